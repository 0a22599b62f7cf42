"""What a server's first clients wait for: kvfn-server with its warm-up (``--kv-warmup``) and
without, and mlx-lm's own path (``--kv-eviction none``), each server a new process meeting the
same requests of lengths it has not seen; from an empty MLX kernel cache (``MLX_PTX_CACHE_DIR``:
a machine where MLX never ran) and from the one an earlier server of the same kind filled.

python examples/benchmark_warmup.py --lengths 600,900 --max-tokens 4          # CPU, SmolLM2
python examples/benchmark_warmup.py --model MODEL --lengths 3000,4700,6100,7900,9800 \
    --flags "--kv-eviction snapkv --kv-budget 256 --kv-max-rows 1024 --prefill-step-size 512"

Servers run one after another: every kind from an empty cache, then every kind again from the
cache its first run filled. Per server: seconds to "listening on" (loading, and the warm-up
where on), the warm-up's own seconds, and each request's time to its first streamed token and to
its last (streamed chat completions, greedy, --max-tokens). ``none`` takes --flags less the
``--kv-*`` ones (the same prefill step).
"""

import argparse
import json
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark_server import COUNTING, prompt, spawn, stream  # noqa: E402

KINDS = ("no-warmup", "warmup", "none")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="kvfn-server's --model (default: the embedded SmolLM2)")
    p.add_argument("--flags", default="--kv-eviction snapkv --kv-budget 128 --kv-max-rows 256 "
                   "--prefill-step-size 128", help="kvfn-server's eviction flags (one flag "
                   "alone: --flags=--kv-budget=64)")  # fmt: skip
    p.add_argument("--lengths", default="600,900,1300", help="prompt tokens a request, about")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--count", action="store_true", help="text completions that go on counting "
                   "to --max-tokens (past a --kv-decode-interval), not chats")  # fmt: skip
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {KINDS}")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    args.kinds = args.kinds.split(",")
    bad = sorted(set(args.kinds) - set(KINDS))
    if bad:
        p.error(f"--kinds: {bad} not of {KINDS}")
    try:
        args.lengths = [int(n) for n in args.lengths.split(",")]
    except ValueError:
        p.error(f"--lengths: {args.lengths!r} is not comma-separated integers")
    if min(args.lengths) < 16:
        p.error(f"--lengths: {min(args.lengths)} tokens is too short a prompt")
    if {"--kv-warmup", "--no-kv-warmup"} & set(shlex.split(args.flags)):
        p.error("--flags: the warm-up flag is this script's (--kinds)")
    return args


def server_flags(kind: str, args) -> list[str]:
    flags = shlex.split(args.flags) + (["--model", args.model] if args.model else [])
    if kind == "none":
        kept, drop = [], False
        for f in flags:  # each --kv-* flag and its value
            if drop and not f.startswith("--"):
                continue
            drop = f.startswith("--kv-")
            if not drop:
                kept.append(f)
        return kept + ["--kv-eviction", "none"]
    return flags + ["--kv-warmup" if kind == "warmup" else "--no-kv-warmup"]


def serve(kind: str, cache: str, tag: str, args) -> dict:
    """One server from start to its last request's last token; then stopped. ``cache``: its
    MLX_PTX_CACHE_DIR (its stderr goes to a log beside it)."""
    log = f"{cache}-{tag}.log"
    tic = time.perf_counter()
    proc = spawn(server_flags(kind, args), log=log, env={"MLX_PTX_CACHE_DIR": cache})
    warm = url = None
    for line in proc.stdout:
        m = re.search(r"warmed up \S+ in ([\d.]+) s \(a (\d+)-token prompt, (\d+) tokens", line)
        warm = (float(m.group(1)), int(m.group(2)), int(m.group(3))) if m else warm
        m = re.search(r"listening on http://[^:]+:(\d+)", line)
        if m:
            url = f"http://127.0.0.1:{m.group(1)}"
            break
    up = time.perf_counter() - tic
    if url is None:
        proc.kill()
        raise SystemExit(f"kvfn-server {' '.join(proc.flags)} did not start: "
                         f"{Path(log).read_text()[-2000:]}")
    try:
        requests = []
        for i, n in enumerate(args.lengths):
            text = prompt(f"{tag}-{i}", n) + (" " + COUNTING if args.count else "")
            sent = time.perf_counter()
            got = stream(url, text, args.max_tokens, chat=not args.count)
            if got["first"] is None:
                raise SystemExit(f"{kind} ({tag}): request {i} streamed no text")
            requests.append(dict(prompt_tokens=got["usage"].get("prompt_tokens"),
                                 completion_tokens=got["usage"].get("completion_tokens"),
                                 first_s=got["first"] - sent,
                                 last_s=got["last"] - sent))  # fmt: skip
    finally:
        proc.kill()
        proc.wait()
    return dict(kind=kind, up_s=up, warm_up_s=warm and warm[0], warm_up_tokens=warm and warm[1],
                warm_up_decoded=warm and warm[2], requests=requests)  # fmt: skip


def table(runs: list) -> str:
    lines = ["| server | kernel cache | up | warm-up (prompt, decoded tokens) | first request: "
             "first token | last token | later requests: first token | prompt tokens | "
             "completion tokens |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in runs:
        first, later = r["requests"][0], r["requests"][1:]
        warm = ""
        if r["warm_up_s"] is not None:
            warm = f"{r['warm_up_s']:.1f} s ({r['warm_up_tokens']}, {r['warm_up_decoded']})"
        rest = "" if not later else (f"{min(q['first_s'] for q in later):.2f}-"
                                     f"{max(q['first_s'] for q in later):.2f} s")  # fmt: skip
        tokens = ",".join(str(q["prompt_tokens"]) for q in r["requests"])
        answers = ",".join(str(q["completion_tokens"]) for q in r["requests"])
        lines.append(f"| {r['kind']} | {r['cache']} | {r['up_s']:.1f} s | {warm} | "
                     f"{first['first_s']:.2f} s | {first['last_s']:.2f} s | {rest} | "
                     f"{tokens} | {answers} |")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> list:
    args = parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory() as root:
        for cache in ("empty", "filled"):
            for kind in args.kinds:
                directory = str(Path(root) / kind)  # the empty run fills what the next one reads
                r = serve(kind, directory, f"{kind}-{cache}", args)
                runs.append(dict(r, cache=cache))
                print(f"{kind} ({cache} cache): up {r['up_s']:.1f} s, first token "
                      f"{[round(q['first_s'], 2) for q in r['requests']]}", flush=True)  # fmt: skip
    print(f"\nflags: {args.flags}; model: {args.model or 'embedded SmolLM2'}; "
          f"{args.max_tokens} tokens a request")
    print(table(runs))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(flags=args.flags, model=args.model,
                                                   runs=runs), indent=1))  # fmt: skip
    return runs


if __name__ == "__main__":
    main()

"""kvfn-server under concurrent load: aggregate decode tokens/s and peak KV bytes held, with
eviction off and on, for 1 / 4 / 16 concurrent long-prompt requests (streamed, greedy).

python examples/benchmark_server.py                                  # 2K-token prompts
python examples/benchmark_server.py --prompt-tokens 384 --max-tokens 24   # a slow CPU

Each mode runs in its own kvfn-server process on a free loopback port. Decode tokens/s is the
completion tokens of a level over the span from its first streamed token to its last; KV bytes
held is the peak of /health's kv_cache.active_bytes during the level (sampled every 50 ms).
"""

import argparse
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prompt-tokens", type=int, default=2048, help="about this many per prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated levels")
    p.add_argument("--kv-eviction", default="snapkv", help="the policy of the 'on' mode")
    p.add_argument("--kv-budget", type=int, default=256)
    p.add_argument("--kv-window", type=int, default=32)
    args = p.parse_args(argv)
    args.levels = [int(x) for x in args.concurrency.split(",")]
    if args.prompt_tokens < 16 or args.max_tokens < 1 or min(args.levels) < 1:
        p.error("--prompt-tokens >= 16, --max-tokens >= 1 and levels >= 1 are required")
    return args


def start(flags: list[str]):
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvfn.server", "--port", "0", "--log-level", "ERROR", *flags],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    match = re.search(r"http://[^:]+:(\d+)", proc.stdout.readline())
    if not match:
        proc.kill()
        raise SystemExit("kvfn-server did not start")
    return proc, f"http://127.0.0.1:{match.group(1)}"


def prompt(tag: str, n_tokens: int) -> str:
    # ~8 tokens per sentence with SmolLM2's tokenizer; the tag makes every prompt distinct up
    # front, so no request reuses another's prompt cache
    sentences = [f"Request {tag}: the log starts here."]
    sentences += [f"Entry {i} reads value {i * 7 % 100}." for i in range(n_tokens // 8)]
    return " ".join(sentences) + " What was the value of entry 3?"


def stream(url: str, text: str, max_tokens: int) -> dict:
    body = {"model": "default_model", "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode())
    first = last = None
    usage = {}
    with urllib.request.urlopen(req, timeout=3600) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk["choices"] and chunk["choices"][0].get("delta", {}).get("content"):
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


def main(argv=None) -> list:
    args = parse_args(argv)
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

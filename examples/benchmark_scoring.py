"""Window scoring for one layer: kvfn.kernels.window against the stock ops.

For one layer of an 8B llama (B=1, 32 query / 8 KV heads, D=128, bf16) and capacities 8K-128K:
``sum``, SnapKV's window (32 queries, ``kvfn.scores.window_attention_scores``), and ``max``,
one step of KVzip's reconstruction (64 queries, ``window_attention_max``), each with the CUDA
kernels and with the stock ops (cast, mask, softmax, sum or max), interleaved in one process:
the time a call of ``--calls`` queued before one mx.eval (as a prefill queues its layers), the
peak memory of one call above its operands, and the largest difference between the two. Off
CUDA both columns are the stock ops.

    python examples/benchmark_scoring.py [--iters 20] [--calls 32] [--capacities 8192 32768]
"""

import argparse
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvfn  # isort: skip  (puts OpenBLAS in front before mlx loads)
import mlx.core as mx  # noqa: E402

from examples.benchmark_decode import measured  # noqa: E402
from kvfn.kernels import window as window_kernel  # noqa: E402
from kvfn.scores import window_attention_max, window_attention_scores  # noqa: E402

HEADS, KV_HEADS, DIM = 32, 8, 128
OPS = {"sum": (window_attention_scores, 32), "max": (window_attention_max, 64)}


def operands(capacity, queries, dtype=mx.bfloat16):
    keys = mx.random.normal((1, KV_HEADS, capacity, DIM)).astype(dtype)
    positions = mx.broadcast_to(mx.arange(capacity, dtype=mx.int32), (1, KV_HEADS, capacity))
    state = kvfn.PositionPreservingKVCache(keys=keys, values=keys, positions=positions,
                                           offset=mx.array([capacity]), rows=mx.array(capacity),
                                           dense=True, packed=True)  # fmt: skip
    q = mx.random.normal((1, HEADS, queries, DIM)).astype(dtype)
    qpos = mx.arange(capacity - queries, capacity, dtype=mx.int32)[None]
    mx.eval(keys, q, qpos)
    return q, qpos, state


def scores(fn, q, qpos, state, kernels: bool, calls: int = 1):
    """The sum of ``calls`` scorings (each its own launches, queued before one mx.eval)."""
    with nullcontext() if kernels else window_kernel.disabled():
        out = sum(fn(q * (1 + i / 64), qpos, state, DIM**-0.5) for i in range(calls))
        mx.eval(out)
        return out


def measure(op, capacity, iters, calls):
    fn, queries = OPS[op]
    q, qpos, state = operands(capacity, queries)
    results = {name: scores(fn, q, qpos, state, name == "kernels") for name in ("kernels", "stock")}
    diff = mx.max(mx.abs(results["kernels"] - results["stock"])).item()
    times = {"kernels": [], "stock": []}
    peaks = {"kernels": [], "stock": []}
    for _ in range(iters):
        for name in times:
            base = mx.get_active_memory()
            peak = measured(lambda: scores(fn, q, qpos, state, name == "kernels"))[2]
            peaks[name].append(peak - base)
            t = time.perf_counter()
            scores(fn, q, qpos, state, name == "kernels", calls)
            times[name].append((time.perf_counter() - t) / calls)
    row = dict(op=op, queries=queries, capacity=capacity, max_abs_diff=diff)
    for name in times:
        row[f"{name}_ms"] = 1e3 * statistics.median(times[name])
        row[f"{name}_mb"] = max(peaks[name]) / 1e6
    return row


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=20, help="interleaved rounds (median)")
    p.add_argument("--calls", type=int, default=32, help="scorings queued a round (a layer each)")
    p.add_argument("--capacities", type=int, nargs="+", default=[8192, 32768, 131072])
    p.add_argument("--ops", nargs="+", choices=sorted(OPS), default=["sum", "max"])
    args = p.parse_args(argv)
    if min(args.iters, args.calls) < 1 or min(args.capacities) < 64:
        p.error(f"--iters and --calls must be >= 1 and --capacities >= 64; got "
                f"{args.iters}, {args.calls}, {args.capacities}")  # fmt: skip
    print(f"{mx.default_device()}, kernels apply: "
          f"{window_kernel.applies(mx.zeros((1,), mx.bfloat16))}")  # fmt: skip
    print(
        "| op (queries) | capacity | kernels ms / MB | stock ops ms / MB | time ratio | memory ratio | max |diff| |"
    )
    print("|---|---|---|---|---|---|---|")
    rows = []
    for op in args.ops:
        for capacity in args.capacities:
            r = measure(op, capacity, args.iters, args.calls)
            rows.append(r)
            print(f"| {op} ({r['queries']}) | {capacity} | "
                  f"{r['kernels_ms']:.3f} / {r['kernels_mb']:.0f} | "
                  f"{r['stock_ms']:.3f} / {r['stock_mb']:.0f} | "
                  f"{r['kernels_ms'] / r['stock_ms']:.2f} | "
                  f"{r['kernels_mb'] / max(r['stock_mb'], 1e-9):.2f} | {r['max_abs_diff']:.2e} |")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()

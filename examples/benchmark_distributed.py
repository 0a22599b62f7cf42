"""Per-rank KV bytes and decode speed of a tensor-parallel model, full cache vs compacted.

    python examples/benchmark_distributed.py --shape tiny --length 2048 --budget 256
    mlx.launch --backend ring -n 2 .venv/bin/python examples/benchmark_distributed.py --shape tiny
    mlx.launch --backend nccl -n 2 python examples/benchmark_distributed.py --shape 8b \\
        --dtype bfloat16 --length 32768 --budget 2048                                 # 2 GPUs

A random-weight llama of benchmark_decode's shapes, built from one seed on every rank and
sharded with ``kvfn.distributed.shard``. Per case (the full prompt cache, then SnapKV per head
and per layer): the KV bytes this rank holds, the compiled decode's median ms per step
(``FunctionalModel.decode``, greedy) and tokens/s, and for compaction the eviction's ms
(``compact_states`` after the scored prefill). ``scores`` times what a rank exchanges for a
layer-shared policy, over all layers: the all-gather of its heads' window scores that kvfn
does, beside an all-sum of one row per key (what a policy-specific reduction would send).
Rank 0 prints one JSON object.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvfn  # isort: skip  (puts OpenBLAS in front before mlx loads)
import mlx.core as mx  # noqa: E402

from examples.benchmark_decode import SHAPES, VOCAB, random_model  # noqa: E402
from kvfn.eviction import stored_bytes  # noqa: E402


def timed(fn, repeat: int = 1) -> float:
    """Median seconds of ``fn()``, which evaluates what it computes."""
    times = []
    for _ in range(repeat):
        mx.synchronize()
        t = time.perf_counter()
        fn()
        mx.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def decode_ms(fm, states, token: int, steps: int, warmup: int = 3) -> float:
    tok, times = mx.array([[token]]), []
    for i in range(warmup + steps):
        t = time.perf_counter()
        logits, states = fm.decode(tok, states)
        tok = mx.argmax(logits, axis=-1, keepdims=True)
        mx.eval(tok, kvfn.cache.arrays(states))
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times[warmup:])


def kv_bytes(states) -> int:
    return sum(stored_bytes(s, s.max_rows) for s in states)


def full_case(fm, prompt, steps: int, chunk: int) -> dict:
    context = mx.array([prompt[:-1]])
    states = kvfn.prefill(fm, context, capacity=len(prompt) + steps + 8, prefill_step_size=chunk)
    mx.eval(kvfn.cache.arrays(states))
    ms = decode_ms(fm, states, prompt[-1], steps)
    return {"kv_bytes": kv_bytes(states), "decode_ms": ms, "tokens_per_s": 1e3 / ms}


def compacted_case(fm, prompt, policy, steps: int, chunk: int) -> dict:
    context = mx.array([prompt[:-1]])
    window = policy.observation_window(context.shape[1])
    states, scores = kvfn.scored_prefill(fm, context, window=window, prefill_step_size=chunk)
    mx.eval(kvfn.cache.arrays(states), scores)
    evict = lambda: kvfn.compact_states(states, scores, policy, reserve=steps + 8, group=fm.group)
    evict()  # trace
    seconds = timed(lambda: mx.eval(kvfn.cache.arrays(evict()[0])), repeat=3)
    kept, _ = evict()
    ms = decode_ms(fm, kept, prompt[-1], steps)
    return {"kv_bytes": kv_bytes(kept), "evict_ms": 1e3 * seconds, "decode_ms": ms,
            "tokens_per_s": 1e3 / ms}  # fmt: skip


def scores_exchange(fm, P: int) -> dict:
    """ms over all layers: kvfn's all-gather of (1, heads, P) float32 scores vs an all-sum of
    (1, 1, P); and the bytes a rank sends per layer for each."""
    group, heads = fm.group, fm.n_heads[0]
    local = [mx.random.uniform(shape=(1, heads, P)) for _ in fm.n_heads]
    rows = [mx.random.uniform(shape=(1, 1, P)) for _ in fm.n_heads]
    mx.eval(local, rows)
    gather = lambda: mx.eval([kvfn.distributed.gather_heads(s, group) for s in local])
    reduce = lambda: mx.eval([mx.distributed.all_sum(r, group=group) for r in rows])
    gather(), reduce()
    return {
        "all_gather_ms": 1e3 * timed(gather, 5),
        "all_sum_ms": 1e3 * timed(reduce, 5),
        "all_gather_bytes_per_layer": 4 * heads * P,
        "all_sum_bytes_per_layer": 4 * P,
        "layers": len(fm.n_heads),
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--length", type=int, default=2048, help="prompt tokens")
    p.add_argument("--budget", type=int, default=256, help="rows kept per layer and head")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed (median)")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk size")
    args = p.parse_args(argv)
    group = mx.distributed.init()
    mx.random.seed(0)  # the same weights on every rank before sharding
    model = random_model(args.shape, False, getattr(mx, args.dtype))
    heads_sharded = kvfn.distributed.shard(model, group)
    mx.eval(model.parameters())
    fm = kvfn.FunctionalModel(model)
    prompt = mx.random.randint(0, VOCAB, (args.length,), key=mx.random.key(1)).tolist()
    report = {"ranks": group.size(), "heads_sharded": heads_sharded, "shape": args.shape,
              "dtype": args.dtype, "length": args.length, "budget": args.budget,
              "device": str(mx.default_device())}  # fmt: skip
    report["full"] = full_case(fm, prompt, args.steps, args.chunk)
    for name in ("snapkv", "snapkv-layer"):
        policy = kvfn.parse_policy(name, budget=args.budget)
        report[name] = compacted_case(fm, prompt, policy, args.steps, args.chunk)
    if fm.group is not None:
        report["scores"] = scores_exchange(fm, args.length - 1)
    if group.rank() == 0:
        print(json.dumps(report, indent=1), flush=True)
    return report


if __name__ == "__main__":
    main()

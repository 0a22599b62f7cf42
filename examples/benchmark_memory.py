"""Bounded memory: a long prompt and a generation through mlx-lm's full cache, mlx-lm's rotating
cache (``RotatingKVCache(max_size=R, keep=4)``, what ``--max-kv-size`` gives where a model
has no ``make_cache`` of its own, evicting as it prefills), kvfn's SnapKV
after the prefill and kvfn's SnapKV evicting while it prefills (``kvfn.compact(max_rows=R)``),
in one process, on a random-weight model: first-token time, decode tokens/s, the peak memory
above the weights and the KV bytes held after.

python examples/benchmark_memory.py                                        # tiny shape, CPU
python examples/benchmark_memory.py --shape 8b --prompt-tokens 131072 --dtype bfloat16 --bits 4

``--ballast-gb G`` holds G GB of the device's memory before the first config, so that the
device itself has too little left for a config (mlx-lm's full cache at a long prompt) and its
allocation fails; a config that fails is reported with its error and the next one runs.
On request: ``kvfn duo``, ``kvfn duo bounded`` and ``kvfn snapkv bounded per-layer`` (the same
rows as ``kvfn snapkv bounded``, each layer's selected on its own: what one selection for every
layer costs or saves in memory and time).
"""

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvfn  # isort: skip  (puts OpenBLAS in front before mlx loads)
import mlx.core as mx  # noqa: E402
from benchmark_shapes import SHAPES, greedy, make_policy, random_model  # noqa: E402
from kvfn_eval.memory import baseline  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache  # noqa: E402

CONFIGS = ("mlx-lm full", "mlx-lm rotating", "kvfn snapkv", "kvfn snapkv bounded")
# DuoAttention (half the KV heads of each layer retrieval heads, the others sinks + recent in
# `rows`): after the prefill, and evicting while it prefills (its chunked prefill); on request
DUO = ("kvfn duo", "kvfn duo bounded")
# SnapKV evicting while prefilling with each layer's rows selected on its own (as before one
# selection served every layer, 597d48f): the batched selection's cost in memory, on request
PER_LAYER = ("kvfn snapkv bounded per-layer",)


class PerLayerSnapKV(kvfn.SnapKV):
    """SnapKV whose compaction selects each layer's rows on its own (``Policy.compact_layers``'
    default), not all layers' in one batch: the same rows, another graph."""

    same_in_every_layer = False


def mlx_lm_run(model, ids, args, rotating: bool) -> dict:
    # made directly: make_prompt_cache ignores max_kv_size for a model with make_cache (llama)
    if rotating:
        cache = [RotatingKVCache(max_size=args.rows, keep=4) for _ in model.layers]
    else:
        cache = make_prompt_cache(model)
    tic = time.perf_counter()
    steps = generate_step(mx.array(ids), model, prompt_cache=cache, max_tokens=args.new_tokens,
                          prefill_step_size=args.prefill_step_size)  # fmt: skip
    next(steps)
    first = time.perf_counter()
    for _ in steps:
        pass
    done = time.perf_counter()
    held = sum(c.nbytes for c in cache)
    return {"first_s": first - tic, "decode_tps": (args.new_tokens - 1) / (done - first),
            "kv_held_gb": held / 1e9}  # fmt: skip


def kvfn_run(model, ids, args, policy_of: Callable, bounded: bool,
             max_rows: Optional[int] = None) -> dict:  # fmt: skip
    """``policy_of(fm)``'s compaction (``bounded``: capped at ``max_rows``, default the budget,
    while prefilling) and greedy decode."""
    fm = kvfn.FunctionalModel(model)
    policy = policy_of(fm)
    tic = time.perf_counter()
    cap = (max_rows or args.rows) if bounded else None
    states, result = kvfn.compact(fm, ids, policy, max_new_tokens=args.new_tokens,
                                  prefill_step_size=args.prefill_step_size,
                                  max_rows=cap)  # fmt: skip
    first, done, states = greedy(fm, ids[-1], states, args.new_tokens)
    held = sum(a.nbytes for a in kvfn.tree.arrays(states))
    return {"first_s": first - tic, "decode_tps": (args.new_tokens - 1) / (done - first),
            "kv_held_gb": held / 1e9, "peak_rows": result.peak_rows}  # fmt: skip


def above_weights(measure) -> dict:
    """``measure()``'s results and ``peak_above_weights_gb``: the peak memory it reached above
    what was held before it (the weights, and anything made for it beforehand)."""
    base = baseline()
    out = measure()
    out["peak_above_weights_gb"] = (mx.get_peak_memory() - base) / 1e9
    return out


def run(config: str, model, ids, args) -> dict:
    try:
        return measured(config, model, ids, args, max_rows=args.max_rows)
    except Exception as e:  # an allocation the device cannot make (under --ballast-gb)
        mx.clear_cache()
        return {"error": f"{type(e).__name__}: {e}"}


def measured(config: str, model, ids, args, max_rows: Optional[int] = None) -> dict:
    """``config``'s run, its peak above the weights; ``max_rows``: kvfn's cap while prefilling
    (default: the budget, ``--rows``)."""
    if config.startswith("mlx-lm"):
        return above_weights(
            lambda: mlx_lm_run(model, ids, args, rotating=config.endswith("rotating"))
        )
    if "duo" in config:
        policy_of = partial(make_policy, "duo", budget=args.rows, window=args.window)
    else:
        kind = PerLayerSnapKV if config in PER_LAYER else kvfn.SnapKV
        policy_of = lambda fm: kind(budget=args.rows, window=args.window)  # noqa: E731
    return above_weights(lambda: kvfn_run(model, ids, args, policy_of, "bounded" in config,
                                          max_rows=max_rows))  # fmt: skip


def model_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The model's shape, dtype and quantization, and the prompt's tokens."""
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--bits", type=int, choices=[4, 8], help="quantize the weights")
    p.add_argument("--prompt-tokens", type=int, default=8192)
    return p


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    model_arguments(p)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rows", type=int, default=256, help="kept rows: budget, cap, max_kv_size")
    p.add_argument("--max-rows", type=int,
                   help="kvfn's cap while prefilling (default: --rows); above it, the bounded "
                   "configs compact back to --max-rows after each chunk that leaves more, and "
                   "to --rows at the prompt's end")  # fmt: skip
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--prefill-step-size", type=int, default=512)
    p.add_argument("--rounds", type=int, default=2, help="the first is a warm-up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, run in order")
    p.add_argument("--ballast-gb", type=float, default=0.0,
                   help="device memory held before the first config")  # fmt: skip
    args = p.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS + DUO + PER_LAYER]
    if unknown or not configs:
        p.error(f"--configs: unknown {unknown or configs}; choose from "
                f"{list(CONFIGS + DUO + PER_LAYER)}")
    if args.rows < args.window + 4 or args.prompt_tokens <= args.rows or args.rounds < 2:
        p.error("need rows >= window + 4, prompt tokens > rows and at least 2 rounds")
    if args.max_rows is not None and args.max_rows < args.rows:
        p.error(f"--max-rows {args.max_rows} is below --rows {args.rows}")
    model = random_model(args.shape, getattr(mx, args.dtype), args.bits)
    vocab = SHAPES[args.shape][1]["vocab_size"]
    ids = np.random.default_rng(args.seed).integers(0, vocab, size=args.prompt_tokens).tolist()
    # every round its own prompt length (a user's prompts all differ): the first a warm-up
    lengths = [args.prompt_tokens - 37 * r for r in range(args.rounds)]
    ballast = mx.zeros((int(args.ballast_gb * 1e9) // 2**22, 2**20), mx.float32)  # 4 MB a row
    mx.eval(ballast)
    rows = {c: [] for c in configs}
    for r, n in enumerate(lengths):
        for c in configs:
            got = run(c, model, ids[:n], args)
            print(json.dumps({"round": r, "tokens": n, "config": c, **got}), flush=True)
            if r:
                rows[c].append(got)
    out = []
    print(f"\n{args.shape} {args.dtype}{f' {args.bits}-bit' if args.bits else ''}, "
          f"prompts of {lengths[1:]} tokens (each new; {lengths[0]} warmed up), "
          f"{args.new_tokens} new tokens, {args.rows} rows"
          f"{f' (kvfn: a cap of {args.max_rows})' if args.max_rows else ''}, "
          f"prefill chunks of {args.prefill_step_size}; mean of {args.rounds - 1} rounds"
          f"{f'; {args.ballast_gb} GB of the device held' if args.ballast_gb else ''}")  # fmt: skip
    w = max(22, *(len(c) + 1 for c in configs))
    print(f"{'config':<{w}}{'first token s':>14}{'decode tok/s':>13}{'peak above weights GB':>23}"
          f"{'KV held after GB':>18}{'peak rows':>10}")  # fmt: skip
    for c in configs:
        failed = [x["error"] for x in rows[c] if "error" in x]
        if failed:
            out.append({"config": c, "error": failed[0]})
            print(f"{c:<{w}}failed: {failed[0][:120]}")
            continue
        mean = {k: float(np.mean([x[k] for x in rows[c]])) for k in rows[c][0] if k != "peak_rows"}
        peak = rows[c][0].get("peak_rows")
        out.append({"config": c, **{k: round(v, 4) for k, v in mean.items()}, "peak_rows": peak})
        print(f"{c:<{w}}{mean['first_s']:>14.3f}{mean['decode_tps']:>13.1f}"
              f"{mean['peak_above_weights_gb']:>23.4f}{mean['kv_held_gb']:>18.4f}"
              f"{'-' if peak is None else peak:>10}")  # fmt: skip
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()

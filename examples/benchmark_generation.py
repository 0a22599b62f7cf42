"""Bounded memory while generating: a short prompt and a long generation through mlx-lm's full
cache, mlx-lm's rotating cache (``RotatingKVCache(max_size=R, keep=4)``), kvfn's own loop
evicting every ``interval`` tokens (``kvfn.bounded_decode``) and mlx-lm's ``generate_step``
over kvfn caches that evict the same way (``kvfn.to_mlx_cache(states, policy=...)``, the model
as ``attending_copy``), in one process, on a random-weight model: decode tokens/s, the most rows
a layer held, the peak memory above the weights and the KV bytes held after. kvfn's cap is
budget + interval = R rows (SnapKV, budget R - interval).

python examples/benchmark_generation.py                                     # tiny shape, CPU
python examples/benchmark_generation.py --shape qwen05 --dtype bfloat16 --new-tokens 8192 --rows 1024
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvfn  # isort: skip  (puts OpenBLAS in front before mlx loads)
import mlx.core as mx  # noqa: E402
from benchmark_memory import above_weights  # noqa: E402
from benchmark_shapes import SHAPES, random_model  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache  # noqa: E402

from kvfn.wrapper import attending_copy  # noqa: E402

CONFIGS = ("mlx-lm full", "mlx-lm rotating", "kvfn bounded_decode", "mlx-lm over kvfn evicting")


def mlx_lm_run(model, ids, caches, args) -> dict:
    """Decode through mlx-lm's ``generate_step`` from ``caches`` holding all but ``ids[-1]``."""
    rows, tic = 0, time.perf_counter()
    for i, _ in enumerate(generate_step(mx.array(ids[-1:]), model, prompt_cache=caches,
                                        max_tokens=args.new_tokens)):  # fmt: skip
        if i == 0:
            first = time.perf_counter()
        rows = max(rows, caches[0].size())  # a count on the host: no sync
    done = time.perf_counter()
    return {"decode_tps": (args.new_tokens - 1) / (done - first), "most_rows": rows,
            "kv_held_gb": sum(c.nbytes for c in caches) / 1e9}  # fmt: skip


def prefilled(model, ids, cache):
    model(mx.array([ids[:-1]]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def bounded_run(fm, ids, states, policy, args) -> dict:
    gen = kvfn.bounded_decode(fm, mx.array([[ids[-1]]]), states, policy, steps=args.new_tokens,
                              interval=args.interval)  # fmt: skip
    next(gen).item()
    first = time.perf_counter()
    try:
        while True:
            last = next(gen)
    except StopIteration as end:
        last.item()
        done, states = time.perf_counter(), end.value
    held = sum(a.nbytes for a in kvfn.tree.arrays(states))
    return {"decode_tps": (args.new_tokens - 1) / (done - first), "most_rows": args.rows,
            "kv_held_gb": held / 1e9}  # fmt: skip


def run(config: str, model, ids, args) -> dict:
    """One config's decode; its peak above what was held before it (the weights and, for kvfn,
    the compacted prompt; mlx-lm's caches prefill the prompt inside it)."""
    fm = kvfn.FunctionalModel(model)
    policy = kvfn.SnapKV(budget=args.rows - args.interval, window=args.window)
    if config == "mlx-lm full":
        return above_weights(lambda: mlx_lm_run(
            model, ids, prefilled(model, ids, make_prompt_cache(model)), args))  # fmt: skip
    if config == "mlx-lm rotating":
        cache = [RotatingKVCache(max_size=args.rows, keep=4) for _ in model.layers]
        return above_weights(lambda: mlx_lm_run(model, ids, prefilled(model, ids, cache), args))
    states, _ = kvfn.compact(fm, ids, policy, max_new_tokens=1)
    if config == "kvfn bounded_decode":
        return above_weights(lambda: bounded_run(fm, ids, states, policy, args))
    caches = kvfn.to_mlx_cache(states, policy=policy, interval=args.interval)
    return above_weights(lambda: mlx_lm_run(attending_copy(model), ids, caches, args))


def check_cap(p: argparse.ArgumentParser, args, known: tuple = CONFIGS) -> list:
    """The ``known`` configs asked for, and a cap whose budget holds the sinks and the window;
    else ``p.error`` naming what is wrong."""
    configs = args.configs.split(",")
    if any(c not in known for c in configs):
        p.error(f"--configs: each one of {', '.join(known)}, got {args.configs}")
    if not args.window < args.interval < args.rows - args.window - 4:
        p.error("need window < interval < rows - window - 4 (a budget of at least window + 4)")
    return configs


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=2048)
    p.add_argument("--rows", type=int, default=256, help="the cap: max_size, budget + interval")
    p.add_argument("--interval", type=int, default=128, help="kvfn's: tokens between compactions")
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    configs = check_cap(p, args)
    if not 2 <= args.prompt_tokens <= args.rows - args.interval or args.new_tokens <= args.rows:
        p.error("need 2 <= prompt tokens <= the budget (rows - interval), new tokens > rows")
    model = random_model(args.shape, getattr(mx, args.dtype))
    vocab = SHAPES[args.shape][1]["vocab_size"]
    ids = np.random.default_rng(args.seed).integers(0, vocab, size=args.prompt_tokens).tolist()
    warm = argparse.Namespace(**{**vars(args), "new_tokens": args.rows + 8})
    for c in configs:  # a compaction and its scored steps each: their kernels and traces built
        run(c, model, ids, warm)
    out = []
    for c in configs:
        got = run(c, model, ids, args)
        print(json.dumps({"config": c, **got}), flush=True)
        out.append({"config": c, **got})
    print(f"\n{args.shape} {args.dtype}, a {args.prompt_tokens}-token prompt, {args.new_tokens} "
          f"new tokens, {args.rows} rows (kvfn: budget {args.rows - args.interval} + interval "
          f"{args.interval})")  # fmt: skip
    print(f"{'config':<28}{'decode tok/s':>13}{'most rows':>10}{'peak above weights GB':>23}"
          f"{'KV held after GB':>18}")  # fmt: skip
    for r in out:
        print(f"{r['config']:<28}{r['decode_tps']:>13.1f}{r['most_rows']:>10}"
              f"{r['peak_above_weights_gb']:>23.4f}{r['kv_held_gb']:>18.4f}")  # fmt: skip
    return out


if __name__ == "__main__":
    main()

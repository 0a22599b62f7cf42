"""Where a prompt length not seen before costs more than a repeated one: each phase of
``kvfn.compact`` and each op of a policy's selection, timed (evaluated) at a new length and then
again at the same length, in one process, on a random-weight model. On MLX's CUDA backend a new
length cost SnapKV's and KVzip's compaction 3-5x a repeated one (docs/benchmarks.md); on the CPU
nothing does, so the rows here are for the GPU.

python examples/profile_new_length.py                                    # tiny shape, CPU
python examples/profile_new_length.py --shape qwen05 --dtype bfloat16 --lengths 3000 3301 3607
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvfn  # isort: skip  (puts OpenBLAS in front before mlx loads)
import mlx.core as mx  # noqa: E402

from examples.benchmark_shapes import SHAPES, random_model  # noqa: E402
from kvfn.policies.snapkv import pool1d  # noqa: E402


def leaves(out) -> list:
    if isinstance(out, mx.array):
        return [out]
    if isinstance(out, (tuple, list)):
        return [a for o in out for a in leaves(o)]
    return kvfn.tree.arrays([out])  # a state


def timed(fn) -> tuple:
    tic = time.perf_counter()
    out = fn()
    mx.eval(leaves(out))
    return out, time.perf_counter() - tic


def phases(fm, ids, args):
    """Each phase and op of one prompt, in order: ``(name, function)``, each op's parts before
    it, so the first op whose new length costs more than its repeat is where the cost is."""
    context = mx.array([ids[:-1]])
    P = context.shape[1]
    snapkv = kvfn.SnapKV(budget=args.budget, window=args.window)
    chunkkv = kvfn.ChunkKV(budget=args.budget, window=args.window)
    yield "prefill", lambda: kvfn.prefill(fm, context)
    states, scores = yield "scored_prefill", lambda: kvfn.scored_prefill(fm, context,
                                                                         window=args.window)  # fmt: skip
    s0, keys = scores[0][..., :P], states[0].keys  # the prompt's rows of its bucket
    H = keys.shape[1]
    kv_scores = yield "group mean (B, H, P)", lambda: mx.mean(s0.reshape(1, H, -1, P), axis=2)
    yield "pool1d max k7 (B, H, P)", lambda: pool1d(kv_scores, 7, "max")
    kth = args.budget - 1
    yield "argpartition (B, H, P)", lambda: mx.argpartition(-kv_scores, kth=kth, axis=-1)
    yield "argpartition (B, 1, P)", lambda: mx.argpartition(-kv_scores[:, :1], kth=kth, axis=-1)
    keep = yield "snapkv keep_indices (a layer)", lambda: snapkv.keep_indices(
        s0, prompt_length=P, n_kv_heads=H
    )
    yield "sort (B, H, budget)", lambda: mx.sort(keep[..., ::-1], axis=-1)
    yield "take_along_axis keys (a layer)", lambda: mx.take_along_axis(
        keys, keep[..., None], axis=2
    )
    yield "chunkkv keep_indices (a layer)", lambda: chunkkv.keep_indices(s0, prompt_length=P,
                                                                         n_kv_heads=H)  # fmt: skip
    yield "chunkkv compact_states", lambda: kvfn.compact_states(states, scores, chunkkv,
                                                                reserve=13)[0]  # fmt: skip
    yield "snapkv compact_states", lambda: kvfn.compact_states(states, scores, snapkv,
                                                               reserve=13)[0]  # fmt: skip


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--lengths", type=int, nargs="+", default=[300, 331, 367])
    p.add_argument("--budget", type=int, default=64)
    p.add_argument("--window", type=int, default=32)
    args = p.parse_args(argv)
    if min(args.lengths) <= args.budget + args.window or len(set(args.lengths)) < 2:
        p.error("need two or more distinct lengths, each past budget + window")
    model = random_model(args.shape, getattr(mx, args.dtype))
    fm = kvfn.FunctionalModel(model)
    vocab = SHAPES[args.shape][1]["vocab_size"]
    rng = np.random.default_rng(0)
    rows = []
    names = []
    for n in args.lengths:  # the first warms up what no length has
        steps, got = phases(fm, rng.integers(0, vocab, size=n).tolist(), args), None
        while True:
            try:
                name, fn = steps.send(got)
            except StopIteration:
                break
            got, new = timed(fn)
            _, repeat = timed(fn)
            names += [name] if name not in names else []
            rows.append(
                {"length": n, "phase": name, "new_ms": new * 1e3, "repeat_ms": repeat * 1e3}
            )
            print(json.dumps(rows[-1]), flush=True)
    print(
        f"\n{args.shape} {args.dtype}, lengths {args.lengths[1:]} (each new; "
        f"{args.lengths[0]} warmed up), budget {args.budget}, window {args.window}; ms"
    )
    print(f"{'phase':<34}{'new':>10}{'repeated':>10}{'new/rep':>9}")
    out = []
    for name in names:
        got = [r for r in rows if r["phase"] == name and r["length"] != args.lengths[0]]
        new, rep = np.median([r["new_ms"] for r in got]), np.median([r["repeat_ms"] for r in got])
        out.append({"phase": name, "new_ms": round(new, 3), "repeat_ms": round(rep, 3)})
        print(f"{name:<34}{new:>10.2f}{rep:>10.2f}{new / rep:>9.2f}")
    return out


if __name__ == "__main__":
    main()

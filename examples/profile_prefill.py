"""Where a chunked prefill's peak memory comes from: each chunk's time and peak, side by side.

    python examples/profile_prefill.py --shape 8b --length 8192 --chunk 2048 --rounds 4  # GPU
    python examples/profile_prefill.py --shape tiny --length 1024 --chunk 256             # CPU

Rows, in interleaved rounds (round 0 is the cold one):
mlx-lm   its chunked prefill into a KVCache (which grows by concatenation)
kvfn     kvfn's eager prefill into states made at full size, written in place
grown    kvfn's prefill into states grown chunk by chunk (``with_room``), as mlx-lm's cache
scored   kvfn's prefill scoring the last ``--window`` queries (SnapKV's, ``scored_forward``)

Per chunk: ms, peak GB above what was active before the chunk, active GB after it. On a GPU
a buffer is freed when its kernel completes, so a peak grows with how far the host has run
ahead of the GPU.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvfn  # isort: skip  (puts OpenBLAS in front before mlx loads)
import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from examples.benchmark_decode import SHAPES, VOCAB, random_model  # noqa: E402
from kvfn.compact import with_room  # noqa: E402

ROWS = ("mlx-lm", "kvfn", "grown", "scored")


def mlx_chunks(model, fm, tokens, chunk, window):
    cache = make_prompt_cache(model)
    for i in range(0, tokens.shape[1], chunk):
        model(tokens[:, i : i + chunk], cache=cache)
        yield [c.state for c in cache]


def kvfn_chunks(model, fm, tokens, chunk, window, grown=False, scored=False):
    L = tokens.shape[1]
    states = fm.init_states(1, chunk if grown else L)
    scores = tuple(mx.zeros((1, h, L), mx.float32) for h in fm.n_heads) if scored else ()
    for i in range(0, L, chunk):
        stop = min(i + chunk, L)
        if grown and i:
            states = tuple(with_room(s, stop - i) for s in states)
        first = max(L - window, i)
        if scored and first < stop:
            q = kvfn.QuerySlice(first - i, stop - i)
            states, scores = fm.scored_forward(tokens[:, i:stop], states, scores, q)[1:]
        else:
            states = fm.forward(tokens[:, i:stop], states)[1]
        yield [kvfn.tree.arrays(states), scores]


def profile(run) -> list:
    """[(ms, peak GB above the active memory before the chunk, active GB after)] a chunk."""
    mx.synchronize()
    mx.clear_cache()
    base, out = mx.get_active_memory(), []
    chunks = iter(run())
    while True:
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        t = time.perf_counter()
        arrays = next(chunks, None)
        if arrays is None:
            return out
        mx.eval(arrays)
        del arrays
        mx.synchronize()
        out.append((1e3 * (time.perf_counter() - t), (mx.get_peak_memory() - before) / 1e9,
                    (mx.get_active_memory() - base) / 1e9))  # fmt: skip


def peak_gb(chunks: list) -> float:
    """The prefill's peak above what was active before it."""
    return max(p + (chunks[j - 1][2] if j else 0.0) for j, (_, p, _) in enumerate(chunks))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    for name in ("length", "chunk", "window", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"argument --{name}: must be >= 1, got {getattr(args, name)}")
    if args.window > args.length:
        p.error(f"argument --window: must be <= --length ({args.length}), got {args.window}")
    gpu = mx.default_device() == mx.gpu
    model = random_model(args.shape, False, mx.bfloat16 if gpu else mx.float32)
    fm = kvfn.FunctionalModel(model)
    tokens = mx.random.randint(0, VOCAB, (1, args.length), key=mx.random.key(args.length))
    runs = {
        "mlx-lm": mlx_chunks,
        "kvfn": kvfn_chunks,
        "grown": lambda *a: kvfn_chunks(*a, grown=True),
        "scored": lambda *a: kvfn_chunks(*a, scored=True),
    }
    result = {name: [] for name in ROWS}
    print(f"{args.shape}, L={args.length}, chunk={args.chunk}: per chunk ms / peak GB above the "
          "active memory before it / active GB after it")  # fmt: skip
    for r in range(args.rounds):
        for name in ROWS:
            chunks = profile(lambda: runs[name](model, fm, tokens, args.chunk, args.window))
            result[name].append(chunks)
            print(f"round {r} {name:7s} {sum(c[0] for c in chunks):8.1f} ms  peak "
                  f"{peak_gb(chunks):6.2f} GB | "
                  + "  ".join(f"{t:.0f}/{p:.2f}/{a:.2f}" for t, p, a in chunks))  # fmt: skip
    return result


if __name__ == "__main__":
    main()

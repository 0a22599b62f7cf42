"""Where a chunked prefill's peak memory comes from: each chunk's time and peak, side by side.

    python examples/profile_prefill.py --shape 8b --length 8192 --chunk 2048 --rounds 4  # GPU
    python examples/profile_prefill.py --shape tiny --length 1024 --chunk 256             # CPU

Rows, in interleaved rounds (round 0 is the cold one):
mlx-lm   its chunked prefill into a KVCache (which grows by concatenation)
kvfn     kvfn's ``prefill``: states made at full size, written in place
grown    kvfn's prefill of one chunk after another (``prefill(states=...)`` gives room for the
         chunk alone), so its states grow as mlx-lm's cache does
scored   kvfn's ``scored_prefill`` of the last ``--window`` queries (SnapKV's)

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

from examples.benchmark_decode import (  # noqa: E402
    SHAPES,
    VOCAB,
    check_at_least,
    cleared,
    mlx_prefill,
    random_model,
)

ROWS = ("mlx-lm", "kvfn", "grown", "scored")


class Chunks:
    """A prefill's ``progress`` callback that records, for each chunk evaluated, (ms, peak GB
    above the memory active before the chunk, active GB after it, above the start)."""

    def __init__(self):
        cleared()  # garbage freed during the prefill would lower the active memory read
        self.base, self.rows = mx.get_active_memory(), []
        self._start()

    def _start(self):
        self.before = mx.get_active_memory()
        mx.reset_peak_memory()
        self.t = time.perf_counter()

    def __call__(self, done: int, n: int) -> None:
        if done < n:  # kvfn leaves its last chunk lazy: ``last`` records it once evaluated
            self.record()

    def record(self) -> None:
        mx.synchronize()
        self.rows.append((1e3 * (time.perf_counter() - self.t),
                          (mx.get_peak_memory() - self.before) / 1e9,
                          (mx.get_active_memory() - self.base) / 1e9))  # fmt: skip
        self._start()

    def last(self, arrays) -> list:
        mx.eval(arrays)
        self.record()
        return self.rows


def profile(name, model, fm, tokens, chunk, window) -> list:
    """One prefill of ``tokens`` (1, L) by the row ``name``: its ``Chunks`` rows."""
    rec, L = Chunks(), tokens.shape[1]
    if name == "mlx-lm":
        cache = mlx_prefill(model, tokens[0].tolist(), chunk, progress=rec)
        return rec.last([c.state for c in cache])
    if name == "scored":
        states, scores = kvfn.scored_prefill(fm, tokens, window=window, prefill_step_size=chunk,
                                             progress=rec)  # fmt: skip
        return rec.last([kvfn.tree.arrays(states), scores])
    if name == "kvfn":
        states = kvfn.prefill(fm, tokens, prefill_step_size=chunk, progress=rec)
        return rec.last(kvfn.tree.arrays(states))
    states = None  # grown: each chunk prefilled after the last, with room for it alone
    for i in range(0, L, chunk):
        room = chunk if states is None else None  # the first chunk's rows, not their bucket
        states = kvfn.prefill(fm, tokens[:, i : i + chunk], states=states, capacity=room)
        if i + chunk < L:
            mx.eval(kvfn.tree.arrays(states))
            rec.record()
    return rec.last(kvfn.tree.arrays(states))


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
        check_at_least(p, name, [getattr(args, name)])
    if args.window > args.length:
        p.error(f"argument --window: must be <= --length ({args.length}), got {args.window}")
    gpu = mx.default_device() == mx.gpu
    model = random_model(args.shape, False, mx.bfloat16 if gpu else mx.float32)
    fm = kvfn.FunctionalModel(model)
    tokens = mx.random.randint(0, VOCAB, (1, args.length), key=mx.random.key(args.length))
    result = {name: [] for name in ROWS}
    print(f"{args.shape}, L={args.length}, chunk={args.chunk}: per chunk ms / peak GB above the "
          "active memory before it / active GB after it")  # fmt: skip
    for r in range(args.rounds):
        for name in ROWS:
            chunks = profile(name, model, fm, tokens, args.chunk, args.window)
            result[name].append(chunks)
            print(f"round {r} {name:7s} {sum(c[0] for c in chunks):8.1f} ms  peak "
                  f"{peak_gb(chunks):6.2f} GB | "
                  + "  ".join(f"{t:.0f}/{p:.2f}/{a:.2f}" for t, p, a in chunks))  # fmt: skip
    return result


if __name__ == "__main__":
    main()

"""Where one DuoAttention decode step's attention time goes: 32 layers' worth of one query's
attention, each variant one compiled function over 32 distinct layers' arrays (8B shape: 32 / 8
heads, head_dim 128, bf16), median ms per step.

    python examples/profile_duo.py --lengths 8192 32768 --ratio 0.5   # MLX CUDA

plain      the fused ragged kernel over all 8 KV heads (kvfn's full-cache step)
per-group  kvfn's per-group path: queries gathered per group, the ragged kernel over the
           retrieval heads, SDPA over the full ring, concatenated, put back in head order
fused      one two-group kernel over both groups, queries and outputs in head order
slots      the slots kernel over one buffer a layer (kvfn.slots)
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvfn  # isort: skip  (puts OpenBLAS in front before mlx loads)
import mlx.core as mx  # noqa: E402

from kvfn import kernels, partitioned, slots  # noqa: E402

LAYERS, HQ, HKV, D = 32, 32, 8, 128


def timed(fn, args, steps=20) -> float:
    for _ in range(3):
        mx.eval(fn(*args))
    ts = []
    for _ in range(steps):
        t = time.perf_counter()
        mx.eval(fn(*args))
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--ring", type=int, default=320)
    args = p.parse_args(argv)
    dt = mx.bfloat16
    n_ret = round(args.ratio * HKV)
    if not 0 < n_ret < HKV:
        p.error(f"argument --ratio: {args.ratio} gives {n_ret} of {HKV} retrieval heads")
    retrieval = tuple(HKV * i // n_ret for i in range(n_ret))  # spread among the heads
    heads = (retrieval, tuple(h for h in range(HKV) if h not in retrieval))
    scale = D**-0.5
    for L in args.lengths:
        C = L + 64
        q = [mx.random.normal((1, HQ, 1, D)).astype(dt) for _ in range(LAYERS)]
        full = [(mx.random.normal((1, HKV, C, D)).astype(dt),) * 2 for _ in range(LAYERS)]
        ret = [(mx.random.normal((1, n_ret, C, D)).astype(dt),) * 2 for _ in range(LAYERS)]
        ring = [(mx.random.normal((1, HKV - n_ret, args.ring, D)).astype(dt),) * 2
                for _ in range(LAYERS)]  # fmt: skip
        rows = mx.array(L, mx.int32)
        mx.eval(q, full, ret, ring)

        def plain(q, full, rows):
            return [kernels.ragged_decode_attention(x, k, v, rows, scale=scale)
                    for x, (k, v) in zip(q, full)]  # fmt: skip

        def per_group(q, ret, ring, rows):
            outs = []
            for x, (k0, v0), (k1, v1) in zip(q, ret, ring):

                def attend_part(g, qg):
                    if g == 0:
                        return kernels.ragged_decode_attention(qg, k0, v0, rows, scale=scale)
                    return mx.fast.scaled_dot_product_attention(qg, k1, v1, scale=scale)

                outs.append(partitioned.in_head_order(x, heads, attend_part))
            return outs

        def fused(q, ret, ring, rows):
            hmap = partitioned._head_map(heads)
            return [kernels.two_part_decode_attention(x, k0, v0, rows, k1, v1, args.ring, hmap,
                                                       scale=scale)  # fmt: skip
                    for x, (k0, v0), (k1, v1) in zip(q, ret, ring)]

        hmap = slots._layout(heads, C, args.ring)[2]
        buffers = [mx.concatenate([k0.reshape(1, -1, D), k1.reshape(1, -1, D)], axis=1)
                   for (k0, _), (k1, _) in zip(ret, ring)]  # fmt: skip
        mx.eval(buffers)

        def slotted(q, buffers, rows):
            return [kernels.slots_decode_attention(x, b, b, rows, C, args.ring, hmap, scale=scale)
                    for x, b in zip(q, buffers)]  # fmt: skip

        variants = dict(
            plain=(plain, (q, full, rows)),
            per_group=(per_group, (q, ret, ring, rows)),
            fused=(fused, (q, ret, ring, rows)),
            slots=(slotted, (q, buffers, rows)),
        )
        compiled = {k: (mx.compile(f), a) for k, (f, a) in variants.items()}
        res = {k: timed(f, a) for k, (f, a) in compiled.items()}
        a, b, c = (f(*args) for f, args in (compiled[k] for k in ("per_group", "fused", "slots")))
        err = max(mx.max(mx.abs(x.astype(mx.float32) - y.astype(mx.float32))).item()
                  for x, y in [*zip(a, b), *zip(a, c)])  # fmt: skip
        print(f"attention x{LAYERS} layers L={L} retrieval {n_ret}/{HKV} heads: "
              + ", ".join(f"{k} {v:.3f} ms" for k, v in res.items())
              + f" | fused, slots vs per-group max |diff| {err:.2e}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

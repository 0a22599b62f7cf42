"""The primitives under a decode step, per layer, compiled: row writes and attention variants.

    python examples/benchmark_primitives.py --rows 4096 32768

One layer of an 8B-shaped llama (32 query / 8 KV heads, head_dim 128, bf16 on a GPU), one query:
writes of one row into a buffer of rows + 256 slots (static slot, traced slot by slice_update,
traced slot by scatter), and attention over the rows: fused with no mask over exactly the rows,
with a boolean / additive mask over the whole buffer, and split into an unmasked fused prefix
plus a masked 256-slot tail merged exactly by log-sum-exp. Each figure is the median of 50
compiled calls of 32 layers' worth of the primitive, divided by 32.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvfn  # noqa: F401,E402  isort: skip  (OpenBLAS before mlx)
import mlx.core as mx  # noqa: E402

LAYERS, HQ, HK, D, TAIL = 32, 32, 8, 128, 256


def threaded(fn, bufs, *args, n=50):
    """Like ``timed``, feeding each call's buffers to the next (the old ones are dropped, as in
    a decode loop, so a write may reuse its buffer)."""
    box = [bufs]
    del bufs
    for _ in range(5):
        box.append(fn(box.pop(), *args))
        mx.eval(box[0])
    times = []
    for _ in range(n):
        t = time.perf_counter()
        box.append(fn(box.pop(), *args))
        mx.eval(box[0])
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times) / LAYERS


def timed(fn, *args, n=50):
    for _ in range(5):
        mx.eval(fn(*args))
    times = []
    for _ in range(n):
        t = time.perf_counter()
        mx.eval(fn(*args))
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times) / LAYERS


def lse_merge(q, k, v, rows, tail_k, tail_v, tail_valid, scale):
    """Exact attention over [prefix rows | valid tail slots]: fused unmasked prefix + manual
    tail, merged by log-sum-exp (the prefix's from one extra q.K product)."""
    B = q.shape[0]
    out_p = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
    qg = q.reshape(B, HK, HQ // HK, 1, D).astype(mx.float32) * scale
    s_p = qg @ k[:, :, None].astype(mx.float32).swapaxes(-1, -2)  # (B, HK, rep, 1, P)
    lse_p = mx.logsumexp(s_p, axis=-1, keepdims=True)
    s_t = qg @ tail_k[:, :, None].astype(mx.float32).swapaxes(-1, -2)
    s_t = mx.where(tail_valid, s_t, -mx.inf)
    lse_t = mx.logsumexp(s_t, axis=-1, keepdims=True)
    out_t = mx.softmax(s_t, axis=-1) @ tail_v[:, :, None].astype(mx.float32)
    lse = mx.logaddexp(lse_p, lse_t)
    out_p = out_p.reshape(B, HK, HQ // HK, 1, D).astype(mx.float32)
    out = out_p * mx.exp(lse_p - lse) + out_t * mx.exp(lse_t - lse)
    return out.reshape(B, HQ, 1, D).astype(q.dtype)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[4096, 32768])
    args = p.parse_args(argv)
    dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    scale = D**-0.5
    print(f"{mx.default_device()}, {dtype}; ms per layer")
    print("| rows | write static | write slice_update | write scatter | write tail slice_update | "
          "attn fused exact rows | attn bool mask | attn additive mask | attn prefix+tail LSE |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for R in args.rows:
        C = R + TAIL
        key = mx.random.key(R)
        bufs = [mx.random.normal((1, HK, C, D), key=key).astype(dtype) for _ in range(LAYERS)]
        row = mx.random.normal((1, HK, 1, D)).astype(dtype)
        where = mx.array(R, mx.int32)
        mx.eval(bufs, row)

        def static(bufs, row):
            out = []
            for b in bufs:
                b = mx.array(b)
                b[:, :, R : R + 1] = row
                out.append(b)
            return out

        def dynamic(bufs, row, where):
            return [mx.slice_update(b, row, where.reshape(1), axes=(2,)) for b in bufs]

        def scatter(bufs, row, where):
            idx = mx.broadcast_to(where.reshape(1, 1, 1, 1), row.shape)
            return [mx.put_along_axis(b, idx, row, axis=2) for b in bufs]

        tails = [b[:, :, :TAIL] + 0 for b in bufs]

        def tail_write(tails, row, where):
            return [mx.slice_update(t, row, (where % TAIL).reshape(1), axes=(2,)) for t in tails]

        copy = lambda xs: [x + 0 for x in xs]  # noqa: E731  own buffers for each variant
        w_static = threaded(mx.compile(lambda b, r: static(b, r)), copy(bufs), row)
        w_dyn = threaded(mx.compile(dynamic), copy(bufs), row, where)
        w_scatter = threaded(mx.compile(scatter), copy(bufs), row, where)
        w_tail = threaded(mx.compile(tail_write), copy(tails), row, where)

        q = mx.random.normal((1, HQ, 1, D)).astype(dtype)
        exact = [b[:, :, :R] for b in bufs]
        valid = mx.arange(C) <= R
        additive = mx.where(valid, 0.0, -mx.inf).astype(dtype)
        tail_valid = (mx.arange(TAIL) < 7)[None, None, None, None]
        mx.eval(q, exact, valid, additive)

        def attn(mask, ks):
            return [
                mx.fast.scaled_dot_product_attention(q, k, k, scale=scale, mask=mask) for k in ks
            ]

        a_exact = timed(mx.compile(lambda ks: attn(None, ks)), exact)
        a_bool = timed(mx.compile(lambda ks: attn(valid, ks)), bufs)
        a_add = timed(mx.compile(lambda ks: attn(additive, ks)), bufs)
        a_lse = timed(mx.compile(lambda ks, ts: [lse_merge(q, k, k, R, t, t, tail_valid, scale)
                                                 for k, t in zip(ks, ts)]), exact, tails)  # fmt: skip
        ref = attn(valid[: R + 7], [b[:, :, : R + 7] for b in bufs[:1]])[0]
        tail_ref = [b[:, :, :TAIL] for b in bufs[:1]]
        merged = lse_merge(q, exact[0], exact[0], R, tail_ref[0], tail_ref[0], tail_valid, scale)
        both = mx.concatenate([exact[0], tail_ref[0][:, :, :7]], axis=2)
        ref = mx.fast.scaled_dot_product_attention(q, both, both, scale=scale)
        err = mx.abs(merged.astype(mx.float32) - ref.astype(mx.float32)).max().item()
        print(f"| {R} | {w_static:.3f} | {w_dyn:.3f} | {w_scatter:.3f} | {w_tail:.3f} | "
              f"{a_exact:.3f} | {a_bool:.3f} | {a_add:.3f} | {a_lse:.3f} (err {err:.1e}) |")  # fmt: skip


if __name__ == "__main__":
    main()

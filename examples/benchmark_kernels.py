"""Ragged decode attention on the GPU: the split-K kernel against MLX's SDPA.

Loads kvfn/kernels/__init__.py by file path, so it runs while the rest of kvfn is being edited.
For one layer (B=1, 32 query / 8 KV heads, D=128, bf16) and capacities 1K-128K it checks the
kernel against masked SDPA, then times, interleaved in one process (median over iterations,
mx.eval each): the kernel over the valid rows, fused SDPA with mask=None over exactly the
valid rows (the ideal), and masked SDPA over the whole capacity (kvfn today). With --layers N
it also times a compiled function making N such calls.

    python examples/benchmark_kernels.py [--iters 200] [--layers 32] [--sweep] [--check]
    python examples/benchmark_kernels.py --chain --capacities 1024 4096 32768  # CUPTI durations
    python examples/benchmark_kernels.py --chain --capacities 4096 --configs 4,4,3,2 4,4,3,0
    python examples/benchmark_kernels.py --chain --capacities 2048 8192 --configs 4,4,3,2,0 \
        4,4,1,2,1,8 --split-rows 256 512  # CUDA cores in 4 warps, tensor cores in 8 (the
        # defaults), each in splits of 256 and 512 rows
    python examples/benchmark_kernels.py --chain --capacities 4096 16384 --decoded 20  # rows
        # as a step's lie 20 tokens into decoding (profile section 22: still no proxy for steps)
    ncu --kernel-name regex:"ragged|sdpa|lean" --section WarpStateStats python \
        examples/benchmark_kernels.py --launches --capacities 1024 4096 --split-rows 64 256
"""

import argparse
import importlib.util
import statistics
import sys
import time
from contextlib import nullcontext
from functools import lru_cache
from pathlib import Path
from unittest import mock

import mlx.core as mx
import numpy as np

HEADS, KV_HEADS, DIM = 32, 8, 128
CAPACITIES = (1024, 4096, 32768, 131072)
RAGGED = (1, 1 / 8, 1 / 2, 1 / 4, 1, 1 / 16, 3 / 4, 1 / 2)  # per-KV-head share of C


def load_kernels():
    path = Path(__file__).resolve().parent.parent / "kvfn" / "kernels" / "__init__.py"
    spec = importlib.util.spec_from_file_location("kvfn_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def operands(capacity, dim=DIM, heads=HEADS, kv_heads=KV_HEADS, batch=1, dtype=mx.bfloat16):
    q = mx.random.normal((batch, heads, 1, dim)).astype(dtype)
    k = mx.random.normal((batch, kv_heads, capacity, dim)).astype(dtype)
    v = mx.random.normal((batch, kv_heads, capacity, dim)).astype(dtype)
    mx.eval(q, k, v)
    return q, k, v


def cases(capacity):
    """(name, lengths, rows the ideal attends to)."""
    ragged = [max(1, int(capacity * share)) for share in RAGGED]
    return [
        ("full", mx.array(capacity, dtype=mx.int32), capacity),
        ("half", mx.array(capacity // 2, dtype=mx.int32), capacity // 2),
        ("ragged", mx.array([ragged], dtype=mx.int32), max(ragged)),
    ]


def patched(module, **values):
    """``module``'s attributes set to ``values`` inside the block, restored after it."""
    return mock.patch.multiple(module, **values) if values else nullcontext()


def without_prefetch(kk, fn):
    """``fn()`` on the CUDA-core kernel loading rows without prefetch."""
    with patched(kk, PREFETCH=False, TENSOR_CORES=False):
        return fn()


def on_cuda_cores(fn):
    """``fn(kk, ...)`` with the CUDA-core kernel everywhere: the settings it sweeps or checks
    (U, prefetch, stages) are that kernel's."""

    def run(kk, *args):
        with patched(kk, TENSOR_CORES=False):
            return fn(kk, *args)

    return run


def variants(kk, q, k, v, lengths, rows):
    scale = q.shape[-1] ** -0.5
    kernel = lambda: kk.ragged_decode_attention(q, k, v, lengths, scale=scale)  # noqa: E731
    return {
        "kernel": kernel,
        "no prefetch": lambda: without_prefetch(kk, kernel),
        "ideal": lambda: mx.fast.scaled_dot_product_attention(
            q, k[:, :, :rows], v[:, :, :rows], scale=scale
        ),
        "masked": lambda: kk._masked_attention(q, k, v, lengths, scale),
    }


def max_error(a, b):
    return float(mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))))


def timed(fns, iters, repeat=1):
    """Median microseconds per call of each fn, interleaved; repeat calls share one eval."""
    for fn in fns.values():
        mx.eval([fn() for _ in range(repeat)])
    times = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            start = time.perf_counter()
            mx.eval([fn() for _ in range(repeat)])
            times[name].append((time.perf_counter() - start) / repeat)
    return {name: 1e6 * statistics.median(t) for name, t in times.items()}


def compiled_layers(kk, capacity, lengths, rows, layers):
    """A compiled function making `layers` calls over distinct K/V buffers, per variant."""
    q, _, _ = operands(16)
    kvs = [operands(capacity)[1:] for _ in range(layers)]
    scale = DIM**-0.5

    def step(attend):
        def run(q, lengths, kvs):
            return sum(attend(q, k, v, lengths) for k, v in kvs)

        return mx.compile(run)

    attends = {
        "kernel": lambda q, k, v, n: kk.ragged_decode_attention(q, k, v, n, scale=scale),
        "ideal": lambda q, k, v, n: mx.fast.scaled_dot_product_attention(
            q, k[:, :, :rows], v[:, :, :rows], scale=scale
        ),
        "masked": lambda q, k, v, n: kk._masked_attention(q, k, v, n, scale),
    }
    fns = {name: step(a) for name, a in attends.items()}
    out = {name: (lambda f=f: f(q, lengths, kvs)) for name, f in fns.items()}
    err = max_error(out["kernel"](), out["masked"]())
    return out, err


def row(cells):
    return "| " + " | ".join(str(c) for c in cells) + " |"


def one_layer_table(kk, capacities, iters):
    print("\nOne layer, B=1, 32 q / 8 KV heads, D=128, bf16; us per call (median, mx.eval each)")
    head = ["C", "rows", "err vs masked", "err vs f32", "kernel", "ideal", "masked"]
    head += [
        "kernel/ideal",
        "masked/kernel",
        "kernel GB/s",
        "kernel x20",
        "CUDA cores, no prefetch x20",
        "ideal x20",
        "masked x20",
    ]
    print(row(head))
    print(row(["---"] * len(head)))
    for capacity in capacities:
        q, k, v = operands(capacity)
        for name, lengths, rows in cases(capacity):
            fns = variants(kk, q, k, v, lengths, rows)
            got, masked = fns["kernel"](), fns["masked"]()
            exact = kk._masked_attention(
                *(x.astype(mx.float32) for x in (q, k, v)), lengths, DIM**-0.5
            )
            errors = (max_error(got, masked), max_error(got, exact))
            t = timed(fns, iters)
            t20 = timed(fns, max(10, iters // 10), repeat=20)
            read = 2 * DIM * 2 * float(mx.sum(mx.broadcast_to(lengths, (1, KV_HEADS))))
            print(
                row(
                    [capacity, f"{name} {rows}", f"{errors[0]:.1e}", f"{errors[1]:.1e}"]
                    + [f"{t[n]:.1f}" for n in ("kernel", "ideal", "masked")]
                    + [
                        f"{t['kernel'] / t['ideal']:.2f}",
                        f"{t['masked'] / t['kernel']:.2f}",
                        f"{read / t20['kernel'] / 1e3:.0f}",
                    ]
                    + [f"{t20[n]:.1f}" for n in ("kernel", "no prefetch", "ideal", "masked")]
                )
            )
        del q, k, v


def compiled_table(kk, capacities, layers, iters):
    print(f"\nCompiled, {layers} calls (layers) per step, distinct K/V each; ms per step (median)")
    head = ["C", "rows", "err", "kernel", "ideal", "masked", "kernel/ideal", "masked/kernel"]
    print(row(head))
    print(row(["---"] * len(head)))
    for capacity in capacities:
        for name, lengths, rows in cases(capacity)[:2]:
            fns, err = compiled_layers(kk, capacity, lengths, rows, layers)
            t = {n: us / 1e3 for n, us in timed(fns, iters).items()}
            print(
                row(
                    [capacity, f"{name} {rows}", f"{err:.1e}"]
                    + [f"{t[n]:.3f}" for n in ("kernel", "ideal", "masked")]
                    + [f"{t['kernel'] / t['ideal']:.2f}", f"{t['masked'] / t['kernel']:.2f}"]
                )
            )
            del fns
            mx.clear_cache()


@on_cuda_cores
def sweep(kk, capacities, iters, splits_list, unrolls):
    print("\nSplit and unroll sweep (kernel only, us per call, x20 per eval); U=keys per lane step")
    plan = kk.plan
    for capacity in capacities:
        q, k, v = operands(capacity)
        for name, lengths, rows in cases(capacity)[:1]:
            ideal = {"i": variants(kk, q, k, v, lengths, rows)["ideal"]}
            print(capacity, name, f"ideal:{timed(ideal, max(10, iters // 10), repeat=20)['i']:.1f}")
            for unroll in unrolls:
                results = []
                for splits in splits_list:
                    if splits * 64 > capacity:
                        continue
                    fn = {"k": lambda: kk.ragged_decode_attention(q, k, v, lengths, scale=0.1)}
                    fixed = lambda *a, s=splits, **kw: plan(*a, **kw)[:2] + (s,)  # noqa: E731
                    with patched(kk, UNROLL=unroll, plan=fixed):
                        us = timed(fn, max(10, iters // 10), repeat=20)["k"]
                    results.append(f"{splits}:{us:.1f}")
                print(f"   U={unroll}", " ".join(results), flush=True)


def kernel_config(text: str) -> tuple:
    """``G,U,B[,S[,T[,W]]]`` (query heads a block at most, keys a lane step, blocks an SM (only
    ``plan``'s split count uses it, where the capacity does not cap that count): positive;
    steps staged through shared memory, 0 for none: the default; T 1: the tensor-core kernel
    on every split it takes, float16 / bfloat16 and head_dim 64 or 128, which takes no U; T 0:
    the CUDA-core kernel; W: warps a block, 1, 2, 4 (the default here) or 8; W and B set both
    kernels: the module's tensor-core blocks are ``...,1,2,1,8``)."""
    parts = text.split(",")
    parts += ["0", "0", "4"][max(0, len(parts) - 3) :]
    valid = len(parts) == 6 and all(p.isdigit() for p in parts) and parts[4] in ("0", "1")
    if not valid or "0" in parts[:3] or parts[5] not in ("1", "2", "4", "8"):
        raise argparse.ArgumentTypeError(
            f"must be G,U,B[,S[,T[,W]]]: three positive integers, stages >= 0, T 0 or 1 and "
            f"W 1, 2, 4 or 8; got {text!r}"
        )
    return tuple(int(p) for p in parts)


def rows_at_least(least: int):
    """An argparse type: a whole number of rows, at least ``least``."""

    def rows(text: str) -> int:
        if not text.isdigit() or int(text) < least:
            raise argparse.ArgumentTypeError(
                f"must be a row count of at least {least}; got {text!r}"
            )
        return int(text)

    return rows


split_rows = rows_at_least(1)  # --split-rows
decoded_rows = rows_at_least(0)  # --decoded


def split_settings(rows) -> dict:
    """The ``kvfn.kernels`` settings of ``--split-rows``: ``plan`` gives either kernel's splits
    at least ``rows`` rows (None: the module's own)."""
    if rows is None:
        return {}
    return dict(MIN_KEYS_PER_SPLIT=rows, MMA_MIN_KEYS_PER_SPLIT=rows, MMA_KEYS_PER_SPLIT=rows)


def kernel_settings(config: tuple) -> dict:
    """The ``kvfn.kernels`` settings a ``kernel_config`` tuple stands for."""
    g, u, b, st, tc, w = config
    return dict(MAX_HEADS_PER_BLOCK=g, UNROLL=u, BLOCKS_PER_SM=b, MMA_BLOCKS_PER_SM=b,
                STAGES=st, TENSOR_CORES=tc == 1, MMA_MIN_KEYS_PER_SPLIT=0, MMA_RUN_DIMS=None,
                THREADS=32 * w, MMA_THREADS=32 * w)  # fmt: skip


def compiled_ms(kk, capacity, lengths, layers, iters, variant) -> str:
    """ms per compiled step of ``layers`` calls of one variant, as a cell ("-" for 0 layers)."""
    if not layers:
        return "-"
    fns, _ = compiled_layers(kk, capacity, lengths, capacity, layers)
    return f"{timed({'v': fns[variant]}, max(10, iters // 4))['v'] / 1e3:.3f}"


def configs_table(kk, capacities, iters, configs, layers):
    """Each (query heads a block, keys a lane step, blocks an SM, steps staged, tensor cores)
    setting of the split kernel (``kernel_config``; the tensor-core kernel stages at least one
    step, as its S column shows): its error against float32 masked SDPA (full and ragged
    lengths), us per call (x20 per eval) over all and half the rows, and a compiled step of
    ``layers`` calls, against the ideal (SDPA with no mask over exactly the valid rows)."""
    print(f"\nKernel settings (G query heads a block, U keys a lane step, B blocks an SM, S "
          f"steps staged, T tensor cores); us per call x20, ms per compiled step of {layers} "
          f"calls")  # fmt: skip
    head = ["C", "G,U,B,S,T", "err full", "err ragged", "full", "half", "ideal full", "ideal half",
            f"x{layers} full", f"x{layers} ideal"]  # fmt: skip
    print(row(head))
    print(row(["---"] * len(head)))
    for capacity in capacities:
        q, k, v = operands(capacity)
        (_, full, _), (_, half, _), (_, ragged, _) = cases(capacity)
        exact = lambda n: kk._masked_attention(  # noqa: E731
            *(x.astype(mx.float32) for x in (q, k, v)), n, DIM**-0.5
        )
        ideal = {n: variants(kk, q, k, v, lengths, rows)["ideal"]
                 for n, lengths, rows in cases(capacity)[:2]}  # fmt: skip
        t_ideal = timed(ideal, max(10, iters // 10), repeat=20)
        c_ideal = compiled_ms(kk, capacity, full, layers, iters, "ideal")
        for config in configs:
            g, u, b, st, tc, w = config
            fns = {name: (lambda n=n: kk.ragged_decode_attention(q, k, v, n, scale=DIM**-0.5))
                   for name, n in (("full", full), ("half", half))}  # fmt: skip
            with patched(kk, **kernel_settings(config)):
                g = kk.plan(1, HEADS, KV_HEADS, capacity)[0]  # the heads a block plan() takes
                err = [max_error(kk.ragged_decode_attention(q, k, v, n, scale=DIM**-0.5),
                                 exact(n)) for n in (full, ragged)]  # fmt: skip
                t = timed(fns, max(10, iters // 10), repeat=20)
                c = compiled_ms(kk, capacity, full, layers, iters, "kernel")
            setting = f"{g},{u},{b},{max(st, 1) if tc else st},{tc},{w}"
            print(row([capacity, setting, f"{err[0]:.1e}", f"{err[1]:.1e}",
                       f"{t['full']:.1f}", f"{t['half']:.1f}", f"{t_ideal['full']:.1f}",
                       f"{t_ideal['half']:.1f}", c, c_ideal]), flush=True)  # fmt: skip
            mx.clear_cache()
        del q, k, v


LOAD_PATHS = ((True, 0), (False, 0), (True, 1), (True, 2), (True, 3))  # (PREFETCH, STAGES)


@on_cuda_cores
def check(kk):
    """The CUDA-core kernel (each load path: registers with and without prefetch, rows staged
    in shared memory) against float32 masked SDPA; prints each mismatch."""
    worst, failures = 0.0, 0
    shapes = [(mx.bfloat16, d, h, c, b) for d in (64, 128) for h, c, b in ((32, 8, 1), (14, 2, 3))]
    for dtype, dim, heads, kv_heads, batch in shapes + [(mx.float32, 128, 32, 8, 1)]:
        for capacity in (37, 5000):
            q, k, v = operands(capacity, dim, heads, kv_heads, batch, dtype)
            for lengths in check_lengths(capacity, batch, kv_heads):
                for prefetch, stages in LOAD_PATHS:
                    with patched(kk, PREFETCH=prefetch, STAGES=stages):
                        err = check_one(kk, q, k, v, lengths)
                    if not err <= (1e-4 if dtype == mx.float32 else 2e-2):
                        failures += 1
                        print(
                            f"MISMATCH {dtype} D={dim} {heads}/{kv_heads} B={batch} C={capacity} "
                            f"prefetch={prefetch} stages={stages} lengths={lengths.tolist()}: "
                            f"err {err}"
                        )
                    elif dtype != mx.float32:
                        worst = max(worst, err)
    print(f"check: {failures} mismatches; worst half-precision error {worst:.1e}")


def check_lengths(capacity, batch, kv_heads):
    return (
        mx.array(capacity, dtype=mx.int32),
        mx.array(0, dtype=mx.int32),
        mx.random.randint(0, capacity + 1, (batch, kv_heads)).astype(mx.int32),
        mx.random.randint(-2, capacity + 9, (batch,)).astype(mx.int32),
        mx.random.randint(0, capacity + 1, (1, kv_heads)).astype(mx.int32),
        mx.random.randint(0, capacity + 1, (batch, 1)).astype(mx.int32),
    )


def check_one(kk, q, k, v, lengths):
    """Max abs error against float32 masked SDPA; NaN counts as infinite."""
    scale = q.shape[-1] ** -0.5
    got = kk.ragged_decode_attention(q, k, v, lengths, scale=scale)
    f32 = (x.astype(mx.float32) for x in (q, k, v))
    want = kk._masked_attention(*f32, lengths, scale)
    if bool(mx.any(mx.isnan(got))):
        return float("inf")
    return max_error(got, want)


def chain_table(kk, capacities, layers=32, steps=10, settings="", decoded=0):
    """Each kernel's duration (CUPTI, through PyTorch's profiler) inside ``layers`` dependent
    calls, each call's output the next call's query as in a decode step: cuDNN's fused SDPA
    over all rows, the split kernel as planned over the same rows, and the split kernel at
    lengths 0 and 64 of that capacity (its fixed cost). us a call, per kernel: the mean;
    ``settings`` names the kernel settings in the title. ``decoded`` T > 0 times a state T
    steps into decoding, as a step sees it: capacity + T valid rows in capacity + 2T slots
    (cuDNN over the capacity + T rows alone). At T = 0 the valid rows fill the slots, a whole
    number of every split's rows, which ranked split counts differently from steps (profile
    section 21)."""
    print(f"\nkernels inside {layers} dependent calls (us a call, each kernel's mean)"
          + (f", settings {settings}" if settings else "")
          + (f", {decoded} rows decoded: capacity + {decoded} valid of capacity + {2 * decoded}"
             if decoded else ""))  # fmt: skip
    print("| capacity | cuDNN | kvfn (splits) | kvfn, length 0 | kvfn, length 64 |")
    print("|---|---|---|---|---|")
    scale = DIM**-0.5
    for capacity in capacities:
        valid = capacity + decoded
        q = operands(1)[0]
        kvs = [operands(valid + decoded)[1:] for _ in range(layers)]
        dense = [operands(valid)[1:] for _ in range(layers)] if decoded else kvs

        def chain(attend, layers_kv=kvs):
            def run(n):
                for _ in range(n):
                    x = q
                    for k, v in layers_kv:
                        x = attend(x, k, v)
                    mx.eval(x)

            return run

        def split(n):
            rows = mx.array(n, dtype=mx.int32)
            return chain(lambda x, k, v: kk.ragged_decode_attention(x, k, v, rows, scale=scale))

        sdpa = mx.fast.scaled_dot_product_attention
        runs = [chain(lambda x, k, v: sdpa(x, k, v, scale=scale), dense),
                split(valid), split(0), split(64)]  # fmt: skip
        cells = []
        for run in runs:
            run(2)
            kernels = _timeline().recorded(run, steps)[0]
            cells.append(per_call(kernels))
        cells[1] += f" ({planned(kk, q, kvs[0][0])})"
        print(f"| {capacity} | " + " | ".join(cells) + " |", flush=True)
        del kvs, dense


def planned(kk, q, k) -> str:
    """The split count the kernel launches over ``k``'s capacity with, and whether it runs on
    tensor cores ("16 splits", "8 splits, tensor cores")."""
    mma = kk._mma_applies(q, k)
    splits = kk.plan(*q.shape[:2], k.shape[1], k.shape[2], mma)[2]
    return f"{splits} split{'s' * (splits > 1)}{', tensor cores' if mma else ''}"


def launches(kk, capacities, split_rows_list, repeat=3):
    """For Nsight Compute, untimed: each capacity's kernel ``repeat`` times in each split size
    (None: the module's), then cuDNN's SDPA twice over the same full rows; prints each plan."""
    scale = DIM**-0.5
    for capacity in capacities:
        q, k, v = operands(capacity)
        rows = mx.array(capacity, dtype=mx.int32)
        for split in split_rows_list:
            with patched(kk, **split_settings(split)):
                print(f"capacity {capacity}, split rows {split or 'default'}: "
                      f"{planned(kk, q, k)}", flush=True)  # fmt: skip
                for _ in range(repeat):
                    mx.eval(kk.ragged_decode_attention(q, k, v, rows, scale=scale))
        for _ in range(2):
            mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale))


def per_call(kernels) -> str:
    """'a + b': each kernel name's mean duration (us), the costliest first."""
    return " + ".join(f"{us:.1f}" for _, us, _ in _timeline().named(kernels, 1).values())


@lru_cache(maxsize=None)
def _timeline():
    """``examples.profile_timeline`` (it imports kvfn, which the rest of this script does not)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from examples import profile_timeline

    return profile_timeline


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--capacities", type=int, nargs="+", default=CAPACITIES)
    parser.add_argument("--layers", type=int, default=32, help="0 skips the compiled table")
    parser.add_argument("--sweep", action="store_true", help="time other split counts")
    parser.add_argument("--splits", type=int, nargs="+", default=[16, 32, 49, 66, 98, 132, 196])
    parser.add_argument("--unrolls", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--check", action="store_true", help="check many shapes first")
    parser.add_argument("--chain", action="store_true",
                        help="only kernel durations inside dependent calls (CUDA, PyTorch)")  # fmt: skip
    parser.add_argument(
        "--configs",
        nargs="+",
        metavar="G,U,B[,S[,T[,W]]]",
        type=kernel_config,
        help="split kernel settings to compare (then only that table, or with --chain one "
        "chain table each)",
    )
    parser.add_argument(
        "--split-rows",
        nargs="+",
        metavar="N",
        type=split_rows,
        help="with --chain or --launches: each in plan's splits of at least N rows",
    )
    parser.add_argument("--decoded", type=decoded_rows, default=0, metavar="T",
                        help="with --chain: capacity + T valid rows of capacity + 2T, as a "
                        "state T steps into decoding")  # fmt: skip
    parser.add_argument("--launches", action="store_true",
                        help="only launch the kernels, untimed (for ncu; --split-rows)")  # fmt: skip
    args = parser.parse_args()
    kk = load_kernels()
    print("device", mx.default_device(), "cuda", mx.cuda.is_available(), "mlx", mx.__version__)
    if args.check:
        check(kk)
    if args.launches:
        return launches(kk, args.capacities, args.split_rows or [None])
    if args.chain:
        if not kk.on_cuda():
            raise SystemExit("--chain reads CUDA kernels: run it with MLX's CUDA backend")
        for config in args.configs or [None]:
            for rows in args.split_rows or [None]:
                settings = {**(kernel_settings(config) if config else {}), **split_settings(rows)}
                name = ",".join(map(str, config or ())) + (f" rows {rows}" if rows else "")
                with patched(kk, **settings):
                    chain_table(
                        kk,
                        args.capacities,
                        args.layers or 32,
                        settings=name.strip(),
                        decoded=args.decoded,
                    )
        return
    if args.configs:
        return configs_table(kk, args.capacities, args.iters, args.configs, args.layers)
    one_layer_table(kk, args.capacities, args.iters)
    if args.layers:
        compiled_table(kk, args.capacities, args.layers, max(10, args.iters // 4))
    if args.sweep:
        sweep(kk, args.capacities, args.iters, args.splits, args.unrolls)


if __name__ == "__main__":
    main()

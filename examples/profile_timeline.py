"""The GPU's timeline of decode loops: how long a step keeps the GPU busy, how long it leaves it
idle, and which kernels fill it, for mlx-lm's eager step and kvfn's compiled one over the same
rows (8B-shaped llama, random weights, bf16 or with ``--q4`` 4-bit, K/V filled with random rows,
no prefill).

    python examples/profile_timeline.py --rows 1024 4096 32768    # MLX CUDA, with PyTorch
    python examples/profile_timeline.py --q4 --rows 16 1024 --loops mlx-lm kvfn --top 8

The kernels are recorded by CUPTI through ``torch.profiler`` (Kineto), which sees every kernel of
the process, MLX's included (the device machine has no Nsight Systems). Per step, averaged over
``--steps`` steps of each loop: wall ms, kernel count, kernel ms (summed durations), busy ms (the
union of the kernels' intervals), span ms (first kernel start to last kernel end, over the steps,
divided by their count) and idle ms (span - busy), then the busy time by kernel class and
(``--top N``) the costliest kernels by name and the host's costliest CUDA API calls (graph
instantiations, updates, launches; their total is the union of the calls' intervals, waits
included). ``--loops NAME ...`` runs only the rows named. Kernels of one step can overlap
(MLX's CUDA graphs run independent nodes side by side), so kernel ms can exceed busy ms. CUPTI
adds host work to every launch: wall ms here run slower than unprofiled steps
(``benchmark_decode.py`` times those); the kernels' own durations are what this script is for.

Loops: ``piped`` builds step t+1 while step t runs (``mx.async_eval``, as mlx-lm's generate_step
does); ``sync`` builds then evaluates each step. Rows: mlx-lm over a KVCache of R rows; kvfn over
a packed state of the same R rows (what a compaction gives: appends scatter at a traced slot);
kvfn with its CUDA decode kernel off (SDPA with a mask array); with ``--splits``, kvfn with
the split kernel's key splits fixed. With ``--duo RATIO``, R is a prompt's length and three more
rows follow: kvfn over the whole prompt (a dense state), DuoAttention's state of it (a random
head pattern at that retrieval ratio; streaming heads keep 64 sinks + 256 recent rows) and the
same rows in the slots layout; ``--splits`` then fixes their splits too. ``--batch B`` decodes B
sequences at once, each over its own random rows (``kernels.plan`` then spreads B times as many
blocks over the SMs, so fewer key splits).
"""

import argparse
import json
import re
import sys
import tempfile
import time
from functools import lru_cache
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvfn  # isort: skip  (puts OpenBLAS in front before mlx loads)
import mlx.core as mx  # noqa: E402

from examples.benchmark_decode import (  # noqa: E402
    SHAPES,
    check_at_least,
    cleared,
    median_ms,
    pipelined_ms,
    random_model,
    weights_bytes,
)
from examples.profile_decode import (  # noqa: E402
    check_duo,
    duo_states,
    filled,
    kvfn_loop,
    mlx_loop,
    packed,
    variant_loop,
)
from kvfn import slots  # noqa: E402

WARM = 5  # steps run before each recorded loop
CLASSES = (  # first match wins
    ("attention", r"sdpa|flash|cudnn|attention|kvfn_.*decode|lean|softmax"),
    ("matmul", r"gemv|gemm|matmul|cutlass|sm90|xmma|qmv|qmm"),
    ("kv write", r"scatter|slice_update|copy"),
    ("rope", r"rope"),
    ("norm", r"rms|layer_norm"),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    return next((c for c, pattern in CLASSES if re.search(pattern, low)), "other")


def merged(intervals: list) -> list:
    """The union of (start, stop) intervals as disjoint intervals, in order."""
    out = []
    for start, stop in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], stop)
        else:
            out.append([start, stop])
    return out


def runs_of(calls: list) -> list:
    """The disjoint (start, stop) us runs that ``calls``, (name, start us, duration us), cover."""
    return merged([(t, t + d) for _, t, d in calls])


def covered_us(runs: list) -> float:
    return sum(stop - start for start, stop in runs)


def summary(kernels: list, steps: int, wall_s: float, api: list = ()) -> dict:
    """Per-step figures of ``kernels`` and the host's CUDA ``api`` calls, lists of (name,
    start us, duration us)."""
    runs = runs_of(kernels)
    span = runs[-1][1] - runs[0][0] if runs else 0.0
    busy = covered_us(runs)
    by_class = {}
    for name, _, d in kernels:
        c = kernel_class(name)
        by_class[c] = by_class.get(c, 0.0) + d
    gaps = [b[0] - a[1] for a, b in zip(runs, runs[1:])]
    return dict(
        wall_ms=1e3 * wall_s / steps,
        kernels=len(kernels) / steps,
        kernel_ms=sum(d for *_, d in kernels) / steps / 1e3,
        busy_ms=busy / steps / 1e3,
        span_ms=span / steps / 1e3,
        idle_ms=(span - busy) / steps / 1e3,
        gaps_over_20us=sum(1 for g in gaps if g > 20) / steps,
        idle_in_gaps_over_20us_ms=sum(g for g in gaps if g > 20) / steps / 1e3,
        classes_ms={c: t / steps / 1e3 for c, t in sorted(by_class.items())},
        names=named(kernels, steps),
        api_ms=covered_us(runs_of(api)) / steps / 1e3,
        api=named(api, steps),
    )


def named(kernels: list, steps: int) -> dict:
    """Per kernel name (template arguments dropped): (calls, us a call, us) a step, by time."""
    totals = {}
    for name, _, d in kernels:
        key = re.sub(r"<.*", "", name)[:60]
        calls, us = totals.get(key, (0, 0.0))
        totals[key] = (calls + 1, us + d)
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])
    return {k: (n / steps, us / n, us / steps) for k, (n, us) in ranked}


def recorded(run, steps: int):
    """(kernels, CUDA API calls, wall seconds) of ``run(steps)`` under ``torch.profiler``; each
    a list of (name, start us, duration us). The API calls are the host's runtime and driver
    calls (MLX's CUDA graph instantiations, updates and launches among them)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    mx.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        run(steps)
        mx.synchronize()
        wall = time.perf_counter() - t
    torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())
    events = {"kernel": [], "cuda_runtime": [], "cuda_driver": []}
    for e in trace["traceEvents"]:
        if e.get("cat") in events:
            events[e["cat"]].append((e["name"], float(e["ts"]), float(e.get("dur", 0.0))))
    if not events["kernel"]:
        raise RuntimeError("CUPTI recorded no kernel: is this PyTorch built with CUDA?")
    return events["kernel"], events["cuda_runtime"] + events["cuda_driver"], wall


def fixed_splits(n: int):
    """``kernels.plan`` with the split count set to ``n``."""
    plan = kvfn.kernels.plan

    def fixed(batch, q_heads, kv_heads, capacity, mma=False):
        return plan(batch, q_heads, kv_heads, capacity, mma)[:2] + (n,)

    return fixed


HELD = 3  # copies of a row count's K/V alive at once: mlx-lm's cache twice while its first
# append regrows it and kvfn's states, then mlx-lm's grown cache, kvfn's states and their
# packed copy


def kv_bytes(model, rows: int, batch: int, dtype) -> int:
    """K and V bytes of ``rows`` rows of every layer, for ``batch`` sequences."""
    a = model.args
    return 2 * batch * rows * a.num_hidden_layers * a.num_key_value_heads * a.head_dim * dtype.size


def device_bytes():
    """The GPU's memory in bytes, where MLX reports it (None elsewhere)."""
    info = mx.device_info()
    return info.get("total_memory") or info.get("memory_size")


def check_memory(p, model, rows: list, room: int, batch: int, dtype, memory) -> None:
    weights = weights_bytes(model)
    for R in rows:
        need = weights + HELD * kv_bytes(model, R + room, batch, dtype)
        if memory and need > memory:
            p.error(f"argument --rows: {R} rows of --batch {batch} need about {need / 1e9:.1f} GB "
                    f"(the weights and {HELD} copies of the rows), more than the device's "
                    f"{memory / 1e9:.1f} GB")  # fmt: skip


def row_names(splits: list, duo: bool) -> list:
    """The rows a run times, in order."""
    names = ["mlx-lm", "kvfn", "kvfn masked SDPA", *(f"kvfn {n} splits" for n in splits)]
    if duo:
        names.append("kvfn full")
        for name in ("duo", "duo slots"):
            names += [name, *(f"{name} {n} splits" for n in splits)]
    return names


def row_builders(model, caches, states, R: int, room: int, args) -> dict:
    """Per row name, a function that builds the row's decode loop (only rows that run are
    built; the Duo states once, for the rows that need them)."""
    compacted = lru_cache(maxsize=1)(lambda: packed(states, R, room))
    duo = lru_cache(maxsize=1)(lambda: duo_states(states, args.duo, room))
    b = args.batch
    rows = {
        "mlx-lm": lambda: mlx_loop(model, caches, b),
        "kvfn": lambda: kvfn_loop(kvfn.FunctionalModel(model), compacted(), b),
        "kvfn masked SDPA": lambda: variant_loop(model, compacted(), b, ENABLED=False),
        "kvfn full": lambda: kvfn_loop(kvfn.FunctionalModel(model), states, b),
        "duo": lambda: kvfn_loop(kvfn.FunctionalModel(model), duo()),
        "duo slots": lambda: kvfn_loop(kvfn.FunctionalModel(model), slots.pack_layers(duo())),
    }
    for n in args.splits:
        for name, state in (("kvfn", compacted), ("duo", duo),
                            ("duo slots", lambda: slots.pack_layers(duo()))):  # fmt: skip
            rows[f"{name} {n} splits"] = lambda state=state, n=n: variant_loop(
                model, state(), b, plan=fixed_splits(n)
            )
    return rows


def print_top(named: dict, top: int) -> None:
    for k, (n, per, us) in list(named.items())[:top]:
        print(f"      {n:6.1f} x {per:7.2f} us = {us:8.1f} us  {k}")


def piped(build):
    return lambda steps: pipelined_ms(build, steps, warmup=0)


def sync(build):
    return lambda steps: median_ms(lambda: mx.eval(build()), steps, warmup=0)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    p.add_argument("--q4", action="store_true", help="4-bit weights (group size 64)")
    p.add_argument("--rows", type=int, nargs="+", default=[1024, 4096])
    p.add_argument(
        "--batch", type=int, default=1, help="sequences decoded at once (not with --duo)"
    )
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=0, help="print each row's N costliest kernels")
    p.add_argument("--splits", type=int, nargs="*", default=[],
                   help="add kvfn rows whose split kernel takes this many key splits")  # fmt: skip
    p.add_argument(
        "--duo",
        type=float,
        metavar="RATIO",
        help="add DuoAttention rows at this retrieval ratio (R: the prompt's length)",
    )
    p.add_argument("--loops", nargs="+", help="run only the rows of these names (e.g. mlx-lm duo)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    check_at_least(p, "rows", args.rows)
    check_at_least(p, "steps", [args.steps])
    check_at_least(p, "batch", [args.batch])
    if args.batch > 1 and args.duo is not None:
        p.error(f"argument --batch: --duo rows run one sequence, got --batch {args.batch}")
    check_at_least(p, "splits", args.splits)
    check_at_least(p, "top", [args.top], low=0)
    check_duo(p, args.duo, args.rows, "--rows")
    names = row_names(args.splits, args.duo is not None)
    unknown = sorted(set(args.loops or ()) - set(names))
    if unknown:
        p.error(f"argument --loops: no rows named {unknown}; the rows are {names}")
    if not kvfn.kernels.on_cuda():
        raise SystemExit("profile_timeline reads CUDA kernels: run it with MLX's CUDA backend")
    dtype = mx.bfloat16
    model = random_model(args.shape, args.q4, dtype)
    room = 2 * (10 * WARM + args.steps) + 2  # a row's steps: its first, then both loops
    check_memory(p, model, args.rows, room, args.batch, dtype, device_bytes())
    results = {}
    for R in args.rows:
        caches, states = filled(model, R, room, dtype, args.batch)
        cleared()  # filling's float32 draws stay in MLX's buffer cache otherwise (batch 8 at 32K
        # ran out of memory at kvfn's first step)
        builders = row_builders(model, caches, states, R, room, args)
        for name in names:
            if args.loops and name not in args.loops:
                continue
            build = builders[name]()
            for mode, loop in (("piped", piped), ("sync", sync)):
                run = loop(build)
                # compiled traces, cuDNN plans, the buffer cache; the process's first loop
                # longer (on a fresh machine it read up to 1.7x slower than in a later process)
                run(WARM if results else 10 * WARM)
                kernels, api, wall = recorded(run, args.steps)
                s = summary(kernels, args.steps, wall, api)
                results[f"R={R} {name} {mode}"] = s
                classes = " ".join(f"{c} {t:.2f}" for c, t in s["classes_ms"].items())
                print(f"R={R:6d} {name:17s} {mode:5s} wall {s['wall_ms']:5.2f} busy "
                      f"{s['busy_ms']:5.2f} idle {s['idle_ms']:5.2f} (gaps>20us "
                      f"{s['gaps_over_20us']:4.1f}: {s['idle_in_gaps_over_20us_ms']:5.2f}) "
                      f"kernels {s['kernels']:5.0f} {s['kernel_ms']:5.2f} ms | {classes}",
                      flush=True)  # fmt: skip
                print_top(s["names"], args.top)
                if args.top:
                    print(f"    host CUDA API calls {s['api_ms']:.2f} ms a step:")
                    print_top(s["api"], args.top)
            del build
        del caches, states, builders
        cleared()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()

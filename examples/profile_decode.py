"""Where kvfn's compiled full-cache decode step loses to mlx-lm's eager step: the whole 8B-shaped
step (random weights, K/V filled with random rows, no prefill), timed synchronously and
pipelined, with and without kvfn's ragged kernel, holding the previous step's state or not.

    python examples/profile_decode.py --lengths 8192 32768            # MLX CUDA
    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \\
        --log-file ncu.csv python examples/profile_decode.py --lengths 8192 --ncu  # one step each
    python examples/profile_decode.py --read-ncu ncu.csv                  # its kernels per phase
    python examples/profile_decode.py --shape 1b --prefill-chunk 512       # host time a chunk
    python examples/profile_decode.py --shape 1b --lengths 1024 --primitives  # ops a step

sync        build + evaluate one step, median ms
piped       a greedy loop that builds step t+1 while step t runs (``mx.async_eval``), queuing
            and holding only the next token, as mlx-lm's generate_step does
piped-held  the same, but the step's state arrays are queued and stay referenced while the next
            step is queued, so no write is in place
/ mlx-lm    a row's sync and piped times over mlx-lm's: the median of the rounds' own ratios and
            their range (every other round runs the rows in reverse, as benchmark_decode.py)
--phases    one step's graph building, its ``async_eval`` (MLX encodes every kernel launch on
            the calling thread) and the wait for the GPU, started with the GPU idle

Rows: mlx-lm's eager step over its KVCache; kvfn's compiled ``decode`` over the same rows
(the ragged split kernel on CUDA); kvfn with the kernel off (SDPA with a mask array); on CUDA
also the split kernel in each ``--configs`` setting (G,U,B,S,T,W as in benchmark_kernels.py).
With ``--duo RATIO``, DuoAttention's states of the same rows (a random head pattern at that
retrieval ratio, 64 sinks + 256 recent rows) and the same in the slots layout:

    python examples/profile_decode.py --lengths 8192 32768 --duo 0.25 --phases   # host or GPU?
"""

import argparse
import collections
import csv
import ctypes
import io
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvfn  # isort: skip  (puts OpenBLAS in front before mlx loads)
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from examples.benchmark_decode import (  # noqa: E402
    SHAPES,
    cell,
    in_rounds,
    median_ms,
    paired_ratios,
    pipelined_ms,
    random_model,
)
from examples.benchmark_kernels import kernel_config, kernel_settings, patched  # noqa: E402
from kvfn import slots  # noqa: E402

MODES = ("sync", "piped", "piped-held")
VERSUS = ("sync", "piped")  # the modes a row's ratio to mlx-lm's is printed for


def mlx_loop(model, cache, batch: int = 1):
    box = [mx.ones((batch, 1), mx.int32)]

    def build():
        logits = model(box[0], cache=cache)
        box[0] = mx.argmax(logits[:, -1], axis=-1)[:, None]
        return [box[0]]

    return build


def kvfn_loop(fm, states, batch: int = 1):
    box = [mx.ones((batch, 1), mx.int32), tuple(states)]

    def build():
        logits, box[1] = fm.decode(box[0], box[1])
        box[0] = mx.argmax(logits, axis=-1)[:, None]
        return [box[0], *kvfn.tree.arrays(box[1])]

    build.box, build.fm = box, fm
    return build


def variant_loop(model, states, batch: int = 1, **settings):
    """``kvfn_loop`` of a new FunctionalModel whose step traces with these ``kvfn.kernels``
    settings (read when a step traces; restored after its first step)."""
    with patched(kvfn.kernels, **settings):
        build = kvfn_loop(kvfn.FunctionalModel(model), states, batch)
        mx.eval(build())
    build.settings = settings
    return build


def filled(model, L: int, room: int, dtype, batch: int = 1):
    """(mlx-lm caches, kvfn states) holding the same L random rows a layer, for each of
    ``batch`` sequences."""
    args = model.args
    shape = (batch, args.num_key_value_heads, L, args.head_dim)
    caches, states = make_prompt_cache(model), []
    for c in caches:
        k = mx.random.normal(shape).astype(dtype)
        v = mx.random.normal(shape).astype(dtype)
        c.update_and_fetch(k, v)
        states.append(kvfn.reserve(kvfn.from_full(k, v), L + room))
    mx.eval([c.keys for c in caches], [c.values for c in caches], kvfn.tree.arrays(states))
    return caches, tuple(states)


SINK, RECENT = 64, 256  # a Duo streaming head's rows in the --duo rows


def check_duo(p, ratio, lengths, flag: str) -> None:
    """``--duo``'s checks: a retrieval ratio in (0, 1), prompts longer than a ring."""
    if ratio is not None and not 0 < ratio < 1:
        p.error(f"argument --duo: a retrieval ratio in (0, 1), got {ratio}")
    if ratio is not None and min(lengths) <= SINK + RECENT:
        p.error(f"argument {flag}: with --duo each must exceed {SINK + RECENT}, got {lengths}")


def duo_policy(states, ratio: float, rng, sink: int = SINK, recent: int = RECENT) -> kvfn.Duo:
    """DuoAttention at ``ratio`` over a random head pattern (``rng``'s) for ``states``' layers."""
    scores = rng.random((len(states), states[0].keys.shape[1]))
    pattern = kvfn.HeadPattern(scores=scores, sink_size=sink, recent_size=recent)
    return kvfn.Duo.from_pattern(pattern, ratio=ratio)


def duo_states(states, ratio: float, room: int, seed: int = 0) -> tuple:
    """DuoAttention's states of ``states`` (full prompts), a random head pattern at ``ratio``."""
    policy = duo_policy(states, ratio, np.random.default_rng(seed))
    out, _ = kvfn.compact_states(states, None, policy, reserve=room)
    mx.eval(kvfn.tree.arrays(out))
    return out


def duo_rows(model, duo) -> dict:
    """Decode loops over Duo states and over the same rows in the slots layout."""
    return {"duo": kvfn_loop(kvfn.FunctionalModel(model), duo),
            "duo slots": kvfn_loop(kvfn.FunctionalModel(model), slots.pack_layers(duo))}  # fmt: skip


def primitives(outputs) -> collections.Counter:
    """The primitives (graph nodes that compute; each a kernel launch on the GPU, or fused
    into one) behind ``outputs``, by name, read off ``mx.export_to_dot``."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *outputs)
    return collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', dot.getvalue()))


def packed(states, L: int, room: int) -> tuple:
    """The states' first L rows as a packed state that is not dense (what a compaction
    gives), whose appends are scatters at a traced slot."""
    idx = mx.broadcast_to(mx.arange(L, dtype=mx.int32), states[0].positions.shape[:2] + (L,))
    return tuple(kvfn.reserve(kvfn.cache.gather(s, idx, packed=True), L + room) for s in states)


def primitives_table(model, caches, states, L: int, room: int, duo=None) -> dict:
    """Primitives of one decode step: mlx-lm's eager step, kvfn's compiled step over a dense
    state and over a packed one, and with ``duo`` states, over them and their slots layout."""
    rows = {"mlx-lm": mlx_loop(model, caches), "kvfn dense": kvfn_loop(kvfn.FunctionalModel(model), states),
            "kvfn packed": kvfn_loop(kvfn.FunctionalModel(model), packed(states, L, room))}  # fmt: skip
    if duo is not None:
        rows.update(duo_rows(model, duo))
    counts = {}
    for name, build in rows.items():
        mx.eval(build())  # the compiled step traces first
        counts[name] = primitives(build())
        top = ", ".join(f"{k} {n}" for k, n in counts[name].most_common(6))
        print(f"L={L:6d} {name:12s} {sum(counts[name].values()):5d} primitives a step ({top})")
    return counts


def phases_ms(build, steps: int) -> list:
    """Median ms of one step's phases with the GPU idle at its start: building the graph,
    ``async_eval`` (MLX encodes every kernel launch on the calling thread), waiting for the GPU."""
    ts = []
    for i in range(steps + 3):
        mx.synchronize()
        t0 = time.perf_counter()
        out = build()
        t1 = time.perf_counter()
        mx.async_eval(out)
        t2 = time.perf_counter()
        mx.eval(out)
        t3 = time.perf_counter()
        del out
        ts.append((t1 - t0, t2 - t1, t3 - t2))
    return [1e3 * statistics.median(t[i] for t in ts[3:]) for i in range(3)]


def profiler(on: bool) -> None:
    lib = ctypes.CDLL("libcuda.so.1")
    (lib.cuProfilerStart if on else lib.cuProfilerStop)()


def marker(name: str) -> None:
    """A named no-op kernel: ncu's kernel list reads as phases between markers."""
    kernel = mx.fast.cuda_kernel(name=name, input_names=["x"], output_names=["y"],
                                 source="y[0] = x[0];")  # fmt: skip
    mx.eval(kernel(inputs=[mx.zeros((1,))], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                   output_shapes=[(1,)], output_dtypes=[mx.float32]))  # fmt: skip
    mx.synchronize()


def read_ncu(path: str, top: int = 14) -> None:
    """The kernels of an ``--ncu`` run's CSV (``--csv --log-file``) per phase (between the
    marker kernels): count, summed duration, name and launch shape, largest first."""
    with open(path) as f:
        rows = list(csv.reader(f))
    at = next((i for i, r in enumerate(rows) if r[:1] == ["ID"]), None)
    if at is None:
        raise SystemExit(f'{path}: no ncu CSV header (a row starting with "ID")')
    phase, kernels = None, collections.defaultdict(list)
    for r in rows[at + 1 :]:
        d = dict(zip(rows[at], r))
        if "phase_" in d.get("Kernel Name", "phase_"):
            phase = d.get("Kernel Name", "").split("phase_")[-1].split("(")[0]
            continue
        if d.get("Metric Unit", "ns") not in ("ns", "nsecond"):
            raise SystemExit(f"{path}: durations in {d['Metric Unit']!r}, not ns (use --csv)")
        us = float(d["Metric Value"].replace(",", "")) / 1e3
        kernels[phase].append((d["Kernel Name"][:90] + f" {d['Grid Size']}x{d['Block Size']}", us))
    for phase, ks in kernels.items():
        if phase in (None, "end"):
            continue
        count, total = collections.Counter(), collections.Counter()
        for name, us in ks:
            count[name] += 1
            total[name] += us
        print(f"{phase}: {len(ks)} kernels, {sum(total.values()):.0f} us")
        for name, us in total.most_common(top):
            print(f"  {count[name]:4d} {us:8.1f} us  {name}")


def prefill_build_ms(model, chunk: int, repeat: int = 30) -> dict:
    """Median ms to build (not evaluate) the graph of one eager prefill chunk after a first:
    mlx-lm's, kvfn's (``forward``) and kvfn's scored (``scored_forward``, a 32-query window).
    A prefill evaluates each chunk before building the next, so this host time adds up."""
    fm = kvfn.FunctionalModel(model)
    tokens = mx.array([[1] * chunk])
    cache = make_prompt_cache(model)
    model(tokens, cache=cache)
    states = fm.forward(tokens, fm.init_states(1, 2 * chunk))[1]
    scores = tuple(mx.zeros((1, h, 2 * chunk)) for h in fm.n_heads)
    window = kvfn.QuerySlice(max(0, chunk - 32), chunk)
    mx.eval([c.state for c in cache], kvfn.tree.arrays(states), scores)
    builds = {
        "mlx-lm": lambda: model(tokens, cache=cache),
        "kvfn": lambda: fm.forward(tokens, states, check_ids=False),  # mlx-lm checks none
        "kvfn scored": lambda: fm.scored_forward(tokens, states, scores, window, check_ids=False),
    }
    times = {name: [] for name in builds}
    for _ in range(repeat):
        for name, build in builds.items():
            t = time.perf_counter()
            out = build()
            times[name].append(time.perf_counter() - t)
            del out  # freeing the unevaluated graph is not timed
        for c in cache:
            c.trim(chunk)  # mlx-lm's cache back to the first chunk
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    p.add_argument("--q4", action="store_true", help="4-bit weights (group size 64)")
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--configs", nargs="*", type=kernel_config, default=[],
                   metavar="G,U,B[,S[,T[,W]]]",
                   help="split kernel settings to add as rows (CUDA; default none)")  # fmt: skip
    p.add_argument("--phases", action="store_true", help="also time build / encode / wait")
    p.add_argument("--ncu", action="store_true", help="one step of each, between markers")
    p.add_argument("--primitives", action="store_true",
                   help="only count the primitives of one step (dense and packed states; "
                        "with --duo, Duo and slots states too)")  # fmt: skip
    p.add_argument("--duo", type=float, metavar="RATIO",
                   help="add DuoAttention rows (and the slots layout) at this retrieval ratio")  # fmt: skip
    p.add_argument("--read-ncu", metavar="CSV", help="print an --ncu run's kernels per phase")
    p.add_argument("--prefill-chunk", type=int, metavar="N",
                   help="only time building one eager prefill chunk's graph of N tokens")  # fmt: skip
    args = p.parse_args(argv)
    check_duo(p, args.duo, args.lengths, "--lengths")
    if args.read_ncu:
        return read_ncu(args.read_ncu)
    dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    model = random_model(args.shape, args.q4, dtype)
    if args.prefill_chunk:
        ms = prefill_build_ms(model, args.prefill_chunk)
        print(f"{args.shape}: ms to build one {args.prefill_chunk}-token prefill chunk's graph: "
              + ", ".join(f"{name} {t:.2f}" for name, t in ms.items()))  # fmt: skip
        return ms
    room = (3 * args.rounds + 1) * 2 * (args.steps + 8)
    if not (args.ncu or args.primitives):
        print(
            f"{args.shape}{' q4' if args.q4 else ''}, {dtype}, "
            f"ms per step (median of {args.rounds} rounds):"
            "     sync   piped  piped-held"
        )
    counted, timed = {}, {}
    for L in args.lengths:
        caches, states = filled(model, L, room, dtype)
        if args.primitives:
            duo = None if args.duo is None else duo_states(states, args.duo, room)
            counted[L] = primitives_table(model, caches, states, L, room, duo)
            continue
        fm = kvfn.FunctionalModel(model)
        mlx_build, kvfn_build = mlx_loop(model, caches), kvfn_loop(fm, states)
        duo = None if args.duo is None or args.ncu else duo_states(states, args.duo, room)
        del states
        if args.ncu:
            for _ in range(3):
                mx.eval(mlx_build()), mx.eval(kvfn_build())
            mx.synchronize()
            profiler(True)
            marker("phase_mlx")
            mx.eval(mlx_build())
            marker("phase_kvfn")
            mx.eval(kvfn_build())
            marker("phase_end")
            profiler(False)
            continue
        rows = {"mlx-lm": mlx_build, "kvfn": kvfn_build}
        rows["kvfn masked SDPA"] = variant_loop(model, kvfn_build.box[1], ENABLED=False)
        for config in args.configs if mx.default_device() == mx.gpu else ():
            rows["kvfn " + ",".join(map(str, config))] = variant_loop(
                model, kvfn_build.box[1], **kernel_settings(config)
            )
        if duo is not None:
            rows.update(duo_rows(model, duo))
            del duo
        if args.phases:
            for name, build in rows.items():
                cells = phases_ms(build, args.steps)
                print(f"L={L:6d} {name:18s} build {cells[0]:6.2f}  encode {cells[1]:6.2f}  "
                      f"wait {cells[2]:6.2f} ms", flush=True)  # fmt: skip
        times = in_rounds(timers(rows, args.steps), args.rounds)
        for name, build in rows.items():
            if getattr(build, "settings", None) and build.fm.traces != 1:
                raise RuntimeError(f"{name!r} traced again without {build.settings}: its state "
                                   "grew; give fewer --steps or --rounds")  # fmt: skip
        for name in rows:
            cells = [statistics.median(times[name, m]) for m in MODES]
            spread = max(max(t) - min(t) for m in MODES for t in [times[name, m]])
            row = timed[L, name] = dict(
                ms=dict(zip(MODES, cells)), rounds_ms={m: times[name, m] for m in MODES},
                **paired_ratios(times, {f"{m}_vs_mlx_lm": ((name, m), ("mlx-lm", m))
                                        for m in VERSUS}))  # fmt: skip
            print(f"L={L:6d} {name:18s} " + " ".join(f"{x:7.2f}" for x in cells)
                  + f"   (largest spread over rounds {spread:.2f})"
                  + ("" if name == "mlx-lm" else "   / mlx-lm " + " ".join(
                      f"{m} {cell(row, f'{m}_vs_mlx_lm')}" for m in VERSUS)),
                  flush=True)  # fmt: skip
        del caches, rows, mlx_build, kvfn_build
    return counted if args.primitives else timed


def timers(rows: dict, steps: int) -> dict:
    """Per (row, mode) a timer of one round; a row's modes run next to each other."""
    out = {}
    for name, build in rows.items():
        out[name, "sync"] = lambda b=build: median_ms(lambda: mx.eval(b()), steps)
        out[name, "piped"] = lambda b=build: pipelined_ms(b, steps)
        out[name, "piped-held"] = lambda b=build: pipelined_ms(b, steps, held=True)
    return out


if __name__ == "__main__":
    main()

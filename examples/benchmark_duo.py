"""DuoAttention's savings, side by side in one process: KV bytes and decode step time of
head-partitioned states vs the full cache and vs the union-plus-mask store (every row kept, the
streaming heads' dropped rows only masked).

    python examples/benchmark_duo.py --shape tiny --lengths 2048 8192 --ratios 0.25 0.5
    python examples/benchmark_duo.py --shape 8b --lengths 8192 32768 --ratios 0.25 0.5   # GPU
    python examples/benchmark_duo.py --shape 8b --lengths 32768 --ratios --adakv 1024     # ragged

Random-weight llama shapes (see benchmark_decode.py) and a random head pattern at each
retrieval ratio; streaming heads keep --sink + --recent rows. Step times are medians of kvfn's
compiled decode advancing the state (as a decode loop does: the old state's buffers are free to
be written in place); mlx-lm's eager step over its own full KVCache (trimmed back after each
step) is the reference. Host ms: building one compiled step's graph. With ``--rounds N`` every
loop of a ratio's row (the full caches' loops too) runs N times in turn; each time is the
median of its N and each ratio the median of the rounds' own ratios, printed with their range
(the machine's drift then hits all loops alike); one ratio's states are alive at a time.

Two step times per state: "sync", each step built then evaluated (host + GPU time add up), and
"pipelined", a greedy decode loop that builds step t+1 while step t runs (``mx.async_eval``, as
mlx-lm's generate_step does), so the step costs max(host, GPU) once the queue is full. "duo" is
the head-partitioned state (two groups a layer); "slots" the same rows in one buffer a layer
(``kvfn.slots``: each KV head owns a slot range, one write per array). "Step MB above live":
what a few steps of each kvfn state allocate beyond the arrays live before them, sync and
pipelined: about their activations when their writes are in place (a write that copies adds
its layer's K and V).
"""

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvfn  # isort: skip  (puts OpenBLAS in front before mlx loads)
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from examples import benchmark_decode  # noqa: E402
from examples.benchmark_decode import (  # noqa: E402
    SHAPES,
    cell,
    in_rounds,
    median_ms,
    mlx_prefill,
    paired_ratios,
    pipelined_ms,
    random_model,
    step_mb,
)
from examples.profile_decode import duo_policy, kvfn_loop, mlx_loop  # noqa: E402
from kvfn import cache as kv  # noqa: E402
from kvfn import slots as sl  # noqa: E402


def union_plus_mask(full: tuple, policy, P: int) -> tuple:
    """The full states with every row a streaming head dropped masked, nothing removed."""
    out = []
    for i, s in enumerate(full):
        heads = np.array(policy.heads[i])
        pos = np.arange(s.capacity)
        ring = (pos < policy.sink_tokens) | ((pos >= P - policy.recent) & (pos < P))
        keep = np.where(heads[:, None], pos[None] < P, ring[None]) | (pos >= P)  # free slots
        positions = mx.where(mx.array(keep)[None], s.positions, kv.EMPTY)
        out.append(s.replace(positions=positions, dense=False, packed=False))
    return tuple(out)


ROOM = 64  # rows reserved for the timed steps (warmup included)


def step_ms(fm, states, steps: int) -> float:
    """Median ms of a compiled decode step that advances the state, as a decode loop does (the
    old state is dropped, so its buffers can be written in place)."""
    if steps + 4 > ROOM:
        raise ValueError(f"at most {ROOM - 4} steps, got {steps}")
    token = mx.array([[1]])
    box = [tuple(states)]

    def step():
        logits, box[0] = fm.decode(token, box[0])
        mx.eval(logits, kvfn.tree.arrays(box[0]))

    return median_ms(step, steps)


def piped_ms(fm, states, steps: int) -> float:
    """Median ms per step of a greedy decode loop that builds each step while the previous one
    runs (``mx.async_eval``, as mlx-lm's generate_step)."""
    if steps + 5 > ROOM:
        raise ValueError(f"at most {ROOM - 5} steps, got {steps}")
    return pipelined_ms(kvfn_loop(fm, states), steps)


def mlx_piped_ms(model, cache, steps: int) -> float:
    ms = pipelined_ms(mlx_loop(model, cache), steps)
    for c in cache:
        c.trim(steps + 4)  # back to the prompt
    return ms


def host_ms(fm, states, steps: int) -> float:
    """Median ms to build one compiled decode step's graph on the host. Each step is evaluated
    before the next is built: steps built from one state each copy its cache, so holding them
    all at once runs out of memory on long rows."""
    token = mx.array([[1]])
    return benchmark_decode.host_ms(lambda: fm.decode(token, states)[0], steps)


def step_mbs(fm, **states) -> dict:
    """``benchmark_decode.step_mb`` of kvfn's decode loop, sync and pipelined, for each of
    ``states`` (name=states), as ``name_step_mb``."""
    return {f"{k}_step_mb": [step_mb(kvfn_loop(fm, s), piped=piped) for piped in (False, True)]
            for k, s in states.items()}  # fmt: skip


def mlx_step_ms(model, cache, steps: int) -> float:
    token = mx.array([[1]])

    def step():
        mx.eval(model(token, cache=cache))
        for c in cache:
            c.trim(1)  # back to the prompt: every step reads the same rows

    return median_ms(step, steps)


def run(args, model=None, tables: bool = True) -> list:
    """Every row of ``args``' lengths (``main``'s flags), over ``model`` if given (else a
    random-weight one of ``args.shape``); the tables at the end unless ``tables`` is False."""
    dtype = getattr(mx, args.dtype)
    model = random_model(args.shape, False, dtype) if model is None else model
    fm = kvfn.FunctionalModel(model)
    rng = np.random.default_rng(0)
    rows = []
    for L in args.lengths:
        tokens = rng.integers(0, 32000, L).tolist()
        cache = mlx_prefill(model, tokens[:-1], args.chunk)
        full = kvfn.prefill(fm, mx.array([tokens[:-1]]), capacity=L + ROOM,
                            prefill_step_size=args.chunk)  # fmt: skip
        mx.eval(kvfn.tree.arrays(full))
        P, steps = L - 1, args.steps
        base = dict(mlx_lm_full=functools.partial(mlx_step_ms, model, cache, steps),
                    mlx_lm_full_piped=functools.partial(mlx_piped_ms, model, cache, steps),
                    kvfn_full=functools.partial(step_ms, fm, full, steps),
                    kvfn_full_piped=functools.partial(piped_ms, fm, full, steps),
                    kvfn_full_host=functools.partial(host_ms, fm, full, steps))  # fmt: skip
        full_bytes = sum(kvfn.eviction.kept(s.replace(max_rows=P))[1] for s in full)
        full_step_mb = step_mbs(fm, kvfn_full=full)
        for ratio in args.ratios:  # one ratio's states alive at a time
            policy = duo_policy(full, ratio, rng, args.sink, args.recent)
            states, _ = kvfn.compact_states(full, None, policy, reserve=ROOM)
            duo_bytes = sum(kvfn.eviction.kept(s)[1] for s in states)
            masked = union_plus_mask(full, policy, P)
            packed = sl.pack_layers(states)
            mx.eval(kvfn.tree.arrays(packed))
            one = [fm.decode(mx.array([[1]]), s)[0] for s in (states, packed)]
            print(
                f"duo vs slots, one step: max |logit diff| {mx.abs(one[0] - one[1]).max().item():.3g}"
            )
            loops = dict(base, union_mask=functools.partial(step_ms, fm, masked, steps))
            for name, s in (("duo", states), ("slots", packed)):
                loops[name] = functools.partial(step_ms, fm, s, steps)
                loops[name + "_piped"] = functools.partial(piped_ms, fm, s, steps)
                loops[name + "_host"] = functools.partial(host_ms, fm, s, steps)
            times = in_rounds(loops, args.rounds)
            row = dict(L=L, ratio=ratio, **{n: statistics.median(t) for n, t in times.items()},
                       **paired_ratios(times, RATIOS), full_mb=full_bytes / 1e6,
                       duo_mb=duo_bytes / 1e6, **full_step_mb,
                       **step_mbs(fm, duo=states, slots=packed))  # fmt: skip
            del loops, states, masked, packed, s
            rows.append(row)
            print_row(row)
        for budget in args.adakv:  # Ada-KV's ragged rows against plain SnapKV rows, as many
            rows.append(ragged_row(fm, full, base, L, budget, args.rounds, steps, rng))
            print_ragged(rows[-1])
    if tables:
        print_tables(rows)
    return rows


def print_tables(rows: list) -> None:
    print_table([r for r in rows if "ratio" in r])
    print_ragged_table([r for r in rows if "budget" in r])


def ragged_row(fm, full, base: dict, L: int, budget: int, rounds: int, steps: int, rng) -> dict:
    """Ada-KV's ragged states (``kvfn.RaggedKVCache``, random scores: a random allocation) and
    SnapKV's plain ones at the same budget, timed beside the full caches."""
    scores = [mx.array(rng.random((1, h, s.capacity)), mx.float32)
              for h, s in zip(fm.n_heads, full)]  # fmt: skip
    states = {}
    for name, policy in (("ragged", kvfn.AdaKV(budget=budget)), ("plain", kvfn.SnapKV(budget))):
        states[name] = kvfn.compact_states(full, scores, policy, reserve=ROOM)[0]
        mx.eval(kvfn.tree.arrays(states[name]))
    loops = dict(base)
    for name, s in states.items():
        loops[name] = functools.partial(step_ms, fm, s, steps)
        loops[name + "_piped"] = functools.partial(piped_ms, fm, s, steps)
        loops[name + "_host"] = functools.partial(host_ms, fm, s, steps)
    times = in_rounds(loops, rounds)
    kept = sum(kvfn.eviction.kept(s)[1] for s in states["ragged"])
    full_bytes = sum(kvfn.eviction.kept(s.replace(max_rows=L - 1))[1] for s in full)
    return dict(L=L, budget=budget, **{n: statistics.median(t) for n, t in times.items()},
                **paired_ratios(times, RAGGED_RATIOS), kv_fraction=kept / full_bytes)  # fmt: skip


RAGGED_RATIOS = {
    "ragged_vs_kvfn_full": ("ragged", "kvfn_full"),
    "ragged_vs_mlx_lm_full": ("ragged", "mlx_lm_full"),
    "ragged_vs_plain": ("ragged", "plain"),
    "ragged_vs_kvfn_full_piped": ("ragged_piped", "kvfn_full_piped"),
    "ragged_vs_mlx_lm_full_piped": ("ragged_piped", "mlx_lm_full_piped"),
    "ragged_vs_plain_piped": ("ragged_piped", "plain_piped"),
}


def timed(r: dict, loop: str) -> str:
    """A loop's cell: ms a step sync / pipelined, and the host's ms building one in brackets."""
    return f"{r[loop]:.2f} / {r[loop + '_piped']:.2f} [{r[loop + '_host']:.2f}]"


def print_ragged(r: dict) -> None:
    print(
        f"L={r['L']:6d} adakv budget={r['budget']} | KV {r['kv_fraction']:.3f}x | step ms: "
        f"mlx-lm full {r['mlx_lm_full']:.2f}, kvfn full {r['kvfn_full']:.2f}, ragged "
        f"{r['ragged']:.2f}, plain {r['plain']:.2f} | pipelined: mlx-lm full "
        f"{r['mlx_lm_full_piped']:.2f}, kvfn full {r['kvfn_full_piped']:.2f}, ragged "
        f"{r['ragged_piped']:.2f}, plain {r['plain_piped']:.2f} | host ms: ragged "
        f"{r['ragged_host']:.2f}, plain {r['plain_host']:.2f}",
        flush=True,
    )


def print_ragged_table(rows: list) -> None:
    if not rows:
        return
    print("\nAda-KV (ragged rows, random allocation) and SnapKV (plain rows) at one budget, ms per "
          "step sync / pipelined, host ms in square brackets")  # fmt: skip
    print("| L | budget | KV | mlx-lm full | kvfn full | ragged | plain | " +
          " | ".join(n.replace("_", " ") for n in RAGGED_RATIOS) + " |")  # fmt: skip
    print("|" + "---|" * (7 + len(RAGGED_RATIOS)))
    for r in rows:
        print(
            f"| {r['L']} | {r['budget']} | {r['kv_fraction']:.3f}x "
            f"| {r['mlx_lm_full']:.2f} / {r['mlx_lm_full_piped']:.2f} "
            f"| {r['kvfn_full']:.2f} / {r['kvfn_full_piped']:.2f} "
            f"| {timed(r, 'ragged')} | {timed(r, 'plain')} "
            + "".join(f"| {cell(r, name)} " for name in RAGGED_RATIOS)
            + "|",
            flush=True,
        )


RATIOS = {  # a row's ratio: (its loop, the loop it is over)
    "duo_vs_mlx_lm_full": ("duo", "mlx_lm_full"),
    "duo_vs_union_mask": ("duo", "union_mask"),
    "slots_vs_mlx_lm_full": ("slots", "mlx_lm_full"),
    "slots_vs_kvfn_full": ("slots", "kvfn_full"),
    "slots_vs_mlx_lm_full_piped": ("slots_piped", "mlx_lm_full_piped"),
    "slots_vs_kvfn_full_piped": ("slots_piped", "kvfn_full_piped"),
    "duo_vs_mlx_lm_full_piped": ("duo_piped", "mlx_lm_full_piped"),
}


TABLE_RATIOS = ("slots_vs_mlx_lm_full", "slots_vs_kvfn_full", "slots_vs_mlx_lm_full_piped",
                "slots_vs_kvfn_full_piped", "duo_vs_mlx_lm_full_piped")  # fmt: skip


def print_row(r: dict) -> None:
    step_mb = ", ".join(
        f"{k.replace('_', ' ')} {r[f'{k}_step_mb'][0]:.1f} / {r[f'{k}_step_mb'][1]:.1f}"
        for k in ("kvfn_full", "duo", "slots")
    )
    print(
        f"L={r['L']:6d} ratio={r['ratio']:.2f} | KV MB full {r['full_mb']:8.1f} = union+mask, "
        f"duo {r['duo_mb']:8.1f} ({r['duo_mb'] / r['full_mb']:.2f}x) | step ms: mlx-lm full "
        f"{r['mlx_lm_full']:.2f}, kvfn full {r['kvfn_full']:.2f}, union+mask "
        f"{r['union_mask']:.2f}, duo {r['duo']:.2f} | duo / mlx-lm full "
        f"{cell(r, 'duo_vs_mlx_lm_full')}, duo / union+mask {cell(r, 'duo_vs_union_mask')} | "
        f"host ms: kvfn full {r['kvfn_full_host']:.2f}, duo {r['duo_host']:.2f}, slots "
        f"{r['slots_host']:.2f} | pipelined: mlx-lm full {r['mlx_lm_full_piped']:.2f}, kvfn full "
        f"{r['kvfn_full_piped']:.2f}, duo {r['duo_piped']:.2f}, slots {r['slots_piped']:.2f} | "
        f"step MB above live (sync / pipelined): {step_mb}",
        flush=True,
    )


def print_table(rows: list) -> None:
    """Every row once more as one markdown table: sync and pipelined ms, ratios to the full
    caches (pipelined ratios in the last columns)."""
    print("\nms per step: sync (host + GPU) / pipelined (async_eval); host ms in square brackets; a "
          "ratio is the median of the rounds' own ratios, their range in round brackets")  # fmt: skip
    print(
        "| L | ratio | KV | mlx-lm full | kvfn full | union+mask | duo | slots | slots / mlx-lm"
        " | slots / kvfn full | piped slots / mlx-lm | piped slots / kvfn full | piped duo / mlx-lm |"
    )
    print("|" + "---|" * 13)
    for r in rows:
        print(
            f"| {r['L']} | {r['ratio']:.2f} | {r['duo_mb'] / r['full_mb']:.2f}x "
            f"| {r['mlx_lm_full']:.2f} / {r['mlx_lm_full_piped']:.2f} "
            f"| {timed(r, 'kvfn_full')} | {r['union_mask']:.2f} | {timed(r, 'duo')} "
            f"| {timed(r, 'slots')} "
            + "".join(f"| {cell(r, name)} " for name in TABLE_RATIOS)
            + "|",
            flush=True,
        )


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--ratios", type=float, nargs="*", default=[0.25, 0.5])
    p.add_argument("--adakv", type=int, nargs="*", default=[], metavar="BUDGET",
                   help="also time Ada-KV's ragged rows (and SnapKV's plain ones) at these "
                   "budgets")  # fmt: skip
    p.add_argument("--sink", type=int, default=64)
    p.add_argument("--recent", type=int, default=256)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=1,
                   help="time every loop this many times in turn; report the medians")  # fmt: skip
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    for r in args.ratios:
        if not 0 <= r <= 1:
            p.error(f"argument --ratios: must be in [0, 1], got {r}")
    if args.rounds < 1 or not 1 <= args.steps <= ROOM - 5:
        p.error(
            f"need --rounds >= 1 and 1 <= --steps <= {ROOM - 5}, got {args.rounds}, {args.steps}"
        )
    for b in args.adakv:
        if not 36 <= b < min(args.lengths):
            p.error(f"argument --adakv: budgets must be in [36, {min(args.lengths)}), got {b}")
    if args.ratios and min(args.lengths) <= args.sink + args.recent:
        p.error(f"argument --lengths: must exceed --sink + --recent = {args.sink + args.recent}")
    rows = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()

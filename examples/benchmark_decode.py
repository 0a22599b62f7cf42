"""kvfn vs mlx-lm, side by side in one process: prefill, compaction and decode.

    python examples/benchmark_decode.py --shape tiny --lengths 1024 4096 --budgets 256
    python examples/benchmark_decode.py --shape 8b --lengths 8192 32768 --budgets 1024 4096   # GPU
    python examples/benchmark_decode.py --lengths 1024 2048 --budgets 128 256   # embedded SmolLM2

Shapes are random-weight llama models (no weights to load): tiny (hidden 512, 8 layers), 1b
(hidden 2048, 16 layers, 32/8 heads, head_dim 64), 8b (hidden 4096, 32 layers, 32/8 heads,
head_dim 128); --q4 quantizes their weights to 4 bits. Without --shape, the embedded SmolLM2 (or
--model). Tables:

prefill  per prompt length and chunk size: mlx-lm's chunked prefill (its KVCache) vs kvfn's
         scored prefill (window 32): seconds and peak GB above the weights, and their ratios;
         kvfn's prefill without scoring beside them, the scored one with the window scored by
         the stock ops instead of the CUDA kernels (kvfn.kernels.window; the same elsewhere),
         Expected Attention's (the queries' moments gathered in every chunk, then each layer's
         expected attention per row) and KVzip's (the unscored prefill, then its
         reconstruction pass over the context).
evict    the compaction after the last prefill chunk: kvfn.compact_states (one compiled step,
         no host sync) vs the same selection and gather done eagerly with checks
         (evict_prompt_cache), up to the first decoded token.
decode   ms per step: mlx-lm's eager step over a KVCache of L and of R rows; kvfn's compiled
         decode over the compacted R rows and over the full L rows; mlx-lm over kvfn's
         compacted interop cache; ratios, KV bytes and the byte-count bound
         (weights + L rows) / (weights + R rows). The MLX ceiling is mlx-lm's full step over
         its step over a cache of FLOOR_ROWS rows: the most that evicting rows can give while
         the rest of a step costs what mlx-lm's does. "floor / mlx R" is that floor over
         mlx-lm's step over R rows: the lowest "kvfn R / mlx R" that reading fewer rows can
         give; "kvfn R / floor" how far kvfn's compacted step sits above it.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvfn  # isort: skip  (puts OpenBLAS in front before mlx loads)
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models import llama  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from kvfn.kernels import window as window_kernel  # noqa: E402
from kvfn_eval.memory import cleared  # noqa: E402

SHAPES = {
    "tiny": dict(hidden_size=512, num_hidden_layers=8, intermediate_size=1408,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=64),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64),
    "8b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128),
}  # fmt: skip
VOCAB = 32000


def random_model(shape: str, q4: bool, dtype):
    args = llama.ModelArgs(model_type="llama", rms_norm_eps=1e-5, vocab_size=VOCAB,
                           rope_theta=500000.0, tie_word_embeddings=False, **SHAPES[shape])  # fmt: skip
    model = llama.Model(args)
    model.set_dtype(dtype)
    if q4:
        nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    return model


def weights_bytes(model) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def median_ms(step, steps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def pipelined_ms(build, steps: int, held: bool = False, warmup: int = 4) -> float:
    """Median ms per step when each step is built while the previous one runs (``async_eval``,
    as mlx-lm's generate_step does); ``build()`` returns the step's arrays, the logits or next
    token first. Only that first array is queued and kept between steps, as mlx-lm queues only
    its next token: the state arrays the next step reads are computed as its inputs. Queuing
    them too would hold them until the step's last command buffer completes (``mx.async_eval``
    keeps its outputs alive as the inputs of a final synchronizing array), so the next step's
    writes, encoded while this one runs, would copy their buffers instead of writing in place;
    ``held`` queues and keeps them all, to measure that."""
    times = []
    pending = None
    for _ in range(steps + warmup):
        t = time.perf_counter()
        out = build()
        queued = out if held else out[0]
        mx.async_eval(queued)
        if pending is not None:
            mx.eval(pending)
        pending = queued
        del out, queued
        times.append(time.perf_counter() - t)
    mx.eval(pending)
    return 1e3 * statistics.median(times[warmup:])


def step_mb(build, steps: int = 3, piped: bool = False, held: bool = False) -> float:
    """MB that ``steps`` steps of a decode loop (``build``, as ``pipelined_ms`` takes) allocate
    above the arrays live before them, after an untimed first step (it copies the state its
    caller still holds): about the steps' activations when their writes are in place; a write
    that copies adds its layer's K and V. ``piped``: pipelined, ``held`` as there."""
    mx.eval(build())
    mx.synchronize()
    live = mx.get_active_memory()

    def run():
        if piped:
            pipelined_ms(build, steps, held=held, warmup=0)
        else:
            for _ in range(steps):
                mx.eval(build())

    return (measured(run)[2] - live) / 1e6


def host_ms(build, steps: int) -> float:
    """Median ms to build one step's graph (no evaluation counted)."""
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        out = build()
        times.append(time.perf_counter() - t)
        mx.eval(out)
    return 1e3 * statistics.median(times)


def measured(fn):
    """(result, seconds, peak bytes) of fn(), which must evaluate what it returns."""
    mx.synchronize()
    mx.reset_peak_memory()
    t = time.perf_counter()
    out = fn()
    mx.synchronize()
    return out, time.perf_counter() - t, mx.get_peak_memory()


def mlx_prefill(model, tokens, chunk, progress=None):
    """mlx-lm's chunked prefill into its KVCache; ``progress(done, n)`` after each chunk."""
    cache = make_prompt_cache(model)
    for i in range(0, len(tokens), chunk):
        model(mx.array([tokens[i : i + chunk]]), cache=cache)
        mx.eval([c.state for c in cache])
        if progress is not None:
            progress(min(i + chunk, len(tokens)), len(tokens))
    return cache


def kvfn_prefill(fm, tokens, chunk, window=32):
    states, scores = kvfn.scored_prefill(fm, mx.array([tokens]), window=window,
                                         prefill_step_size=chunk)  # fmt: skip
    mx.eval(kvfn.cache.arrays(states), scores)
    return states, scores


def kvfn_expected_prefill(fm, tokens, chunk, sinks=4):
    """Expected Attention's prefill: the queries' moments gathered in every chunk, then each
    layer's expected attention over the prompt's rows."""
    context = mx.array([tokens])
    states, moments = kvfn.scored_prefill(fm, context, window=len(tokens) - sinks,
                                          statistic="moments", prefill_step_size=chunk)  # fmt: skip
    policy = kvfn.ExpectedAttention(budget=len(tokens) - 1, sink_tokens=sinks)
    scores = policy.score_prompt(fm, context, states, moments)
    mx.eval(kvfn.cache.arrays(states), scores)
    return states, scores


def kvfn_kvzip_prefill(fm, tokens, chunk):
    """KVzip's prefill: the plain prefill, then the reconstruction pass over its states (the
    context repeated, ``chunk`` queries a step; no instruction: random weights)."""
    context = mx.array([tokens])
    states = kvfn.prefill(fm, context, prefill_step_size=chunk)
    scores = kvfn.reconstruction_scores(fm, context, states, chunk=chunk)
    mx.eval(kvfn.cache.arrays(states), scores)
    return states, scores


def kvfn_plain_prefill(fm, tokens, chunk):
    states = kvfn.prefill(fm, mx.array([tokens]), prefill_step_size=chunk)
    mx.eval(kvfn.cache.arrays(states))
    return states


def kvfn_stock_prefill(fm, tokens, chunk):
    """kvfn's scored prefill with the window scored by the stock ops (the CUDA kernels off)."""
    with window_kernel.disabled():
        return kvfn_prefill(fm, tokens, chunk)


# beside mlx-lm and kvfn's SnapKV prefill
PREFILL_VARIANTS = ("plain", "stock", "expected", "kvzip")


def prefill_rows(model, fm, lengths, chunks, weights, variants=PREFILL_VARIANTS, rounds=3):
    fns = dict(mlx=mlx_prefill, kvfn=kvfn_prefill, plain=kvfn_plain_prefill,
               stock=kvfn_stock_prefill, expected=kvfn_expected_prefill,
               kvzip=kvfn_kvzip_prefill)  # fmt: skip
    names = ["mlx", "kvfn", *variants]
    rows = []
    for L in lengths:
        tokens = mx.random.randint(0, VOCAB, (L,), key=mx.random.key(L)).tolist()
        for chunk in chunks:
            runs = {name: [] for name in names}
            for r in range(rounds + 1):  # interleaved rounds after a warm-up one
                for name in names:
                    # else a run after mlx-lm's (whose cached buffers have other sizes)
                    # allocates where one after kvfn's reuses
                    cleared()
                    out, s, peak = measured(lambda: fns[name](model if name == "mlx" else fm,
                                                              tokens, chunk))  # fmt: skip
                    del out
                    if r:  # a cold run's host is slow, so fewer buffers are in flight
                        runs[name].append((s, peak - weights))
            # each side's best time and median peak (the peak moves with how far the host
            # runs ahead of the GPU: a buffer is freed when its kernel completes)
            best = {n: (min(t for t, _ in v), statistics.median(m for _, m in v))
                    for n, v in runs.items()}  # fmt: skip
            row = dict(L=L, chunk=chunk)
            for name, (t, m) in best.items():
                row.update({f"{name}_s": t, f"{name}_gb": m / 1e9})
            row.update(time_ratio=row["kvfn_s"] / row["mlx_s"],
                       mem_ratio=best["kvfn"][1] / max(best["mlx"][1], 1))  # fmt: skip
            rows.append(row)
    return rows


def evict_rows(fm, lengths, budgets, chunk):
    rows = []
    for L in lengths:
        tokens = mx.random.randint(0, VOCAB, (L,), key=mx.random.key(L + 1)).tolist()
        for R in budgets:
            if R >= L:
                continue
            policy = kvfn.SnapKV(budget=R)
            token = mx.array([[tokens[-1]]])

            def traced():
                states, scores = kvfn.scored_prefill(fm, mx.array([tokens[:-1]]), window=32,
                                                     prefill_step_size=chunk)  # fmt: skip
                mx.eval(kvfn.cache.arrays(states), scores)
                t = time.perf_counter()
                states, _ = kvfn.compact_states(states, scores, policy, reserve=8)
                logits, _ = fm.decode(token, states)
                mx.eval(logits)
                return time.perf_counter() - t

            def eager():
                states, scores = kvfn.scored_prefill(fm, mx.array([tokens[:-1]]), window=32,
                                                     prefill_step_size=chunk)  # fmt: skip
                mx.eval(kvfn.cache.arrays(states), scores)
                t = time.perf_counter()
                keep = [None if s.sliding_window is not None else policy.keep_indices(
                            sc[..., : L - 1], prompt_length=L - 1, n_kv_heads=s.keys.shape[1],
                            layer=i) for i, (s, sc) in enumerate(zip(states, scores))]  # fmt: skip
                states, _ = kvfn.evict_prompt_cache(states, keep)
                states = tuple(kvfn.reserve(s, s.capacity + 8) for s in states)
                logits, _ = fm.decode(token, states)
                mx.eval(logits)
                return time.perf_counter() - t

            traced(), eager()  # compile and warm up
            t_traced = min(traced() for _ in range(3))
            t_eager = min(eager() for _ in range(3))
            rows.append(dict(L=L, R=R, traced_ms=1e3 * t_traced, eager_ms=1e3 * t_eager))
    return rows


FLOOR_ROWS = 16  # a step that reads almost no KV rows: the weights and launches alone


def own_copy(states) -> tuple:
    """States holding their own buffers: a view kept elsewhere (mlx-lm's interop cache) would
    stop the originals' writes from being in place."""
    return tuple(s.replace(keys=mx.array(s.keys), values=mx.array(s.values),
                           positions=mx.array(s.positions)) for s in states)  # fmt: skip


def in_rounds(timers: dict, rounds: int) -> dict:
    """Each timer's results (ms), one a round over ``rounds`` in which every timer runs once in
    turn, every other round in reverse (the shared machine's drift then hits all alike, and no
    timer always runs first)."""
    times = {name: [] for name in timers}
    order = list(timers)
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            times[name].append(timers[name]())
    return times


def paired(times: dict, a, b) -> tuple:
    """(median, lowest, highest) over the rounds of a round's ``a`` over its ``b``: the two ran
    in the same round, so a ratio sees less of the machine's drift than a ratio of medians."""
    ratios = [x / y for x, y in zip(times[a], times[b])]
    return statistics.median(ratios), min(ratios), max(ratios)


def paired_ratios(times: dict, pairs: dict) -> dict:
    """Each ``name: (a, b)`` of ``pairs`` as ``paired`` gives it: ``name`` the median ratio,
    ``name_range`` its [lowest, highest]."""
    out = {}
    for name, (a, b) in pairs.items():
        mid, lo, hi = paired(times, a, b)
        out[name], out[name + "_range"] = mid, [lo, hi]
    return out


def decode_rows(model, fm, lengths, budgets, chunk, steps, weights, rounds=3):
    """Every step below is timed once a round (``in_rounds``: a shared machine's load moves
    between them): each time is the median over rounds of a round's median, each ratio the
    median of a round's ratios, with their range (``<ratio>_range``) and the rounds' times
    (``rounds_ms``). The compacted, full-cache, ceiling and pipelined pairs run next to each
    other in a round; the speedups' pairs further apart."""
    rows = []
    token = mx.array([[1]])
    room = rounds * (steps + 4) + 8  # rows a timed loop appends

    def mlx_build(cache):
        return lambda: [model(token, cache=cache)[:, -1]]

    def kvfn_build(states):
        box = [states]

        def build():
            logits, box[0] = fm.decode(token, box[0])
            return [logits, *kvfn.cache.arrays(box[0])]

        return build

    def sync(build):
        return lambda: median_ms(lambda: mx.eval(build()), steps)

    for L in lengths:
        tokens = mx.random.randint(0, VOCAB, (L,), key=mx.random.key(L + 2)).tolist()
        full = kvfn.prefill(fm, mx.array([tokens[:-1]]), capacity=L + room,
                            prefill_step_size=chunk)  # fmt: skip
        full_kv = sum(kvfn.eviction.stored_bytes(s, L - 1) for s in full)
        timers = dict(
            floor=sync(mlx_build(mlx_prefill(model, tokens[:FLOOR_ROWS], chunk))),
            mlx_full=sync(mlx_build(mlx_prefill(model, tokens[:-1], chunk))),
            kvfn_full=sync(kvfn_build(full)),
        )
        del full
        kept = {}
        for R in [R for R in budgets if R < L]:
            states, result = kvfn.compact(fm, tokens, kvfn.SnapKV(budget=R),
                                          max_new_tokens=room, prefill_step_size=chunk)  # fmt: skip
            kept[R] = result.total_bytes_after

            def small(R=R):
                return mlx_build(mlx_prefill(model, tokens[:R], chunk))

            timers.update({  # each timed loop its own state or cache
                ("kvfn", R): sync(kvfn_build(own_copy(states))),
                ("mlx", R): sync(small()),
                ("interop", R): sync(mlx_build(kvfn.to_mlx_cache(own_copy(states)))),
                ("kvfn_host", R): lambda b=kvfn_build(own_copy(states)): host_ms(b, steps),
                ("mlx_host", R): lambda b=small(): host_ms(b, steps),
                ("kvfn_piped", R): lambda b=kvfn_build(states): pipelined_ms(b, steps),
                ("mlx_piped", R): lambda b=small(): pipelined_ms(b, steps),
            })  # fmt: skip
            del states
        times = in_rounds(timers, rounds)
        del timers
        t = {name: statistics.median(ms) for name, ms in times.items()}
        for R, kept_kv in kept.items():
            ratios = paired_ratios(times, dict(
                kvfn_R_vs_mlx_R=(("kvfn", R), ("mlx", R)),
                kvfn_full_vs_mlx_full=("kvfn_full", "mlx_full"),
                speedup_kvfn=("mlx_full", ("kvfn", R)),
                speedup_interop=("mlx_full", ("interop", R)),
                mlx_ceiling=("mlx_full", "floor"),
                kvfn_vs_mlx_pipelined=(("kvfn_piped", R), ("mlx_piped", R)),
                floor_vs_mlx_R=("floor", ("mlx", R)),
                kvfn_R_vs_floor=(("kvfn", R), "floor"),
            ))  # fmt: skip
            rows.append(dict(
                L=L, R=R, mlx_full_ms=t["mlx_full"], mlx_R_ms=t["mlx", R],
                kvfn_R_ms=t["kvfn", R], kvfn_full_ms=t["kvfn_full"],
                mlx_interop_ms=t["interop", R], kvfn_R_host_ms=t["kvfn_host", R],
                mlx_R_host_ms=t["mlx_host", R], kvfn_R_pipelined_ms=t["kvfn_piped", R],
                mlx_R_pipelined_ms=t["mlx_piped", R], mlx_floor_ms=t["floor"],
                **ratios,
                rounds_ms=dict(kvfn_R=times["kvfn", R], mlx_R=times["mlx", R],
                               interop_R=times["interop", R], kvfn_full=times["kvfn_full"],
                               mlx_full=times["mlx_full"], floor=times["floor"],
                               kvfn_R_piped=times["kvfn_piped", R],
                               mlx_R_piped=times["mlx_piped", R]),  # fmt: skip
                kept_kv_mb=kept_kv / 1e6, full_kv_mb=full_kv / 1e6,
                byte_bound=(weights + full_kv) / (weights + kept_kv),
            ))  # fmt: skip
    return rows


def cell(row: dict, name: str) -> str:
    """A ratio and, where the rounds gave different ones, their range."""
    lo, hi = row[name + "_range"]
    spread = f" ({lo:.2f}-{hi:.2f})" if f"{lo:.2f}" != f"{hi:.2f}" else ""
    return f"{row[name]:.2f}{spread}"


def markdown(result: dict) -> str:
    out = ["prefill (seconds / GB peak above the weights)", "",
           "| L | chunk | mlx-lm s / GB | kvfn scored s / GB | time ratio | memory ratio | kvfn unscored s / GB | kvfn scored, stock ops s / GB | kvfn expected s / GB | kvfn kvzip s / GB |",
           "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in result["prefill"]:
        out.append(f"| {r['L']} | {r['chunk']} | {r['mlx_s']:.3f} / {r['mlx_gb']:.2f} | "
                   f"{r['kvfn_s']:.3f} / {r['kvfn_gb']:.2f} | {r['time_ratio']:.2f} | "
                   f"{r['mem_ratio']:.2f} | "
                   + " | ".join(f"{r[n + '_s']:.3f} / {r[n + '_gb']:.2f}" if n + "_s" in r
                                else "-" for n in PREFILL_VARIANTS) + " |")  # fmt: skip
    out += ["", "eviction after prefill, to the first decoded token (ms)", "",
            "| L | R | compiled compact_states | eager, checked | saved |", "|---|---|---|---|---|"]  # fmt: skip
    for r in result["evict"]:
        out.append(f"| {r['L']} | {r['R']} | {r['traced_ms']:.1f} | {r['eager_ms']:.1f} | "
                   f"{r['eager_ms'] - r['traced_ms']:.1f} |")  # fmt: skip
    out += ["", "decode (ms per step; a ratio is the median of the rounds' own ratios, their "
            "range in brackets)", "",
            "| L -> R | mlx-lm full L | mlx-lm R rows | kvfn compacted R | kvfn full L | mlx-lm over kvfn interop | kvfn R / mlx R | kvfn full / mlx full | speedup kvfn | speedup interop | MLX ceiling | byte bound |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in result["decode"]:
        out.append(f"| {r['L']} -> {r['R']} | {r['mlx_full_ms']:.2f} | {r['mlx_R_ms']:.2f} | "
                   f"{r['kvfn_R_ms']:.2f} | {r['kvfn_full_ms']:.2f} | {r['mlx_interop_ms']:.2f} | "
                   + " | ".join(cell(r, n) for n in ("kvfn_R_vs_mlx_R", "kvfn_full_vs_mlx_full",
                                                     "speedup_kvfn", "speedup_interop",
                                                     "mlx_ceiling"))
                   + f" | {r['byte_bound']:.2f} |")  # fmt: skip
    out += ["", "decode over R rows: host graph building, steps pipelined with async_eval, and "
            f"mlx-lm's floor, its step over {FLOOR_ROWS} rows (ms)", "",
            "| L -> R | mlx-lm host | kvfn host | mlx-lm pipelined | kvfn pipelined | kvfn / mlx-lm pipelined | mlx-lm floor | floor / mlx R | kvfn R / floor |",
            "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in result["decode"]:
        out.append(f"| {r['L']} -> {r['R']} | {r['mlx_R_host_ms']:.2f} | {r['kvfn_R_host_ms']:.2f} | "
                   f"{r['mlx_R_pipelined_ms']:.2f} | {r['kvfn_R_pipelined_ms']:.2f} | "
                   f"{cell(r, 'kvfn_vs_mlx_pipelined')} | {r['mlx_floor_ms']:.2f} | "
                   f"{cell(r, 'floor_vs_mlx_R')} | {cell(r, 'kvfn_R_vs_floor')} |")  # fmt: skip
    return "\n".join(out)


def check_at_least(parser, name: str, values: list, low: int = 1) -> None:
    bad = [v for v in values if v < low]
    if bad:
        parser.error(f"argument --{name}: values must be >= {low}, got {bad}")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), help="a random-weight llama shape")
    p.add_argument("--q4", action="store_true", help="4-bit weights (with --shape)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on a GPU, float32 on the CPU")  # fmt: skip
    p.add_argument("--model", help="a .gguf file or mlx-lm folder (no --shape; default SmolLM2)")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--budgets", type=int, nargs="+", default=[256])
    p.add_argument("--chunks", type=int, nargs="+", default=[512], help="prefill chunk sizes")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed (median)")
    p.add_argument("--rounds", type=int, default=3,
                   help="interleaved rounds of every prefill and decode timing")  # fmt: skip
    p.add_argument("--tables", nargs="+", default=["prefill", "evict", "decode"],
                   choices=["prefill", "evict", "decode"])  # fmt: skip
    p.add_argument(
        "--prefill-variants",
        nargs="*",
        default=list(PREFILL_VARIANTS),
        choices=PREFILL_VARIANTS,
        help="kvfn prefills timed beside mlx-lm and SnapKV's",
    )
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    check_at_least(p, "lengths", args.lengths, 64)
    check_at_least(p, "budgets", args.budgets, 40)
    check_at_least(p, "chunks", args.chunks)
    check_at_least(p, "steps", [args.steps])
    check_at_least(p, "rounds", [args.rounds])
    if args.q4 and not args.shape:
        p.error("argument --q4: needs --shape")
    gpu = mx.default_device() == mx.gpu
    dtype = getattr(mx, args.dtype or ("bfloat16" if gpu else "float32"))
    if args.shape:
        model = random_model(args.shape, args.q4, dtype)
    else:
        import kvfn_models

        model, _ = kvfn_models.load(args.model)
        if args.dtype:
            model.set_dtype(dtype)
    fm = kvfn.FunctionalModel(model)
    weights = weights_bytes(model)
    result = dict(device=str(mx.default_device()), shape=args.shape or args.model or "smollm2",
                  q4=args.q4, dtype=str(dtype), weights_gb=weights / 1e9, prefill=[], evict=[],
                  decode=[])  # fmt: skip
    chunk = args.chunks[0]
    if "prefill" in args.tables:
        result["prefill"] = prefill_rows(
            model, fm, args.lengths, args.chunks, weights, args.prefill_variants, args.rounds
        )
    if "evict" in args.tables:
        result["evict"] = evict_rows(fm, args.lengths, args.budgets, chunk)
    if "decode" in args.tables:
        result["decode"] = decode_rows(model, fm, args.lengths, args.budgets, chunk, args.steps,
                                       weights, args.rounds)  # fmt: skip
    print(f"{result['device']}, {result['shape']}{' q4' if args.q4 else ''}, {dtype}, "
          f"weights {result['weights_gb']:.2f} GB")  # fmt: skip
    print(markdown(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()

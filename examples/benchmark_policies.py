"""What a policy's own scoring costs beside mlx-lm's prefill, side by side in one process.

    python examples/benchmark_policies.py --shape tiny --lengths 512 --pass-chunk 128   # CPU
    python examples/benchmark_policies.py --shape 8b --lengths 8192 32768   # GPU: both tables

Shapes are benchmark_decode's random-weight llama models (no weights to load). Tables:

kvzip    per prompt length: mlx-lm's chunked prefill (its KVCache); kvfn's plain prefill (the
         states ``kvfn.compact`` prefills, capacity P); and that prefill followed by KVzip's
         reconstruction pass over its states (``kvfn.reconstruction_scores``, the states held
         throughout, as ``compact`` holds them), with instructions of the real ones' lengths
         (random ids: random weights read no text). Seconds and peak GB above the weights;
         the ratios to mlx-lm's are the median of each round's own ratios (the timers run in
         interleaved rounds, every other one reversed), their range in brackets.
decode   benchmark_duo.py's decode steps over the same model: DuoAttention at ratio 0.25 (its
         two-group and slots layouts) and Ada-KV's ragged rows beside SnapKV's plain ones, each
         against kvfn's and mlx-lm's full caches (sync and pipelined ms, paired ratios).
"""

import argparse
import contextlib
import io
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvfn  # isort: skip  (puts OpenBLAS in front before mlx loads)
import mlx.core as mx  # noqa: E402

from examples import benchmark_duo  # noqa: E402
from examples.benchmark_decode import (  # noqa: E402
    SHAPES,
    VOCAB,
    cell,
    check_at_least,
    cleared,
    in_rounds,
    measured,
    mlx_prefill,
    paired_ratios,
    random_model,
    weights_bytes,
)

# token counts of KVzip's instructions with Llama 3's tokenizer and chat template: the first
# chunk's (the repeat instruction and the assistant turn), a later chunk's resume instruction
# (the previous chunk's last 8 tokens follow it) and the assistant turn alone
HEADS = dict(prompt=13, resume=12, suffix=5)


def instructions(seed: int = 0) -> dict:
    """Random token ids of ``HEADS``' lengths."""
    ids = mx.random.randint(0, VOCAB, (sum(HEADS.values()),), key=mx.random.key(seed)).tolist()
    out, at = {}, 0
    for name, n in HEADS.items():
        out[name], at = tuple(ids[at : at + n]), at + n
    return out


def kvfn_prefill(fm, tokens, chunk):
    states = kvfn.prefill(fm, mx.array([tokens]), capacity=len(tokens), prefill_step_size=chunk)
    mx.eval(kvfn.cache.arrays(states))
    return states


def kvfn_kvzip(fm, tokens, chunk, pass_chunk, heads):
    """The prefill, then KVzip's pass over its states (held, as ``compact`` holds them)."""
    states = kvfn_prefill(fm, tokens, chunk)
    scores = kvfn.reconstruction_scores(fm, mx.array([tokens]), states, chunk=pass_chunk, **heads)
    mx.eval(scores)
    return states, scores


def timed(fn) -> tuple:
    """(seconds, peak bytes) of ``fn()`` from a cleared device, its result dropped."""
    cleared()
    out, seconds, peak = measured(fn)
    del out
    return seconds, peak


def kvzip_rows(model, fm, lengths, chunk, pass_chunk, weights, rounds):
    heads = instructions()
    rows = []
    for L in lengths:
        tokens = mx.random.randint(0, VOCAB, (L,), key=mx.random.key(L)).tolist()
        peaks = {}

        def timer(name, fn):
            def run():
                seconds, peak = timed(fn)
                peaks.setdefault(name, []).append(peak - weights)
                return seconds

            return run

        timers = dict(
            mlx=timer("mlx", lambda: mlx_prefill(model, tokens, chunk)),
            prefill=timer("prefill", lambda: kvfn_prefill(fm, tokens, chunk)),
            kvzip=timer("kvzip", lambda: kvfn_kvzip(fm, tokens, chunk, pass_chunk, heads)),
        )
        in_rounds(timers, 1)  # warm-up: compiles, kernel builds, first allocations
        peaks.clear()
        times = in_rounds(timers, rounds)
        gb = {name: statistics.median(p) / 1e9 for name, p in peaks.items()}
        row = dict(L=L, chunk=chunk, pass_chunk=pass_chunk, rounds_s=times,
                   rounds_gb={n: [p / 1e9 for p in v] for n, v in peaks.items()})  # fmt: skip
        for name, seconds in times.items():
            row[f"{name}_s"], row[f"{name}_gb"] = statistics.median(seconds), gb[name]
        row.update(paired_ratios(times, dict(time_ratio=("kvzip", "mlx"),
                                             prefill_ratio=("prefill", "mlx"))))  # fmt: skip
        row["mem_ratio"] = gb["kvzip"] / max(gb["mlx"], 1e-9)
        row["prefill_mem_ratio"] = gb["prefill"] / max(gb["mlx"], 1e-9)
        rows.append(row)
    return rows


def kvzip_table(rows: list) -> str:
    out = ["kvzip: mlx-lm's prefill vs kvfn's prefill + KVzip's pass (seconds / GB peak above the "
           "weights; medians over the rounds)", "",
           "| L | chunk / pass chunk | mlx-lm prefill | kvfn prefill | kvfn prefill + kvzip | "
           "time ratio | memory ratio | prefill time ratio | prefill memory ratio |",
           "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        out.append(f"| {r['L']} | {r['chunk']} / {r['pass_chunk']} | "
                   + " | ".join(f"{r[n + '_s']:.3f} / {r[n + '_gb']:.2f}"
                                for n in ("mlx", "prefill", "kvzip"))
                   + f" | {cell(r, 'time_ratio')} | {r['mem_ratio']:.2f} | "
                   f"{cell(r, 'prefill_ratio')} | {r['prefill_mem_ratio']:.2f} |")  # fmt: skip
    return "\n".join(out)


def decode_rows(model, fm, lengths, chunk, pass_chunk, weights, rounds) -> list:
    """benchmark_duo's rows over the same model: DuoAttention (ratio 0.25, 64 sinks, 256
    recent; less for prompts under 4K) and Ada-KV's ragged rows (budget 1024, or an eighth of a
    shorter prompt), each step beside kvfn's and mlx-lm's full caches."""
    short = min(lengths)  # a ring must be shorter than the prompt
    args = argparse.Namespace(shape="given", lengths=lengths, ratios=[0.25],
                              sink=min(64, short // 16), recent=min(256, short // 4),
                              chunk=chunk, steps=15, rounds=rounds, dtype=DTYPE_NAMES[fm.dtype],
                              adakv=[min(1024, max(36, min(lengths) // 8))])  # fmt: skip
    return benchmark_duo.run(args, model, tables=False)


def decode_table(rows: list) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        benchmark_duo.print_tables(rows)
    return out.getvalue()


TABLES = {"kvzip": (kvzip_rows, kvzip_table), "decode": (decode_rows, decode_table)}
DTYPE_NAMES = {mx.float32: "float32", mx.bfloat16: "bfloat16", mx.float16: "float16"}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny",
                   help="a random-weight llama shape")  # fmt: skip
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on a GPU, float32 on the CPU")  # fmt: skip
    p.add_argument("--lengths", type=int, nargs="+", default=[1024])
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (both sides)")
    p.add_argument("--pass-chunk", type=int, default=2048, help="context tokens a KVzip step")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds")
    p.add_argument("--tables", nargs="+", default=list(TABLES), choices=list(TABLES))
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    check_at_least(p, "lengths", args.lengths, 16)
    check_at_least(p, "chunk", [args.chunk])
    check_at_least(p, "pass-chunk", [args.pass_chunk])
    check_at_least(p, "rounds", [args.rounds])
    gpu = mx.default_device() == mx.gpu
    dtype = getattr(mx, args.dtype or ("bfloat16" if gpu else "float32"))
    model = random_model(args.shape, False, dtype)
    fm = kvfn.FunctionalModel(model)
    weights = weights_bytes(model)
    result = dict(device=str(mx.default_device()), shape=args.shape, dtype=str(dtype),
                  weights_gb=weights / 1e9)  # fmt: skip
    print(f"{result['device']}, {args.shape}, {dtype}, weights {result['weights_gb']:.2f} GB",
          flush=True)  # fmt: skip
    for name in args.tables:
        rows_of, table = TABLES[name]
        result[name] = rows_of(model, fm, args.lengths, args.chunk, args.pass_chunk, weights,
                               args.rounds)  # fmt: skip
        print(table(result[name]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()

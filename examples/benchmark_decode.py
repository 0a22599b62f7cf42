"""Decode-step and scored-prefill benchmark: kvfn vs mlx-lm, side by side in one process.

    python examples/benchmark_decode.py --lengths 512 1024 2048 --budgets 128 256

Per prompt length L and budget R, the median time of one decode step:
  compacted  kvfn compiled step on a SnapKV-compacted state (R rows kept of L)
  plain-R    kvfn compiled step on a plain state holding R rows
  mlx-R      mlx-lm's own eager step over a KVCache of R rows
  mlx-compacted  mlx-lm's eager step over the same compacted rows (kvfn.interop.CompactedKVCache)
  full       kvfn compiled step on the full L-row state;  mlx-full: mlx-lm over L rows
with the KV bytes held, the peak memory while decoding, and the byte-count bound: the speedup
over the full cache if a step cost only the bytes it reads, (weights + full KV bytes) /
(weights + kept KV bytes). Per L, prefill time and peak memory with and without window scoring.
With --plot, a PNG of decode step time vs L per budget, next to the bound.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvfn  # isort: skip  (puts OpenBLAS in front before mlx loads)
import kvfn_models  # noqa: E402
import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from kvfn import FunctionalModel  # noqa: E402
from kvfn import cache as kv  # noqa: E402
from kvfn import compact_prompt_cache, prefill, scored_prefill
from kvfn.evict import stored_bytes  # noqa: E402
from kvfn.interop import to_mlx_cache  # noqa: E402


def time_steps(step, steps: int, warmup: int = 3) -> float:
    """Median seconds of ``step()`` (which must evaluate its own outputs)."""
    for _ in range(warmup):
        step()
    times = []
    mx.reset_peak_memory()
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def kvfn_decoder(fm, states):
    box = {"states": states, "token": mx.array([[1]], mx.int32)}

    def step():
        logits, box["states"] = fm.decode(box["token"], box["states"])
        mx.eval(logits, kv.arrays(box["states"]))

    return step


def mlx_lm_decoder(model, tokens):
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([tokens]), cache=cache))
    token = mx.array([[1]])

    def step():
        mx.eval(model(token, cache=cache)[:, -1])

    return step


def mlx_lm_cache_decoder(model, caches):
    token = mx.array([[1]])

    def step():
        mx.eval(model(token, cache=caches)[:, -1])

    return step


def timed(fn):
    mx.reset_peak_memory()
    t = time.perf_counter()
    out = fn()
    mx.eval(kv.arrays(out[0] if isinstance(out[0], tuple) else out))
    return out, time.perf_counter() - t, mx.get_peak_memory()


def run(args) -> dict:
    model, _ = kvfn_models.load(args.model)
    fm = FunctionalModel(model)
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    rows, prefills = [], []
    for L in args.lengths:
        tokens = mx.random.randint(0, model.args.vocab_size, (L,), key=mx.random.key(L)).tolist()
        ctx = mx.array([tokens[:-1]])
        cap = L + args.steps + 8
        prefill(fm, ctx, capacity=cap, prefill_step_size=args.prefill_step_size)  # compile once
        scored_prefill(fm, ctx, capacity=cap, prefill_step_size=args.prefill_step_size, window=32)
        plain, t_plain, m_plain = timed(
            lambda: prefill(fm, ctx, capacity=cap, prefill_step_size=args.prefill_step_size)
        )
        _, t_scored, m_scored = timed(
            lambda: scored_prefill(
                fm, ctx, capacity=cap, prefill_step_size=args.prefill_step_size, window=32
            )
        )
        prefills.append(
            dict(
                L=L,
                plain_s=t_plain,
                scored_s=t_scored,
                ratio=t_scored / t_plain,
                plain_peak_mb=m_plain / 1e6,
                scored_peak_mb=m_scored / 1e6,
            )
        )
        full_kv = sum(stored_bytes(s, int(s.rows.item())) for s in plain)
        full = kvfn_decoder(fm, plain)
        t_full = time_steps(full, args.steps)
        peak_full = mx.get_peak_memory()
        t_mlx_full = time_steps(mlx_lm_decoder(model, tokens[:-1]), args.steps)
        for R in args.budgets:
            if R >= L:
                continue
            compacted, _ = compact_prompt_cache(
                fm,
                tokens,
                budget=R,
                window=32,
                max_new_tokens=args.steps + 8,
                prefill_step_size=args.prefill_step_size,
            )
            small = prefill(fm, mx.array([tokens[:R]]), capacity=R + args.steps + 8)
            kept_kv = sum(stored_bytes(s, int(s.rows.item())) for s in compacted)
            t_c = time_steps(kvfn_decoder(fm, compacted), args.steps)
            peak_c = mx.get_peak_memory()
            t_mc = time_steps(mlx_lm_cache_decoder(model, to_mlx_cache(compacted)), args.steps)
            t_p = time_steps(kvfn_decoder(fm, small), args.steps)
            t_m = time_steps(mlx_lm_decoder(model, tokens[:R]), args.steps)
            rows.append(
                dict(
                    L=L,
                    R=R,
                    compacted_ms=t_c * 1e3,
                    mlx_compacted_ms=t_mc * 1e3,
                    plain_R_ms=t_p * 1e3,
                    mlx_R_ms=t_m * 1e3,
                    full_ms=t_full * 1e3,
                    mlx_full_ms=t_mlx_full * 1e3,
                    compacted_vs_plain=t_c / t_p,
                    compacted_vs_mlx_R=t_c / t_m,
                    full_vs_compacted=t_full / t_c,
                    mlx_full_vs_mlx_compacted=t_mlx_full / t_mc,
                    compacted_tok_s=1 / t_c,
                    full_tok_s=1 / t_full,
                    kept_kv_mb=kept_kv / 1e6,
                    full_kv_mb=full_kv / 1e6,
                    weights_mb=weights / 1e6,
                    byte_bound=(weights + full_kv) / (weights + kept_kv),
                    compacted_peak_mb=peak_c / 1e6,
                    full_peak_mb=peak_full / 1e6,
                )
            )
    return {"device": str(mx.default_device()), "decode": rows, "prefill": prefills}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["decode"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    lengths = sorted({r["L"] for r in rows})
    full = {r["L"]: r["full_ms"] for r in rows}
    mlx_full = {r["L"]: r["mlx_full_ms"] for r in rows}
    ax.plot(lengths, [full[L] for L in lengths], "k-o", label="full (kvfn)")
    ax.plot(lengths, [mlx_full[L] for L in lengths], "k--", label="full (mlx-lm)")
    for R in sorted({r["R"] for r in rows}):
        pts = [(r["L"], r["compacted_ms"], r["full_vs_compacted"], r["byte_bound"])
               for r in rows if r["R"] == R]  # fmt: skip
        L, ms, speedup, bound = zip(*pts)
        line = ax.plot(L, ms, "-o", label=f"compacted R={R}")[0]
        ax.plot(L, [r["mlx_compacted_ms"] for r in rows if r["R"] == R], "--",
                color=line.get_color(), label=f"mlx-lm compacted R={R}")  # fmt: skip
        bx.plot(L, speedup, "-o", color=line.get_color(), label=f"kvfn R={R}")
        bx.plot(L, [r["mlx_full_vs_mlx_compacted"] for r in rows if r["R"] == R], "--",
                color=line.get_color(), label=f"mlx-lm R={R}")  # fmt: skip
        bx.plot(L, bound, ":", color=line.get_color(), label=f"byte bound R={R}")
    ax.set(xscale="log", xlabel="prompt tokens L", ylabel="decode step, ms",
           title=f"decode step ({result['device']})")  # fmt: skip
    bx.set(xscale="log", xlabel="prompt tokens L", ylabel="full / compacted",
           title="speedup over the full cache")  # fmt: skip
    ax.legend(fontsize=7)
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def table(result: dict) -> str:
    out = [
        "| L | R | compacted ms | mlx-compacted ms | plain-R ms | mlx-R ms | full ms | mlx-full ms | compacted/plain-R | compacted/mlx-R | full/compacted |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["decode"]:
        out.append(
            f"| {r['L']} | {r['R']} | {r['compacted_ms']:.2f} | {r['mlx_compacted_ms']:.2f} | "
            f"{r['plain_R_ms']:.2f} | {r['mlx_R_ms']:.2f} | "
            f"{r['full_ms']:.2f} | {r['mlx_full_ms']:.2f} | {r['compacted_vs_plain']:.3f} | "
            f"{r['compacted_vs_mlx_R']:.3f} | {r['full_vs_compacted']:.3f} |"
        )
    out += [
        "",
        "| L | R | compacted tok/s | full tok/s | kept KV MB | full KV MB | weights MB | full/compacted | mlx-full/mlx-compacted | byte bound | peak MB compacted | peak MB full |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["decode"]:
        out.append(
            f"| {r['L']} | {r['R']} | {r['compacted_tok_s']:.1f} | {r['full_tok_s']:.1f} | "
            f"{r['kept_kv_mb']:.1f} | {r['full_kv_mb']:.1f} | {r['weights_mb']:.0f} | "
            f"{r['full_vs_compacted']:.2f} | {r['mlx_full_vs_mlx_compacted']:.2f} | "
            f"{r['byte_bound']:.2f} | "
            f"{r['compacted_peak_mb']:.0f} | {r['full_peak_mb']:.0f} |"
        )
    out += [
        "",
        "| L | prefill s | scored prefill s | ratio | peak MB | scored peak MB |",
        "|---|---|---|---|---|---|",
    ]
    for p in result["prefill"]:
        out.append(
            f"| {p['L']} | {p['plain_s']:.2f} | {p['scored_s']:.2f} | {p['ratio']:.3f} | "
            f"{p['plain_peak_mb']:.0f} | {p['scored_peak_mb']:.0f} |"
        )
    return "\n".join(out)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="a .gguf file or mlx-lm folder (default: embedded SmolLM2)")
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--budgets", type=int, nargs="+", default=[128, 256])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prefill-step-size", type=int, default=512)
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--plot", help="also draw them into this PNG")
    args = p.parse_args(argv)
    for name in ("lengths", "budgets"):
        bad = [v for v in getattr(args, name) if v < 40]
        if bad:
            p.error(f"argument --{name}: values must be >= 40 (window 32 + sinks), got {bad}")
    if args.steps < 1:
        p.error(f"argument --steps: must be >= 1, got {args.steps}")
    result = run(args)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()

"""Every prompt its own length: what a new prompt length costs, policy by policy, through the
public API (``kvfn.compact`` or ``kvfn.prefill``, then ``fm.decode``), against the same policy at
a repeated length and mlx-lm's ``generate_step`` over a full cache of the same prompt, in one
process, on a random-weight model.

python examples/benchmark_shapes.py                                   # tiny shape, CPU-sized
python examples/benchmark_shapes.py --shape qwen05 --lengths 3000:4100:8 --dtype bfloat16   # GPU
python examples/benchmark_shapes.py ... --compiled-compaction         # compact_states compiled
python examples/benchmark_shapes.py ... --compile-after 64            # decode eager at a new shape

Per request: the compaction (or prefill) with its arrays evaluated, the first decode step, and
decode tokens/s over the rest; ``traces``: the compiled steps ``fm.decode`` traced meanwhile.
Each row (mlx-lm, then each policy) gets its own N lengths of the range, so that no row's new
length was seen earlier in the process (MLX keeps per-shape work across rows, such as cuDNN's
attention graphs). Each length runs twice in a row: "new" then "repeat" (the same prompt,
everything warm). The first request is "cold"; the other new ones split into those that opened a
bucket (a decode trace, or a prefill into a ``kvfn.wrapper.bucket`` no kvfn request of the process
had met: its attention shapes are new) and those that found theirs warm (mlx-lm: every new one
after its first; it has no buckets). Ratios: a warm-bucket new length to its repeat, every new length to mlx-lm's new lengths of the same range,
and the decode step to SnapKV's.
"""

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvfn  # isort: skip  (puts OpenBLAS in front before mlx loads)
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models import llama, qwen2  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from kvfn.wrapper import bucket  # noqa: E402

SHAPES = {
    "tiny": (llama, dict(model_type="llama", hidden_size=256, num_hidden_layers=4,
                         intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, vocab_size=4096)),
    "qwen05": (qwen2, dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24,
                           intermediate_size=4864, num_attention_heads=14,
                           num_key_value_heads=2, vocab_size=151936)),
    "8b": (llama, dict(model_type="llama", hidden_size=4096, num_hidden_layers=32,
                       intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, vocab_size=32000)),
}  # fmt: skip
POLICIES = "full,snapkv,streaming,chunkkv,kvzip,adakvzip-global,duo"


def random_model(shape: str, dtype, bits: Optional[int] = None):
    """A random-weight model of ``shape`` in ``dtype``, its weights quantized to ``bits``."""
    module, settings = SHAPES[shape]
    args = module.ModelArgs(rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
                            **settings)  # fmt: skip
    model = module.Model(args)
    model.set_dtype(dtype)
    if bits:
        nn.quantize(model, bits=bits)
    mx.eval(model.parameters())
    return model


def make_policy(name: str, fm, budget: int, window: int):
    if name == "full":
        return None
    if name == "duo":  # half the KV heads of each layer retrieval heads
        heads = tuple(tuple(h % 2 == 0 for h in range(n)) for n in fm.n_kv_heads)
        return kvfn.Duo(retrieval=heads, sink_tokens=4, recent=budget - 4)
    return kvfn.parse_policy(name, budget=budget, window=window)


def request(fm, ids, policy, new_tokens: int, compiled: bool) -> dict:
    traces = fm.traces
    tic = time.perf_counter()
    if policy is None:
        states = kvfn.prefill(fm, mx.array([ids[:-1]]), capacity=len(ids) + new_tokens)
    else:
        states, _ = kvfn.compact(fm, ids, policy, max_new_tokens=new_tokens, compiled=compiled)
    mx.eval(kvfn.tree.arrays(states))
    compacted = time.perf_counter()
    first, done, _ = greedy(fm, ids[-1], states, new_tokens)
    return {"compact_s": compacted - tic, "first_s": first - compacted,
            "decode_tps": (new_tokens - 1) / (done - first), "traces": fm.traces - traces}  # fmt: skip


def greedy(fm, last: int, states, new_tokens: int) -> tuple:
    """``new_tokens`` greedy steps of ``fm.decode`` from the token ``last``, pipelined: the
    clock when the first token is out, when the last is, and the states."""
    token = mx.array([[last]])
    for i in range(new_tokens):
        logits, states = fm.decode(token, states)
        token = mx.argmax(logits, axis=-1)[:, None]
        mx.async_eval(token)
        if i == 0:
            mx.eval(token)
            first = time.perf_counter()
    mx.eval(token)
    return first, time.perf_counter(), states


def mlx_lm_request(model, ids, new_tokens: int) -> dict:
    tic = time.perf_counter()
    steps = generate_step(mx.array(ids), model, prompt_cache=make_prompt_cache(model),
                          max_tokens=new_tokens)  # fmt: skip
    next(steps)
    first = time.perf_counter()
    for _ in steps:
        pass
    done = time.perf_counter()
    return {"compact_s": 0.0, "first_s": first - tic,
            "decode_tps": (new_tokens - 1) / (done - first), "traces": 0}  # fmt: skip


def summary(rows: list[dict]) -> dict:
    keys = ("compact_s", "first_s", "decode_tps", "traces")
    return {k: round(float(np.mean([r[k] for r in rows])), 3) for k in keys}


def seconds(r: dict, new_tokens: int) -> float:
    return r["compact_s"] + r["first_s"] + (new_tokens - 1) / r["decode_tps"]


def ratio(rows: list, against: list, args) -> Optional[float]:
    if not rows:
        return None
    total = lambda rs: sum(seconds(r, args.new_tokens) for r in rs)  # noqa: E731
    return round(total(rows) / total(against), 3)


def table(out: list, lengths: list, budget: int, args) -> None:
    base = seconds(out[0]["new"], args.new_tokens)
    snap = next((r["new"]["decode_tps"] for r in out if r["policy"] == "snapkv"), None)
    print(
        f"\n{args.shape} {args.dtype}, lengths {min(lengths)}-{max(lengths)} ({len(lengths)}, "
        f"each row its own), budget {budget}, "
        f"{'compiled' if args.compiled_compaction else 'eager'} compaction, compile_after "
        f"{args.compile_after}, trace_slack {args.trace_slack}; seconds per request"
    )
    print(
        f"{'policy':<16}{'cold':>8}{'new':>8}{'repeat':>8}{'vs mlx-lm':>10}"
        f"{'warm new/rep':>14}{'tok/s new':>10}{'step/snapkv':>12}{'traces new':>11}"
    )
    for r in out:
        t = {k: seconds(r[k], args.new_tokens) for k in ("cold", "new", "repeat")}
        warm = "-" if r["warm_new_x"] is None else f"{r['warm_new_x']:.2f} ({r['warm_new']})"
        step = "-" if snap is None else f"{snap / r['new']['decode_tps']:.2f}"
        print(f"{r['policy']:<16}{t['cold']:>8.3f}{t['new']:>8.3f}{t['repeat']:>8.3f}"
              f"{t['new'] / base:>10.2f}{warm:>14}{r['new']['decode_tps']:>10.1f}{step:>12}"
              f"{r['new']['traces']:>11}")  # fmt: skip
    print(
        "targets: warm new/rep <= 1.10; vs mlx-lm <= 1.2 (window-scored, scoring-free); "
        "adakvzip-global step/snapkv <= 1.2"
    )


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--lengths", default="300:420:6", help="LOW:HIGH:N distinct prompt lengths")
    p.add_argument("--policies", default=POLICIES)
    p.add_argument("--budget", type=float, default=0.125, help="a share of the shortest prompt")
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=12)
    p.add_argument("--compiled-compaction", action="store_true",
                   help="compact_states compiled (a trace per prompt length)")  # fmt: skip
    p.add_argument(
        "--compile-after",
        type=int,
        default=0,
        help="FunctionalModel(compile_after=N): a shape's first N steps eager",
    )
    p.add_argument("--trace-slack", type=float, default=kvfn.wrapper.TRACE_SLACK,
                   help="FunctionalModel(trace_slack=F): ragged layers padded to a trace made "
                        "before where that costs at most F more memory")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    low, high, n = (int(x) for x in args.lengths.split(":"))
    names = ["mlx-lm", *args.policies.split(",")]
    if not 2 <= low < high or n < 2 or n * len(names) > high - low:
        p.error(f"--lengths needs 2 <= LOW < HIGH and 2 <= N, N x {len(names)} rows (mlx-lm "
                f"and each policy) <= HIGH - LOW, got {args.lengths}")  # fmt: skip
    rng = np.random.default_rng(args.seed)
    # each row its own lengths, spread over the range: no row's new length was seen before in
    # this process (MLX keeps per-shape work, cuDNN's attention graphs, across rows)
    every = sorted(rng.choice(np.arange(low, high), size=n * len(names), replace=False).tolist())
    model = random_model(args.shape, getattr(mx, args.dtype))
    vocab = SHAPES[args.shape][1]["vocab_size"]
    prompts = {L: rng.integers(0, vocab, size=L).tolist() for L in every}
    budget = max(int(args.budget * low), args.window + 8)
    out, met = [], set()  # the prefill buckets kvfn requests have met
    for r, name in enumerate(names):
        lengths = every[r :: len(names)]
        fm = kvfn.FunctionalModel(model, compile_after=args.compile_after,
                                  trace_slack=args.trace_slack)  # each starts cold
        policy = None if name == "mlx-lm" else make_policy(name, fm, budget, args.window)

        def one(L):
            if name == "mlx-lm":
                return mlx_lm_request(model, prompts[L], args.new_tokens)
            opened = bucket(L - 1) not in met
            met.add(bucket(L - 1))
            got = request(fm, prompts[L], policy, args.new_tokens, args.compiled_compaction)
            return {**got, "opened": opened}

        cold = one(lengths[0])
        pairs = [(one(L), one(L)) for L in lengths[1:]]
        news = [new for new, _ in pairs]
        warm = [i for i, new in enumerate(news) if not new["traces"] and not new.get("opened")]
        row = {
            "policy": name,
            "lengths": lengths,
            "budget": budget,
            "cold": summary([cold]),
            "new": summary(news),
            "repeat": summary([rep for _, rep in pairs]),
            "warm_new": len(warm),
            "warm_new_x": ratio([news[i] for i in warm], [pairs[i][1] for i in warm], args),
        }
        print(json.dumps(row), flush=True)
        out.append(row)
    table(out, every, budget, args)
    return out


if __name__ == "__main__":
    main()

"""Where a process's first request evicting while it prefills (``kvfn.compact(max_rows=R)``)
spends the seconds its later requests do not: each prefill chunk and the first decoded tokens,
timed (the device waited for at every step) in a process's first request and in the requests
after it, each a new length, on a random-weight model. On MLX's CUDA backend the first request
paid 8-12 s more than the next (docs/benchmarks.md); this says in which steps.

python examples/profile_first_request.py                                         # tiny, CPU
python examples/profile_first_request.py --shape 8b --dtype bfloat16 --prompt-tokens 32768 \
    --rows 1024

Steps: ``first chunk`` (a forward over an empty cache), ``filling`` (the chunks before the rows
held pass the cap), ``first compaction`` (the chunk whose rows first pass the cap: its forward
and the compaction back to the cap), ``steady`` (every later chunk but the last, summed),
``last chunk`` (evaluated with the final selection its window scores, of other shapes; where the
first chunk passes the cap, ``first chunk`` holds the first compaction), ``first token`` (the
first decode step over the compacted states) and ``decode`` (the other new tokens). Waiting at
every step serialises the host and the device, so totals are above an unsettled run's.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvfn  # isort: skip  (puts OpenBLAS in front before mlx loads)
import mlx.core as mx  # noqa: E402
from benchmark_memory import model_arguments  # noqa: E402
from benchmark_shapes import SHAPES, random_model  # noqa: E402

STEPS = ("first chunk", "filling", "first compaction", "steady", "last chunk", "first token",
         "decode")  # fmt: skip


def request(fm, ids, args) -> dict:
    """One request's seconds a step (``STEPS``)."""
    marks = []

    def progress(done, total):
        mx.synchronize()
        marks.append((done, time.perf_counter()))

    policy = kvfn.SnapKV(budget=args.rows, window=args.window)
    tic = time.perf_counter()
    states, result = kvfn.compact(fm, ids, policy, max_new_tokens=args.new_tokens,
                                  prefill_step_size=args.prefill_step_size,
                                  max_rows=args.rows, progress=progress)  # fmt: skip
    mx.eval(kvfn.tree.arrays(states))
    prefilled = time.perf_counter()
    token, times = mx.array([[ids[-1]]]), []
    for _ in range(args.new_tokens):
        logits, states = fm.decode(token, states)
        token = mx.argmax(logits, axis=-1)[:, None]
        mx.eval(token)
        times.append(time.perf_counter())
    # one mark a chunk (its last); the first chunk before the last whose rows pass the cap
    # compacts (none: k is the last chunk, whose compaction is the final one)
    ends = sorted({d: t for d, t in marks}.items())
    s = [t - (ends[i - 1][1] if i else tic) for i, (_, t) in enumerate(ends)]
    last = len(s) - 1
    k = next((i for i, (d, _) in enumerate(ends[:last]) if d > args.rows), last)
    out = dict(zip(STEPS, (s[0], sum(s[1:k], 0.0), s[k] if 0 < k < last else 0.0,
                           sum(s[k + 1:last], 0.0), (s[last] if last else 0.0) + prefilled
                           - ends[-1][1], times[0] - prefilled, times[-1] - times[0])))  # fmt: skip
    out["chunks"] = len(s)
    out["total"] = times[-1] - tic
    out["peak_rows"] = result.peak_rows
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(p).set_defaults(prompt_tokens=4096)
    p.add_argument("--rows", type=int, default=256, help="the budget and the cap")
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--prefill-step-size", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--requests", type=int, default=3, help="each 37 tokens shorter than before")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    mx.random.seed(args.seed)
    model = random_model(args.shape, getattr(mx, args.dtype), args.bits)
    fm = kvfn.FunctionalModel(model)
    V = SHAPES[args.shape][1]["vocab_size"]
    rows = []
    for r in range(args.requests):
        P = args.prompt_tokens - 37 * r
        ids = np.random.default_rng(args.seed + r).integers(0, V, size=P).tolist()
        rows.append(dict(request=r + 1, prompt_tokens=P, **request(fm, ids, args)))
    print(f"{mx.default_device()}, shape {args.shape} {args.dtype}"
          f"{f' {args.bits}-bit' if args.bits else ''}, rows {args.rows}, chunks of "
          f"{args.prefill_step_size}; seconds a step, the device waited for at each")  # fmt: skip
    cols = ["request", "prompt_tokens", "chunks", *STEPS, "total"]
    print(" | ".join(cols))
    for row in rows:
        print(" | ".join(f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c])
                         for c in cols))  # fmt: skip
    first, later = rows[0], rows[1:]
    if later:
        print("first request less the mean of the later ones:")
        for c in [*STEPS, "total"]:
            print(f"  {c}: {first[c] - sum(r[c] for r in later) / len(later):+.3f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(args=vars(args), rows=rows), indent=1))
    return dict(rows=rows)


if __name__ == "__main__":
    main()

"""Where the time of a prefill that evicts as it goes (``kvfn.compact(max_rows=R)``) goes: the
whole prefill against mlx-lm's rotating cache in interleaved rounds, and one steady chunk
split into the host's graph building and the device's work, with the host reads it makes.

    python examples/profile_bounded.py                                    # CPU, 32 thin layers
    python examples/profile_bounded.py --shape 8b --dtype bfloat16 --prompt-tokens 32768 \\
        --rows 1024 --chunk 512                                           # GPU

Rows of the first table (seconds a prefill, to every array evaluated; min / median / max):
mlx-lm rotating     mlx-lm's ``RotatingKVCache(R, keep=4)``, a chunk a model call and an eval, as
                    ``generate_step`` prefills
kvfn bounded        ``kvfn.compact(max_rows=R)`` (SnapKV, budget R): a chunk computed while the
                    host builds the next one's graph
kvfn synchronous    the same, each chunk waited for before the next one's graph is built
kvfn compiled       ``compiled=True``: each chunk's compaction in one compiled trace, shared by
                    every prompt (its first round traces it)

The steady chunk (R rows held, one chunk prefilled and scored, compacted back to R): the
host's ms to build the forward's and the compaction's graphs, the device's ms to evaluate each
(after its graph is built), eager and compiled, and the host reads (``item``, ``tolist``) and
evals a whole prefill makes per chunk. Then the primitives of a steady chunk's compaction graph
(what its evaluation asks of the device before any fusion: on a GPU each kernel costs a launch).
"""

import argparse
import collections
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvfn  # isort: skip  (puts OpenBLAS in front before mlx loads)
import mlx.core as mx  # noqa: E402
from benchmark_shapes import SHAPES, random_model  # noqa: E402
from mlx_lm.models import llama  # noqa: E402
from mlx_lm.models.cache import RotatingKVCache  # noqa: E402

from kvfn import compaction  # noqa: E402
from kvfn.passes import _drain, _scored_steps, per_layer  # noqa: E402

# 32 layers of almost no compute: what a chunk costs the host shows
THIN = dict(model_type="llama", hidden_size=64, num_hidden_layers=32, intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=4096)  # fmt: skip


def model_of(shape: str, dtype):
    if shape != "thin":
        return random_model(shape, dtype)
    args = llama.ModelArgs(rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False, **THIN)
    model = llama.Model(args)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


class Counted:
    """Counts the host reads (``mx.array.item`` / ``tolist``) and ``mx.eval`` calls made inside
    it (evals of arrays already computing only wait)."""

    def __enter__(self):
        self.reads, self.evals, self._real = 0, 0, {}
        for name in ("item", "tolist"):
            real = self._real[name] = getattr(mx.array, name)
            setattr(mx.array, name, self._counted(real, "reads"))
        self._real["eval"] = mx.eval
        mx.eval = self._counted(mx.eval, "evals", method=False)
        return self

    def _counted(self, real, what, method=True):
        def call(*args, **kwargs):
            setattr(self, what, getattr(self, what) + 1)
            return real(*args, **kwargs)

        return call

    def __exit__(self, *exc):
        mx.eval = self._real.pop("eval")
        for name, real in self._real.items():
            setattr(mx.array, name, real)


def rotating(model, ids, args) -> float:
    tic = time.perf_counter()
    cache = [RotatingKVCache(max_size=args.rows, keep=4) for _ in model.layers]
    x = mx.array([ids])
    for i in range(0, x.shape[1], args.chunk):
        model(x[:, i : i + args.chunk], cache=cache)
        mx.eval([c.state for c in cache])
    return time.perf_counter() - tic


def bounded(fm, ids, args, compiled=False, synchronous=False) -> float:
    policy = kvfn.SnapKV(budget=args.rows, window=args.window)
    real = mx.async_eval
    if synchronous:
        mx.async_eval = mx.eval
    try:
        tic = time.perf_counter()
        states, _ = kvfn.compact(fm, ids, policy, max_rows=args.rows, compiled=compiled,
                                 prefill_step_size=args.chunk, max_new_tokens=1)  # fmt: skip
        mx.eval(kvfn.tree.arrays(states))
        return time.perf_counter() - tic
    finally:
        mx.async_eval = real


def steady(fm, ids, args, compiled: bool) -> tuple[dict, collections.Counter]:
    """One steady chunk's host and device ms (median of ``--repeats``), and the primitives of
    its compaction's graph (``graph_ops``; eager: a compiled one is one primitive)."""
    policy = kvfn.SnapKV(budget=args.rows, window=args.window)
    toks = mx.array([ids[: args.rows + args.chunk]])
    scored = dict(window=args.window, dtype=None, compiled=False, statistic="attention",
                  check_ids=False)  # fmt: skip
    held, sc = _drain(_scored_steps(fm, toks[:, : args.rows], states=None, capacity=args.rows,
                                    prefill_step_size=args.rows, **scored), None)  # fmt: skip
    mx.eval(per_layer(held, sc))
    got = {k: [] for k in ("forward host", "forward device", "compaction host",
                           "compaction device")}  # fmt: skip
    for r in range(args.repeats + 1):  # the first: traces, warms, and its graph is counted
        t0 = time.perf_counter()
        states, scores = _drain(_scored_steps(fm, toks[:, args.rows :], states=held,
                                              capacity=args.chunk, prefill_step_size=args.chunk,
                                              **scored), None)  # fmt: skip
        t1 = time.perf_counter()
        mx.eval(per_layer(states, scores))
        t2 = time.perf_counter()
        new = compaction._compacted(states, scores, policy, reserve=args.chunk, exact=True,
                                    compiled=compiled)[1]  # fmt: skip
        t3 = time.perf_counter()
        ops = graph_ops(kvfn.tree.arrays(new)) if r == 0 else ops
        mx.eval(per_layer(new))
        t4 = time.perf_counter()
        for k, v in zip(got, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            got[k].append(v)
    return {k: 1e3 * float(np.median(v[1:])) for k, v in got.items()}, ops


VIEWS = {"Broadcast", "ExpandDims", "Slice", "Squeeze", "Reshape"}  # mostly no kernel of their own


def graph_ops(arrays) -> collections.Counter:
    """The primitives of the lazy graph that computes ``arrays`` (``mx.export_to_dot``), by
    name: what evaluating it asks of the device, before any fusion."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "graph.dot"
        mx.export_to_dot(str(path), *arrays)
        return collections.Counter(re.findall(r'label ="?([A-Za-z]+)', path.read_text()))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=["thin", *sorted(SHAPES)], default="thin")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--rows", type=int, default=128, help="budget and cap (max_rows)")
    p.add_argument("--chunk", type=int, default=64, help="prefill_step_size")
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5, help="steady chunks measured")
    args = p.parse_args(argv)
    if args.rows < args.window + 4 or args.prompt_tokens <= args.rows + args.chunk:
        p.error("need rows >= window + 4 and prompt tokens > rows + chunk")
    model = model_of(args.shape, getattr(mx, args.dtype))
    fm = kvfn.FunctionalModel(model)
    vocab = THIN["vocab_size"] if args.shape == "thin" else SHAPES[args.shape][1]["vocab_size"]
    ids = np.random.default_rng(0).integers(0, vocab, size=args.prompt_tokens).tolist()
    runs = {
        "mlx-lm rotating": lambda: rotating(model, ids[:-1], args),
        "kvfn bounded": lambda: bounded(fm, ids, args),
        "kvfn synchronous": lambda: bounded(fm, ids, args, synchronous=True),
        "kvfn compiled": lambda: bounded(fm, ids, args, compiled=True),
    }
    chunks = len(compaction.bounded_chunks(len(ids) - 1, args.chunk, args.window))
    times = {k: [] for k in runs}
    for _ in range(args.rounds):
        for k, run in runs.items():
            times[k].append(run())
    print(f"{args.shape} {args.dtype}, {len(ids) - 1}-token context, {chunks} chunks of "
          f"{args.chunk}, {args.rows} rows; {args.rounds} interleaved rounds (the first cold)")
    print(f"{'prefill':<20}{'min s':>8}{'median s':>10}{'max s':>8}{'ms a chunk':>12}")
    for k, v in times.items():
        warm = v[1:] or v
        print(f"{k:<20}{min(warm):>8.3f}{np.median(warm):>10.3f}{max(warm):>8.3f}"
              f"{1e3 * np.median(warm) / chunks:>12.2f}")  # fmt: skip
    with Counted() as count:
        bounded(fm, ids, args)
    print(f"host reads {count.reads}, evals {count.evals} (every one a wait), in {chunks} chunks")
    out = {"times": times, "reads": count.reads, "evals": count.evals}
    for compiled in (False, True):
        ms, ops = steady(fm, ids, args, compiled)
        out[f"steady compiled={compiled}"] = ms
        print(f"steady chunk, compaction {'compiled' if compiled else 'eager':8s} ms: "
              + "  ".join(f"{k} {v:.2f}" for k, v in ms.items()))  # fmt: skip
        if not compiled:
            out["compaction graph"] = ops
    ops = out["compaction graph"]
    layers, total = len(model.layers), sum(ops.values())
    views = sum(n for k, n in ops.items() if k in VIEWS)
    print(f"steady chunk's compaction graph: {total} primitives ({total / layers:.0f} a layer), "
          f"{views} of them views; the others: "
          + ", ".join(f"{k} {n}" for k, n in ops.most_common() if k not in VIEWS))  # fmt: skip
    return out


if __name__ == "__main__":
    main()

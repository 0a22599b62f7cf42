"""What each config's peak memory is made of (issue 53): ``benchmark_memory``'s configs (mlx-lm's
full and rotating caches, kvfn's SnapKV after the prefill and evicting while it prefills), run
by its own functions in one process, a prefill and the first tokens each. Each config runs
three times: as benchmark_memory runs it (the peak), recorded (every prefill chunk waited for
at its end, the memory and the caches' bytes read there: in which chunk the peak happened) and
under ``mx.set_cache_limit(0)``; then the peak chunk is replayed in controlled experiments, one
thing varied at a time, over a cache of the same kind and rows, to split the peak into parts.

python examples/profile_peak.py --prompt-tokens 8192 --rows 512                          # CPU
python examples/profile_peak.py --shape 8b --dtype bfloat16 --prompt-tokens 32768 --rows 1024

Parts of the peak above the weights (MLX's peak memory counts active buffers, not its cache):
KV            the bytes of the caches (mlx-lm's ``nbytes``, kvfn's state arrays) that the peak
              chunk wrote into, as the config's own objects held them
scores        kvfn's per-key score arrays of the observation window
held          other arrays alive at the chunk's start: the active memory at the end of the
              chunk before, less its KV and scores
attention     the forward's transient that grows with the rows held: a forward of a chunk of
              the same size over a cache of the same kind and rows, minus the same forward over
              an empty cache (masks, the attention scores, a copy of a cache that grows by
              concatenation; "of which" lines: the cache copy, with and without room, and
              kvfn's window scoring, scored and unscored)
activations   that forward's transient over an empty cache (projections, MLP, norms, the
              chunk's attention over itself)
compaction    what kvfn's compaction (selection, gather, the new states) adds to the chunk's
              peak: the replayed chunk with it, less the chunk without it
in flight     the run's peak less the recorded one's (kvfn's bounded prefill computes a chunk
              while it builds the next one's graph)
remainder     the rest, unexplained (negative where parts were not alive at the same moment)
A transient is a forward's peak less what it left allocated. The logits of a chunk are
measured too (the same forward with its logits evaluated) and are not a part where the run
does not compute them: its chunk rose as the forward without them does. The allocator's
cache (``mx.get_cache_memory()``) is outside the peak; it is read at every chunk's end and
after the run. What the script sees of a run, it sees through hooks that only read sizes:
mlx-lm's ``prompt_progress_callback``, kvfn's ``progress`` and its internal ``per_layer`` and
``_compacted`` (kvfn.passes, kvfn.compaction).
"""

import argparse
import copy
import json
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvfn  # isort: skip  (puts OpenBLAS in front before mlx loads)
import benchmark_memory as bm  # noqa: E402
import mlx.core as mx  # noqa: E402
from benchmark_shapes import SHAPES, random_model  # noqa: E402
from kvfn_eval.memory import baseline  # noqa: E402
from mlx_lm.models.cache import KVCache, RotatingKVCache  # noqa: E402

from kvfn import compaction, passes  # noqa: E402
from kvfn.wrapper import QuerySlice  # noqa: E402

PARTS = ("kv", "scores", "held", "attention", "activations", "compaction", "in_flight",
         "remainder")


def nbytes(arrays) -> int:
    """Bytes of distinct arrays (lazy ones too: their shapes say)."""
    return sum({id(a): a.nbytes for a in arrays}.values())


def state_bytes(states) -> int:
    return nbytes(kvfn.tree.arrays(states))


class Recorder:
    """Memory at every prefill chunk's end: the segment since the last one (its peak above the
    base, the active memory after it, above the base) and what the config's caches held in it.
    The peak is reset at every end, so each segment's peak is its own."""

    def __init__(self):
        self.segments, self.seg = [], self._new()
        self.base = baseline()

    @staticmethod
    def _new() -> dict:
        return {"kv": 0, "kv_in": None, "scores": 0, "rows": None, "capacity": None,
                "compaction": None}  # fmt: skip

    def states(self, states, scores) -> None:
        """kvfn's states (and scores) as a chunk left them (``passes.per_layer``)."""
        self.seg["kv"], self.seg["scores"] = state_bytes(states), nbytes(scores or ())
        s = states[0]
        self.seg["capacity"] = getattr(s, "capacity", None)
        self.seg["rows_of"] = s.rows

    def compacted(self, states, scores, rows: int, reserve: int, new) -> None:
        """A compaction's input (the states the chunk wrote into) and output."""
        self.seg["kv_in"] = state_bytes(states)
        self.seg["capacity_in"] = getattr(states[0], "capacity", None)
        self.seg["scores"] = max(self.seg["scores"], nbytes(scores or ()))
        self.seg["compaction"] = {"rows": rows, "reserve": reserve, "out": state_bytes(new)}

    def end(self, cache=None) -> None:
        mx.synchronize()
        seg = self.seg
        seg["peak"] = mx.get_peak_memory() - self.base
        seg["active"] = mx.get_active_memory() - self.base
        seg["allocator_cache"] = mx.get_cache_memory()
        if cache is not None:  # mlx-lm's caches, as the chunk left them
            seg["kv"] = sum(c.nbytes for c in cache)
            seg["rows"] = mlx_rows(cache)
        elif "rows_of" in seg:
            seg["rows"] = int(mx.max(seg.pop("rows_of")).item())
        seg["kv_at_peak"] = seg["kv_in"] if seg["kv_in"] is not None else seg["kv"]
        self.segments.append(seg)
        self.seg = self._new()
        mx.reset_peak_memory()


@contextmanager
def recording(rec: Recorder):
    """``benchmark_memory``'s runs, unchanged, with a progress callback (mlx-lm's
    ``prompt_progress_callback``, kvfn's ``progress``) and kvfn's states and compactions seen
    on their way (only sizes are kept: a reference would hold the arrays)."""
    saved = (bm.generate_step, kvfn.compact, passes.per_layer, compaction.per_layer,
             compaction._compacted)  # fmt: skip
    gen, compact, per_layer, compacted = saved[0], saved[1], saved[2], saved[4]

    def generate_step(prompt, model, *, prompt_cache, **kw):
        def progress(done, total):
            if done:
                rec.end(prompt_cache)

        return gen(prompt, model, prompt_cache=prompt_cache, prompt_progress_callback=progress,
                   **kw)  # fmt: skip

    def compact_(*a, **kw):  # kvfn leaves its last chunk lazy: the final end records it
        return compact(*a, progress=lambda done, total: done < total and rec.end(), **kw)

    def per_layer_(states, scores=()):
        rec.states(states, scores)
        return per_layer(states, scores)

    def compacted_(states, scores, policy, **kw):  # compact_states' work, every caller's
        rows, new = compacted(states, scores, policy, **kw)
        rec.compacted(states, scores, rows, kw.get("reserve", 0), new)
        return rows, new

    bm.generate_step, kvfn.compact = generate_step, compact_
    passes.per_layer = compaction.per_layer = per_layer_
    compaction._compacted = compacted_
    try:
        yield rec
    finally:
        (bm.generate_step, kvfn.compact, passes.per_layer, compaction.per_layer,
         compaction._compacted) = saved  # fmt: skip


def plain_run(config: str, model, ids, args) -> dict:
    """One ``benchmark_memory`` run of ``config``, as it runs it: its result and peak."""
    out = bm.above_weights(lambda: bm.measured(config, model, ids, args))
    out["peak"] = round(out.pop("peak_above_weights_gb") * 1e9)
    out["allocator_cache"] = mx.get_cache_memory()
    return out


def run_config(config: str, model, ids, args) -> dict:
    """One ``benchmark_memory`` run of ``config``, recorded: its result and its segments (the
    last one: the last chunk where kvfn leaves it lazy, the compaction and the first tokens).
    Every chunk is waited for at its end (kvfn's bounded prefill otherwise computes a chunk
    while it builds the next one's graph)."""
    out = {}

    def measure():
        rec = Recorder()
        with recording(rec):
            out.update(bm.measured(config, model, ids, args))
        rec.end()
        out["segments"] = rec.segments
        return out

    bm.above_weights(measure)
    out["peak"] = max(s["peak"] for s in out["segments"])  # the resets hid it from above_weights
    return out


# -- the replays: one chunk over a cache of the kind and rows the peak chunk read ------------


def fresh(a: mx.array) -> mx.array:
    """A copy in its own buffer (a shared one would be copied by the first write into it)."""
    b = a + mx.zeros((), a.dtype)
    mx.eval(b)
    return b


def measured_step(hold: list, step) -> dict:
    """``step(hold.pop())``'s arrays evaluated: its peak above what was active before it and
    what it left allocated (the input is handed over, so that its buffers can be reused)."""
    before = baseline()
    out = step(hold.pop())
    mx.eval(out["eval"])
    rise = mx.get_peak_memory() - before
    left = mx.get_active_memory() - before
    return {"rise": rise, "left": left, "transient": rise - left}


def mlx_rows(cache: list) -> int:
    """Rows an mlx-lm cache holds: a KVCache's offset (its buffer grows 256 rows at a time),
    a rotating cache's buffer (after a prefill chunk: ``max_size - 1`` plus the chunk)."""
    c = cache[0]
    if c.keys is None:
        return 0
    return c.offset if isinstance(c, KVCache) else c.keys.shape[2]


def mlx_cache(model, config, args, tokens, rows) -> list:
    """A cache as the config makes it, read through ``tokens`` until it holds ``rows`` rows."""
    make = bm.make_prompt_cache if config == "mlx-lm full" else None
    cache = make(model) if make else [RotatingKVCache(max_size=args.rows, keep=4)
                                      for _ in model.layers]  # fmt: skip
    done, step = 0, args.prefill_step_size
    while mlx_rows(cache) < rows and done < len(tokens):
        n = min(step, len(tokens) - done, rows - done if config == "mlx-lm full" else step)
        model(mx.array(tokens[done : done + n])[None], cache=cache)
        mx.eval([c.state for c in cache])
        done += n
    return cache


def clone(cache: list, room: int = 0) -> list:
    out = []
    for c in cache:
        d = copy.copy(c)
        if c.keys is not None:
            pad = [mx.zeros((*a.shape[:2], room, a.shape[3]), a.dtype) for a in (c.keys, c.values)]
            d.keys, d.values = (fresh(mx.concatenate([a, p], axis=2) if room else a)
                                for a, p in zip((c.keys, c.values), pad))  # fmt: skip
        out.append(d)
    return out


def mlx_replay(model, config, args, tokens, seg, chunk) -> dict:
    rows = seg["rows_before"]
    cache = mlx_cache(model, config, args, tokens, rows) if rows else None
    x = mx.array(tokens[:chunk])[None]

    def step(logits: bool):
        def run(c):
            out = model(x, cache=c)
            return {"eval": [s.state for s in c] + ([out] if logits else [])}

        return run

    def empty():
        return [KVCache() if config == "mlx-lm full" else RotatingKVCache(args.rows, keep=4)
                for _ in model.layers]  # fmt: skip

    def held(room=0):
        return [clone(cache, room) if cache else empty()]

    got = {"forward": measured_step(held(), step(False)),
           "logits": measured_step(held(), step(True)),
           "empty": measured_step([empty()], step(False))}  # fmt: skip
    if config == "mlx-lm full" and cache:  # the same forward with room: no concatenation
        got["room"] = measured_step(held(-(-chunk // 256) * 256), step(False))
    return got


def kvfn_states(fm, tokens, seg, args):
    """States of the kind, rows and capacity the peak chunk read: a dense prefill (kvfn's
    after-prefill config), or (evicting while prefilling) one compacted to those rows with
    room, as ``_bounded_steps`` leaves them."""
    rows, cap = seg["rows_before"], seg["capacity_before"]
    if not seg["packed"]:
        return kvfn.prefill(fm, tokens[:, :rows], capacity=cap) if rows else None
    src = tokens[:, : rows + args.prefill_step_size]
    states, scores = kvfn.scored_prefill(fm, src, window=args.window,
                                         prefill_step_size=args.prefill_step_size)  # fmt: skip
    policy = kvfn.SnapKV(budget=rows, window=args.window)
    return compaction.compact_states(states, scores, policy, reserve=cap - rows)[0]


def kvfn_replay(fm, args, tokens, seg, chunk) -> dict:
    states = kvfn_states(fm, tokens, seg, args)
    if states is not None:
        mx.eval(kvfn.tree.arrays(states))
    x = tokens[:, seg["start"] : seg["start"] + chunk]
    window = min(args.window, chunk) if seg["scored"] else 0
    comp = seg["compaction"]
    policy = kvfn.SnapKV(budget=args.rows, window=args.window)

    def held():
        if states is None:
            return [fm.init_states(1, chunk)]
        return [tuple(passes.with_room(
            s.replace(**{f: fresh(getattr(s, f)) for f in ("keys", "values")}),
            chunk) for s in states)]  # fmt: skip

    def forward(scored: bool, logits: bool = False, compact: bool = False, keep: bool = False):
        def run(st):
            if keep:  # a reference to the input states held through the forward
                kept.append(st)
            if scored:
                zeros = tuple(mx.zeros((1, h, s.capacity), mx.float32)
                              for h, s in zip(fm.n_heads, st))  # fmt: skip
                q = QuerySlice(chunk - window, chunk)
                out, st, scores = fm.scored_forward(x, st, zeros, q, check_ids=False)
            else:
                (out, st), scores = fm.forward(x, st, check_ids=False), None
            arrays = kvfn.tree.arrays(st) + list(scores or ())
            if compact:
                new = compaction.compact_states(st, scores, policy, reserve=comp["reserve"])[0]
                return {"eval": kvfn.tree.arrays(new)}
            return {"eval": arrays + ([out] if logits else [])}

        return run

    kept = []
    got = {"forward": measured_step(held(), forward(bool(window))),
           "logits": measured_step(held(), forward(bool(window), logits=True)),
           "empty": measured_step([fm.init_states(1, chunk)], forward(bool(window)))}
    if window:
        got["unscored"] = measured_step(held(), forward(False))
    if comp is not None:
        got["compacted"] = measured_step(held(), forward(bool(window), compact=True))
    if states is not None:
        got["input_held"] = measured_step(held(), forward(bool(window), keep=True))
        kept.clear()
    return got


def chunk_of(config: str, segments: list, j: int, args, P: int) -> dict:
    """Where segment ``j`` starts, how many tokens it ran, the rows and capacity it read."""
    seg = dict(segments[j])
    prev = segments[j - 1] if j else None
    if config.startswith("mlx-lm"):
        starts = list(range(0, P - 1, args.prefill_step_size))
        seg["start"] = starts[j] if j < len(starts) else P - 1
        seg["tokens"] = min(args.prefill_step_size, P - 1 - seg["start"]) if j < len(starts) else 1
    else:
        context = P - 1
        if config.endswith("bounded"):
            parts = compaction.bounded_chunks(context, args.prefill_step_size, args.window)
        else:
            parts = passes.chunks(context, args.prefill_step_size)
        seg["start"], stop = parts[min(j, len(parts) - 1)]
        seg["tokens"] = stop - seg["start"]
        held = (prev["rows"] if prev else 0) + stop - seg["start"]
        if config.endswith("bounded"):  # a chunk whose rows all fit is kept whole, unscored
            seg["scored"] = held > args.rows
        else:
            seg["scored"] = stop > context - args.window
        seg["packed"] = any(s["compaction"] is not None for s in segments[:j])
    seg["rows_before"] = prev["rows"] if prev else 0
    seg["capacity_before"] = (prev or {}).get("capacity") or seg.get("capacity_in")
    return seg


def parts_of(peak: int, synced: int, seg: dict, prev, got: dict) -> dict:
    """The measured parts of ``peak`` (the run as benchmark_memory runs it; ``synced``: the
    recorded one's, every chunk waited for at its end), and the remainder."""
    fwd, empty = got["forward"]["transient"], got["empty"]["transient"]
    held = prev["active"] - prev["kv"] - prev["scores"] if prev else 0
    parts = {"kv": seg["kv_at_peak"], "scores": seg["scores"], "held": max(0, held),
             "attention": max(0, fwd - empty), "activations": max(0, empty), "compaction": 0,
             "in_flight": max(0, peak - synced)}  # fmt: skip
    if "compacted" in got:  # what the compaction adds to the chunk's peak: the same chunk
        parts["compaction"] = max(0, got["compacted"]["rise"] - got["forward"]["rise"])
    parts["remainder"] = peak - sum(parts.values())
    return parts


def formulas(config: str, seg: dict, args, shape: dict, itemsize: int) -> dict:
    """What the parts would be by the textbook: one layer's tensors at a time."""
    c, r = seg["tokens"], seg["rows_before"]
    heads, inter = shape["num_attention_heads"], shape["intermediate_size"]
    f = {"logits": c * shape["vocab_size"] * 4,
         "scores_1_layer": heads * c * (r + c) * 4,
         "mlp_1_layer": 3 * c * inter * itemsize}  # fmt: skip
    if config == "mlx-lm full":  # the old buffer beside the grown one, a layer at a time
        f["cache_copy"] = seg["kv"] // shape["num_hidden_layers"]
    return f


def profile(config: str, model, fm, ids, args) -> dict:
    plain = plain_run(config, model, ids, args)
    if "error" in plain:
        return {"config": config, "error": plain["error"]}
    got = run_config(config, model, ids, args)
    segs = got["segments"]
    j = max(range(len(segs)), key=lambda i: segs[i]["peak"])
    seg = chunk_of(config, segs, j, args, len(ids))
    tokens = mx.array(ids)[None]
    if config.startswith("mlx-lm"):
        replay = mlx_replay(model, config, args, ids, seg, seg["tokens"])
    else:
        replay = kvfn_replay(fm, args, tokens, seg, seg["tokens"])
    prev = segs[j - 1] if j else None
    parts = parts_of(plain["peak"], got["peak"], seg, prev, replay)
    mx.set_cache_limit(0)  # the same run with no allocator cache
    try:
        nocache = plain_run(config, model, ids, args)
    finally:
        mx.set_cache_limit(args.cache_limit)
    return {"config": config, "peak": plain["peak"], "peak_synced": got["peak"], "segment": j,
            "segments": len(segs), "start": seg["start"], "tokens": seg["tokens"],
            "rows_before": seg["rows_before"], "kv": seg["kv_at_peak"],
            "kv_held_after": round(plain["kv_held_gb"] * 1e9),
            "run_rise": seg["peak"] - (prev["active"] if prev else 0), "parts": parts,
            "replay": replay, "compaction_out": (seg["compaction"] or {}).get("out"),
            "allocator_cache": max(s["allocator_cache"] for s in segs),
            "allocator_cache_after": plain["allocator_cache"],
            "peak_cache_limit_0": nocache["peak"],
            "allocator_cache_limit_0": nocache["allocator_cache"],
            "formulas": formulas(config, seg, args, SHAPES[args.shape][1],
                                 getattr(mx, args.dtype).size)}  # fmt: skip


def table(r: dict) -> None:
    gb = 1e9
    p, rp, f = r["peak"], r["replay"], r["formulas"]
    pct = lambda x: f"{100 * x / p:6.1f}%" if p else "     -"  # noqa: E731
    print(f"\n{r['config']}: peak above weights {p / gb:.4f} GB ({r['peak_synced'] / gb:.4f} "
          f"with every chunk waited for), in segment {r['segment']} of {r['segments']} (tokens "
          f"{r['start']}..{r['start'] + r['tokens']}, over {r['rows_before']} rows held)")
    print(f"  {'part':<44}{'GB':>9}{'of peak':>9}{'formula GB':>12}")
    notes = {"kv": ("KV held (the caches' bytes at the peak)", None),
             "scores": ("kvfn window scores held", None),
             "attention": ("forward transient growing with rows held", f["scores_1_layer"]),
             "activations": ("forward transient over an empty cache", f["mlp_1_layer"]),
             "held": ("other arrays held from the chunk before", None),
             "compaction": ("kvfn compaction beyond the forward", None),
             "in_flight": ("unwaited chunks (the run minus a synced one)", None),
             "remainder": ("remainder (unexplained)", None)}  # fmt: skip
    for k in PARTS:
        name, formula = notes[k]
        v = r["parts"][k]
        ftxt = f"{formula / gb:>12.4f}" if formula is not None else ""
        print(f"  {name:<44}{v / gb:>9.4f}{pct(v)}{ftxt}")
    fwd = rp["forward"]["transient"]
    if "room" in rp:
        copy_ = fwd - rp["room"]["transient"]
        print(f"    of which the cache's copy as it grows{'':<6}{copy_ / gb:>9.4f}{pct(copy_)}"
              f"{f['cache_copy'] / gb:>12.4f}")  # fmt: skip
    if "input_held" in rp:
        h = rp["input_held"]["rise"] - rp["forward"]["rise"]
        left = rp["input_held"]["left"] - rp["forward"]["left"]
        print(f"    (its input states held through the chunk would add {h / gb:.4f} GB to its "
              f"rise, {left / gb:.4f} GB left after it: a copy)")  # fmt: skip
    if "unscored" in rp:
        sc = fwd - rp["unscored"]["transient"]
        print(f"    of which kvfn's window scoring{'':<13}{sc / gb:>9.4f}{pct(sc)}")
    logits = rp["logits"]["rise"] - rp["forward"]["rise"]
    print(f"  the chunk's logits (not computed: outside)  {logits / gb:>9.4f}{pct(logits)}"
          f"{f['logits'] / gb:>12.4f}")  # fmt: skip
    print(f"  the run's chunk rose {r['run_rise'] / gb:.4f} GB; its replay "
          f"{rp['forward']['rise'] / gb:.4f} without logits, {rp['logits']['rise'] / gb:.4f} "
          "with them")  # fmt: skip
    print(f"  allocator cache (outside the peak): at most {r['allocator_cache'] / gb:.4f} GB at "
          f"a chunk's end, {r['allocator_cache_after'] / gb:.4f} GB after; with "
          f"set_cache_limit(0): peak {r['peak_cache_limit_0'] / gb:.4f} GB, cache "
          f"{r['allocator_cache_limit_0'] / gb:.4f} GB")  # fmt: skip


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    bm.model_arguments(p)
    p.add_argument("--new-tokens", type=int, default=2, help="the first tokens after the prompt")
    p.add_argument("--rows", type=int, default=512, help="kept rows: budget, cap, max_kv_size")
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--prefill-step-size", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--configs", default=",".join(bm.CONFIGS), help="comma-separated")
    p.add_argument("--warmup", type=int, default=1024, help="tokens of a warm-up run first")
    args = p.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not configs or any(c not in bm.CONFIGS for c in configs):
        p.error(f"--configs: choose from {list(bm.CONFIGS)}")
    if args.rows < args.window + 4 or args.prompt_tokens <= args.rows or args.new_tokens < 2:
        p.error("need rows >= window + 4, prompt tokens > rows and at least 2 new tokens")
    args.cache_limit = mx.set_cache_limit(0)  # read back, and set again
    mx.set_cache_limit(args.cache_limit)
    model = random_model(args.shape, getattr(mx, args.dtype), args.bits)
    fm = kvfn.FunctionalModel(model)
    vocab = SHAPES[args.shape][1]["vocab_size"]
    ids = np.random.default_rng(args.seed).integers(0, vocab, size=args.prompt_tokens).tolist()
    warm = min(args.warmup, args.prompt_tokens)
    for c in configs:  # one-time buffers (BLAS, kernels) out of the way
        if warm > args.rows:
            run_config(c, model, ids[:warm], args)
    out = []
    print(f"{args.shape} {args.dtype}{f' {args.bits}-bit' if args.bits else ''}, "
          f"{args.prompt_tokens}-token prompt, {args.new_tokens} new tokens, {args.rows} rows, "
          f"prefill chunks of {args.prefill_step_size}, window {args.window}, "
          f"{mx.default_device()}")  # fmt: skip
    for c in configs:
        r = profile(c, model, fm, ids, args)
        out.append(r)
        if "error" in r:
            print(f"\n{c}: failed: {r['error']}")
            continue
        table(r)
    print(json.dumps([{k: v for k, v in r.items() if k != "replay"} for r in out], default=str))
    return out


if __name__ == "__main__":
    main()

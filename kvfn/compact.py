"""Prefill in chunks, score the observation window, and compact with any policy.

``compact`` = ``scored_prefill`` of all but the last prompt token, then ``compact_states``: the
policy's selection, the gather and the room to decode, as one compiled transformation. No host
sync separates the last prefill chunk from the caller's first decode step. ``compact_steps`` is
the same work as a generator, a chunk a step, for a caller that interleaves other work
(kvfn-server's decoding).
"""

from functools import lru_cache
from typing import Callable, Generator, Optional, Sequence

import mlx.core as mx
from typeguard import typechecked

from . import cache as kv
from . import tree
from .eviction import EvictionResult, result_of
from .policy import Policy
from .scores import query_moments
from .snapkv import SnapKV
from .wrapper import STATISTICS, FunctionalModel, QuerySlice


def chunks(n: int, size: int) -> list[tuple[int, int]]:
    return [(i, min(i + size, n)) for i in range(0, n, size)]


def _start(fmodel, tokens, states, capacity, dtype) -> tuple:
    if not isinstance(tokens, mx.array) or tokens.ndim != 2 or tokens.shape[1] < 1:
        shape = tuple(tokens.shape) if isinstance(tokens, mx.array) else type(tokens).__name__
        raise ValueError(f"prefill takes tokens of shape (batch, n >= 1), got {shape}")
    B, n = tokens.shape
    if states is None:
        return fmodel.init_states(B, max(capacity or 0, n), dtype)
    return tuple(with_room(s, n) for s in states)


def with_room(state, n: int):
    """A plain state with room for exactly n more rows (a partitioned one grows in the
    wrapper, which at least doubles a capacity)."""
    if not isinstance(state, kv.State):
        return state
    r = state.max_rows if state.max_rows is not None else int(state.rows.item())
    return kv.reserve(state.replace(max_rows=r), max(state.capacity, r + n))


def _loop(fmodel, tokens, first, window, prefill_step_size, compiled, statistic="attention",
          settle=False):  # fmt: skip
    """The chunk loop as a generator: it yields ``(done, n)`` after each chunk and returns
    ``(states, scores)``. ``first()`` makes the first (states, scores) here, so that no caller's
    frame holds them and the first chunk's writes can reuse their buffers (a held buffer must be
    copied). Every chunk but the last is evaluated before it yields (that bounds the graph); the
    last stays lazy unless ``settle``."""
    states, scores = first()
    n = tokens.shape[1]
    parts = chunks(n, prefill_step_size)
    for j, (start, stop) in enumerate(parts):
        first_scored = max(n - window, start) if window else stop
        if first_scored < stop:
            q = QuerySlice(first_scored - start, stop - start, statistic)
            step = fmodel.scored_step if compiled else fmodel.scored_forward
            states, scores = step(tokens[:, start:stop], states, scores, q)[1:]
        else:
            step = fmodel.step if compiled else fmodel.forward
            # the logits are dropped at once: kept, their graph would hold the old buffers and
            # the next write could not reuse them
            states = step(tokens[:, start:stop], states)[1]
        if settle or j + 1 < len(parts):
            mx.eval(tree.arrays(states), scores)
        yield stop, n
    return states, scores


def _prefill_steps(fmodel, tokens, *, states, capacity, prefill_step_size, dtype, compiled,
                   settle=False):  # fmt: skip
    """``prefill`` as ``_loop``'s generator (its arguments checked now, not when it first runs)."""
    if prefill_step_size <= 0:
        raise ValueError(f"prefill_step_size must be positive, got {prefill_step_size}")
    first = lambda: (_start(fmodel, tokens, states, capacity, dtype), ())  # noqa: E731
    return _loop(fmodel, tokens, first, 0, prefill_step_size, compiled, settle=settle)


def _scored_steps(fmodel, tokens, *, window, states, capacity, prefill_step_size, dtype, compiled,
                  statistic, settle=False):  # fmt: skip
    """``scored_prefill`` as ``_loop``'s generator (its arguments checked now)."""
    if not 1 <= window <= tokens.shape[1]:
        raise ValueError(f"window must be in [1, {tokens.shape[1]}] (the tokens), got {window}")
    if statistic not in STATISTICS:
        raise ValueError(f"statistic must be one of {STATISTICS}, got {statistic!r}")
    if prefill_step_size <= 0:
        raise ValueError(f"prefill_step_size must be positive, got {prefill_step_size}")

    def first():
        made = _start(fmodel, tokens, states, capacity, dtype)
        B = tokens.shape[0]
        if statistic == "moments":
            zeros = (query_moments(B, h, d) for h, d in zip(fmodel.n_heads, fmodel.head_dims))
        else:
            zeros = (mx.zeros((B, h, s.capacity), mx.float32) for h, s in zip(fmodel.n_heads, made))
        return made, tuple(zeros)

    return _loop(fmodel, tokens, first, window, prefill_step_size, compiled, statistic, settle)


def _drain(steps, progress: Optional[Callable[[int, int], None]]):
    """Run a generator of ``(done, total)`` steps to its end, calling ``progress`` after each;
    its return value."""
    while True:
        try:
            done = next(steps)
        except StopIteration as end:
            return end.value
        if progress is not None:
            progress(*done)


@typechecked
def prefill(
    fmodel: FunctionalModel,
    tokens: mx.array,
    *,
    states: Optional[tuple] = None,
    capacity: Optional[int] = None,
    prefill_step_size: int = 512,
    dtype: Optional[mx.Dtype] = None,
    progress: Optional[Callable[[int, int], None]] = None,
    compiled: bool = False,
) -> tuple:
    """Run ``tokens`` (B, n) through the model in chunks into fresh states (room for
    ``capacity`` rows, at least n) or after what ``states`` hold. Eager by default, as mlx-lm
    prefills: a plain (dense) state is written at static slots and attended with the fused
    causal kernel, no mask array. ``compiled=True`` runs the compiled step instead (a trace per
    chunk shape; for states that are not dense)."""
    steps = _prefill_steps(fmodel, tokens, states=states, capacity=capacity,
                           prefill_step_size=prefill_step_size, dtype=dtype,
                           compiled=compiled)  # fmt: skip
    return _drain(steps, progress)[0]


@typechecked
def scored_prefill(
    fmodel: FunctionalModel,
    tokens: mx.array,
    *,
    window: int,
    states: Optional[tuple] = None,
    capacity: Optional[int] = None,
    prefill_step_size: int = 512,
    dtype: Optional[mx.Dtype] = None,
    progress: Optional[Callable[[int, int], None]] = None,
    compiled: bool = False,
    statistic: str = "attention",
) -> tuple[tuple, tuple]:
    """``prefill`` that also sums the attention of the last ``window`` tokens' queries over
    every key into per-key scores, chunk by chunk (the window may span chunks), in the same
    pass: ``(states, scores)``, one (B, n_heads, capacity) float32 array a layer (zeros for
    sliding-window layers, which are never evicted). O(window x prompt) per layer, never a
    prompt-sized matrix. This is the seed's ``SnapKVAttentionCapture``. With
    ``statistic="moments"`` the scores are instead the running moments of those queries before
    RoPE (``kvfn.scores.query_moments``: mean and covariance per query head)."""
    steps = _scored_steps(fmodel, tokens, window=window, states=states, capacity=capacity,
                          prefill_step_size=prefill_step_size, dtype=dtype, compiled=compiled,
                          statistic=statistic)  # fmt: skip
    return _drain(steps, progress)


def _window_cut(state: kv.State, P: int, extra: int) -> kv.State:
    """A sliding-window layer keeps the rows its window can still see (lossless)."""
    B, H = state.keys.shape[:2]
    k = min(P, state.sliding_window)
    idx = mx.broadcast_to(mx.arange(P - k, P, dtype=mx.int32), (B, H, k))
    state = kv.gather(state, idx, packed=state.packed)
    return kv.reserve(state, max(state.capacity, k + extra))


@lru_cache(maxsize=64)
def _evictor(policy: Policy, P: int, extra: int, statics: tuple, compiled: bool, group):
    """The compaction of one prompt length as a function of arrays; ``layout[0]`` holds, once
    traced, each output layer's static part and host bounds (they depend only on the key)."""
    layout = []

    def run(flat, scores):
        out, shapes = [], []
        for i, (arrays, static) in enumerate(zip(flat, statics)):
            s = kv.unflatten(arrays, static)
            if s.sliding_window is not None:
                new = _window_cut(s, P, extra)
            else:
                sc = scores[i][..., :P] if scores else None
                layer_policy = policy.for_layer(i, len(statics))
                new = layer_policy.compact_layer(s, sc, prompt_length=P, layer=i, reserve=extra,
                                                 group=group)  # fmt: skip
            arrays_out, static_out, host = tree.flatten(new)
            out.append(arrays_out)
            shapes.append((static_out, host))
        layout[:] = [shapes]
        return out

    return (mx.compile(run) if compiled else run), layout


@typechecked
def compact_states(
    states: Sequence[kv.State],
    scores: Optional[Sequence[mx.array]],
    policy: Policy,
    *,
    reserve: int = 0,
    compiled: bool = True,
    group: Optional[mx.distributed.Group] = None,
) -> tuple[tuple, EvictionResult]:
    """Apply ``policy`` to freshly prefilled ``states`` of one prompt length (and its
    ``scored_prefill`` scores, if it needs them): select, gather and reserve room for
    ``reserve`` more rows, in one compiled step for a static policy and prompt length.
    Sliding-window layers are cut to their window (lossless). ``group``: the states hold this
    rank's slice of every layer's heads, split evenly over the group (``FunctionalModel.group``
    of a sharded model); every rank then keeps the rows one process would keep."""
    bounds = {s.max_rows if s.max_rows is not None else int(s.rows.item()) for s in states}
    if len(bounds) != 1:
        raise ValueError(f"compact_states takes states of one prompt length, got rows {bounds}")
    (P,) = bounds
    if P < 1:
        raise ValueError("compact_states needs prefilled states (they hold no rows)")
    if reserve < 0:
        raise ValueError(f"reserve must be >= 0, got {reserve}")
    if policy.observation_window(P) and scores is None:
        raise ValueError(f"policy {policy.name!r} needs the scores of a scored_prefill")
    n_kv_heads = tuple(None if s.sliding_window else s.keys.shape[1] for s in states)
    policy.check_layers(n_kv_heads)
    policy = policy.planned(scores, prompt_length=P, n_kv_heads=n_kv_heads)
    # a dense state holds exactly P rows, so every kept row is a stored one: still packed
    statics = tuple((s.sliding_window, s.dense) for s in states)
    flat = [kv.flatten(s)[0] for s in states]
    run, layout = _evictor(policy, P, reserve, statics, compiled and policy.traceable, group)
    out = run(flat, list(scores or ()))
    new = tuple(tree.unflatten(o, st, host) for o, (st, host) in zip(out, layout[0]))
    new = tuple(
        n.replace(dense=True) if isinstance(n, kv.State) and s.dense and n.max_rows == P else n
        for n, s in zip(new, states)
    )
    return new, result_of(states, [P] * len(states), new)


def _prompt(tokens) -> mx.array:
    if isinstance(tokens, mx.array):
        arr = tokens
    else:
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise TypeError("prompt tokens must be ints (token ids)")
        arr = mx.array([list(tokens)], mx.int32)
    if arr.ndim != 2 or arr.shape[1] < 2:
        raise ValueError(f"need a (batch, length >= 2) prompt, got shape {tuple(arr.shape)}")
    return arr


@typechecked
def compact_steps(
    fmodel: FunctionalModel,
    prompt_tokens: Sequence[int] | mx.array,
    policy: Policy,
    *,
    max_new_tokens: int = 256,
    prefill_step_size: int = 512,
    dtype: Optional[mx.Dtype] = None,
    compiled: bool = True,
    settle: bool = True,
) -> Generator[tuple[int, int], None, tuple[tuple, EvictionResult]]:
    """``compact`` one step at a time, for a caller that interleaves other work between steps
    (kvfn-server's decode steps): a generator that yields ``(done, total)`` after each prefill
    chunk (of the ``total`` context tokens) and after each step of the policy's own scoring
    pass (``Policy.score_steps``, counted after the context's tokens: ``total`` grows by the
    pass's own total when it starts), then compacts and returns ``(states, EvictionResult)`` as
    its StopIteration value. With ``settle`` each step's arrays are evaluated before it yields,
    and the compacted states before it returns, so that a step's work is done inside it;
    ``compact`` drains it unsettled. The arguments are checked when it is called."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    context = _prompt(prompt_tokens)[:, :-1]
    P = context.shape[1]
    window = policy.observation_window(P)
    kwargs = dict(states=None, capacity=P, prefill_step_size=prefill_step_size, dtype=dtype,
                  compiled=False, settle=settle)  # fmt: skip
    if window:
        prefill = _scored_steps(fmodel, context, window=window, statistic=policy.statistic,
                                **kwargs)  # fmt: skip
    else:
        prefill = _prefill_steps(fmodel, context, **kwargs)
    return _compaction(fmodel, context, policy, prefill, bool(window), max_new_tokens + 1,
                       compiled, settle)  # fmt: skip


def _compaction(fmodel, context, policy, prefill, scored, reserve, compiled, settle):
    """``compact_steps``' generator, over the steps of its ``prefill``."""
    P = context.shape[1]
    states, scores = yield from prefill
    scores = scores if scored else None
    own = yield from _after(P, policy.score_steps(fmodel, context, states, scores))
    scores = own if own is not None else scores
    new, result = compact_states(states, scores, policy, reserve=reserve, compiled=compiled,
                                 group=fmodel.group)  # fmt: skip
    if settle:
        mx.eval(tree.arrays(new))
    return new, result


def _after(base: int, steps):
    """``steps`` with ``base`` added to each ``(done, total)`` it yields; returns its value."""
    while True:
        try:
            done, total = next(steps)
        except StopIteration as end:
            return end.value
        yield base + done, base + total


@typechecked
def compact(
    fmodel: FunctionalModel,
    prompt_tokens: Sequence[int] | mx.array,
    policy: Policy,
    *,
    max_new_tokens: int = 256,
    prefill_step_size: int = 512,
    dtype: Optional[mx.Dtype] = None,
    progress: Optional[Callable[[int, int], None]] = None,
    compiled: bool = True,
) -> tuple[tuple, EvictionResult]:
    """Prefill all but the last prompt token (eagerly, scoring the policy's observation
    window), keep the policy's rows in every full-attention layer and reserve room for
    ``max_new_tokens`` (decoding further grows the states), the eviction compiled unless
    ``compiled=False``. The caller decodes from the last prompt token. Takes one prompt (a list
    of ints) or a batch of equal-length prompts (B, n). On a sharded model (every rank runs
    this alike) each rank keeps its heads' share of the single-process selection.
    ``progress(done, total)``: after each of ``compact_steps``' steps."""
    steps = compact_steps(fmodel, prompt_tokens, policy, max_new_tokens=max_new_tokens,
                          prefill_step_size=prefill_step_size, dtype=dtype, compiled=compiled,
                          settle=False)  # fmt: skip
    return _drain(steps, progress)


def compact_prompt_cache(
    fmodel: FunctionalModel,
    prompt_tokens: Sequence[int] | mx.array,
    *,
    budget: int,
    max_new_tokens: int = 256,
    prefill_step_size: int = 512,
    dtype: Optional[mx.Dtype] = None,
    progress: Optional[Callable[[int, int], None]] = None,
    **snapkv,
) -> tuple[tuple, EvictionResult]:
    """``compact`` with a ``SnapKV(budget, **snapkv)`` policy (window, sink_tokens, min_tokens,
    kernel_size, pooling, per_head, group_reduce): the seed's entry point."""
    return compact(fmodel, prompt_tokens, SnapKV(budget=budget, **snapkv),
                   max_new_tokens=max_new_tokens, prefill_step_size=prefill_step_size,
                   dtype=dtype, progress=progress)  # fmt: skip

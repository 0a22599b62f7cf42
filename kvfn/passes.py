"""Chunked passes of a model over tokens: ``prefill`` and ``scored_prefill`` (which also
gathers the observation window's statistic inside the pass), each also a generator of its
chunks for callers that interleave other work (``kvfn.compact_steps``, kvfn-server).
"""

from typing import Callable, Optional

import mlx.core as mx
from typeguard import typechecked

from . import wrapper
from .kernels import on_cuda
from .scores import query_moments
from .states import cache as kv
from .states import layout
from .states import tree
from .states.layout import bucket
from .wrapper import STATISTICS, FunctionalModel, QuerySlice


def chunks(n: int, size: int) -> list[tuple[int, int]]:
    return [(i, min(i + size, n)) for i in range(0, n, size)]


def _start(fmodel, tokens, states, capacity, dtype, check_ids: bool) -> tuple:
    if not isinstance(tokens, mx.array) or tokens.ndim != 2 or tokens.shape[1] < 1:
        shape = tuple(tokens.shape) if isinstance(tokens, mx.array) else type(tokens).__name__
        raise ValueError(f"prefill takes tokens of shape (batch, n >= 1), got {shape}")
    if capacity is not None and capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    if check_ids:  # once for every chunk
        wrapper.check_ids(tokens, fmodel.vocab_size)
    B, n = tokens.shape
    if states is None:
        rows = bucket(n) if capacity is None else max(capacity, n)
        return fmodel.init_states(B, rows, dtype)
    return tuple(with_room(s, n) for s in states)


def with_room(state, n: int, bucketed: bool = False):
    """A plain state with room for exactly n more rows (a partitioned one grows in the
    wrapper, which at least doubles a capacity); ``bucketed``: a copy in a capacity ``bucket``,
    attended as a packed state (every slot, the free ones masked), so that a chunk attends in
    a shape that prompts of other lengths in the bucket meet too."""
    if not isinstance(state, kv.State):
        return state
    r = state.max_rows if state.max_rows is not None else int(state.rows.item())
    if bucketed:
        state = state.replace(packed=state.packed or state.dense, dense=False)
    return kv.reserve(state.replace(max_rows=r),
                      max(state.capacity, bucket(r + n) if bucketed else r + n))  # fmt: skip


def padding(states, start: int, stop: int, size: int, scored: bool = False) -> int:
    """Token slots to append to a last chunk [start, stop) of at most ``size`` tokens, so that
    its attention has a shape met before whatever the prompt's length. Over plain dense states
    (a prompt's own prefill): ``size`` rows where every state has the room, the shape a full
    chunk at ``start`` has. Over other states whose kind rolls appended rows back exactly
    (``Layout.rollback``: a question prefilled after a compacted context; not a streaming
    ring, which drops rows as it appends), unscored: the chunk's tokens rounded up to a
    ``query_bucket``, so that the questions asked of one context share a few shapes. Else 0."""
    n = stop - start
    if all(isinstance(s, kv.State) and s.dense for s in states):
        room = min(s.capacity for s in states) - start
        return max(0, min(size, room) - n)
    if scored or any(layout.of(s).rollback is None for s in states):
        return 0
    return max(0, min(query_bucket(n), size) - n)


def settling(layers, per_step: Optional[int] = None):
    """Evaluates ``layers`` (a forward's arrays, one entry a model layer, in layer order). With
    ``per_step``, a generator step evaluates that many layers' entries at a time and yields
    before the last step, so that a caller interleaving other work between steps waits at most
    that share of the forward: the forward's graph is built once, a step computes only what
    its layers' arrays need, and later steps reuse what earlier ones computed."""
    n = len(layers)
    for hi in range(per_step or n, n, per_step or n):
        mx.eval(layers[hi - per_step : hi])
        yield
    mx.eval(layers)


def check_step(name: str, value: Optional[int]) -> None:
    """A step setting (``pass_step_size``, ``layers_per_step``): a positive int, or None."""
    if value is not None and (type(value) is not int or value < 1):
        raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")


def per_layer(states, scores=()) -> list:
    """``states`` and their ``scores`` (a tuple a layer, or none) as ``settling`` takes them."""
    scores = scores or ((),) * len(states)
    return [(tree.arrays(s), sc) for s, sc in zip(states, scores)]


def query_bucket(n: int) -> int:
    """The tokens a chunk of ``n`` runs as over compacted states: the next power of two, at
    least 16."""
    return max(16, 1 << (n - 1).bit_length())


def _loop(fmodel, tokens, first, window, prefill_step_size, compiled, statistic="attention",
          settle=False, padded=None, layers=None):  # fmt: skip
    """The chunk loop as a generator: it yields ``(done, n)`` after each chunk and returns
    ``(states, scores)``. ``first()`` makes the first (states, scores) here, so that no caller's
    frame holds them and the first chunk's writes can reuse their buffers (a held buffer must be
    copied). Every chunk but the last is evaluated before it yields (that bounds the graph); the
    last stays lazy unless ``settle``. ``padded``: the last chunk runs in a shape met before
    (``padding`` slots of token 0 after it, rolled back: no real query sees them); None: on
    CUDA only. ``layers``: a chunk is evaluated that many layers a step (``settling``), each
    step but its last yielding the chunk's start."""
    states, scores = first()
    del first  # its closure holds the caller's states
    n = tokens.shape[1]
    parts = chunks(n, prefill_step_size)
    padded = on_cuda() if padded is None else padded
    for j, (start, stop) in enumerate(parts):
        last = j + 1 == len(parts)
        pad = 0
        if padded and last:
            pad = padding(states, start, stop, prefill_step_size, scored=bool(window))
        chunk = tokens[:, start:stop]
        if pad:
            chunk = mx.concatenate([chunk, mx.zeros((chunk.shape[0], pad), chunk.dtype)], axis=1)
        first_scored = max(n - window, start) if window else stop
        if first_scored < stop:
            q = QuerySlice(first_scored - start, stop - start, statistic)
            step = fmodel.scored_step if compiled else fmodel.scored_forward
            states, scores = step(chunk, states, scores, q, check_ids=False)[1:]
        else:
            step = fmodel.step if compiled else fmodel.forward
            # the logits are dropped at once: kept, their graph would hold the old buffers and
            # the next write could not reuse them
            states = step(chunk, states, check_ids=False)[1]
        if pad:
            states = tuple(layout.of(s).rollback(s, pad) for s in states)
        if settle or not last:
            for _ in settling(per_layer(states, scores), layers):
                yield start, n
        yield stop, n
    return states, scores


def _prefill_steps(fmodel, tokens, *, states, capacity, prefill_step_size, dtype, compiled,
                   settle=False, check_ids=True, padded=None, layers=None):  # fmt: skip
    """``prefill`` as ``_loop``'s generator (its arguments checked now, not when it first runs;
    ``check_ids``: the token ids too, unless the caller did)."""
    if prefill_step_size <= 0:
        raise ValueError(f"prefill_step_size must be positive, got {prefill_step_size}")
    first = lambda: (_start(fmodel, tokens, states, capacity, dtype, check_ids), ())  # noqa: E731
    return _loop(fmodel, tokens, first, 0, prefill_step_size, compiled, settle=settle,
                 padded=padded, layers=layers)  # fmt: skip


def _scored_steps(fmodel, tokens, *, window, states, capacity, prefill_step_size, dtype, compiled,
                  statistic, settle=False, check_ids=True, padded=None, layers=None):  # fmt: skip
    """``scored_prefill`` as ``_loop``'s generator (its arguments checked now)."""
    if not 1 <= window <= tokens.shape[1]:
        raise ValueError(f"window must be in [1, {tokens.shape[1]}] (the tokens), got {window}")
    if statistic not in STATISTICS:
        raise ValueError(f"statistic must be one of {STATISTICS}, got {statistic!r}")
    if prefill_step_size <= 0:
        raise ValueError(f"prefill_step_size must be positive, got {prefill_step_size}")

    def first():
        made = _start(fmodel, tokens, states, capacity, dtype, check_ids)
        B = tokens.shape[0]
        if statistic == "moments":
            zeros = (query_moments(B, h, d) for h, d in zip(fmodel.n_heads, fmodel.head_dims))
        else:
            zeros = (mx.zeros((B, h, s.capacity), mx.float32) for h, s in zip(fmodel.n_heads, made))
        return made, tuple(zeros)

    return _loop(fmodel, tokens, first, window, prefill_step_size, compiled, statistic, settle,
                 padded, layers)  # fmt: skip


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
    padded: Optional[bool] = None,
) -> tuple:
    """Run ``tokens`` (B, n) through the model in chunks into fresh states (room for
    ``capacity`` rows, at least n; by default n's ``kvfn.wrapper.bucket``, at most 25% more,
    as a decode step would grow them to) or after what ``states`` hold. A layer's keys are read
    as a slice of its buffer, and MLX's CUDA backend builds an attention graph (cuDNN) per
    shape and strides: in a bucket, a prompt of a new length builds one for its last chunk,
    where an exact capacity built one for every chunk (0.5 s of a 3,300-token prompt's 0.6 s
    first prefill on an H100). ``padded`` (None: on CUDA) runs the last chunk as a full one, a
    few slots of token 0 after it, trimmed again and seen by no real query: then every prompt in
    a bucket attends in the shapes its longest one did, and a new length builds no graph.
    Eager by default, as mlx-lm
    prefills: a plain (dense) state is written at static slots and attended with the fused
    causal kernel, no mask array. ``compiled=True`` runs the compiled step instead (a trace per
    chunk shape; for states that are not dense)."""
    steps = _prefill_steps(fmodel, tokens, states=states, capacity=capacity,
                           prefill_step_size=prefill_step_size, dtype=dtype,
                           compiled=compiled, padded=padded)  # fmt: skip
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
    padded: Optional[bool] = None,
) -> tuple[tuple, tuple]:
    """``prefill`` that also sums the attention of the last ``window`` tokens' queries over
    every key into per-key scores, chunk by chunk (the window may span chunks), in the same
    pass: ``(states, scores)``, one (B, n_heads, capacity) float32 array a layer (zeros for
    sliding-window layers, which are never evicted). O(window x prompt) per layer, never a
    prompt-sized matrix. With ``statistic="moments"`` the scores are instead the running
    moments of those queries before RoPE (``kvfn.scores.query_moments``: mean and covariance
    per query head). ``padded`` as in ``prefill``."""
    steps = _scored_steps(fmodel, tokens, window=window, states=states, capacity=capacity,
                          prefill_step_size=prefill_step_size, dtype=dtype, compiled=compiled,
                          statistic=statistic, padded=padded)  # fmt: skip
    return _drain(steps, progress)

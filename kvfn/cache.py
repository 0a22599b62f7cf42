"""PositionPreservingKVCache: an immutable KV-cache state and the pure functions over it.

Rows of a compacted cache are a sparse subset of the prompt, so the RoPE position (``offset``)
and the number of stored rows diverge. Every stored row records its true sequence position; an
empty slot holds ``EMPTY``, larger than any position, so a causal comparison masks it for free.
A plain full cache is the same state with positions equal to row indices.

Layout: keys/values (B, n_kv_heads, capacity, head_dim); positions (B, n_kv_heads, capacity)
int32; offset (B,) int32, the next true position per sequence; rows () int32, the slots in use
(slot ``rows`` is where the next update writes). ``window`` (static) makes a sliding-window
layer: a query attends only to the last ``window`` positions.
"""

from typing import Optional

import chex
import mlx.core as mx
from typeguard import typechecked

EMPTY = 2**31 - 1


@chex.dataclass(frozen=True)
class PositionPreservingKVCache:
    keys: mx.array
    values: mx.array
    positions: mx.array
    offset: mx.array
    rows: mx.array
    window: Optional[int] = None

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + self.positions.nbytes


State = PositionPreservingKVCache


def _check(state: State) -> None:
    chex.assert_rank([state.keys, state.values, state.positions], [4, 4, 3])
    chex.assert_equal_shape([state.keys, state.values])
    chex.assert_shape(state.positions, state.keys.shape[:3])
    chex.assert_shape(state.offset, state.keys.shape[:1])


@typechecked
def init(
    batch: int,
    n_kv_heads: int,
    head_dim: int,
    capacity: int,
    *,
    dtype: mx.Dtype = mx.float32,
    window: Optional[int] = None,
    value_dim: Optional[int] = None,
) -> State:
    """An empty state with room for ``capacity`` rows."""
    for name, v in (("batch", batch), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim)):
        if v <= 0:
            raise ValueError(f"{name} must be positive, got {v}")
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    if window is not None and window <= 0:
        raise ValueError(f"window must be positive or None, got {window}")
    shape = (batch, n_kv_heads, capacity)
    return State(
        keys=mx.zeros((*shape, head_dim), dtype),
        values=mx.zeros((*shape, value_dim or head_dim), dtype),
        positions=mx.full(shape, EMPTY, mx.int32),
        offset=mx.zeros((batch,), mx.int32),
        rows=mx.array(0, mx.int32),
        window=window,
    )


@typechecked
def from_full(keys: mx.array, values: mx.array, *, window: Optional[int] = None) -> State:
    """A state holding a plain full cache: row i has position i."""
    chex.assert_rank([keys, values], 4)
    B, H, N, _ = keys.shape
    positions = mx.broadcast_to(mx.arange(N, dtype=mx.int32), (B, H, N))
    return State(
        keys=keys,
        values=values,
        positions=positions,
        offset=mx.full((B,), N, mx.int32),
        rows=mx.array(N, mx.int32),
        window=window,
    )


def appended_positions(state: State, n: int) -> mx.array:
    """The positions array after ``n`` rows are appended (see ``update``)."""
    slots = mx.arange(state.capacity, dtype=mx.int32)
    new = (slots >= state.rows) & (slots < state.rows + n)
    true_pos = state.offset[:, None, None] + (slots - state.rows)[None, None, :]
    return mx.where(new[None, None, :], true_pos, state.positions)


@typechecked
def update(state: State, keys: mx.array, values: mx.array) -> State:
    """Append rows (B, n_kv_heads, n, head_dim); their true positions continue from ``offset``.

    Capacity is the caller's to provide (``reserve``): an update past it is not checked here,
    since ``rows`` is traced data.
    """
    _check(state)
    chex.assert_rank([keys, values], 4)
    chex.assert_shape(keys, (*state.keys.shape[:2], None, state.keys.shape[3]))
    chex.assert_shape(values, (*state.values.shape[:2], keys.shape[2], state.values.shape[3]))
    n = keys.shape[2]
    start = mx.reshape(state.rows, (1,))
    return state.replace(
        keys=mx.slice_update(state.keys, keys.astype(state.keys.dtype), start, axes=(2,)),
        values=mx.slice_update(state.values, values.astype(state.values.dtype), start, axes=(2,)),
        positions=appended_positions(state, n),
        offset=state.offset + n,
        rows=state.rows + n,
    )


@typechecked
def prefix_trim(state: State, length) -> State:
    """Keep exactly the rows whose true position is below ``length`` (an int or a (B,) array).

    Exact for prompt-cache reuse: what remains is what the state held of the first ``length``
    tokens. Freed slots become EMPTY; ``rows`` shrinks to just past the last kept slot.
    """
    _check(state)
    length = mx.broadcast_to(mx.array(length, mx.int32), state.offset.shape)
    keep = state.positions < length[:, None, None]
    slots = mx.arange(1, state.capacity + 1, dtype=mx.int32)
    return state.replace(
        positions=mx.where(keep, state.positions, EMPTY),
        offset=mx.minimum(state.offset, length),
        rows=mx.max(mx.where(keep, slots, 0)).astype(mx.int32),
    )


@typechecked
def trim(state: State, n: int) -> State:
    """Drop the last ``n`` tokens of every sequence (speculative rollback): a prefix trim to
    ``offset - n``, so in a compacted state only rows of those tokens go."""
    if n < 0:
        raise ValueError(f"trim needs n >= 0, got {n}")
    return prefix_trim(state, mx.maximum(state.offset - n, 0))


@typechecked
def evict(state: State, keep_indices: mx.array) -> State:
    """Keep the slots ``keep_indices`` (B, n_kv_heads, k), in that order; capacity becomes k."""
    _check(state)
    chex.assert_rank(keep_indices, 3)
    chex.assert_shape(keep_indices, (*state.keys.shape[:2], None))
    idx = keep_indices.astype(mx.int32)
    return state.replace(
        keys=mx.take_along_axis(state.keys, idx[..., None], axis=2),
        values=mx.take_along_axis(state.values, idx[..., None], axis=2),
        positions=mx.take_along_axis(state.positions, idx, axis=2),
        rows=mx.array(idx.shape[2], mx.int32),
    )


@typechecked
def reserve(state: State, capacity: int) -> State:
    """The same state with room for ``capacity`` rows (EMPTY slots added at the end)."""
    extra = capacity - state.capacity
    if extra < 0:
        raise ValueError(f"reserve cannot shrink capacity {state.capacity} to {capacity}")
    if extra == 0:
        return state
    B, H, _, _ = state.keys.shape

    def pad(x, fill):
        return mx.concatenate([x, mx.full((B, H, extra, *x.shape[3:]), fill, x.dtype)], axis=2)

    return state.replace(
        keys=pad(state.keys, 0), values=pad(state.values, 0), positions=pad(state.positions, EMPTY)
    )


@typechecked
def mask(state: State, n_queries: int) -> mx.array:
    """Boolean attention mask (B, n_kv_heads, n_queries, capacity) for the last ``n_queries``
    tokens (true positions ``offset - n_queries`` ...): causal over true positions, per head,
    limited to ``window`` for a sliding-window layer; EMPTY slots never attend."""
    _check(state)
    q = state.offset[:, None] - n_queries + mx.arange(n_queries, dtype=mx.int32)[None]
    q = q[:, None, :, None]
    k = state.positions[:, :, None, :]
    visible = k <= q
    if state.window is not None:
        visible = visible & (k > q - state.window)
    return visible


@typechecked
def valid_rows(state: State) -> mx.array:
    """(B, n_kv_heads) count of stored (non-EMPTY) rows."""
    return mx.sum(state.positions != EMPTY, axis=-1)


ARRAY_FIELDS = ("keys", "values", "positions", "offset", "rows")


def flatten(state: State) -> tuple[dict, tuple]:
    """Arrays for mx.compile / mlx tree utilities, plus the static part."""
    return {f: getattr(state, f) for f in ARRAY_FIELDS}, (state.window,)


def unflatten(arrays: dict, static: tuple) -> State:
    (window,) = static
    return State(**arrays, window=window)


@typechecked
def restrict(state: State, keep_indices: mx.array) -> State:
    """Mask, without moving anything, every slot not in ``keep_indices`` (B, n_kv_heads, k): the
    state attends exactly as ``evict(state, keep_indices)`` would (the exactness oracle)."""
    _check(state)
    chex.assert_shape(keep_indices, (*state.keys.shape[:2], None))
    slots = mx.arange(state.capacity, dtype=mx.int32)
    kept = mx.any(keep_indices[..., :, None] == slots, axis=-2)
    return state.replace(positions=mx.where(kept, state.positions, EMPTY))


@typechecked
def stack(states: list[State]) -> State:
    """One batch from per-sequence states of the same layer (e.g. prompts of different lengths
    compacted alone). Shorter ones get EMPTY slots, so all write their next row at one slot."""
    if not states:
        raise ValueError("stack needs at least one state")
    windows = {s.window for s in states}
    if len(windows) > 1:
        raise ValueError(f"cannot stack layers with different windows {sorted(windows, key=str)}")
    capacity = max(s.capacity for s in states)
    rows = mx.max(mx.stack([s.rows for s in states]))
    padded = [reserve(s, capacity) for s in states]
    return State(
        keys=mx.concatenate([s.keys for s in padded]),
        values=mx.concatenate([s.values for s in padded]),
        positions=mx.concatenate([s.positions for s in padded]),
        offset=mx.concatenate([s.offset for s in padded]),
        rows=rows,
        window=states[0].window,
    )


def arrays(states) -> list:
    """Every array of a state or a sequence of states, e.g. for ``mx.eval`` (which does not
    look inside dataclasses: ``mx.eval(states)`` would evaluate nothing)."""
    if isinstance(states, State):
        return list(flatten(states)[0].values())
    return [a for s in states for a in arrays(s)]

"""PositionPreservingKVCache: an immutable KV-cache state and the pure functions over it.

Rows of a compacted cache are a sparse subset of the prompt, so the RoPE position (``offset``)
and the number of stored rows diverge. Every stored row records its true sequence position. A
free slot below ``rows`` (a row trimmed or masked away) holds ``EMPTY``, larger than any
position; a slot at or past ``rows`` already holds the position the next appends give it,
``offset + (slot - rows)`` per sequence (``tail_positions``). Appends move ``rows`` and
``offset`` together, so they never write a position, and a causal comparison masks both kinds
of free slot (neither is at or below a query's position). A plain full cache is the same state
with positions equal to row indices.

Layout: keys/values (B, n_kv_heads, capacity, head_dim); positions (B, n_kv_heads, capacity)
int32; offset (B,) int32, the next true position per sequence; rows () int32, the slots in use
(slot ``rows`` is where the next update writes). Static fields: ``sliding_window`` makes a
sliding-window layer (a query attends only to the last ``sliding_window`` positions);
``max_rows`` is an upper bound on ``rows`` known on the host (exact unless the state was
trimmed; None inside a compiled step), so capacity is checked before anything is written;
``dense`` says the state is a plain full cache (slot i holds position i for every sequence and
head, ``rows == offset == max_rows``): then rows are written at static slots and attention
needs no array mask, as in mlx-lm's own ``KVCache``; ``packed`` says slots below ``rows`` all
hold rows, none after, and every position is below ``offset`` (a dense state, or one compacted
from it and decoded further): then a query's mask is a comparison of slots with ``rows``, the
same for every head, instead of a per-head mask from positions.
"""

import dataclasses
import operator
from functools import lru_cache
from typing import Optional

import chex
import mlx.core as mx
from typeguard import typechecked

from . import layout
from .layout import bucket

EMPTY = 2**31 - 1


@chex.dataclass(frozen=True, repr=False)
class PositionPreservingKVCache:
    keys: mx.array
    values: mx.array
    positions: mx.array
    offset: mx.array
    rows: mx.array
    sliding_window: Optional[int] = None
    max_rows: Optional[int] = None
    dense: bool = False
    packed: bool = False

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + self.positions.nbytes

    def __repr__(self) -> str:
        B, H, C, D = self.keys.shape
        window = "" if self.sliding_window is None else f", sliding_window={self.sliding_window}"
        dense = ", dense" if self.dense else ", packed" if self.packed else ""
        return (
            f"PositionPreservingKVCache(batch={B}, kv_heads={H}, head_dim={D}, capacity={C}, "
            f"max_rows={self.max_rows}, dtype={self.keys.dtype}{window}{dense})"
        )

    @property
    def static_rows(self) -> Optional[int]:
        """The exact row count when the host knows it (a dense state outside a trace)."""
        return self.max_rows if self.dense else None


State = PositionPreservingKVCache


def _check(state: State) -> None:
    chex.assert_rank([state.keys, state.values, state.positions], [4, 4, 3])
    chex.assert_shape(state.values, state.keys.shape[:3] + (None,))
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
    sliding_window: Optional[int] = None,
    value_dim: Optional[int] = None,
) -> State:
    """An empty state with room for ``capacity`` rows."""
    for name, v in (("batch", batch), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim)):
        if v <= 0:
            raise ValueError(f"{name} must be positive, got {v}")
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    check_capacity(capacity)
    if not mx.issubdtype(dtype, mx.floating):
        raise TypeError(f"a KV cache is floating point, got dtype {dtype}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
    shape = (batch, n_kv_heads, capacity)
    return State(
        keys=mx.zeros((*shape, head_dim), dtype),
        values=mx.zeros((*shape, value_dim or head_dim), dtype),
        positions=mx.broadcast_to(mx.arange(capacity, dtype=mx.int32), shape),
        offset=mx.zeros((batch,), mx.int32),
        rows=mx.array(0, mx.int32),
        sliding_window=sliding_window,
        max_rows=0,
        dense=True,
        packed=True,
    )


@typechecked
def from_full(keys: mx.array, values: mx.array, *, sliding_window: Optional[int] = None) -> State:
    """A state holding a plain full cache: row i has position i."""
    chex.assert_rank([keys, values], 4)
    chex.assert_shape(values, keys.shape[:3] + (None,))
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
    B, H, N, _ = keys.shape
    positions = mx.broadcast_to(mx.arange(N, dtype=mx.int32), (B, H, N))
    return State(
        keys=keys,
        values=values,
        positions=positions,
        offset=mx.full((B,), N, mx.int32),
        rows=mx.array(N, mx.int32),
        sliding_window=sliding_window,
        max_rows=N,
        dense=True,
        packed=True,
    )


def check_capacity(rows: int, what: str = "capacity") -> None:
    """Raise a ValueError if ``rows`` is more than a state can hold: its positions are int32."""
    if rows >= EMPTY:
        raise ValueError(
            f"{what} is {rows} rows, more than a state holds (int32 positions: fewer than "
            f"{EMPTY})"
        )


def check_queries(n_queries: int) -> None:
    if n_queries < 0:
        raise ValueError(f"mask needs n_queries >= 0, got {n_queries}")


def host_int(x: mx.array) -> Optional[int]:
    """A scalar array read on the host; None inside ``mx.compile`` or ``vmap``, where MLX reads
    nothing (a check that needs it is then left to the caller outside)."""
    try:
        return int(x.item())
    except ValueError:  # "Attempting to eval an array during function transformations"
        return None


def trim_lengths(length, shape: tuple) -> mx.array:
    """``prefix_trim``'s ``length``, an int in [0, 2**31 - 1) or an integer array broadcast to
    ``shape``, as an int32 array (an array's negative entries keep nothing, as 0 does); a
    TypeError or ValueError naming it otherwise."""
    if isinstance(length, mx.array):
        if not mx.issubdtype(length.dtype, mx.integer):
            raise TypeError(f"prefix_trim needs an integer length, got dtype {length.dtype}")
        return mx.maximum(mx.broadcast_to(length.astype(mx.int32), shape), 0)
    try:
        length = operator.index(length)  # an int, a numpy integer
    except TypeError:
        raise TypeError(
            f"prefix_trim needs an int or an integer mx.array, got {length!r}"
        ) from None
    if isinstance(length, bool) or not 0 <= length < EMPTY:
        raise ValueError(f"prefix_trim needs 0 <= length < {EMPTY}, got {length}")
    return mx.full(shape, length, mx.int32)


def next_positions(offset: mx.array, rows, slots: mx.array) -> mx.array:
    """(B, 1, n): the position an append gives each of ``slots`` (at or past ``rows``)."""
    return offset[:, None, None] + (slots - rows)[None, None, :]


def tail_positions(positions: mx.array, offset: mx.array, rows) -> mx.array:
    """``positions`` (B, H, capacity) with each slot at or past ``rows`` set to
    ``next_positions``."""
    slots = mx.arange(positions.shape[2], dtype=mx.int32)
    return mx.where((slots >= rows)[None, None, :], next_positions(offset, rows, slots), positions)


def grown_bound(state: State, n: int) -> Optional[int]:
    if state.max_rows is None:
        return None
    if state.max_rows + n > state.capacity:
        raise ValueError(
            f"cannot append {n} rows to a state holding up to {state.max_rows} rows with "
            f"capacity {state.capacity}: reserve(state, capacity) first"
        )
    return state.max_rows + n


@typechecked
def update(state: State, keys: mx.array, values: mx.array) -> State:
    """Append rows (B, n_kv_heads, n, head_dim); their true positions continue from ``offset``.

    Raises a ValueError, before anything is written, when the rows may not fit (``reserve``
    makes room; ``FunctionalModel`` grows its states itself)."""
    _check(state)
    chex.assert_rank([keys, values], 4)
    chex.assert_shape(keys, (*state.keys.shape[:2], None, state.keys.shape[3]))
    chex.assert_shape(values, (*state.values.shape[:2], keys.shape[2], state.values.shape[3]))
    if state.max_rows is None:  # a state built by hand: its rows read here, if not traced
        state = state.replace(max_rows=host_int(state.rows))
    return append(state, keys, values)


def append(state: State, keys: mx.array, values: mx.array, rows: Optional[int] = None) -> State:
    """``update`` without its type and shape checks (the capacity check stays), for a caller
    whose keys and values are made for this state: the model wrapper's layers, each call.

    ``rows``: the exact row count of a packed state, where the caller counts it on the host
    (mlx-lm's interop cache of one sequence): the rows are then written at a static slice."""
    n = keys.shape[2]
    bound = grown_bound(state, n)
    if rows is not None and not state.packed:
        raise ValueError("append: a row count (rows) is given only for a packed state")
    r = state.static_rows if rows is None else rows
    if r is not None:  # static slots, which reuse the buffer
        return state.replace(
            keys=_write(state.keys, keys, r),
            values=_write(state.values, values, r),
            offset=state.offset + n,
            rows=state.rows + n,
            max_rows=bound,
        )
    return append_at(state, keys, values, **appended(state, n), max_rows=bound)


def appended(state: State, n: int) -> dict:
    """What appending ``n`` rows derives from ``rows`` and ``offset``: the slots (n,) of the new
    rows, and the new ``offset`` and ``rows`` (the slots already hold the rows' positions)."""
    return dict(
        slots=state.rows + mx.arange(n, dtype=mx.int32),
        offset=state.offset + n,
        rows=state.rows + n,
    )


def append_at(state: State, keys, values, *, slots, offset, rows, max_rows=None):
    """``update`` with the ``appended`` arrays given, so layers that move in lockstep share one
    computation of them (``FunctionalModel`` does it once a call, not once a layer)."""
    return state.replace(
        keys=_scatter(state.keys, keys, slots),
        values=_scatter(state.values, values, slots),
        offset=offset,
        rows=rows,
        max_rows=max_rows,
    )


def _scatter(buffer: mx.array, rows: mx.array, slots: mx.array) -> mx.array:
    """Rows written at traced slots (n,) along axis 2: a scatter, which reuses the buffer when
    nothing else holds it (a slice update at a traced start copies it)."""
    shape = (*buffer.shape[:2], slots.shape[0], *buffer.shape[3:])
    index = mx.broadcast_to(slots.reshape((1, 1, -1) + (1,) * (buffer.ndim - 3)), shape)
    rows = mx.broadcast_to(rows.astype(buffer.dtype), shape)
    return mx.put_along_axis(buffer, index, rows, axis=2)


def _write(buffer: mx.array, rows: mx.array, start: int) -> mx.array:
    out = mx.array(buffer)  # a new handle: the input state's array is left as it was
    out[:, :, start : start + rows.shape[2]] = rows.astype(buffer.dtype)
    return out


@typechecked
def prefix_trim(state: State, length) -> State:
    """Keep exactly the rows whose true position is below ``length`` (an int or a (B,) array).

    Exact for prompt-cache reuse: what remains is what the state held of the first ``length``
    tokens. Freed slots below the new ``rows`` become EMPTY; ``rows`` shrinks to just past the
    last kept slot.
    """
    _check(state)
    lengths = trim_lengths(length, state.offset.shape)  # checks length
    plain = state.static_rows is not None and not isinstance(length, mx.array)
    static = operator.index(length) if plain else None
    slots = mx.arange(state.capacity, dtype=mx.int32)
    keep = (state.positions < lengths[:, None, None]) & (slots < state.rows)
    offset = mx.minimum(state.offset, lengths)
    rows = mx.max(mx.where(keep, slots + 1, 0)).astype(mx.int32)
    out = state.replace(
        positions=tail_positions(mx.where(keep, state.positions, EMPTY), offset, rows),
        offset=offset,
        rows=rows,
        dense=False,
        packed=False,
    )
    if static is not None:  # a prefix of a plain cache is a plain cache
        out = out.replace(max_rows=max(0, min(state.max_rows, static)), dense=True, packed=True)
    return out


def rollback(state: State, n: int) -> State:
    """``state`` before its last ``n`` appended rows (``update`` writes at ``rows``, so they
    are its last ``n`` slots), its flags and bounds as they were; ``trim`` drops the last ``n``
    tokens' rows wherever they are, and a compacted state it trims is no longer packed."""
    if n < 0:
        raise ValueError(f"rollback needs n >= 0, got {n}")
    offset, rows = state.offset - n, state.rows - n
    return state.replace(
        positions=tail_positions(state.positions, offset, rows),
        offset=offset,
        rows=rows,
        max_rows=None if state.max_rows is None else state.max_rows - n,
    )


def tail_run(positions: mx.array, offset: int) -> int:
    """Eagerly: how many of the last of ``positions`` (n_kv_heads, rows), in every head, are the
    positions just before ``offset`` in order (a run a trim of the last tokens can drop)."""
    rows = positions.shape[-1]
    expected = offset - 1 - mx.arange(rows, dtype=mx.int32)
    match = mx.all(positions[:, ::-1] == expected, axis=0).astype(mx.int32)
    return rows if mx.all(match).item() else int(mx.argmin(match).item())


@typechecked
def trim(state: State, n: int) -> State:
    """Drop the last ``n`` tokens of every sequence (speculative rollback): a prefix trim to
    ``offset - n``, so in a compacted state only rows of those tokens go."""
    if n < 0:
        raise ValueError(f"trim needs n >= 0, got {n}")
    if state.static_rows is not None:
        return prefix_trim(state, max(state.static_rows - n, 0))
    return prefix_trim(state, mx.maximum(state.offset - n, 0))


def check_keep_indices(state: State, keep_indices) -> None:
    """Raise a ValueError/TypeError naming what is wrong with ``keep_indices`` for ``state``:
    an integer array (B, n_kv_heads, k >= 1) of slots below the capacity (a slot at or past
    ``rows`` holds no row: kept, it is EMPTY), strictly increasing along each (sequence, head).
    Eager: it reads the indices on the host."""
    if not isinstance(keep_indices, mx.array):
        raise TypeError(f"keep_indices must be an mx.array, got {type(keep_indices).__name__}")
    if not mx.issubdtype(keep_indices.dtype, mx.integer):
        raise TypeError(f"keep_indices must be integers, got dtype {keep_indices.dtype}")
    want = tuple(state.keys.shape[:2])
    if keep_indices.ndim != 3 or tuple(keep_indices.shape[:2]) != want:
        raise ValueError(
            f"keep_indices must have shape (batch, n_kv_heads, k) = ({want[0]}, {want[1]}, k), "
            f"got {tuple(keep_indices.shape)}"
        )
    if keep_indices.shape[2] == 0:
        raise ValueError("keep_indices keeps no row (k = 0): keep at least one")
    lo, hi = int(keep_indices.min().item()), int(keep_indices.max().item())
    if lo < 0 or hi >= state.capacity:
        raise ValueError(
            f"keep_indices must lie in [0, {state.capacity}) (the state's slots), got values "
            f"from {lo} to {hi}"
        )
    step = keep_indices[..., 1:] - keep_indices[..., :-1]
    if keep_indices.shape[2] > 1 and mx.any(step <= 0).item():
        raise ValueError(
            "keep_indices must be sorted and unique along each (sequence, head): found a "
            "repeated or decreasing index"
        )


def gather(state: State, keep_indices: mx.array, packed: bool = False, room: int = 0) -> State:
    """``evict`` without the eager check, for traced code whose indices are valid by
    construction (a policy's ``keep_indices``); ``packed``: the caller knows every index is a
    stored row of a packed state. ``room``: free slots after the kept rows (``reserve``'s), in
    the same gathers: they hold copies of the last kept row, never read, as any free slot."""
    idx = keep_indices.astype(mx.int32)
    B, H, k = idx.shape
    if room:
        check_capacity(k + room)
        idx = mx.concatenate([idx, mx.broadcast_to(idx[..., -1:], (B, H, room))], axis=2)
    positions = mx.take_along_axis(state.positions, idx, axis=2)
    positions = positions if packed else mx.where(idx < state.rows, positions, EMPTY)
    return state.replace(
        keys=mx.take_along_axis(state.keys, idx[..., None], axis=2),
        values=mx.take_along_axis(state.values, idx[..., None], axis=2),
        positions=tail_positions(positions, state.offset, k) if room else positions,
        rows=mx.array(k, mx.int32),
        max_rows=k,
        dense=False,
        packed=packed,
    )


@typechecked
def evict(state: State, keep_indices) -> State:
    """Keep the slots ``keep_indices`` (B, n_kv_heads, k), sorted and unique; capacity becomes
    k. The indices are checked first (``check_keep_indices``)."""
    _check(state)
    check_keep_indices(state, keep_indices)
    stored = state.packed and int(keep_indices.max().item()) < int(state.rows.item())
    return gather(state, keep_indices, packed=stored)


@typechecked
def fitted(state: State, capacity: int) -> State:
    """The same state in exactly ``capacity`` slots (at least the rows it may hold,
    ``max_rows``): free slots added at the end, or its last free slots dropped, copied out of
    the larger buffer so that it is freed (a kept-whole layer prefilled into its prompt's
    bucket holds no more than its rows and ``capacity``)."""
    if capacity >= state.capacity:
        return reserve(state, capacity)
    if state.max_rows is None or state.max_rows > capacity:
        raise ValueError(f"cannot fit up to {state.max_rows} rows into {capacity} slots")
    slots = mx.arange(capacity, dtype=mx.int32)
    cut = lambda x: mx.take(x, slots, axis=2)  # noqa: E731  (a copy, not a view of the buffer)
    return state.replace(keys=cut(state.keys), values=cut(state.values),
                         positions=cut(state.positions))  # fmt: skip


@typechecked
def reserve(state: State, capacity: int) -> State:
    """The same state with room for ``capacity`` rows (free slots added at the end)."""
    extra = capacity - state.capacity
    if extra < 0:
        raise ValueError(f"reserve cannot shrink capacity {state.capacity} to {capacity}")
    check_capacity(capacity)
    if extra == 0:
        return state
    B, H, _, _ = state.keys.shape

    def pad(x, fill):
        return mx.concatenate([x, mx.broadcast_to(fill, (B, H, extra, *x.shape[3:]))], axis=2)

    slots = mx.arange(state.capacity, capacity, dtype=mx.int32)
    return state.replace(
        keys=pad(state.keys, mx.zeros((), state.keys.dtype)),
        values=pad(state.values, mx.zeros((), state.values.dtype)),
        positions=pad(state.positions, next_positions(state.offset, state.rows, slots)),
    )


@typechecked
def mask(state: State, n_queries: int) -> mx.array:
    """Boolean attention mask (B, n_kv_heads, n_queries, capacity) for the last ``n_queries``
    tokens (true positions ``offset - n_queries`` ...): causal over true positions, per head,
    limited to ``sliding_window`` for a sliding-window layer; free slots never attend."""
    _check(state)
    check_queries(n_queries)
    q = state.offset[:, None] - n_queries + mx.arange(n_queries, dtype=mx.int32)[None]
    q = q[:, None, :, None]
    k = state.positions[:, :, None, :]
    visible = k <= q
    if state.sliding_window is not None:
        visible = visible & (k > q - state.sliding_window)
    return visible


def packed_mask(state: State, n_queries: int) -> mx.array:
    """For a packed state about to take ``n_queries`` rows: the mask (1, 1, n, capacity) that
    ``mask`` gives after the update, the same for every sequence and head: query i sees the
    slots below ``rows + i + 1``."""
    slots = mx.arange(state.capacity, dtype=mx.int32)
    limit = state.rows + 1 + mx.arange(n_queries, dtype=mx.int32)
    return (slots[None, :] < limit[:, None])[None, None]


@typechecked
def valid_rows(state: State) -> mx.array:
    """(B, n_kv_heads) count of stored rows (non-EMPTY, below ``rows``)."""
    slots = mx.arange(state.capacity, dtype=mx.int32)
    return mx.sum((state.positions != EMPTY) & (slots < state.rows), axis=-1)


ARRAY_FIELDS = ("keys", "values", "positions", "offset", "rows")


def flatten(state: State) -> tuple[dict, tuple]:
    """Arrays for mx.compile / mlx tree utilities, plus the static part that shapes a trace:
    the sliding window and whether the state is packed (``max_rows`` and ``dense`` are host
    knowledge that a trace does not have)."""
    return {f: getattr(state, f) for f in ARRAY_FIELDS}, (state.sliding_window, state.packed)


def unflatten(
    arrays: dict, static: tuple, max_rows: Optional[int] = None, dense: bool = False
) -> State:
    sliding_window, packed = static
    return rebuilt(State, **arrays, sliding_window=sliding_window, max_rows=max_rows,
                   dense=dense, packed=packed or dense)  # fmt: skip


def rebuilt(cls, **fields):
    """A state dataclass (``State``, a ring, a partitioned or slots layer) from every one of its
    fields, without the chex constructor's per-call work: a compiled step rebuilds each layer's
    state from its output arrays every call (the constructor checks nothing these need)."""
    names = _field_names(cls)
    if tuple(fields) != names:  # in the fields' order, as the constructor would set them
        if fields.keys() != set(names):
            missing = [n for n in names if n not in fields]
            unexpected = [n for n in fields if n not in names]
            raise TypeError(f"{cls.__name__}: missing fields {missing}, unexpected {unexpected}")
        fields = {name: fields[name] for name in names}
    state = object.__new__(cls)
    state.__dict__.update(fields)
    return state


@lru_cache(maxsize=None)
def _field_names(cls) -> tuple:
    return tuple(f.name for f in dataclasses.fields(cls))


@typechecked
def restrict(state: State, keep_indices) -> State:
    """Mask, without moving anything, every slot not in ``keep_indices`` (B, n_kv_heads, k): the
    state attends exactly as ``evict(state, keep_indices)`` would (the exactness oracle)."""
    _check(state)
    check_keep_indices(state, keep_indices)
    slots = mx.arange(state.capacity, dtype=mx.int32)
    kept = mx.any(keep_indices[..., :, None] == slots, axis=-2) | (slots >= state.rows)
    return state.replace(
        positions=mx.where(kept, state.positions, EMPTY), dense=False, packed=False
    )


@typechecked
def stack(states: list[State]) -> State:
    """One batch from per-sequence states of the same layer (e.g. prompts of different lengths
    compacted alone). Shorter ones get EMPTY slots, so all write their next row at one slot."""
    if not states:
        raise ValueError("stack needs at least one state")
    sliding = {s.sliding_window for s in states}
    if len(sliding) > 1:
        raise ValueError(
            f"cannot stack layers with different sliding windows {sorted(sliding, key=str)}"
        )
    dtypes = {s.keys.dtype for s in states}
    if len(dtypes) > 1:
        raise ValueError(f"cannot stack layers of different dtypes {sorted(map(str, dtypes))}")
    capacity = max(s.capacity for s in states)
    rows = mx.max(mx.stack([s.rows for s in states]))
    padded = [reserve(s, capacity) for s in states]
    bounds = [s.max_rows for s in states]
    slots = mx.arange(capacity, dtype=mx.int32)
    positions = [mx.where(slots < s.rows, s.positions, EMPTY) for s in padded]
    offset = mx.concatenate([s.offset for s in padded])
    return State(
        keys=mx.concatenate([s.keys for s in padded]),
        values=mx.concatenate([s.values for s in padded]),
        positions=tail_positions(mx.concatenate(positions), offset, rows),
        offset=offset,
        rows=rows,
        sliding_window=states[0].sliding_window,
        max_rows=None if None in bounds else max(bounds),
        dense=all(s.dense for s in states) and len(set(bounds)) == 1,
        packed=all(s.dense for s in states) and len(set(bounds)) == 1,
    )


def arrays(states) -> list:
    """Every array of a state or a sequence of states, e.g. for ``mx.eval`` (which does not
    look inside dataclasses: ``mx.eval(states)`` would evaluate nothing)."""
    if isinstance(states, State):
        return list(flatten(states)[0].values())
    return [a for s in states for a in arrays(s)]


def row_bytes(state: State) -> float:
    """Bytes one stored row of every head takes (keys, values, positions; whole batch)."""
    return state.nbytes / max(state.capacity, 1)


def stored_bytes(state: State, rows: int) -> int:
    """Bytes of ``rows`` stored rows of every head (keys, values, positions)."""
    return int(row_bytes(state) * rows)


def take_heads(state: State, heads) -> State:
    """The state of a subset of ``state``'s KV heads."""
    idx = mx.array(list(heads), mx.int32)
    return state.replace(**{f: mx.take(getattr(state, f), idx, axis=1)
                            for f in ("keys", "values", "positions")})  # fmt: skip


def take(state: State, indices: mx.array) -> State:
    """The sequences ``indices`` of a batch's layer (``rows`` and the flags are the batch's)."""
    return state.replace(**{f: mx.take(getattr(state, f), indices, axis=0)
                            for f in ("keys", "values", "positions", "offset")})  # fmt: skip


def grown(state: State, n: int, bucket_rows: bool = False) -> State:
    """``layout.Layout.grown`` for a plain layer (a sliding window's buffer keeps its size)."""
    if state.max_rows is None:
        state = state.replace(max_rows=int(state.rows.item()))
    need = state.max_rows + n
    if need <= state.capacity:
        exact = state.capacity == bucket(state.capacity) or state.sliding_window is not None
        return state if not bucket_rows or exact else reserve(state, bucket(state.capacity))
    return reserve(state, bucket(max(need, 2 * state.capacity)))


@layout.register(State)
class Layout(layout.Layout):
    """A plain layer: host knowledge is ``max_rows`` and ``dense``."""

    name = "plain"
    ARRAY_FIELDS = ARRAY_FIELDS
    flatten = staticmethod(flatten)
    stack = staticmethod(stack)
    take = staticmethod(take)
    trim = staticmethod(trim)
    grown = staticmethod(grown)
    rollback = staticmethod(rollback)

    @staticmethod
    def host(state):
        return state.max_rows, state.dense

    @staticmethod
    def unflatten(arrays, static, host):
        return unflatten(arrays, static, *(host or (None, False)))

    @staticmethod
    def advanced(host, n):
        max_rows, dense = host
        return (None if max_rows is None else max_rows + n), dense

    @staticmethod
    def kept(state):
        rows = state.max_rows if state.max_rows is not None else int(state.rows.item())
        return rows, stored_bytes(state, rows)

    @staticmethod
    def lockstep_rows(state):
        if state.packed and state.sliding_window is None:
            return {(state.max_rows, state.capacity)}
        return set()

    @staticmethod
    def loaded(state):
        """A file written before free slots held their next positions (EMPTY there) gets the
        tail rebuilt, so appends to it are seen; a newer file is left as it was."""
        return state.replace(positions=tail_positions(state.positions, state.offset, state.rows))

    @staticmethod
    def head_parts(state, heads):
        return [(take_heads(state, hs), None) for hs in heads]

    @staticmethod
    def encode(static, host):
        (window, packed), (max_rows, dense) = static, host
        return dict(sliding_window=window, packed=packed, max_rows=max_rows, dense=dense)

    @staticmethod
    def decode(saved):
        return (saved["sliding_window"], saved["packed"]), (saved["max_rows"], saved["dense"])

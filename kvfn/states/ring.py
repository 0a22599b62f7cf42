"""StreamingRing: attention sinks plus a ring of the most recent rows, an immutable state of
fixed size (DuoAttention's streaming heads).

A query at true position q sees the rows at positions below ``sink`` and the last ``recent``
positions (q - recent, q]. The state holds exactly those for the next query: position p lives at
slot p when p < sink, else at slot ``sink + (p - sink) % recent``, so a write is a function of
the position alone and a decode step never moves a row. So the slots' positions need not be
stored: each slot holds the one position of its slot class among the last ``recent`` before
``offset`` (or its sink), and whether it holds a row at all follows from ``offset`` and
``since``, the lowest recent position a trim left (``positions`` derives them, EMPTY where none).
A prefix trim is exact: it keeps what the ring held of the first tokens, and a write is two
scatters (keys and values), no position.

Layout: keys/values (B, n_heads, sink + recent, head_dim); offset (B,) int32, the next true
position; since (B,) int32 (<= offset): the ring holds no recent row below it (rows a trim
dropped are not rewritten until appends pass them). Static: ``sink``, ``recent``, and ``full``:
True when every slot of every sequence is known to hold a row (a ring filled from a prompt longer
than its slots; updates keep it full, trims clear it), so a single query sees every slot and
attends without a mask.
"""

import chex
import mlx.core as mx
import numpy as np
from typeguard import typechecked

from .cache import EMPTY, State, check_queries, rebuilt, trim_lengths


@chex.dataclass(frozen=True, repr=False)
class StreamingRing:
    keys: mx.array
    values: mx.array
    offset: mx.array
    since: mx.array
    sink: int = 0
    recent: int = 1
    full: bool = False

    capacity = State.capacity  # slots: as a state's

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    @property
    def positions(self) -> mx.array:
        """(B, n_heads, sink + recent) int32: the true position of each slot's row, EMPTY where
        the slot holds none (every head holds the same positions)."""
        p, held = slot_positions(self.sink, self.recent, self.offset, self.since)
        return mx.broadcast_to(mx.where(held, p, EMPTY)[:, None], self.keys.shape[:3])

    def __repr__(self) -> str:
        B, H, _, D = self.keys.shape
        return (
            f"StreamingRing(batch={B}, heads={H}, head_dim={D}, sink={self.sink}, "
            f"recent={self.recent}, dtype={self.keys.dtype})"
        )


def _check_sizes(sink: int, recent: int) -> None:
    if type(sink) is not int or sink < 0:
        raise ValueError(f"sink must be an int >= 0, got {sink!r}")
    if type(recent) is not int or recent < 1:
        raise ValueError(f"recent must be an int >= 1, got {recent!r}")


@typechecked
def init(batch: int, n_heads: int, head_dim: int, *, sink: int, recent: int,
         dtype: mx.Dtype = mx.float32, value_dim: int | None = None) -> StreamingRing:  # fmt: skip
    """An empty ring."""
    _check_sizes(sink, recent)
    shape = (batch, n_heads, sink + recent)
    return StreamingRing(
        keys=mx.zeros((*shape, head_dim), dtype),
        values=mx.zeros((*shape, value_dim or head_dim), dtype),
        offset=mx.zeros((batch,), mx.int32),
        since=mx.zeros((batch,), mx.int32),
        sink=sink,
        recent=recent,
    )


def slot_positions(sink: int, recent: int, offset: mx.array, since: mx.array) -> tuple:
    """For a ring at ``offset`` (B,) whose recent rows start at ``since`` (B,): the position
    each slot's row has (B, sink + recent), and whether the slot holds it (B, sink + recent)."""
    j = mx.arange(sink + recent, dtype=mx.int32)[None]
    last = (offset - 1)[:, None]
    last_slot = sink + (last - sink) % recent
    p = mx.where(j < sink, j, last - (last_slot - j) % recent)
    low = mx.maximum(since, sink)[:, None]
    held = (p <= last) & ((j < sink) | (p >= low))
    return p, held


def slot_of(position: mx.array, sink: int, recent: int) -> mx.array:
    """The slot a position takes: its own below ``sink``, else the ring slot of the position
    ``recent`` before it."""
    slot = sink + (position - sink) % recent
    return mx.where(position < sink, position, slot) if sink else slot


def appended(ring: StreamingRing) -> dict:
    """What appending one row derives from ``offset`` alone: the slot (B,) that position
    ``offset`` takes and the new ``offset``. Rings of one ``sink`` and ``recent`` at the same
    offset (the layers of a model) share it."""
    return dict(slots=slot_of(ring.offset, ring.sink, ring.recent), offset=ring.offset + 1)


def write_at(ring: StreamingRing, keys: mx.array, values: mx.array, *, slots,
             offset) -> StreamingRing:  # fmt: skip
    """``update`` with one row (B, n_heads, 1, head_dim), written at its slot (``appended``'s
    arrays): two one-row scatters, in place when nothing else holds the old ring."""
    at = slots.reshape(slots.shape[0], 1, 1, 1)
    return ring.replace(
        keys=mx.put_along_axis(ring.keys, at, keys.astype(ring.keys.dtype), axis=2),
        values=mx.put_along_axis(ring.values, at, values.astype(ring.values.dtype), axis=2),
        offset=offset,
    )


@typechecked
def update(ring: StreamingRing, keys: mx.array, values: mx.array) -> StreamingRing:
    """Append rows (B, n_heads, n, head_dim) at positions ``offset ...``; rows that fall out of
    the ring are dropped. Any n, traceable: one row is written at its slot (``write_at``),
    more are a gather of the rows that stay."""
    chex.assert_rank([keys, values], 4)
    chex.assert_shape(keys, (*ring.keys.shape[:2], None, ring.keys.shape[3]))
    chex.assert_shape(values, (*ring.values.shape[:2], keys.shape[2], ring.values.shape[3]))
    if keys.shape[2] == 1:
        return write_at(ring, keys, values, **appended(ring))
    return gathered(ring, keys, values)


def gathered(ring: StreamingRing, keys: mx.array, values: mx.array) -> StreamingRing:
    """``update`` of any number of rows as a gather of the rows that stay (the whole ring is
    rewritten)."""
    n = keys.shape[2]
    p, held = slot_positions(ring.sink, ring.recent, ring.offset + n, ring.since)
    new = held & (p >= ring.offset[:, None])
    src = mx.clip(p - ring.offset[:, None], 0, n - 1)[:, None, :, None]
    take = new[:, None, :, None]

    def merged(old, rows):
        shape = (*rows.shape[:2], src.shape[2], rows.shape[3])
        picked = mx.take_along_axis(rows.astype(old.dtype), mx.broadcast_to(src, shape), axis=2)
        return mx.where(take, picked, old)

    return ring.replace(
        keys=merged(ring.keys, keys), values=merged(ring.values, values), offset=ring.offset + n
    )


def visible(ring: StreamingRing, key_positions: mx.array, n_queries: int) -> mx.array:
    """Mask (B, H, n, K) of keys at ``key_positions`` (B, H, K) for the last ``n_queries``
    tokens before ``ring.offset``: causal, and a sink or one of the last ``recent`` positions."""
    q = ring.offset[:, None] - n_queries + mx.arange(n_queries, dtype=mx.int32)[None]
    q = q[:, None, :, None]
    k = key_positions[:, :, None, :]
    return (k <= q) & ((k < ring.sink) | (k > q - ring.recent))


@typechecked
def mask(ring: StreamingRing, n_queries: int) -> mx.array:
    """Boolean mask (B, H, n_queries, sink + recent) of the ring's slots for its last
    ``n_queries`` tokens. Exact for one query; a longer chunk also needs the rows its own
    update pushed out (``kvfn.partitioned`` attends over the ring before the update plus the
    chunk)."""
    check_queries(n_queries)
    return visible(ring, ring.positions, n_queries)


def valid_rows(ring: StreamingRing) -> mx.array:
    """(B, H) count of the rows the ring holds (non-EMPTY slots)."""
    return mx.sum(ring.positions != EMPTY, axis=-1)


@typechecked
def prefix_trim(ring: StreamingRing, length) -> StreamingRing:
    """Keep the rows whose true position is below ``length`` (an int or (B,) array). The
    recent rows kept are those from ``offset - recent`` (or ``since``) up to ``length``."""
    length = trim_lengths(length, ring.offset.shape)
    offset = mx.minimum(ring.offset, length)
    since = mx.minimum(mx.maximum(ring.since, ring.offset - ring.recent), offset)
    return ring.replace(offset=offset, since=since, full=False)


@typechecked
def trim(ring: StreamingRing, n: int) -> StreamingRing:
    """Drop the last ``n`` tokens (speculative rollback). Rows the ring had already pushed out
    stay gone: afterwards the ring holds fewer than ``recent`` rows until new ones arrive."""
    if n < 0:
        raise ValueError(f"trim needs n >= 0, got {n}")
    return prefix_trim(ring, mx.maximum(ring.offset - n, 0))


@typechecked
def from_state(state: State, rows: int, *, sink: int, recent: int) -> StreamingRing:
    """The ring a plain prefilled state's heads keep of its first ``rows`` slots: the sinks and
    the last ``recent`` rows. ``state`` must be dense (slot i holds position i), as a fresh
    prefill is; traceable."""
    _check_sizes(sink, recent)
    B, H, _, D = state.keys.shape
    ring = init(B, H, D, sink=sink, recent=recent, dtype=state.keys.dtype,
                value_dim=state.values.shape[3])  # fmt: skip
    filled = update(ring, state.keys[:, :, :rows], state.values[:, :, :rows])
    # a sequence of a batch may hold fewer rows (offset below P): its later slots are empty
    filled = prefix_trim(filled, state.offset)
    return filled.replace(full=B == 1 and rows >= sink + recent)


def ordered(ring: StreamingRing) -> State:
    """Eagerly, the rows a ring of one sequence holds as a plain state, in position order (its
    sinks, then its recent run)."""
    pos = np.array(ring.positions[0, 0])
    order = [int(i) for i in np.argsort(pos, kind="stable") if pos[i] != EMPTY]
    idx = mx.array(order, mx.int32)
    keys, values, positions = (mx.take(x, idx, axis=2) for x in (ring.keys, ring.values,
                                                                  ring.positions))  # fmt: skip
    return State(keys=keys, values=values, positions=positions, offset=ring.offset,
                 rows=mx.array(len(order), mx.int32), max_rows=len(order), packed=True)  # fmt: skip


ARRAY_FIELDS = ("keys", "values", "offset", "since")


@typechecked
def stack(rings: list[StreamingRing]) -> StreamingRing:
    """One batch from rings of several sequences of one size (``sink``, ``recent``, heads and
    head size): side by side, each with its own ``offset`` and ``since``."""
    if not rings:
        raise ValueError("stack needs at least one ring")
    shapes = {(r.sink, r.recent, r.keys.shape[1:], r.values.shape[1:], r.keys.dtype) for r in rings}
    if len(shapes) > 1:
        raise ValueError(
            f"cannot stack rings of different sizes or dtypes: {sorted(map(str, shapes))}"
        )
    joined = {f: mx.concatenate([getattr(r, f) for r in rings]) for f in ARRAY_FIELDS}
    return rings[0].replace(**joined, full=all(r.full for r in rings))


def since_of(positions: mx.array, offset: mx.array, sink: int) -> mx.array:
    """A ring's ``since`` (B,) from the positions its slots hold (B, n_heads, sink + recent)
    (EMPTY where none), as rings recorded them before ``since`` existed: the lowest recent
    position held, or ``offset`` where none is."""
    recent = mx.where(positions[:, 0, sink:] == EMPTY, offset[:, None], positions[:, 0, sink:])
    return mx.minimum(mx.min(recent, axis=-1), offset).astype(mx.int32)


def flatten(ring: StreamingRing) -> tuple[dict, tuple]:
    return {f: getattr(ring, f) for f in ARRAY_FIELDS}, (ring.sink, ring.recent, ring.full)


def unflatten(arrays: dict, static: tuple) -> StreamingRing:
    sink, recent, full = static
    return rebuilt(StreamingRing, **arrays, sink=sink, recent=recent, full=full)

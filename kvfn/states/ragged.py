"""RaggedKVCache: one layer whose KV heads keep different numbers of rows, in one buffer per
array, each head its own contiguous range of slots (Ada-KV's allocation, stored for real).

Layout: keys (B, S, D), values (B, S, Dv), positions (B, S) int32; per sequence and KV head,
``starts`` (B, H) int32, the head's first slot, and ``lengths`` (B, H) int32, the rows it holds:
head h's rows are slots [starts, starts + lengths) in position order, then its free slots up
to the next head's start (the last head's, up to S). Every head has at least ``room`` free
slots (host knowledge), so a decode step writes each head's new row at starts + lengths: one
scatter per array. A free slot already holds the position the next append gives it (``offset``
plus its distance past the head's rows), so appends never write a position, and a query's mask
is its head's range and a comparison of positions. S is static (the rows a layer keeps plus
each head's room) while the per-head counts are arrays: a policy's allocation is traced, and a
batch of prompts, each with its own allocation, is compacted in one call.

The oracle: decoding from a ragged state equals decoding the plain state it was packed from with
attention masked per KV head to the rows that head keeps (tests/test_ragged.py).
"""

from typing import Optional

import chex
import mlx.core as mx

from .. import kernels
from . import cache as kv
from . import layout


@chex.dataclass(frozen=True, repr=False)
class RaggedKVCache:
    keys: mx.array
    values: mx.array
    positions: mx.array
    starts: mx.array
    lengths: mx.array
    offset: mx.array
    room: Optional[int] = None  # free slots every head has after its rows (host); None: unknown
    kept: Optional[int] = None  # rows every sequence keeps over all heads, if known (host)

    # what the model wrapper asks of any state
    sliding_window = None
    packed = False
    dense = False
    static_rows = None

    @property
    def n_kv_heads(self) -> int:
        return self.starts.shape[1]

    @property
    def slots(self) -> int:
        return self.keys.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in (self.keys, self.values, self.positions, self.starts,
                                      self.lengths))  # fmt: skip

    def __repr__(self) -> str:
        B, S, D = self.keys.shape
        return (
            f"RaggedKVCache(batch={B}, kv_heads={self.n_kv_heads}, slots={S}, head_dim={D}, "
            f"room={self.room}, dtype={self.keys.dtype})"
        )


def head_of(starts: mx.array, slots: int) -> mx.array:
    """(B, slots) int32: the KV head whose range holds each slot (the last head starting at or
    before it: a head of no slots holds none)."""
    s = mx.arange(slots, dtype=mx.int32)
    return (mx.sum(starts[:, :, None] <= s[None, None], axis=1) - 1).astype(mx.int32)


def _within(starts: mx.array, slots: int) -> tuple[mx.array, mx.array]:
    """Per slot, its head (B, S) and its index inside the head's range (B, S)."""
    head = head_of(starts, slots)
    first = mx.take_along_axis(starts, head, axis=1)
    return head, mx.arange(slots, dtype=mx.int32)[None] - first


def _free_positions(positions, starts, lengths, offset) -> mx.array:
    """``positions`` (B, S) with each head's free slots set to the positions the next appends
    give them: ``offset`` plus the slot's distance past the head's rows."""
    head, within = _within(starts, positions.shape[1])
    length = mx.take_along_axis(lengths, head, axis=1)
    tail = offset[:, None] + within - length
    return mx.where(within < length, positions, tail)


def pack(state: kv.State, keep: mx.array, *, capacity: int, room: int,
         kept: Optional[int] = None) -> RaggedKVCache:  # fmt: skip
    """The rows ``keep`` (B, n_kv_heads, P) marks of a packed plain ``state`` holding P rows,
    each KV head's in its own range followed by ``room`` free slots. ``capacity``: the most rows
    a sequence keeps over all its heads (static; S = capacity + n_kv_heads * room); ``kept``:
    the rows every sequence keeps, when the caller knows it is the same for all. Traceable; the
    marks' counts are the caller's promise (a sequence keeping more than ``capacity`` rows would
    run past the buffer)."""
    B, H, P = keep.shape
    if state.keys.shape[:2] != (B, H) or state.capacity < P:
        raise ValueError(f"keep {keep.shape} does not fit a state of {state.keys.shape[:3]}")
    if capacity < 0 or room < 0:
        raise ValueError(f"capacity and room must be >= 0, got {capacity} and {room}")
    S = capacity + H * room
    counts = mx.sum(keep, axis=-1).astype(mx.int32)
    size = counts + room
    starts = (mx.cumsum(size, axis=1) - size).astype(mx.int32)
    pos = mx.arange(P, dtype=mx.int32)
    order = mx.argsort(mx.where(keep, pos, pos + P), axis=-1).astype(mx.int32)  # kept rows first
    head, within = _within(starts, S)
    row = mx.take_along_axis(order.reshape(B, H * P), head * P + mx.minimum(within, P - 1), axis=1)
    source = head * state.capacity + row  # flat (head, slot) of the plain state
    flat = lambda x: x.reshape(B, H * state.capacity, *x.shape[3:])  # noqa: E731
    keys = mx.take_along_axis(flat(state.keys), source[..., None], axis=1)
    values = mx.take_along_axis(flat(state.values), source[..., None], axis=1)
    positions = mx.take_along_axis(flat(state.positions), source, axis=1)
    return RaggedKVCache(
        keys=keys,
        values=values,
        positions=_free_positions(positions, starts, counts, state.offset),
        starts=starts,
        lengths=counts,
        offset=state.offset,
        room=room,
        kept=kept,
    )


def from_keep_sets(state: kv.State, keep_sets, room: int = 0) -> RaggedKVCache:
    """Eagerly, from one sorted unique slot array per KV head (batch 1, or the same sets for
    every sequence), as ``kvfn.partitioned.from_keep_sets`` takes them."""
    B, H = state.keys.shape[:2]
    if len(keep_sets) != H:
        raise ValueError(f"{len(keep_sets)} keep sets for {H} KV heads")
    P = int(state.rows.item())
    keep = mx.zeros((H, P), mx.bool_)
    for h, rows in enumerate(keep_sets):
        keep[h, rows.astype(mx.int32)] = True
    keep = mx.broadcast_to(keep[None], (B, H, P))
    kept = int(mx.max(mx.sum(keep, axis=(1, 2))).item())
    return pack(state, keep, capacity=kept, room=room, kept=kept)


def _checked_rows(state: RaggedKVCache, keys: mx.array, values: mx.array) -> int:
    B, S, D = state.keys.shape
    for name, x, d in (("keys", keys, D), ("values", values, state.values.shape[2])):
        if not isinstance(x, mx.array) or x.ndim != 4 or x.shape[:2] != (B, state.n_kv_heads) \
                or x.shape[3] != d:  # fmt: skip
            shape = tuple(x.shape) if isinstance(x, mx.array) else type(x).__name__
            raise ValueError(
                f"{name} {shape} do not fit a ragged layer of batch {B}, {state.n_kv_heads} KV "
                f"heads, head_dim {d}"
            )
    if keys.shape[2] != values.shape[2]:
        raise ValueError(f"keys hold {keys.shape[2]} rows, values {values.shape[2]}")
    n = keys.shape[2]
    room = state.room if state.room is not None else kv.host_int(_free(state))
    if room is not None and n > room:
        raise ValueError(
            f"cannot append {n} rows to a ragged layer whose heads have {room} free slots: "
            "reserve(state, room) first"
        )
    return n


def update(state: RaggedKVCache, keys: mx.array, values: mx.array) -> RaggedKVCache:
    """Append rows (B, n_kv_heads, n, head_dim) to each head's range; their positions continue
    from ``offset``. ValueError before anything is written when they may not fit."""
    return append(state, keys, values, n=_checked_rows(state, keys, values))


def append(state: RaggedKVCache, keys, values, n: Optional[int] = None) -> RaggedKVCache:
    """``update`` without its checks, for the model wrapper's layers: one scatter per array."""
    B, H = state.starts.shape
    n = keys.shape[2] if n is None else n
    slot = state.starts + state.lengths  # (B, H)
    if n > 1:
        slot = (slot[..., None] + mx.arange(n, dtype=mx.int32)).reshape(B, H * n)
    index = {}  # as wide as the rows, so no scatter broadcasts its index (one for K and V alike)

    def write(buffer, rows):
        d = buffer.shape[2]
        if d not in index:
            index[d] = slot[..., None] + mx.zeros((1, 1, d), mx.int32)
        return mx.put_along_axis(buffer, index[d], rows.reshape(B, H * n, d).astype(buffer.dtype),
                                 axis=1)  # fmt: skip

    return state.replace(
        keys=write(state.keys, keys),
        values=write(state.values, values),
        lengths=state.lengths + n,
        offset=state.offset + n,
        room=None if state.room is None else state.room - n,
        kept=None,
    )


def _own(state: RaggedKVCache) -> mx.array:
    """(B, n_kv_heads, S): which slots hold each KV head's rows."""
    slot = mx.arange(state.slots, dtype=mx.int32)[None, None]
    ends = state.starts + state.lengths
    return (slot >= state.starts[..., None]) & (slot < ends[..., None])


def mask(state: RaggedKVCache, n_queries: int) -> mx.array:
    """(B, n_kv_heads, n_queries, S): for the last ``n_queries`` tokens (true positions
    ``offset - n_queries`` ...), each KV head's own rows at or before the query's position."""
    kv.check_queries(n_queries)
    q = state.offset[:, None] - n_queries + mx.arange(n_queries, dtype=mx.int32)[None]
    seen = state.positions[:, None, :] <= q[:, :, None]  # (B, n, S)
    return _own(state)[:, :, None, :] & seen[:, None]


def attend(state: RaggedKVCache, queries: mx.array, scale: float) -> mx.array:
    """Attention of ``queries`` (B, n_q_heads, n, D), whose rows ``update`` just appended, over
    each KV head's own rows, in query-head order. One token on CUDA: the ragged kernel, which
    reads only each head's rows; otherwise the masked SDPA over the buffer."""
    B, n_q, n, _ = queries.shape
    H = state.n_kv_heads
    if n_q % H:
        raise ValueError(f"{n_q} query heads do not group over {H} KV heads")
    if n == 1 and kernels.ranges_fused(queries, state.keys, state.values, H):
        return kernels.ranges_decode_attention(queries, state.keys, state.values, state.starts,
                                               state.lengths, scale=scale)  # fmt: skip
    m = mask(state, n)
    if n_q != H:
        m = mx.repeat(m, n_q // H, axis=1)
    out = kernels.attention(queries, state.keys[:, None], state.values[:, None], scale=scale,
                            mask=m)  # fmt: skip
    seen = mx.any(m, axis=-1, keepdims=True)  # a query that sees no row gets zeros
    return mx.where(seen, out, mx.array(0, out.dtype))


def prefix_trim(state: RaggedKVCache, length) -> RaggedKVCache:
    """Keep exactly the rows whose true position is below ``length`` (an int or a (B,) array):
    each head's rows are in position order, so what stays is a prefix of each range."""
    length = kv.trim_lengths(length, state.offset.shape)
    below = state.positions[:, None, :] < length[:, None, None]
    lengths = mx.sum(_own(state) & below, axis=-1).astype(mx.int32)
    offset = mx.minimum(state.offset, length)
    return state.replace(
        positions=_free_positions(state.positions, state.starts, lengths, offset),
        lengths=lengths,
        offset=offset,
        kept=None,
    )  # ``room`` stays a bound: a trim only frees slots


def trim(state: RaggedKVCache, n: int) -> RaggedKVCache:
    """Drop the last ``n`` tokens of every sequence (speculative rollback)."""
    if n < 0:
        raise ValueError(f"trim needs n >= 0, got {n}")
    return prefix_trim(state, mx.maximum(state.offset - n, 0))


def rollback(state: RaggedKVCache, n: int) -> RaggedKVCache:
    """``state`` before its last ``n`` appended rows (each head's last ``n``), its room back."""
    if n < 0:
        raise ValueError(f"rollback needs n >= 0, got {n}")
    lengths, offset = state.lengths - n, state.offset - n
    return state.replace(
        positions=_free_positions(state.positions, state.starts, lengths, offset),
        lengths=lengths,
        offset=offset,
        room=None if state.room is None else state.room + n,
        kept=None,
    )


def reserve(state: RaggedKVCache, room: int) -> RaggedKVCache:
    """The same rows with at least ``room`` free slots after every head's rows (each range
    grows; the buffer is laid out again). Reads the lengths on the host."""
    if isinstance(room, bool) or not isinstance(room, int) or room < 0:
        raise ValueError(f"reserve needs an int room >= 0, got {room!r}")
    B, H = state.starts.shape
    ends = _ends(state)
    free = int(_free(state, ends).item())
    if room <= free:
        return state.replace(room=free)
    extra = room - free
    S = state.slots + H * extra
    starts = state.starts + extra * mx.arange(H, dtype=mx.int32)[None]
    head, within = _within(starts, S)
    old = mx.take_along_axis(state.starts, head, axis=1) + within
    size = mx.take_along_axis(ends - state.starts, head, axis=1)
    source = mx.where(within < size, old, 0)
    take = lambda x: mx.take_along_axis(x, source.reshape(B, S, *([1] * (x.ndim - 2))),  # noqa
                                        axis=1)  # fmt: skip
    return state.replace(
        keys=take(state.keys),
        values=take(state.values),
        positions=_free_positions(take(state.positions), starts, state.lengths, state.offset),
        starts=starts,
        room=room,
    )


def padded(state: RaggedKVCache, slots: int) -> RaggedKVCache:
    """The same rows in a buffer of ``slots`` slots (at least ``state.slots``): the new slots
    are the last head's free slots, so every head's room is what it was. A decode loop pads its
    states to a bucket, and to the sizes of a trace it already has (``FunctionalModel.decode``),
    so that prompts of different allocations share a trace."""
    extra = slots - state.slots
    if extra < 0:
        raise ValueError(f"padded takes slots >= the state's {state.slots}, got {slots}")
    if extra == 0:
        return state
    pad = lambda x: mx.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
    positions = _free_positions(pad(state.positions), state.starts, state.lengths, state.offset)
    return state.replace(keys=pad(state.keys), values=pad(state.values), positions=positions)


def _ends(state: RaggedKVCache) -> mx.array:
    """(B, H): the slot past each head's range (the next head's start; the last, S)."""
    B = state.starts.shape[0]
    return mx.concatenate([state.starts[:, 1:], mx.full((B, 1), state.slots, mx.int32)], axis=1)


def _free(state: RaggedKVCache, ends: Optional[mx.array] = None) -> mx.array:
    """The fewest free slots any head has after its rows (``ends``: ``_ends(state)``)."""
    ends = _ends(state) if ends is None else ends
    return mx.min(ends - state.starts - state.lengths)


ARRAY_FIELDS = ("keys", "values", "positions", "starts", "lengths", "offset")


def stack(states: list) -> RaggedKVCache:
    """One batch from ragged layers of several sequences (e.g. one prompt compacted by several
    policies), each buffer grown to the longest; each sequence keeps its own ranges."""
    if not states:
        raise ValueError("stack needs at least one ragged state")
    shapes = {(s.n_kv_heads, s.keys.shape[2:], s.values.shape[2:], s.keys.dtype) for s in states}
    if len(shapes) > 1:
        raise ValueError(f"cannot stack ragged layers of different heads or dtypes: {shapes}")
    slots = max(s.slots for s in states)
    states = [padded(s, slots) for s in states]
    rooms = [s.room for s in states]
    kept = {s.kept for s in states}
    joined = {f: mx.concatenate([getattr(s, f) for s in states]) for f in ARRAY_FIELDS}
    return RaggedKVCache(**joined, room=None if None in rooms else min(rooms),
                         kept=kept.pop() if len(kept) == 1 else None)  # fmt: skip


def take(state: RaggedKVCache, indices: mx.array) -> RaggedKVCache:
    """The sequences ``indices`` of a batch's layer (each keeps its own ranges)."""
    arrays = {f: mx.take(getattr(state, f), indices, axis=0) for f in ARRAY_FIELDS}
    return state.replace(**arrays, kept=state.kept if indices.size == state.keys.shape[0] else None)


def head_rows(state: RaggedKVCache, b: int, h: int) -> tuple[mx.array, mx.array, mx.array]:
    """Eagerly, sequence b's KV head h: its keys (n, D), values (n, Dv) and positions (n,)."""
    start, n = int(state.starts[b, h].item()), int(state.lengths[b, h].item())
    return (state.keys[b, start : start + n], state.values[b, start : start + n],
            state.positions[b, start : start + n])  # fmt: skip


def flatten(state: RaggedKVCache) -> tuple[dict, tuple]:
    return {f: getattr(state, f) for f in ARRAY_FIELDS}, ()


def unflatten(arrays: dict, static: tuple, host=None) -> RaggedKVCache:
    room, kept = host or (None, None)
    return kv.rebuilt(RaggedKVCache, **arrays, room=room, kept=kept)


def grown(state: RaggedKVCache, n: int, bucket_rows: bool = False) -> RaggedKVCache:
    """``layout.Layout.grown``: room for ``n`` more rows in every head (at least double,
    a bucket); ``bucket_rows``: the buffer padded to a bucket of slots."""
    if state.room is None or n > state.room:
        room = 0 if state.room is None else state.room
        state = reserve(state, layout.bucket(max(room + n, 2 * room)))
    if bucket_rows and state.slots != layout.bucket(state.slots):
        state = padded(state, layout.bucket(state.slots))
    return state


def kept(state: RaggedKVCache) -> tuple[int, int]:
    """Rows a head keeps, on average over the batch and heads, and bytes stored."""
    B, H = state.starts.shape
    total = B * state.kept if state.kept is not None else int(mx.sum(state.lengths).item())
    return round(total / (B * H)), int(state.nbytes / state.slots * total / B)


def head_parts(state: RaggedKVCache, heads: tuple) -> list:
    """``layout.Layout.head_parts`` of one sequence: the heads of a part must hold as many
    rows each."""
    out = []
    for hs in heads:
        rows = [head_rows(state, 0, h) for h in hs]
        if len({r[0].shape[0] for r in rows}) != 1:
            raise ValueError(f"heads {list(hs)} hold different numbers of rows: part them apart")
        keys, values, positions = (mx.stack([r[i] for r in rows])[None] for i in range(3))
        n = keys.shape[2]
        out.append((kv.State(keys=keys, values=values, positions=positions, offset=state.offset,
                             rows=mx.array(n, mx.int32), max_rows=n, packed=True), None))  # fmt: skip
    return out


def as_ragged(state, room: int = 1) -> RaggedKVCache:
    """One sequence's layer as a ragged one: a ragged layer as it is, a plain one with every
    head keeping all its rows and ``room`` free slots (kvfn-server batches Ada-KV layers so)."""
    if type(state) is RaggedKVCache:
        return state
    if type(state) is not kv.State or state.sliding_window is not None:
        raise TypeError(f"cannot serve a {type(state).__name__} as a ragged layer")
    rows = int(state.rows.item())
    keep = mx.broadcast_to(mx.arange(state.capacity) < rows, state.keys.shape[:3])
    H = state.keys.shape[1]
    return pack(state, keep, capacity=rows * H, room=room, kept=rows * H)


@layout.register(RaggedKVCache)
class Layout(layout.Layout):
    """A ragged layer: host knowledge is ``room`` and ``kept``."""

    name = "ragged"
    per_head = True
    ARRAY_FIELDS = ARRAY_FIELDS
    flatten = staticmethod(flatten)
    unflatten = staticmethod(unflatten)
    stack = staticmethod(stack)
    take = staticmethod(take)
    trim = staticmethod(trim)
    grown = staticmethod(grown)
    rollback = staticmethod(rollback)
    kept = staticmethod(kept)
    head_parts = staticmethod(head_parts)
    padded = staticmethod(padded)

    @staticmethod
    def size(state):
        return state.slots

    @staticmethod
    def unit_bytes(state):
        return sum(x.nbytes // state.slots for x in (state.keys, state.values, state.positions))

    @staticmethod
    def host(state):
        return state.room, state.kept

    @staticmethod
    def advanced(host, n):
        room, _ = host
        return (None if room is None else room - n), None

    @staticmethod
    def encode(static, host):
        room, kept = host
        return dict(room=room, kept=kept)

    @staticmethod
    def decode(saved):
        return (), (saved["room"], saved["kept"])

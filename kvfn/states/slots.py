"""HeadSlotsKVCache: DuoAttention's two head parts of one layer (a plain part of C slots a
head, a streaming ring of sink + recent slots a head) in one buffer per array, each KV head
owning its own slot range. Nothing stores the union of the heads' rows, and a decode step
writes every head's new row with one scatter per array (keys, values), as a plain layer does,
where the two-part state (``kvfn.partitioned``) splits the rows per part first and writes
each part.

Layout: keys (B, S, D), values (B, S, Dv) with S = H0 * C + H1 * (sink + recent): the plain
part's heads ``heads[0]`` first, head i at slots [i * C, (i + 1) * C), then the ring heads
``heads[1]``, head j at [H0 * C + j * R, H0 * C + (j + 1) * R); positions (B, H0 * C) int32,
the plain slots' (a ring derives its own). Inside each range the slots are exactly those of
the part's state (``to_partitioned`` is a reshape of slices), so every law of the parts
carries over: ``to_partitioned(op(s)) == op(to_partitioned(s))``. Fields ``offset`` (B,),
``rows`` (the plain part's next slot) and ``since`` (the ring's) are the parts'. Static:
``heads``, ``capacity`` (C), ``sink``, ``recent``, ``packed`` (the plain part's slots below
``rows`` all hold rows), ``full`` (the ring's); host: ``max_rows``.

One row appended (a decode step) is written in place at its slot per head; everything else
(chunks, trims, masks) goes through the two-part state and back, which is exact and rare.
"""

from functools import lru_cache
from typing import Optional

import chex
import mlx.core as mx
import numpy as np

from .. import kernels
from . import cache as kv
from . import layout
from . import partitioned as part
from . import ring as rg


@chex.dataclass(frozen=True, repr=False)
class HeadSlotsKVCache:
    keys: mx.array
    values: mx.array
    positions: mx.array
    offset: mx.array
    rows: mx.array
    since: mx.array
    heads: tuple = ((), ())
    capacity: int = 0  # slots of one plain head
    sink: int = 0
    recent: int = 1
    packed: bool = True
    full: bool = False
    max_rows: Optional[int] = None

    # what the model wrapper asks of any state
    sliding_window = None
    dense = False
    static_rows = None

    @property
    def n_kv_heads(self) -> int:
        return len(self.heads[0]) + len(self.heads[1])

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + self.positions.nbytes

    def __repr__(self) -> str:
        B, S, D = self.keys.shape
        return (
            f"HeadSlotsKVCache(batch={B}, plain heads {list(self.heads[0])} x {self.capacity} "
            f"slots (max_rows={self.max_rows}), ring heads {list(self.heads[1])} x "
            f"{self.sink}+{self.recent}, head_dim={D}, dtype={self.keys.dtype})"
        )


def _ring_slots(s: HeadSlotsKVCache) -> int:
    return s.sink + s.recent


def from_partitioned(state) -> HeadSlotsKVCache:
    """The slots layout of a two-part layer: a plain part (full attention, any rows) and a
    ``StreamingRing``, in either order. ValueError for any other layout."""
    if not isinstance(state, part.HeadPartitionedKVCache):
        raise ValueError(
            f"from_partitioned takes a HeadPartitionedKVCache, got {type(state).__name__}"
        )
    if len(state.parts) != 2:
        raise ValueError(f"the slots layout holds two head parts, got {len(state.parts)}")
    (plain, ring), heads = state.parts, state.heads
    if isinstance(plain, rg.StreamingRing):
        plain, ring, heads = ring, plain, heads[::-1]
    if not (isinstance(plain, kv.State) and isinstance(ring, rg.StreamingRing)):
        raise ValueError("the slots layout holds one plain part and one StreamingRing, got "
                         f"{type(plain).__name__} and {type(ring).__name__}")  # fmt: skip
    if plain.sliding_window is not None:
        raise ValueError("the slots layout's plain part must be full attention (no window)")
    B, H0, C, D = plain.keys.shape
    _, H1, R, _ = ring.keys.shape
    if (
        ring.keys.shape[0] != B
        or ring.keys.shape[3] != D
        or ring.values.shape[3] != plain.values.shape[3]
    ):
        raise ValueError(
            f"parts {plain.keys.shape} and {ring.keys.shape} differ in batch or head_dim"
        )
    if plain.keys.dtype != ring.keys.dtype:
        raise ValueError(f"parts differ in dtype: {plain.keys.dtype} vs {ring.keys.dtype}")

    def joined(a, b):
        return mx.concatenate(
            [a.reshape(B, H0 * C, *a.shape[3:]), b.reshape(B, H1 * R, *b.shape[3:])], axis=1
        )

    return HeadSlotsKVCache(
        keys=joined(plain.keys, ring.keys),
        values=joined(plain.values, ring.values),
        positions=plain.positions.reshape(B, H0 * C),
        offset=plain.offset,
        rows=plain.rows,
        since=ring.since,
        heads=tuple(tuple(h) for h in heads),
        capacity=C,
        sink=ring.sink,
        recent=ring.recent,
        packed=bool(plain.packed or plain.dense),
        full=ring.full,
        max_rows=plain.max_rows,
    )


def to_partitioned(s: HeadSlotsKVCache) -> part.HeadPartitionedKVCache:
    """The two-part state of the same rows (views of the slot ranges, no copy for B == 1)."""
    B, _, D = s.keys.shape
    H0, H1, C, R = len(s.heads[0]), len(s.heads[1]), s.capacity, _ring_slots(s)
    split = H0 * C

    def view(x, lo, hi, h, n):
        return x[:, lo:hi].reshape(B, h, n, *x.shape[2:])

    plain = kv.State(
        keys=view(s.keys, 0, split, H0, C),
        values=view(s.values, 0, split, H0, C),
        positions=s.positions.reshape(B, H0, C),
        offset=s.offset,
        rows=s.rows,
        max_rows=s.max_rows,
        packed=s.packed,
    )
    ring = rg.StreamingRing(
        keys=view(s.keys, split, None, H1, R),
        values=view(s.values, split, None, H1, R),
        offset=s.offset,
        since=s.since,
        sink=s.sink,
        recent=s.recent,
        full=s.full,
    )
    return part.HeadPartitionedKVCache(parts=(plain, ring), heads=s.heads)


def pack_layers(states) -> tuple:
    """Every layer that ``from_partitioned`` takes in the slots layout, the others as they are."""

    def fits(s):
        if not isinstance(s, part.HeadPartitionedKVCache) or len(s.parts) != 2:
            return False
        kinds = {type(g) for g in s.parts}
        return kinds == {kv.State, rg.StreamingRing} and all(
            g.sliding_window is None for g in s.parts if isinstance(g, kv.State)
        )

    return tuple(from_partitioned(s) if fits(s) else s for s in states)


@lru_cache(maxsize=None)
def _layout(heads: tuple, capacity: int, ring: int) -> tuple:
    """Per KV head in model order: its first slot (int32 (n_kv_heads, 1)) and whether it is a
    ring head (bool (n_kv_heads, 1)), and the fused kernel's map (first slot, part) per head,
    flat."""
    H0 = len(heads[0])
    base, side = {}, {}
    for i, h in enumerate(heads[0]):
        base[h], side[h] = i * capacity, 0
    for j, h in enumerate(heads[1]):
        base[h], side[h] = H0 * capacity + j * ring, 1
    n = len(base)
    b = np.array([base[h] for h in range(n)], np.int32)
    g = np.array([side[h] for h in range(n)], np.int32)
    hmap = np.stack([b, g], 1).reshape(-1)
    return mx.array(b[:, None]), mx.array(g[:, None] == 1), mx.array(hmap)


def appended(s: HeadSlotsKVCache) -> dict:
    """What one appended row derives from the counters, the same for every layer of one
    (sink, recent) at one offset and row count: per sequence the plain slot and the ring slot
    (B, 1, 1 each), and the new ``offset`` and ``rows``."""
    B, p = s.offset.shape[0], s.offset
    plain = mx.broadcast_to(s.rows.reshape(-1, 1, 1), (B, 1, 1))
    ring = rg.slot_of(p, s.sink, s.recent).reshape(B, 1, 1)
    return dict(plain=plain, ring=ring, offset=p + 1, rows=s.rows + 1)


def write_at(s: HeadSlotsKVCache, keys: mx.array, values: mx.array, *, plain, ring, offset,
             rows) -> HeadSlotsKVCache:  # fmt: skip
    """One row per KV head (B, n_kv_heads, 1, D) written at its slot: two scatters, in place
    when nothing else holds the old buffers; no position (a plain slot at ``rows`` already
    holds the next one, a ring derives its own). ``appended``'s arrays."""
    base, ring_head, _ = _layout(s.heads, s.capacity, _ring_slots(s))
    B, H, _, D = keys.shape
    slot = base + mx.where(ring_head, ring, plain)  # (B, H, 1)
    # as wide as the rows within the same fused primitive, so no scatter broadcasts its index
    wide = slot + mx.zeros((1, 1, D), mx.int32)
    return s.replace(
        keys=mx.put_along_axis(s.keys, wide, keys.reshape(B, H, D).astype(s.keys.dtype), axis=1),
        values=mx.put_along_axis(
            s.values,
            wide if values.shape[3] == D else slot,
            values.reshape(B, H, -1).astype(s.values.dtype),
            axis=1,
        ),
        offset=offset,
        rows=rows,
        max_rows=None if s.max_rows is None else s.max_rows + 1,
    )


def _check_rows(s: HeadSlotsKVCache, keys: mx.array, values: mx.array) -> None:
    for name, x, d in (("keys", keys, s.keys.shape[2]), ("values", values, s.values.shape[2])):
        if not isinstance(x, mx.array) or x.ndim != 4:
            raise ValueError(f"{name} must be an mx.array (B, n_kv_heads, n, head_dim)")
        if x.shape[0] != s.keys.shape[0] or x.shape[1] != s.n_kv_heads or x.shape[3] != d:
            raise ValueError(
                f"{name} {tuple(x.shape)} do not fit a layer of batch {s.keys.shape[0]}, "
                f"{s.n_kv_heads} KV heads, head_dim {d}"
            )
    if keys.shape[2] != values.shape[2]:
        raise ValueError(f"keys hold {keys.shape[2]} rows, values {values.shape[2]}")


def update(s: HeadSlotsKVCache, keys: mx.array, values: mx.array) -> HeadSlotsKVCache:
    """Append rows (B, n_kv_heads, n, head_dim): one row is written at each head's slot
    (``write_at``), more go through the two-part state. ValueError before anything is
    written when the plain heads' rows may not fit (``reserve``)."""
    _check_rows(s, keys, values)
    n = keys.shape[2]
    if s.max_rows is not None and s.max_rows + n > s.capacity:
        raise ValueError(
            f"cannot append {n} rows to plain heads holding up to {s.max_rows} rows of "
            f"{s.capacity} slots: reserve(state, capacity) first"
        )
    if n == 1:
        return write_at(s, keys, values, **appended(s))
    return from_partitioned(part.update(to_partitioned(s), keys, values))


def _via_parts(fn):
    def op(s: HeadSlotsKVCache, *args):
        if not isinstance(s, HeadSlotsKVCache):
            raise ValueError(f"expected a HeadSlotsKVCache, got {type(s).__name__}")
        return from_partitioned(fn(to_partitioned(s), *args))

    op.__name__ = fn.__name__
    op.__doc__ = f"``partitioned.{fn.__name__}`` of the same rows, in the slots layout."
    return op


prefix_trim = _via_parts(part.prefix_trim)
trim = _via_parts(part.trim)


def reserve(s: HeadSlotsKVCache, capacity: int) -> HeadSlotsKVCache:
    """Room for ``capacity`` slots per plain head (EMPTY slots added at each head's end)."""
    p = to_partitioned(s)
    plain = kv.reserve(p.parts[0], capacity)
    return from_partitioned(p.replace(parts=(plain, p.parts[1])))


def mask(s: HeadSlotsKVCache, n_queries: int) -> tuple:
    """Per part (plain, ring), what ``partitioned.mask`` gives."""
    return part.mask(to_partitioned(s), n_queries)


def row_counts(s: HeadSlotsKVCache) -> mx.array:
    """(B, n_kv_heads) stored rows per KV head, in head order."""
    return part.row_counts(to_partitioned(s))


def attend(after: HeadSlotsKVCache, queries: mx.array, scale: float) -> mx.array:
    """Attention of one query token (B, n_q_heads, 1, D), whose row ``update`` just wrote,
    over each head's own slots, in query-head order. On CUDA with a packed plain part and a
    full ring: one fused kernel over the buffer; elsewhere the two-part path."""
    if queries.shape[2] != 1:
        raise ValueError(f"slots.attend takes one query token, got {queries.shape[2]}")
    if after.packed and after.full and kernels.slots_fused(queries, after.keys, after.values):
        _, _, hmap = _layout(after.heads, after.capacity, _ring_slots(after))
        return kernels.slots_decode_attention(
            queries, after.keys, after.values, after.rows, after.capacity, _ring_slots(after),
            hmap, scale=scale,
        )  # fmt: skip
    p = to_partitioned(after)
    return part.attend(p, p, queries, [None, None], [None, None], scale)  # reads only ``after``


ARRAY_FIELDS = ("keys", "values", "positions", "offset", "rows", "since")


def flatten(s: HeadSlotsKVCache) -> tuple[dict, tuple]:
    static = (s.heads, s.capacity, s.sink, s.recent, s.packed, s.full)
    return {f: getattr(s, f) for f in ARRAY_FIELDS}, static


def unflatten(arrays: dict, static: tuple, max_rows: Optional[int] = None) -> HeadSlotsKVCache:
    heads, capacity, sink, recent, packed, full = static
    return kv.rebuilt(HeadSlotsKVCache, **arrays, heads=heads, capacity=capacity, sink=sink,
                      recent=recent, packed=packed, full=full, max_rows=max_rows)  # fmt: skip


def grown(s: HeadSlotsKVCache, n: int, bucket_rows: bool = False) -> HeadSlotsKVCache:
    """``layout.Layout.grown``: the plain part grows (through the two-part state)."""
    fits = s.max_rows is not None and s.max_rows + n <= s.capacity
    if fits and not (bucket_rows and s.capacity != layout.bucket(s.capacity)):
        return s
    return from_partitioned(part.grown(to_partitioned(s), n, bucket_rows))


@layout.register(HeadSlotsKVCache)
class Layout(layout.Layout):
    """The slots layout: host knowledge is ``max_rows``; saved as its two-part state."""

    per_head = True
    flatten = staticmethod(flatten)
    unflatten = staticmethod(unflatten)
    grown = staticmethod(grown)
    trim = staticmethod(trim)
    saved_as = "slots"
    to_saved = staticmethod(to_partitioned)
    from_saved = staticmethod(from_partitioned)

    @staticmethod
    def host(s):
        return s.max_rows

    @staticmethod
    def advanced(host, n):
        return None if host is None else host + n

    @staticmethod
    def kept(s):
        return part.kept(to_partitioned(s))

    @staticmethod
    def lockstep_rows(s):
        return {(s.max_rows, s.capacity)}

    @staticmethod
    def head_parts(s, heads):
        return part.head_parts(to_partitioned(s), heads)

"""HeadPartitionedKVCache: one layer's KV heads split into parts that each store only their
own rows, so heads that keep little hold (and read) little.

A part is a ``PositionPreservingKVCache`` over some of the layer's KV heads (heads that keep
the same number of rows: a retrieval head's long context, or any per-head keep set) or a
``StreamingRing`` (sinks + recent rows: DuoAttention's streaming heads). ``heads[g]`` names the
KV heads of part g; together they are every head once. Nothing stores the union of the heads'
rows: attention runs per part over the part's rows and the outputs are put back in head
order, which is exact (a query head only ever reads its own KV head).

Every part knows each row's true position (a plain part records it, a ring derives it) and
the true ``offset`` (equal in all parts), so prefix trims and rollback stay exact, as for the
plain state.
"""

from functools import lru_cache
from typing import Callable, Sequence

import chex
import mlx.core as mx
import numpy as np
from typeguard import typechecked

from .. import kernels
from . import cache as kv
from . import layout
from . import ring as rg
from .ring import StreamingRing

PART_MODULES = {kv.State: kv, StreamingRing: rg}


@chex.dataclass(frozen=True, repr=False)
class HeadPartitionedKVCache:
    parts: tuple
    heads: tuple

    @property
    def offset(self) -> mx.array:
        return self.parts[0].offset

    @property
    def n_kv_heads(self) -> int:
        return sum(len(h) for h in self.heads)

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.parts)

    # what the model wrapper asks of any state
    sliding_window = None
    packed = False
    dense = False
    static_rows = None

    def __repr__(self) -> str:
        parts = ", ".join(f"{list(h)}: {g!r}" for h, g in zip(self.heads, self.parts))
        return f"HeadPartitionedKVCache({parts})"


def _module(part):
    try:
        return PART_MODULES[type(part)]
    except KeyError:
        raise TypeError(f"a head part must be a kvfn state or ring, got {type(part).__name__}")


def take_heads(state, heads: Sequence[int]):
    """The state (plain, or a ring) of a subset of ``state``'s KV heads."""
    if type(state) is not StreamingRing:
        return kv.take_heads(state, heads)
    idx = mx.array(list(heads), mx.int32)  # a ring's heads share the positions it derives
    return state.replace(keys=mx.take(state.keys, idx, axis=1),
                         values=mx.take(state.values, idx, axis=1))  # fmt: skip


@typechecked
def partition(parts: Sequence, heads: Sequence[Sequence[int]]) -> HeadPartitionedKVCache:
    """A partitioned layer from its parts and the KV heads each one holds."""
    if len(parts) != len(heads) or not parts:
        raise ValueError(f"{len(parts)} parts for {len(heads)} head lists (need >= 1, equal)")
    heads = tuple(tuple(int(h) for h in hs) for hs in heads)
    flat = sorted(h for hs in heads for h in hs)
    if flat != list(range(len(flat))) or any(not hs for hs in heads):
        raise ValueError(f"head parts {heads} must cover heads 0..n-1 once each, none empty")
    for g, hs in zip(parts, heads):
        _module(g)
        if g.keys.shape[1] != len(hs):
            raise ValueError(f"a part holds {g.keys.shape[1]} heads but is given {list(hs)}")
    return HeadPartitionedKVCache(parts=tuple(parts), heads=heads)


@typechecked
def from_keep_sets(state: kv.State, keep: Sequence) -> HeadPartitionedKVCache:
    """Evict each KV head of a plain ``state`` to its own rows: ``keep[h]`` (B, k_h) sorted
    unique slots of head h. Heads keeping equally many rows share a part. Eager and checked."""
    H = state.keys.shape[1]
    if len(keep) != H:
        raise ValueError(f"{len(keep)} keep sets for a layer of {H} KV heads")
    B = state.keys.shape[0]
    keep = [mx.broadcast_to(mx.array(k), (B, mx.array(k).shape[-1])) for k in keep]
    by_count: dict[int, list[int]] = {}
    for h, k in enumerate(keep):
        by_count.setdefault(k.shape[-1], []).append(h)
    parts, heads = [], []
    for count, hs in sorted(by_count.items(), reverse=True):
        sub = take_heads(state, hs)
        idx = mx.stack([keep[h] for h in hs], axis=1)
        try:
            parts.append(kv.evict(sub, idx))
        except (ValueError, TypeError) as e:
            raise type(e)(f"heads {hs}: {e}") from None
        heads.append(tuple(hs))
    return partition(parts, heads)


@lru_cache(maxsize=None)
def head_order(heads: tuple, rep: int) -> tuple:
    """For parts of KV heads ``heads``, each head ``rep`` rows (its query heads, or 1): the
    permutation that lists the rows part after part (shaped (1, rows, 1, 1), to index the
    head axis of (B, rows, n, D) arrays), each part's range in it, and the permutation back,
    (rows,) (both None when the rows already are in that order). Cached: a decode step asks
    for the same every layer."""
    order = [h * rep + r for hs in heads for h in hs for r in range(rep)]
    ends = np.cumsum([len(hs) * rep for hs in heads]).tolist()
    ranges = tuple(zip([0] + ends[:-1], ends))
    if order == sorted(order):
        return None, ranges, None
    index = mx.array(np.array(order, np.int32).reshape(1, -1, 1, 1))
    return index, ranges, mx.array(np.argsort(order), mx.int32)


def by_part(x: mx.array, heads: tuple, rep: int = 1) -> list:
    """``x`` (B, n_kv_heads * rep, n, D) as each part's rows: one gather at most, then
    slices."""
    order, ranges, _ = head_order(tuple(heads), rep)
    if order is not None:  # along an axis: one primitive (a take adds a transpose and squeeze)
        x = mx.take_along_axis(x, mx.broadcast_to(order, x.shape), axis=1)
    return [x[:, a:b] for a, b in ranges]


def in_head_order(queries: mx.array, heads: tuple, attend_part: Callable) -> mx.array:
    """Attention computed per head part, in query-head order: ``attend_part(g, q)`` is part
    g's output for its query heads ``q`` (of ``queries`` (B, n_q_heads, n, D))."""
    rep = queries.shape[1] // sum(len(hs) for hs in heads)
    outs = [attend_part(g, q) for g, q in enumerate(by_part(queries, heads, rep))]
    out = mx.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]
    back = head_order(tuple(heads), rep)[2]
    return out if back is None else mx.take(out, back, axis=1)


@typechecked
def split_rows(state: HeadPartitionedKVCache, keys: mx.array, values: mx.array) -> tuple:
    """New rows (B, n_kv_heads, n, head_dim) as each part's: (keys per part, values per
    part), for ``update_split`` and ``attend``."""
    chex.assert_rank([keys, values], 4)
    if keys.shape[1] != state.n_kv_heads:
        raise ValueError(f"rows for {keys.shape[1]} heads, the layer has {state.n_kv_heads}")
    return by_part(keys, state.heads), by_part(values, state.heads)


def update_split(state: HeadPartitionedKVCache, keys: list, values: list, derived=None):
    """``update`` with the rows already split per part (``split_rows``). ``derived(part,
    n)``, when given, returns what an append derives from a part's counters
    (``cache.appended`` for a packed part, ``ring.appended`` for one row into a ring) or None,
    so that layers in lockstep compute it once (``FunctionalModel`` does, once a call)."""
    parts = []
    for g, k, v in zip(state.parts, keys, values):
        shared = None if derived is None else derived(g, k.shape[2])
        if shared is None:
            parts.append(_module(g).update(g, k, v))
        elif isinstance(g, StreamingRing):
            parts.append(rg.write_at(g, k, v, **shared))
        else:
            bound = kv.grown_bound(g, k.shape[2])
            parts.append(kv.append_at(g, k, v, **shared, max_rows=bound))
    return state.replace(parts=tuple(parts))


def lockstep_derived(part, n: int, shared: dict, plain: Callable):
    """What an append of ``n`` rows to ``part`` derives from its counters, once for the layers
    in lockstep: a ring's for one row (kept in ``shared`` under its sizes), a plain part's
    ``plain(part, n)``; None to derive it alone."""
    if type(part) is not StreamingRing:
        return plain(part, n)
    if n != 1:
        return None
    key = ("ring", part.sink, part.recent)
    if key not in shared:
        shared[key] = rg.appended(part)
    return shared[key]


@typechecked
def update(state: HeadPartitionedKVCache, keys: mx.array, values: mx.array):
    """Append rows (B, n_kv_heads, n, head_dim) to every part."""
    return update_split(state, *split_rows(state, keys, values))


@typechecked
def prefix_trim(state: HeadPartitionedKVCache, length) -> HeadPartitionedKVCache:
    """Keep exactly the rows of the first ``length`` tokens in every part."""
    return state.replace(parts=tuple(_module(g).prefix_trim(g, length) for g in state.parts))


@typechecked
def trim(state: HeadPartitionedKVCache, n: int) -> HeadPartitionedKVCache:
    """Drop the last ``n`` tokens (speculative rollback) in every part."""
    if n < 0:
        raise ValueError(f"trim needs n >= 0, got {n}")
    return prefix_trim(state, mx.maximum(state.offset - n, 0))


@typechecked
def mask(state: HeadPartitionedKVCache, n_queries: int) -> tuple:
    """Per part, the boolean mask (B, part heads, n_queries, part capacity) of its own rows
    for the last ``n_queries`` tokens (exact for one query; see ``ring.mask``)."""
    return tuple(_module(g).mask(g, n_queries) for g in state.parts)


@typechecked
def row_counts(state: HeadPartitionedKVCache) -> mx.array:
    """(B, n_kv_heads) stored rows per KV head, in head order."""
    counts = [_module(g).valid_rows(g) for g in state.parts]
    order = np.argsort([h for hs in state.heads for h in hs])
    return mx.take(mx.concatenate(counts, axis=1), mx.array(order, mx.int32), axis=1)


def _part_rows(before, after, keys, values, n: int):
    """Keys, values and the mask (B, heads, n, rows) one part attends over for n queries."""
    if isinstance(after, StreamingRing):
        if n == 1:  # the update pushed out only a row the query no longer sees
            return after.keys, after.values, None if after.full else rg.mask(after, 1)
        pos = after.offset[:, None, None] - n + mx.arange(n, dtype=mx.int32)
        pos = mx.broadcast_to(pos, keys.shape[:3])
        k = mx.concatenate([before.keys, keys.astype(before.keys.dtype)], axis=2)
        v = mx.concatenate([before.values, values.astype(before.values.dtype)], axis=2)
        positions = mx.concatenate([before.positions, pos], axis=2)
        return k, v, rg.visible(after, positions, n)
    if before.packed and before.sliding_window is None:  # one (1, 1, n, C) mask for all heads
        if n == 1:  # the length, for the fused kernel where there is one
            return after.keys, after.values, after.rows
        return after.keys, after.values, kv.packed_mask(before, n)
    return after.keys, after.values, kv.mask(after, n)


@typechecked
def stack(states: list[HeadPartitionedKVCache]) -> HeadPartitionedKVCache:
    """One batch from partitioned layers of several sequences with the same head parts: each
    plain part stacked as ``cache.stack`` does (shorter ones padded with EMPTY slots), each
    ring beside rings of its size (``ring.stack``)."""
    if not states:
        raise ValueError("stack needs at least one partitioned state")
    heads = {s.heads for s in states}
    if len(heads) > 1:
        raise ValueError(
            f"cannot stack partitioned layers of different head parts {sorted(heads)}"
        )
    parts = []
    for g, members in enumerate(zip(*(s.parts for s in states))):
        kinds = {type(m) for m in members}
        if len(kinds) > 1:
            names = sorted(k.__name__ for k in kinds)
            raise ValueError(f"cannot stack head part {g} of different kinds {names}")
        parts.append(_module(members[0]).stack(list(members)))
    return states[0].replace(parts=tuple(parts))


@lru_cache(maxsize=None)
def _head_map(heads: tuple) -> mx.array:
    """For two parts of KV heads: per KV head its part and its index there, flat (int32)."""
    where = {h: (g, i) for g, hs in enumerate(heads) for i, h in enumerate(hs)}
    return mx.array([x for h in range(len(where)) for x in where[h]], mx.int32)


def _decode_fused(after: HeadPartitionedKVCache, queries: mx.array, scale: float):
    """One query over a packed part and a full ring (DuoAttention's layout) as one fused
    kernel, reading the queries and writing the outputs in head order; None where it does not
    apply (not CUDA, another layout), for the per-part path."""
    if len(after.parts) != 2 or queries.shape[2] != 1:
        return None
    plain, ring = after.parts
    heads = after.heads
    if isinstance(plain, StreamingRing):
        plain, ring, heads = ring, plain, heads[::-1]
    if not (isinstance(ring, StreamingRing) and ring.full and isinstance(plain, kv.State)):
        return None
    if not (plain.packed and plain.sliding_window is None):
        return None
    if not kernels.two_part_fused(queries, plain.keys, ring.keys):
        return None
    return kernels.two_part_decode_attention(
        queries, plain.keys, plain.values, plain.rows, ring.keys, ring.values, ring.capacity,
        _head_map(heads), scale=scale,
    )  # fmt: skip


def attend(before: HeadPartitionedKVCache, after: HeadPartitionedKVCache, queries: mx.array,
           ks: list, vs: list, scale: float) -> mx.array:  # fmt: skip
    """Attention of ``queries`` (B, n_q_heads, n, D) of the n tokens just appended, whose rows
    per part are ``ks``, ``vs`` (``split_rows``; ``after = update_split(before, ks, vs)``),
    over each part's rows, in query-head order. One query over DuoAttention's layout (a packed
    part and a full ring) on CUDA is one fused kernel over both parts."""
    n = queries.shape[2]
    fused = _decode_fused(after, queries, scale) if n == 1 else None
    if fused is not None:
        return fused

    def attend_part(g: int, q: mx.array) -> mx.array:
        gk, gv, m = _part_rows(before.parts[g], after.parts[g], ks[g], vs[g], n)
        if isinstance(m, mx.array) and m.dtype == mx.int32:  # a row count: slots [0, m)
            return kernels.ragged_decode_attention(q, gk, gv, m, scale=scale)
        if m is not None and m.shape[1] > 1 and q.shape[1] > m.shape[1]:
            m = mx.repeat(m, q.shape[1] // m.shape[1], axis=1)
        # m None: a full ring, whose every slot one query sees
        return kernels.attention(q, gk, gv, scale=scale, mask=m)

    return in_head_order(queries, after.heads, attend_part)


def flatten(state: HeadPartitionedKVCache) -> tuple[list, tuple]:
    flat = [_module(g).flatten(g) for g in state.parts]
    return [f[0] for f in flat], (
        state.heads,
        tuple((type(g), f[1]) for g, f in zip(state.parts, flat)),
    )


def unflatten(arrays: list, static: tuple, bounds: tuple) -> HeadPartitionedKVCache:
    """``bounds``: each part's ``max_rows`` (None for a ring)."""
    heads, kinds = static
    parts = []
    for a, (cls, st), bound in zip(arrays, kinds, bounds):
        if cls is StreamingRing:
            parts.append(rg.unflatten(a, st))
        else:
            parts.append(kv.unflatten(a, st, bound))
    return kv.rebuilt(HeadPartitionedKVCache, parts=tuple(parts), heads=heads)


def bounds(state: HeadPartitionedKVCache) -> tuple:
    """Each part's ``max_rows`` (None for a ring)."""
    return tuple(getattr(g, "max_rows", None) for g in state.parts)


def grown(state: HeadPartitionedKVCache, n: int, bucket_rows: bool = False):
    """``layout.Layout.grown``: the parts of plain rows grow (a ring has a fixed size)."""
    parts = tuple(kv.grown(g, n, bucket_rows) if type(g) is kv.State else g
                   for g in state.parts)  # fmt: skip
    same = all(a is b for a, b in zip(parts, state.parts))
    return state if same else state.replace(parts=parts)


def kept(state: HeadPartitionedKVCache) -> tuple[int, int]:
    """Rows a KV head stores, on average over the layer's heads, and bytes stored."""
    rows, nbytes = 0, 0
    for heads, part in zip(state.heads, state.parts):
        r = part.max_rows if type(part) is kv.State else part.capacity
        rows += r * len(heads)
        nbytes += int(part.nbytes / part.capacity * r)
    return round(rows / state.n_kv_heads), nbytes


def _encoded_part(cls, static, bound) -> dict:
    if cls is kv.State:
        return dict(kind="plain", sliding_window=static[0], packed=static[1], max_rows=bound)
    return dict(kind="ring", sink=static[0], recent=static[1], full=static[2])


def _decoded_part(saved: dict) -> tuple:
    if saved["kind"] == "plain":
        return (kv.State, (saved["sliding_window"], saved["packed"])), saved["max_rows"]
    return (StreamingRing, (saved["sink"], saved["recent"], saved.get("full", False))), None


def head_parts(state: HeadPartitionedKVCache, heads: tuple) -> list:
    """``layout.Layout.head_parts``: each of ``heads`` must lie inside one of the layer's
    parts; a ring's rows come in position order, with its window."""
    out = []
    for hs in heads:
        src = [i for i, own in enumerate(state.heads) if set(hs) <= set(own)]
        if not src:
            raise ValueError(f"heads {list(hs)} are not inside one part of {state.heads}")
        g, own = state.parts[src[0]], list(state.heads[src[0]])
        if list(hs) != own:
            g = take_heads(g, [own.index(h) for h in hs])
        ring = type(g) is StreamingRing
        out.append((rg.ordered(g), (g.sink, g.recent)) if ring else (g, None))
    return out


@layout.register(HeadPartitionedKVCache)
class Layout(layout.Layout):
    """A layer's heads in parts: host knowledge is each part's ``max_rows``."""

    name = "partitioned"
    per_head = True
    flatten = staticmethod(flatten)
    stack = staticmethod(stack)
    trim = staticmethod(trim)
    grown = staticmethod(grown)
    kept = staticmethod(kept)
    host = staticmethod(bounds)
    head_parts = staticmethod(head_parts)

    @staticmethod
    def unflatten(arrays, static, host):
        return unflatten(arrays, static, host or (None,) * len(arrays))

    @staticmethod
    def advanced(host, n):
        return tuple(None if b is None else b + n for b in host)

    @staticmethod
    def lockstep_rows(state):
        return set().union(*(kv.Layout.lockstep_rows(g) for g in state.parts
                             if type(g) is kv.State))  # fmt: skip

    @staticmethod
    def loaded(state):
        parts = (kv.Layout.loaded(g) if type(g) is kv.State else g for g in state.parts)
        return state.replace(parts=tuple(parts))

    @staticmethod
    def encode(static, host):
        heads, kinds = static
        parts = [_encoded_part(cls, st, bound) for (cls, st), bound in zip(kinds, host)]
        return dict(heads=[list(h) for h in heads], parts=parts)

    @staticmethod
    def decode(saved):
        parts = saved["parts"] if "parts" in saved else saved["groups"]  # files before 0.3
        kinds, bounds = zip(*(_decoded_part(g) for g in parts))
        return (tuple(tuple(h) for h in saved["heads"]), tuple(kinds)), tuple(bounds)

    @staticmethod
    def unnamed(prefix, flat, static):
        return [_unnamed_part(f"{prefix}.{i}", flat, k) for i, k in enumerate(static[1])]


def _unnamed_part(prefix: str, flat: dict, static) -> dict:
    cls, st = static
    if cls is kv.State:
        return {f: flat[f"{prefix}.{f}"] for f in kv.ARRAY_FIELDS}
    ring = {f: flat[f"{prefix}.{f}"] for f in rg.ARRAY_FIELDS if f"{prefix}.{f}" in flat}
    if "since" not in ring:  # written when rings stored a position per slot
        ring["since"] = rg.since_of(flat[f"{prefix}.positions"], ring["offset"], st[0])
    return ring

"""Evict a prompt cache layer by layer, and what it kept: ``EvictionResult``."""

from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np
from typeguard import typechecked

from .states import cache as kv
from .states import layout
from .states import partitioned as part
from .states.cache import row_bytes, stored_bytes  # noqa: F401  (kvfn.eviction's own names)


class _Bytes:
    """Totals of per-layer ``bytes_before`` / ``bytes_after``."""

    @property
    def total_bytes_before(self) -> int:
        return sum(self.bytes_before)

    @property
    def total_bytes_after(self) -> int:
        return sum(self.bytes_after)


@dataclass(frozen=True)
class EvictionResult(_Bytes):
    """Stored rows and bytes per layer, before and after, and their totals."""

    rows_before: tuple[int, ...]
    rows_after: tuple[int, ...]
    bytes_before: tuple[int, ...]
    bytes_after: tuple[int, ...]
    peak_rows: Optional[int] = None  # evicting while prefilling: the most rows a head held

    @property
    def total_rows_before(self) -> int:
        return sum(self.rows_before)

    @property
    def total_rows_after(self) -> int:
        return sum(self.rows_after)

    def __repr__(self) -> str:
        before, after = self.total_bytes_before, self.total_bytes_after
        return (
            f"EvictionResult(layers={len(self.rows_before)}, rows {self.total_rows_before} -> "
            f"{self.total_rows_after}, bytes {before / 1e6:.2f} MB -> {after / 1e6:.2f} MB "
            f"({100 * after / max(before, 1):.1f}%))"
        )


@dataclass(frozen=True)
class HeadPartitionedEvictionResult(_Bytes):
    """What a per-head eviction kept, per layer: the union of rows any head keeps (what a
    union-plus-mask store would hold), each KV head's rows, and bytes before and after."""

    union_rows: tuple[int, ...]
    head_rows: tuple[tuple[int, ...], ...]
    bytes_before: tuple[int, ...]
    bytes_after: tuple[int, ...]

    def __repr__(self) -> str:
        before, after = self.total_bytes_before, self.total_bytes_after
        rows = sum(sum(r) for r in self.head_rows)
        return (
            f"HeadPartitionedEvictionResult(layers={len(self.head_rows)}, head rows {rows}, "
            f"bytes {before / 1e6:.2f} MB -> {after / 1e6:.2f} MB "
            f"({100 * after / max(before, 1):.1f}%))"
        )


def kept(state) -> tuple[int, int]:
    """Rows a KV head stores (the mean over a layer's heads) and bytes stored."""
    return layout.of(state).kept(state)


def result_of(states: Sequence[kv.State], before: Sequence[int], after: Sequence):
    """The ``EvictionResult`` of plain layers that held ``before`` rows, now the states
    ``after``."""
    now = [kept(s) for s in after]
    return EvictionResult(
        rows_before=tuple(before),
        rows_after=tuple(r for r, _ in now),
        bytes_before=tuple(stored_bytes(s, r) for s, r in zip(states, before)),
        bytes_after=tuple(b for _, b in now),
    )


@typechecked
def evict_prompt_cache(
    states: Sequence[kv.State], keep_indices: Sequence
) -> tuple[tuple, EvictionResult]:
    """Gather ``keep_indices[i]`` (B, n_kv_heads, k; sorted, unique, below the stored rows) from
    every full-attention layer i, eagerly and checked. ``None`` keeps a layer whole. A
    sliding-window layer takes no indices: it is cut to the rows its window can still see,
    which changes nothing computed later. (``kvfn.compact`` does the same inside one compiled
    step from a policy.)"""
    if len(states) != len(keep_indices):
        raise ValueError(f"{len(keep_indices)} index arrays for {len(states)} layer states")
    new, before = [], []
    for i, (s, idx) in enumerate(zip(states, keep_indices)):
        rows = int(s.rows.item())
        if s.sliding_window is not None:
            if idx is not None:
                raise ValueError(f"layer {i} is a sliding-window layer: it takes no keep indices")
            keep = min(rows, s.sliding_window)
            idx = mx.broadcast_to(
                mx.arange(rows - keep, rows, dtype=mx.int32), (*s.keys.shape[:2], keep)
            )
        try:
            new.append(s.replace(max_rows=rows) if idx is None else kv.evict(s, idx))
        except (ValueError, TypeError) as e:
            raise type(e)(f"layer {i}: {e}") from None
        before.append(rows)
    return tuple(new), result_of(states, before, new)


def _merged_query_sets(sets: Sequence, n_kv: int, query_heads: int) -> list:
    """A KV head keeps the union of its query heads' sets."""
    if len(sets) != query_heads or query_heads % n_kv:
        raise ValueError(f"{len(sets)} query-head keep sets for query_heads={query_heads} over "
                         f"{n_kv} KV heads")  # fmt: skip
    rep = query_heads // n_kv
    merged = []
    for h in range(n_kv):
        union = np.unique(np.concatenate([np.array(sets[h * rep + r]) for r in range(rep)]))
        merged.append(mx.array(union.astype(np.int32)))
    return merged


@typechecked
def evict_prompt_cache_by_head(
    states: Sequence,
    head_keep_indices: Sequence,
    *,
    true_offset: Optional[int] = None,
    query_heads: Optional[int] = None,
) -> tuple[tuple, HeadPartitionedEvictionResult]:
    """Evict each KV head of each layer to its own rows: ``head_keep_indices[i]`` is None (layer
    i untouched) or one sorted unique slot array per KV head (or per query head with
    ``query_heads``: a KV head keeps the union of its query heads' rows). Heads keeping equally
    many rows share a part; no union is stored (``HeadPartitionedKVCache``). ``true_offset``,
    if given, must be every sequence's true position (a check). Eager and checked."""
    if len(states) != len(head_keep_indices):
        raise ValueError(f"{len(head_keep_indices)} keep lists for {len(states)} layer states")
    new, union, head_rows, before, after = [], [], [], [], []
    for i, (s, sets) in enumerate(zip(states, head_keep_indices)):
        if not isinstance(s, kv.State):
            raise TypeError(f"layer {i}: a {type(s).__name__}, not a plain kvfn state")
        if true_offset is not None and s.offset.tolist() != [true_offset] * s.offset.shape[0]:
            raise ValueError(f"layer {i}: offset {s.offset.tolist()} is not true_offset "
                             f"{true_offset}")  # fmt: skip
        rows = int(s.rows.item())
        H = s.keys.shape[1]
        before.append(stored_bytes(s, rows))
        if sets is None:
            new.append(s)
            union.append(rows)
            head_rows.append((rows,) * H)
            after.append(before[-1])
            continue
        try:
            if query_heads is not None:
                sets = _merged_query_sets(sets, H, query_heads)
            p = part.from_keep_sets(s, sets)
        except (ValueError, TypeError) as e:
            raise type(e)(f"layer {i}: {e}") from None
        counts = part.row_counts(p)
        any_head = set().union(*(np.array(x).ravel().tolist() for x in sets))
        new.append(p)
        union.append(len(any_head))
        head_rows.append(tuple(int(c) for c in counts.max(axis=0).tolist()))
        after.append(kept(p)[1])
    return tuple(new), HeadPartitionedEvictionResult(
        union_rows=tuple(union), head_rows=tuple(head_rows), bytes_before=tuple(before),
        bytes_after=tuple(after)
    )  # fmt: skip

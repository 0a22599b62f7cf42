"""Evict a prompt cache layer by layer, and what it kept: ``EvictionResult``."""

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
from typeguard import typechecked

from . import cache as kv


@dataclass(frozen=True)
class EvictionResult:
    """Stored rows and bytes per layer, before and after, and their totals."""

    rows_before: tuple[int, ...]
    rows_after: tuple[int, ...]
    bytes_before: tuple[int, ...]
    bytes_after: tuple[int, ...]

    @property
    def total_rows_before(self) -> int:
        return sum(self.rows_before)

    @property
    def total_rows_after(self) -> int:
        return sum(self.rows_after)

    @property
    def total_bytes_before(self) -> int:
        return sum(self.bytes_before)

    @property
    def total_bytes_after(self) -> int:
        return sum(self.bytes_after)

    def __repr__(self) -> str:
        before, after = self.total_bytes_before, self.total_bytes_after
        return (
            f"EvictionResult(layers={len(self.rows_before)}, rows {self.total_rows_before} -> "
            f"{self.total_rows_after}, bytes {before / 1e6:.2f} MB -> {after / 1e6:.2f} MB "
            f"({100 * after / max(before, 1):.1f}%))"
        )


def row_bytes(state: kv.State) -> float:
    """Bytes one stored row of every head takes (keys, values, positions; whole batch)."""
    return state.nbytes / max(state.capacity, 1)


def stored_bytes(state: kv.State, rows: int) -> int:
    """Bytes of ``rows`` stored rows of every head (keys, values, positions)."""
    return int(row_bytes(state) * rows)


def result_of(states: Sequence[kv.State], before: Sequence[int], after: Sequence[int]):
    """The ``EvictionResult`` of layers that held ``before`` rows and now hold ``after``."""
    return EvictionResult(
        rows_before=tuple(before),
        rows_after=tuple(after),
        bytes_before=tuple(stored_bytes(s, r) for s, r in zip(states, before)),
        bytes_after=tuple(stored_bytes(s, r) for s, r in zip(states, after)),
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
    after = [s.max_rows for s in new]
    return tuple(new), result_of(states, before, after)

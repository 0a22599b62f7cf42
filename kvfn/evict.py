"""Compact a prompt cache: evict every full-attention layer, leave every other layer alone."""

from dataclasses import dataclass
from typing import Optional, Sequence

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


def stored_bytes(state: kv.State, rows: int) -> int:
    """Bytes of ``rows`` stored rows of every head (keys, values, positions)."""
    per_row = (state.keys.nbytes + state.values.nbytes + state.positions.nbytes) / state.capacity
    return int(per_row * rows)


@typechecked
def evict_prompt_cache(
    states: Sequence[kv.State], keep_indices: Sequence[Optional[mx.array]]
) -> tuple[tuple, EvictionResult]:
    """Gather ``keep_indices[i]`` (B, n_kv_heads, k) from every full-attention layer i.

    ``None`` keeps a layer whole. A sliding-window layer is never evicted by scores; it is cut
    to the rows its window can still see, which changes nothing that is computed later.
    """
    if len(states) != len(keep_indices):
        raise ValueError(f"{len(keep_indices)} index arrays for {len(states)} layer states")
    new, before, after = [], [], []
    for i, (s, idx) in enumerate(zip(states, keep_indices)):
        rows = int(s.rows.item())
        if s.window is not None:
            if idx is not None:
                raise ValueError(f"layer {i} is a sliding-window layer: it takes no keep indices")
            keep = min(rows, s.window)
            idx = mx.broadcast_to(
                mx.arange(rows - keep, rows, dtype=mx.int32), (*s.keys.shape[:2], keep)
            )
        if idx is None:
            new.append(s)
        else:
            bad = mx.any((idx < 0) | (idx >= rows)).item()
            if bad:
                raise ValueError(f"layer {i}: keep indices outside the {rows} stored rows")
            new.append(kv.evict(s, idx))
        before.append(rows)
        after.append(int(new[-1].rows.item()))
    result = EvictionResult(
        rows_before=tuple(before),
        rows_after=tuple(after),
        bytes_before=tuple(stored_bytes(s, r) for s, r in zip(states, before)),
        bytes_after=tuple(stored_bytes(s, r) for s, r in zip(new, after)),
    )
    return tuple(new), result

"""A batch form of ``CompactedKVCache`` for mlx-lm's continuous batching (``BatchGenerator``).

mlx-lm batches a cache only through ``type(cache).merge([...])``. ``KVCache.merge`` builds a
``BatchKVCache`` from ``offset`` rows and its ``extract`` sets ``offset`` to the row count, which
corrupts a compacted cache (its true position is past its stored rows). ``BatchKVCache`` itself
keeps the RoPE offset per sequence apart from the storage (left padding, ``_idx``), so the batch
form below is a ``BatchKVCache`` whose ``merge`` sets the true offsets and whose ``extract`` gives
back a ``CompactedKVCache`` with its recorded per-head positions. Everything else (left-padded
rows, the causal mask from left padding, right-padded prefill, ``filter``, ``extend``) is
mlx-lm's own.
"""

from typing import List

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from .interop import CompactedKVCache


class BatchCompactedKVCache(BatchKVCache):
    """Left-padded rows of several compacted (or full) sequences, each with its true offset.

    ``prefix_positions[i]`` (1, kv_heads, r_i) holds the recorded true positions of the rows
    sequence i brought in; every row appended since is a contiguous run ending at ``offset[i]``,
    so ``extract`` rebuilds each row's position without storing a position per batch row.
    """

    def __init__(self, left_padding: List[int]):
        super().__init__(left_padding)
        self.prefix_positions = [mx.zeros((1, 1, 0), mx.int32) for _ in left_padding]

    @classmethod
    def merge(cls, caches):
        for i, c in enumerate(caches):
            if not isinstance(c, CompactedKVCache):
                raise TypeError(f"sequence {i}: cannot batch a {type(c).__name__} with kvfn caches")
            if c.sliding_window is not None:
                raise ValueError(f"sequence {i}: sliding-window caches are not batched")
        rows = [c.rows for c in caches]
        longest = max(rows)
        padding = [longest - r for r in rows]
        batch = cls(padding)
        batch.offset = mx.array([c.offset for c in caches])
        batch.prefix_positions = [c.positions[:, :, : c.rows] for c in caches]
        if longest == 0:
            return batch
        full = [c for c in caches if c.rows > 0]
        _, heads, _, dk = full[0].keys.shape
        dv, dtype = full[0].values.shape[3], full[0].keys.dtype
        keys = mx.zeros((len(caches), heads, longest, dk), dtype)
        values = mx.zeros((len(caches), heads, longest, dv), dtype)
        for i, (p, c) in enumerate(zip(padding, caches)):
            if c.rows:
                keys[i : i + 1, :, p:] = c.keys[:, :, : c.rows]
                values[i : i + 1, :, p:] = c.values[:, :, : c.rows]
        batch.keys, batch.values, batch._idx = keys, values, longest
        return batch

    def appended(self) -> List[int]:
        """Rows each sequence gained in this batch (after its prefix)."""
        stored = [self._idx - p for p in self.left_padding.tolist()]
        return [s - p.shape[2] for s, p in zip(stored, self.prefix_positions)]

    def extract(self, idx: int) -> CompactedKVCache:
        padding = self.left_padding.tolist()[idx]
        offset = int(self.offset[idx].item())
        prefix = self.prefix_positions[idx]
        keys = mx.contiguous(self.keys[idx : idx + 1, :, padding : self._idx])
        values = mx.contiguous(self.values[idx : idx + 1, :, padding : self._idx])
        new = keys.shape[2] - prefix.shape[2]
        tail = mx.arange(offset - new, offset, dtype=mx.int32)
        tail = mx.broadcast_to(tail, (1, keys.shape[1], new))
        if prefix.shape[1] != keys.shape[1]:
            prefix = mx.broadcast_to(prefix, (1, keys.shape[1], prefix.shape[2]))
        positions = mx.concatenate([prefix, tail], axis=2)
        return CompactedKVCache(keys, values, positions, offset)

    def filter(self, batch_indices):
        self.prefix_positions = [self.prefix_positions[i] for i in batch_indices]
        super().filter(batch_indices)

    def extend(self, other):
        if not isinstance(other, BatchCompactedKVCache):
            raise TypeError(f"cannot extend kvfn's batch cache with a {type(other).__name__}")
        prefix = self.prefix_positions + other.prefix_positions
        super().extend(other)
        self.prefix_positions = prefix

    def trim(self, n: int) -> int:
        """Drop up to ``n`` of the rows appended in this batch (never a compacted prefix)."""
        return super().trim(min([n, *self.appended()]))

    @property
    def nbytes(self) -> int:
        return super().nbytes + sum(p.nbytes for p in self.prefix_positions)

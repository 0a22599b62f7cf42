"""DuoAttention's head parts in mlx-lm's continuous batching (``BatchGenerator``):
``HeadPartsKVCache``, batched as ``BatchHeadPartsKVCache`` (a
``kvfn.serving.interop.BatchCompactedKVCache`` a part, a ring's rows masked). A plain compacted
cache's batch form is in ``interop``; a ragged layer's is any kind's, ``shell.StateCache``.
"""

import mlx.core as mx

from .. import kernels
from ..states import layout
from ..states import partitioned as part
from .interop import BatchCompactedKVCache, to_mlx_cache


class HeadPartsKVCache:
    """One sequence's layer of a per-head state (``kvfn.HeadPartitionedKVCache``) as mlx-lm's
    ``BatchGenerator`` takes it: one ``CompactedKVCache`` per head part, ``heads[g]`` naming
    its KV heads, and ``rings[g]`` = (sink, recent) for a part of streaming heads that sees
    only its sinks and recent rows, else None. It is only merged into a batch
    (``BatchHeadPartsKVCache``) or extracted from one; it never runs a model itself."""

    def __init__(self, parts, heads, rings):
        if not (len(parts) == len(heads) == len(rings)) or not parts:
            raise ValueError(
                f"need one head list and ring per part, got {len(parts)} parts, "
                f"{len(heads)} head lists, {len(rings)} rings"
            )
        self.parts, self.heads, self.rings = (
            list(parts),
            tuple(map(tuple, heads)),
            list(rings),
        )

    @classmethod
    def from_state(cls, state, heads) -> "HeadPartsKVCache":
        """From one layer's kvfn state (batch 1) as the parts ``heads`` (e.g. the policy's
        ``head_parts``): a plain state (a prompt kept whole, or any plain policy's) is split
        into them; a ``HeadPartitionedKVCache`` must hold each of them inside one of its parts.
        A streaming ring's part keeps its (sink, recent)."""
        heads = tuple(tuple(h) for h in heads)
        parts = layout.of(state).head_parts(state, heads)
        return cls([to_mlx_cache([g])[0] for g, _ in parts], heads, [w for _, w in parts])

    @property
    def offset(self) -> int:
        return self.parts[0].offset

    def size(self) -> int:
        return max(g.rows for g in self.parts)

    def empty(self) -> bool:
        return all(g.empty() for g in self.parts)

    @property
    def state(self):
        return [g.state[:3] for g in self.parts]

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.parts)

    @classmethod
    def merge(cls, caches) -> "BatchHeadPartsKVCache":
        return BatchHeadPartsKVCache.merge(caches)


class BatchHeadPartsKVCache:
    """A batch of ``HeadPartsKVCache`` layers: one ``BatchCompactedKVCache`` per head part.

    The model must call ``attend`` (``kvfn.wrapper.attending_copy``): each part attends over
    its own rows with its own mask and the outputs go back in query-head order, so no union of
    the parts' rows is stored or read. A streaming part's new rows are appended; a sequence
    whose part is a ring masks its rows between the sinks and the last ``recent``
    positions, which is what its ring would hold (exact; the masked rows stay in memory until
    the sequence leaves the batch, at most the tokens it generates)."""

    def __init__(self, parts, heads, rings):
        self.parts, self.heads = parts, heads
        self.rings = rings  # setting it rebuilds the ring arrays (once per membership)
        self._pending = None

    @property
    def rings(self) -> list:
        return self._rings

    @rings.setter
    def rings(self, rings: list) -> None:
        """Per part, per sequence (sink, recent) or None; kept as (limited, sink, recent)
        arrays of shape (B, 1, 1, 1) for the mask, or None for a part of no ring."""
        self._rings = rings
        expand = lambda x: mx.array(x)[:, None, None, None]  # noqa: E731
        self._limits = [
            None if all(w is None for w in ws) else
            (expand([w is not None for w in ws]), expand([w[0] if w else 0 for w in ws]),
             expand([w[1] if w else 0 for w in ws]))
            for ws in rings
        ]  # fmt: skip

    @classmethod
    def merge(cls, caches) -> "BatchHeadPartsKVCache":
        for i, c in enumerate(caches):
            if not isinstance(c, HeadPartsKVCache):
                raise TypeError(
                    f"sequence {i}: cannot batch a {type(c).__name__} with per-head caches"
                )
            if c.heads != caches[0].heads:
                raise ValueError(
                    f"sequence {i}: head parts {c.heads} differ from {caches[0].heads}"
                )
        parts = [BatchCompactedKVCache.merge([c.parts[g] for c in caches])
                  for g in range(len(caches[0].parts))]  # fmt: skip
        rings = [[c.rings[g] for c in caches] for g in range(len(parts))]
        return cls(parts, caches[0].heads, rings)

    # -- mlx-lm protocol ----------------------------------------------------------------------
    @property
    def offset(self):
        return self.parts[0].offset

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        return None  # every layer is a per-head cache, and ``attend`` builds each part's mask

    def _ring_mask(self, g: int, mask: mx.array, n: int) -> mx.array:
        """``mask`` (B, 1, n, T) of part g's rows, less the rows a sequence's ring would no
        longer hold: past its sinks and at or before the query's storage index minus
        ``recent``."""
        if self._limits[g] is None:
            return mask
        limited, sink, recent = self._limits[g]
        padding = self.parts[g].left_padding[:, None, None, None]
        T = mask.shape[-1]
        j = mx.arange(T)[None, None, None, :]
        q = (T - n + mx.arange(n))[None, None, :, None]
        old = (j - padding >= sink) & (j <= q - recent)
        return mask & ~(limited & old)

    def update_and_fetch(self, keys, values):
        n = keys.shape[2]
        pending = []
        rows = zip(self.parts, part.by_part(keys, self.heads), part.by_part(values, self.heads))
        for g, (cache, new_keys, new_values) in enumerate(rows):
            mask = cache.make_mask(n, return_array=True)
            k, v = cache.update_and_fetch(new_keys, new_values)
            pending.append((k, v, self._ring_mask(g, mask, n)))
        for cache in self.parts[1:]:  # only the first part's offset is read (by RoPE)
            cache.offset = mx.array(self.parts[0].offset)  # a handle of its own, one node
        self._pending = pending
        return keys, values  # the new rows only: ``attend`` reads the parts

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        if sinks is not None:
            raise TypeError("kvfn's per-head caches do not support attention sinks")
        pending, self._pending = self._pending, None

        def attend_part(g: int, q: mx.array) -> mx.array:
            k, v, m = pending[g]
            return kernels.attention(q, k, v, scale=scale, mask=m)

        return part.in_head_order(queries, self.heads, attend_part)

    def prepare(self, **kwargs):
        for g in self.parts:
            g.prepare(**kwargs)

    def finalize(self):
        for g in self.parts:
            g.finalize()

    @property
    def state(self):
        return [g.state for g in self.parts]

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        return min(g.trim(n) for g in self.parts)

    def size(self) -> int:
        return max(g._idx for g in self.parts)

    def empty(self) -> bool:
        return all(g.keys is None for g in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.parts)

    # -- batch membership ---------------------------------------------------------------------
    def filter(self, batch_indices):
        for g in self.parts:
            g.filter(batch_indices)
        self.rings = [[w[i] for i in batch_indices] for w in self.rings]

    def extend(self, other):
        if not isinstance(other, BatchHeadPartsKVCache) or other.heads != self.heads:
            raise TypeError(f"cannot extend a per-head batch cache with {type(other).__name__}")
        for g, o in zip(self.parts, other.parts):
            g.extend(o)
        self.rings = [a + b for a, b in zip(self.rings, other.rings)]

    def extract(self, idx: int) -> HeadPartsKVCache:
        return HeadPartsKVCache([g.extract(idx) for g in self.parts], self.heads,
                                 [w[idx] for w in self.rings])  # fmt: skip

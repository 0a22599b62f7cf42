"""Interop with mlx-lm: a compacted state as an mlx-lm cache object, and back.

``CompactedKVCache`` speaks mlx-lm 0.32's cache protocol (see the shared protocol notes), so
``generate`` / ``stream_generate``, speculative decoding and ``save_prompt_cache`` /
``load_prompt_cache`` work with a compacted prompt. Its ``offset`` is the true next position
(RoPE); ``size()`` is the number of stored rows; ``positions`` travel with the state, so a
file round trip keeps both.
"""

from typing import Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.base import create_causal_mask
from typeguard import typechecked

from . import cache as kv


class _TruePositions:
    """What both compacted caches share: rows with recorded true positions, offset apart."""

    def make_mask(self, n, return_array=False, window_size=None):
        window_size = window_size or self.sliding_window
        if n == 1 and window_size is None:
            return None
        if not return_array and window_size is None:
            return "causal"  # aligned to the end of the stored rows: right for any row count
        return create_causal_mask(n, offset=self.rows, window_size=window_size)

    @classmethod
    def from_state(cls, state):
        obj = cls.__new__(cls)
        obj.state = state
        return obj

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop up to ``n`` of the latest tokens; only a contiguous tail of true positions can
        go (rows appended after compaction, or a recent window), and it returns how many went."""
        n = min(n, self.contiguous_tail())
        self.rows -= n
        self.offset -= n
        return n

    def contiguous_tail(self) -> int:
        pos = np.array(self.positions[:, :, : self.rows])
        expected = self.offset - 1 - np.arange(self.rows)
        match = (pos[..., ::-1] == expected).all(axis=(0, 1))
        return int(self.rows if match.all() else np.argmin(match))

    def size(self) -> int:
        return self.rows

    def empty(self) -> bool:
        return self.rows == 0

    @property
    def nbytes(self) -> int:
        """Bytes of the stored rows: keys and values (``kv_nbytes``) and their positions."""
        return self.kv_nbytes + self.positions.itemsize * self.positions[..., : self.rows].size

    def _grow(self, arrays, n: int):
        """Room for ``n`` more rows: new buffers (never written in place while shared)."""
        if self.rows + n <= arrays[0].shape[2]:
            return arrays
        grow = ((n + self.step - 1) // self.step) * self.step
        return [
            mx.concatenate([x[:, :, : self.rows], mx.zeros((*x.shape[:2], grow, *x.shape[3:]), x.dtype)], axis=2)
            for x in arrays
        ]  # fmt: skip


class CompactedKVCache(_TruePositions):
    """A mutable mlx-lm cache over rows with recorded true positions (batch size 1).

    Rows are dense: every stored row of every head is valid and the same count per head, so the
    one mask an mlx-lm model builds from one layer is right for all layers.
    """

    step = 256

    def __init__(self, keys, values, positions, offset: int, sliding_window: Optional[int] = None):
        self.keys, self.values, self.positions = keys, values, positions
        self.offset, self.sliding_window = int(offset), sliding_window
        self.rows = keys.shape[2]

    # -- mlx-lm protocol ----------------------------------------------------------------------
    def update_and_fetch(self, keys, values):
        n = keys.shape[2]
        self.keys, self.values, self.positions = self._grow(
            [self.keys, self.values, self.positions], n
        )
        r = self.rows
        self.keys[:, :, r : r + n] = keys
        self.values[:, :, r : r + n] = values
        self.positions[:, :, r : r + n] = mx.arange(self.offset, self.offset + n, dtype=mx.int32)
        self.offset += n
        self.rows += n
        return self.keys[:, :, : self.rows], self.values[:, :, : self.rows]

    @property
    def state(self):
        r = self.rows
        return (
            self.keys[:, :, :r],
            self.values[:, :, :r],
            self.positions[:, :, :r],
            self.offset,
            self.sliding_window,
        )

    @state.setter
    def state(self, v):
        keys, values, positions, offset, window = v
        self.__init__(keys, values, positions.astype(mx.int32), int(offset), window)

    @property
    def kv_nbytes(self) -> int:
        per_row = (self.keys.nbytes + self.values.nbytes) // max(self.keys.shape[2], 1)
        return per_row * self.rows

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> "QuantizedCompactedKVCache":
        """The stored rows quantized with ``mx.quantize``, as mlx-lm's ``QuantizedKVCache`` does
        (so mlx-lm's ``kv_bits`` also applies to a compacted cache)."""
        r = self.rows
        keys, values = (
            mx.quantize(x[:, :, :r], group_size=group_size, bits=bits)
            for x in (self.keys, self.values)
        )
        return QuantizedCompactedKVCache(keys, values, self.positions[:, :, :r], self.offset,
                                         self.sliding_window, group_size, bits)  # fmt: skip

    @classmethod
    def merge(cls, caches):
        """A batch of compacted caches for mlx-lm's ``BatchGenerator`` (true offsets kept)."""
        from .batch import BatchCompactedKVCache  # batch.py builds on this module

        return BatchCompactedKVCache.merge(caches)

    # -- functional side ------------------------------------------------------------------------
    def to_state(self, capacity: Optional[int] = None) -> kv.State:
        """This cache as an immutable state with room for ``capacity`` rows."""
        r = self.rows
        s = kv.State(
            keys=self.keys[:, :, :r], values=self.values[:, :, :r], positions=self.positions[:, :, :r],
            offset=mx.array([self.offset], mx.int32), rows=mx.array(r, mx.int32),
            sliding_window=self.sliding_window, max_rows=r,
        )  # fmt: skip
        return kv.reserve(s, max(capacity or r, r))


class QuantizedCompactedKVCache(_TruePositions):
    """``CompactedKVCache`` with keys and values stored by ``mx.quantize`` (each a tuple of
    packed weights, scales, biases), read by mlx-lm's quantized attention (it looks for
    ``bits``). Memory per row: ``bits`` per element plus a scale and a bias per group."""

    step = 256

    def __init__(self, keys, values, positions, offset, sliding_window, group_size: int, bits: int):
        self.keys, self.values, self.positions = tuple(keys), tuple(values), positions
        self.offset, self.sliding_window = int(offset), sliding_window
        self.group_size, self.bits = int(group_size), int(bits)
        self.rows = positions.shape[2]

    def update_and_fetch(self, keys, values):
        n, r = keys.shape[2], self.rows
        grown = self._grow([*self.keys, *self.values, self.positions], n)
        self.keys, self.values, self.positions = tuple(grown[:3]), tuple(grown[3:6]), grown[6]
        for stored, new in ((self.keys, keys), (self.values, values)):
            for buf, part in zip(
                stored, mx.quantize(new, group_size=self.group_size, bits=self.bits)
            ):
                buf[:, :, r : r + n] = part
        self.positions[:, :, r : r + n] = mx.arange(self.offset, self.offset + n, dtype=mx.int32)
        self.offset += n
        self.rows += n
        return self._stored()

    def _stored(self):
        r = self.rows
        return tuple(x[:, :, :r] for x in self.keys), tuple(x[:, :, :r] for x in self.values)

    @property
    def state(self):
        keys, values = self._stored()
        return (keys, values, self.positions[:, :, : self.rows], self.offset, self.sliding_window,
                self.group_size, self.bits)  # fmt: skip

    @state.setter
    def state(self, v):
        keys, values, positions, offset, window, group_size, bits = v
        self.__init__(keys, values, positions.astype(mx.int32), offset, window, group_size, bits)

    @property
    def kv_nbytes(self) -> int:
        keys, values = self._stored()
        return sum(x.nbytes for x in (*keys, *values))


def register() -> None:
    """Let mlx-lm's ``load_prompt_cache`` resolve kvfn's cache classes by their names.

    Adds the two names to ``mlx_lm.models.cache``; called by ``to_mlx_cache`` and
    ``load_prompt_cache`` here, never on import."""
    mlx_cache.CompactedKVCache = CompactedKVCache
    mlx_cache.QuantizedCompactedKVCache = QuantizedCompactedKVCache


@typechecked
def to_mlx_cache(states: Sequence[kv.State]) -> list:
    """mlx-lm cache objects for the given layer states (batch size 1, rows without holes)."""
    register()
    caches = []
    for i, s in enumerate(states):
        if s.keys.shape[0] != 1:
            raise ValueError(f"layer {i}: mlx-lm interop takes batch size 1, got {s.keys.shape[0]}")
        r = int(s.rows.item())
        positions = s.positions[:, :, :r]
        if mx.any(positions == kv.EMPTY).item():
            raise ValueError(
                f"layer {i}: the state has empty rows among its first {r} (after a prefix trim); "
                "mlx-lm builds one mask for all layers, so it cannot take them"
            )
        caches.append(CompactedKVCache(s.keys[:, :, :r], s.values[:, :, :r], positions,
                                       int(s.offset.item()), s.sliding_window))  # fmt: skip
    return caches


@typechecked
def from_mlx_cache(caches: Sequence, capacity: Optional[int] = None) -> tuple:
    """Immutable states from mlx-lm caches: ``CompactedKVCache`` or a plain ``KVCache``."""
    states = []
    for i, c in enumerate(caches):
        if isinstance(c, CompactedKVCache):
            states.append(c.to_state(capacity))
        elif type(c) is mlx_cache.KVCache:
            keys, values = c.keys[:, :, : c.offset], c.values[:, :, : c.offset]
            states.append(
                kv.reserve(kv.from_full(keys, values), max(capacity or c.offset, c.offset))
            )
        else:
            raise TypeError(f"layer {i}: cannot convert a {type(c).__name__} to a kvfn state")
    return tuple(states)


def load_prompt_cache(path: str, return_metadata: bool = False):
    """mlx-lm's ``load_prompt_cache``, with kvfn's cache class registered first."""
    register()
    return mlx_cache.load_prompt_cache(path, return_metadata=return_metadata)

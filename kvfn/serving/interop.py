"""Interop with mlx-lm: a compacted state as an mlx-lm cache object, and back.

``CompactedKVCache`` (the one shell, ``shell.StateCache``, around a plain state) speaks mlx-lm
0.32's cache protocol (``mlx_lm.models.cache``) under mlx-lm's own attention, so ``generate`` /
``stream_generate``, speculative decoding and ``save_prompt_cache`` / ``load_prompt_cache``
work with a compacted prompt. Its ``offset`` is the true next position
(RoPE); ``size()`` is the number of stored rows; ``positions`` travel with the state, so a
file round trip keeps both. ``to_mlx_cache(states, policy=...)`` gives caches that also evict
while mlx-lm generates (``Evicting``), as ``kvfn.bounded_decode`` does in kvfn's own loop.
"""

from typing import List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.base import create_causal_mask, scaled_dot_product_attention
from mlx_lm.models.cache import BatchKVCache
from typeguard import typechecked

from .. import kernels
from ..decoding import check_bounded_decode
from ..policies.policy import BasePolicy
from ..scores import window_attention_scores
from ..states import cache as kv
from ..states import layout
from .shell import StateCache


def causal_mask(n: int, rows: int, window: Optional[int], return_array: bool):
    """mlx-lm's mask for ``n`` queries over ``rows`` stored rows without holes and the ``n``
    new ones after them: aligned to the end of the rows, so right for any row count."""
    if n == 1 and window is None:
        return None
    if not return_array and window is None:
        return "causal"
    return create_causal_mask(n, offset=rows, window_size=window)


class CompactedKVCache(StateCache):
    """A plain layer's ``StateCache`` that runs under mlx-lm's own attention (batch size 1).

    Its rows have no holes (a packed state), so the keys it fetches are exactly its rows and
    mlx-lm's causal mask, aligned to their end, is right for any row count: the one mask an
    mlx-lm model builds from its first layer is right for every layer. ``offset`` is the true
    next position (RoPE), an int; ``size()`` the stored rows; ``positions`` travel with the
    state, so a prompt-cache file keeps both. An ``Evicting`` makes it evict while mlx-lm
    generates."""

    def __init__(self, keys, values, positions, offset: int, sliding_window: Optional[int] = None,
                 evicting: Optional["Evicting"] = None):  # fmt: skip
        r = keys.shape[2]
        state = kv.State(keys=keys, values=values, positions=positions.astype(mx.int32),
                         offset=mx.array([int(offset)], mx.int32), rows=mx.array(r, mx.int32),
                         sliding_window=sliding_window, max_rows=r, packed=True)  # fmt: skip
        super().__init__(state)
        self._offset, self.evicting = int(offset), evicting

    @classmethod
    def from_state(cls, state):
        """From the ``state`` a prompt-cache file saved (mlx-lm's ``load_prompt_cache``)."""
        return cls(*state)

    @property
    def offset(self) -> int:
        return self._offset

    @property
    def rows(self) -> int:
        return self.layer_state.max_rows

    @property
    def sliding_window(self) -> Optional[int]:
        return self.layer_state.sliding_window

    @property
    def keys(self) -> mx.array:
        return self.layer_state.keys

    @property
    def values(self) -> mx.array:
        return self.layer_state.values

    @property
    def positions(self) -> mx.array:
        return self.layer_state.positions

    # -- mlx-lm protocol ----------------------------------------------------------------------
    def make_mask(self, n, return_array=False, window_size=None):
        return causal_mask(n, self.rows, window_size or self.sliding_window, return_array)

    def update_and_fetch(self, keys, values):
        if self.evicting is not None and self.evicting.due(self.rows, False):
            self.layer_state = self.evicting.compact(self.layer_state)
        n = keys.shape[2]
        state = layout.grown(self.layer_state, n)
        self.layer_state = kv.append(state, keys, values, rows=self.rows)
        self._offset += n
        r = self.rows
        return self.layer_state.keys[:, :, :r], self.layer_state.values[:, :, :r]

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        """mlx-lm's attention (``kvfn.wrapper.attending_copy`` calls it after
        ``update_and_fetch``); an evicting cache also reads the queries it scores rows by."""
        if self.evicting is not None:
            first = self.evicting.first_scored(self.rows, queries.shape[2])
            if first is not None:
                self.evicting.observe(self.layer_state, queries, scale, first)
        mask = kernels.sdpa_mask(mask, queries)
        return scaled_dot_product_attention(queries, keys, values, self, scale, mask, sinks)

    @property
    def state(self):
        r = self.rows
        return (self.keys[:, :, :r], self.values[:, :, :r], self.positions[:, :, :r], self.offset,
                self.sliding_window)  # fmt: skip

    @state.setter
    def state(self, v):
        self.__init__(*v)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop up to ``n`` of the latest tokens; only a contiguous tail of true positions can
        go (rows appended after compaction, or a recent window), and it returns how many went."""
        n = min(n, self.contiguous_tail())
        self.layer_state = kv.rollback(self.layer_state, n)
        self._offset -= n
        return n

    def contiguous_tail(self) -> int:
        """How many of the last rows are the last tokens, in order."""
        return kv.tail_run(self.positions[0, :, : self.rows], self.offset)

    def size(self) -> int:
        return self.rows

    @property
    def nbytes(self) -> int:
        """Bytes of the stored rows: keys and values (``kv_nbytes``) and their positions."""
        return self.kv_nbytes + self.positions.itemsize * self.positions[..., : self.rows].size

    @property
    def kv_nbytes(self) -> int:
        per_row = (self.keys.nbytes + self.values.nbytes) // max(self.keys.shape[2], 1)
        return per_row * self.rows

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> "QuantizedCompactedKVCache":
        """The stored rows quantized with ``mx.quantize``, as mlx-lm's ``QuantizedKVCache`` does
        (so mlx-lm's ``kv_bits`` also applies to a compacted cache)."""
        if self.evicting is not None:
            raise ValueError("a cache that evicts while generating is not quantized (mlx-lm's "
                             "kv_bits): its compactions read and gather the full-precision rows")  # fmt: skip
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
        return BatchCompactedKVCache.merge(caches)

    def extract(self, idx: int):
        raise TypeError("a CompactedKVCache holds one sequence; its batch form extracts")

    # -- functional side ------------------------------------------------------------------------
    def to_state(self, capacity: Optional[int] = None) -> kv.State:
        """This cache as an immutable state with room for ``capacity`` rows."""
        r = self.rows
        s = self.layer_state
        if s.capacity != r:
            s = kv.fitted(s, r)
        return kv.reserve(s, max(capacity or r, r))


class QuantizedCompactedKVCache:
    """``CompactedKVCache`` with keys and values stored by ``mx.quantize`` (each a tuple of
    packed weights, scales, biases), read by mlx-lm's quantized attention (it looks for
    ``bits``). Memory per row: ``bits`` per element plus a scale and a bias per group. No kvfn
    state holds quantized rows, so this one keeps its buffers itself: grown by the one capacity
    rule (``layout.bucket``), masked and trimmed as ``CompactedKVCache`` is."""

    def __init__(self, keys, values, positions, offset, sliding_window, group_size: int, bits: int):
        self.keys, self.values, self.positions = tuple(keys), tuple(values), positions
        self.offset, self.sliding_window = int(offset), sliding_window
        self.group_size, self.bits = int(group_size), int(bits)
        self.rows = positions.shape[2]

    @classmethod
    def from_state(cls, state):
        obj = cls.__new__(cls)
        obj.state = state
        return obj

    def make_mask(self, n, return_array=False, window_size=None):
        return causal_mask(n, self.rows, window_size or self.sliding_window, return_array)

    def update_and_fetch(self, keys, values):
        n, r = keys.shape[2], self.rows
        if r + n > self.positions.shape[2]:
            capacity = layout.bucket(max(r + n, 2 * self.positions.shape[2]))
            grow = lambda x: mx.pad(x[:, :, :r], [(0, 0), (0, 0), (0, capacity - r)]  # noqa: E731
                                    + [(0, 0)] * (x.ndim - 3))  # fmt: skip
            self.keys, self.values = tuple(map(grow, self.keys)), tuple(map(grow, self.values))
            self.positions = grow(self.positions)
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

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(n, kv.tail_run(self.positions[0, :, : self.rows], self.offset))
        self.rows -= n
        self.offset -= n
        return n

    def size(self) -> int:
        return self.rows

    def empty(self) -> bool:
        return self.rows == 0

    @property
    def nbytes(self) -> int:
        return self.kv_nbytes + self.positions.itemsize * self.positions[..., : self.rows].size

    @property
    def kv_nbytes(self) -> int:
        keys, values = self._stored()
        return sum(x.nbytes for x in (*keys, *values))


# mlx-lm batches a cache only through ``type(cache).merge([...])``. ``KVCache.merge`` builds a
# ``BatchKVCache`` from ``offset`` rows and its ``extract`` sets ``offset`` to the row count,
# which corrupts a compacted cache (its true position is past its stored rows). ``BatchKVCache``
# itself keeps the RoPE offset per sequence apart from the storage (left padding, ``_idx``), so
# the batch form is a ``BatchKVCache`` whose ``merge`` sets the true offsets and whose
# ``extract`` gives back a ``CompactedKVCache`` with its recorded per-head positions; everything
# else (left-padded rows, the causal mask from left padding, right-padded prefill, ``filter``,
# ``extend``) is mlx-lm's own.
class BatchCompactedKVCache(BatchKVCache):
    """Left-padded rows of several compacted (or full) sequences, each with its true offset.

    ``prefix_positions[i]`` (1, kv_heads, r_i) holds the recorded true positions of the rows
    sequence i brought in; every row appended since is a contiguous run ending at ``offset[i]``,
    so ``extract`` rebuilds each row's position without storing a position per batch row.
    """

    def __init__(self, left_padding: List[int]):
        super().__init__(left_padding)
        self.prefix_positions = [mx.zeros((1, 1, 0), mx.int32) for _ in left_padding]
        self.evicting = [None for _ in left_padding]  # each sequence's ``Evicting``, if any

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
        batch.evicting = [c.evicting for c in caches]
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
        s = self.sequence(idx, self.left_padding.tolist()[idx])
        keys, values = mx.contiguous(s.keys), mx.contiguous(s.values)
        return CompactedKVCache(keys, values, s.positions, int(s.offset.item()),
                                evicting=self.evicting[idx])  # fmt: skip

    def sequence(self, idx: int, padding: int) -> kv.State:
        """Sequence ``idx``'s rows (after its left ``padding``) as a packed state, its true
        positions rebuilt (its prefix's, then a run ending at its offset) from arrays: nothing
        is read on the host."""
        prefix = self.prefix_positions[idx]
        keys = self.keys[idx : idx + 1, :, padding : self._idx]
        rows, offset = keys.shape[2], self.offset[idx : idx + 1].astype(mx.int32)
        new = rows - prefix.shape[2]
        tail = offset[:, None, None] - new + mx.arange(new, dtype=mx.int32)
        tail = mx.broadcast_to(tail, (1, keys.shape[1], new))
        if prefix.shape[1] != keys.shape[1]:
            prefix = mx.broadcast_to(prefix, (1, keys.shape[1], prefix.shape[2]))
        return kv.State(keys=keys, values=self.values[idx : idx + 1, :, padding : self._idx],
                        positions=mx.concatenate([prefix, tail], axis=2), offset=offset,
                        rows=mx.array(rows, mx.int32), max_rows=rows, packed=True)  # fmt: skip

    def filter(self, batch_indices):
        self.prefix_positions = [self.prefix_positions[i] for i in batch_indices]
        self.evicting = [self.evicting[i] for i in batch_indices]
        super().filter(batch_indices)

    def extend(self, other):
        if not isinstance(other, BatchCompactedKVCache):
            raise TypeError(f"cannot extend kvfn's batch cache with a {type(other).__name__}")
        prefix = self.prefix_positions + other.prefix_positions
        evicting = self.evicting + other.evicting
        super().extend(other)
        self.prefix_positions, self.evicting = prefix, evicting

    def update_and_fetch(self, keys, values):
        if self._right_padding is None and any(e is not None for e in self.evicting):
            self._evict()
        return super().update_and_fetch(keys, values)

    def _evict(self) -> None:
        """Compacts each evicting sequence whose rows are due, in place, right-aligned at the
        end of the batch's rows (the slots before them become its left padding), then drops the
        padding every sequence has (the buffer then holds no more than the longest's rows)."""
        padding = self.left_padding.tolist()
        due = [i for i, e in enumerate(self.evicting)
               if e is not None and e.due(self._idx - padding[i], True)]  # fmt: skip
        if not due:
            return
        for i in due:
            new = self.evicting[i].compact(self.sequence(i, padding[i]))
            padding[i] = start = self._idx - new.max_rows
            self.keys[i : i + 1, :, start : self._idx] = new.keys
            self.values[i : i + 1, :, start : self._idx] = new.values
            self.prefix_positions[i] = new.positions
        common = min(padding)
        if common:
            self.keys, self.values = (x[..., common:, :] for x in (self.keys, self.values))
            self._idx -= common
        self.left_padding = mx.array([p - common for p in padding])

    def trim(self, n: int) -> int:
        """Drop up to ``n`` of the rows appended in this batch (never a compacted prefix)."""
        return super().trim(min([n, *self.appended()]))

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        """Attention over this layer's rows with this layer's own mask (called by
        ``kvfn.wrapper.attending_copy``'s attention, after ``update_and_fetch``). An mlx-lm model
        builds one mask from its first layer's cache, which is wrong where layers keep different
        numbers of rows (pyramidkv) or are padded differently; where they agree, the two masks
        are the same."""
        n = queries.shape[2]
        if any(e is not None for e in self.evicting):
            self._observe(queries, scale)
        own = create_causal_mask(n, offset=self._idx - n, left_padding=self.left_padding)
        own = kernels.sdpa_mask(own, queries)
        return scaled_dot_product_attention(queries, keys, values, self, scale, own, sinks)

    def _observe(self, queries, scale) -> None:
        padding = self.left_padding.tolist()
        for i, e in enumerate(self.evicting):
            first = None if e is None else e.first_scored(self._idx - padding[i], queries.shape[2])
            if first is not None:
                e.observe(self.sequence(i, padding[i]), queries[i : i + 1], scale, first)

    @property
    def nbytes(self) -> int:
        return super().nbytes + sum(p.nbytes for p in self.prefix_positions)


def widened(scores: mx.array, width: int) -> mx.array:
    """Per-row scores (B, H, n) with zeros for the rows up to ``width``."""
    more = width - scores.shape[-1]
    return mx.pad(scores, [(0, 0), (0, 0), (0, more)]) if more else scores


class Evicting:
    """What makes a ``CompactedKVCache`` evict while mlx-lm generates: whenever its rows reach
    the policy's budget plus ``interval``, the next append first compacts them back to the
    budget, as ``kvfn.bounded_decode`` does (the same rows: scored by the attention of the last
    ``policy.window`` queries, which the model hands the cache through ``attend`` when it runs
    as ``kvfn.wrapper.attending_copy(model)``). ``layer`` of ``layers``: the policy's layer."""

    def __init__(self, policy: BasePolicy, interval: int, layer: int, layers: int):
        self.policy, self.interval = policy.for_layer(layer, layers), interval
        self.layer, self.cap = layer, policy.budget + interval
        self.scores, self.unseen = None, False

    def due(self, rows: int, attends: bool) -> bool:
        """Whether rows held before an append call for a compaction; a ValueError where the
        model did not hand the cache its last queries and the cache needs them (a window-scored
        policy, or ``attends``: a batch masks its sequences itself)."""
        if self.unseen and (attends or self.policy.needs_scores):
            why = ("scores rows by the attention of recent queries" if self.policy.needs_scores
                   else "in a batch masks each sequence's rows itself")  # fmt: skip
            raise ValueError(
                f"{self.policy.name} evicting while generating {why}, which needs the model to "
                "hand its caches the queries: run it as kvfn.wrapper.attending_copy(model)"
            )
        self.unseen = True
        return rows >= self.cap

    def first_scored(self, rows: int, n: int) -> Optional[int]:
        """Of the last ``n`` queries, over ``rows`` rows held after their append, the first in
        the observation window before a compaction (None: none is, or the policy needs none)."""
        self.unseen = False
        first = max(0, self.cap - self.policy.window - (rows - n))  # a query's rows before it
        return first if self.policy.needs_scores and first < n else None

    def observe(self, state: kv.State, queries: mx.array, scale, first: int) -> None:
        """Adds the attention of ``queries[:, :, first:]`` (after RoPE, the last at ``offset -
        1``) over the rows ``state`` holds (all of its slots)."""
        n, r = queries.shape[2], state.max_rows
        qpos = state.offset[:, None] - n + mx.arange(first, n, dtype=mx.int32)[None]
        got = window_attention_scores(queries[:, :, first:], qpos, state, scale)
        if self.scores is not None:
            width = max(r, self.scores.shape[-1])
            got = widened(got, width) + widened(self.scores, width)
        self.scores = got
        # queued now: a lazy sum would hold every observed step's copy of the rows until the
        # compaction (the window's steps, each a buffer a layer)
        mx.async_eval(self.scores)

    def compact(self, state: kv.State) -> kv.State:
        """The rows the policy keeps of ``state`` (its ``max_rows`` rows, all of its slots),
        scored by what ``observe`` added, packed in a state of exactly their number."""
        r = state.max_rows
        state = state if state.capacity == r else kv.fitted(state, r)
        scores = None if self.scores is None else self.scores[..., :r]
        new = self.policy.compact_layer(state.replace(packed=True), scores, prompt_length=r,
                                        layer=self.layer, reserve=0)  # fmt: skip
        self.scores = None
        return new


def register() -> None:
    """Let mlx-lm's ``load_prompt_cache`` resolve kvfn's cache classes by their names.

    Adds the two names to ``mlx_lm.models.cache``; called by ``to_mlx_cache`` and
    ``load_prompt_cache`` here, never on import."""
    mlx_cache.CompactedKVCache = CompactedKVCache
    mlx_cache.QuantizedCompactedKVCache = QuantizedCompactedKVCache


@typechecked
def to_mlx_cache(
    states: Sequence, *, policy: Optional[BasePolicy] = None, interval: int = 512
) -> list:
    """mlx-lm cache objects for the given layer states (batch size 1, rows without holes).

    A layer of a per-head kind (ragged rows, head parts, slots) keeps a row count per head,
    which no mlx-lm cache object holds (a model builds one mask for every head): a ValueError
    names it and what takes it instead. With ``policy``, the caches evict while mlx-lm
    generates: at most the policy's budget plus ``interval`` rows a layer (``Evicting``; a
    window-scored policy needs the model as ``kvfn.wrapper.attending_copy(model)``). What
    cannot evict while generating is refused by name, as ``kvfn.bounded_decode`` refuses it."""
    register()
    for i, s in enumerate(states):
        layout.of(s)  # a TypeError for what is no kvfn layer state
        if type(s) is not kv.State:
            raise ValueError(
                f"layer {i}: a {type(s).__name__} keeps its rows per KV head, which mlx-lm's "
                "cache objects cannot hold; decode it with FunctionalModel.decode (kvfn-server "
                "serves it through its per-head batch caches)"
            )
    if policy is not None:
        check_bounded_decode(states, policy, interval)
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
    return evicting(caches, policy, interval)


def evicting(caches: list, policy: Optional[BasePolicy], interval: Optional[int]) -> list:
    """``CompactedKVCache`` layers made to evict while generating (each layer an ``Evicting``
    of ``policy`` every ``interval`` tokens), or not to (``policy`` or ``interval`` None); the
    caller has checked that the policy can (``kvfn.decoding.check_generating``)."""
    off = policy is None or interval is None
    for i, c in enumerate(caches):
        c.evicting = None if off else Evicting(policy, interval, i, len(caches))
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

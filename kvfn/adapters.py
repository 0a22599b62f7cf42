"""mlx-lm's cache protocol (``offset``, ``update_and_fetch``, ``make_mask``, and ``attend`` for
the attention modules ``FunctionalModel`` copies) over each kind of kvfn layer state, for the
length of one forward call: an adapter holds the layer's state, replaces it with the updated one
as the model writes its new rows, and, in a scored call, adds the layer's statistic for the
queries ``QuerySlice`` names."""

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from . import kernels
from .scores import (
    add_query_moments,
    reconstruction_attention,
    window_attention_max,
    window_attention_scores,
)
from .states import cache as kv
from .states import layout
from .states import partitioned as part
from .states import ragged as rgd
from .states import slots as sl


class Call:
    """What the layers of one forward call share: whether the model asked for array masks, and
    for layers in lockstep (packed, full attention, equal rows and capacity: the host knew it
    before the call) the new rows' slots, offset, rows and mask, computed once."""

    def __init__(self, lockstep: bool = False):
        self.return_array, self.lockstep = False, lockstep
        self.shared: dict = {}

    def in_lockstep(self, state: kv.State) -> bool:
        return self.lockstep and state.packed and state.sliding_window is None

    def derived(self, state: kv.State, n: int) -> tuple:
        """``kv.appended`` and ``kv.packed_mask``, which every lockstep layer derives alike, from
        the first one that asks."""
        if n not in self.shared:
            self.shared[n] = (kv.appended(state, n), kv.packed_mask(state, n))
        return self.shared[n]

    def part_derived(self, state, n: int):
        """For a head part of a partitioned layer: what its append derives from its counters,
        shared by the layers in lockstep (``partitioned.update_split``); None to derive it
        alone."""
        if not self.lockstep:
            return None
        return part.lockstep_derived(state, n, self.shared, self._plain_derived)

    def _plain_derived(self, state: kv.State, n: int):
        return self.derived(state, n)[0] if self.in_lockstep(state) else None

    def slots_derived(self, state: sl.HeadSlotsKVCache):
        """``slots.appended`` for a slots layer, shared by the layers in lockstep (one ring
        size, one row count); None to derive it alone."""
        if not (self.lockstep and state.packed):
            return None
        key = ("slots", state.sink, state.recent)
        if key not in self.shared:
            self.shared[key] = sl.appended(state)
        return self.shared[key]


class LayerAdapter:
    """mlx-lm's cache protocol over one layer's state, for the length of one forward call."""

    def __init__(self, state: kv.State, n_heads: int, call: Call, scale=None, scores=None,
                 queries=None):  # fmt: skip
        self.state, self.n_heads, self.call, self.scale = state, n_heads, call, scale
        self.scores, self.query_slice = scores, queries
        self.queries = self.queries_in = None  # after and before RoPE

    @property
    def offset(self):
        return self.state.offset

    def make_mask(self, n, return_array=False, window_size=None):
        self.call.return_array |= return_array
        return None  # each wrapped attention module builds its own layer's mask

    def attention_mask(self, n: int):
        r = self.state.static_rows
        if r is not None:  # a plain cache: the fetched keys are exactly rows + n
            w = self.state.sliding_window
            if w is None and not self.call.return_array:
                return "causal" if n > 1 else None
            return create_causal_mask(n, offset=r, window_size=w)
        if self.call.in_lockstep(self.state):
            return self.call.derived(self.state, n)[1]
        if self.state.packed and self.state.sliding_window is None:
            return kv.packed_mask(self.state, n)
        m = kv.mask(self.state.replace(offset=self.state.offset + n), n)
        rep = self.n_heads // m.shape[1]
        return mx.repeat(m, rep, axis=1) if rep > 1 else m

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        s = self.state
        if (
            sinks is None
            and queries.shape[2] == 1
            and s.static_rows is None
            and s.packed
            and s.sliding_window is None
            and kernels.fused(queries, keys, values)
        ):  # one query over a packed state: the fused kernel reads slots [0, rows), no mask
            return kernels.ragged_decode_attention(queries, keys, values, s.rows, scale=scale)
        return kernels.attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)

    def update_and_fetch(self, keys, values):
        before, r = self.state.offset, self.state.static_rows
        if r is None and self.call.in_lockstep(self.state):
            new_rows = self.call.derived(self.state, keys.shape[2])[0]
            bound = kv.grown_bound(self.state, keys.shape[2])  # the host's bound, as append's
            self.state = kv.append_at(self.state, keys, values, **new_rows, max_rows=bound)
        else:
            self.state = kv.append(self.state, keys, values)  # the model made them for it
        if self.query_slice is not None:
            if self.queries is None:
                raise RuntimeError("kvfn could not read this layer's queries (no rope call seen)")
            qs = self.query_slice
            if qs.statistic == "moments":
                self.scores = add_query_moments(
                    self.scores, self.queries_in[:, :, qs.start : qs.stop]
                )
                return self._fetch(r, keys.shape[2])
            q = self.queries[:, :, qs.start : qs.stop]
            if qs.statistic == "queries":
                self.scores = q
                return self._fetch(r, keys.shape[2])
            qpos = before[:, None] + mx.arange(qs.start, qs.stop, dtype=mx.int32)[None]
            if qs.statistic == "reconstruction":
                self.scores = reconstruction_attention(q, self.state.keys, *qs.rows, self.scale)
            elif qs.statistic == "max_attention":
                top = window_attention_max(q, qpos, self.state, self.scale)
                self.scores = mx.maximum(self.scores, top)
            else:
                rows = window_attention_scores(q, qpos, self.state, self.scale,
                                               reduce=self.scores.ndim == 3)  # fmt: skip
                self.scores = self.scores + rows
            # this layer's attention waits for its scores, so the scoring's (heads x window x
            # capacity) arrays are freed before the next layer's exist
            return mx.depends(list(self._fetch(r, keys.shape[2])), [self.scores])
        return self._fetch(r, keys.shape[2])

    def _fetch(self, r, n: int) -> tuple:
        if r is not None:
            return self.state.keys[:, :, : r + n], self.state.values[:, :, : r + n]
        return self.state.keys, self.state.values


class PartitionedAdapter:
    """mlx-lm's cache protocol over one ``HeadPartitionedKVCache`` layer: the update goes to
    each head part, and attention (through the model's own attention code, which calls
    ``_attend``) runs per part over the part's own rows."""

    def __init__(self, state, n_heads: int, call: Call, scale=None, scores=None, queries=None):
        self.state, self.before, self.rows, self.call = state, None, None, call
        self.query_slice, self.queries, self.queries_in = None, None, None

    @property
    def offset(self):
        return self.state.offset

    def make_mask(self, n, return_array=False, window_size=None):
        return None

    def attention_mask(self, n: int):
        return None

    def update_and_fetch(self, keys, values):
        self.rows = part.split_rows(self.state, keys, values)  # split once, for both
        new = part.update_split(self.state, *self.rows, derived=self.call.part_derived)
        self.before, self.state = self.state, new
        return keys, values  # the new rows only: ``attend`` reads the parts

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        if sinks is not None:
            raise TypeError("kvfn's head-partitioned states do not support attention sinks")
        return part.attend(self.before, self.state, queries, *self.rows, scale)


class SlotsAdapter(PartitionedAdapter):
    """mlx-lm's cache protocol over one ``HeadSlotsKVCache`` layer: one row is written at each
    head's slot with one scatter per array and attended in one kernel (CUDA); a chunk goes
    through the two-part state."""

    def update_and_fetch(self, keys, values):
        if keys.shape[2] != 1:
            before = sl.to_partitioned(self.state)
            self.rows = part.split_rows(before, keys, values)
            after = part.update_split(before, *self.rows)
            self.before, self.state = (before, after), sl.from_partitioned(after)
            return keys, values
        shared = self.call.slots_derived(self.state)
        if shared is None:
            self.state = sl.update(self.state, keys, values)
        else:
            self.state = sl.write_at(self.state, keys, values, **shared)
        self.before = None
        return keys, values

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        if sinks is not None:
            raise TypeError("kvfn's head-slots states do not support attention sinks")
        if self.before is None:
            return sl.attend(self.state, queries, scale)
        return part.attend(*self.before, queries, *self.rows, scale)


class RaggedAdapter(PartitionedAdapter):
    """mlx-lm's cache protocol over one ``RaggedKVCache`` layer: each KV head's new rows are
    written at the end of its range (one scatter per array) and attended over its own rows (the
    ragged kernel on CUDA for one token)."""

    def update_and_fetch(self, keys, values):
        self.state = rgd.append(self.state, keys, values)
        return keys, values

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        if sinks is not None:
            raise TypeError("kvfn's ragged states do not support attention sinks")
        return rgd.attend(self.state, queries, scale)


ADAPTERS = {
    kv.Layout: LayerAdapter,
    part.Layout: PartitionedAdapter,
    sl.Layout: SlotsAdapter,
    rgd.Layout: RaggedAdapter,
}  # a new kind's own adapter is added here, by its layout


def adapter_of(state):
    """The adapter class of ``state``'s kind."""
    return ADAPTERS[layout.of(state)]

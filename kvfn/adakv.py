"""Ada-KV (arXiv:2407.11550): a layer's budget shared out among its KV heads by score.

SnapKV gives every head the same number of rows. Ada-KV ranks all (head, row) pairs of a layer
together and keeps the best ``budget x n_kv_heads``, so a head whose attention is spread over
many rows keeps more of them and a focused head fewer; each head first keeps its own best
``floor`` percent of an even share (the paper's safeguard). Heads keep different numbers of
rows, stored for real (``HeadPartitionedKVCache``: heads keeping as many rows share a group),
not as a mask over the union.
"""

import math
from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import numpy as np

from . import cache as kv
from . import partitioned as part
from .policy import register_policy
from .snapkv import SnapKV


@register_policy
@dataclass(frozen=True)
class AdaKV(SnapKV):
    """SnapKV's scores, allocated across a layer's heads: ``adakv``, ``adakv-f20`` (floor)."""

    floor: int = 20

    name: ClassVar[str] = "adakv"
    numbers: ClassVar[dict] = {**SnapKV.numbers, "f": "floor"}
    # the allocation decides the groups' shapes: compaction reads it on the host
    traceable: ClassVar[bool] = False

    def validate(self) -> None:
        super().validate()
        if not self.per_head:
            raise ValueError("adakv allocates rows among heads: per_head must be True")
        if self.floor > 100:
            raise ValueError(f"adakv floor is a percent of a head's share, <= 100; got {self.floor}")

    def allocation(self, scores: mx.array, *, prompt_length: int, n_kv_heads: int,
                   layer: int = 0) -> list[np.ndarray]:  # fmt: skip
        """Per KV head, its sorted kept rows of a prompt of one sequence (scores (1, n_heads,
        P)); together ``budget x n_kv_heads`` rows."""
        P, H = prompt_length, n_kv_heads
        s = self.row_scores(scores, prompt_length=P, n_kv_heads=H, batch=1, layer=layer)
        s = np.array(s.astype(mx.float32))[0]
        s = np.where(np.isnan(s), -np.inf, s)
        pos = np.arange(P)
        forced = (pos < self.sink_tokens) | (pos >= P - self.window)
        guard = min(math.ceil(self.floor / 100 * self.budget),
                    self.budget - self.sink_tokens - self.window)  # fmt: skip
        rank = np.argsort(np.argsort(-np.where(forced, -np.inf, s), axis=-1, kind="stable"),
                          axis=-1)  # fmt: skip
        priority = np.where(forced[None] | (rank < guard), np.inf, s)
        flat = np.argsort(-priority.ravel(), kind="stable")[: self.budget * H]
        heads, rows = np.divmod(flat, P)
        return [np.sort(rows[heads == h]).astype(np.int32) for h in range(H)]

    def head_groups(self, layer: int, n_kv_heads: int) -> tuple:
        return tuple((h,) for h in range(n_kv_heads))  # which heads share a row count varies

    def compact_layer(self, state, scores, *, prompt_length: int, layer: int, reserve: int,
                      group=None):  # fmt: skip
        if group is not None and group.size() > 1:
            raise ValueError("adakv allocates across all of a layer's heads: a tensor-parallel "
                             "model is not supported yet")  # fmt: skip
        P = prompt_length
        B, H = state.keys.shape[:2]
        if self.keeps_whole(P):
            return super().compact_layer(state, scores, prompt_length=P, layer=layer,
                                         reserve=reserve)  # fmt: skip
        if B != 1:
            raise ValueError(f"adakv allocates rows per sequence: compact one prompt at a time, "
                             f"got batch {B}")  # fmt: skip
        keep = self.allocation(scores, prompt_length=P, n_kv_heads=H, layer=layer)
        counts = {len(k) for k in keep}
        if len(counts) == 1:  # an even allocation: a plain state
            state = kv.gather(state, mx.array(np.stack(keep))[None], packed=state.packed)
            return kv.reserve(state, max(state.capacity, state.max_rows + reserve))
        p = part.from_keep_sets(state.replace(max_rows=P), [mx.array(k) for k in keep])
        groups = tuple(kv.reserve(g, max(g.capacity, g.max_rows + reserve)) for g in p.groups)
        return p.replace(groups=groups)

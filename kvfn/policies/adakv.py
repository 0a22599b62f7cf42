"""Ada-KV (arXiv:2407.11550): a layer's budget shared out among its KV heads by score.

SnapKV gives every head the same number of rows. Ada-KV ranks all (head, row) pairs of a layer
together and keeps the best ``budget x n_kv_heads``, so a head whose attention is spread over
many rows keeps more of them and a focused head fewer; each head first keeps its own best
``floor`` percent of an even share (the paper's safeguard). Heads keep different numbers of
rows, stored for real in one buffer (``kvfn.ragged.RaggedKVCache``: each head its own range of
slots), not as a mask over the union. The allocation is traced: a layer's total is static, the
per-head counts are arrays, so a batch of prompts compacts in one compiled call.
"""

import math
from dataclasses import dataclass
from typing import ClassVar, Optional

import mlx.core as mx
import numpy as np

from ..states import ragged
from .policy import register_policy
from .snapkv import SnapKV


def top_mask(priority: mx.array, k: int) -> mx.array:
    """A boolean mask of the ``k`` largest entries along the last axis (ties: any of them)."""
    n = priority.shape[-1]
    if k >= n:
        return mx.ones(priority.shape, mx.bool_)
    top = mx.argpartition(-priority, kth=k - 1, axis=-1)[..., :k]
    return mx.put_along_axis(mx.zeros(priority.shape, mx.bool_), top, mx.array(True), axis=-1)


@register_policy
@dataclass(frozen=True)
class AdaKV(SnapKV):
    """SnapKV's scores, allocated across a layer's heads: ``adakv``, ``adakv-f20`` (floor)."""

    floor: int = 20
    # the rows each sequence keeps in this layer, where a plan across layers set them
    # (``AdaKVzip.for_layer``); empty: ``budget x n_kv_heads`` every sequence
    totals: tuple = ()

    name: ClassVar[str] = "adakv"
    # SnapKV's option words but "layer": the allocation is among a layer's heads
    words: ClassVar[dict] = {k: v for k, v in SnapKV.words.items() if k != "layer"}
    numbers: ClassVar[dict] = {**SnapKV.numbers, "f": "floor"}
    ragged: ClassVar[bool] = True
    cannot_recompact: ClassVar[str] = (
        "it keeps each head's rows ragged, and a compaction takes plain layers"
    )

    def validate(self) -> None:
        super().validate()
        if not self.per_head:
            raise ValueError("adakv allocates rows among heads: per_head must be True")
        if self.floor > 100:
            raise ValueError(
                f"adakv floor is a percent of a head's share, <= 100; got {self.floor}"
            )
        if not isinstance(self.totals, tuple) or any(
            type(r) is not int or r < 0 for r in self.totals
        ):
            raise ValueError(
                f"{self.name} totals must be a tuple of ints >= 0, got {self.totals!r}"
            )

    @property
    def guard(self) -> int:
        """Rows each head keeps of its own best before the layer's pairs are ranked (the floor),
        besides sinks and window."""
        return min(math.ceil(self.floor / 100 * self.budget),
                   self.budget - self.sink_tokens - self.window)  # fmt: skip

    def _priority(self, scores, *, prompt_length: int, n_kv_heads: int, batch: int,
                  layer: int) -> mx.array:  # fmt: skip
        """(B, H, P) float32: a pair's rank among the layer's, +inf for what every head keeps
        (sinks, window, its best ``guard`` rows), -inf for NaN."""
        P, H = prompt_length, n_kv_heads
        s = self.row_scores(scores, prompt_length=P, n_kv_heads=H, batch=batch, layer=layer)
        s = mx.broadcast_to(s.astype(mx.float32), (batch, H, P))
        s = mx.where(mx.isnan(s), -mx.inf, s)
        pos = mx.arange(P)
        forced = (pos < self.sink_tokens) | (pos >= P - self.window)
        if self.guard > 0:
            forced = forced | top_mask(mx.where(forced, -mx.inf, s), self.guard)
        return mx.where(forced, mx.inf, s)

    def check_states(self, n_kv_heads: tuple, *, batch: int, prompt_length: int) -> None:
        for i, h in enumerate(n_kv_heads):
            if h is not None:
                self.for_layer(i, len(n_kv_heads)).check_totals(h, batch, prompt_length)

    def check_totals(self, n_kv_heads: int, batch: int, prompt_length: int) -> None:
        """Raise a ValueError unless ``totals`` (if set) holds a count for each of ``batch``
        sequences, each at least the rows every head must keep and at most ``min(budget,
        prompt_length)`` a head (a larger count would run past the ragged buffer)."""
        if not self.totals:
            return
        H, P = n_kv_heads, prompt_length
        if len(self.totals) != batch:
            raise ValueError(f"{self.name} totals has {len(self.totals)} counts (one a "
                             f"sequence); the batch has {batch} sequences")  # fmt: skip
        forced = min(P, self.sink_tokens + self.window + self.guard)
        least, most = H * forced, H * min(P, self.budget)
        bad = [t for t in self.totals if not least <= t <= most]
        if bad:
            raise ValueError(
                f"{self.name} totals {bad} out of range for {H} KV heads and a {P}-row prompt: "
                f"at least {least} (the {forced} sinks, window and floor rows each head keeps), "
                f"at most {most} ({min(P, self.budget)} rows a head: the budget, or the prompt)"
            )

    def keep_mask(self, scores, *, prompt_length: int, n_kv_heads: int, batch: int = 1,
                  layer: int = 0, totals: Optional[tuple] = None) -> mx.array:  # fmt: skip
        """(B, n_kv_heads, P) bool: the rows each head keeps, ``budget x n_kv_heads`` a
        sequence in all, or ``totals[b]`` for sequence b (a plan across layers). Traceable."""
        P, H = prompt_length, n_kv_heads
        if totals is None and self.keeps_whole(P):
            return mx.ones((batch, H, P), mx.bool_)
        s = self._priority(scores, prompt_length=P, n_kv_heads=H, batch=batch, layer=layer)
        flat = s.reshape(batch, H * P)
        if totals is None:
            return top_mask(flat, self.budget * H).reshape(batch, H, P)
        rank = mx.argsort(mx.argsort(-flat, axis=-1), axis=-1)
        return (rank < mx.array(totals, mx.int32)[:, None]).reshape(batch, H, P)

    def allocation(self, scores: mx.array, *, prompt_length: int, n_kv_heads: int,
                   layer: int = 0) -> list[np.ndarray]:  # fmt: skip
        """Per KV head, its sorted kept rows of a prompt of one sequence (scores (1, n_heads,
        P)); together ``budget x n_kv_heads`` rows."""
        keep = np.array(self.keep_mask(scores, prompt_length=prompt_length, n_kv_heads=n_kv_heads,
                                       layer=layer))[0]  # fmt: skip
        return [np.flatnonzero(k).astype(np.int32) for k in keep]

    def compact_layer(self, state, scores, *, prompt_length: int, layer: int, reserve: int,
                      group=None):  # fmt: skip
        if group is not None and group.size() > 1:
            raise ValueError("adakv allocates across all of a layer's heads: a tensor-parallel "
                             "model is not supported yet")  # fmt: skip
        P = prompt_length
        B, H = state.keys.shape[:2]
        totals = self.totals or None  # with them each sequence keeps its own count, ragged,
        if totals is None and self.keeps_whole(P):  # even where the budget reaches the prompt
            return super().compact_layer(state, scores, prompt_length=P, layer=layer,
                                         reserve=reserve)  # fmt: skip
        keep = self.keep_mask(scores, prompt_length=P, n_kv_heads=H, batch=B, layer=layer,
                              totals=totals)  # fmt: skip
        total = self.budget * H
        return ragged.pack(state, keep, capacity=total, room=reserve,
                           kept=total if totals is None else None)  # fmt: skip

"""SnapKV (arXiv:2404.14469): which prompt rows to keep, from observation-window attention.

Keep attention sinks + the recent (observation) window + the middle rows that the window's
queries attend to most, after 1-D pooling of the scores; the budget counts all of them.
Everything here is pure and traceable for a static budget and prompt length.
"""

from dataclasses import dataclass
from typing import Literal

import chex
import mlx.core as mx
from typeguard import typechecked

from .cache import State


@dataclass(frozen=True)
class SnapKVConfig:
    """SnapKV's knobs. ``validate`` raises a ValueError naming any bad value."""

    budget: int
    window: int = 32
    sink_tokens: int = 4
    min_tokens: int = 0
    kernel_size: int = 7
    pooling: Literal["max", "avg"] = "max"
    per_head: bool = True
    group_reduce: Literal["mean", "max"] = "mean"

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        for name in ("budget", "window", "sink_tokens", "min_tokens", "kernel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"SnapKV {name} must be a non-negative int, got {value!r}")
        if self.window < 1:
            raise ValueError(
                f"SnapKV window must be >= 1 (the observation window), got {self.window}"
            )
        if self.budget < self.sink_tokens + self.window:
            raise ValueError(
                f"SnapKV budget {self.budget} is below sink_tokens + window = "
                f"{self.sink_tokens} + {self.window}"
            )
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"SnapKV kernel_size must be odd and >= 1, got {self.kernel_size}")
        if self.pooling not in ("max", "avg"):
            raise ValueError(f"SnapKV pooling must be 'max' or 'avg', got {self.pooling!r}")
        if self.group_reduce not in ("mean", "max"):
            raise ValueError(
                f"SnapKV group_reduce must be 'mean' or 'max', got {self.group_reduce!r}"
            )

    def keeps_whole(self, prompt_length: int) -> bool:
        return prompt_length <= max(self.min_tokens, self.budget)


def pool1d(x: mx.array, kernel_size: int, kind: str) -> mx.array:
    """Stride-1 'same' pooling over the last axis (max: pads with -inf; avg: zero-padded / k)."""
    if kernel_size == 1:
        return x
    half = kernel_size // 2
    fill = -mx.inf if kind == "max" else 0.0
    pad = mx.full((*x.shape[:-1], half), fill, x.dtype)
    padded = mx.concatenate([pad, x, pad], axis=-1)
    n = x.shape[-1]
    windows = mx.stack([padded[..., i : i + n] for i in range(kernel_size)], axis=0)
    return mx.max(windows, axis=0) if kind == "max" else mx.sum(windows, axis=0) / kernel_size


@typechecked
def window_attention_scores(
    queries: mx.array, query_positions: mx.array, state: State, scale: float
) -> mx.array:
    """Summed softmax attention of ``queries`` (B, n_heads, w, D; after RoPE) over every slot of
    ``state``: (B, n_heads, capacity), float32. Causal over true positions; O(w x capacity)."""
    chex.assert_rank([queries, query_positions], [4, 2])
    B, n_heads, w, D = queries.shape
    n_kv = state.keys.shape[1]
    if n_heads % n_kv:
        raise ValueError(f"{n_heads} query heads do not group over {n_kv} KV heads")
    q = queries.astype(mx.float32).reshape(B, n_kv, n_heads // n_kv, w, D)
    k = state.keys.astype(mx.float32)[:, :, None]  # (B, n_kv, 1, C, D)
    logits = (q * scale) @ k.swapaxes(-1, -2)  # (B, n_kv, rep, w, C)
    visible = state.positions[:, :, None, None, :] <= query_positions[:, None, None, :, None]
    logits = mx.where(visible, logits, -mx.inf)
    weights = mx.softmax(logits, axis=-1, precise=True)
    return mx.sum(weights, axis=-2).reshape(B, n_heads, -1)


@typechecked
def snapkv_keep_indices(
    scores: mx.array,
    budget: int,
    *,
    n_kv_heads: int,
    window: int = 32,
    sink_tokens: int = 4,
    min_tokens: int = 0,
    kernel_size: int = 7,
    pooling: str = "max",
    per_head: bool = True,
    group_reduce: str = "mean",
) -> mx.array:
    """Rows to keep of a prompt of length P, from window scores (B, n_heads, P).

    Returns sorted slot indices (B, n_kv_heads, min(P, budget)). Sinks are rows [0, sink_tokens),
    the window is the last ``window`` rows, and the rest of the budget goes to the middle rows
    with the highest pooled score. GQA: a KV head's score reduces its query heads' scores
    (``group_reduce``). ``per_head=False`` keeps one set of rows for every head of the layer.
    """
    cfg = SnapKVConfig(budget, window, sink_tokens, min_tokens, kernel_size, pooling, per_head,
                       group_reduce)  # fmt: skip
    return keep_indices(scores, cfg, n_kv_heads)


def keep_indices(scores: mx.array, cfg: SnapKVConfig, n_kv_heads: int) -> mx.array:
    """``snapkv_keep_indices`` with its knobs in a validated ``SnapKVConfig``."""
    budget, window, sink_tokens = cfg.budget, cfg.window, cfg.sink_tokens
    chex.assert_rank(scores, 3)
    B, n_heads, P = scores.shape
    if n_heads % n_kv_heads:
        raise ValueError(f"{n_heads} query heads do not group over n_kv_heads={n_kv_heads}")
    if cfg.keeps_whole(P):
        return mx.broadcast_to(mx.arange(P, dtype=mx.int32), (B, n_kv_heads, P))
    grouped = scores.astype(mx.float32).reshape(B, n_kv_heads, n_heads // n_kv_heads, P)
    s = mx.mean(grouped, axis=2) if cfg.group_reduce == "mean" else mx.max(grouped, axis=2)
    if not cfg.per_head:
        s = mx.mean(s, axis=1, keepdims=True)
    s = pool1d(s, cfg.kernel_size, cfg.pooling)
    middle = mx.arange(P)
    s = mx.where((middle >= sink_tokens) & (middle < P - window), s, -mx.inf)
    n_middle = budget - sink_tokens - window
    fixed = mx.concatenate([mx.arange(sink_tokens), mx.arange(P - window, P)]).astype(mx.int32)
    fixed = mx.broadcast_to(fixed, (*s.shape[:2], sink_tokens + window))
    if n_middle > 0:
        top = mx.argpartition(-s, kth=n_middle - 1, axis=-1)[..., :n_middle].astype(mx.int32)
        fixed = mx.concatenate([fixed, top], axis=-1)
    keep = mx.sort(fixed, axis=-1)
    return mx.broadcast_to(keep, (B, n_kv_heads, budget))

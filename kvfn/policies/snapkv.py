"""SnapKV (arXiv:2404.14469): keep the middle rows the observation window attends to most.

The window's per-key attention is summed inside the prefill (``kvfn.scored_prefill``); here it
is reduced over a KV head's query heads, optionally over the layer's heads, and 1-D pooled so
neighbours of a hit are kept with it.
"""

from dataclasses import dataclass
from typing import ClassVar, Literal

import mlx.core as mx

from .policy import Policy, register_policy

MAX_KERNEL = 255  # pooling stacks a shifted copy of the scores per tap: a request may set it


def check_kernel(name: str, kernel_size) -> None:
    if type(kernel_size) is not int or not 1 <= kernel_size <= MAX_KERNEL or kernel_size % 2 == 0:
        raise ValueError(f"{name} kernel_size must be odd, 1 to {MAX_KERNEL}, got {kernel_size!r}")


def pool1d(x: mx.array, kernel_size: int, kind: str) -> mx.array:
    """Stride-1 'same' pooling over the last axis (max: pads with -inf; avg: zero-padded / k)."""
    if kernel_size == 1:
        return x
    half = kernel_size // 2
    fill = -mx.inf if kind == "max" else 0.0
    pad = mx.full((*x.shape[:-1], half), fill, x.dtype)
    padded = mx.concatenate([pad, x, pad], axis=-1)
    n = x.shape[-1]
    shifted = mx.stack([padded[..., i : i + n] for i in range(kernel_size)], axis=0)
    return mx.max(shifted, axis=0) if kind == "max" else mx.sum(shifted, axis=0) / kernel_size


@register_policy
@dataclass(frozen=True)
class SnapKV(Policy):
    """SnapKV's knobs: pooling kernel and kind, one row set per KV head (``per_head``) or per
    layer, and how a KV head reduces its query heads' scores (``group_reduce``)."""

    kernel_size: int = 7
    pooling: Literal["max", "avg"] = "max"
    per_head: bool = True
    group_reduce: Literal["mean", "max"] = "mean"

    name: ClassVar[str] = "snapkv"
    same_in_every_layer: ClassVar[bool] = True
    cannot_recompact: ClassVar[str] = ""
    needs_scores: ClassVar[bool] = True
    words: ClassVar[dict] = {
        "avg": {"pooling": "avg"},
        "max": {"pooling": "max"},
        "layer": {"per_head": False},
        "gmax": {"group_reduce": "max"},
    }
    numbers: ClassVar[dict] = {"k": "kernel_size"}

    @property
    def head_local(self) -> bool:
        return self.per_head

    def validate(self) -> None:
        super().validate()
        if self.window < 1:
            raise ValueError(
                f"snapkv window must be >= 1 (the observation window), got {self.window}"
            )
        check_kernel(self.name, self.kernel_size)
        if self.pooling not in ("max", "avg"):
            raise ValueError(f"snapkv pooling must be 'max' or 'avg', got {self.pooling!r}")
        if self.group_reduce not in ("mean", "max"):
            raise ValueError(
                f"snapkv group_reduce must be 'mean' or 'max', got {self.group_reduce!r}"
            )
        if not isinstance(self.per_head, bool):
            raise ValueError(f"snapkv per_head must be a bool, got {self.per_head!r}")

    def row_scores(self, scores, *, prompt_length, n_kv_heads, batch, layer):
        B, n_heads, P = scores.shape
        grouped = scores.astype(mx.float32).reshape(B, n_kv_heads, n_heads // n_kv_heads, P)
        s = mx.mean(grouped, axis=2) if self.group_reduce == "mean" else mx.max(grouped, axis=2)
        if not self.per_head:
            s = mx.mean(s, axis=1, keepdims=True)
        # pool the rows before the window only (as SnapKV does): the window, always kept, would
        # lend its own rows' attention to the rows just before it
        split = prompt_length - self.observation_window(prompt_length)
        head = pool1d(s[..., :split], self.kernel_size, self.pooling)
        return mx.concatenate([head, s[..., split:]], axis=-1)


def snapkv_keep_indices(
    scores: mx.array, budget: int, *, n_kv_heads: int, layer: int = 0, **settings
) -> mx.array:
    """Rows to keep of a prompt of P rows, from window scores (B, n_heads, P): sorted slot
    indices (B, n_kv_heads, min(P, budget)). ``SnapKV(budget, **settings).keep_indices`` as
    one call (settings: window, sink_tokens, min_tokens, kernel_size, pooling, per_head,
    group_reduce)."""
    B, _, P = scores.shape
    policy = SnapKV(budget=budget, **settings)
    return policy.keep_indices(scores, prompt_length=P, n_kv_heads=n_kv_heads, batch=B, layer=layer)

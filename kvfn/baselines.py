"""Score-free baselines under the policy contract: StreamingLLM and random middle rows."""

from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx

from .policy import Policy, register_policy


@register_policy
@dataclass(frozen=True)
class StreamingLLM(Policy):
    """StreamingLLM (arXiv:2309.17453): the sinks and the most recent rows, as mlx-lm's
    ``RotatingKVCache(keep=sink_tokens)`` keeps them; needs no scores (its ``window`` changes
    nothing: the most recent rows are kept anyway)."""

    window: int = 0

    name: ClassVar[str] = "streaming"

    def row_scores(self, scores, *, prompt_length, n_kv_heads, batch, layer):
        return mx.broadcast_to(
            mx.arange(prompt_length, dtype=mx.float32), (batch, 1, prompt_length)
        )


@register_policy
@dataclass(frozen=True)
class RandomRows(Policy):
    """SnapKV's sinks and window, the rest of the budget drawn uniformly from the middle rows,
    each (layer, head) its own draw from ``seed``: the control that tells how much a policy's
    scores add over its fixed rows."""

    seed: int = 0

    name: ClassVar[str] = "random"

    def row_scores(self, scores, *, prompt_length, n_kv_heads, batch, layer):
        key = mx.random.split(mx.random.key(self.seed), layer + 1)[layer]
        return mx.random.uniform(shape=(batch, n_kv_heads, prompt_length), key=key)

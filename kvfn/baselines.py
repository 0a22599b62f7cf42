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


@register_policy
@dataclass(frozen=True)
class ChunkKV(Policy):
    """ChunkKV (arXiv:2502.00299): whole chunks of ``chunk_size`` rows ranked by the window
    attention they receive in sum, one row set for every head of a layer, so a kept passage is
    kept whole (a number's every digit, a name's every piece)."""

    chunk_size: int = 20

    name: ClassVar[str] = "chunkkv"
    needs_scores: ClassVar[bool] = True
    numbers: ClassVar[dict] = {"c": "chunk_size"}

    def validate(self) -> None:
        super().validate()
        if self.window < 1 or self.chunk_size < 1:
            raise ValueError(
                f"chunkkv window and chunk_size must be >= 1, got {self.window}, {self.chunk_size}"
            )

    def row_scores(self, scores, *, prompt_length, n_kv_heads, batch, layer):
        P, c = prompt_length, self.chunk_size
        s = mx.mean(scores.astype(mx.float32), axis=1)  # (batch, P): the layer's heads
        pad = -P % c
        s = mx.concatenate([s, mx.zeros((batch, pad))], axis=1) if pad else s
        chunk = mx.sum(s.reshape(batch, -1, c), axis=-1, keepdims=True)
        # earlier rows of a chunk first, so a chunk the budget cuts keeps its start
        order = -mx.arange(c, dtype=mx.float32) * 1e-6 * (mx.abs(chunk) + 1e-30)
        return mx.broadcast_to(chunk + order, (batch, P // c + (pad > 0), c)).reshape(batch, 1, -1)[
            ..., :P
        ]

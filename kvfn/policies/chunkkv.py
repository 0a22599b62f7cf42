"""ChunkKV (arXiv:2502.00299): whole chunks of rows ranked by the window's attention."""

from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx

from .policy import Policy, register_policy


@register_policy
@dataclass(frozen=True)
class ChunkKV(Policy):
    """ChunkKV (arXiv:2502.00299): whole chunks of ``chunk_size`` rows ranked by the window
    attention they receive in sum, one row set for every head of a layer, so a kept passage is
    kept whole (a number's every digit, a name's every piece)."""

    chunk_size: int = 20

    name: ClassVar[str] = "chunkkv"
    same_in_every_layer: ClassVar[bool] = True
    cannot_recompact: ClassVar[str] = ""
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

"""StreamingLLM (arXiv:2309.17453) under the policy contract: sinks and the most recent rows."""

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
    same_in_every_layer: ClassVar[bool] = True
    query_agnostic: ClassVar[bool] = True
    cannot_recompact: ClassVar[str] = ""

    def row_scores(self, scores, *, prompt_length, n_kv_heads, batch, layer):
        return mx.broadcast_to(
            mx.arange(prompt_length, dtype=mx.float32), (batch, 1, prompt_length)
        )

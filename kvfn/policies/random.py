"""Random middle rows under the policy contract: the control that needs no scores."""

from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx

from .policy import Policy, register_policy


@register_policy
@dataclass(frozen=True)
class RandomRows(Policy):
    """SnapKV's sinks and window, the rest of the budget drawn uniformly from the middle rows,
    each (layer, head) its own draw from ``seed``: the control that tells how much a policy's
    scores add over its fixed rows."""

    seed: int = 0

    name: ClassVar[str] = "random"
    query_agnostic: ClassVar[bool] = True
    cannot_recompact: ClassVar[str] = ""

    def validate(self) -> None:
        super().validate()
        if self.seed >= 2**64:  # what mx.random.key takes
            raise ValueError(f"random seed must be below 2**64, got {self.seed}")

    def row_scores(self, scores, *, prompt_length, n_kv_heads, batch, layer):
        key = mx.random.split(mx.random.key(self.seed), layer + 1)[layer]
        return mx.random.uniform(shape=(batch, n_kv_heads, prompt_length), key=key)

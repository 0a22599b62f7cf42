"""PyramidKV (arXiv:2406.02069): SnapKV's rows with per-layer budgets falling with depth."""

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from .policy import register_policy
from .snapkv import SnapKV


@register_policy
@dataclass(frozen=True)
class PyramidKV(SnapKV):
    """PyramidKV (arXiv:2406.02069): SnapKV's selection with budgets falling linearly with
    depth, averaging ``budget`` (exactly, so memory equals SnapKV's at the same budget): the top
    layer keeps (budget - window) / ``beta`` + window rows, the first about twice the average.
    ``pyramidkv-b10`` sets beta."""

    beta: int = 20

    name: ClassVar[str] = "pyramidkv"
    numbers: ClassVar[dict] = {**SnapKV.numbers, "b": "beta"}
    cannot_recompact: ClassVar[str] = (
        "its layers keep different budgets, and a compaction step takes layers of one row count"
    )

    def validate(self) -> None:
        super().validate()
        if self.beta < 1:
            raise ValueError(f"pyramidkv beta must be >= 1, got {self.beta}")

    def layer_budgets(self, n_layers: int) -> list[int]:
        """Rows each of ``n_layers`` layers keeps (sinks and window included)."""
        spare = self.budget - self.window
        low = spare // self.beta
        high = 2 * spare - low
        # linear from high to low, summing to exactly n_layers x spare (equal memory)
        ramp = [high - (high - low) * i / max(n_layers - 1, 1) for i in range(n_layers)]
        rows = [int(r) for r in ramp]
        for i in range(n_layers * spare - sum(rows)):
            rows[i] += 1
        floor = self.sink_tokens + self.window
        return [max(floor, r + self.window) for r in rows]

    def keeps_whole(self, prompt_length: int) -> bool:
        smallest = max(self.sink_tokens + self.window, (self.budget - self.window) // self.beta
                       + self.window)  # fmt: skip
        return prompt_length <= max(self.min_tokens, smallest)

    def for_layer(self, layer: int, n_layers: int) -> SnapKV:
        budget = self.layer_budgets(n_layers)[layer]
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(SnapKV)}
        return SnapKV(**{**fields, "budget": budget})

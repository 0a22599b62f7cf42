"""PyramidKV (arXiv:2406.02069): SnapKV's rows with per-layer budgets falling with depth."""

from typing import ClassVar, Optional

from .allocation import Pyramid, shorthand_scorer
from .policy import Policy, register_policy
from .snapkv import SnapKV


@register_policy
class PyramidKV(Pyramid):
    """PyramidKV: SnapKV's selection under ``Pyramid``'s budgets falling with depth,
    ``Pyramid(SnapKV(...), beta)`` from SnapKV's settings. ``pyramidkv-b10`` sets beta."""

    name: ClassVar[str] = "pyramidkv"
    default_scorer: ClassVar[type] = SnapKV
    words: ClassVar[dict] = SnapKV.words
    numbers: ClassVar[dict] = {**SnapKV.numbers, "b": "beta"}

    def __init__(self, budget: Optional[int] = None, *, scorer: Optional[Policy] = None,
                 beta: int = 20, **settings):  # fmt: skip
        super().__init__(shorthand_scorer(type(self), budget, scorer, settings), beta)

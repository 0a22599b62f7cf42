"""Ada-KV (arXiv:2407.11550): a layer's budget shared out among its KV heads by score.

SnapKV gives every head the same number of rows. Ada-KV ranks all (head, row) pairs of a layer
together and keeps the best ``budget x n_kv_heads``, so a head whose attention is spread over
many rows keeps more of them and a focused head fewer; each head first keeps its own best
``floor`` percent of an even share (the paper's safeguard). The allocation is
``kvfn.policies.allocation.AcrossHeads``, which takes any scorer; ``AdaKV`` is it over SnapKV.
"""

from typing import ClassVar, Optional

from .allocation import AcrossHeads, shorthand_scorer
from .policy import Policy, register_policy
from .snapkv import SnapKV


@register_policy
class AdaKV(AcrossHeads):
    """SnapKV's scores, allocated across a layer's heads: ``AcrossHeads(SnapKV(...), floor)``
    from SnapKV's settings, ``adakv``, ``adakv-f20`` (floor)."""

    name: ClassVar[str] = "adakv"
    default_scorer: ClassVar[type] = SnapKV
    # SnapKV's option words but "layer": the allocation is among a layer's heads
    words: ClassVar[dict] = {k: v for k, v in SnapKV.words.items() if k != "layer"}
    numbers: ClassVar[dict] = {**SnapKV.numbers, "f": "floor"}

    def __init__(self, budget: Optional[int] = None, *, scorer: Optional[Policy] = None,
                 floor: int = 20, across_layers: bool = False, **settings):  # fmt: skip
        super().__init__(shorthand_scorer(type(self), budget, scorer, settings), floor,
                         across_layers)  # fmt: skip

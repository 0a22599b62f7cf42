"""AdaKVzip: KVzip's reconstruction scores under Ada-KV's allocation, within a layer or, as the
KVzip paper ranks them by default, every layer's (KV head, row) pairs together
(``adakvzip-global``: a plan on the host, ragged rows a layer)."""

from typing import ClassVar, Optional

from .allocation import AcrossHeads, shorthand_scorer
from .kvzip import KVzip
from .policy import Policy, register_policy


@register_policy
class AdaKVzip(AcrossHeads):
    """KVzip's scores, a layer's ``budget x kv_heads`` rows allocated across its KV heads by
    score: ``AcrossHeads(KVzip(...), floor)`` from KVzip's settings, the paper's non-uniform
    head budgets within a layer. ``across_layers`` (``adakvzip-global``, floor 0): the paper's
    pair-level selection across layers, as ``AcrossLayers(KVzip(...))``: ``plan`` returns each
    layer's rows a head and the rows each sequence keeps there."""

    name: ClassVar[str] = "adakvzip"
    default_scorer: ClassVar[type] = KVzip
    words: ClassVar[dict] = {"global": {"across_layers": True, "floor": 0}}
    numbers: ClassVar[dict] = {**KVzip.numbers, "f": "floor"}

    def __init__(self, budget: Optional[int] = None, *, scorer: Optional[Policy] = None,
                 floor: int = 20, across_layers: bool = False, **settings):  # fmt: skip
        super().__init__(shorthand_scorer(type(self), budget, scorer, settings), floor,
                         across_layers)  # fmt: skip

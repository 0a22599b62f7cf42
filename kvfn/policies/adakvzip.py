"""AdaKVzip: KVzip's reconstruction scores under Ada-KV's allocation, within a layer or, as the
KVzip paper ranks them by default, every layer's (KV head, row) pairs together
(``adakvzip-global``: a plan on the host, ragged rows a layer)."""

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .adakv import AdaKV
from .kvzip import KVzip
from .policy import register_policy


@register_policy
@dataclass(frozen=True)
class AdaKVzip(KVzip, AdaKV):
    """KVzip's scores, a layer's ``budget x kv_heads`` rows allocated across its KV heads by
    score (Ada-KV's allocation, ``floor`` included): the paper's non-uniform head budgets,
    within a layer; ragged rows (``kvfn.RaggedKVCache``), traced as ``AdaKV``'s.
    ``across_layers`` (``adakvzip-global``): the paper's pair-level selection across layers,
    planned on the host (``planned`` sets ``layer_budgets``, each layer's rows a head, and
    ``layer_totals``, the rows each sequence keeps in each layer)."""

    across_layers: bool = False
    layer_budgets: tuple = ()
    layer_totals: tuple = ()

    name: ClassVar[str] = "adakvzip"
    cannot_recompact: ClassVar[str] = AdaKV.cannot_recompact
    scores_held: ClassVar[bool] = False
    words: ClassVar[dict] = {"global": {"across_layers": True, "floor": 0}}
    numbers: ClassVar[dict] = {**KVzip.numbers, "f": "floor"}

    @property
    def head_local(self) -> bool:
        return False

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.across_layers, bool):
            raise ValueError(f"adakvzip across_layers must be a bool, got {self.across_layers!r}")
        if self.across_layers and self.floor:
            raise ValueError(
                f"adakvzip-global ranks every layer's pairs together, with no floor: floor must "
                f"be 0, got {self.floor}"
            )
        floor = self.sink_tokens + self.window
        if not isinstance(self.layer_budgets, tuple) or any(
            type(b) is not int or b < floor for b in self.layer_budgets
        ):
            raise ValueError(
                f"adakvzip layer_budgets must be a tuple of ints >= {floor}, got "
                f"{self.layer_budgets!r}"
            )
        for rows in self.layer_totals:
            if not isinstance(rows, tuple) or any(type(r) is not int or r < 0 for r in rows):
                raise ValueError(f"adakvzip layer_totals must be tuples of ints >= 0, got {rows!r}")

    def planned(self, scores, *, prompt_length, n_kv_heads) -> "AdaKVzip":
        """``across_layers`` (``adakvzip-global``, the paper's pair level): for each sequence,
        every layer's (KV head, row) pairs ranked together and the best ``budget`` a head kept
        over all layers (sinks and window first); a layer keeps its share of them (as many rows
        a sequence as it has pairs there), stored in ``budget`` rows a head, the most any
        sequence of the batch needs there."""
        P = prompt_length
        if not self.across_layers or self.layer_budgets or self.keeps_whole(P):
            return self
        full = [i for i, h in enumerate(n_kv_heads) if h is not None]
        keep = self.budget * sum(n_kv_heads[i] for i in full)
        B = scores[full[0]].shape[0]
        counts = np.zeros((B, len(n_kv_heads)), np.int64)
        for b in range(B):
            # the priorities the traced allocation ranks (floor 0: sinks and window forced)
            ranked = [np.array(self._priority(scores[i][b : b + 1, :, :P], prompt_length=P,
                                              n_kv_heads=n_kv_heads[i], batch=1, layer=i))
                      for i in full]  # fmt: skip
            flat = np.concatenate([r.ravel() for r in ranked])
            threshold = np.partition(flat, flat.size - keep)[flat.size - keep]
            for i, r in zip(full, ranked):
                counts[b, i] = int((r >= threshold).sum())
        floor = self.sink_tokens + self.window
        budgets = [min(P, max(floor, -(-int(counts[:, i].max()) // h))) if h else floor
                   for i, h in enumerate(n_kv_heads)]  # fmt: skip
        totals = tuple(tuple(int(c) for c in counts[:, i]) for i in range(len(n_kv_heads)))
        return self.replace(layer_budgets=tuple(budgets), layer_totals=totals)

    def check_states(self, n_kv_heads: tuple, *, batch: int, prompt_length: int) -> None:
        for name in ("layer_budgets", "layer_totals"):
            given = getattr(self, name)
            if given and len(given) != len(n_kv_heads):
                raise ValueError(
                    f"adakvzip {name} has {len(given)} entries; the model has "
                    f"{len(n_kv_heads)} layers (one entry each)"
                )
        super().check_states(n_kv_heads, batch=batch, prompt_length=prompt_length)

    def for_layer(self, layer: int, n_layers: int) -> "AdaKVzip":
        if not self.layer_budgets:
            return self
        return self.replace(budget=self.layer_budgets[layer], across_layers=False,
                            layer_budgets=(), layer_totals=(),
                            totals=self.layer_totals[layer] if self.layer_totals else ())  # fmt: skip

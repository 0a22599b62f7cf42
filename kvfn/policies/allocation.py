"""Allocations: how a scorer's rows are shared out, apart from how they are scored.

A scorer (``kvfn.Policy``: SnapKV's window, KVzip's reconstruction, Expected Attention, ...)
keeps its top ``budget`` rows in every layer and KV head. An allocation wraps one and holds only
its own knobs: ``Pyramid`` gives the layers budgets falling with depth, ``AcrossHeads`` shares a
layer's rows among its heads by score (Ada-KV), ``AcrossLayers`` every layer's (the KVzip
paper's pair level). The scoring stays the scorer's (settings, pass, scores); the selection and
the states it makes are the allocation's. A plan a prompt's scores decide (``AcrossLayers``: the
rows of each layer) is returned by ``plan`` and given to each layer's compaction, never kept in
the settings. Today's names are shorthands: ``PyramidKV`` is ``Pyramid(SnapKV(...))``, ``AdaKV``
``AcrossHeads(SnapKV(...))``, ``AdaKVzip`` ``AcrossHeads(KVzip(...))``.

    AcrossHeads(ExpectedAttention(budget=512), floor=20)
    Pyramid(KVzip(budget=512), beta=20)
    AcrossLayers(KVzip(budget=512))
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar, Optional

import mlx.core as mx
import numpy as np

from ..states import ragged
from .policy import BasePolicy, Plan, Policy

# a scorer's flags (kvfn.Policy's) that an allocation has from its scorer unless it sets its own
SCORER_FLAGS = ("needs_scores", "statistic", "traceable", "ragged", "query_agnostic",
                "cannot_recompact", "scores_held")  # fmt: skip


def top_mask(priority: mx.array, k: int) -> mx.array:
    """A boolean mask of the ``k`` largest entries along the last axis (ties: any of them)."""
    n = priority.shape[-1]
    if k >= n:
        return mx.ones(priority.shape, mx.bool_)
    top = mx.argpartition(-priority, kth=k - 1, axis=-1)[..., :k]
    return mx.put_along_axis(mx.zeros(priority.shape, mx.bool_), top, mx.array(True), axis=-1)


@dataclass(frozen=True)
class Allocation(BasePolicy):
    """A scorer's rows shared out another way. What it does not own is its scorer's: the
    settings (``budget``, ``window``, ``per_head``, ...) and the scoring (``needs_scores``,
    ``statistic``, ``score_steps``, ``row_scores``, ``query_agnostic``, ...), so compaction
    calls it as it calls a scorer. A subclass defines ``compact_layer`` or ``for_layer``."""

    scorer: Policy

    # a shorthand's scorer class (AdaKV: SnapKV), whose settings its constructor takes
    default_scorer: ClassVar[Optional[type]] = None
    bounds_itself: ClassVar[bool] = False  # its own layout, not its scorer's (kvfn.Policy's)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.scorer, Policy):
            raise TypeError(f"{type(self).__name__} wraps a scorer (a kvfn.Policy), "
                            f"got {self.scorer!r}")  # fmt: skip
        self.check_ints()

    @property
    def name(self) -> str:
        return f"{type(self).__name__.lower()}({self.scorer.name})"

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "scorer":  # copying and unpickling look these up
            raise AttributeError(name)
        return getattr(self.scorer, name)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # a shorthand's class says what its scorer's does where it does not decide (as its
        # instances do): the registry reads these off classes
        for flag in SCORER_FLAGS if cls.default_scorer else ():
            if not hasattr(cls, flag):
                setattr(cls, flag, getattr(cls.default_scorer, flag))

    @classmethod
    def settings(cls) -> dict:
        own = super().settings()
        if cls.default_scorer is None:
            return own
        own.pop("scorer")
        return {**cls.default_scorer.settings(), **own}

    def replace(self, **changes) -> "Allocation":
        """With ``changes``: its own fields here, the rest its scorer's (``budget=``, ...)."""
        own = {f.name for f in dataclasses.fields(self)}
        mine = {k: v for k, v in changes.items() if k in own}
        theirs = {k: v for k, v in changes.items() if k not in own}
        scorer = mine.pop("scorer", self.scorer)
        return dataclasses.replace(self, scorer=scorer.replace(**theirs), **mine)

    def for_tokenizer(self, tokenizer) -> "Allocation":
        return self.replace(scorer=self.scorer.for_tokenizer(tokenizer))

    def for_layer(self, layer: int, n_layers: int) -> BasePolicy:
        return self

    def plan(self, scores, *, prompt_length: int, n_kv_heads: tuple) -> Optional[Plan]:
        return None

    def check_states(self, n_kv_heads: tuple, *, batch: int, prompt_length: int,
                     plan: Optional[Plan] = None) -> None:  # fmt: skip
        self.scorer.check_states(n_kv_heads, batch=batch, prompt_length=prompt_length)

    def check_max_rows(self, max_rows, during: str = "prefilling") -> None:
        self.scorer.check_max_rows(max_rows, during)
        if self.cannot_recompact:
            raise ValueError(f"{self.name} cannot evict while {during}: {self.cannot_recompact}")

    def compact_layer(self, state, scores, *, prompt_length: int, layer: int, reserve: int,
                      group=None, plan: Optional[Plan] = None):  # fmt: skip
        raise NotImplementedError(f"{type(self).__name__} compacts by its for_layer policies")


def shorthand_scorer(cls: type, budget: Optional[int], scorer: Optional[Policy],
                     settings: dict) -> Policy:  # fmt: skip
    """The scorer a shorthand (``AdaKV(budget=512, window=16)``) wraps: its ``default_scorer``
    made from today's keywords, or the one ``dataclasses.replace`` gives back (``scorer=``)."""
    default = cls.default_scorer
    if scorer is None:
        return default(**settings) if budget is None else default(budget, **settings)
    if budget is not None or settings or type(scorer) is not default:
        raise TypeError(
            f"{cls.__name__} takes {default.__name__}'s settings or one {default.__name__} "
            f"(scorer=); another scorer goes in an allocation of kvfn.policies.allocation"
        )
    return scorer


@dataclass(frozen=True)
class Pyramid(Allocation):
    """PyramidKV's allocation (arXiv:2406.02069): layer budgets falling linearly with depth,
    averaging the scorer's ``budget`` (exactly, so memory equals the scorer's alone): the top
    layer keeps (budget - window) / ``beta`` + window rows, the first about twice the average.
    Each layer keeps its scorer's top rows at its own budget (``for_layer``)."""

    beta: int = 20

    cannot_recompact: ClassVar[str] = (
        "its layers keep different budgets, and a compaction step takes layers of one row count"
    )

    def validate(self) -> None:
        super().validate()
        if self.beta < 1:
            raise ValueError(f"{self.name} beta must be >= 1, got {self.beta}")

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

    @property
    def smallest(self) -> int:
        """The top layer's budget, the fewest rows a layer keeps."""
        return max(self.sink_tokens + self.window,
                   (self.budget - self.window) // self.beta + self.window)  # fmt: skip

    def keeps_whole(self, prompt_length: int) -> bool:
        return prompt_length <= max(self.min_tokens, self.smallest)

    def rows_after(self, prompt_length: int) -> int:
        return prompt_length if self.keeps_whole(prompt_length) else self.budget

    def for_layer(self, layer: int, n_layers: int) -> Policy:
        return self.scorer.replace(budget=self.layer_budgets(n_layers)[layer])

    # the scorer scores wherever the smallest layer compacts, though the budget fits the prompt
    def _scoring(self) -> Policy:
        return self.scorer.replace(budget=self.smallest)

    def observation_window(self, prompt_length: int) -> int:
        return self._scoring().observation_window(prompt_length)

    def check_prompt(self, prompt_length: int) -> None:
        self._scoring().check_prompt(prompt_length)

    def score_prompt(self, fmodel, tokens, states, gathered=None):
        return self._scoring().score_prompt(fmodel, tokens, states, gathered)

    def score_steps(self, fmodel, tokens, states, gathered=None, *, step=None, layers=None):
        return self._scoring().score_steps(fmodel, tokens, states, gathered, step=step,
                                           layers=layers)  # fmt: skip


@dataclass(frozen=True)
class AcrossHeads(Allocation):
    """Ada-KV's allocation (arXiv:2407.11550): a layer's ``budget x n_kv_heads`` rows shared
    out among its KV heads by the scorer's ``row_scores``. All (head, row) pairs of a layer are
    ranked together, so a head whose attention is spread over many rows keeps more of them and
    a focused head fewer; each head first keeps its own best ``floor`` percent of an even share
    (the paper's safeguard). The rows are stored for real (``kvfn.RaggedKVCache``: each head its
    own range of slots), not as a mask over the union; the allocation is traced (a layer's total
    is static, the per-head counts arrays). ``across_layers``: every layer's pairs ranked
    together (``AcrossLayers``)."""

    floor: int = 20
    across_layers: bool = False

    ragged: ClassVar[bool] = True
    head_local: ClassVar[bool] = False
    cannot_recompact: ClassVar[str] = (
        "it keeps each head's rows ragged, and a compaction takes plain layers"
    )
    scores_held: ClassVar[bool] = False  # it never evicts while prefilling

    def validate(self) -> None:
        super().validate()
        if getattr(self.scorer, "per_head", True) is not True:
            raise ValueError(f"{self.name} allocates rows among heads: per_head must be True")
        if self.floor > 100:
            raise ValueError(
                f"{self.name} floor is a percent of a head's share, <= 100; got {self.floor}"
            )
        if not isinstance(self.across_layers, bool):
            raise ValueError(f"{self.name} across_layers must be a bool, "
                             f"got {self.across_layers!r}")  # fmt: skip
        if self.across_layers and self.floor:
            raise ValueError(
                f"{self.name} across_layers ranks every layer's pairs together, with no floor: "
                f"floor must be 0, got {self.floor}"
            )

    @property
    def guard(self) -> int:
        """Rows each head keeps of its own best before the layer's pairs are ranked (the floor),
        besides sinks and window."""
        return min(math.ceil(self.floor / 100 * self.budget),
                   self.budget - self.sink_tokens - self.window)  # fmt: skip

    def at_budget(self, budget: Optional[int]) -> "AcrossHeads":
        """Itself with ``budget`` rows a head (a plan's for one layer; None: its own)."""
        return self if budget in (None, self.budget) else self.replace(budget=budget)

    def _priority(self, scores, *, prompt_length: int, n_kv_heads: int, batch: int,
                  layer: int) -> mx.array:  # fmt: skip
        """(B, H, P) float32: a pair's rank among the layer's, +inf for what every head keeps
        (sinks, window, its best ``guard`` rows), -inf for NaN."""
        P, H = prompt_length, n_kv_heads
        s = self.scorer.row_scores(scores, prompt_length=P, n_kv_heads=H, batch=batch,
                                   layer=layer)  # fmt: skip
        s = mx.broadcast_to(s.astype(mx.float32), (batch, H, P))
        s = mx.where(mx.isnan(s), -mx.inf, s)
        pos = mx.arange(P)
        forced = (pos < self.sink_tokens) | (pos >= P - self.window)
        if self.guard > 0:
            forced = forced | top_mask(mx.where(forced, -mx.inf, s), self.guard)
        return mx.where(forced, mx.inf, s)

    def check_states(self, n_kv_heads: tuple, *, batch: int, prompt_length: int,
                     plan: Optional[Plan] = None) -> None:  # fmt: skip
        super().check_states(n_kv_heads, batch=batch, prompt_length=prompt_length)
        if plan is None:
            return
        for name in ("budgets", "totals"):
            given = getattr(plan, name)
            if given and len(given) != len(n_kv_heads):
                raise ValueError(f"{self.name} plan has {len(given)} {name}; the model has "
                                 f"{len(n_kv_heads)} layers (one each)")  # fmt: skip
        least = self.sink_tokens + self.window
        if any(b < least for b in plan.budgets):
            raise ValueError(f"{self.name} plan budgets must be >= {least} (the sinks and "
                             f"window), got {plan.budgets!r}")  # fmt: skip
        for i, h in enumerate(n_kv_heads):
            budget, totals = plan.layer(i)
            if h is not None and totals is not None:
                self.at_budget(budget).check_totals(totals, h, batch, prompt_length)

    def check_totals(self, totals: tuple, n_kv_heads: int, batch: int,
                     prompt_length: int) -> None:  # fmt: skip
        """Raise a ValueError unless ``totals`` holds a count for each of ``batch`` sequences,
        each at least the rows every head must keep and at most ``min(budget, prompt_length)``
        a head (a larger count would run past the ragged buffer)."""
        H, P = n_kv_heads, prompt_length
        if len(totals) != batch:
            raise ValueError(f"{self.name} totals has {len(totals)} counts (one a sequence); "
                             f"the batch has {batch} sequences")  # fmt: skip
        forced = min(P, self.sink_tokens + self.window + self.guard)
        least, most = H * forced, H * min(P, self.budget)
        bad = [t for t in totals if not least <= t <= most]
        if bad:
            raise ValueError(
                f"{self.name} totals {bad} out of range for {H} KV heads and a {P}-row prompt: "
                f"at least {least} (the {forced} sinks, window and floor rows each head keeps), "
                f"at most {most} ({min(P, self.budget)} rows a head: the budget, or the prompt)"
            )

    def keep_mask(self, scores, *, prompt_length: int, n_kv_heads: int, batch: int = 1,
                  layer: int = 0, totals: Optional[tuple] = None) -> mx.array:  # fmt: skip
        """(B, n_kv_heads, P) bool: the rows each head keeps, ``budget x n_kv_heads`` a
        sequence in all, or ``totals[b]`` for sequence b (a plan's). Traceable."""
        P, H = prompt_length, n_kv_heads
        if totals is None and self.keeps_whole(P):
            return mx.ones((batch, H, P), mx.bool_)
        s = self._priority(scores, prompt_length=P, n_kv_heads=H, batch=batch, layer=layer)
        flat = s.reshape(batch, H * P)
        if totals is None:
            return top_mask(flat, self.budget * H).reshape(batch, H, P)
        rank = mx.argsort(mx.argsort(-flat, axis=-1), axis=-1)
        return (rank < mx.array(totals, mx.int32)[:, None]).reshape(batch, H, P)

    def allocation(self, scores: mx.array, *, prompt_length: int, n_kv_heads: int,
                   layer: int = 0) -> list[np.ndarray]:  # fmt: skip
        """Per KV head, its sorted kept rows of a prompt of one sequence (scores (1, n_heads,
        P)); together ``budget x n_kv_heads`` rows."""
        keep = np.array(self.keep_mask(scores, prompt_length=prompt_length, n_kv_heads=n_kv_heads,
                                       layer=layer))[0]  # fmt: skip
        return [np.flatnonzero(k).astype(np.int32) for k in keep]

    def compact_layer(self, state, scores, *, prompt_length: int, layer: int, reserve: int,
                      group=None, plan: Optional[Plan] = None):  # fmt: skip
        if group is not None and group.size() > 1:
            raise ValueError(f"{self.name} allocates across all of a layer's heads: a "
                             "tensor-parallel model is not supported yet")  # fmt: skip
        budget, totals = plan.layer(layer) if plan is not None else (None, None)
        own, P = self.at_budget(budget), prompt_length
        B, H = state.keys.shape[:2]
        # with totals each sequence keeps its own count, ragged, even where the budget reaches
        # the prompt
        if totals is None and own.keeps_whole(P):
            return own.scorer.compact_layer(state, scores, prompt_length=P, layer=layer,
                                            reserve=reserve)  # fmt: skip
        keep = own.keep_mask(scores, prompt_length=P, n_kv_heads=H, batch=B, layer=layer,
                             totals=totals)  # fmt: skip
        total = own.budget * H
        return ragged.pack(state, keep, capacity=total, room=reserve,
                           kept=total if totals is None else None)  # fmt: skip

    def plan(self, scores, *, prompt_length: int, n_kv_heads: tuple) -> Optional[Plan]:
        """``across_layers`` (the KVzip paper's pair level): for each sequence, every layer's
        (KV head, row) pairs ranked together and the best ``budget`` a head kept over all layers
        (sinks and window first); a layer keeps its share of them (as many rows a sequence as it
        has pairs there), stored in ``budget`` rows a head, the most any sequence of the batch
        needs there. None within a layer, or for a prompt kept whole."""
        P = prompt_length
        if not self.across_layers or self.keeps_whole(P):
            return None
        full = [i for i, h in enumerate(n_kv_heads) if h is not None]
        B = scores[full[0]].shape[0]
        counts = np.array([self._shares(scores, b, P, n_kv_heads) for b in range(B)])
        floor = self.sink_tokens + self.window
        budgets = [min(P, max(floor, -(-int(counts[:, i].max()) // h))) if h else floor
                   for i, h in enumerate(n_kv_heads)]  # fmt: skip
        totals = tuple(tuple(int(c) for c in counts[:, i]) for i in range(len(n_kv_heads)))
        return Plan(budgets=tuple(budgets), totals=totals)

    def _shares(self, scores, b: int, P: int, n_kv_heads: tuple) -> list[int]:
        """The pairs sequence ``b`` keeps in each layer, every layer's ranked together by the
        priorities the traced allocation ranks (floor 0: sinks and window forced)."""
        ranked = {i: np.array(self._priority(scores[i][b : b + 1, :, :P], prompt_length=P,
                                             n_kv_heads=h, batch=1, layer=i))
                  for i, h in enumerate(n_kv_heads) if h is not None}  # fmt: skip
        flat = np.concatenate([r.ravel() for r in ranked.values()])
        keep = self.budget * sum(h for h in n_kv_heads if h is not None)
        threshold = np.partition(flat, flat.size - keep)[flat.size - keep]
        return [int((ranked[i] >= threshold).sum()) if i in ranked else 0
                for i in range(len(n_kv_heads))]  # fmt: skip


@dataclass(frozen=True)
class AcrossLayers(AcrossHeads):
    """``AcrossHeads`` over every layer at once (the KVzip paper's pair-level selection): each
    sequence keeps its best ``budget x n_kv_heads x layers`` (layer, KV head, row) pairs, with
    no floor; ``plan`` shares them out among the layers on the host, before tracing."""

    floor: int = 0
    across_layers: bool = True

"""The one contract every eviction policy follows, and the parser from names to policies.

A policy is a small frozen dataclass holding its settings, in one of two parts that compose
(as kvpress's scorer presses and their wrappers, or Optax's transformations): a scorer
(``Policy``) scores the rows of a prompt (``row_scores``: higher is kept first, from the
observation window's attention scores, a pass of its own, or nothing) and keeps its top rows
the same way in every layer and head; an allocation (``kvfn.policies.allocation``: ``Pyramid``,
``AcrossHeads``, ``AcrossLayers``) wraps a scorer and shares its rows out otherwise. The scorer
base does the rest once for all: the "keep the whole prompt when it fits" rule, the attention
sinks and the observation window (always kept), the budget, and the top-k that makes the keep
indices sorted and unique by construction. Everything is traceable for a static budget and
prompt length, so ``kvfn.compact`` runs it inside one compiled transformation.

    @dataclass(frozen=True)
    class KeyNorm(kvfn.Policy):          # a policy of your own
        name: ClassVar[str] = "keynorm"
        def row_scores(self, scores, *, prompt_length, n_kv_heads, batch, layer):
            ...                          # (batch, n_kv_heads or 1, prompt_length)

    AcrossHeads(KeyNorm(budget=512))     # its rows shared out among a layer's heads (Ada-KV)
"""

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Optional

import mlx.core as mx

from ..distributed import keep_indices as rank_keep_indices
from ..states import cache as kv

POLICIES: dict[str, type] = {}


def register_policy(cls: type) -> type:
    """Make ``parse_policy`` know ``cls`` by its ``name`` (usable as a class decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, BasePolicy)):
        raise TypeError(f"register_policy takes a Policy subclass, got {cls!r}")
    POLICIES[cls.name] = cls
    return cls


class BasePolicy:
    """What every policy is, scorer or allocation: a ``name`` (registered for ``parse_policy``,
    reported in usage) whose option ``words`` and ``numbers`` set fields; what compaction calls
    of it is ``Policy``'s methods (an allocation has its scorer's for what it does not own)."""

    name: ClassVar[str] = "policy"
    # option word -> field values, for names like "snapkv-avg-layer"
    words: ClassVar[dict] = {}
    # option prefix -> int field, for names like "snapkv-k15"
    numbers: ClassVar[dict] = {}

    def compact_layers(self, states: dict, scores: Optional[dict], *, prompt_length: int,
                       n_layers: int, reserve: int, group=None, plan=None) -> dict:  # fmt: skip
        """Freshly prefilled full-attention layers ``states`` ({layer: state} of a model of
        ``n_layers``; ``scores`` likewise, or None) compacted, each by ``for_layer``'s
        ``compact_layer`` (its arguments, there). Traceable."""
        return {i: self.for_layer(i, n_layers).compact_layer(
                    s, None if scores is None else scores[i], prompt_length=prompt_length,
                    layer=i, reserve=reserve, group=group, plan=plan)
                for i, s in states.items()}  # fmt: skip

    def holding(self, max_rows: int) -> "BasePolicy":
        """The policy of a compaction while prefilling under a cap of ``max_rows`` rows, before
        the last one (which keeps this policy's rows): this one by default."""
        return self

    def check_ints(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            optional = f.type in (Optional[int], "Optional[int]")
            if optional and value is None:
                continue
            if (optional or f.type in (int, "int")) and (type(value) is not int or value < 0):
                raise ValueError(f"{self.name} {f.name} must be a non-negative int, got {value!r}")

    @classmethod
    def settings(cls) -> dict:
        """The keywords its constructor takes (what ``parse_policy`` and the server pass), each
        to its default (``dataclasses.MISSING``: none)."""
        return {f.name: f.default for f in dataclasses.fields(cls)}

    @classmethod
    def options(cls, parts: list[str]) -> dict:
        """Field values from the option words of a name (see ``words`` and ``numbers``)."""
        out, said = {}, {}
        for word in parts:
            prefix, digits = word[:1], word[1:]
            if word in cls.words:
                got = cls.words[word]
            elif prefix in cls.numbers and digits.isascii() and digits.isdecimal():
                got = {cls.numbers[prefix]: int(digits)}
            else:
                known = [*cls.words, *(f"{p}<N>" for p in cls.numbers)]
                raise ValueError(
                    f"unknown option {word!r} for policy {cls.name!r} "
                    f"(options: {', '.join(known) or 'none'})"
                )
            for field in got:
                if field in said:
                    raise ValueError(f"options {said[field]!r} and {word!r} of policy "
                                     f"{cls.name!r} both set its {field}")  # fmt: skip
                said[field] = word
            out.update(got)
        return out


def _counts(values, least: int = 0) -> bool:
    return isinstance(values, tuple) and all(type(v) is int and v >= least for v in values)


@dataclass(frozen=True)
class Plan:
    """What a policy decided for one prompt's layers on the host, before tracing (``plan``),
    given to every layer's ``compact_layer``: per layer, the rows a KV head stores
    (``budgets``; empty: the policy's budget) and the rows each sequence keeps over its heads
    (``totals``, a tuple a layer, a count a sequence; empty: ``budget x n_kv_heads``)."""

    budgets: tuple = ()
    totals: tuple = ()

    def __post_init__(self):
        if not _counts(self.budgets, least=1):
            raise ValueError(f"a plan's budgets must be a tuple of ints >= 1, got {self.budgets!r}")
        if not (isinstance(self.totals, tuple) and all(_counts(t) for t in self.totals)):
            raise ValueError(f"a plan's totals must be tuples of ints >= 0, got {self.totals!r}")

    def layer(self, i: int) -> tuple[Optional[int], Optional[tuple]]:
        """Layer ``i``'s budget and totals (None where the plan leaves them to the policy)."""
        return (self.budgets[i] if self.budgets else None, self.totals[i] if self.totals else None)


@dataclass(frozen=True)
class Policy(BasePolicy):
    """A scorer and the uniform allocation: its top rows in every layer and KV head. The
    settings every scorer shares (an allocation has its scorer's); ``validate`` raises a
    ValueError naming a bad value.

    budget: rows kept per layer and KV head (sinks and window included).
    window: the observation window: the last ``window`` prompt rows are always kept, and their
        queries' attention is what ``row_scores`` receives when ``needs_scores``.
    sink_tokens: the first rows, always kept (attention sinks).
    min_tokens: prompts this short are never compacted.
    """

    budget: int
    window: int = 32
    sink_tokens: int = 4
    min_tokens: int = 0

    needs_scores: ClassVar[bool] = False
    # what the prefill gathers of the observation window's queries (kvfn.QuerySlice): their
    # "attention" over every key, or their "moments" (mean and covariance before RoPE)
    statistic: ClassVar[str] = "attention"
    # False: compact_layer reads values on the host (data-dependent shapes), so it runs eagerly
    traceable: ClassVar[bool] = True
    # True when a KV head's rows depend only on its own query heads' scores: a rank of a
    # tensor-parallel model then selects without the other ranks' scores (kvfn.distributed)
    head_local: ClassVar[bool] = False
    # True when compact_layer stores a layer's heads ragged (kvfn.RaggedKVCache): how many rows
    # each head keeps varies by prompt, and any two prompts' layers batch together
    ragged: ClassVar[bool] = False
    # True when the rows it keeps do not depend on what the prompt asks at its end (no window
    # of queries scores them): one compaction of a context then serves every later question
    query_agnostic: ClassVar[bool] = False
    # why the policy cannot compact states it compacted before, to evict while prefilling
    # (compact's max_rows) or generating (kvfn.bounded_decode); "" when it can: a policy says so
    cannot_recompact: ClassVar[str] = (
        "it does not say it can compact rows it compacted before (Policy.cannot_recompact)"
    )
    # True when, evicting while prefilling, it scores the rows it holds by a pass of its own
    # (``held_score_steps``: KVzip's reconstruction) instead of a window of the prefill's queries
    scores_held: ClassVar[bool] = False
    # True when its compacted layers bound what they hold as later chunks append (Duo's
    # streaming heads, rings): evicting while prefilling, it compacts once, when the cap is first
    # passed, and later chunks are prefilled into its layout
    bounds_itself: ClassVar[bool] = False
    # True when row_scores never reads its layer and compact_layer is the base's: every layer's
    # rows are one function of its own scores (compact_layers then selects them all at once). A
    # subclass that defines its own scoring or selection is False unless it says so again.
    same_in_every_layer: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        own = ("row_scores", "keep_indices", "compact_layer", "for_layer")
        if "same_in_every_layer" not in vars(cls) and any(m in vars(cls) for m in own):
            cls.same_in_every_layer = False

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        self.check_ints()
        self.check_budget()

    def check_budget(self) -> None:
        if self.budget < 1:
            raise ValueError(f"{self.name} budget must be >= 1, got {self.budget}")
        if self.budget < self.sink_tokens + self.window:
            raise ValueError(
                f"{self.name} budget {self.budget} is below sink_tokens + window = "
                f"{self.sink_tokens} + {self.window}"
            )

    def replace(self, **changes) -> "Policy":
        return dataclasses.replace(self, **changes)

    def holding(self, max_rows: int) -> "Policy":
        """Itself with a budget of ``max_rows``: a compaction before the last one keeps as many
        rows as the cap holds, so the last one chooses from all of them."""
        return self if max_rows == self.budget else self.replace(budget=max_rows)

    def keeps_whole(self, prompt_length: int) -> bool:
        """Whether a prompt this long is kept whole (it fits the budget, or is below
        ``min_tokens``)."""
        return prompt_length <= max(self.min_tokens, self.budget)

    def check_prompt(self, prompt_length: int) -> None:
        """Refuses, before any work, a context this long that the policy's settings would make
        unreasonable (KVzip: a pass of too many chunks); nothing by default."""

    def check_max_rows(self, max_rows, during: str = "prefilling") -> None:
        """Refuses, by value or by the policy's reason, a cap on the rows held while prefilling
        (``kvfn.compact``'s ``max_rows``) or generating."""
        if type(max_rows) is not int or max_rows < self.budget:
            raise ValueError(f"max_rows must be an int >= the policy's budget {self.budget}, "
                             f"got {max_rows!r}")  # fmt: skip
        if self.min_tokens > max_rows:
            raise ValueError(f"max_rows {max_rows} is below the policy's min_tokens "
                             f"{self.min_tokens}, which it would hold whole")  # fmt: skip
        if self.cannot_recompact:
            raise ValueError(f"{self.name} cannot evict while {during}: {self.cannot_recompact}")
        if during == "prefilling":
            self.holding(max_rows)  # what compacts while prefilling: checked here, before work

    def observation_window(self, prompt_length: int) -> int:
        """How many of the prompt's last queries the prefill must score (0: none)."""
        if not self.needs_scores or self.keeps_whole(prompt_length):
            return 0
        return min(self.window, prompt_length)

    def score_prompt(self, fmodel, tokens: mx.array, states: tuple,
                     gathered: Optional[tuple] = None) -> Optional[tuple]:  # fmt: skip
        """Scores for ``row_scores`` from ``states`` freshly prefilled from ``tokens`` (B, P)
        and what that prefill ``gathered`` (the policy's ``statistic``, if it scored): a pass
        of the policy's own (KVzip's context reconstruction), or the expected attention of the
        gathered query moments; None (the default): the gathered attention is the scores."""
        return None

    def score_steps(self, fmodel, tokens: mx.array, states: tuple,
                    gathered: Optional[tuple] = None, *, step: Optional[int] = None,
                    layers: Optional[int] = None):  # fmt: skip
        """``score_prompt`` as a generator: it yields ``(done, total)`` after each step of a
        pass of its own (KVzip's chunks), so a caller can interleave other work (the server's
        decode steps), and returns what ``score_prompt`` returns. ``step``: a pass's forwards
        take at most this many tokens each, a step apiece (None: the pass's own steps);
        ``layers``: each forward evaluated that many layers a step (``passes.settling``). The
        default runs ``score_prompt`` in one step."""
        return self.score_prompt(fmodel, tokens, states, gathered)
        yield  # noqa: unreachable: makes this a generator

    def held_score_steps(self, fmodel, context: mx.array, states: tuple, start: int,
                         carried: Optional[tuple], *, step: Optional[int] = None,
                         layers: Optional[int] = None):  # fmt: skip
        """Evicting while prefilling, where ``scores_held``: a generator of the scores of every
        row ``states`` hold, yielding after each step of its pass. The last rows are those of
        the context tokens ``context[:, start:]``, not scored yet; ``carried`` holds the earlier
        rows' scores (None: there are none). ``step`` and ``layers`` as in ``score_steps``."""
        raise NotImplementedError(f"{type(self).__name__} scores by the prefill's window")
        yield  # noqa: unreachable: makes this a generator

    def scoring(self) -> tuple:
        """What ``score_prompt``'s result depends on besides the prompt and its states:
        policies with equal ``scoring()`` may share one scoring (the evaluator does)."""
        return (type(self).score_prompt,)

    def for_tokenizer(self, tokenizer) -> "Policy":
        """The policy with the settings that come from the model's tokenizer (KVzip's
        instruction to repeat the context); itself by default."""
        return self

    def row_scores(
        self, scores: Optional[mx.array], *, prompt_length: int, n_kv_heads: int, batch: int,
        layer: int
    ) -> mx.array:  # fmt: skip
        """Per-row keep priority (batch, n_kv_heads or 1, prompt_length); 1 = one row set for
        every head. ``scores`` is (batch, n_heads, prompt_length) summed window attention, or
        None when the policy does not need scores."""
        raise NotImplementedError(f"{type(self).__name__} must define row_scores")

    def keep_indices(
        self, scores: Optional[mx.array], *, prompt_length: int, n_kv_heads: int,
        batch: int = 1, layer: int = 0
    ) -> mx.array:  # fmt: skip
        """Sorted unique rows to keep (batch, n_kv_heads, min(prompt_length, budget)) of a
        prompt of ``prompt_length`` rows, in layer ``layer``."""
        P = prompt_length
        if P < 1:
            raise ValueError(f"prompt_length must be >= 1, got {P}")
        if not isinstance(n_kv_heads, int) or n_kv_heads < 1:
            raise ValueError(
                f"n_kv_heads must be a positive divisor of the query heads, got {n_kv_heads!r}"
            )
        if self.keeps_whole(P):
            return mx.broadcast_to(mx.arange(P, dtype=mx.int32), (batch, n_kv_heads, P))
        if self.needs_scores:
            if scores is None:
                raise ValueError(f"policy {self.name!r} needs the observation window's scores")
            if scores.ndim != 3 or scores.shape[0] != batch or scores.shape[2] != P:
                raise ValueError(
                    f"scores must have shape (batch={batch}, n_heads, prompt_length={P}), "
                    f"got {tuple(scores.shape)}"
                )
            if scores.shape[1] % n_kv_heads:
                raise ValueError(
                    f"{scores.shape[1]} query heads do not group over n_kv_heads={n_kv_heads}"
                )
        s = self.row_scores(scores, prompt_length=P, n_kv_heads=n_kv_heads, batch=batch,
                            layer=layer).astype(mx.float32)  # fmt: skip
        s = mx.where(mx.isnan(s), -mx.inf, s)
        pos = mx.arange(P)
        s = mx.where((pos < self.sink_tokens) | (pos >= P - self.window), mx.inf, s)
        keep = mx.argpartition(-s, kth=self.budget - 1, axis=-1)[..., : self.budget]
        keep = mx.sort(keep.astype(mx.int32), axis=-1)
        return mx.broadcast_to(keep, (batch, n_kv_heads, self.budget))

    def rows_after(self, prompt_length: int) -> int:
        """Rows each KV head of a full-attention layer keeps of a prompt this long."""
        return prompt_length if self.keeps_whole(prompt_length) else self.budget

    def for_layer(self, layer: int, n_layers: int) -> "Policy":
        """The policy that compacts layer ``layer`` of ``n_layers`` (itself; ``Pyramid`` gives
        each layer its scorer with a budget of its own)."""
        return self

    def head_parts(self, layer: int, n_kv_heads: int) -> Optional[tuple]:
        """The KV-head parts (tuples of heads) that this policy's compacted layer ``layer``
        may store apart (``HeadPartitionedKVCache``), the same for every prompt, so per-head
        states of different prompts batch together (``kvfn.serving.batch.HeadPartsKVCache``); None
        when every layer is one plain state (the base)."""
        return None

    def plan(self, scores, *, prompt_length: int, n_kv_heads: tuple) -> Optional[Plan]:
        """What this prompt's scores decide for every layer, on the host before tracing (None,
        the base: nothing; ``AcrossLayers`` shares one budget across layers here). ``scores``
        and ``n_kv_heads`` a layer, as ``check_states`` takes them."""
        return None

    def check_states(self, n_kv_heads: tuple[Optional[int], ...], *, batch: int,
                     prompt_length: int, plan: Optional[Plan] = None) -> None:  # fmt: skip
        """Raise a ValueError if the policy cannot compact prefilled states of these shapes: a
        KV-head count per layer (None for a sliding-window layer), ``batch`` sequences of
        ``prompt_length`` rows, under ``plan`` (the one ``plan`` made or one given); called
        before tracing."""

    def compact_layer(self, state: kv.State, scores: Optional[mx.array], *, prompt_length: int,
                      layer: int, reserve: int, group=None, plan: Optional[Plan] = None):  # fmt: skip
        """A freshly prefilled full-attention layer (``prompt_length`` rows) compacted, with
        room for ``reserve`` more rows. Traceable. The base keeps ``keep_indices``; a policy
        that stores heads differently (``kvfn.Duo``) returns another state type. ``group``: the
        state holds this rank's heads of a tensor-parallel model (``kvfn.distributed``).
        ``plan``: the prompt's ``plan`` (the base has none)."""
        P = prompt_length
        if self.keeps_whole(P):
            return kv.fitted(state.replace(max_rows=P), P + reserve)
        B, H = state.keys.shape[:2]
        idx = rank_keep_indices(self, scores, prompt_length=P, n_kv_heads=H, batch=B,
                                layer=layer, group=group)  # fmt: skip
        return kv.gather(state, idx, packed=state.packed, room=reserve)

    def compact_layers(self, states: dict, scores: Optional[dict], *, prompt_length: int,
                       n_layers: int, reserve: int, group=None, plan=None) -> dict:  # fmt: skip
        """``BasePolicy.compact_layers``; a policy ``same_in_every_layer`` selects the rows of
        all its layers of one shape at once (the layers folded into the batch: one scoring and
        one top-k instead of one a layer), then gathers each layer's."""
        P, kept = prompt_length, {}
        shapes = {(s.keys.shape[:2], None if scores is None else scores[i].shape)
                  for i, s in states.items()}  # fmt: skip
        if not self.same_in_every_layer or self.keeps_whole(P) or len(shapes) != 1:
            return super().compact_layers(states, scores, prompt_length=P, n_layers=n_layers,
                                          reserve=reserve, group=group, plan=plan)  # fmt: skip
        (((B, H), _),) = shapes
        layers = list(states)
        every = None if scores is None else mx.concatenate([scores[i] for i in layers])
        idx = rank_keep_indices(self, every, prompt_length=P, n_kv_heads=H,
                                batch=B * len(layers), layer=0, group=group)  # fmt: skip
        for j, i in enumerate(layers):
            kept[i] = kv.gather(states[i], idx[j * B : (j + 1) * B], packed=states[i].packed,
                                room=reserve)  # fmt: skip
        return kept


def parse_policy(spec: str, **settings) -> BasePolicy:
    """A policy from its name and options, e.g. ``parse_policy("snapkv-k15-avg-layer",
    budget=512)``; ``settings`` are the fields the name does not give (budget, window, ...)."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"a policy name must be a non-empty string, got {spec!r}")
    head, *parts = spec.split("-")
    cls = POLICIES.get(head)
    if cls is None:
        raise ValueError(f"unknown policy {spec!r} (known: {', '.join(sorted(POLICIES))})")
    unknown = sorted(set(settings) - set(cls.settings()))
    if unknown:
        raise ValueError(f"policy {head!r} has no setting {', '.join(unknown)}")
    return cls(**{**settings, **cls.options(parts)})

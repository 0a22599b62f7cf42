"""DuoAttention (arXiv:2410.10819): retrieval heads keep the long context, streaming heads keep
only the attention sinks and a ring of recent rows.

``HeadPattern`` is a score per (layer, KV head) in [0, 1] (1: a retrieval head), read from and
written to DuoAttention's published format (``full_attention_heads.tsv``: a row per layer, a
tab-separated score per KV head; ``config.json``: ``sink_size``, ``recent_size``, and
optionally ``threshold`` / ``sparsity``). ``Duo`` is the policy: after a full prefill each
layer becomes a ``HeadPartitionedKVCache`` of a plain part (the retrieval heads; SnapKV-
compacted to ``budget`` with ``compress``) and a ``StreamingRing`` (the streaming heads).
"""

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import ClassVar, Optional

import mlx.core as mx
import numpy as np

from ..states import cache as kv
from ..states import partitioned as part
from ..states import ring as rg
from .policy import Policy, register_policy
from .snapkv import SnapKV

TSV = "full_attention_heads.tsv"
CONFIG = "config.json"
ALL = 2**31 - 1


@dataclass(frozen=True)
class HeadPattern:
    """Per layer, per KV head, how much the head needs the whole context (1: retrieval)."""

    scores: tuple
    sink_size: int = 64
    recent_size: int = 256
    threshold: Optional[float] = None  # config.json's binarization, when it gives one
    sparsity: Optional[float] = None

    def __post_init__(self):
        a = np.asarray(self.scores, dtype=np.float64)
        if a.ndim != 2 or a.size == 0:
            raise ValueError(f"head scores must be (layers, kv_heads), got shape {a.shape}")
        if not np.all(np.isfinite(a)):
            raise ValueError("head scores must be finite")
        object.__setattr__(self, "scores", tuple(tuple(float(x) for x in r) for r in a))
        for name in ("sink_size", "recent_size"):
            v = getattr(self, name)
            if type(v) is not int or v < (0 if name == "sink_size" else 1):
                raise ValueError(f"{name} must be an int (>= 1 for recent_size), got {v!r}")

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.scores), len(self.scores[0])

    def retrieval(self, *, ratio: Optional[float] = None,
                  threshold: Optional[float] = None) -> tuple:  # fmt: skip
        """Which KV heads retrieve, per layer: the ``ratio`` highest-scoring heads of the model
        (ties by layer then head, so exactly round(ratio x heads) of them), or those scoring at
        least ``threshold``. DuoAttention's ``sparsity`` is 1 - ratio. With neither, the
        pattern's own config (sparsity, else threshold)."""
        a = np.clip(np.asarray(self.scores), 0.0, 1.0)
        if ratio is None and threshold is None:
            if self.sparsity is None and self.threshold is None:
                raise ValueError("give a ratio or threshold (the pattern's config sets neither)")
            if self.sparsity is not None:
                ratio = 1.0 - self.sparsity
            else:
                threshold = self.threshold
        if (ratio is None) == (threshold is None):
            raise ValueError("give exactly one of ratio and threshold")
        if ratio is not None:
            if not 0.0 <= ratio <= 1.0:
                raise ValueError(f"retrieval ratio must be in [0, 1], got {ratio}")
            k = int(round(ratio * a.size))
            order = np.argsort(-a.ravel(), kind="stable")
            keep = np.zeros(a.size, bool)
            keep[order[:k]] = True
            keep = keep.reshape(a.shape)
        else:
            keep = a >= threshold
        return tuple(tuple(bool(x) for x in r) for r in keep)

    @classmethod
    def load(cls, path) -> "HeadPattern":
        """From a DuoAttention pattern folder (``full_attention_heads.tsv`` + ``config.json``)
        or a .tsv file (sink and recent sizes then default to 64 and 256)."""
        path = Path(path)
        tsv, config = (path / TSV, path / CONFIG) if path.is_dir() else (path, None)
        if not tsv.is_file():
            raise FileNotFoundError(f"no head pattern at {tsv}")
        try:
            scores = np.loadtxt(tsv, dtype=float, delimiter="\t", ndmin=2)
        except ValueError as e:
            raise ValueError(f"{tsv} is not a tab-separated table of numbers: {e}") from None
        settings = {}
        if config is not None and config.is_file():
            raw = json.loads(config.read_text())
            keys = ("sink_size", "recent_size", "threshold", "sparsity")
            settings = {k: raw[k] for k in keys if raw.get(k) is not None}
        return cls(scores=scores, **settings)

    def save(self, folder, **extra) -> Path:
        """Write ``full_attention_heads.tsv`` and ``config.json`` (with ``extra`` keys, e.g.
        how the scores were made) into ``folder``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        np.savetxt(folder / TSV, np.asarray(self.scores), delimiter="\t", fmt="%.6f")
        config = dict(sink_size=self.sink_size, recent_size=self.recent_size, **extra)
        config.update({k: getattr(self, k) for k in ("threshold", "sparsity")
                       if getattr(self, k) is not None})  # fmt: skip
        (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        return folder


@register_policy
@dataclass(frozen=True)
class Duo(Policy):
    """Retrieval heads keep the whole prompt, or with ``compress`` their SnapKV rows within
    ``budget``; streaming heads keep ``sink_tokens`` + ``recent`` rows, a ring during decode.

    Which heads retrieve: ``retrieval`` (per layer, a bool per KV head) if given, else the
    ``ratio`` percent best-scoring heads of ``pattern`` (None: the pattern's own sparsity or
    threshold, else 50%). Names: "duo", "duo-r25" (ratio 25), "duo-snapkv" (compress)."""

    budget: int = ALL
    window: int = 32
    sink_tokens: int = 64
    min_tokens: int = 0
    recent: int = 256
    ratio: Optional[int] = None
    pattern: Optional[HeadPattern] = None
    retrieval: tuple = ()
    compress: bool = False

    name: ClassVar[str] = "duo"
    words: ClassVar[dict] = {"snapkv": {"compress": True}}
    numbers: ClassVar[dict] = {"r": "ratio"}
    # evicting while prefilling its streaming heads become rings once (DuoAttention's chunked
    # prefill), its retrieval heads keep every row; see ``check_max_rows``
    cannot_recompact: ClassVar[str] = ""
    bounds_itself: ClassVar[bool] = True

    @classmethod
    def from_pattern(cls, pattern: HeadPattern, *, ratio: Optional[float] = None,
                     threshold: Optional[float] = None, **settings) -> "Duo":  # fmt: skip
        """Retrieval heads chosen by ``ratio`` (a fraction) or ``threshold``; sink and recent
        sizes from the pattern unless given."""
        settings.setdefault("sink_tokens", pattern.sink_size)
        settings.setdefault("recent", pattern.recent_size)
        heads = pattern.retrieval(ratio=ratio, threshold=threshold)
        return cls(retrieval=heads, pattern=pattern, **settings)

    def validate(self) -> None:
        self.check_ints()
        if self.compress:  # the budget is the retrieval heads' SnapKV budget
            self.check_budget()
        if self.recent < 1:
            raise ValueError(f"duo recent must be >= 1, got {self.recent}")
        if self.ratio is not None and not 0 <= self.ratio <= 100:
            raise ValueError(f"duo ratio is a percent of KV heads, <= 100; got {self.ratio}")
        if self.pattern is not None and not isinstance(self.pattern, HeadPattern):
            raise ValueError(
                f"duo pattern must be a HeadPattern, got {type(self.pattern).__name__}"
            )
        if not isinstance(self.retrieval, tuple) or any(
            not isinstance(r, (tuple, list)) or any(type(x) is not bool for x in r)
            for r in self.retrieval
        ):
            raise ValueError(
                "duo retrieval must be a tuple with, per layer, a tuple of bools (one per KV "
                f"head, True: retrieval), got {self.retrieval!r}"
            )
        if self.compress and self.budget == ALL:
            raise ValueError("duo with compress (duo-snapkv) needs a budget for retrieval heads")

    @cached_property
    def heads(self) -> tuple:
        """Per layer, per KV head: True for a retrieval head."""
        if self.retrieval:
            return self.retrieval
        if self.pattern is None:
            raise ValueError("duo needs a head pattern (pattern=HeadPattern.load(...)) or "
                             "retrieval=(per layer, a bool per KV head)")  # fmt: skip
        if self.ratio is None:
            if self.pattern.sparsity is None and self.pattern.threshold is None:
                return self.pattern.retrieval(ratio=0.5)
            return self.pattern.retrieval()
        return self.pattern.retrieval(ratio=self.ratio / 100)

    @property
    def needs_scores(self) -> bool:
        return self.compress

    def check_max_rows(self, max_rows, during: str = "prefilling") -> None:
        """Evicting while prefilling, the streaming heads hold at most ``max_rows`` plus a
        chunk, then their sinks and recent rows; the retrieval heads hold every row. Refused
        while generating and with ``compress``."""
        why = None
        if during != "prefilling":
            why = ("its streaming heads are rings already and its retrieval heads keep every "
                   "row")  # fmt: skip
        elif self.compress:
            why = ("duo-snapkv's retrieval heads are scored by SnapKV over the prompt, and a "
                   "compaction of its layers takes plain ones")  # fmt: skip
        if why:
            raise ValueError(f"{self.name} cannot evict while {during}: {why}")
        least = max(self.sink_tokens + self.recent, self.min_tokens)
        if type(max_rows) is not int or max_rows < least:
            raise ValueError(f"max_rows must be an int >= duo's sink_tokens + recent (and "
                             f"min_tokens) {least}, got {max_rows!r}")  # fmt: skip

    def holding(self, max_rows: int) -> "Duo":
        """Itself: its layout bounds itself, so it compacts once while prefilling."""
        return self

    def keeps_whole(self, prompt_length: int) -> bool:
        return prompt_length <= max(self.min_tokens, self.sink_tokens + self.recent)

    def _split(self, layer: int) -> tuple[list, list]:
        """Layer ``layer``'s retrieval and streaming KV heads."""
        mask = self.heads[layer]
        return [h for h, r in enumerate(mask) if r], [h for h, r in enumerate(mask) if not r]

    def head_parts(self, layer: int, n_kv_heads: int) -> tuple:
        return tuple(tuple(g) for g in self._split(layer) if g)

    def _snapkv(self) -> SnapKV:
        return SnapKV(budget=self.budget, window=self.window, sink_tokens=self.sink_tokens)

    def check_states(self, n_kv_heads: tuple, *, batch: int, prompt_length: int,
                     plan=None) -> None:  # fmt: skip
        want = [len(r) for r in self.heads]
        if len(want) != len(n_kv_heads) or any(
            h is not None and h != w for h, w in zip(n_kv_heads, want)
        ):
            raise ValueError(
                f"duo retrieval pattern has {len(want)} layers of {sorted(set(want))} KV heads; "
                f"the model has {len(n_kv_heads)} layers of "
                f"{sorted({h for h in n_kv_heads if h is not None})} (a row per layer)"
            )

    def row_scores(self, scores, *, prompt_length, n_kv_heads, batch, layer):
        raise TypeError("duo keeps ragged per-head rows: use kvfn.compact (compact_layer)")

    def compact_layer(self, state: kv.State, scores: Optional[mx.array], *, prompt_length: int,
                      layer: int, reserve: int, group=None, plan=None):  # fmt: skip
        if group is not None and group.size() > 1:
            raise ValueError("duo on a tensor-parallel model is not supported yet")
        P = prompt_length
        if self.keeps_whole(P):
            return super().compact_layer(state, scores, prompt_length=P, layer=layer,
                                         reserve=reserve)  # fmt: skip
        keep, stream = self._split(layer)
        parts, heads = [], []
        if keep:
            parts.append(self._retrieval_part(state, scores, keep, P, layer, reserve))
            heads.append(keep)
        if stream:
            sub = part.take_heads(state, stream)
            parts.append(rg.from_state(sub, P, sink=self.sink_tokens, recent=self.recent))
            heads.append(stream)
        if not stream:
            return parts[0]
        return part.partition(parts, heads)

    def _retrieval_part(self, state, scores, heads, P, layer, reserve) -> kv.State:
        """The retrieval heads' plain state: every row, or with ``compress`` SnapKV's."""
        sub = part.take_heads(state, heads)
        if self.compress:
            n_q = scores.shape[1] // state.keys.shape[1]
            qh = mx.array([h * n_q + r for h in heads for r in range(n_q)], mx.int32)
            return self._snapkv().compact_layer(sub, mx.take(scores, qh, axis=1), prompt_length=P,
                                                layer=layer, reserve=reserve)  # fmt: skip
        return kv.fitted(sub.replace(max_rows=P), P + reserve)

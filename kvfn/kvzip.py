"""KVzip (arXiv:2505.23416): keep the rows the model needs to repeat its context.

After the context is prefilled, the model is asked to repeat it: a short instruction, then the
context's own tokens, run in chunks over the prefilled states. A row's score is the most
attention it gets from any of those queries (and, per KV head, from any of its query heads).
States are immutable, so the pass's states are simply dropped: the scores need no question,
and one compaction serves every later one. The pass costs about one more prefill.
"""

from dataclasses import dataclass
from typing import ClassVar, Optional, Sequence

import mlx.core as mx
import numpy as np

from . import cache as kv
from . import tree
from .adakv import AdaKV
from .compact import with_room
from .policy import Policy, register_policy
from .snapkv import pool1d
from .wrapper import FunctionalModel, QuerySlice

REPEAT = "\n\nRepeat the previous context exactly."


def repeat_prompt(tokenizer, text: str = REPEAT) -> tuple[int, ...]:
    """The reconstruction instruction as token ids: ``text``, closed by the chat template's
    assistant turn when the tokenizer has one (the paper's prompt), else by a newline."""
    if getattr(tokenizer, "chat_template", None):
        marker = "\x00KVZIP\x00"
        turn = tokenizer.apply_chat_template([{"role": "user", "content": marker}],
                                             add_generation_prompt=True, tokenize=False)  # fmt: skip
        text += turn[turn.index(marker) + len(marker) :]
    else:
        text += "\n"
    return tuple(tokenizer.encode(text, add_special_tokens=False))


def reconstruction_scores(
    fmodel: FunctionalModel,
    tokens: mx.array,
    states: Sequence,
    *,
    prompt: Sequence[int] = (),
    chunk: int = 512,
) -> tuple:
    """Per layer, the most attention (B, n_heads, P) float32 each of the P rows of ``states``
    (freshly prefilled from ``tokens``, (B, P)) gets from any query of the reconstruction
    (``prompt`` then ``tokens``), run over them in steps of at most ``chunk`` queries; zeros for
    sliding-window layers. Each layer keeps a running maximum; at most (heads x 64 x rows)
    weights of one layer exist at once (``kvfn.scores.window_attention_max``), never a
    (heads x P x P) matrix. ``states`` are left as they were."""
    if not isinstance(tokens, mx.array) or tokens.ndim != 2 or tokens.shape[1] < 1:
        shape = tuple(tokens.shape) if isinstance(tokens, mx.array) else type(tokens).__name__
        raise ValueError(f"reconstruction takes tokens of shape (batch, n >= 1), got {shape}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    B, P = tokens.shape
    for s in states:
        if not isinstance(s, kv.State):
            raise TypeError(f"the reconstruction pass needs plain states, got {type(s).__name__}")
    rows = {s.max_rows if s.max_rows is not None else int(s.rows.item()) for s in states}
    if rows != {P}:
        raise ValueError(f"states must hold the {P} prefilled tokens' rows, got rows {rows}")
    head = mx.broadcast_to(mx.array(list(prompt), mx.int32)[None], (B, len(prompt)))
    recon = mx.concatenate([head, tokens.astype(mx.int32)], axis=1)
    n = recon.shape[1]
    best = None
    for start in range(0, n, chunk):
        part = recon[:, start : start + chunk]
        w = part.shape[1]
        # exactly the room this step needs: each query's rows span only the rows so far
        states = tuple(with_room(s, w) for s in states)
        zeros = tuple(mx.zeros((B, h, s.capacity), mx.float32)
                      for h, s in zip(fmodel.n_heads, states))  # fmt: skip
        query = QuerySlice(0, w, "max_attention")
        _, states, top = fmodel.scored_forward(part, states, zeros, query)
        top = tuple(t[..., :P] for t in top)
        best = top if best is None else tuple(map(mx.maximum, best, top))
        mx.eval(best, tree.arrays(states))
    return best


@register_policy
@dataclass(frozen=True)
class KVzip(Policy):
    """KVzip's selection from reconstruction scores: a KV head keeps the rows its query heads
    attended to most while repeating the context (``per_head``; ``kvzip-layer``: one row set per
    layer, the max over its heads), optionally max-pooled (``kvzip-k3``). ``prompt``: the
    instruction's token ids (``repeat_prompt(tokenizer)``; empty: the context is simply run
    again). ``chunk``: reconstruction queries per step (``kvzip-c256``)."""

    prompt: tuple = ()
    per_head: bool = True
    kernel_size: int = 1
    chunk: int = 512

    name: ClassVar[str] = "kvzip"
    needs_scores: ClassVar[bool] = True
    flags: ClassVar[dict] = {"layer": {"per_head": False}}
    numbers: ClassVar[dict] = {"k": "kernel_size", "c": "chunk"}

    @property
    def head_local(self) -> bool:
        return self.per_head

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.prompt, tuple) or not all(
            type(t) is int and t >= 0 for t in self.prompt
        ):
            raise ValueError(f"kvzip prompt must be a tuple of token ids, got {self.prompt!r}")
        if not isinstance(self.per_head, bool):
            raise ValueError(f"kvzip per_head must be a bool, got {self.per_head!r}")
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"kvzip kernel_size must be odd and >= 1, got {self.kernel_size}")
        if self.chunk < 1:
            raise ValueError(f"kvzip chunk must be >= 1, got {self.chunk}")

    def scoring(self) -> tuple:
        return (KVzip.score_prompt, self.prompt, self.chunk)  # kvzip-layer, adakvzip: one pass

    def for_tokenizer(self, tokenizer) -> "KVzip":
        """With the tokenizer's repeat instruction (``repeat_prompt``) unless one is set."""
        return self if self.prompt else self.replace(prompt=repeat_prompt(tokenizer))

    def observation_window(self, prompt_length: int) -> int:
        return 0  # the prefill scores nothing: ``score_prompt`` does

    def score_prompt(self, fmodel, tokens, states, gathered=None) -> Optional[tuple]:
        if self.keeps_whole(tokens.shape[1]):
            return None
        return reconstruction_scores(fmodel, tokens, states, prompt=self.prompt, chunk=self.chunk)

    def keep_indices(self, scores, *, prompt_length, **kwargs) -> mx.array:
        if scores is None and not self.keeps_whole(prompt_length):
            raise ValueError("kvzip needs reconstruction_scores (kvfn.compact runs the pass)")
        return super().keep_indices(scores, prompt_length=prompt_length, **kwargs)

    def row_scores(self, scores, *, prompt_length, n_kv_heads, batch, layer):
        B, n_heads, P = scores.shape
        grouped = scores.astype(mx.float32).reshape(B, n_kv_heads, n_heads // n_kv_heads, P)
        s = mx.max(grouped, axis=2)
        if not self.per_head:
            s = mx.max(s, axis=1, keepdims=True)
        return pool1d(s, self.kernel_size, "max")


@register_policy
@dataclass(frozen=True)
class AdaKVzip(KVzip, AdaKV):
    """KVzip's scores, a layer's ``budget x kv_heads`` rows allocated across its KV heads by
    score (Ada-KV's allocation, ``floor`` included): the paper's non-uniform head budgets,
    within a layer. Stores per-head groups and compacts eagerly, as ``AdaKV``."""

    across_layers: bool = False
    layer_budgets: tuple = ()

    name: ClassVar[str] = "adakvzip"
    flags: ClassVar[dict] = {"global": {"across_layers": True, "floor": 0}}
    numbers: ClassVar[dict] = {**KVzip.numbers, "f": "floor"}

    @property
    def head_local(self) -> bool:
        return False

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.across_layers, bool):
            raise ValueError(f"adakvzip across_layers must be a bool, got {self.across_layers!r}")
        floor = self.sink_tokens + self.window
        if not isinstance(self.layer_budgets, tuple) or any(
            type(b) is not int or b < floor for b in self.layer_budgets
        ):
            raise ValueError(
                f"adakvzip layer_budgets must be a tuple of ints >= {floor}, got "
                f"{self.layer_budgets!r}"
            )

    def planned(self, scores, *, prompt_length, n_kv_heads) -> "AdaKVzip":
        """``across_layers`` (``adakvzip-global``, the paper's pair level): every layer's
        (KV head, row) pairs ranked together, the best ``budget`` a head kept over all layers;
        each layer's budget is its share, then allocated among its heads (floor 0: by score)."""
        P, budgets = prompt_length, []
        if not self.across_layers or self.layer_budgets or self.keeps_whole(P):
            return self
        full = [i for i, h in enumerate(n_kv_heads) if h is not None]
        ranked = [self._forced_scores(scores[i][..., :P], n_kv_heads[i], i) for i in full]
        flat = np.concatenate([r.ravel() for r in ranked])
        keep = self.budget * sum(n_kv_heads[i] for i in full)
        threshold = np.partition(flat, flat.size - keep)[flat.size - keep]
        floor = self.sink_tokens + self.window
        by_layer = dict(zip(full, ranked))
        for i, h in enumerate(n_kv_heads):
            kept = int((by_layer[i] >= threshold).sum()) if i in by_layer else 0
            budgets.append(min(P, max(floor, -(-kept // h)) if h else floor))
        return self.replace(layer_budgets=tuple(budgets))

    def _forced_scores(self, scores, n_kv_heads: int, layer: int) -> np.ndarray:
        s = self.row_scores(scores, prompt_length=scores.shape[-1], n_kv_heads=n_kv_heads,
                            batch=scores.shape[0], layer=layer)  # fmt: skip
        s = np.array(mx.broadcast_to(s, (*s.shape[:1], n_kv_heads, s.shape[-1])))[0]
        pos = np.arange(s.shape[-1])
        forced = (pos < self.sink_tokens) | (pos >= s.shape[-1] - self.window)
        return np.where(forced, np.inf, np.nan_to_num(s, nan=-np.inf))

    def for_layer(self, layer: int, n_layers: int) -> "AdaKVzip":
        if not self.layer_budgets:
            return self
        return self.replace(budget=self.layer_budgets[layer], across_layers=False,
                            layer_budgets=())  # fmt: skip

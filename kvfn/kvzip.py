"""KVzip (arXiv:2505.23416): keep the rows the model needs to repeat its context.

After the context (P prefilled rows) the model is asked to repeat it, chunk by chunk, as the
published KVzip does: chunk i of the context, rows [start, end), is run after an instruction
(the first: "Repeat the previous context exactly." and the chat template's assistant turn; a
later one: "Repeat the part of the previous context exactly, starting with", the previous
chunk's last ``overlap`` tokens, then the assistant turn) over the prefilled states, and its
rows are dropped again: every chunk sees the P context rows, never an earlier chunk's. A row of
[start, end) scores the most weight any query of its chunk's input gives it in a softmax over
the first sinks, the chunk's own context rows and the input's own rows (causally): each row is
scored by its own chunk only. States are immutable: the pass leaves them as they were, so the
scores need no question and one compaction serves every later one. The pass costs about one
more prefill (each query sees about P keys in the model's own attention).
"""

from dataclasses import dataclass
from typing import ClassVar, Optional, Sequence

import mlx.core as mx
import numpy as np

from . import cache as kv
from . import ragged
from .adakv import AdaKV
from .compact import _drain, chunks, with_room
from .policy import Policy, register_policy
from .snapkv import pool1d
from .wrapper import FunctionalModel, QuerySlice

REPEAT = "\n\nRepeat the previous context exactly."
RESUME = "\n\nRepeat the part of the previous context exactly, starting with"
_MARKER = "\x00KVZIP\x00"


def assistant_suffix(tokenizer) -> str:
    """What the chat template puts after a user turn's text to open the assistant's turn; a
    newline without a template."""
    if not getattr(tokenizer, "chat_template", None):
        return "\n"
    turn = tokenizer.apply_chat_template([{"role": "user", "content": _MARKER}],
                                         add_generation_prompt=True, tokenize=False)  # fmt: skip
    return turn[turn.index(_MARKER) + len(_MARKER) :]


def repeat_prompt(tokenizer, text: str = REPEAT) -> tuple[int, ...]:
    """The reconstruction instruction as token ids: ``text``, closed by the chat template's
    assistant turn when the tokenizer has one (the paper's prompt), else by a newline."""
    return tuple(tokenizer.encode(text + assistant_suffix(tokenizer), add_special_tokens=False))


def resume_prompt(tokenizer, text: str = RESUME) -> tuple[int, ...]:
    """The later chunks' instruction as token ids (the previous chunk's last tokens and
    ``suffix_prompt`` follow it)."""
    return tuple(tokenizer.encode(text, add_special_tokens=False))


def suffix_prompt(tokenizer) -> tuple[int, ...]:
    """The assistant turn's opening alone, as token ids."""
    return tuple(tokenizer.encode(assistant_suffix(tokenizer), add_special_tokens=False))


def _token_ids(name: str, ids) -> tuple:
    if not isinstance(ids, (tuple, list)) or not all(type(t) is int and t >= 0 for t in ids):
        raise ValueError(f"{name} must be a sequence of token ids (ints >= 0), got {ids!r}")
    return tuple(ids)


def reconstruction_steps(
    fmodel: FunctionalModel,
    tokens: mx.array,
    states: Sequence,
    *,
    prompt: Sequence[int] = (),
    resume: Sequence[int] = (),
    suffix: Sequence[int] = (),
    chunk: int = 2048,
    overlap: int = 8,
    sink: int = 4,
):
    """``reconstruction_scores`` as a generator: it yields ``(done, total)`` context rows after
    each chunk (evaluated) and returns the scores as its StopIteration value, so a caller can
    interleave other work between chunks. The arguments are checked when it is called."""
    if not isinstance(tokens, mx.array) or tokens.ndim != 2 or tokens.shape[1] < 1:
        shape = tuple(tokens.shape) if isinstance(tokens, mx.array) else type(tokens).__name__
        raise ValueError(f"reconstruction takes tokens of shape (batch, n >= 1), got {shape}")
    for name, value, least in (("chunk", chunk, 1), ("overlap", overlap, 0), ("sink", sink, 0)):
        if type(value) is not int or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    heads = [_token_ids(n, v) for n, v in (("prompt", prompt), ("resume", resume),
                                           ("suffix", suffix))]  # fmt: skip
    B, P = tokens.shape
    for s in states:
        if not isinstance(s, kv.State):
            raise TypeError(f"the reconstruction pass needs plain states, got {type(s).__name__}")
    rows = {s.max_rows if s.max_rows is not None else int(s.rows.item()) for s in states}
    if rows != {P}:
        raise ValueError(f"states must hold the {P} prefilled tokens' rows, got rows {rows}")
    if not all(s.dense for s in states):
        raise ValueError("the reconstruction pass needs the dense states of a plain prefill")
    return _steps(fmodel, tokens.astype(mx.int32), tuple(states), *heads, chunk, overlap, sink)


def _steps(fmodel, tokens, states, prompt, resume, suffix, chunk, overlap, sink):
    B, P = tokens.shape
    parts = chunks(P, chunk)
    done = [[] for _ in states]
    for start, end in parts:
        if start == 0:
            head = _ids(prompt, B)
        else:
            tail = tokens[:, max(start - overlap, 0) : start]
            head = mx.concatenate([_ids(resume, B), tail, _ids(suffix, B)], axis=1)
        inputs = mx.concatenate([head, tokens[:, start:end]], axis=1)
        n = inputs.shape[1]
        query = QuerySlice(0, n, "reconstruction", (sink, start, end, P))
        zeros = tuple(mx.zeros((B, h, end - start), mx.float32) for h in fmodel.n_heads)
        # each chunk runs over its own copy of the states with room for its n rows, made and
        # freed layer by layer: the caller's states stay as they were and no second copy of
        # every layer is ever held (the states and their logits are dropped at once)
        scores = fmodel.scored_forward(inputs, tuple(with_room(s, n) for s in states), zeros,
                                       query)[2]  # fmt: skip
        mx.eval(scores)
        for kept, s in zip(done, scores):
            kept.append(s)
        del scores
        yield end, P
    return tuple(mx.concatenate(kept, axis=-1) if len(kept) > 1 else kept[0] for kept in done)


def _ids(ids: tuple, batch: int) -> mx.array:
    return mx.broadcast_to(mx.array(list(ids), mx.int32).reshape(1, -1), (batch, len(ids)))


def reconstruction_scores(
    fmodel: FunctionalModel,
    tokens: mx.array,
    states: Sequence,
    *,
    prompt: Sequence[int] = (),
    resume: Sequence[int] = (),
    suffix: Sequence[int] = (),
    chunk: int = 2048,
    overlap: int = 8,
    sink: int = 4,
) -> tuple:
    """KVzip's scores of the P rows of ``states`` (the dense states of a plain prefill of
    ``tokens``, (B, P)): per layer (B, n_heads, P) float32, zeros for sliding-window layers.
    The context is cut into chunks of ``chunk`` tokens; chunk [start, end) runs after its head
    (``prompt`` for the first; for a later one ``resume``, the previous ``overlap`` context
    tokens, then ``suffix``) over the prefilled states, and each of its rows scores the most
    weight any query of that input gives it in a softmax over rows [0, min(sink, start)),
    [start, end) and the input's own (causally; ``kvfn.scores.reconstruction_attention``).
    Without a tokenizer's ids the head is just the overlap (nothing for the first chunk).
    ``states`` are left as they were."""
    steps = reconstruction_steps(fmodel, tokens, states, prompt=prompt, resume=resume,
                                 suffix=suffix, chunk=chunk, overlap=overlap, sink=sink)  # fmt: skip
    return _drain(steps, None)


@register_policy
@dataclass(frozen=True)
class KVzip(Policy):
    """KVzip's selection from reconstruction scores: a KV head keeps the rows its query heads
    attended to most while repeating the context (``per_head``; ``kvzip-layer``: one row set per
    layer, the max over its heads), optionally max-pooled (``kvzip-k3``). ``prompt``,
    ``resume``, ``suffix``: the first chunk's instruction, a later chunk's, and the assistant
    turn's opening, as token ids (``for_tokenizer`` sets them; empty: the context is simply run
    again). ``chunk``: context tokens a step (``kvzip-c1024``); ``overlap``: the previous
    chunk's tokens a later chunk's instruction quotes. ``sink_tokens`` are also the sinks every
    reconstruction query sees."""

    prompt: tuple = ()
    per_head: bool = True
    kernel_size: int = 1
    chunk: int = 2048
    resume: tuple = ()
    suffix: tuple = ()
    overlap: int = 8

    name: ClassVar[str] = "kvzip"
    needs_scores: ClassVar[bool] = True
    flags: ClassVar[dict] = {"layer": {"per_head": False}}
    numbers: ClassVar[dict] = {"k": "kernel_size", "c": "chunk"}

    @property
    def head_local(self) -> bool:
        return self.per_head

    def validate(self) -> None:
        super().validate()
        for name in ("prompt", "resume", "suffix"):
            ids = getattr(self, name)
            if not isinstance(ids, tuple) or not all(type(t) is int and t >= 0 for t in ids):
                raise ValueError(f"kvzip {name} must be a tuple of token ids, got {ids!r}")
        if not isinstance(self.per_head, bool):
            raise ValueError(f"kvzip per_head must be a bool, got {self.per_head!r}")
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"kvzip kernel_size must be odd and >= 1, got {self.kernel_size}")
        if self.chunk < 1:
            raise ValueError(f"kvzip chunk must be >= 1, got {self.chunk}")

    def scoring(self) -> tuple:
        # kvzip-layer, adakvzip: one pass when these agree
        return (KVzip.score_steps, self.prompt, self.resume, self.suffix, self.chunk,
                self.overlap, self.sink_tokens)  # fmt: skip

    def for_tokenizer(self, tokenizer) -> "KVzip":
        """With the tokenizer's instructions and assistant turn (``repeat_prompt``,
        ``resume_prompt``, ``suffix_prompt``) unless any is set."""
        if self.prompt or self.resume or self.suffix:
            return self
        return self.replace(prompt=repeat_prompt(tokenizer), resume=resume_prompt(tokenizer),
                            suffix=suffix_prompt(tokenizer))  # fmt: skip

    def observation_window(self, prompt_length: int) -> int:
        return 0  # the prefill scores nothing: ``score_steps`` does

    def score_steps(self, fmodel, tokens, states, gathered=None):
        """The reconstruction pass (``reconstruction_steps``), a chunk a step; None without
        steps when the prompt is kept whole."""
        if self.keeps_whole(tokens.shape[1]):
            return None
        steps = reconstruction_steps(fmodel, tokens, states, prompt=self.prompt,
                                     resume=self.resume, suffix=self.suffix, chunk=self.chunk,
                                     overlap=self.overlap, sink=self.sink_tokens)  # fmt: skip
        return (yield from steps)

    def score_prompt(self, fmodel, tokens, states, gathered=None) -> Optional[tuple]:
        return _drain(self.score_steps(fmodel, tokens, states, gathered), None)

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
    within a layer; ragged rows (``kvfn.RaggedKVCache``), traced as ``AdaKV``'s.
    ``across_layers`` (``adakvzip-global``): the paper's pair-level selection across layers,
    planned on the host (``planned`` sets ``layer_budgets``, each layer's rows a head, and
    ``layer_totals``, the rows each sequence keeps in each layer)."""

    across_layers: bool = False
    layer_budgets: tuple = ()
    layer_totals: tuple = ()
    totals: tuple = ()  # one layer's: the rows each sequence keeps in it (``for_layer``)

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
        for name, rows in (("totals", self.totals), *(("layer_totals", t) for t in
                                                       self.layer_totals)):  # fmt: skip
            if not isinstance(rows, tuple) or any(type(r) is not int or r < 0 for r in rows):
                raise ValueError(f"adakvzip {name} must be tuples of ints >= 0, got {rows!r}")

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
            ranked = [self._forced_scores(scores[i][b : b + 1, :, :P], n_kv_heads[i], i)
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
                            layer_budgets=(), layer_totals=(),
                            totals=self.layer_totals[layer] if self.layer_totals else ())  # fmt: skip

    def compact_layer(self, state, scores, *, prompt_length: int, layer: int, reserve: int,
                      group=None):  # fmt: skip
        """With ``totals`` (a layer of a plan across layers), each sequence keeps its own
        number of rows, ragged, even where the layer's budget reaches the prompt."""
        if not self.totals:
            return super().compact_layer(state, scores, prompt_length=prompt_length,
                                         layer=layer, reserve=reserve, group=group)  # fmt: skip
        B, H = state.keys.shape[:2]
        if len(self.totals) != B:
            raise ValueError(f"a plan for {len(self.totals)} sequences applied to {B}")
        keep = self.keep_mask(scores, prompt_length=prompt_length, n_kv_heads=H, batch=B,
                              layer=layer, totals=self.totals)  # fmt: skip
        return ragged.pack(state, keep, capacity=self.budget * H, room=reserve)

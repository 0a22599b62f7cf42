"""Accuracy of eviction methods at equal KV memory, on RULER-style samples.

Per sample, the context is prefilled once (in chunks, eagerly) into immutable states; every
method and question starts from those states, so reuse is exact and free:

* query-agnostic: the context's last ``window`` tokens are scored, the context is compacted once
  per method, and every question is asked on that one compacted state;
* query-aware: per question, the window is the question's end (scores over context + question),
  and the prompt is compacted before the answer's first token.

Answers are decoded greedily. A cell that keeps every row, or is quantized, is decoded by the
unmodified mlx-lm model over mlx-lm cache objects built from the states
(``kvfn.serving.interop``), so the full cache is exactly mlx-lm's computation and KV quantization
mlx-lm's own ``mx.quantize`` + quantized attention; an evicted cell by kvfn's decode step, its
states stacked with other cells' (``Evaluator.answers``).
"""

import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable, Iterable, Optional, Sequence, Union

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step

import kvfn
from kvfn.passes import with_room
from kvfn.serving.interop import to_mlx_cache

from . import answers
from .memory import peak_gib
from .tasks import Question, Sample

MODES = ("aware", "agnostic")
ANSWER_TOKENS = {  # enough for a right answer; a wrong one is cut short
    "passkey": 12,
    "niah_single": 12,
    "niah_multikey": 12,
    "niah_multivalue": 48,
    "niah_multiquery": 48,
    "variable_tracking": 32,
    "common_words": 64,
}
KV_BITS = (2, 3, 4, 6, 8)


@dataclass(frozen=True)
class Method:
    """An eviction policy by name (``kvfn.parse_policy``: "snapkv", "snapkv-k15-layer",
    "streaming", any registered policy; None keeps every row) and/or mlx-lm KV quantization."""

    policy: Optional[str] = None
    kv_bits: Optional[int] = None

    @property
    def name(self) -> str:
        parts = [self.policy] if self.policy else []
        parts += [f"kv{self.kv_bits}"] if self.kv_bits else []
        return "+".join(parts) or "full"

    def make_policy(self, budget: int, **settings) -> kvfn.policies.BasePolicy:
        return kvfn.parse_policy(self.policy, budget=budget, **settings)

    @classmethod
    def parse(cls, name: str) -> "Method":
        """'full', 'kvB', a policy name, or 'POLICY+kvB' (B in 2, 3, 4, 6, 8)."""
        if name == "full":
            return cls()
        policy, bits = None, None
        try:
            for part in name.split("+"):
                if part.startswith("kv") and part[2:].isdigit() and bits is None:
                    bits = int(part[2:])
                    if bits not in KV_BITS:
                        raise ValueError(f"KV bits must be one of {KV_BITS}, got {bits}")
                elif policy is None and part:
                    kvfn.parse_policy(part, budget=1 << 30)  # names a bad policy or option
                    policy = part
                else:
                    raise ValueError("use full, kvB, POLICY or POLICY+kvB")
        except ValueError as e:
            raise ValueError(f"unknown method {name!r}: {e}") from None
        return cls(policy, bits)


def quantized_row_fraction(head_dim: int, itemsize: int, bits: int, group_size: int = 64) -> float:
    """Bytes of a quantized K/V row over the bytes of the row at ``itemsize``: packed values
    plus one scale and one bias (at ``itemsize``) per group."""
    return (head_dim * bits / 8 + 2 * itemsize * head_dim / group_size) / (head_dim * itemsize)


def rows_for(method: Method, budget: Optional[int], head_dim: int, itemsize: int) -> Optional[int]:
    """Rows an evicting method keeps so its KV bytes match ``budget`` full-precision rows."""
    if method.policy is None or budget is None:
        return None
    if method.kv_bits is None:
        return budget
    return int(budget / quantized_row_fraction(head_dim, itemsize, method.kv_bits))


@dataclass(frozen=True)
class Prompt:
    """A question's prompt as token ids: the shared context head, then the question tail; and
    the head's token indices of each needle (empty when the tokenizer gives no offsets)."""

    head: list[int]
    tail: list[int]
    needles: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class Cell:
    """One method at one budget on one call's states (a mode, and in query-aware mode a
    question): its rows, whether it evicted, the needle rows it kept (over all full-attention
    layers and KV heads, and each such layer's share), its own scoring pass's seconds, its KV
    bytes, and whether mlx-lm decodes it (it keeps every row, or is quantized)."""

    method: Method
    budget: Optional[Union[int, float]]
    rows: Optional[int]
    evicted: bool
    kept: Optional[float]
    kept_layers: Optional[tuple]
    seconds: float
    nbytes: int
    by_mlx: bool


def _needle_tokens(tokenizer, text: str, start: int, spans, special: bool) -> tuple:
    """Token indices of ``text`` overlapping each character span (shifted by ``start``)."""
    if not spans:
        return ()
    fast = getattr(tokenizer, "_tokenizer", None)
    try:
        offsets = fast(text, return_offsets_mapping=True, add_special_tokens=special)
    except (TypeError, NotImplementedError):
        return ()
    pairs = offsets["offset_mapping"]
    return tuple(
        tuple(i for i, (a, b) in enumerate(pairs) if a < start + stop and b > start + begin)
        for begin, stop in spans
    )


def prompt_texts(tokenizer, sample: Sample, question: Question) -> tuple[str, str]:
    """The prompt of ``question`` as text, cut where the question starts: (head, tail). Chat
    template when the tokenizer has one (else plain text), answer prefix after it."""
    body = sample.instruction + sample.context
    ask = "\n\n" + question.text
    if not getattr(tokenizer, "chat_template", None):
        return body, ask + "\n" + question.answer_prefix
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": body + ask}], add_generation_prompt=True, tokenize=False
    )
    cut = text.rindex(ask)
    return text[:cut], text[cut:] + question.answer_prefix


def prompt_tokens(tokenizer, sample: Sample, question: Question) -> Prompt:
    """``prompt_texts`` tokenized. The head ends where the question starts, so every question
    shares the context's tokens."""
    templated = bool(getattr(tokenizer, "chat_template", None))
    head_text, tail_text = prompt_texts(tokenizer, sample, question)
    head = tokenizer.encode(head_text, add_special_tokens=not templated)
    start = head_text.rindex(sample.instruction + sample.context) + len(sample.instruction)
    needles = _needle_tokens(tokenizer, head_text, start, sample.needles, not templated)
    return Prompt(head, tokenizer.encode(tail_text, add_special_tokens=False), needles)


def token_counter(tokenizer) -> Callable[[Sample], int]:
    """``count_tokens`` for ``kvfn_eval.tasks.generate``: a sample's longest prompt. The head
    (instruction and context) is every question's, and a tail (the question, the template's
    end, the answer prefix) does not depend on the context, so each is tokenized once."""

    def count(sample: Sample) -> int:
        bare = replace(sample, needles=())
        head = prompt_tokens(tokenizer, bare, sample.questions[0]).head
        no_context = replace(bare, context="")
        tails = (prompt_tokens(tokenizer, no_context, q).tail for q in sample.questions)
        return len(head) + max(map(len, tails))

    return count


def greedy(model, prompt: list[int], caches: list, max_tokens: int, eos: set) -> list[int]:
    if len(prompt) > 1 and any(hasattr(c, "bits") for c in caches):
        # MLX's CUDA backend has no quantized attention for several queries at once: feed the
        # prompt one token at a time (the same computation as a chunk, row by row)
        for t in prompt[:-1]:
            model(mx.array([[t]]), cache=caches)
        prompt = prompt[-1:]
    out = []
    for token, _ in generate_step(mx.array(prompt), model, prompt_cache=caches,
                                  max_tokens=max_tokens):  # fmt: skip
        token = int(token)
        if token in eos:
            break
        out.append(token)
    return out


def head_arrays(state) -> list:
    """The arrays ``head_positions`` reads of a layer state: evaluated together, for many
    states at once, they cost one wait for the device, not one a read (a Duo ring derives its
    positions from its offset: one small evaluation a ring)."""
    if isinstance(state, kvfn.RaggedKVCache):
        return [state.positions, state.starts, state.lengths]
    out = []
    for g in getattr(state, "parts", (state,)):
        out += [g.positions, g.rows] if hasattr(g, "rows") else [g.offset, g.since]
    return out


def head_positions(state) -> list:
    """The kept positions of each KV head of the first sequence (any layer state): its stored
    rows' (a plain state's slots past ``rows`` are free)."""
    if isinstance(state, kvfn.RaggedKVCache):
        positions, starts, lengths = (np.array(a[0]) for a in head_arrays(state))
        return [positions[a : a + n] for a, n in zip(starts.tolist(), lengths.tolist())]
    out = []
    for g in getattr(state, "parts", (state,)):
        rows = int(g.rows.item()) if hasattr(g, "rows") else g.positions.shape[-1]
        out += [p[p != kvfn.EMPTY] for p in np.array(g.positions)[0][:, :rows]]
    return out


def needle_fractions(states: Sequence, tokens) -> list[list[float]]:
    """Per full-attention layer, per KV head: the fraction of ``tokens`` (prompt positions)
    among its kept rows."""
    return [
        [float(np.isin(tokens, positions).mean()) for positions in head_positions(s)]
        for s in states
        if s.sliding_window is None
    ]


def decode(fm, first: Callable, max_tokens: int, eos: set) -> list[list[int]]:
    """Greedy continuations, one a sequence of a batch, by kvfn's eager steps. ``first()``
    gives the logits (B, vocab) at the prompts' ends and the states after them; it makes them,
    so that no caller's frame holds the states (a held buffer is copied, not written in place,
    and stays in memory). A step is queued before the last step's tokens are read, as mlx-lm's
    generate loop does."""
    logits, states = first()
    tokens = mx.argmax(logits, axis=-1).astype(mx.int32)
    mx.async_eval(tokens)
    out: list[list[int]] = [[] for _ in range(tokens.shape[0])]
    live = [True] * len(out)
    for step in range(max_tokens):
        following = None
        if step + 1 < max_tokens:
            logits, states = fm.forward(tokens[:, None], states, check_ids=False)  # its own ids
            following = mx.argmax(logits[:, -1], axis=-1).astype(mx.int32)
            mx.async_eval(following)
        for b, token in enumerate(tokens.tolist()):
            if live[b] and token in eos:
                live[b] = False
            elif live[b]:
                out[b].append(token)
        if not any(live):
            break
        tokens = following
    return out


def kvfn_greedy(fm, prompt: list[int], states, max_tokens: int, eos: set,
                batch: int = 1) -> list[list[int]]:  # fmt: skip
    """Greedy answers decoded by kvfn itself (``decode``), one a sequence of the ``batch`` that
    ``states`` hold (for states mlx-lm cannot hold, and for many methods' states at once);
    every sequence is given the same ``prompt``."""

    def first():
        logits, after = fm.forward(mx.array([prompt] * batch), states)
        return logits[:, -1], after

    return decode(fm, first, max_tokens, eos)


def batch_key(states) -> Optional[tuple]:
    """What a cell's layer states must share with another's to decode in one batch: per layer,
    the kind and its shape (a partitioned layer's head groups and ring sizes); None for states
    of a kind that does not stack (``kvfn.tree.stackable``)."""
    key = []
    for s in states:
        if not kvfn.tree.stackable(s):
            return None
        shape = s.sliding_window
        if isinstance(s, kvfn.HeadPartitionedKVCache):
            sizes = tuple((type(g), getattr(g, "sink", None), getattr(g, "recent", None))
                          for g in s.parts)  # fmt: skip
            shape = (s.heads, sizes)
        key.append((type(s), shape))
    return tuple(key)


def fitted(state, room: int):
    """``state`` with room for ``room`` more rows (a partitioned state: its plain groups), so
    that decoding does not grow it."""
    if isinstance(state, kvfn.RaggedKVCache):
        return kvfn.ragged.reserve(state, room)
    if isinstance(state, kvfn.HeadPartitionedKVCache):
        return state.replace(parts=tuple(with_room(g, room) for g in state.parts))
    return with_room(state, room)


def kv_bytes(caches: Sequence, with_positions: bool) -> int:
    total = 0
    for c in caches:
        total += c.nbytes if with_positions else c.kv_nbytes
    return int(total)


class Evaluator:
    """Runs methods over samples for one model; ``run`` yields one record per answer."""

    def __init__(self, model, tokenizer, *, window: int = 32, sink_tokens: int = 4,
                 prefill_step_size: int = 512, dtype: Optional[mx.Dtype] = None, seed: int = 0,
                 compiled: bool = False, head_pattern: Optional[kvfn.HeadPattern] = None,
                 batch: int = 8):  # fmt: skip
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        self.model, self.tokenizer, self.batch = model, tokenizer, batch
        self.head_pattern = head_pattern
        self.fm = kvfn.FunctionalModel(model)
        self.window, self.sink_tokens, self.seed = window, sink_tokens, seed
        self.prefill_step_size, self.dtype = prefill_step_size, dtype or self.fm.dtype
        # every sample and question has its own shapes: compiled steps would retrace each time
        self.compiled = compiled
        self.eos = set(tokenizer.eos_token_ids) | {tokenizer.eos_token_id}
        self.head_dim = self.fm.init_states(1, 1, self.dtype)[0].keys.shape[-1]
        self.itemsize = mx.zeros((), self.dtype).itemsize

    # -- selection ------------------------------------------------------------------------------
    def policy(self, method: Method, rows: int, sample_seed: int) -> kvfn.policies.BasePolicy:
        settings = dict(window=self.window, sink_tokens=self.sink_tokens)
        probe = method.make_policy(rows, **settings)
        fields = probe.settings()
        if "seed" in fields:  # e.g. random rows: per sample
            probe = probe.replace(seed=self.seed * 1_000_003 + sample_seed)
        if "pattern" in fields:  # DuoAttention: the head pattern's heads, sink and recent sizes
            if self.head_pattern is None:
                raise ValueError(f"method {method.name!r} needs a head pattern (--head-pattern)")
            p = self.head_pattern
            probe = probe.replace(pattern=p, sink_tokens=p.sink_size, recent=p.recent_size)
            if probe.compress:  # equal rows a head: streaming heads fill the budget with recent
                probe = probe.replace(recent=max(1, rows - p.sink_size))
        return probe.for_tokenizer(self.tokenizer)  # KVzip: the repeat instruction

    def own_scores(self, policy: kvfn.policies.BasePolicy, tokens: Sequence[int], states, memo: dict,
                   moments=None) -> tuple:  # fmt: skip
        """A policy's own scores of ``states`` of the prompt ``tokens`` (KVzip's reconstruction
        pass; Expected Attention's, from the context's query ``moments``; None for the others)
        and their seconds, once per state and ``policy.scoring()`` (``memo``: kvzip,
        kvzip-layer and adakvzip share one pass; no budget changes it)."""
        key = policy.scoring()
        if key not in memo:
            t0 = time.perf_counter()
            gathered = moments if policy.statistic == "moments" else None
            own = policy.score_prompt(self.fm, mx.array([tokens]), states, gathered)
            mx.eval(own or ())
            memo[key] = own, 0.0 if own is None else time.perf_counter() - t0
        return memo[key]

    def compact(self, states, scores, method: Method, rows: Optional[int], sample_seed: int,
                tokens=(), memo=None, moments=None):  # fmt: skip
        """States after ``method``'s eviction to ``rows`` rows (unchanged when it keeps them
        all; the K/V gathers left lazy), whether it evicted, and the seconds of the policy's
        own scoring pass over the prompt ``tokens`` (0 without one)."""
        P = states[0].max_rows
        if method.policy is None or rows is None or rows >= P:
            return states, False, 0.0
        policy = self.policy(method, rows, sample_seed)
        own, seconds = self.own_scores(policy, tokens, states, {} if memo is None else memo,
                                       moments)  # fmt: skip
        states, _ = kvfn.compact_states(states, scores if own is None else own, policy,
                                        compiled=self.compiled)  # fmt: skip
        return states, True, seconds

    @staticmethod
    def caches(states, method: Method, evicted: bool) -> tuple[list, int]:
        """Fresh mlx-lm caches over ``states`` (quantized if the method says so), and their KV
        bytes (with the positions that an evicted cache must keep)."""
        caches = to_mlx_cache(states)
        if method.kv_bits is not None:
            caches = [c.to_quantized(group_size=64, bits=method.kv_bits) for c in caches]
        return caches, kv_bytes(caches, with_positions=evicted)

    @staticmethod
    def gathers_moments(methods: Sequence[Method]) -> bool:
        """Whether a method's policy scores from query moments: the shared prefill of the
        context (all but its last ``window`` tokens) then gathers them, once for all (in
        query-aware mode the question's queries are not among them; ``kvfn.compact``'s are)."""
        return any(m.policy and m.make_policy(1 << 30).statistic == "moments" for m in methods)

    def rows(self, budget, prompt_rows: int) -> Optional[int]:
        """A budget in rows: itself, or a fraction (< 1) of the prompt's rows."""
        if budget is None or budget >= 1:
            return budget
        return max(self.window + self.sink_tokens, round(budget * prompt_rows))

    def cell(self, method: Method, budget, rows: Optional[int], states, evicted: bool,
             kept: Optional[float], kept_layers: Optional[tuple],
             seconds: float) -> Cell:  # fmt: skip
        """A compacted cell's record: its KV bytes (with the positions that an evicted cache
        must keep: the kept rows' bytes, known on the host) and the decoder it takes."""
        plain = all(isinstance(s, kvfn.PositionPreservingKVCache) for s in states)
        if method.kv_bits is not None and not plain:
            raise ValueError(f"{method.name}: per-head states are not quantized")
        by_mlx = plain and (not evicted or method.kv_bits is not None)
        bounded = not plain or all(s.max_rows is not None for s in states)
        if by_mlx or not bounded:
            nbytes = self.caches(states, method, evicted)[1]
        else:
            nbytes = self.kept_bytes(states)
        return Cell(method, budget, rows, evicted, kept, kept_layers, seconds, nbytes, by_mlx)

    def answers(self, cells: Sequence[Cell], held: list, asks: Sequence[tuple],
                n_new: int) -> tuple[list, int]:  # fmt: skip
        """The greedy answers to ``asks``, (cell, question tail) pairs: cell c's states are
        ``held[c]``; and the decode loops they took. mlx-lm decodes a cell that keeps every row
        or is quantized, a question at a time (fresh caches each: its decode appends to them).
        kvfn decodes the others, up to ``self.batch`` questions at once among cells whose states
        stack (``batch_key``, ``kvfn.tree.stack``: each its own rows, the same computation as one at a time), in
        order of rows, so that a batch pads little. ``held[c]`` is dropped once the batch of
        c's last question is formed: a batch's rows are freed when it is answered."""
        groups: list = []
        batched: dict = {}
        for a, (c, _) in enumerate(asks):
            key = None if cells[c].by_mlx else batch_key(held[c])
            if key is None:  # alone
                groups.append([a])
            else:
                batched.setdefault(key, []).append(a)
        for members in batched.values():
            members.sort(key=lambda a: (cells[asks[a][0]].rows or 0, asks[a][0]))
            for start in range(0, len(members), self.batch):  # a batch's questions by length
                groups.append(sorted(members[start : start + self.batch],
                                     key=lambda a: len(asks[a][1])))  # fmt: skip
        last = {asks[a][0]: g for g, members in enumerate(groups) for a in members}
        out: list = [None] * len(asks)
        for g, members in enumerate(groups):
            pairs = [(held[asks[a][0]], asks[a][1]) for a in members]
            for c in {asks[a][0] for a in members}:
                if last[c] == g:
                    held[c] = None
            cell = cells[asks[members[0]][0]]
            if cell.by_mlx:
                states, tail = pairs.pop()
                caches = self.caches(states, cell.method, cell.evicted)[0]
                del states
                got = [greedy(self.model, tail, caches, n_new, self.eos)]
                del caches  # grown by the decode: not to be held through the next batches
            else:
                got = decode(self.fm, partial(self.prompted, pairs, n_new), n_new, self.eos)
            for a, answer in zip(members, got):
                out[a] = answer
        return out, len(groups)

    def prompted(self, pairs: list, n_new: int) -> tuple:
        """From ``pairs`` of (a cell's states, a question tail), sorted by tail length: the
        logits (B, vocab) at each question's end and the batch's states after it, in the order
        of ``pairs``, which is emptied (see ``decode``). Each state gets the room the batch's
        longest question and the answer take; tails of one length run as one chunk over their
        states stacked, then the chunks' states stack."""
        taken = list(pairs)
        pairs.clear()
        lengths = [len(tail) for _, tail in taken]
        if lengths != sorted(lengths):  # the chunks are stacked in the order of their lengths
            raise ValueError(f"a batch's questions must come sorted by length, got {lengths}")
        room = max(lengths) + n_new
        room_made = {}
        for states, _ in taken:  # a cell asked two questions is made room for once
            if id(states) not in room_made:
                room_made[id(states)] = [fitted(s, room) for s in states]
        chunks = {}
        for states, tail in taken:
            chunks.setdefault(len(tail), []).append((room_made[id(states)], tail))
        del taken, room_made
        parts = []
        for members in chunks.values():
            layers = [kvfn.tree.stack(list(layer)) for layer in zip(*(s for s, _ in members))]
            logits, after = self.fm.forward(mx.array([tail for _, tail in members]), layers)
            parts.append((logits[:, -1], after))
        del chunks, members, layers
        if len(parts) == 1:
            return parts[0]
        logits = mx.concatenate([p[0] for p in parts])
        return logits, [kvfn.tree.stack(list(layer)) for layer in zip(*(p[1] for p in parts))]

    @staticmethod
    def kept_bytes(states) -> int:
        """The bytes a per-head state's kept rows hold (with their positions)."""
        return sum(kvfn.eviction.kept(s)[1] for s in states)

    # -- one sample -------------------------------------------------------------------------------
    def run(self, sample: Sample, methods: Sequence[Method], budgets: Sequence[Union[int, float]],
            modes: Iterable[str] = MODES, max_new_tokens: Optional[int] = None) -> list[dict]:  # fmt: skip
        prompts = [prompt_tokens(self.tokenizer, sample, q) for q in sample.questions]
        head = prompts[0].head
        if any(p.head != head for p in prompts):
            raise RuntimeError("questions of one sample must share the context's tokens")
        w = min(self.window, len(head) - 1)
        capacity = len(head) + max(len(p.tail) for p in prompts)
        opts = dict(dtype=self.dtype, prefill_step_size=self.prefill_step_size,
                    compiled=self.compiled)  # fmt: skip
        t0 = time.perf_counter()
        context, moments = mx.array([head[:-w]]), None
        n = context.shape[1] - self.sink_tokens  # the queries after the sinks
        if n >= 1 and self.gathers_moments(methods):  # Expected Attention's query statistics
            start, moments = kvfn.scored_prefill(self.fm, context, window=n, capacity=capacity,
                                                 statistic="moments", **opts)  # fmt: skip
        else:
            start = kvfn.prefill(self.fm, context, capacity=capacity, **opts)
        mx.eval(kvfn.tree.arrays(start), moments)
        prefill_seconds = time.perf_counter() - t0  # the context's, shared by every method
        prefill_peak = peak_gib()
        n_new = max_new_tokens or ANSWER_TOKENS.get(sample.task, 32)
        cells: list[Cell] = []
        held: list = []  # each cell's states, until its answers' batch is formed
        calls = []

        def compact_all(mode, states, scores, tails, tokens):
            """A call: the mode's scored pass, then every (method, budget) cell compacted."""
            t0 = time.perf_counter()
            mx.eval(kvfn.tree.arrays(states), scores)  # the mode's scored pass, left lazy
            t1, p1 = time.perf_counter(), peak_gib()
            full_bytes = kv_bytes(to_mlx_cache(states), with_positions=False)
            P, memo, first, made = len(tokens), {}, len(cells), []
            for method in methods:
                for budget in [None] if method.policy is None else budgets:
                    rows = rows_for(method, self.rows(budget, P), self.head_dim, self.itemsize)
                    made.append((method, budget, rows, *self.compact(
                        states, scores, method, rows, sample.seed, tokens, memo, moments
                    )))  # fmt: skip
            # every cell's kept positions read at once (one wait for the device, not one a read)
            mx.eval([a for *_, layers, _, _ in made for s in layers for a in head_arrays(s)])
            spans = prompts[tails[0][0]].needles  # the context's: the same for all
            needles = [t for n in spans for t in n]
            for method, budget, rows, kept_states, evicted, seconds in made:
                kept = layers = None  # without needle offsets
                if spans:
                    full = sum(s.sliding_window is None for s in kept_states)
                    heads = needle_fractions(kept_states, needles) if evicted else [[1.0]] * full
                    kept = float(np.mean([f for h in heads for f in h])) if evicted else 1.0
                    layers = tuple(float(np.mean(h)) for h in heads)
                cells.append(self.cell(method, budget, rows, kept_states, evicted, kept, layers,
                                       seconds))  # fmt: skip
                held.append(kept_states)
            del made
            # the scored pass over the context's last tokens (and, asked, the question) and every
            # cell's compaction (own scoring passes included; gathers left lazy are paid in the
            # answers), each with its seconds and the peak memory so far after it
            spent = dict(window_seconds=t1 - t0, compact_seconds=time.perf_counter() - t1,
                         window_peak_gib=p1, compact_peak_gib=peak_gib())  # fmt: skip
            calls.append((mode, tails, range(first, len(cells)), full_bytes, P, spent))

        states = scores = None
        if "agnostic" in modes:  # every question on the one compacted state
            states, scores = kvfn.scored_prefill(self.fm, mx.array([head[-w:]]), window=w,
                                                 states=start, **opts)  # fmt: skip
            tails = [(q, p.tail) for q, p in enumerate(prompts)]
            compact_all("agnostic", states, scores, tails, head)
        if "aware" in modes:
            for q, p in enumerate(prompts):
                ask = head[-w:] + p.tail[:-1]
                window = min(self.window, len(ask))
                states, scores = kvfn.scored_prefill(self.fm, mx.array([ask]), window=window,
                                                     states=start, **opts)  # fmt: skip
                compact_all("aware", states, scores, [(q, p.tail[-1:])], head + p.tail[:-1])
        del start, moments, states, scores  # the cells' states are what the answers read
        # every call's cells answered together: a batch of questions may span calls
        asks = [(c, tail) for _, tails, span, *_ in calls for c in span for _, tail in tails]
        t0 = time.perf_counter()
        got, loops = self.answers(cells, held, asks, n_new)
        answered = dict(sample_answer_seconds=time.perf_counter() - t0,
                        sample_answer_peak_gib=peak_gib(), sample_decode_loops=loops)  # fmt: skip
        records, got = [], iter(got)
        for mode, tails, span, full_bytes, P, spent in calls:
            for c in span:
                cell = cells[c]
                for q, _ in tails:
                    prediction = self.tokenizer.decode(next(got))
                    rows = min(cell.rows, P) if cell.rows is not None else P
                    layers = None if cell.kept_layers is None else list(cell.kept_layers)
                    records.append(dict(
                        task=sample.task, seed=sample.seed, target_tokens=sample.target_tokens,
                        prompt_tokens=len(head) + len(prompts[q].tail), mode=mode,
                        method=cell.method.name, budget=cell.budget, rows=rows,
                        kv_bytes=cell.nbytes, kv_fraction=cell.nbytes / full_bytes,
                        needle_kept=cell.kept, needle_kept_layers=layers,
                        score_seconds=cell.seconds,
                        prefill_seconds=prefill_seconds, prefill_peak_gib=prefill_peak,
                        question=q, prediction=prediction,
                        score=answers.match_all(prediction, sample.questions[q].answers),
                        **spent, **answered,
                    ))  # fmt: skip
        return records

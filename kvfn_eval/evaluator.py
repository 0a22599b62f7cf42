"""Accuracy of eviction methods at equal KV memory, on RULER-style samples.

Per sample, the context is prefilled once (in chunks, eagerly) into immutable states; every
method and question starts from those states, so reuse is exact and free:

* query-agnostic: the context's last ``window`` tokens are scored, the context is compacted once
  per method, and every question is asked on that one compacted state;
* query-aware: per question, the window is the question's end (scores over context + question),
  and the prompt is compacted before the answer's first token.

Answers are decoded greedily by the unmodified mlx-lm model over mlx-lm cache objects built from
the states (``kvfn.serving.interop``), so KV quantization is mlx-lm's own ``mx.quantize`` + quantized
attention, and the full cache is exactly mlx-lm's computation.
"""

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence, Union

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step

import kvfn
from kvfn.passes import with_room
from kvfn.serving.interop import to_mlx_cache

from . import answers
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

    def make_policy(self, budget: int, **settings) -> kvfn.Policy:
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


def _needle_tokens(tokenizer, text: str, start: int, spans, special: bool) -> tuple:
    """Token indices of ``text`` overlapping each character span (shifted by ``start``)."""
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


def prompt_tokens(tokenizer, sample: Sample, question: Question) -> Prompt:
    """Chat template when the tokenizer has one (else plain text), answer prefix after it. The
    head ends where the question starts, so every question shares the context's tokens."""
    body = sample.instruction + sample.context
    ask = "\n\n" + question.text
    templated = bool(getattr(tokenizer, "chat_template", None))
    if templated:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": body + ask}], add_generation_prompt=True, tokenize=False
        )
        cut = text.rindex(ask)
        head_text, tail_text = text[:cut], text[cut:] + question.answer_prefix
    else:
        head_text, tail_text = body, ask + "\n" + question.answer_prefix
    head = tokenizer.encode(head_text, add_special_tokens=not templated)
    start = head_text.rindex(body) + len(sample.instruction)
    needles = _needle_tokens(tokenizer, head_text, start, sample.needles, not templated)
    return Prompt(head, tokenizer.encode(tail_text, add_special_tokens=False), needles)


def token_counter(tokenizer) -> Callable[[Sample], int]:
    """``count_tokens`` for ``kvfn.tasks.generate``: a sample's longest prompt."""

    def count(sample: Sample) -> int:
        return max(
            len(p.head) + len(p.tail)
            for p in (prompt_tokens(tokenizer, sample, q) for q in sample.questions)
        )

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


def head_positions(state) -> list:
    """The kept positions of each KV head of the first sequence (any layer state): its stored
    rows' (a plain state's slots past ``rows`` are free)."""
    if isinstance(state, kvfn.RaggedKVCache):
        return [np.array(kvfn.ragged.head_rows(state, 0, h)[2]) for h in range(state.n_kv_heads)]
    out = []
    for g in getattr(state, "groups", (state,)):
        rows = int(g.rows.item()) if hasattr(g, "rows") else g.positions.shape[-1]
        out += [p[p != kvfn.EMPTY] for p in np.array(g.positions)[0][:, :rows]]
    return out


def needle_fraction(states: Sequence, tokens) -> float:
    """Mean over full-attention layers and KV heads of the fraction of ``tokens`` (prompt
    positions) among the kept rows."""
    fractions = [
        np.isin(tokens, positions).mean()
        for s in states
        if s.sliding_window is None
        for positions in head_positions(s)
    ]
    return float(np.mean(fractions))


def kvfn_greedy(fm, prompt: list[int], states, max_tokens: int, eos: set,
                batch: int = 1) -> list[list[int]]:  # fmt: skip
    """Greedy answers decoded by kvfn itself (eager steps), one a sequence of the ``batch``
    that ``states`` hold (for states mlx-lm cannot hold, and for many methods' states at once);
    every sequence is given the same ``prompt``."""
    logits, states = fm.forward(mx.array([prompt] * batch), states)
    out: list[list[int]] = [[] for _ in range(batch)]
    live = [True] * batch
    for _ in range(max_tokens):
        tokens = mx.argmax(logits[:, -1], axis=-1).astype(mx.int32)
        for b, token in enumerate(tokens.tolist()):
            if live[b] and token in eos:
                live[b] = False
            elif live[b]:
                out[b].append(token)
        if not any(live):
            break
        logits, states = fm.forward(tokens[:, None], states)
    return out


def peak_gib() -> float:
    """MLX's peak memory so far (since the caller's ``mx.reset_peak_memory()``), in GiB: read
    after each phase of a sample, it says which phase set the sample's peak."""
    return round(mx.get_peak_memory() / 2**30, 3)


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
    def policy(self, method: Method, rows: int, sample_seed: int) -> kvfn.Policy:
        settings = dict(window=self.window, sink_tokens=self.sink_tokens)
        probe = method.make_policy(rows, **settings)
        fields = {f.name for f in dataclasses.fields(probe)}
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

    def own_scores(self, policy: kvfn.Policy, tokens: Sequence[int], states, memo: dict,
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
                needles=(), tokens=(), memo=None, moments=None):  # fmt: skip
        """States after ``method``'s eviction to ``rows`` rows (unchanged when it keeps them
        all), whether it evicted, the fraction of needle rows kept (over full-attention layers
        and KV heads; None without needles) and the seconds of the policy's own scoring pass
        over the prompt ``tokens`` (0 without one)."""
        P = states[0].max_rows
        if method.policy is None or rows is None or rows >= P:
            return states, False, 1.0 if needles else None, 0.0
        policy = self.policy(method, rows, sample_seed)
        own, seconds = self.own_scores(policy, tokens, states, {} if memo is None else memo,
                                       moments)  # fmt: skip
        states, _ = kvfn.compact_states(states, scores if own is None else own, policy,
                                        compiled=self.compiled)  # fmt: skip
        needle_rows = [t for n in needles for t in n]
        kept = needle_fraction(states, needle_rows) if needles else None
        return states, True, kept, seconds

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

    def answers(self, cells: Sequence[tuple], tails: Sequence[list], n_new: int) -> list[tuple]:
        """Each cell's greedy answers, one a question ``tail``, and its KV bytes. A method
        that keeps every row is decoded by mlx-lm; evicted plain states by kvfn, up to
        ``self.batch`` methods' at once (``kvfn.stack``: each its own rows, the same computation
        as one at a time; stacked once for all the questions); ragged states (Ada-KV's) likewise
        among themselves (``kvfn.ragged.stack``); head-partitioned states one at a time."""
        out: list = [None] * len(cells)
        batched: dict = {kvfn.stack: [], kvfn.ragged.stack: []}
        for i, (method, _, _, states, evicted, _, _) in enumerate(cells):
            plain = all(isinstance(s, kvfn.PositionPreservingKVCache) for s in states)
            ragged = all(isinstance(s, kvfn.RaggedKVCache) for s in states)
            if method.kv_bits is not None and not plain:
                raise ValueError(f"{method.name}: per-head states are not quantized")
            if plain and evicted and method.kv_bits is None:
                batched[kvfn.stack].append(i)
            elif ragged:
                batched[kvfn.ragged.stack].append(i)
            elif plain:
                got = []
                for tail in tails:  # fresh caches a question: mlx-lm's decode appends to them
                    caches, nbytes = self.caches(states, method, evicted)
                    got.append(greedy(self.model, tail, caches, n_new, self.eos))
                out[i] = got, nbytes
            else:
                got = [kvfn_greedy(self.fm, t, states, n_new, self.eos)[0] for t in tails]
                out[i] = got, self.kept_bytes(states)
        # each state gets the room its questions and answers take (decoding would otherwise
        # double its capacity), and a batch holds states of similar rows: each is padded to the
        # batch's longest
        room = max(len(t) for t in tails) + n_new
        fits = {kvfn.stack: lambda s: with_room(s, room),
                kvfn.ragged.stack: lambda s: kvfn.ragged.reserve(s, room)}  # fmt: skip
        for stack, indices in batched.items():
            indices = sorted(indices, key=lambda i: cells[i][2])
            for start in range(0, len(indices), self.batch):
                group = indices[start : start + self.batch]
                layers = zip(*([fits[stack](s) for s in cells[i][3]] for i in group))
                stacked = [stack(list(layer)) if len(group) > 1 else layer[0] for layer in layers]
                got = [kvfn_greedy(self.fm, t, stacked, n_new, self.eos, len(group)) for t in tails]
                for b, i in enumerate(group):
                    states = cells[i][3]
                    nbytes = (self.caches(states, cells[i][0], True)[1] if stack is kvfn.stack
                              else self.kept_bytes(states))  # fmt: skip
                    out[i] = [a[b] for a in got], nbytes
        return out

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
        records = []

        def record(mode, method, budget, q, rows, nbytes, full_bytes, P, answer, kept, seconds,
                   spent):  # fmt: skip
            prediction = self.tokenizer.decode(answer)
            records.append(dict(
                task=sample.task, seed=sample.seed, target_tokens=sample.target_tokens,
                prompt_tokens=len(head) + len(prompts[q].tail), mode=mode, method=method.name,
                budget=budget, rows=min(rows, P) if rows is not None else P, kv_bytes=nbytes,
                kv_fraction=nbytes / full_bytes, needle_kept=kept, score_seconds=seconds,
                prefill_seconds=prefill_seconds, prefill_peak_gib=prefill_peak, question=q,
                prediction=prediction,
                score=answers.match_all(prediction, sample.questions[q].answers), **spent,
            ))  # fmt: skip

        def answer_all(mode, states, scores, tails, tokens):
            t0 = time.perf_counter()
            mx.eval(kvfn.tree.arrays(states), scores)  # the mode's scored pass, left lazy
            t1, p1 = time.perf_counter(), peak_gib()
            full_bytes = kv_bytes(to_mlx_cache(states), with_positions=False)
            P, memo, cells = len(tokens), {}, []
            needles = prompts[tails[0][0]].needles  # the context's: the same for all
            for method in methods:
                for budget in [None] if method.policy is None else budgets:
                    rows = rows_for(method, self.rows(budget, P), self.head_dim, self.itemsize)
                    kept_states, evicted, kept, seconds = self.compact(
                        states, scores, method, rows, sample.seed, needles, tokens, memo, moments
                    )
                    cells.append((method, budget, rows, kept_states, evicted, kept, seconds))
            t2, p2 = time.perf_counter(), peak_gib()
            # every question on the one compacted state
            answered = self.answers(cells, [tail for _, tail in tails], n_new)
            # shared by the records of this call: the mode's scored pass over the context's last
            # tokens (and, asked, the question), every cell's compaction (own scoring passes
            # included; gathers left lazy are paid in the answers) and every cell's answers, each
            # with its seconds and the peak memory so far after it
            spent = dict(window_seconds=t1 - t0, compact_seconds=t2 - t1,
                         answer_seconds=time.perf_counter() - t2, window_peak_gib=p1,
                         compact_peak_gib=p2, answer_peak_gib=peak_gib())  # fmt: skip
            for (method, budget, rows, _, _, kept, seconds), (got, nbytes) in zip(cells, answered):
                for (q, _), answer in zip(tails, got):
                    record(mode, method, budget, q, rows, nbytes, full_bytes, P, answer, kept,
                           seconds, spent)  # fmt: skip

        if "agnostic" in modes:
            states, scores = kvfn.scored_prefill(self.fm, mx.array([head[-w:]]), window=w,
                                                 states=start, **opts)  # fmt: skip
            tails = [(q, p.tail) for q, p in enumerate(prompts)]
            answer_all("agnostic", states, scores, tails, head)
        if "aware" in modes:
            for q, p in enumerate(prompts):
                ask = head[-w:] + p.tail[:-1]
                window = min(self.window, len(ask))
                states, scores = kvfn.scored_prefill(self.fm, mx.array([ask]), window=window,
                                                     states=start, **opts)  # fmt: skip
                answer_all("aware", states, scores, [(q, p.tail[-1:])], head + p.tail[:-1])
        return records

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
from functools import partial
from typing import ClassVar, Optional, Sequence

import mlx.core as mx

from ..kernels import on_cuda
from ..passes import _drain, check_step, chunks, per_layer, query_bucket, settling, with_room
from ..scores import reconstruction_attention
from ..states import cache as kv
from ..wrapper import FunctionalModel, QuerySlice
from .policy import Policy, register_policy
from .snapkv import check_kernel, pool1d

REPEAT = "\n\nRepeat the previous context exactly."
RESUME = "\n\nRepeat the part of the previous context exactly, starting with"
_MARKER = "\x00KVZIP\x00"
MAX_STEPS = 4096  # a pass's chunks: each is a forward of the model, so this bounds its time


def check_steps(prompt_length: int, chunk: int) -> None:
    """Refuses a chunk that cuts a context this long into more than ``MAX_STEPS`` steps."""
    steps = -(-prompt_length // chunk)
    if steps > MAX_STEPS:
        raise ValueError(
            f"kvzip chunk {chunk} cuts the {prompt_length}-token context into {steps} steps of "
            f"the reconstruction pass; at most {MAX_STEPS} (a chunk of at least "
            f"{-(-prompt_length // MAX_STEPS)})"
        )


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
    step: Optional[int] = None,
    layers: Optional[int] = None,
    padded: Optional[bool] = None,
):
    """``reconstruction_scores`` as a generator: it yields ``(done, total)`` context rows after
    each chunk (evaluated) and returns the scores as its StopIteration value, so a caller can
    interleave other work between chunks. ``step``: a chunk's input runs in forwards of at most
    ``step`` tokens, each a step of its own (the same scores, from every forward's queries at
    the chunk's last; a caller's other work then waits at most one ``step``). ``layers``: each
    forward evaluated that many layers a step (``passes.settling``). ``padded`` (None: on CUDA
    only): a chunk's tokens run rounded up to a ``query_bucket`` (at most ``chunk``; the padding
    after every real query) over a copy of the states in a capacity ``bucket``, so that
    prompts of other lengths in a bucket attend in the shapes it met: the same scores. The
    arguments are checked when it is called."""
    if not isinstance(tokens, mx.array) or tokens.ndim != 2 or tokens.shape[1] < 1:
        shape = tuple(tokens.shape) if isinstance(tokens, mx.array) else type(tokens).__name__
        raise ValueError(f"reconstruction takes tokens of shape (batch, n >= 1), got {shape}")
    checked = [("chunk", chunk, 1), ("overlap", overlap, 0), ("sink", sink, 0)]
    if step is not None:
        checked.append(("step", step, 1))
    for name, value, least in checked:
        if type(value) is not int or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    heads = [_token_ids(n, v) for n, v in (("prompt", prompt), ("resume", resume),
                                           ("suffix", suffix))]  # fmt: skip
    B, P = tokens.shape
    check_steps(P, chunk)
    for s in states:
        if not isinstance(s, kv.State):
            raise TypeError(f"the reconstruction pass needs plain states, got {type(s).__name__}")
    rows = {s.max_rows if s.max_rows is not None else int(s.rows.item()) for s in states}
    if rows != {P}:
        raise ValueError(f"states must hold the {P} prefilled tokens' rows, got rows {rows}")
    if not all(s.dense for s in states):
        raise ValueError("the reconstruction pass needs the dense states of a plain prefill")
    prompt, resume, suffix = heads
    check_step("layers", layers)
    return held_reconstruction_steps(fmodel, tokens.astype(mx.int32), tuple(states), 0, None,
                                     prompt=prompt, resume=resume, suffix=suffix, chunk=chunk,
                                     overlap=overlap, sink=sink, step=step, layers=layers,
                                     padded=padded)  # fmt: skip


def held_reconstruction_steps(fmodel, context, states, start, carried, *, prompt, resume,
                              suffix, chunk, overlap, sink, step=None, layers=None,
                              padded=None):  # fmt: skip
    """KVzip's scores while evicting as it prefills: the context tokens ``context[:, start:]``
    are the last rows ``states`` hold (earlier rows compacted, keeping their true positions and
    the first ``sink`` rows), scored now as the pass scores them (chunks of ``chunk`` from the
    context's start, each after its instruction, over what is held: ``reconstruction_attention``
    over the held slots) and appended to the earlier rows' ``carried`` scores. A generator,
    yielding after each chunk; it returns every held row's scores. With ``start`` 0 and nothing
    carried (a plain prefill held whole) it is the pass itself (``reconstruction_steps``).
    ``step``, ``layers`` and ``padded`` as there."""
    B, stop = context.shape
    base = 0 if carried is None else carried[0].shape[-1]
    held = base + stop - start
    parts = [(max(a, start), b) for a, b in chunks(stop, chunk) if b > start]
    done = [[] if carried is None else [c] for c in (carried or states)]
    padded = on_cuda() if padded is None else padded
    for a, b in parts:
        if a == 0:
            head = _ids(prompt, B)
        else:
            tail = context[:, max(a - overlap, 0) : a]
            head = mx.concatenate([_ids(resume, B), tail, _ids(suffix, B)], axis=1)
        inputs = mx.concatenate([head, context[:, a:b]], axis=1)
        n = inputs.shape[1]
        pad = min(chunk, query_bucket(b - a)) - (b - a) if padded else 0
        if pad:  # after every real query: none of them sees these tokens
            inputs = mx.concatenate([inputs, mx.zeros((B, pad), inputs.dtype)], axis=1)
        room = partial(with_room, bucketed=padded)
        rows = (sink, base + a - start, base + b - start, held)
        if step is not None and b - a > step:  # the chunk's own tokens: its head rides along
            scores, shown = yield from _stepped(fmodel, inputs, states, rows, step, a, b, stop,
                                                layers, n, room)  # fmt: skip
        else:
            shown = a
            zeros = tuple(mx.zeros((B, h, b - a), mx.float32) for h in fmodel.n_heads)
            # each chunk runs over its own copy of the states with room for its input, made and
            # freed layer by layer: the caller's states stay as they were and no second copy of
            # every layer is ever held (the states and their logits are dropped at once)
            scores = fmodel.scored_forward(inputs, tuple(room(s, inputs.shape[1]) for s in states),
                                           zeros, QuerySlice(0, n, "reconstruction", rows))[2]  # fmt: skip
        for _ in settling(scores, layers):
            yield shown, stop
        for kept, s in zip(done, scores):
            kept.append(s)
        del scores
        yield b, stop
    return tuple(mx.concatenate(kept, axis=-1) if len(kept) > 1 else kept[0] for kept in done)


def _stepped(fmodel, inputs, states, rows, step, a, b, stop, layers=None, real=None,
             room=with_room):  # fmt: skip
    """One chunk's input in forwards of at most ``step`` tokens over one copy of the states
    with room for all of it (``room``; held until the chunk's scores are made), each yielding;
    the chunk's scores from the queries of its first ``real`` tokens (all) at the last, as one
    forward's would be, and the progress it yielded last."""
    B, n = inputs.shape
    real = n if real is None else real
    held = tuple(room(s, n) for s in states)
    queries = [[] for _ in states]
    for i in range(0, real, step):
        j, shown = min(i + step, n), a + (b - a) * i // real
        zeros = tuple(mx.zeros((B, h, j - i, d), mx.float32)
                      for h, d in zip(fmodel.n_heads, fmodel.head_dims))  # fmt: skip
        _, held, got = fmodel.scored_forward(inputs[:, i:j], held, zeros,
                                             QuerySlice(0, j - i, "queries"))  # fmt: skip
        for kept, q in zip(queries, got):
            kept.append(q)
        if j < real:
            for _ in settling(per_layer(held, got), layers):
                yield shown, stop
            yield a + (b - a) * j // real, stop
    scores = tuple(
        reconstruction_attention(mx.concatenate(q, axis=2)[:, :, :real], s.keys, *rows, scale)
        if window is None
        else mx.zeros((B, h, b - a), mx.float32)
        for q, s, scale, window, h in zip(queries, held, fmodel.scales, fmodel.sliding_windows,
                                          fmodel.n_heads)  # fmt: skip
    )
    return scores, shown


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
    padded: Optional[bool] = None,
) -> tuple:
    """KVzip's scores of the P rows of ``states`` (the dense states of a plain prefill of
    ``tokens``, (B, P)): per layer (B, n_heads, P) float32, zeros for sliding-window layers.
    The context is cut into chunks of ``chunk`` tokens; chunk [start, end) runs after its head
    (``prompt`` for the first; for a later one ``resume``, the previous ``overlap`` context
    tokens, then ``suffix``) over the prefilled states, and each of its rows scores the most
    weight any query of that input gives it in a softmax over rows [0, min(sink, start)),
    [start, end) and the input's own (causally; ``kvfn.scores.reconstruction_attention``).
    Without a tokenizer's ids the head is just the overlap (nothing for the first chunk).
    ``states`` are left as they were. ``padded`` as in ``reconstruction_steps``."""
    steps = reconstruction_steps(fmodel, tokens, states, prompt=prompt, resume=resume,
                                 suffix=suffix, chunk=chunk, overlap=overlap, sink=sink,
                                 padded=padded)  # fmt: skip
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
    same_in_every_layer: ClassVar[bool] = True
    query_agnostic: ClassVar[bool] = True
    needs_scores: ClassVar[bool] = True
    words: ClassVar[dict] = {"layer": {"per_head": False}}
    numbers: ClassVar[dict] = {"k": "kernel_size", "c": "chunk"}
    # evicting while prefilling it scores each chunk of the context over what is held, when a
    # compaction is due (the pass's chunks over the whole context where none is)
    cannot_recompact: ClassVar[str] = ""
    scores_held: ClassVar[bool] = True

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
        check_kernel("kvzip", self.kernel_size)
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

    def check_prompt(self, prompt_length: int) -> None:
        if not self.keeps_whole(prompt_length):
            check_steps(prompt_length, self.chunk)

    def score_steps(self, fmodel, tokens, states, gathered=None, *, step=None, layers=None):
        """The reconstruction pass (``reconstruction_steps``), a chunk a step (or ``step``
        tokens, ``layers`` layers a step); None without steps when the prompt is kept whole."""
        if self.keeps_whole(tokens.shape[1]):
            return None
        steps = reconstruction_steps(fmodel, tokens, states, prompt=self.prompt,
                                     resume=self.resume, suffix=self.suffix, chunk=self.chunk,
                                     overlap=self.overlap, sink=self.sink_tokens,
                                     step=step, layers=layers)  # fmt: skip
        return (yield from steps)

    def check_max_rows(self, max_rows, during: str = "prefilling") -> None:
        if during != "prefilling":
            raise ValueError(f"{self.name} cannot evict while {during}: its scores come from "
                             "a reconstruction pass over the context, not from generated "
                             "queries")  # fmt: skip
        super().check_max_rows(max_rows, during)

    def held_score_steps(self, fmodel, context, states, start, carried, *, step=None,
                         layers=None):  # fmt: skip
        return held_reconstruction_steps(fmodel, context, states, start, carried,
                                         prompt=self.prompt, resume=self.resume,
                                         suffix=self.suffix, chunk=self.chunk,
                                         overlap=self.overlap, sink=self.sink_tokens,
                                         step=step, layers=layers)  # fmt: skip

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

"""Compact a prefilled prompt with any policy.

``compact`` = ``scored_prefill`` (``kvfn.passes``) of all but the last prompt token, then ``compact_states``: the
policy's selection, the gather and the room to decode, as one compiled transformation. No host
sync separates the last prefill chunk from the caller's first decode step. ``compact_steps`` is
the same work as a generator, a chunk a step, for a caller that interleaves other work
(kvfn-server's decoding).
"""

import dataclasses
from functools import lru_cache
from typing import Callable, Generator, Optional, Sequence

import mlx.core as mx
from typeguard import typechecked

from .eviction import EvictionResult, kept, result_of
from .passes import (
    _drain,
    _prefill_steps,
    _scored_steps,
    check_step,
    chunks,
    per_layer,
    settling,
    with_room,
)
from .policies.policy import BasePolicy, Plan
from .policies.snapkv import SnapKV
from .states import cache as kv
from .states import layout, tree
from .wrapper import FunctionalModel, check_ids


def _window_cut(state: kv.State, P: int, extra: int) -> kv.State:
    """A sliding-window layer keeps the rows its window can still see (lossless)."""
    B, H = state.keys.shape[:2]
    k = min(P, state.sliding_window)
    idx = mx.broadcast_to(mx.arange(P - k, P, dtype=mx.int32), (B, H, k))
    state = kv.gather(state, idx, packed=state.packed)
    return kv.reserve(state, max(state.capacity, k + extra))


@lru_cache(maxsize=64)
def _evictor(policy: BasePolicy, plan: Optional[Plan], P: int, extra: int, statics: tuple,
             compiled: bool, group):  # fmt: skip
    """The compaction of one prompt length under ``plan`` as a function of arrays; ``layout[0]``
    holds, once traced, each output layer's static part and host bounds (they depend only on
    the key)."""
    layout = []

    def run(flat, scores):
        states = [kv.unflatten(arrays, static) for arrays, static in zip(flat, statics)]
        full = {i: s for i, s in enumerate(states) if s.sliding_window is None}
        cut = {i: scores[i][..., :P] for i in full} if scores else None
        kept = policy.compact_layers(full, cut, prompt_length=P, n_layers=len(states),
                                     reserve=extra, group=group, plan=plan)  # fmt: skip
        out, shapes = [], []
        for i, s in enumerate(states):
            new = kept[i] if i in kept else _window_cut(s, P, extra)
            arrays_out, static_out, host = tree.flatten(new)
            out.append(arrays_out)
            shapes.append((static_out, host))
        layout[:] = [shapes]
        return out

    return (mx.compile(run) if compiled else run), layout


@typechecked
def compact_states(
    states: Sequence[kv.State],
    scores: Optional[Sequence[mx.array]],
    policy: BasePolicy,
    *,
    reserve: int = 0,
    compiled: bool = False,
    group: Optional[mx.distributed.Group] = None,
    plan: Optional[Plan] = None,
) -> tuple[tuple, EvictionResult]:
    """Apply ``policy`` to freshly prefilled ``states`` of one prompt length (and its
    ``scored_prefill`` scores, if it needs them): select, gather and reserve room for
    ``reserve`` more rows; eagerly, or with ``compiled`` as one compiled step per policy and
    prompt length (its trace costs more than it saves at any length not repeated: on an H100,
    3.6-3.8 s per new prompt length against tens of ms saved at a repeated one).
    Sliding-window layers are cut to their window (lossless). ``group``: the states hold this
    rank's slice of every layer's heads, split evenly over the group (``FunctionalModel.group``
    of a sharded model); every rank then keeps the rows one process would keep. ``plan``: what
    the policy's ``plan`` would decide from these scores (a layer's budget and each sequence's
    rows, ``kvfn.policies.Plan``), given instead; checked before tracing. The rows a state
    stores that the host does not know are read in one read, not one a layer."""
    P, new = _compacted(states, scores, policy, reserve=reserve, compiled=compiled, group=group,
                        plan=plan)  # fmt: skip
    return new, result_of(states, [P] * len(states), new)


def _rows_read(states, exact: bool) -> list:
    """Each state's stored rows where the host must read them (its ``max_rows`` unknown, or a
    packed state's ``max_rows`` only a bound), in one read for every layer; None where it need
    not. ``exact``: the caller vouches that each ``max_rows`` is the rows stored (states it
    made by appends and gathers alone, as ``_bounded_steps`` does): nothing is read for them."""
    at = [i for i, s in enumerate(states)
          if s.max_rows is None or (s.packed and not s.dense and not exact)]  # fmt: skip
    out = [None] * len(states)
    for i, r in zip(at, mx.stack([states[i].rows for i in at]).tolist() if at else ()):
        out[i] = r
    return out


def _compacted(states, scores, policy, *, reserve=0, compiled=False, group=None, plan=None,
               exact: bool = False) -> tuple[int, tuple]:  # fmt: skip
    """``compact_states`` without its ``EvictionResult``: (the prompt length, the new states).
    ``exact``: as ``_rows_read``'s."""
    read = _rows_read(states, exact)
    bounds = {s.max_rows if s.max_rows is not None else r for s, r in zip(states, read)}
    if len(bounds) != 1:
        raise ValueError(f"compact_states takes states of one prompt length, got rows {bounds}")
    (P,) = bounds
    if P < 1:
        raise ValueError("compact_states needs prefilled states (they hold no rows)")
    if reserve < 0:
        raise ValueError(f"reserve must be >= 0, got {reserve}")
    if policy.observation_window(P) and scores is None:
        raise ValueError(f"policy {policy.name!r} needs the scores of a scored_prefill")
    if scores is not None and len(scores) != len(states):
        raise ValueError(f"{len(scores)} score arrays for {len(states)} layers")
    kv.check_capacity(P + reserve)
    n_kv_heads = tuple(None if s.sliding_window else s.keys.shape[1] for s in states)
    if plan is None:
        plan = policy.plan(scores, prompt_length=P, n_kv_heads=n_kv_heads)
    policy.check_states(n_kv_heads, batch=states[0].keys.shape[0], prompt_length=P, plan=plan)
    # a dense state holds exactly P rows, as does a packed one whose rows are P (one compacted
    # while prefilling, then prefilled further): every kept row is a stored one, still packed
    stored = [s.max_rows if r is None else r for s, r in zip(states, read)]
    statics = tuple((s.sliding_window, s.dense or (s.packed and r == P))
                    for s, r in zip(states, stored))  # fmt: skip
    flat = [kv.flatten(s)[0] for s in states]
    run, layout = _evictor(policy, plan, P, reserve, statics, compiled and policy.traceable,
                           group)  # fmt: skip
    out = run(flat, list(scores or ()))
    new = tuple(tree.unflatten(o, st, host) for o, (st, host) in zip(out, layout[0]))
    new = tuple(
        n.replace(dense=True) if isinstance(n, kv.State) and s.dense and n.max_rows == P else n
        for n, s in zip(new, states)
    )
    return P, new


def _prompt(tokens, vocab: Optional[int]) -> mx.array:
    """The prompt as a (batch, length) array, its ids checked against the vocabulary (a list's
    on the host, an array's by one read before any work is queued)."""
    if isinstance(tokens, mx.array):
        arr = tokens
    else:
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise TypeError("prompt tokens must be ints (token ids)")
        arr = mx.array([list(tokens)], mx.int32)
    if arr.ndim != 2 or arr.shape[1] < 2:
        raise ValueError(f"need a (batch, length >= 2) prompt, got shape {tuple(arr.shape)}")
    if not mx.issubdtype(arr.dtype, mx.integer):
        raise TypeError(f"prompt tokens must be integer ids, got dtype {arr.dtype}")
    check_ids(tokens if isinstance(tokens, mx.array) else list(tokens), vocab)
    return arr


@typechecked
def compact_steps(
    fmodel: FunctionalModel,
    prompt_tokens: Sequence[int] | mx.array,
    policy: BasePolicy,
    *,
    max_new_tokens: int = 256,
    prefill_step_size: int = 512,
    dtype: Optional[mx.Dtype] = None,
    compiled: bool = False,
    settle: bool = True,
    max_rows: Optional[int] = None,
    probe: bool = False,
    pass_step_size: Optional[int] = None,
    layers_per_step: Optional[int] = None,
) -> Generator[tuple[int, int], None, tuple[tuple, EvictionResult]]:
    """``compact`` one step at a time, for a caller that interleaves other work between steps
    (kvfn-server's decode steps): a generator that yields ``(done, total)`` after each prefill
    chunk (of the ``total`` context tokens) and after each step of the policy's own scoring
    pass (``Policy.score_steps``, counted after the context's tokens: ``total`` grows by the
    pass's own total when it starts), then compacts and returns ``(states, EvictionResult)`` as
    its StopIteration value. With ``settle`` each step's arrays are evaluated before it yields,
    and the compacted states before it returns, so that a step's work is done inside it;
    ``compact`` drains it unsettled. ``max_rows``: evict while prefilling (``_bounded_steps``);
    ``probe``: its compactions scored by the prompt's last window (``compact``).
    ``pass_step_size``: the policy's own pass (KVzip's reconstruction) in forwards of at most
    this many tokens, a step each, with the same scores (None: a chunk of the pass a step), so
    that no step of the job is much longer than a prefill chunk of that size.
    The arguments are checked when it is called."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    check_step("pass_step_size", pass_step_size)
    check_step("layers_per_step", layers_per_step)
    layers = layers_per_step if settle else None
    context = _prompt(prompt_tokens, fmodel.vocab_size)[:, :-1]
    kv.check_capacity(context.shape[1] + max_new_tokens + 1, "the prompt plus max_new_tokens")
    P = context.shape[1]
    policy.check_prompt(P)
    if probe and max_rows is None:
        raise ValueError("probe scores the compactions while prefilling: it takes max_rows")
    if max_rows is not None:
        check_bounded(fmodel.sliding_windows, policy, max_rows, prefill_step_size)
        check_probe(policy, probe)
        prefill = _bounded_steps(fmodel, context, policy, max_rows, prefill_step_size, dtype,
                                 settle, pass_step_size, layers, max_new_tokens + 1,
                                 compiled, probe)  # fmt: skip
        return _compaction(fmodel, context, policy, prefill, True, max_new_tokens + 1, compiled,
                           settle, own_pass=not policy.scores_held,
                           pass_step_size=pass_step_size, layers=layers)  # fmt: skip
    window = policy.observation_window(P)
    kwargs = dict(states=None, capacity=None, prefill_step_size=prefill_step_size, dtype=dtype,
                  compiled=False, settle=settle, check_ids=False, layers=layers)  # fmt: skip
    if window:
        prefill = _scored_steps(fmodel, context, window=window, statistic=policy.statistic,
                                **kwargs)  # fmt: skip
    else:
        prefill = _prefill_steps(fmodel, context, **kwargs)
    return _compaction(fmodel, context, policy, prefill, bool(window), max_new_tokens + 1,
                       compiled, settle, pass_step_size=pass_step_size, layers=layers)  # fmt: skip


def _paced(step: Optional[int], layers: Optional[int]) -> dict:
    """A policy pass's pace as its ``score_steps`` takes it (only what is set: a policy of
    its own may take neither)."""
    return {k: v for k, v in (("step", step), ("layers", layers)) if v is not None}


def _compaction(fmodel, context, policy, prefill, scored, reserve, compiled, settle,
                own_pass=True, pass_step_size=None, layers=None):  # fmt: skip
    """``compact_steps``' generator, over the steps of its ``prefill`` (which returns the
    states, the scores and, evicting while it prefilled, the most rows it held), then the
    policy's own scoring pass unless the prefill scored what it holds."""
    P = context.shape[1]
    states, scores, *rest = yield from prefill
    peak, done = (*rest, None, None)[:2]
    scores = scores if scored else None
    own, last = None, [(P, P)]
    if own_pass and done is None:
        steps = policy.score_steps(fmodel, context, states, scores,
                                   **_paced(pass_step_size, layers))  # fmt: skip
        own = yield from _after(P, steps, last)
    scores = own if own is not None else scores
    if done is not None:  # compacted while prefilling, into a layout that bounds itself
        new, result = tuple(layout.grown(s, reserve) for s in states), done
    elif peak is None:
        new, result = compact_states(states, scores, policy, reserve=reserve, compiled=compiled,
                                     group=fmodel.group)  # fmt: skip
    else:  # the bounded prefill made its states by appends and gathers: their rows are known
        rows, new = _compacted(states, scores, policy, reserve=reserve, compiled=compiled,
                               group=fmodel.group, exact=True)  # fmt: skip
        result = result_of(states, [rows] * len(states), new)
    if settle:
        for _ in settling(per_layer(new), layers):
            yield last[0]
    return new, (result if peak is None else dataclasses.replace(result, peak_rows=peak))


def check_bounded(sliding_windows: Sequence, policy: BasePolicy, max_rows, step: int,
                  during: str = "prefilling") -> None:  # fmt: skip
    """Refuses, by name and reason, what cannot evict while prefilling (or generating) a
    model whose layers have these ``sliding_windows`` (None: full attention)."""
    policy.check_max_rows(max_rows, during)
    if any(w is not None for w in sliding_windows):
        raise ValueError(f"this model has sliding-window layers, whose rows are kept apart; "
                         f"evicting while {during} takes full-attention layers")  # fmt: skip
    if step <= 0:
        raise ValueError(f"prefill_step_size must be positive, got {step}")


def check_probe(policy: BasePolicy, probe: bool) -> None:
    """Refuses, by name, a ``probe`` of a policy that can evict while prefilling but is not
    scored by its observation window's queries."""
    if probe and (policy.scores_held or policy.bounds_itself or not policy.needs_scores):
        raise ValueError(f"probe reads the prompt's last window to score what {policy.name!r} "
                         f"keeps, but {policy.name!r} is not scored by an observation window's "
                         f"queries")  # fmt: skip


def probed(fmodel, probe: mx.array, states: tuple, statistic: str, dtype) -> tuple:
    """(``states`` as they were, the scores ``probe``'s tokens give every row held): the
    probe is read after the rows held, at the next positions, all its queries scoring, and its
    own rows rolled back."""
    w = probe.shape[1]
    states, scores = _drain(_scored_steps(fmodel, probe, window=w, statistic=statistic,
                                          states=states, capacity=w, prefill_step_size=w,
                                          dtype=dtype, compiled=False, check_ids=False),
                            None)  # fmt: skip
    return tuple(layout.of(s).rollback(s, w) for s in states), scores


def bounded_chunks(P: int, step: int, window: int) -> list[tuple[int, int]]:
    """The prefill chunks of an eviction while prefilling: ``step`` tokens each, the last one
    holding at least the whole observation window (it starts no later than ``P - window``)."""
    start = max(0, min(chunks(P, step)[-1][0], P - window))
    return [(a, min(b, start)) for a, b in chunks(P, step) if a < start] + [(start, P)]


def _bounded_steps(fmodel, context, policy, max_rows, step, dtype, settle, pass_step=None,
                   layers=None, extra=0, compiled=False, probe=False):  # fmt: skip
    """The prefill of ``compact_steps(max_rows=...)``, a chunk a step: whenever the rows held
    pass ``max_rows`` before the last chunk, the states are compacted back to ``max_rows`` rows
    (by ``policy.holding(max_rows)``) with what the chunk just read can score (its last
    ``window`` queries' attention over every row held; nothing for a scoring-free policy), with
    room for the next chunk; the last chunk's compaction keeps the policy's budget. Rows
    keep their true positions, so later chunks attend to what is kept at the right distances.
    At most ``max_rows`` plus a chunk (the last: up to ``step + window``) rows are ever held.
    A policy whose layers bound themselves (``Policy.bounds_itself``: Duo) compacts once, the
    first time, with room for the rest of the context and ``extra`` rows (what ``compact``
    reserves), and the later chunks are prefilled into its layout. Returns (states, scores of
    the last chunk, the most rows a head held, and the result of that one compaction, made
    final for the whole context, or None). ``compiled``: each compaction that makes room for a
    whole ``step`` runs compiled (``compact_states``): its shapes (the cap plus a chunk of
    rows, room for a chunk) are the same at every chunk of every prompt, so its one trace serves
    the process's life; the one that makes room for the last chunk stays eager. Unsettled, the
    device computes a chunk while the host builds the next one's graph. ``probe``: each
    compaction before the last is scored instead by the context's last window, read after the
    rows held (``probed``; they have room for it: at most the window more rows are held then),
    and the chunks before the last are not scored."""
    P = context.shape[1]
    parts = bounded_chunks(P, step, policy.window)
    w = policy.observation_window(P) if probe else 0  # 0: a prompt it keeps whole
    question = context[:, P - w :] if w else None
    holding = policy.holding(max_rows)  # the compactions before the last one
    states, scores, held, peak, once = None, None, 0, 0, None
    unscored, carried = 0, None  # a policy scoring what it holds: rows it has not scored yet
    ahead = None  # unsettled: the arrays of the chunk the device is computing
    for j, (start, stop) in enumerate(parts):
        tokens, n, shown = context[:, start:stop], stop - start, start
        window = 0 if policy.scores_held else min(policy.observation_window(held + n), n)
        window = 0 if w and j + 1 < len(parts) else window
        if w and states is not None and held + n > max_rows:
            states = tuple(with_room(s, n + w) for s in states)  # the probe's room, in one copy
        # with ``layers`` the chunk stays lazy here and is evaluated below, layers a step; the
        # states go to the chunk's loop alone (held here too, its writes would copy them)
        given, states = [states], None
        kwargs = dict(capacity=n + w, prefill_step_size=n, dtype=dtype, compiled=False,
                      settle=settle and layers is None, check_ids=False)  # fmt: skip
        if window:
            states, scores = _drain(_scored_steps(fmodel, tokens, window=window,
                                                  statistic=policy.statistic,
                                                  states=given.pop(), **kwargs), None)  # fmt: skip
        else:
            steps = _prefill_steps(fmodel, tokens, states=given.pop(), **kwargs)
            states, scores = _drain(steps, None)[0], None
        held += n
        peak = max(peak, held)
        last = j + 1 == len(parts)
        if policy.scores_held and (last or held > max_rows):
            steps = policy.held_score_steps(fmodel, context[:, :stop], states, unscored, carried,
                                            **_paced(pass_step, layers))  # fmt: skip
            scores = yield from _as_progress(steps, stop, P)
            unscored, shown = stop, stop
        if held > max_rows and not last and once is None:
            # room for the next chunk; a layout that bounds itself, for the rest of the context
            # and what compact reserves after it (its plain part then never grows)
            room = parts[j + 1][1] - parts[j + 1][0]
            room = P - stop + extra if policy.bounds_itself else room
            if policy.bounds_itself:  # the most a head holds goes on growing (Duo's retrieval)
                states, once = compact_states(states, scores, policy, reserve=room,
                                              group=fmodel.group)  # fmt: skip
            else:  # the rows of states this loop made are known here; no result is kept
                if w:
                    states, scores = probed(fmodel, question, states, policy.statistic, dtype)
                    peak = max(peak, held + w)
                new = _compacted(states, scores, holding, reserve=room + w, group=fmodel.group,
                                 compiled=compiled and room == step, exact=True)[1]  # fmt: skip
                rows = holding.rows_after(held)
                if policy.scores_held:
                    carried = kept_scores(scores, states, new, rows)
                states, held, new = new, rows, None
        if settle:
            for _ in settling(per_layer(states, scores), layers):
                yield shown, P
            mx.eval(carried or ())
        else:  # the device computed the chunk before while the host built this one's graph
            mx.eval(ahead or ())  # it is done first: at most one chunk in flight (the peak)
            ahead = None  # held, its buffers could not be written in place by this chunk
            if not last:  # a lazy graph of every chunk would hold them all
                mx.async_eval(per_layer(states, scores), carried or ())
                ahead = [tree.arrays(states), scores, carried or ()]
        yield stop, P
    return states, scores, peak, None if once is None else whole_context(once, states, P)


def whole_context(result: EvictionResult, states: tuple, P: int) -> EvictionResult:
    """``result`` of a compaction of the first rows of a ``P``-token context, made the result
    of ``states`` (its layout, prefilled on to the context's end) for the whole context."""
    per_row = [b / r for b, r in zip(result.bytes_before, result.rows_before)]
    now = [kept(s) for s in states]
    return dataclasses.replace(
        result,
        rows_before=(P,) * len(states),
        bytes_before=tuple(round(b * P) for b in per_row),
        rows_after=tuple(r for r, _ in now),
        bytes_after=tuple(b for _, b in now),
    )


def _as_progress(steps, done: int, total: int):
    """``steps``, yielding ``(done, total)`` for each of its steps; returns its value."""
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value
        yield done, total


def kept_scores(scores: tuple, before: tuple, after: tuple, rows: int) -> tuple:
    """Each layer's ``scores`` (B, n_heads, rows held ``before``) of the ``rows`` rows kept
    ``after`` a compaction, found by their positions (a KV head's scores go with its query
    heads')."""
    out = []
    for s, b, a in zip(scores, before, after):
        old = b.positions[..., : s.shape[-1]]
        new = a.positions[..., :rows]
        at = mx.argmax(new[..., :, None] == old[..., None, :], axis=-1)
        at = mx.repeat(at, s.shape[1] // at.shape[1], axis=1)
        out.append(mx.take_along_axis(s, at, axis=-1))
    return tuple(out)


def _after(base: int, steps, last: Optional[list] = None):
    """``steps`` with ``base`` added to each ``(done, total)`` it yields (the latest also in
    ``last[0]``, where given); returns its value."""
    while True:
        try:
            done, total = next(steps)
        except StopIteration as end:
            return end.value
        if last is not None:
            last[0] = (base + done, base + total)
        yield base + done, base + total


@typechecked
def compact(
    fmodel: FunctionalModel,
    prompt_tokens: Sequence[int] | mx.array,
    policy: BasePolicy,
    *,
    max_new_tokens: int = 256,
    prefill_step_size: int = 512,
    dtype: Optional[mx.Dtype] = None,
    progress: Optional[Callable[[int, int], None]] = None,
    compiled: bool = False,
    max_rows: Optional[int] = None,
    probe: bool = False,
) -> tuple[tuple, EvictionResult]:
    """Prefill all but the last prompt token (eagerly, scoring the policy's observation
    window), keep the policy's rows in every full-attention layer and reserve room for
    ``max_new_tokens`` (decoding further grows the states), the eviction eager unless
    ``compiled`` (``compact_states``: worth it only for many prompts of one length). The
    caller decodes from the last prompt token. Takes one prompt (a list
    of ints) or a batch of equal-length prompts (B, n). On a sharded model (every rank runs
    this alike) each rank keeps its heads' share of the single-process selection.
    ``progress(done, total)``: after each of ``compact_steps``' steps.

    ``max_rows``: evict while prefilling, so that no more than ``max_rows`` plus one chunk of
    ``prefill_step_size`` rows (and the window, with ``probe`` or at the last chunk) are ever
    held, however long the prompt: each time a chunk leaves
    more, the states are compacted back to ``max_rows`` rows (``Policy.holding``: a policy
    keeping ``max_rows`` where its budget is less) with the scores that chunk's last queries
    give, and the last chunk's window makes the final selection of the budget's rows
    (``EvictionResult.peak_rows``: the most held; ``rows_before``: what the final compaction
    took). Not the same selection as without it: rows evicted early are never seen by the later
    prompt tokens (as with mlx-lm's rotating cache, but chosen by the policy). A policy that
    cannot (``Policy.cannot_recompact`` says why) is refused by name. With ``compiled``, each
    chunk's compaction runs compiled too: its shapes are the same for every prompt (the cap
    plus a chunk), so it is traced once a process (worth it after the first long prompt: on
    this CPU a compiled chunk's graph took 2 ms to build against 16-20 ms eager, 32 layers).

    ``probe`` (with ``max_rows``, a policy scored by its observation window): each compaction
    while prefilling is scored by the prompt's own last window (its question, where the prompt
    ends in one) read after the rows held, at the next positions, then rolled back, instead of
    by the chunk's last queries: the rows kept before the question is reached are those it
    attends to, as InfiniPot scores each compression by a prompt appended to what is held
    (arXiv:2410.01518). The whole prompt must be known when the prefill starts; the window's
    tokens are read once a compaction more (at most the window more rows held then)."""
    steps = compact_steps(fmodel, prompt_tokens, policy, max_new_tokens=max_new_tokens,
                          prefill_step_size=prefill_step_size, dtype=dtype, compiled=compiled,
                          settle=False, max_rows=max_rows, probe=probe)  # fmt: skip
    return _drain(steps, progress)


def compact_prompt_cache(
    fmodel: FunctionalModel,
    prompt_tokens: Sequence[int] | mx.array,
    *,
    budget: int,
    max_new_tokens: int = 256,
    prefill_step_size: int = 512,
    dtype: Optional[mx.Dtype] = None,
    progress: Optional[Callable[[int, int], None]] = None,
    **snapkv,
) -> tuple[tuple, EvictionResult]:
    """``compact`` with a ``SnapKV(budget, **snapkv)`` policy (window, sink_tokens, min_tokens,
    kernel_size, pooling, per_head, group_reduce)."""
    return compact(fmodel, prompt_tokens, SnapKV(budget=budget, **snapkv),
                   max_new_tokens=max_new_tokens, prefill_step_size=prefill_step_size,
                   dtype=dtype, progress=progress)  # fmt: skip

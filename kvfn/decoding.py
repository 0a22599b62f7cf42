"""Bounded memory while generating: a decode loop that compacts its states back to the policy's
budget every ``interval`` generated tokens, so a long generation holds a fixed number of rows.

The rows to keep are scored as SnapKV scores a prompt: by the attention the last ``window``
decoded queries before a compaction paid every row held (``FunctionalModel.scored_step``), then
``compact_states``. The loop counts rows on the host (no sync a step), its states keep one
capacity (``layout.bucket`` of budget + interval), so it traces one decode step and one scored
step, not one a compaction.
"""

from typing import Callable, Generator, Optional

import mlx.core as mx

from .compaction import check_bounded, compact_states
from .policies.policy import BasePolicy
from .states import cache as kv
from .states.layout import bucket
from .wrapper import FunctionalModel, QuerySlice


def greedy(logits: mx.array) -> mx.array:
    return mx.argmax(logits, axis=-1)[:, None]


def check_generating(policy: BasePolicy, interval, sliding_windows=()) -> None:
    """Refuses, by name and reason, a policy that cannot evict every ``interval`` generated
    tokens, or a model whose layers have these ``sliding_windows``."""
    check_bounded(sliding_windows, policy, policy.budget, 1, during="generating")
    if type(interval) is not int or interval <= policy.window:
        raise ValueError(f"interval must be an int > the policy's window {policy.window}, "
                         f"got {interval!r}")  # fmt: skip


def check_bounded_decode(states, policy: BasePolicy, interval) -> None:
    """Refuses, by name and reason, what cannot evict while generating ``states``."""
    check_generating(policy, interval, [getattr(s, "sliding_window", None) for s in states])
    kinds = {type(s).__name__ for s in states if type(s) is not kv.State}
    if kinds:
        raise ValueError(f"bounded_decode takes plain layer states, got {sorted(kinds)}")
    rows = {s.max_rows for s in states}
    if len(rows) != 1 or None in rows:
        raise ValueError(f"bounded_decode takes layers of one known row count, got {rows}")


def bounded_decode(
    fmodel: FunctionalModel,
    token: mx.array,
    states: tuple,
    policy: BasePolicy,
    *,
    steps: int,
    interval: int = 512,
    sample: Optional[Callable[[mx.array], mx.array]] = None,
) -> Generator[mx.array, None, tuple]:
    """Decode ``steps`` tokens after ``token`` (B, 1) over ``states`` (plain layers, e.g.
    ``kvfn.compact``'s), yielding each sampled token (B, 1) as a queued array (``sample``:
    logits (B, vocab) to tokens (B, 1); greedy by default). Whenever the rows held reach the
    budget plus ``interval``, the states are compacted back to the policy's budget, scored by
    the attention of the last ``policy.window`` decoded queries; so no more than budget +
    ``interval`` rows are ever held (kvpress's ``DecodingPress`` default interval: 512), in
    one capacity from the first step (states with more room are cut to it).
    Returns the states as its StopIteration value. A policy that cannot compact its own states
    again (``Policy.cannot_recompact``) is refused by name."""
    check_bounded_decode(states, policy, interval)
    sample = sample or greedy
    return _loop(fmodel, token, states, policy, steps, interval, sample)


def _loop(fmodel, token, states, policy, steps, interval, sample):
    cap = policy.budget + interval
    capacity = bucket(cap)
    held, scores = states[0].max_rows, None
    if held <= cap:  # one capacity from the first step, whatever room the caller reserved
        states = tuple(kv.fitted(s, capacity) for s in states)
    for _ in range(steps):
        if held + 1 > cap - policy.window:  # this step's query is in the observation window
            if scores is None:  # room for the window's rows now: the scores keep one shape
                states = tuple(kv.reserve(s, max(s.capacity, capacity)) for s in states)
                scores = tuple(mx.zeros((token.shape[0], h, states[0].capacity), mx.float32)
                               for h in fmodel.n_heads)  # fmt: skip
            logits, states, scores = fmodel.scored_step(token, states, scores, QuerySlice(0, 1),
                                                        check_ids=False)  # fmt: skip
        else:
            logits, states = fmodel.decode(token, states)
        held += 1
        token = sample(logits)
        mx.async_eval(token)
        yield token
        if held >= cap:
            states = compact_states(states, scores, policy, reserve=capacity - policy.budget,
                                    group=fmodel.group)[0]  # fmt: skip
            held, scores = policy.rows_after(held), None
    return states

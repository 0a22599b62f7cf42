"""``compact_steps``: ``compact`` one step at a time (kvfn-server interleaves its steps)."""

import re
from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import numpy as np
import pytest

import kvfn
from kvfn import FunctionalModel, SnapKV, StreamingLLM, compact_steps
from tests.test_shapes import LIBRARY, policy_of
from tests.tiny import tiny_model

IDS = np.random.default_rng(3).integers(1, 97, 50).tolist()  # 49 context tokens


@dataclass(frozen=True)
class StepScored(SnapKV):
    """SnapKV whose scores come from a pass of its own, in ``passes`` steps (as KVzip's)."""

    passes: int = 3
    name: ClassVar[str] = "stepscored"

    def score_steps(self, fmodel, tokens, states, gathered=None, *, step=None):
        scores = gathered
        for i in range(self.passes):
            scores = tuple(s * (i + 2) for s in scores)  # rescaled: the same rows win
            yield i + 1, self.passes
        return scores


def run(steps) -> tuple[list, tuple]:
    done = []
    while True:
        try:
            done.append(next(steps))
        except StopIteration as end:
            return done, end.value


def same_states(a, b) -> bool:
    arrays = kvfn.tree.arrays
    return all(np.array_equal(np.array(x), np.array(y)) for x, y in zip(arrays(a), arrays(b)))


@pytest.fixture(scope="module")
def fm():
    return FunctionalModel(tiny_model("llama"))


@pytest.mark.parametrize("policy", [SnapKV(budget=16, window=4), StreamingLLM(budget=12),
                                    StepScored(budget=16, window=4)], ids=str)  # fmt: skip
def test_steps_give_what_compact_gives(fm, policy):
    seen = []
    want, want_result = kvfn.compact(fm, IDS, policy, max_new_tokens=4, prefill_step_size=16,
                                     progress=lambda *d: seen.append(d))  # fmt: skip
    done, (states, result) = run(compact_steps(fm, IDS, policy, max_new_tokens=4,
                                               prefill_step_size=16))  # fmt: skip
    passes = [(49 + i, 49 + policy.passes) for i in range(1, policy.passes + 1)] if isinstance(
        policy, StepScored) else []  # fmt: skip
    assert done == [(16, 49), (32, 49), (48, 49), (49, 49), *passes]
    assert seen == done  # compact's progress: the same steps
    assert same_states(states, want)
    assert result == want_result


def test_settled_steps_evaluate_their_work(fm, monkeypatch):
    evals = []
    real_eval = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a: evals.append(1) or real_eval(*a))
    steps = compact_steps(fm, IDS, SnapKV(budget=16, window=4), prefill_step_size=16)
    counts = []
    for _ in steps:
        counts.append(len(evals))
    assert counts == [1, 2, 3, 4]  # each chunk, the last one too, before it yields
    assert len(evals) == 5  # and the compacted states before it returns
    evals.clear()
    kvfn.compact(fm, IDS, SnapKV(budget=16, window=4), prefill_step_size=16)
    assert len(evals) == 3  # compact leaves the last chunk and the compaction lazy


def test_bad_arguments_raise_when_called(fm):
    with pytest.raises(ValueError, match="prefill_step_size must be positive, got 0"):
        compact_steps(fm, IDS, SnapKV(budget=16, window=4), prefill_step_size=0)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0, got -1"):
        compact_steps(fm, IDS, SnapKV(budget=16, window=4), max_new_tokens=-1)
    with pytest.raises(ValueError, match=r"need a \(batch, length >= 2\) prompt"):
        compact_steps(fm, [5], SnapKV(budget=16, window=4))


def test_closed_midway_it_runs_no_further(fm):
    steps = compact_steps(fm, IDS, StepScored(budget=16, window=4), prefill_step_size=16)
    assert next(steps) == (16, 49)
    steps.close()
    with pytest.raises(StopIteration):
        next(steps)


@pytest.mark.parametrize("max_rows", [None, 24])
@pytest.mark.parametrize("name", LIBRARY)
def test_layer_steps_split_each_forward_and_change_nothing(fm, name, max_rows, monkeypatch):
    """``layers_per_step``: each settled forward (a prefill chunk, a piece of KVzip's pass, the
    compacted states) is evaluated that many layers a step, in layer order, yielding between
    steps; the states, the result and the steps' last progress are the unsplit job's, for
    every library policy, evicting while prefilling too where the policy can (where it cannot,
    the refusal is the same)."""
    policy = policy_of(name, fm)
    layers = len(fm.n_heads)
    kwargs = dict(max_new_tokens=4, prefill_step_size=16, pass_step_size=8, max_rows=max_rows)
    try:
        whole, (want, want_result) = run(compact_steps(fm, IDS, policy, **kwargs))
    except ValueError as refused:
        with pytest.raises(ValueError, match=re.escape(str(refused))):
            compact_steps(fm, IDS, policy, layers_per_step=2, **kwargs)
        return
    steps, real_eval = [], mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a: steps.append(len(a[0])) or real_eval(*a))
    split, (states, result) = run(compact_steps(fm, IDS, policy, layers_per_step=2, **kwargs))
    assert same_states(states, want) and result == want_result
    assert len(split) > len(whole) and split[-1] == whole[-1]
    assert all(a[0] <= b[0] for a, b in zip(split, split[1:]))  # progress never goes back
    per_forward = [2] * ((layers - 1) // 2) + [layers]  # steps of 2 layers, then the rest
    assert steps[: len(per_forward)] == per_forward


def test_layer_steps_must_be_a_positive_int(fm):
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match=f"layers_per_step must be an int >= 1 or None, "
                                             f"got {bad!r}"):  # fmt: skip
            compact_steps(fm, IDS, SnapKV(budget=16, window=4), layers_per_step=bad)

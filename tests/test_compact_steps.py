"""``compact_steps``: ``compact`` one step at a time (kvfn-server interleaves its steps)."""

from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import numpy as np
import pytest

import kvfn
from kvfn import FunctionalModel, SnapKV, StreamingLLM, compact_steps
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

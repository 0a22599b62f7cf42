"""Bounded memory while prefilling: ``compact(..., max_rows=R)`` never holds more than R rows plus
a chunk, whatever the prompt's length, keeps every row's true position, and is the chunk-by-chunk
composition of the public steps (prefill a chunk over what is held, compact it back to the
budget); a policy that cannot is refused by name and reason."""

import mlx.core as mx
import pytest

import kvfn
from kvfn.compaction import bounded_chunks
from kvfn.policies.policy import POLICIES as REGISTRY
from tests.test_shapes import LIBRARY, policy_of
from tests.tiny import tiny_model

STEP, WINDOW = 32, 8


@pytest.fixture(scope="module")
def fm():
    return kvfn.FunctionalModel(tiny_model("llama"))


def prompt(n: int, seed: int = 1) -> list:
    return mx.random.randint(0, 97, (1, n), key=mx.random.key(seed)).tolist()[0]


def first_logits(fm, ids, states):
    return fm.decode(mx.array([[ids[-1]]]), states)[0]


def test_a_cap_the_prompt_never_reaches_changes_nothing(fm):
    """(200 context tokens: the same chunks of 32 either way, the last one holding the window.)"""
    ids, policy = prompt(201), kvfn.SnapKV(budget=32, window=WINDOW)
    bounded, r = kvfn.compact(fm, ids, policy, max_rows=400, prefill_step_size=STEP)
    plain, _ = kvfn.compact(fm, ids, policy, prefill_step_size=STEP)
    assert r.peak_rows == 200
    assert mx.array_equal(first_logits(fm, ids, bounded), first_logits(fm, ids, plain)).item()


@pytest.mark.parametrize("name", ["snapkv", "streaming"])
def test_the_peak_is_the_cap_plus_a_chunk_at_any_length(fm, name):
    """However long the prompt, no more than max_rows + a chunk (the last: + the window) are
    held; the kept rows keep their true positions: the sinks, the last window, in order."""
    policy = kvfn.parse_policy(name, budget=32, **({} if name == "streaming" else {"window": 8}))
    peaks = []
    for n in (150, 400, 900):
        states, r = kvfn.compact(fm, prompt(n), policy, max_rows=48, prefill_step_size=STEP)
        peaks.append(r.peak_rows)
        assert r.peak_rows <= 48 + STEP + WINDOW and set(r.rows_after) == {32}
        for s in states:
            pos = s.positions[0, 0, :32].tolist()
            assert pos == sorted(pos) and len(set(pos)) == 32
            assert pos[:4] == [0, 1, 2, 3] and pos[-WINDOW:] == list(range(n - 1 - WINDOW, n - 1))
    assert max(peaks) - min(peaks) < WINDOW, peaks  # the last chunk alone differs


def test_it_is_the_chunk_by_chunk_composition_of_the_public_steps(fm):
    """The oracle: prefill a chunk after what is held (scoring its last queries), compact back
    to the budget with room for the next chunk when the cap is passed, and compact the last."""
    ids, policy, cap = prompt(300), kvfn.SnapKV(budget=32, window=WINDOW), 48
    got, _ = kvfn.compact(fm, ids, policy, max_rows=cap, prefill_step_size=STEP,
                          max_new_tokens=4)  # fmt: skip
    context = mx.array([ids[:-1]])
    parts = bounded_chunks(context.shape[1], STEP, WINDOW)
    states, held = None, 0
    for j, (start, stop) in enumerate(parts):
        states, scores = kvfn.scored_prefill(fm, context[:, start:stop], window=WINDOW,
                                             states=states, prefill_step_size=STEP * 2)  # fmt: skip
        held += stop - start
        if held > cap and j + 1 < len(parts):
            room = parts[j + 1][1] - parts[j + 1][0]
            states, _ = kvfn.compact_states(states, scores, policy, reserve=room)
            held = 32
    want, _ = kvfn.compact_states(states, scores, policy, reserve=5)
    assert mx.array_equal(first_logits(fm, ids, got), first_logits(fm, ids, want)).item()


@pytest.mark.parametrize("name", LIBRARY)
def test_every_policy_evicts_while_prefilling_or_is_refused_by_name(fm, name):
    policy = policy_of(name, fm)
    ids = prompt(160)
    if REGISTRY[name].while_prefilling:
        with pytest.raises(ValueError, match=f"{name} cannot evict while prefilling: .+"):
            kvfn.compact(fm, ids, policy, max_rows=policy.budget)
        return
    _, r = kvfn.compact(fm, ids, policy, max_rows=policy.budget, prefill_step_size=16)
    assert r.peak_rows <= policy.budget + 16 + policy.window
    assert set(r.rows_after) == {policy.budget}


@pytest.mark.parametrize(
    "max_rows, settings, message",
    [
        (31, {}, "max_rows must be an int >= the policy's budget 32, got 31"),
        (40, {"min_tokens": 64}, "max_rows 40 is below the policy's min_tokens 64"),
    ],
)
def test_bad_caps_are_refused_by_value(fm, max_rows, settings, message):
    policy = kvfn.SnapKV(budget=32, window=WINDOW, **settings)
    with pytest.raises(ValueError, match=message):
        kvfn.compact(fm, prompt(100), policy, max_rows=max_rows)


def test_a_model_with_sliding_window_layers_is_refused():
    fm = kvfn.FunctionalModel(tiny_model("gemma3_text"))
    with pytest.raises(ValueError, match="sliding-window layers"):
        kvfn.compact(fm, prompt(100), kvfn.SnapKV(budget=32, window=WINDOW), max_rows=40)

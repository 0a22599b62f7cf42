"""A context compacted once, asked many times (the library side): ``kvfn.prefill(fm, question,
states=compacted)`` per question over one compacted context, which stays as it was, and the same
context shipped through a file (``kvfn.tree.save`` / ``load``). The oracle: each answer equals
one full-sequence pass where the question's and the answer's queries see the context rows the
compaction kept and every row from the question on."""

import mlx.core as mx
import numpy as np
import pytest

import kvfn
from kvfn.policies.policy import POLICIES as REGISTRY
from kvfn.states import ragged
from tests.test_duo import TOL, greedy_logits, kept_visibility, reference_logits
from tests.test_shapes import LIBRARY
from tests.tiny import tiny_model

QUESTIONS = ([7, 8, 9, 10, 11], [12, 13, 14])


def context_rows(state, n: int) -> list:
    """Per KV head, the context positions (< n) a compacted layer holds."""
    if isinstance(state, ragged.RaggedKVCache):
        pos = [np.array(ragged.head_rows(state, 0, h)[2]) for h in range(state.n_kv_heads)]
    else:
        pos = [
            np.array(state.positions[0, h, : state.max_rows]) for h in range(state.keys.shape[1])
        ]
    return [p[p < n] for p in pos]


def gap(fm, ids, states, kept, C: int, steps: int = 4) -> float:
    """Max |logit gap| of decoding ``states`` against the full pass where every query from
    position C on (the question, the answer) sees, in KV head h of layer i, the context rows
    ``kept[i][h]`` and every row from C on; the context's own queries are causal."""
    logits, tokens = greedy_logits(fm, ids, states, steps)
    T = len(tokens) - 1
    ref = reference_logits(fm.model, mx.array([tokens[:T]]), kept_visibility(fm, kept, C, T))
    return mx.abs(logits - ref[len(ids) - 1 :]).max().item()


AGNOSTIC = [n for n in LIBRARY if REGISTRY[n].query_agnostic]


def test_the_registry_says_which_policies_are_query_agnostic():
    assert set(AGNOSTIC) == {"adakvzip", "kvzip", "random", "streaming"}


@pytest.mark.parametrize("name", [*AGNOSTIC, "adakvzip-global"])
def test_one_compacted_context_answers_every_question_exactly(name, tmp_path):
    fm = kvfn.FunctionalModel(tiny_model("llama"))
    context = np.random.default_rng(3).integers(0, 97, 120).tolist()
    policy = kvfn.parse_policy(name, budget=24, **({} if name == "streaming" else {"window": 4}))
    compacted, _ = kvfn.compact(fm, context, policy, max_new_tokens=0)  # all but its last token
    before = [mx.array(a) for a in kvfn.tree.arrays(compacted)]
    kvfn.tree.save(tmp_path / "context.safetensors", compacted)
    shipped, _ = kvfn.tree.load(tmp_path / "context.safetensors")
    C = len(context) - 1
    kept = [context_rows(s, C) for s in compacted]
    assert sum(len(k) for layer in kept for k in layer) <= 24 * sum(fm.n_kv_heads) < C * 6
    for question in QUESTIONS:
        ids = context + question
        rest = mx.array([ids[C:-1]])  # the context's last token, then the question's
        states = kvfn.prefill(fm, rest, states=compacted)
        assert gap(fm, ids, states, kept, C) < TOL
        again = kvfn.prefill(fm, rest, states=shipped)
        token = mx.array([[ids[-1]]])
        assert mx.array_equal(fm.decode(token, again)[0], fm.decode(token, states)[0]).item()
    after = kvfn.tree.arrays(compacted)
    assert all(mx.array_equal(a, b).item() for a, b in zip(before, after))

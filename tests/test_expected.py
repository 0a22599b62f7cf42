"""Expected Attention: the prefill's query moments, the averaged RoPE, the expected attention
against a Monte Carlo estimate, selection on hand-made queries and keys, the evaluator, and
bad settings. (Compaction's exactness: the one policy suite, tests/test_policies.py.)"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import kvfn
from kvfn import ExpectedAttention, FunctionalModel, QuerySlice, parse_policy, query_statistics
from kvfn.policies.expected import average_rotation, expected_attention
from kvfn_eval import tasks
from kvfn_eval.evaluator import Evaluator, Method, token_counter
from tests.tiny import tiny_model


def layer0_queries(model, ids):
    """Layer 0's queries before RoPE, computed directly from the model's modules."""
    inner = model.model
    x = inner.embed_tokens(mx.array([ids]))
    attn = inner.layers[0].self_attn
    q = attn.q_proj(inner.layers[0].input_layernorm(x))
    return q.reshape(1, len(ids), attn.n_heads, -1).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: a q_proj bias
def test_prefill_gathers_the_moments_of_the_queries_before_rope(family):
    model = tiny_model(family)
    fm = FunctionalModel(model)
    ids = np.random.default_rng(3).integers(0, 97, 45).tolist()
    sinks = 4
    one = kvfn.scored_prefill(fm, mx.array([ids]), window=len(ids) - sinks, statistic="moments",
                              prefill_step_size=64)[1]  # fmt: skip
    chunked = kvfn.scored_prefill(fm, mx.array([ids]), window=len(ids) - sinks,
                                  statistic="moments", prefill_step_size=7)[1]  # fmt: skip
    for a, b in zip(one, chunked):
        assert a.shape == (1, 4, 18, 16)
        assert np.allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-4)
    q = np.array(layer0_queries(model, ids))[0, :, sinks:]  # (heads, n, D)
    mean, cov = query_statistics(one[0])
    assert np.allclose(np.array(mean)[0], q.mean(axis=1), atol=1e-5)
    centered = q - q.mean(axis=1, keepdims=True)
    want = np.einsum("hni,hnj->hij", centered, centered) / q.shape[1]
    assert np.allclose(np.array(cov)[0], want, atol=1e-4)
    with pytest.raises(ValueError, match="query moments hold no queries"):
        query_statistics(mx.zeros((1, 2, 6, 4)))


@pytest.mark.parametrize("traditional", [False, True])
def test_average_rotation_is_the_mean_of_ropes_rotations(traditional):
    D, base, start, n = 8, 100.0, 37, 50
    rope = nn.RoPE(D, traditional=traditional, base=base)
    rot = np.array(average_rotation(rope, start, n, D))
    q = np.random.default_rng(0).normal(size=D).astype(np.float32)
    rotated = rope(mx.broadcast_to(mx.array(q)[None, None, None], (1, 1, n, D)), offset=start)
    assert np.allclose(rot @ q, np.array(rotated)[0, 0].mean(axis=0), atol=1e-5)
    theta = base ** (-np.arange(0, D, 2) / D)
    t = np.arange(start, start + n)[:, None] * theta[None]
    c, s = np.cos(t).mean(axis=0), np.sin(t).mean(axis=0)
    lo, hi = (np.arange(0, D, 2), np.arange(1, D, 2)) if traditional else (np.arange(D // 2), np.arange(D // 2, D))  # fmt: skip
    want = np.zeros((D, D))
    want[lo, lo], want[lo, hi], want[hi, lo], want[hi, hi] = c, -s, s, c
    assert np.allclose(rot, want, atol=1e-5)


def test_expected_attention_is_the_mean_over_gaussian_queries():
    rng = np.random.default_rng(1)
    D, P, scale, sinks = 4, 7, 0.5, 2
    keys = rng.normal(size=(1, 1, P, D)).astype(np.float32)
    mean = rng.normal(size=(1, 2, D)).astype(np.float32)
    a = rng.normal(size=(2, D, D)) * 0.5
    cov = (a @ a.transpose(0, 2, 1))[None].astype(np.float32)
    got = np.array(expected_attention(mx.array(keys), mx.array(mean), mx.array(cov), scale, sinks))
    for h in range(2):
        q = rng.multivariate_normal(mean[0, h], cov[0, h], size=400_000)
        weight = np.exp(scale * q @ keys[0, 0].T).mean(axis=0)  # E[exp(scale q.k)] per row
        weight[:sinks] = 0
        assert np.allclose(got[0, h], weight / weight.sum(), rtol=0.02, atol=1e-4)
    plain = np.array(expected_attention(mx.array(keys), mx.array(mean), None, scale))
    logits = scale * np.einsum("hd,pd->hp", mean[0], keys[0, 0])
    assert np.allclose(plain[0], np.exp(logits) / np.exp(logits).sum(-1, keepdims=True), atol=1e-5)


def test_selection_follows_the_mean_the_spread_and_the_value_norm():
    """Row 10 lies along the queries' mean, row 20 along their spread (orthogonal to the mean),
    row 30 along neither but with a large value: the mean alone keeps 10; the covariance adds
    20; the value norm prefers 30 over equally attended rows."""
    D, P, sinks, window = 4, 40, 2, 4
    keys = np.zeros((1, 1, P, D), np.float32)
    keys[0, 0, :, 3] = 0.1
    keys[0, 0, 10, 0], keys[0, 0, 20, 1] = 2.0, 3.0
    mean = np.array([[[2.0, 0, 0, 0]]], np.float32)
    cov = np.diag([0.01, 4.0, 0.01, 0.01]).astype(np.float32)[None, None]
    values = np.ones((1, 1, P, D), np.float32)
    values[0, 0, 30] = 20.0

    def kept(covariance, value_norm, budget):
        s = expected_attention(mx.array(keys), mx.array(mean),
                               mx.array(cov) if covariance else None, 1.0, sinks)  # fmt: skip
        if value_norm:
            s = s * mx.linalg.norm(mx.array(values), axis=-1)
        p = ExpectedAttention(budget=budget, window=window, sink_tokens=sinks)
        idx = p.keep_indices(s, prompt_length=P, n_kv_heads=1)
        return set(np.array(idx)[0, 0].tolist()) - set(range(sinks)) - set(range(P - window, P))

    assert kept(False, False, 7) == {10}
    assert kept(True, False, 8) == {10, 20}
    assert kept(False, True, 8) == {10, 30}


def test_compact_scores_each_layer_once_and_keeps_every_layers_choice():
    fm = FunctionalModel(tiny_model("qwen2"))
    ids = np.random.default_rng(5).integers(0, 97, 60).tolist()
    policy = ExpectedAttention(budget=24, window=4, sink_tokens=2, future=32)
    states, result = kvfn.compact(fm, ids, policy, max_new_tokens=2)
    assert result.rows_after == (24, 24)
    context = mx.array([ids[:-1]])
    full, moments = kvfn.scored_prefill(fm, context, window=57, statistic="moments")
    scores = policy.score_prompt(fm, context, full, moments)
    for i, (s, state) in enumerate(zip(scores, states)):
        assert s.shape == (1, 4, 59)
        assert np.allclose(np.array(s).sum(-1) > 0, True)
        want = policy.keep_indices(s, prompt_length=59, n_kv_heads=2, layer=i)
        assert np.array_equal(np.array(state.positions[:, :, :24]), np.array(want))
    with pytest.raises(ValueError, match="needs the prefill's query moments"):
        policy.score_prompt(fm, context, full)
    with pytest.raises(ValueError, match="not query moments"):
        policy.keep_indices(moments[0], prompt_length=59, n_kv_heads=2)


def test_expected_runs_in_the_evaluator_in_both_modes(smollm2):
    model, tokenizer = smollm2
    sample = tasks.generate("passkey", seed=0, target_tokens=300,
                            count_tokens=token_counter(tokenizer), n_questions=1)  # fmt: skip
    ev = Evaluator(model, tokenizer, window=16)
    methods = [Method.parse(m) for m in ["full", "expected", "expected-mean", "snapkv"]]
    assert ev.gathers_moments(methods) and not ev.gathers_moments(methods[3:])
    records = ev.run(sample, methods, budgets=[96])
    by = {(r["mode"], r["method"]): r for r in records}
    for mode in ("aware", "agnostic"):
        assert by[(mode, "expected")]["rows"] == 96 and by[(mode, "expected")]["score_seconds"] > 0
        assert by[(mode, "expected-mean")]["score_seconds"] > 0  # its own scores, not expected's


def test_parser_and_bad_settings_are_named():
    assert parse_policy("expected-mean-nov-layer-f64", budget=64) == ExpectedAttention(
        budget=64, covariance=False, value_norm=False, per_head=False, future=64
    )
    for make, message in [
        (lambda: ExpectedAttention(budget=64, future=0), "expected future must be 1 to 65536 positions, got 0"),
        (lambda: ExpectedAttention(budget=64, future=65537), "must be 1 to 65536 positions, got 65537"),
        (lambda: ExpectedAttention(budget=64, covariance=1), "expected covariance must be a bool, got 1"),
        (lambda: QuerySlice(0, 4, "keys"), "statistic must be one of .*, got 'keys'"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            make()
    fm = FunctionalModel(tiny_model("llama"))
    with pytest.raises(ValueError, match="statistic must be one of .*, got 'mean'"):
        kvfn.scored_prefill(fm, mx.array([[1, 2, 3]]), window=2, statistic="mean")
    assert ExpectedAttention(budget=64).observation_window(50) == 0  # kept whole
    assert ExpectedAttention(budget=64).observation_window(500) == 496  # all but the sinks


def test_policies_share_a_scoring_only_when_it_cannot_differ():
    def scoring(name, budget=64):
        return parse_policy(name, budget=budget).scoring()

    assert scoring("expected") == scoring("expected", budget=128)  # the budget does not score
    assert scoring("expected") != scoring("expected-mean") != scoring("expected-nov")
    assert scoring("expected") != scoring("expected-f64")
    assert scoring("kvzip") == scoring("kvzip-layer") == scoring("adakvzip-global")  # one pass
    assert scoring("kvzip") != scoring("kvzip-c256") != scoring("snapkv")


def test_the_average_rotation_is_the_same_summed_in_chunks():
    rope = FunctionalModel(tiny_model("llama")).rope(0)
    whole = average_rotation(rope, 5, 100, 16)
    assert mx.abs(average_rotation(rope, 5, 100, 16, chunk=7) - whole).max().item() < 1e-6
    q = mx.random.normal((16,))
    mean = mx.mean(rope(mx.broadcast_to(q, (1, 1, 100, 16)), offset=5)[0, 0], axis=0)
    assert mx.abs(whole @ q - mean).max().item() < 1e-5  # R @ q = mean_t rope(q at t)

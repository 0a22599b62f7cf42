"""KVzip: selection from max scores, the reconstruction pass against a brute-force reference,
compaction on SmolLM2, the evaluator, and bad settings."""

import mlx.core as mx
import mlx_lm.models.llama as llama
import mlx_lm.models.qwen2 as qwen2
import numpy as np
import pytest

import kvfn
from kvfn import KVzip, parse_policy, reconstruction_scores, repeat_prompt
from kvfn.kvzip import AdaKVzip
from kvfn_eval import answers, tasks
from kvfn_eval.evaluator import Evaluator, Method, prompt_tokens, token_counter
from tests.tiny import tiny_model

MODULES = {"llama": llama, "qwen2": qwen2}


def test_a_planted_row_is_kept_and_one_sharp_hit_beats_many_small_ones():
    P, n_heads = 40, 4  # 4 query heads over 2 KV heads
    s = np.full((1, n_heads, P), 0.01, np.float32)
    s[0, 0, 17] = 0.9  # one query head's sharp hit (KV head 0)
    s[0, :2, 23] = 0.4  # KV head 0's both query heads, spread: sum 0.8, mean 0.4 < 0.9 / 2
    s[0, 3, 9] = 0.7  # KV head 1 only
    p = KVzip(budget=8, window=4, sink_tokens=2)
    idx = np.array(p.keep_indices(mx.array(s), prompt_length=P, n_kv_heads=2))
    head0, head1 = idx[0, 0].tolist(), idx[0, 1].tolist()
    assert head0[:2] == [0, 1] and head0[-4:] == [36, 37, 38, 39]
    assert head0[2:4] == [17, 23] and 9 not in head0  # sharp first, then the spread row
    assert 9 in head1 and 17 not in head1
    one = KVzip(budget=7, window=4, sink_tokens=2)  # room for one middle row: the sharp hit
    assert np.array(one.keep_indices(mx.array(s), prompt_length=P, n_kv_heads=2))[0, 0, 2] == 17
    layer = np.array(p.replace(per_head=False).keep_indices(mx.array(s), prompt_length=P,
                                                            n_kv_heads=2))  # fmt: skip
    assert layer[0, 0].tolist() == layer[0, 1].tolist() and {9, 17} <= set(layer[0, 0])


def test_pooling_keeps_a_hits_neighbours():
    s = np.zeros((1, 2, 40), np.float32)
    s[0, 0, 20] = 1.0
    p = KVzip(budget=9, window=4, sink_tokens=2, kernel_size=3)
    assert np.array(p.keep_indices(mx.array(s), prompt_length=40, n_kv_heads=1))[0, 0, 2:5].tolist() == [19, 20, 21]  # fmt: skip


def test_adakvzip_shares_a_layers_rows_among_heads_by_score():
    s = np.full((1, 4, 40), 0.01, np.float32)
    s[0, :2, 10:20] = 1.0  # KV head 0 (query heads 0, 1) attends to ten rows
    p = AdaKVzip(budget=10, window=4, sink_tokens=2, floor=0)
    keep = p.allocation(mx.array(s), prompt_length=40, n_kv_heads=2)
    fixed = {0, 1, 36, 37, 38, 39}
    assert len(keep[0]) == 14 and len(keep[1]) == 6  # 2 x 10 rows, by score
    assert set(keep[1]) == fixed and set(keep[0]) - fixed <= set(range(10, 20))
    assert parse_policy("adakvzip-k3-f10", budget=64) == AdaKVzip(budget=64, kernel_size=3,
                                                                  floor=10)  # fmt: skip
    fm = kvfn.FunctionalModel(tiny_model("llama"))
    ids = np.random.default_rng(2).integers(0, 97, 40).tolist()
    policy = AdaKVzip(budget=12, window=4, sink_tokens=2)
    states, result = kvfn.compact(fm, ids, policy, max_new_tokens=2)
    assert result.total_rows_after == 3 * 12  # 12 rows a KV head on average
    logits, _ = fm.forward(mx.array([ids[-1:]]), states)
    assert logits.shape == (1, 1, 97) and not mx.isnan(logits).any().item()


def test_adakvzip_global_ranks_every_layers_pairs_together():
    rng = np.random.default_rng(0)
    s0 = rng.uniform(0.0, 0.01, (1, 4, 40)).astype(np.float32)
    s0[0, :2, 10:22] = 1.0  # layer 0, KV head 0: twelve sharp rows
    s1 = rng.uniform(0.02, 0.03, (1, 4, 40)).astype(np.float32)  # layer 1: flat, above the rest
    p = parse_policy("adakvzip-global", budget=10, window=4, sink_tokens=2)
    assert p.across_layers and p.floor == 0
    planned = p.planned([mx.array(s0), mx.array(s1)], prompt_length=40, n_kv_heads=(2, 2))
    # 2 layers x 2 heads x 10 = 40 pairs: 24 forced, the 12 sharp ones, 4 of layer 1's
    assert planned.layer_budgets == (12, 8)
    layer0 = planned.for_layer(0, 2)
    assert layer0.budget == 12 and not layer0.across_layers and layer0.layer_budgets == ()
    fm = kvfn.FunctionalModel(tiny_model("llama"))
    ids = np.random.default_rng(1).integers(0, 97, 40).tolist()
    _, result = kvfn.compact(fm, ids, p.replace(budget=12), max_new_tokens=2)
    assert result.total_rows_after == 3 * 12  # the memory of a flat budget, shared unevenly
    with pytest.raises(ValueError, match="adakvzip layer_budgets must be a tuple of ints >= 6"):
        p.replace(layer_budgets=(12, 5))


def brute_force(model, module, monkeypatch, sequence, P):
    """Per layer, the max attention (n_heads, P) the prompt rows get from the queries after
    them, from one plain mlx-lm forward over the whole sequence with a manual softmax."""
    weights = []

    def attend(queries, keys, values, cache, scale, mask, sinks=None):
        rep = queries.shape[1] // keys.shape[1]
        k, v = mx.repeat(keys, rep, axis=1), mx.repeat(values, rep, axis=1)
        logits = (queries * scale) @ k.swapaxes(-1, -2)
        T = queries.shape[2]
        causal = mx.arange(T)[:, None] >= mx.arange(T)[None]
        w = mx.softmax(mx.where(causal, logits, -mx.inf), axis=-1, precise=True)
        weights.append(w[0])
        return w @ v

    monkeypatch.setattr(module, "scaled_dot_product_attention", attend)
    mx.eval(model(mx.array([sequence])))
    return [np.array(mx.max(w[:, P:, :P], axis=1)) for w in weights]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_pass_is_the_max_over_reconstruction_queries_of_one_full_forward(family, monkeypatch):
    model = tiny_model(family)
    fm = kvfn.FunctionalModel(model)
    rng = np.random.default_rng(3)
    context, prompt = rng.integers(0, 97, 37).tolist(), (5, 11, 2)
    states = kvfn.prefill(fm, mx.array([context]), prefill_step_size=16)
    got = reconstruction_scores(fm, mx.array([context]), states, prompt=prompt, chunk=6)
    want = brute_force(model, MODULES[family], monkeypatch, context + list(prompt) + context, 37)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == (1, 4, 37)
        np.testing.assert_allclose(np.array(g[0]), w, atol=2e-5)
    assert int(states[0].rows.item()) == 37  # the prefilled states are untouched


def test_window_attention_max_is_the_max_over_queries_in_any_pieces():
    rng = np.random.default_rng(4)
    state = kvfn.cache.init(1, 2, 8, 24)
    k = mx.array(rng.normal(size=(1, 2, 20, 8)), mx.float32)
    state = kvfn.update(state, k, k)
    q = mx.array(rng.normal(size=(1, 4, 9, 8)), mx.float32)
    qpos = mx.arange(11, 20)[None]
    want = mx.max(kvfn.scores.window_attention_scores(q, qpos, state, 0.3, reduce=False), axis=2)
    for piece in (1, 4, 9, 64):
        got = kvfn.scores.window_attention_max(q, qpos, state, 0.3, piece=piece)
        assert got.shape == (1, 4, 24) and mx.allclose(got, want).item()
    with pytest.raises(ValueError, match="piece must be >= 1, got 0"):
        kvfn.scores.window_attention_max(q, qpos, state, 0.3, piece=0)


def test_compact_with_kvzip_on_smollm2_finds_the_passkey(smollm2):
    """Query-agnostic: the context alone is compacted to 25%, then the question is asked."""
    model, tokenizer = smollm2
    fm = kvfn.FunctionalModel(model)
    sample = tasks.generate("passkey", seed=0, target_tokens=400,
                            count_tokens=token_counter(tokenizer), n_questions=1)  # fmt: skip
    p = prompt_tokens(tokenizer, sample, sample.questions[0])
    budget = len(p.head) // 4
    policy = KVzip(budget=budget, window=8, prompt=repeat_prompt(tokenizer))
    states, result = kvfn.compact(fm, p.head + p.tail[:1], policy, max_new_tokens=16)
    assert result.rows_after == (budget,) * len(states)
    logits, states = fm.forward(mx.array([p.tail]), states)
    out = []
    for _ in range(8):
        token = int(mx.argmax(logits[0, -1]).item())
        out.append(token)
        logits, states = fm.forward(mx.array([[token]]), states)
    assert answers.match_all(tokenizer.decode(out), sample.questions[0].answers) == 1.0


def test_repeat_prompt_closes_the_chat_turn(smollm2):
    _, tokenizer = smollm2
    text = tokenizer.decode(list(repeat_prompt(tokenizer)))
    assert text.startswith("\n\nRepeat the previous context exactly.")
    if getattr(tokenizer, "chat_template", None):
        assert "assistant" in text


def test_kvzip_runs_in_the_evaluator_in_both_modes(smollm2):
    model, tokenizer = smollm2
    sample = tasks.generate("passkey", seed=0, target_tokens=300,
                            count_tokens=token_counter(tokenizer), n_questions=1)  # fmt: skip
    ev = Evaluator(model, tokenizer, window=16)
    methods = [Method.parse(m) for m in ["full", "kvzip", "kvzip-layer"]]
    records = ev.run(sample, methods, budgets=[96])
    by = {(r["mode"], r["method"]): r for r in records}
    for mode in ("aware", "agnostic"):
        zipped = by[(mode, "kvzip")]
        assert zipped["rows"] == 96 and zipped["score_seconds"] > 0
        assert by[(mode, "full")]["score_seconds"] == 0.0
        assert by[(mode, "kvzip-layer")]["score_seconds"] == zipped["score_seconds"]  # shared
        assert zipped["prefill_seconds"] > 0


def test_parser_and_bad_settings_are_named():
    assert parse_policy("kvzip-layer-k3-c64", budget=64) == KVzip(
        budget=64, per_head=False, kernel_size=3, chunk=64
    )
    for make, message in [
        (lambda: KVzip(budget=64, prompt=[1, 2]), "kvzip prompt must be a tuple of token ids, got \\[1, 2\\]"),
        (lambda: KVzip(budget=64, prompt=(1, -2)), "kvzip prompt must be a tuple of token ids, got \\(1, -2\\)"),
        (lambda: KVzip(budget=64, kernel_size=2), "kvzip kernel_size must be odd and >= 1, got 2"),
        (lambda: KVzip(budget=64, chunk=0), "kvzip chunk must be >= 1, got 0"),
        (lambda: KVzip(budget=64, per_head=1), "kvzip per_head must be a bool, got 1"),
        (lambda: KVzip(budget=20), "kvzip budget 20 is below sink_tokens \\+ window = 4 \\+ 32"),
        (lambda: parse_policy("kvzip-avg", budget=64), "unknown option 'avg' for policy 'kvzip'"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            make()
    with pytest.raises(ValueError, match="kvzip needs reconstruction_scores"):
        KVzip(budget=40).keep_indices(None, prompt_length=50, n_kv_heads=1)


def test_bad_reconstruction_inputs_are_named():
    fm = kvfn.FunctionalModel(tiny_model("llama"))
    ids = mx.array([list(range(20))])
    states = kvfn.prefill(fm, ids)
    for tokens, kwargs, message in [
        (ids[0], {}, "tokens of shape \\(batch, n >= 1\\), got \\(20,\\)"),
        (ids, {"chunk": 0}, "chunk must be >= 1, got 0"),
        (ids[:, :19], {}, "states must hold the 19 prefilled tokens' rows, got rows \\{20\\}"),
    ]:
        with pytest.raises(ValueError, match=message):
            reconstruction_scores(fm, tokens, states, **kwargs)


def test_the_tokenizer_gives_kvzip_its_repeat_instruction(smollm2):
    _, tokenizer = smollm2
    policy = parse_policy("adakvzip-global", budget=64)
    assert policy.prompt == () and policy.for_tokenizer(tokenizer).prompt == repeat_prompt(
        tokenizer
    )
    own = KVzip(budget=64, prompt=(5, 6))
    assert own.for_tokenizer(tokenizer) is own  # a prompt of its own stays
    snap = parse_policy("snapkv", budget=64)
    assert snap.for_tokenizer(tokenizer) is snap

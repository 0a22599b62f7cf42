"""The exactness oracle, compiled steps, batching and model families."""

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import generate
from mlx_lm.models.cache import make_prompt_cache

import kvfn
from kvfn import FunctionalModel
from kvfn import cache as kv
from kvfn import compact_prompt_cache, prefill, scored_prefill
from tests.tiny import FAMILIES, tiny_model

TOL = 1e-4  # float32: the same rows summed in another order (gathered vs masked)


def greedy(logits):
    return mx.argmax(logits, axis=-1)[:, None]


def oracle_gap(fm, ids, steps=4, **snapkv):
    """Max |logit difference| between decoding from the compacted state and from the full cache
    restricted to the retained (layer, head, position) set; and the gap to the unrestricted one."""
    compacted, result = compact_prompt_cache(fm, ids, max_new_tokens=steps, **snapkv)
    P = len(ids) - 1
    full = prefill(fm, mx.array([ids[:-1]]), capacity=P + steps + 1)
    restricted = tuple(
        f if w is not None else kv.restrict(f, c.positions[:, :, : c.rows.item()])
        for f, c, w in zip(full, compacted, fm.sliding_windows)
    )
    token, gap, full_gap = mx.array([[ids[-1]]]), 0.0, 0.0
    for _ in range(steps):
        a, compacted = fm.decode(token, compacted)
        b, restricted = fm.decode(token, restricted)
        c, full = fm.decode(token, full)
        gap = max(gap, mx.abs(a - b).max().item())
        full_gap = max(full_gap, mx.abs(a - c).max().item())
        token = greedy(a)
    return gap, full_gap, result


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_compacted_decode_equals_masked_full_cache(family):
    fm = FunctionalModel(tiny_model(family))
    ids = np.random.default_rng(0).integers(0, 97, 60).tolist()
    for per_head in (True, False):
        gap, full_gap, result = oracle_gap(fm, ids, budget=16, window=4, sink_tokens=2,
                                           per_head=per_head, prefill_step_size=16)  # fmt: skip
        assert gap < TOL, (family, per_head)
        assert full_gap > 100 * TOL  # eviction did change the logits: the oracle is not vacuous
    full_layers = [i for i, w in enumerate(fm.sliding_windows) if w is None]
    assert all(result.rows_after[i] == 16 for i in full_layers)
    assert all(result.rows_before[i] == 59 for i in range(len(fm.sliding_windows)))
    assert result.total_bytes_after < result.total_bytes_before


def test_sliding_window_layers_are_cut_to_their_window_only():
    fm = FunctionalModel(tiny_model("gemma3_text"))
    ids = list(range(40))
    states, result = compact_prompt_cache(fm, ids, budget=12, window=4, max_new_tokens=2)
    for i, w in enumerate(fm.sliding_windows):
        if w is not None:
            assert result.rows_after[i] == w
            assert np.array(states[i].positions)[0, 0, :w].tolist() == list(range(39 - w, 39))


def test_compiled_and_eager_steps_agree_and_decode_traces_once():
    fm = FunctionalModel(tiny_model("llama"))
    ids = list(range(1, 30))
    states, _ = compact_prompt_cache(fm, ids, budget=12, window=4, max_new_tokens=100)
    eager = states
    token = mx.array([[ids[-1]]])
    before = fm.traces
    for step in range(100):
        logits, states = fm.decode(token, states)
        if step < 5:
            eager_logits, eager = fm.forward(token, eager)
            assert mx.abs(logits - eager_logits[:, -1]).max().item() < 1e-5
        token = greedy(logits)
    assert fm.traces - before == 1
    assert states[0].rows.item() == 112 and states[0].offset.item() == 128


def test_chunked_scoring_equals_one_chunk():
    """The observation window spans chunks: the scores must not depend on the chunking."""
    fm = FunctionalModel(tiny_model("qwen3"))
    ids = mx.array([list(range(3, 43))])
    _, one = scored_prefill(fm, ids, capacity=40, prefill_step_size=40, window=12)
    _, many = scored_prefill(fm, ids, capacity=40, prefill_step_size=7, window=12)
    for a, b in zip(one, many):
        assert mx.abs(a - b).max().item() < 1e-5
        assert abs(mx.sum(a[0, 0]).item() - 12) < 1e-3  # each window query's weights sum to 1


def test_compiled_scoring_equals_eager():
    """The window scoring traced into the compiled step (on CUDA: the window kernels inside
    mx.compile) gives the eager scores; the window spans two chunks."""
    fm = FunctionalModel(tiny_model("llama"))
    ids = mx.array([list(range(3, 43)), list(range(50, 90))])
    runs = [scored_prefill(fm, ids, capacity=48, prefill_step_size=16, window=20, compiled=c)
            for c in (False, True)]  # fmt: skip
    for a, b in zip(runs[0][1], runs[1][1]):
        assert a.shape == b.shape == (2, fm.n_heads[0], 48)
        assert mx.abs(a - b).max().item() < 1e-5
        assert abs(mx.sum(b[1, 0]).item() - 20) < 1e-3


def test_batch_of_different_lengths_decodes_like_each_alone():
    fm = FunctionalModel(tiny_model("llama"))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 97, 50).tolist(), rng.integers(0, 97, 23).tolist()]
    alone, compacted = [], []
    for ids in prompts:
        states, _ = compact_prompt_cache(fm, ids, budget=16, window=4, max_new_tokens=8)
        compacted.append(states)
        token, out = mx.array([[ids[-1]]]), []
        for _ in range(8):
            logits, states = fm.decode(token, states)
            token = greedy(logits)
            out.append(token.item())
        alone.append(out)
    batch = tuple(kv.stack([a, b]) for a, b in zip(*compacted))
    token, out = mx.array([[prompts[0][-1]], [prompts[1][-1]]]), []
    for _ in range(8):
        logits, batch = fm.decode(token, batch)
        token = greedy(logits)
        out.append(np.array(token)[:, 0].tolist())
    assert [list(t) for t in zip(*out)] == alone


def test_forward_checks_layer_count():
    fm = FunctionalModel(tiny_model("llama"))
    with pytest.raises(ValueError, match="2 states for a model of 3 layers"):
        fm.forward(mx.array([[1]]), fm.init_states(1, 4)[:2])


def test_compact_rejects_bad_values():
    fm = FunctionalModel(tiny_model("llama"))
    with pytest.raises(ValueError, match="budget 6 is below sink_tokens \\+ window = 4 \\+ 32"):
        compact_prompt_cache(fm, list(range(50)), budget=6)
    with pytest.raises(
        ValueError, match="need a \\(batch, length >= 2\\) prompt, got shape \\(1, 1\\)"
    ):
        compact_prompt_cache(fm, [5], budget=64)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0, got -1"):
        compact_prompt_cache(fm, list(range(50)), budget=64, max_new_tokens=-1)


def test_smollm2_compacted_decode_equals_masked_full_cache(smollm2):
    model, tokenizer = smollm2
    fm = FunctionalModel(model)
    text = "The lighthouse keeper counted ships every night. " * 12 + "How many ships?"
    ids = tokenizer.encode(text)
    gap, full_gap, _ = oracle_gap(fm, ids, steps=3, budget=48, window=8, prefill_step_size=64)
    assert gap < TOL and full_gap > 100 * TOL


def test_smollm2_budget_over_prompt_is_token_identical_to_mlx_lm(smollm2):
    model, tokenizer = smollm2
    fm = FunctionalModel(model)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three rivers in Europe."}], add_generation_prompt=True
    )
    states, result = compact_prompt_cache(fm, prompt, budget=512, window=8, max_new_tokens=24)
    assert result.total_rows_after == result.total_rows_before
    token, ours = mx.array([[prompt[-1]]]), []
    for _ in range(24):
        logits, states = fm.decode(token, states)
        token = greedy(logits)
        ours.append(token.item())
    reference = tokenizer.encode(
        generate(model, tokenizer, prompt, max_tokens=24), add_special_tokens=False
    )
    assert tokenizer.decode(ours) == tokenizer.decode(reference)


def test_smollm2_prefill_scores_are_the_models_attention_rows(smollm2):
    """Scores read inside the compiled prefill = the window rows of each layer's attention
    matrix, recomputed here by hand from the layer's own projections (layers 0 and 1)."""
    model, tokenizer = smollm2
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 12)
    n, w = len(ids), 8
    _, scores = scored_prefill(FunctionalModel(model), mx.array([ids]), capacity=n, window=w,
                        prefill_step_size=50)  # fmt: skip
    h = model.model.embed_tokens(mx.array([ids]))
    for i, layer in enumerate(model.model.layers[:2]):
        a, x = layer.self_attn, layer.input_layernorm(h)
        q = a.rope(a.q_proj(x).reshape(1, n, a.n_heads, -1).transpose(0, 2, 1, 3))
        k = a.rope(a.k_proj(x).reshape(1, n, a.n_kv_heads, -1).transpose(0, 2, 1, 3))
        k = mx.repeat(k, a.n_heads // a.n_kv_heads, axis=1)
        logits = mx.where(mx.tril(mx.ones((n, n), mx.bool_)), (q * a.scale) @ k.swapaxes(-1, -2),
                          -mx.inf)  # fmt: skip
        rows = mx.softmax(logits, axis=-1)[:, :, -w:].sum(axis=2)
        assert mx.abs(rows - scores[i]).max().item() < 1e-5
        h = layer(h, mask="causal", cache=None)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_dense_prefill_equals_the_general_path(family):
    """A plain cache prefilled at static slots with the fused causal kernel computes what the
    traced path (array masks over the whole capacity) computes."""
    fm = FunctionalModel(tiny_model(family))
    ids = mx.array([np.random.default_rng(2).integers(0, 97, 37).tolist()])
    fast, scores = scored_prefill(fm, ids, capacity=40, prefill_step_size=10, window=6)
    assert all(s.dense for s in fast)
    general = tuple(
        dataclasses.replace(s, dense=False, max_rows=None) for s in fm.init_states(1, 40)
    )
    slow, slow_scores = scored_prefill(fm, ids, states=general, prefill_step_size=10, window=6)
    for a, b in zip(fast, slow):
        assert mx.abs(a.keys - b.keys).max().item() < 1e-4
        assert np.array_equal(np.array(a.positions), np.array(b.positions))
    for a, b in zip(scores, slow_scores):
        assert mx.abs(a - b).max().item() < 1e-4
    la, _ = fm.forward(mx.array([[5]]), fast)
    lb, _ = fm.forward(mx.array([[5]]), slow)
    assert mx.abs(la - lb).max().item() < 1e-4


def test_layers_of_unequal_rows_do_not_share_lockstep_arrays():
    """Packed layers share one slot/position/mask computation only when their rows are equal;
    per-layer budgets (unequal rows) still decode exactly (the oracle)."""
    fm = FunctionalModel(tiny_model("llama"))
    ids = np.random.default_rng(5).integers(0, 97, 41).tolist()
    full = prefill(fm, mx.array([ids[:-1]]), capacity=48)
    rng = np.random.default_rng(6)
    keep = [mx.array(np.sort(np.stack([rng.choice(40, k, replace=False) for _ in range(2)]))[None])
            for k in (10, 17, 25)]  # fmt: skip
    states, _ = kvfn.evict_prompt_cache(full, keep)
    states = tuple(kv.reserve(s, s.capacity + 4) for s in states)
    assert all(s.packed for s in states) and not fm._lockstep(states)
    compacted, _ = compact_prompt_cache(fm, ids, budget=16, window=4, max_new_tokens=2)
    assert fm._lockstep(compacted)
    restricted = tuple(kv.restrict(f, k) for f, k in zip(full, keep))
    token = mx.array([[ids[-1]]])
    for _ in range(3):
        a, states = fm.decode(token, states)
        b, restricted = fm.decode(token, restricted)
        assert mx.abs(a - b).max().item() < TOL
        token = greedy(a)


def test_one_compiled_step_retraces_per_shape_and_reuses_earlier_traces():
    """A compiled step is keyed by layout only; mx.compile keeps a trace per input shape and
    dtype. Capacities, batch sizes and chunk lengths that come back reuse their trace, and
    every call equals the eager step."""
    fm = FunctionalModel(tiny_model("llama"))
    rng = np.random.default_rng(7)
    seen, shapes = fm.traces, set()
    for batch, capacity, n in [(1, 64, 1), (1, 128, 1), (2, 64, 1), (1, 64, 3), (1, 128, 1),
                               (1, 64, 1), (2, 64, 1)]:  # fmt: skip
        states = fm.init_states(batch, capacity)
        prompt = mx.array(rng.integers(0, 97, (batch, 9)))
        states = fm.forward(prompt, states)[1]
        tokens = mx.array(rng.integers(0, 97, (batch, n)))
        logits, _ = fm.step(tokens, states)
        eager, _ = fm.forward(tokens, states)
        assert mx.abs(logits - eager[:, -1]).max().item() < 1e-5
        shapes.add((batch, capacity, n))
        assert fm.traces - seen == len(shapes)  # a new trace only for a new shape

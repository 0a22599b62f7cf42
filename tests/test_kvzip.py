"""KVzip: selection from max scores, the reconstruction pass against a brute-force reference,
compaction on SmolLM2, the evaluator, and bad settings."""

import mlx.core as mx
import mlx_lm.models.llama as llama
import mlx_lm.models.qwen2 as qwen2
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import kvfn
from kvfn import KVzip, parse_policy, reconstruction_scores, repeat_prompt
from kvfn.policies import Plan
from kvfn.policies.adakvzip import AdaKVzip
from kvfn.policies.kvzip import MAX_STEPS, reconstruction_steps
from kvfn_eval import answers, tasks
from kvfn_eval.evaluator import Evaluator, Method, prompt_tokens, token_counter
from tests.test_compact_steps import run
from tests.test_shapes import attention_shapes
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
    plan = p.plan([mx.array(s0), mx.array(s1)], prompt_length=40, n_kv_heads=(2, 2))
    # 2 layers x 2 heads x 10 = 40 pairs: 24 forced, the 12 sharp ones, 4 of layer 1's
    assert plan == Plan(budgets=(12, 8), totals=((24,), (16,)))
    assert plan.layer(0) == (12, (24,)) and p.budget == 10  # returned, the settings as they were
    fm = kvfn.FunctionalModel(tiny_model("llama"))
    ids = np.random.default_rng(1).integers(0, 97, 40).tolist()
    _, result = kvfn.compact(fm, ids, p.replace(budget=12), max_new_tokens=2)
    assert result.total_rows_after == 3 * 12  # the memory of a flat budget, shared unevenly
    with pytest.raises(ValueError, match="adakvzip plan budgets must be >= 6"):
        p.check_states((2, 2), batch=1, prompt_length=40, plan=Plan(budgets=(12, 5)))


def chunk_inputs(context, chunk, prompt, resume, suffix, overlap=8):
    """The published KVzip's inputs: (start, end, head + context[start:end]) per chunk."""
    out = []
    for start in range(0, len(context), chunk):
        end = min(start + chunk, len(context))
        tail = context[max(start - overlap, 0) : start]
        head = list(prompt) if start == 0 else [*resume, *tail, *suffix]
        out.append((start, end, head + context[start:end]))
    return out


def brute_force(model, module, monkeypatch, context, chunk, prompt=(), resume=(), suffix=(),
                sink=4):  # fmt: skip
    """Per layer (n_heads, P) float64: each chunk's input run by mlx-lm's own model over a plain
    KVCache holding the prefilled context, its queries and keys read at mlx-lm's attention, and
    the restricted softmax computed by hand."""
    P = len(context)
    out = None
    for start, end, ids in chunk_inputs(context, chunk, tuple(prompt), tuple(resume),
                                        tuple(suffix)):  # fmt: skip
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([context]), cache=cache))
        seen = []
        original = module.scaled_dot_product_attention

        def attend(queries, keys, values, cache, scale, mask, sinks=None):
            seen.append((np.array(queries[0], np.float64), np.array(keys[0], np.float64), scale))
            return original(queries, keys, values, cache, scale, mask, sinks)

        monkeypatch.setattr(module, "scaled_dot_product_attention", attend)
        mx.eval(model(mx.array([ids]), cache=cache))
        monkeypatch.setattr(module, "scaled_dot_product_attention", original)
        n = len(ids)
        keys = list(range(min(sink, start))) + list(range(start, end)) + list(range(P, P + n))
        fixed = len(keys) - n
        seen_by = np.arange(len(keys))[None] < fixed + 1 + np.arange(n)[:, None]
        if out is None:
            out = [np.zeros((q.shape[0], P)) for q, _, _ in seen]
        for layer, (q, k, scale) in zip(out, seen):
            k = np.repeat(k[:, keys], q.shape[0] // k.shape[0], axis=0)
            logits = np.where(seen_by, scale * q @ k.transpose(0, 2, 1), -np.inf)
            w = np.exp(logits - logits.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            layer[:, start:end] = w[:, :, fixed - (end - start) : fixed].max(axis=1)
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("chunk", [6, 16, 37, 50])  # a last partial chunk, one chunk, > P
@pytest.mark.parametrize("instructed", [False, True], ids=["bare", "instructed"])
@pytest.mark.parametrize("padded", [False, True], ids=["exact", "padded"])
def test_each_chunk_scores_its_rows_as_mlx_lm_attends_in_its_own_pass(family, chunk, instructed,
                                                                      padded, monkeypatch):  # fmt: skip
    """``padded`` (CUDA's default): each chunk's tokens rounded up to a query bucket over a
    copy of the states in a capacity bucket; the scores are the same."""
    model = tiny_model(family)
    fm = kvfn.FunctionalModel(model)
    context = np.random.default_rng(3).integers(0, 97, 37).tolist()
    heads = dict(prompt=(5, 11, 2), resume=(7, 8), suffix=(9, 4, 1)) if instructed else {}
    states = kvfn.prefill(fm, mx.array([context]), prefill_step_size=16)
    got = reconstruction_scores(fm, mx.array([context]), states, chunk=chunk, padded=padded,
                                **heads)  # fmt: skip
    want = brute_force(model, MODULES[family], monkeypatch, context, chunk, **heads)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == (1, 4, 37) and g.dtype == mx.float32
        np.testing.assert_allclose(np.array(g[0]), w, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("step", [1, 5, 16])
@pytest.mark.parametrize("padded", [False, True], ids=["exact", "padded"])
def test_a_chunk_in_steps_scores_as_mlx_lm_attends_in_its_own_pass(family, step, padded,
                                                                   monkeypatch):  # fmt: skip
    """``step``: each chunk's input (its head and 16 context tokens) in forwards of ``step``
    tokens, a step each; the scores are still those of mlx-lm's one forward of the input (and
    padded: no forward runs padding alone)."""
    model = tiny_model(family)
    fm = kvfn.FunctionalModel(model)
    context = np.random.default_rng(3).integers(0, 97, 37).tolist()
    heads = dict(prompt=(5, 11, 2), resume=(7, 8), suffix=(9, 4, 1))
    states = kvfn.prefill(fm, mx.array([context]), prefill_step_size=16)
    done, got = run(reconstruction_steps(fm, mx.array([context]), states, chunk=16, step=step,
                                         padded=padded, **heads))  # fmt: skip
    assert done[-1] == (37, 37) and [d for d, _ in done] == sorted(d for d, _ in done)
    # chunks [0, 16), [16, 32), [32, 37) after heads of 3, 13 and 13 tokens: a chunk of more
    # than ``step`` context tokens takes a step a piece of its input, any other one step
    pieces = [-(-(h + c) // step) if c > step else 1 for h, c in ((3, 16), (13, 16), (13, 5))]
    assert len(done) == sum(pieces)
    want = brute_force(model, MODULES[family], monkeypatch, context, 16, **heads)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.array(g[0]), w, rtol=1e-4, atol=1e-6)


def test_a_padded_pass_attends_in_a_few_shapes_whatever_the_length(monkeypatch):
    """Padded, the pass over 20 contexts of distinct lengths in one capacity bucket attends in
    the shapes of its two heads times the query buckets up to a chunk, every one over the
    bucket's keys; unpadded, every length has shapes of its own. The scores are the same."""
    fm = kvfn.FunctionalModel(tiny_model("llama"))
    heads = dict(prompt=(5, 11, 2), resume=(7, 8), suffix=(9, 4, 1))
    seen = attention_shapes(monkeypatch)
    shapes = {True: set(), False: set()}
    lengths = range(262, 302, 2)  # 20 lengths; with a chunk's input, one bucket (512)
    for P in lengths:
        context = mx.array([np.random.default_rng(P).integers(0, 97, P).tolist()])
        states = kvfn.prefill(fm, context, prefill_step_size=64)
        got = {}
        for padded in (True, False):
            seen.clear()
            got[padded] = reconstruction_scores(fm, context, states, chunk=64, padded=padded,
                                                **heads)  # fmt: skip
            shapes[padded] |= set(seen)
        for a, b in zip(got[True], got[False]):
            assert mx.allclose(a, b, atol=1e-6).item()
    inputs = {3 + 64} | {13 + q for q in (16, 32, 64)}  # the first head, a later one's
    assert shapes[True] <= {(n, 512) for n in inputs}, shapes[True]
    assert len({k for _, k in shapes[False]}) >= len(lengths)


def test_every_kvzip_policy_compacts_as_before_with_its_pass_padded(monkeypatch):
    """The pass padded (as on CUDA) keeps the rows it keeps unpadded: after the prefill, while
    prefilling (the held rows' pass) and in steps."""
    fm = kvfn.FunctionalModel(tiny_model("llama"))
    ids = np.random.default_rng(8).integers(0, 97, 150).tolist()
    names = ("kvzip", "kvzip-layer", "adakvzip", "adakvzip-global")
    cases = [(n, None, None) for n in names] + [("kvzip", 64, None), ("kvzip", None, 8)]
    for name, max_rows, step in cases:
        policy = parse_policy(name, budget=24, window=4, sink_tokens=2, chunk=40)
        kept = {}
        for padded in (False, True):
            monkeypatch.setattr("kvfn.policies.kvzip.on_cuda", lambda: padded)
            _, (states, _) = run(kvfn.compact_steps(fm, ids, policy, prefill_step_size=32,
                                                    max_rows=max_rows,
                                                    pass_step_size=step))  # fmt: skip
            kept[padded] = [np.array(a) for s in states for a in kvfn.tree.arrays(s)]
        assert all(np.array_equal(a, b) for a, b in zip(kept[False], kept[True])), name


@pytest.mark.parametrize("max_rows", [None, 48])
def test_a_compaction_with_its_pass_in_steps_keeps_the_same_rows(max_rows):
    fm = kvfn.FunctionalModel(tiny_model("llama"))
    ids = np.random.default_rng(4).integers(0, 97, 161).tolist()
    policy = KVzip(budget=32, window=4, sink_tokens=2, chunk=64)

    def compacted(**kw):
        done, (states, _) = run(kvfn.compact_steps(fm, ids, policy, prefill_step_size=16,
                                                   max_rows=max_rows, **kw))  # fmt: skip
        return states, len(done)

    (whole, n_whole), (stepped, n_stepped) = compacted(), compacted(pass_step_size=8)
    assert n_stepped > n_whole
    for a, b in zip(whole, stepped):
        assert mx.array_equal(a.positions, b.positions).item()
        assert mx.allclose(a.keys, b.keys).item()


@pytest.mark.parametrize("bad", [0, -3, True])  # (a float meets typeguard first here)
def test_a_bad_pass_step_size_is_refused_by_value(bad):
    fm = kvfn.FunctionalModel(tiny_model("llama"))
    with pytest.raises(
        ValueError, match=f"pass_step_size must be an int >= 1 or None, got {bad!r}"
    ):
        kvfn.compact_steps(fm, list(range(3, 90)), KVzip(budget=40, window=4), pass_step_size=bad)


def test_a_row_is_scored_by_its_own_chunk_only():
    fm = kvfn.FunctionalModel(tiny_model("llama"))
    context = np.random.default_rng(5).integers(0, 97, 30).tolist()
    states = kvfn.prefill(fm, mx.array([context]))
    whole = reconstruction_scores(fm, mx.array([context]), states, chunk=10)
    edited = context[:12] + [(t + 1) % 97 for t in context[12:18]] + context[18:]
    again = reconstruction_scores(fm, mx.array([edited]), kvfn.prefill(fm, mx.array([edited])),
                                  chunk=10)  # fmt: skip
    # the edit is in chunk 1's rows (and chunk 2's overlap). In the first layer a query reads
    # nothing but its input's tokens and the keys of its restricted rows, so chunk 0's scores
    # cannot see it (deeper layers read every context row through the model's own attention)
    a, b = whole[0], again[0]
    assert mx.array_equal(a[..., :10], b[..., :10]).item()
    assert not mx.allclose(a[..., 10:20], b[..., 10:20]).item()
    assert not mx.allclose(a[..., 20:], b[..., 20:]).item()


def test_the_pass_leaves_the_states_and_holds_no_second_copy_of_them():
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=12,
                           intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=97, rope_theta=10000.0)  # fmt: skip
    mx.random.seed(0)
    model = llama.Model(args)
    mx.eval(model.parameters())
    fm = kvfn.FunctionalModel(model)
    context = mx.array([np.random.default_rng(6).integers(0, 97, 1024).tolist()])
    states = kvfn.prefill(fm, context, prefill_step_size=256)
    mx.eval(kvfn.tree.arrays(states))
    before = [np.array(a) for a in kvfn.tree.arrays(states)]
    held = sum(s.nbytes for s in states)
    mx.synchronize()
    mx.reset_peak_memory()
    live = mx.get_active_memory()
    steps = kvfn.reconstruction_steps(fm, context, states, chunk=8, resume=(1, 2), suffix=(3,))
    done = []
    while True:
        try:
            done.append(next(steps))
        except StopIteration as end:
            scores = end.value
            break
    extra = mx.get_peak_memory() - live
    assert done == [(min(i + 8, 1024), 1024) for i in range(0, 1024, 8)]
    assert len(scores) == 12 and scores[0].shape == (1, 4, 1024)
    # a chunk's copy of a layer is freed before the next layer's is made
    assert extra < held / 2, (extra, held)  # a held copy of every layer alone is `held`
    after = kvfn.tree.arrays(states)
    assert all(np.array_equal(a, np.array(b)) for a, b in zip(before, after))
    for s in states:
        assert s.dense and s.max_rows == 1024 and s.capacity == 1024
        assert int(s.rows.item()) == 1024 and s.offset.tolist() == [1024]


def test_reconstruction_attention_pieces_equal_one_float64_softmax():
    rng = np.random.default_rng(4)
    B, n_heads, n_kv, n, D, context = 2, 6, 2, 11, 8, 30
    q = rng.normal(size=(B, n_heads, n, D)).astype(np.float32)
    k = rng.normal(size=(B, n_kv, context + n + 5, D)).astype(np.float32)
    for sink, start, end in [(4, 0, 12), (4, 12, 30), (0, 7, 9), (6, 3, 30)]:
        s0 = min(sink, start)
        rows = list(range(s0)) + list(range(start, end)) + list(range(context, context + n))
        kk = np.repeat(k[:, :, rows], n_heads // n_kv, axis=1).astype(np.float64)
        logits = 0.4 * q.astype(np.float64) @ kk.transpose(0, 1, 3, 2)
        fixed = s0 + end - start
        logits[..., fixed:] = np.where(np.tri(n, dtype=bool), logits[..., fixed:], -np.inf)
        w = np.exp(logits - logits.max(-1, keepdims=True))
        want = (w / w.sum(-1, keepdims=True))[..., s0:fixed].max(axis=2)
        for piece in (1, 4, 64):
            got = kvfn.scores.reconstruction_attention(mx.array(q), mx.array(k), sink, start, end,
                                                       context, 0.4, piece=piece)  # fmt: skip
            assert got.shape == (B, n_heads, end - start) and got.dtype == mx.float32
            np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-7)
    for args, message in [
        ((4, 5, 5, 30, 0.4), r"rows \[5, 5\)"),
        ((4, 0, 31, 30, 0.4), r"rows \[0, 31\)"),
        ((4, 0, 10, 36, 0.4), "after 36 do not fit keys of 46 rows"),
        ((-1, 0, 10, 30, 0.4), "sink -1"),
    ]:
        with pytest.raises(ValueError, match=message):
            kvfn.scores.reconstruction_attention(mx.array(q), mx.array(k), *args)
    with pytest.raises(ValueError, match="piece must be >= 1, got 0"):
        kvfn.scores.reconstruction_attention(mx.array(q), mx.array(k), 4, 0, 10, 30, 0.4, piece=0)


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


@pytest.mark.parametrize("name", ["kvzip", "kvzip-layer", "adakvzip", "adakvzip-global",
                                  "kvzip-c128"])  # fmt: skip
def test_compact_with_kvzip_on_smollm2_finds_the_passkey(smollm2, name):
    """Query-agnostic: the context alone is compacted to 25%, then the question is asked."""
    model, tokenizer = smollm2
    fm = kvfn.FunctionalModel(model)
    sample = tasks.generate("passkey", seed=0, target_tokens=400,
                            count_tokens=token_counter(tokenizer), n_questions=1)  # fmt: skip
    p = prompt_tokens(tokenizer, sample, sample.questions[0])
    budget = len(p.head) // 4
    policy = parse_policy(name, budget=budget, window=8).for_tokenizer(tokenizer)
    states, result = kvfn.compact(fm, p.head + p.tail[:1], policy, max_new_tokens=16)
    # a KV head keeps budget rows on average (adakvzip-global: over all layers, each layer's
    # mean rounded)
    assert abs(result.total_rows_after - budget * len(states)) < len(states)
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
    assert KVzip(budget=64).chunk == 2048 and KVzip(budget=64).overlap == 8
    for make, message in [
        (lambda: KVzip(budget=64, prompt=[1, 2]), "kvzip prompt must be a tuple of token ids, got \\[1, 2\\]"),
        (lambda: KVzip(budget=64, prompt=(1, -2)), "kvzip prompt must be a tuple of token ids, got \\(1, -2\\)"),
        (lambda: KVzip(budget=64, resume=(1, 2.0)), "kvzip resume must be a tuple of token ids, got \\(1, 2.0\\)"),
        (lambda: KVzip(budget=64, suffix=("a",)), "kvzip suffix must be a tuple of token ids, got \\('a',\\)"),
        (lambda: KVzip(budget=64, kernel_size=2), "kvzip kernel_size must be odd, 1 to 255, got 2"),
        (lambda: KVzip(budget=64, chunk=0), "kvzip chunk must be >= 1, got 0"),
        (lambda: KVzip(budget=64, overlap=-1), "kvzip overlap must be a non-negative int, got -1"),
        (lambda: AdaKVzip(budget=64, overlap=-2), "^kvzip overlap must be a non-negative int, got -2"),  # its scorer
        (lambda: KVzip(budget=64, per_head=1), "kvzip per_head must be a bool, got 1"),
        (lambda: KVzip(budget=20), "kvzip budget 20 is below sink_tokens \\+ window = 4 \\+ 32"),
        (lambda: parse_policy("kvzip-avg", budget=64), "unknown option 'avg' for policy 'kvzip'"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            make()
    with pytest.raises(ValueError, match="kvzip needs reconstruction_scores"):
        KVzip(budget=40).keep_indices(None, prompt_length=50, n_kv_heads=1)


def test_a_pass_of_too_many_chunks_is_refused_by_its_chunk():
    fm = kvfn.FunctionalModel(tiny_model("llama"))
    P = MAX_STEPS + 1
    ids = mx.zeros((1, P + 1), mx.int32)
    message = f"kvzip chunk 1 cuts the {P}-token context into {P} steps .* at least 2\\)"
    with pytest.raises(ValueError, match=message):
        kvfn.compact(fm, ids, KVzip(budget=64, chunk=1), compiled=False)
    with pytest.raises(
        ValueError, match=message
    ):  # at the call: before its first step, the prefill
        kvfn.compact_steps(fm, ids, KVzip(budget=64, chunk=1))
    with pytest.raises(ValueError, match=message):
        reconstruction_scores(fm, ids[:, :-1], [], chunk=1)
    with pytest.raises(ValueError, match="chunk 1 cuts"):
        AdaKVzip(budget=64, chunk=1).check_prompt(P)
    KVzip(budget=64, chunk=2).check_prompt(P)
    KVzip(budget=P, chunk=1).check_prompt(P)  # kept whole: no pass


def test_the_scoring_key_holds_every_setting_the_pass_reads():
    base = KVzip(budget=64)
    same = [base.replace(budget=128), base.replace(per_head=False), base.replace(kernel_size=3),
            AdaKVzip(budget=64, floor=5)]  # fmt: skip
    assert all(p.scoring() == base.scoring() for p in same)
    differ = [base.replace(prompt=(1,)), base.replace(resume=(1,)), base.replace(suffix=(1,)),
              base.replace(chunk=512), base.replace(overlap=4),
              base.replace(sink_tokens=8)]  # fmt: skip
    assert len({p.scoring() for p in differ} | {base.scoring()}) == len(differ) + 1


def test_score_steps_yield_each_chunk_and_return_what_score_prompt_gives():
    fm = kvfn.FunctionalModel(tiny_model("llama"))
    ids = mx.array([np.random.default_rng(8).integers(0, 97, 45).tolist()])
    states = kvfn.prefill(fm, ids)
    policy = KVzip(budget=12, window=4, chunk=20, resume=(3,), suffix=(4,))
    steps, done = policy.score_steps(fm, ids, states), []
    while True:
        try:
            done.append(next(steps))
        except StopIteration as end:
            scores = end.value
            break
    assert done == [(20, 45), (40, 45), (45, 45)]
    want = policy.score_prompt(fm, ids, states)
    assert all(mx.array_equal(a, b).item() for a, b in zip(scores, want))
    whole = KVzip(budget=64, window=4).score_steps(fm, ids, states)  # the prompt fits: no pass
    with pytest.raises(StopIteration) as end:
        next(whole)
    assert end.value.value is None


def test_bad_reconstruction_inputs_are_named():
    fm = kvfn.FunctionalModel(tiny_model("llama"))
    ids = mx.array([list(range(20))])
    states = kvfn.prefill(fm, ids)
    for tokens, kwargs, message in [
        (ids[0], {}, "tokens of shape \\(batch, n >= 1\\), got \\(20,\\)"),
        (ids, {"chunk": 0}, "chunk must be an int >= 1, got 0"),
        (ids, {"overlap": -1}, "overlap must be an int >= 0, got -1"),
        (ids, {"sink": -1}, "sink must be an int >= 0, got -1"),
        (ids, {"resume": (1, "2")}, "resume must be a sequence of token ids \\(ints >= 0\\), got \\(1, '2'\\)"),
        (ids, {"suffix": (-1,)}, "suffix must be a sequence of token ids \\(ints >= 0\\), got \\(-1,\\)"),
        (ids[:, :19], {}, "states must hold the 19 prefilled tokens' rows, got rows \\{20\\}"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            kvfn.reconstruction_steps(fm, tokens, states, **kwargs)  # checked when called
    packed = tuple(s.replace(dense=False) for s in states)
    with pytest.raises(ValueError, match="needs the dense states of a plain prefill"):
        reconstruction_scores(fm, ids, packed)


def test_the_tokenizer_gives_kvzip_its_instructions(smollm2):
    _, tokenizer = smollm2
    policy = parse_policy("adakvzip-global", budget=64)
    assert policy.prompt == policy.resume == policy.suffix == ()
    tuned = policy.for_tokenizer(tokenizer)
    assert tuned.prompt == repeat_prompt(tokenizer)
    assert tokenizer.decode(list(tuned.resume)).startswith(
        "\n\nRepeat the part of the previous context exactly, starting with"
    )
    assert tuned.prompt[-len(tuned.suffix) :] == tuned.suffix  # the assistant turn closes both
    assert "assistant" in tokenizer.decode(list(tuned.suffix))
    own = KVzip(budget=64, prompt=(5, 6))
    assert own.for_tokenizer(tokenizer) is own  # instructions of its own stay
    snap = parse_policy("snapkv", budget=64)
    assert snap.for_tokenizer(tokenizer) is snap

"""RaggedKVCache: per-head row counts in one buffer (Ada-KV, AdaKVzip). The oracle: decoding
from a ragged state equals one full-sequence pass of the unmodified model with attention masked
per (layer, KV head) to the rows each head keeps; the traced allocation equals a numpy
reference; a batch compacts to what each of its prompts compacts to alone, row for row."""

import math

import mlx.core as mx
import numpy as np
import pytest

import kvfn
from kvfn import cache as kv
from kvfn import ragged
from kvfn.policies import Plan
from tests.test_duo import TOL, greedy_logits, kept_sets_gap, kept_visibility, reference_logits
from tests.tiny import stacked_gap, tiny_model

CUDA = mx.default_device() == mx.gpu and mx.cuda.is_available()
cuda_only = pytest.mark.skipif(not CUDA, reason="the ragged kernel runs on MLX's CUDA backend")


def held_positions(state, P: int, b: int = 0) -> list:
    """Per KV head of sequence b, the prompt positions (< P) it holds."""
    out = []
    for h in range(state.n_kv_heads):
        pos = np.array(ragged.head_rows(state, b, h)[2])
        out.append(pos[pos < P])
    return out


def reference_allocation(policy, scores: np.ndarray, P: int, H: int) -> list:
    """Ada-KV's allocation in numpy (scores (n_heads, P) float64, one sequence): per head the
    rows it keeps."""
    s = scores.reshape(H, -1, P).max(axis=1) if not policy.per_head else None
    s = policy.row_scores(mx.array(scores[None].astype(np.float32)), prompt_length=P,
                          n_kv_heads=H, batch=1, layer=0)  # fmt: skip
    s = np.broadcast_to(np.array(s.astype(mx.float32))[0], (H, P)).astype(np.float64)
    pos = np.arange(P)
    forced = (pos < policy.sink_tokens) | (pos >= P - policy.window)
    guard = min(math.ceil(policy.floor / 100 * policy.budget),
                policy.budget - policy.sink_tokens - policy.window)  # fmt: skip
    pri = np.where(forced, np.inf, s)
    for h in range(H):
        order = np.argsort(-np.where(forced, -np.inf, s[h]), kind="stable")[:guard]
        pri[h, order] = np.inf
    flat = np.argsort(-pri.ravel(), kind="stable")[: policy.budget * H]
    heads, rows = np.divmod(flat, P)
    return [sorted(rows[heads == h].tolist()) for h in range(H)]


@pytest.mark.parametrize("floor", [0, 20, 100])
def test_traced_allocation_equals_the_numpy_reference(floor):
    rng = np.random.default_rng(floor)
    P, H, G = 90, 3, 2
    scores = rng.random((H * G, P)) ** 4  # distinct values: no ties
    policy = kvfn.AdaKV(budget=24, window=5, sink_tokens=3, floor=floor, kernel_size=1)
    keep = policy.allocation(mx.array(scores[None].astype(np.float32)), prompt_length=P,
                             n_kv_heads=H)  # fmt: skip
    want = reference_allocation(policy, scores, P, H)
    assert [k.tolist() for k in keep] == want
    assert sum(len(k) for k in keep) == 24 * H
    if floor == 100:  # every head keeps at least its even share
        assert all(len(k) == 24 for k in keep)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_adakv_decode_equals_per_head_masked_full_attention(family):
    fm = kvfn.FunctionalModel(tiny_model(family))
    ids = np.random.default_rng(7).integers(0, 97, 70).tolist()
    policy = kvfn.AdaKV(budget=20, window=4, sink_tokens=2)
    states, result = kvfn.compact(fm, ids, policy, max_new_tokens=5)
    P = len(ids) - 1
    assert all(isinstance(s, ragged.RaggedKVCache) for s in states)
    kept = [held_positions(s, P) for s in states]
    H = fm.n_kv_heads[0]
    assert any(len({len(k) for k in layer}) > 1 for layer in kept)  # some layer is ragged
    assert all(sum(len(k) for k in layer) == 20 * H for layer in kept)
    assert all(s.nbytes < 0.5 * P * H * fm.head_dims[0] * 2 * 4 for s in states)  # no union
    assert kept_sets_gap(fm, ids, states, kept, steps=5) < TOL
    full = kvfn.prefill(fm, mx.array([ids[:-1]]))
    assert kept_sets_gap(fm, ids, full, [[np.arange(P)] * H] * len(states)) < TOL
    assert result.total_rows_after == 20 * len(states)


def test_a_batch_compacts_row_for_row_as_each_prompt_alone():
    """The compaction of a batch's prefilled states keeps, bit for bit, what each prompt's own
    compaction keeps; end to end (the batch prefilled together, whose matmuls round apart from
    one prompt's) the same rows, and the same logits within float32 rounding."""
    fm = kvfn.FunctionalModel(tiny_model("llama"))
    rng = np.random.default_rng(3)
    prompts = rng.integers(0, 97, (3, 64))
    policy = kvfn.AdaKV(budget=18, window=4, sink_tokens=2)
    P = prompts.shape[1] - 1
    alone = [kvfn.scored_prefill(fm, mx.array(p[None, :-1]), window=4) for p in prompts]
    stacked = tuple(kv.stack([a[0][i] for a in alone]) for i in range(len(alone[0][0])))
    scores = [mx.concatenate([a[1][i] for a in alone]) for i in range(len(stacked))]
    batch, _ = kvfn.compact_states(stacked, scores, policy, reserve=3)
    for b, (states, sc) in enumerate(alone):
        one, _ = kvfn.compact_states(states, sc, policy, reserve=3)
        for s, o in zip(batch, one):
            for name in ragged.ARRAY_FIELDS:
                assert mx.array_equal(getattr(s, name)[b], getattr(o, name)[0]), name
    lengths = np.stack([np.array(s.lengths) for s in batch])
    assert len({tuple(x) for x in lengths.reshape(-1, lengths.shape[-1])}) > 1  # allocations differ

    together, result = kvfn.compact(fm, mx.array(prompts), policy, max_new_tokens=3)
    logits, _ = fm.decode(mx.array(prompts[:, -1:]), together)
    for b, ids in enumerate(prompts.tolist()):
        one, _ = kvfn.compact(fm, ids, policy, max_new_tokens=3)
        for s, o in zip(together, one):
            assert [x.tolist() for x in held_positions(s, P, b)] == [
                x.tolist() for x in held_positions(o, P)
            ]
        want, _ = fm.decode(mx.array([[ids[-1]]]), one)
        assert mx.abs(logits[b] - want[0]).max().item() < TOL
    assert result.total_rows_after == 18 * len(together)


def test_stacked_states_of_several_policies_decode_as_each_alone():
    """``ragged.stack`` joins one prompt's ragged states from different budgets (buffers of
    different sizes): a chunk and decode steps over the batch give each state's own logits, and
    layers that cannot share a batch are refused by name."""
    fm = kvfn.FunctionalModel(tiny_model("qwen2"))
    rng = np.random.default_rng(9)
    ids = rng.integers(0, 97, 60).tolist()
    states, scores = kvfn.scored_prefill(fm, mx.array([ids]), window=4)
    kept = [kvfn.compact_states(states, scores, kvfn.AdaKV(budget=b, window=4, sink_tokens=2))[0]
            for b in (12, 30)]  # fmt: skip
    assert kept[0][0].slots < kept[1][0].slots
    stacked = [ragged.stack([a, b]) for a, b in zip(*kept)]
    tail = rng.integers(0, 97, 5).tolist()
    assert stacked_gap(fm, stacked, kept, tail, steps=3) < TOL
    narrow = kept[0][0].replace(keys=kept[0][0].keys[..., :2])  # another head size
    with pytest.raises(ValueError, match="cannot stack ragged layers"):
        ragged.stack([kept[1][0], narrow])
    with pytest.raises(ValueError, match="at least one"):
        ragged.stack([])


def test_a_batchs_compaction_reads_no_host_value(monkeypatch):
    """Ada-KV's allocation, the ragged gather and the eviction result of a batch are computed
    without reading an array on the host (no sync between the prefill and the first decode),
    and a second compaction of the same shapes gives the same rows."""
    fm = kvfn.FunctionalModel(tiny_model("llama"))
    prompts = mx.array(np.random.default_rng(4).integers(0, 97, (2, 50)))
    policy = kvfn.AdaKV(budget=16, window=4, sink_tokens=2)
    states, scores = kvfn.scored_prefill(fm, prompts[:, :-1], window=4)
    mx.eval(kvfn.tree.arrays(states), scores)

    def forbidden(*_args, **_kwargs):
        raise AssertionError("host sync inside compact_states")

    with monkeypatch.context() as patched:
        for name in ("item", "tolist", "__int__", "__bool__", "__float__", "__index__"):
            patched.setattr(mx.array, name, forbidden)
        new, result = kvfn.compact_states(states, scores, policy, reserve=2)
    again, _ = kvfn.compact_states(states, scores, policy, reserve=2)
    for a, b in zip(new, again):
        assert mx.array_equal(a.keys, b.keys) and mx.array_equal(a.lengths, b.lengths)
    assert result.rows_after == (16,) * len(new) and policy.traceable


def test_a_chunk_and_growth_past_the_room_stay_exact():
    fm = kvfn.FunctionalModel(tiny_model("qwen2"))
    rng = np.random.default_rng(8)
    ids = rng.integers(0, 97, 60).tolist()
    policy = kvfn.AdaKV(budget=16, window=4, sink_tokens=2)
    states, _ = kvfn.compact(fm, ids, policy, max_new_tokens=1)  # room 2 a head
    assert states[0].room == 2
    P = len(ids) - 1
    kept = [held_positions(s, P) for s in states]
    follow = rng.integers(0, 97, 9).tolist()
    chunk = [ids[-1]] + follow  # 10 rows: past the room, the layer grows
    logits, after = fm.forward(mx.array([chunk]), states)
    T = P + len(chunk)
    visible = kept_visibility(fm, kept, P, T)
    ref = reference_logits(fm.model, mx.array([ids[:-1] + chunk]), visible)[P:]
    assert mx.abs(logits[0] - ref).max().item() < TOL
    assert after[0].room >= 0 and after[0].lengths.tolist() == (states[0].lengths + 10).tolist()
    out, _ = greedy_logits(fm, ids + follow, after, 3)  # and decoding on from there
    assert out.shape[0] == 3


def test_trim_and_prefix_trim_keep_exactly_the_earlier_rows():
    fm = kvfn.FunctionalModel(tiny_model("llama"))
    ids = np.random.default_rng(5).integers(0, 97, 40).tolist()
    policy = kvfn.AdaKV(budget=12, window=3, sink_tokens=2)
    states, _ = kvfn.compact(fm, ids, policy, max_new_tokens=6)
    P = len(ids) - 1
    s = states[0]
    rows = mx.random.normal((1, 2, 4, 16))
    grown = ragged.update(s, rows, rows)
    for back in (ragged.trim(grown, 4), ragged.rollback(grown, 4)):
        assert back.lengths.tolist() == s.lengths.tolist()
        assert mx.array_equal(back.positions, s.positions) and int(back.offset.item()) == P
    assert grown.room is not None and ragged.rollback(grown, 4).room == grown.room + 4
    cut = ragged.prefix_trim(s, 20)
    for h in range(2):
        pos = np.array(ragged.head_rows(cut, 0, h)[2])
        assert pos.tolist() == [p for p in held_positions(s, P)[h] if p < 20]
    again = ragged.update(cut, rows[:, :, :1], rows[:, :, :1])
    for h in range(2):  # the next row lands at position 20, after each head's kept prefix
        assert int(ragged.head_rows(again, 0, h)[2][-1].item()) == 20


def test_ragged_states_save_and_load(tmp_path):
    fm = kvfn.FunctionalModel(tiny_model("llama"))
    ids = np.random.default_rng(6).integers(0, 97, 40).tolist()
    states, _ = kvfn.compact(fm, ids, kvfn.AdaKV(budget=12, window=3, sink_tokens=2))
    path = tmp_path / "ragged.safetensors"
    kvfn.tree.save(path, states)
    loaded, _ = kvfn.tree.load(path)
    for a, b in zip(states, loaded):
        assert type(b) is ragged.RaggedKVCache and (a.room, a.kept) == (b.room, b.kept)
        assert all(mx.array_equal(getattr(a, f), getattr(b, f)) for f in ragged.ARRAY_FIELDS)
    token = mx.array([[ids[-1]]])
    assert mx.array_equal(fm.decode(token, states)[0], fm.decode(token, loaded)[0])


def test_bad_rows_and_a_full_room_are_named():
    state = kv.from_full(mx.zeros((1, 2, 10, 4)), mx.zeros((1, 2, 10, 4)))
    s = ragged.from_keep_sets(state, [mx.arange(0, 10, 2), mx.arange(3)], room=1)
    assert s.lengths.tolist() == [[5, 3]] and s.slots == 10
    with pytest.raises(ValueError, match="do not fit"):
        ragged.update(s, mx.zeros((1, 3, 1, 4)), mx.zeros((1, 3, 1, 4)))
    with pytest.raises(ValueError, match="1 free slots"):
        ragged.update(s, mx.zeros((1, 2, 2, 4)), mx.zeros((1, 2, 2, 4)))
    with pytest.raises(ValueError, match="keep sets"):
        ragged.from_keep_sets(state, [mx.arange(3)])
    with pytest.raises(ValueError, match="n >= 0"):
        ragged.trim(s, -1)
    with pytest.raises(ValueError, match="int room >= 0, got -1"):
        ragged.reserve(s, -1)


def test_a_trimmed_or_unknown_room_still_refuses_rows_that_do_not_fit():
    state = kv.from_full(mx.zeros((1, 2, 10, 4)), mx.zeros((1, 2, 10, 4)))
    s = ragged.from_keep_sets(state, [mx.arange(0, 10, 2), mx.arange(3)], room=1)
    two = mx.ones((1, 2, 2, 4))
    for t in (ragged.trim(s, 0), s.replace(room=None)):  # head 0's range ends where 1's starts
        with pytest.raises(ValueError, match="1 free slots"):
            ragged.update(t, two, two)
    cut = ragged.trim(s, 8)  # the first 2 tokens stay: head 0 has 5 free slots, head 1 has 2
    grown = ragged.update(cut.replace(room=None), two, two)
    assert grown.lengths.tolist() == [[3, 4]]
    assert [ragged.head_rows(grown, 0, h)[2].tolist() for h in (0, 1)] == [[0, 2, 3], [0, 1, 2, 3]]
    assert ragged.head_rows(grown, 0, 1)[0].sum(axis=-1).tolist() == [0, 0, 4, 4]


def test_attention_off_cuda_equals_each_heads_own_rows():
    rng = np.random.default_rng(9)
    B, H, G, D, P = 2, 3, 2, 8, 12
    state = kv.from_full(mx.array(rng.normal(size=(B, H, P, D)), mx.float32),
                         mx.array(rng.normal(size=(B, H, P, D)), mx.float32))  # fmt: skip
    keep = mx.array(rng.random((B, H, P)) < 0.5)
    s = ragged.pack(state, keep, capacity=int(mx.max(mx.sum(keep, axis=(1, 2))).item()), room=2)
    q = mx.array(rng.normal(size=(B, H * G, 1, D)), mx.float32)
    out = np.array(ragged.attend(s, q, 0.5))
    k, v, m = np.array(state.keys), np.array(state.values), np.array(keep)
    for b in range(B):
        for i in range(H * G):
            h = i // G
            logits = 0.5 * k[b, h, m[b, h]] @ np.array(q)[b, i, 0]
            w = np.exp(logits - logits.max())
            want = (w / w.sum()) @ v[b, h, m[b, h]] if m[b, h].any() else np.zeros(D)
            assert np.abs(out[b, i, 0] - want).max() < 1e-5


@cuda_only
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
@pytest.mark.parametrize(
    "dim,heads,group,rows", [(128, 8, 4, 3000), (64, 2, 7, 700), (128, 2, 6, 40)]
)
def test_ranges_kernel_equals_each_heads_masked_attention(dtype, dim, heads, group, rows):
    rng = np.random.default_rng(dim + rows)
    B = 2
    counts = rng.integers(0, rows, (B, heads))
    counts[0, 0] = 0  # a head with no rows: zeros
    room = 3
    size = counts + room
    starts = np.cumsum(size, axis=1) - size
    S = int(size.sum(axis=1).max())
    k = mx.array(rng.normal(size=(B, S, dim)), dtype)
    v = mx.array(rng.normal(size=(B, S, dim)), dtype)
    q = mx.array(rng.normal(size=(B, heads * group, 1, dim)), dtype)
    from kvfn import kernels

    out = kernels.ranges_decode_attention(q, k, v, mx.array(starts, mx.int32),
                                          mx.array(counts, mx.int32), scale=dim**-0.5)  # fmt: skip
    kf, vf, qf = (np.array(x.astype(mx.float32)).astype(np.float64) for x in (k, v, q))
    got = np.array(out.astype(mx.float32))
    for b in range(B):
        for i in range(heads * group):
            h = i // group
            lo, n = starts[b, h], counts[b, h]
            if n == 0:
                assert np.abs(got[b, i, 0]).max() == 0
                continue
            logits = kf[b, lo : lo + n] @ qf[b, i, 0] * dim**-0.5
            w = np.exp(logits - logits.max())
            want = (w / w.sum()) @ vf[b, lo : lo + n]
            tol = 2e-2 if dtype != mx.float32 else 1e-4
            assert np.abs(got[b, i, 0] - want).max() < tol, (b, i)


def test_a_plan_across_layers_keeps_each_sequences_own_pairs_in_a_batch():
    """adakvzip-global: each sequence keeps, over all layers, its best ``budget x kv_heads x
    layers`` (head, row) pairs; batched, every sequence keeps exactly what it keeps alone."""
    from kvfn.policies.adakvzip import AdaKVzip

    fm = kvfn.FunctionalModel(tiny_model("llama"))
    rng = np.random.default_rng(11)
    prompts = rng.integers(0, 97, (3, 50))
    P, L, H = 49, len(fm.n_heads), fm.n_kv_heads[0]
    alone = [kvfn.prefill(fm, mx.array(p[None, :-1])) for p in prompts]
    scores = [[mx.array(rng.random((1, fm.n_heads[i], P)) ** 3, mx.float32) for i in range(L)]
              for _ in prompts]  # fmt: skip
    stacked = tuple(kv.stack([a[i] for a in alone]) for i in range(L))
    batched_scores = [mx.concatenate([s[i] for s in scores]) for i in range(L)]
    policy = kvfn.parse_policy("adakvzip-global", budget=12, window=3, sink_tokens=2)
    batch, _ = kvfn.compact_states(stacked, batched_scores, policy, reserve=2)
    for b in range(len(prompts)):
        one, _ = kvfn.compact_states(alone[b], scores[b], policy, reserve=2)
        assert sum(int(mx.sum(s.lengths).item()) for s in one) == 12 * H * L
        for s, o in zip(batch, one):
            assert s.lengths[b].tolist() == o.lengths[0].tolist()
            for h in range(H):
                for x, y in zip(ragged.head_rows(s, b, h), ragged.head_rows(o, 0, h)):
                    assert mx.array_equal(x, y)
    per_layer = np.array([[int(mx.sum(s.lengths[b]).item()) for s in batch] for b in range(3)])
    assert len({tuple(r) for r in per_layer}) > 1  # the sequences share their budgets apart
    assert len(set(per_layer[0])) > 1  # and the layers theirs
    with pytest.raises(ValueError, match="options 'global' and 'f20' .* both set its floor"):
        kvfn.parse_policy("adakvzip-global-f20", budget=64)
    with pytest.raises(ValueError, match="floor must be 0"):
        kvfn.AdaKVzip(budget=64, across_layers=True, floor=20)


def test_a_plan_of_counts_that_does_not_fit_is_refused_before_tracing(monkeypatch):
    """A plan's ``totals`` (``AcrossHeads.plan``'s, or given to ``compact_states``) are a
    count a sequence: one for each sequence of the batch, each between the rows every head must
    keep and the layer's budget a head (more would run past the ragged buffer). A plan within
    them keeps exactly its counts."""
    from kvfn import compaction

    fm = kvfn.FunctionalModel(tiny_model("llama"))
    ids = mx.array(np.random.default_rng(5).integers(0, 97, (2, 60)))
    states, scores = kvfn.scored_prefill(fm, ids, window=4)
    H, L = fm.n_kv_heads[0], len(states)
    policy = kvfn.AdaKV(budget=20, window=4, sink_tokens=2, floor=0)  # each head keeps 6
    least, most = 6 * H, 20 * H

    def totals(*counts):
        return Plan(totals=(counts,) * L)

    def counts(policy, plan):
        kept, _ = kvfn.compact_states(states, scores, policy, plan=plan)
        return [[int(mx.sum(s.lengths[b]).item()) for b in range(2)] for s in kept]

    assert counts(policy, totals(least, most)) == [[least, most]] * L
    whole = policy.replace(budget=100)  # a budget past the prompt's rows
    assert counts(whole, totals(60 * H, least)) == [[60 * H, least]] * L

    def traced(*args):
        raise AssertionError("traced before the plan was checked")

    monkeypatch.setattr(compaction, "_evictor", traced)
    zip_ = kvfn.AdaKVzip(budget=20, window=4, sink_tokens=2, floor=0)
    bad = [
        (policy, totals(least), "adakv totals has 1 counts .* the batch has 2 sequences"),
        (policy, totals(least, most + 1), rf"adakv totals \[{most + 1}\] out of range .* "
                                          rf"at most {most} \(20 rows a head"),
        (policy, totals(least - 1, most), rf"adakv totals \[{least - 1}\] out of range .* "
                                          rf"at least {least} \(the 6 sinks, window"),
        (policy.replace(floor=50), totals(least, most),
         rf"adakv totals \[{least}\] out of range .* at least {16 * H} \(the 16 sinks"),
        (zip_, Plan(budgets=(20,) * L, totals=((least, most), (least,), (least, most))),
         "adakvzip totals has 1 counts .* the batch has 2 sequences"),
        (zip_, Plan(budgets=(10, 20, 20), totals=((least, most),) * L),
         rf"adakvzip totals \[{most}\] out of range .* at most {10 * H} \(10 rows a head"),
        (whole, totals(60 * H + 1, least),
         rf"at most {60 * H} \(60 rows a head: the budget, or the prompt\)"),
    ]  # fmt: skip
    for bad_policy, plan, message in bad:
        with pytest.raises(ValueError, match=message):
            kvfn.compact_states(states, scores, bad_policy, plan=plan)

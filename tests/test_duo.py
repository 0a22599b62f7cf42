"""DuoAttention: the ring, head-partitioned states, the policy, head patterns; and the oracle:
decoding from partitioned states equals one full-sequence forward pass of the unmodified model
with attention masked per (layer, KV head) to the rows each head keeps."""

import json

import mlx.core as mx
import numpy as np
import pytest

import kvfn
from kvfn import cache as kv
from kvfn import partitioned as part
from kvfn import ring as rg
from kvfn.policies.duo import Duo, HeadPattern
from tests.tiny import stacked_gap, tiny_model

TOL = 1e-4


def reference_logits(model, tokens, visible):
    """Logits (T, vocab) of a llama-family ``model`` over ``tokens`` (1, T) in one pass, where
    layer i's query heads see the keys ``visible(i)`` (1, n_heads, T, T) allows."""
    inner = model.model
    h = inner.embed_tokens(tokens)
    for i, layer in enumerate(inner.layers):
        h = layer(h, visible(i), cache=None)
    h = inner.norm(h)
    if not getattr(model.args, "tie_word_embeddings", True):
        return model.lm_head(h)[0]
    return inner.embed_tokens.as_linear(h)[0]


def duo_visibility(fm, states, P, T, policy, split=None):
    """The per-head masks a Duo-compacted model should attend with: prompt queries (< P) see
    causally all keys; a later query at q sees, in a retrieval head, the rows the head kept and
    every position from P on, in a streaming head the sinks and positions (q - recent, q].
    ``split``: the streaming heads' rule from this query on instead (Duo evicting while it
    prefills: its rings made at that chunk's end)."""
    q = np.arange(T)[:, None]
    k = np.arange(T)[None, :]
    causal = k <= q
    streaming = causal & ((k < policy.sink_tokens) | (k > q - policy.recent))

    def visible(i):
        n_kv, n_q = fm.n_kv_heads[i], fm.n_heads[i]
        s = states[i]
        heads = []
        for h in range(n_kv):
            if not policy.heads[i][h]:
                heads.append(np.where(q < (P if split is None else split), causal, streaming))
                continue
            kept = np.zeros(T, bool)
            plain = s if isinstance(s, kv.State) else s.parts[0]
            col = s.heads[0].index(h) if not isinstance(s, kv.State) else h
            pos = np.array(plain.positions[0, col])
            kept[pos[pos < P]] = True
            heads.append(np.where(q < P, causal, causal & (kept[None, :] | (k >= P))))
        m = np.repeat(np.stack(heads), n_q // n_kv, axis=0)
        return mx.array(m[None])

    return visible


def greedy_logits(fm, ids, states, steps):
    """Greedy decode from the last prompt token: (logits (steps, vocab), all tokens)."""
    token, tokens, logits = mx.array([[ids[-1]]]), list(ids), []
    for _ in range(steps):
        out, states = fm.decode(token, states)
        logits.append(out[0])
        token = mx.argmax(out, axis=-1)[:, None]
        tokens.append(token.item())
    return mx.stack(logits), tokens


def kept_sets_gap(fm, ids, states, kept, steps=4) -> float:
    """Max |logit gap| of decoding ``states`` against the reference where KV head h of layer
    i sees the prompt rows ``kept[i][h]`` and every row from the prompt's end on."""
    P = len(ids) - 1
    logits, tokens = greedy_logits(fm, ids, states, steps)
    T = len(tokens) - 1
    ref = reference_logits(fm.model, mx.array([tokens[:T]]), kept_visibility(fm, kept, P, T))
    return mx.abs(logits - ref[P:]).max().item()


def kept_visibility(fm, kept, P: int, T: int):
    """``reference_logits``' masks over T tokens where KV head h of layer i sees, from query P
    on, the prompt rows ``kept[i][h]`` and every row from P on (prompt queries: causal)."""
    q, k = np.arange(T)[:, None], np.arange(T)[None, :]

    def visible(i):
        heads = []
        for rows in kept[i]:
            held = np.zeros(T, bool)
            held[rows] = True
            heads.append(np.where(q < P, k <= q, (k <= q) & (held[None] | (k >= P))))
        rep = fm.n_heads[i] // fm.n_kv_heads[i]
        return mx.array(np.repeat(np.stack(heads), rep, axis=0)[None])

    return visible


def duo_gap(fm, ids, policy, steps=6):
    """Max |logit gap| of Duo decode against the reference, and against the full cache."""
    states, result = kvfn.compact(fm, ids, policy, max_new_tokens=steps)
    P = len(ids) - 1
    got, tokens = greedy_logits(fm, ids, states, steps)
    T = len(tokens) - 1
    seq = mx.array([tokens[:T]])
    ref = reference_logits(fm.model, seq, duo_visibility(fm, states, P, T, policy))[P:]
    full = reference_logits(fm.model, seq, lambda i: "causal")[P:]
    return mx.abs(got - ref).max().item(), mx.abs(got - full).max().item(), states, result


PATTERN = ((True, False), (False, True), (True, False))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("compress", [False, True])
def test_duo_decode_equals_per_head_masked_full_attention(compress, family):
    fm = kvfn.FunctionalModel(tiny_model(family))
    ids = np.random.default_rng(1).integers(0, 97, 70).tolist()
    pattern = PATTERN[: len(fm.n_kv_heads)]
    policy = Duo(retrieval=pattern, sink_tokens=2, recent=6, budget=24 if compress else 2**31 - 1,
                 window=4, compress=compress)  # fmt: skip
    gap, full_gap, states, result = duo_gap(fm, ids, policy, steps=10)  # the ring wraps
    assert gap < TOL
    assert full_gap > 100 * TOL  # streaming heads did lose rows: the oracle is not vacuous
    ring = states[0].parts[1]
    assert isinstance(ring, rg.StreamingRing) and ring.capacity == 2 + 6
    assert result.total_bytes_after < result.total_bytes_before


def _pending(arrays) -> int:
    """The most unevaluated primitives behind any one of ``arrays``."""
    from examples.profile_decode import primitives

    return max(sum(primitives([a]).values()) for a in arrays)


@pytest.mark.parametrize("family, policy, slots", [
    ("llama", "duo", False), ("llama", "duo", True), ("llama", "adakv", False),
    ("smollm3", "adakv", False), ("smollm3", "pyramidkv", False),
], ids=["duo", "duo-slots", "adakv", "adakv-nope", "pyramidkv-nope"])  # fmt: skip
def test_a_token_only_loop_leaves_no_growing_chain(family, policy, slots):
    """A decode loop that evaluates only its tokens (as a pipelined one must) leaves every state
    array with a bounded graph: no layer or part carries a counter that no step reads, also
    where a layer applies no RoPE (smollm3's every other layer here), whose offset only the
    other layers' RoPE reads."""
    fm = kvfn.FunctionalModel(tiny_model(family))
    ids = np.random.default_rng(4).integers(0, 97, 50).tolist()
    chosen = {"duo": Duo(retrieval=PATTERN, sink_tokens=2, recent=4),
              "adakv": kvfn.AdaKV(budget=16, window=4, sink_tokens=2),
              "pyramidkv": kvfn.PyramidKV(budget=16, window=4, sink_tokens=2)}[policy]  # fmt: skip
    start, _ = kvfn.compact(fm, ids, chosen, max_new_tokens=40)
    if slots:  # a Duo layer's plain part and ring in one buffer
        start = kvfn.slots.pack_layers(start)
    pending = []
    for steps in (5, 30):
        token, states = mx.array([[ids[-1]]]), start
        for _ in range(steps):
            out, states = fm.decode(token, states)
            token = mx.argmax(out, axis=-1)[:, None]
            token.item()
        pending.append(_pending(kvfn.tree.arrays(states)))
    assert pending[0] == pending[1], pending


def test_duo_compiled_decode_traces_once_and_keeps_ring_size():
    fm = kvfn.FunctionalModel(tiny_model("llama"))
    ids = np.random.default_rng(2).integers(0, 97, 50).tolist()
    states, _ = kvfn.compact(fm, ids, Duo(retrieval=PATTERN, sink_tokens=2, recent=4),
                             max_new_tokens=8)  # fmt: skip
    token, before = mx.array([[ids[-1]]]), fm.traces
    for _ in range(8):
        out, states = fm.decode(token, states)
        token = mx.argmax(out, axis=-1)[:, None]
    assert fm.traces == before + 1
    counts = part.row_counts(states[1])
    assert counts.tolist() == [[2 + 4, 49 + 8]]  # head 0 streams, head 1 retrieves
    plain, ring = part.mask(states[1], 1)  # what the last token saw, per part
    assert ring.shape == (1, 1, 1, 6) and bool(ring.all())  # the full ring: sinks + recent
    assert plain.shape[-1] == states[1].parts[0].capacity
    assert int(plain.sum()) == 49 + 8  # every stored retrieval row, no empty slot
    assert int(states[1].offset.item()) == 49 + 8


def test_smollm2_duo_decode_equals_reference(smollm2):
    model, tokenizer = smollm2
    fm = kvfn.FunctionalModel(model)
    ids = tokenizer.encode("The lighthouse keeper counted ships every night. " * 12)[:120]
    rng = np.random.default_rng(0)
    pattern = tuple(tuple(bool(x) for x in rng.random(3) < 0.5) for _ in range(30))
    policy = Duo(retrieval=pattern, sink_tokens=4, recent=16)
    gap, full_gap, _, _ = duo_gap(fm, ids, policy, steps=4)
    assert gap < 1e-3 and full_gap > 1e-2


# -- the ring ------------------------------------------------------------------------------------


def rows(n, H=2, D=3, start=0):
    x = mx.arange(start, start + n, dtype=mx.float32)[None, None, :, None]
    return mx.broadcast_to(x, (1, H, n, D)) * mx.array([1.0, 2.0, 3.0])


@pytest.mark.parametrize("chunks", [[20], [1] * 20, [3, 9, 1, 7], [2, 15, 3]])
def test_ring_holds_sinks_and_last_recent_positions_whatever_the_chunks(chunks):
    r = rg.init(1, 2, 3, sink=3, recent=5)
    start = 0
    for n in chunks:
        r = rg.update(r, rows(n, start=start), rows(n, start=start))
        start += n
    pos = sorted(p for p in r.positions[0, 0].tolist())
    assert pos == [0, 1, 2, 15, 16, 17, 18, 19]
    # each slot's row is the row of its recorded position
    assert np.array_equal(np.array(r.keys[0, 0, :, 0]), np.array(r.positions[0, 0], np.float32))
    assert r.offset.tolist() == [20]


def test_ring_prefix_trim_keeps_only_earlier_rows_and_rewrites_in_place():
    r = rg.update(rg.init(1, 2, 3, sink=2, recent=4), rows(10), rows(10))
    t = rg.trim(r, 3)  # positions 7, 8, 9 go
    assert sorted(p for p in t.positions[0, 0].tolist() if p != kv.EMPTY) == [0, 1, 6]
    assert t.offset.tolist() == [7]
    again = rg.update(t, rows(3, start=7), rows(3, start=7))
    assert np.array_equal(np.array(again.positions), np.array(r.positions))
    assert np.array_equal(np.array(again.keys), np.array(r.keys))


@pytest.mark.parametrize("prompt", [3, 8, 12])
def test_a_full_ring_is_what_one_query_sees_whole(prompt):
    """``full`` (attention without a mask) only where every slot is visible to the next query:
    filled from a prompt of at least sink + recent rows, through updates; a trim clears it."""
    plain = kv.from_full(rows(prompt), rows(prompt))
    r = rg.from_state(plain, prompt, sink=3, recent=5)
    assert r.full == (prompt >= 8)
    for step in range(4):
        r = rg.update(r, rows(1, start=prompt + step), rows(1, start=prompt + step))
        assert bool(rg.mask(r, 1).all().item()) == (prompt + step + 1 >= 8)
    assert not rg.trim(r, 1).full and not rg.prefix_trim(r, 5).full


@pytest.mark.parametrize("sink", [0, 3])
def test_ring_one_row_write_equals_the_gathered_update(sink):
    """Law: one row written at its slot (``write_at``, what a decode step does) equals the
    gather of the rows that stay, whatever the offsets of a batch (below the sinks, wrapping,
    after a trim left empty slots)."""
    r = rg.init(3, 2, 3, sink=sink, recent=5)
    r = rg.gathered(r, mx.repeat(rows(9), 3, 0), mx.repeat(rows(9), 3, 0))
    r = rg.prefix_trim(r, mx.array([1, 6, 9], mx.int32))  # offsets 1, 6, 9: per sequence
    for step in range(12):
        k = mx.repeat(rows(1, start=100 + step), 3, 0)
        one, many = rg.update(r, k, 2 * k), rg.gathered(r, k, 2 * k)
        for f in rg.ARRAY_FIELDS:
            assert np.array_equal(np.array(getattr(one, f)), np.array(getattr(many, f))), f
        r = one


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("sink", [0, 2])
def test_ring_positions_follow_a_reference_through_updates_and_trims(seed, sink):
    """Law: the positions a ring derives (from ``offset`` and ``since``) are those a reference
    holding one position per slot records, through any mix of one-row writes, chunks and
    per-sequence trims, and each held slot's row is the row of its position."""
    B, recent, rng = 3, 5, np.random.default_rng(seed)
    ring, offsets = rg.init(B, 2, 3, sink=sink, recent=recent), [0] * B
    held = [{} for _ in range(B)]  # per sequence: slot -> position

    def slot(p):
        return p if p < sink else sink + (p - sink) % recent

    for _ in range(16):
        if rng.random() < 0.3:
            offsets = [int(rng.integers(0, o + 1)) for o in offsets]
            ring = rg.prefix_trim(ring, mx.array(offsets, mx.int32))
            held = [{j: p for j, p in h.items() if p < o} for h, o in zip(held, offsets)]
            continue
        n = int(rng.choice([1, 1, 2, 7]))
        k = mx.concatenate([rows(n, start=o) for o in offsets], axis=0)
        ring = rg.update(ring, k, -k)
        for h, o in zip(held, offsets):
            h.update({slot(p): p for p in range(o, o + n)})
        offsets = [o + n for o in offsets]
    positions = np.array(ring.positions)
    for b, h in enumerate(held):
        want = [h.get(j, kv.EMPTY) for j in range(sink + recent)]
        assert positions[b].tolist() == [want, want], (b, want)
        on = positions[b, 0] != kv.EMPTY
        assert np.array_equal(np.array(ring.keys[b, 0, :, 0])[on], positions[b, 0][on])
    assert ring.offset.tolist() == offsets
    assert (np.array(ring.since) <= np.array(offsets)).all()


def test_ring_write_shares_what_it_derives():
    """``ring.appended`` depends on the offset alone: rings of other heads at that offset take
    it as their own (``FunctionalModel`` derives it once a call for all its layers)."""
    a = rg.update(rg.init(1, 2, 3, sink=2, recent=4), rows(7), rows(7))
    b = rg.update(rg.init(1, 1, 3, sink=2, recent=4), rows(7, H=1), rows(7, H=1))
    shared = rg.appended(a)
    k = rows(1, H=1, start=50)
    via = rg.write_at(b, k, k, **shared)
    own = rg.update(b, k, k)
    for f in rg.ARRAY_FIELDS:
        assert np.array_equal(np.array(getattr(via, f)), np.array(getattr(own, f))), f


def test_ring_update_checks_values():
    r = rg.init(1, 2, 3, sink=1, recent=4)
    with pytest.raises(AssertionError):
        rg.update(r, rows(1), rows(2))


def test_ring_rejects_bad_sizes():
    with pytest.raises(ValueError, match="recent"):
        rg.init(1, 1, 4, sink=2, recent=0)
    with pytest.raises(ValueError, match="sink"):
        rg.init(1, 1, 4, sink=-1, recent=3)


# -- per-head keep sets --------------------------------------------------------------------------


def test_from_keep_sets_parts_heads_by_count_and_stores_no_union():
    s = kv.from_full(rows(12, H=3), rows(12, H=3))
    keep = [mx.array([0, 5, 11]), mx.arange(12), mx.array([1, 2, 3])]
    p = part.from_keep_sets(s, keep)
    assert p.heads == ((1,), (0, 2))
    assert part.row_counts(p).tolist() == [[3, 12, 3]]
    assert p.nbytes < s.nbytes  # the union (all 12 rows) is not stored for heads 0 and 2
    assert p.parts[1].positions[0].tolist() == [[0, 5, 11], [1, 2, 3]]
    with pytest.raises(ValueError, match="heads"):
        part.from_keep_sets(s, keep[:2])
    with pytest.raises(ValueError, match="sorted"):
        part.from_keep_sets(s, [mx.array([3, 1, 2]), mx.arange(12), mx.array([1, 2, 3])])


def test_partition_checks_heads():
    s = kv.from_full(rows(4, H=2), rows(4, H=2))
    with pytest.raises(ValueError, match="cover"):
        part.partition([s], [(0, 2)])
    with pytest.raises(ValueError, match="holds 2 heads"):
        part.partition([s], [(0,)])


@pytest.mark.parametrize("heads", [((0, 1), (2, 3)), ((1, 3), (0, 2)), ((3,), (0, 1, 2)),
                                   ((2, 0), (3, 1)), ((0, 1, 2, 3),)])  # fmt: skip
@pytest.mark.parametrize("batch", [1, 2])
def test_split_rows_gives_each_part_its_heads_in_order(heads, batch):
    values = mx.arange(batch * 4 * 6 * 3, dtype=mx.float32).reshape(batch, 4, 6, 3)
    s = kv.from_full(values, values)
    layer = part.partition([part.take_heads(s, hs) for hs in heads], heads)
    new_k = mx.arange(batch * 4 * 3, dtype=mx.float32).reshape(batch, 4, 1, 3)
    ks, vs = part.split_rows(layer, new_k, -new_k)
    for g, hs in enumerate(heads):  # every head holds other values: the order is checked
        assert mx.array_equal(ks[g], new_k[:, list(hs)])
        assert mx.array_equal(vs[g], -new_k[:, list(hs)])
    in_order = [h for hs in heads for h in hs] == list(range(4))
    assert (part.head_order(heads, 1)[0] is None) == in_order  # no gather when in order


def test_take_heads_of_a_ring_keeps_its_rows_and_positions():
    per_head = rows(9, H=3) * mx.array([1.0, 2.0, 3.0])[:, None, None]  # each head its own
    full = rg.update(rg.init(1, 3, 3, sink=2, recent=4), per_head, per_head)
    ring = rg.trim(full, 2)
    sub = part.take_heads(ring, [2, 0])
    assert isinstance(sub, rg.StreamingRing) and (sub.sink, sub.recent) == (2, 4)
    assert mx.array_equal(sub.keys, ring.keys[:, [2, 0]])
    assert mx.array_equal(sub.positions, ring.positions[:, [2, 0]])
    assert sub.offset.tolist() == [7]


def test_rebuilt_states_equal_constructed_ones():
    s = kv.from_full(rows(6, H=2), rows(6, H=2))
    r = rg.from_state(s, 6, sink=1, recent=3)
    one_head = r.replace(keys=r.keys[:, 1:], values=r.values[:, 1:])
    for state in (s, r, part.partition([part.take_heads(s, [0]), one_head], [(0,), (1,)])):
        fields = {f: getattr(state, f) for f in type(state).__dataclass_fields__}
        again = kv.rebuilt(type(state), **fields)
        assert type(again) is type(state) and vars(again).keys() == vars(state).keys()
        assert all(getattr(again, f) is v for f, v in fields.items())
        assert list(vars(again)) == list(vars(state))  # field order, as the constructor gives
        backwards = kv.rebuilt(type(state), **dict(reversed(fields.items())))
        assert list(vars(backwards)) == list(vars(state))
        first = next(iter(fields))
        assert getattr(again.replace(**{first: fields[first]}), first) is fields[first]
        assert repr(again) == repr(state)
    with pytest.raises(TypeError, match="StreamingRing: missing fields \\['values'"):
        kv.rebuilt(rg.StreamingRing, keys=r.keys)


def test_growing_a_partitioned_layer_that_has_room_returns_it_unchanged():
    fm = kvfn.FunctionalModel(tiny_model("llama"))
    ids = np.random.default_rng(5).integers(0, 97, 40).tolist()
    policy = Duo(retrieval=PATTERN, sink_tokens=2, recent=4)
    states, _ = kvfn.compact(fm, ids, policy, max_new_tokens=3)
    assert all(kvfn.wrapper.grown(s, 1) is s for s in states)
    g, plain = next((g, x) for g, x in enumerate(states[0].parts) if isinstance(x, kv.State))
    n = plain.capacity - plain.max_rows + 1  # one more than fits
    bigger = kvfn.wrapper.grown(states[0], n)
    assert bigger is not states[0] and bigger.parts[g].capacity > plain.capacity


def test_evict_by_head_decodes_like_per_head_masked_full_attention():
    fm = kvfn.FunctionalModel(tiny_model("llama"))
    ids = np.random.default_rng(3).integers(0, 97, 40).tolist()
    P = len(ids) - 1
    full = kvfn.prefill(fm, mx.array([ids[:-1]]))
    rng = np.random.default_rng(4)
    sets = [[np.sort(rng.choice(P, size=k, replace=False)) for k in (30, 7)] for _ in full]
    states, result = kvfn.evict_prompt_cache_by_head(full, [[mx.array(x) for x in s] for s in sets])
    assert result.head_rows == tuple((30, 7) for _ in full)
    assert result.union_rows[0] == len(set(sets[0][0]) | set(sets[0][1]))
    assert result.total_bytes_after < result.total_bytes_before
    assert kept_sets_gap(fm, ids, states, sets) < TOL


def test_evict_by_head_leaves_other_layers_and_checks_offset():
    fm = kvfn.FunctionalModel(tiny_model("llama"))
    full = kvfn.prefill(fm, mx.array([list(range(20))]))
    keep = [None, [mx.arange(5), mx.arange(20)], None]
    states, result = kvfn.evict_prompt_cache_by_head(full, keep, true_offset=20)
    assert states[0] is full[0] and states[2] is full[2]
    assert isinstance(states[1], part.HeadPartitionedKVCache)
    assert states[1].offset.tolist() == [20]
    assert result.bytes_after[0] == result.bytes_before[0]
    with pytest.raises(ValueError, match="true_offset"):
        kvfn.evict_prompt_cache_by_head(full, keep, true_offset=19)
    with pytest.raises(ValueError, match="layer 1"):
        kvfn.evict_prompt_cache_by_head(full, [None, [mx.arange(5)], None])


def test_query_head_keep_sets_merge_into_their_kv_head():
    fm = kvfn.FunctionalModel(tiny_model("llama"))  # 4 query heads over 2 KV heads
    full = kvfn.prefill(fm, mx.array([list(range(12))]))
    q_sets = [mx.array([0, 1]), mx.array([1, 5]), mx.arange(12), mx.array([3])]
    states, result = kvfn.evict_prompt_cache_by_head(full, [None, q_sets, None], query_heads=4)
    assert part.row_counts(states[1]).tolist() == [[3, 12]]  # {0, 1, 5} and all


# -- head patterns -------------------------------------------------------------------------------


def test_head_pattern_reads_and_writes_duoattentions_format(tmp_path):
    scores = np.array([[0.9, 0.1, 0.5], [0.0, 1.0, 0.2]])
    (tmp_path / "full_attention_heads.tsv").write_text(
        "\n".join("\t".join(str(x) for x in r) for r in scores) + "\n"
    )
    (tmp_path / "config.json").write_text('{"sink_size": 32, "recent_size": 128}')
    p = HeadPattern.load(tmp_path)
    assert p.shape == (2, 3) and (p.sink_size, p.recent_size) == (32, 128)
    assert p.retrieval(threshold=0.5) == ((True, False, True), (False, True, False))
    assert p.retrieval(ratio=0.5) == ((True, False, True), (False, True, False))
    assert sum(map(sum, p.retrieval(ratio=1 / 3))) == 2
    out = p.save(tmp_path / "copy", method="test")
    again = HeadPattern.load(out)
    assert again == p
    policy = Duo.from_pattern(again, ratio=0.5)
    assert policy.sink_tokens == 32 and policy.recent == 128
    (tmp_path / "config.json").write_text('{"sink_size": 32, "recent_size": 128, "sparsity": 0.5}')
    released = HeadPattern.load(tmp_path)
    assert released.sparsity == 0.5 and released.retrieval() == p.retrieval(ratio=0.5)
    assert Duo(pattern=released).heads == p.retrieval(ratio=0.5)
    named = kvfn.parse_policy("duo-r50", pattern=again)
    assert named.heads == policy.heads and named.ratio == 50
    assert kvfn.parse_policy("duo-snapkv-r25", budget=256, pattern=again).compress


def test_head_pattern_and_duo_reject_bad_values(tmp_path):
    (tmp_path / "bad.tsv").write_text("0.1\tx\n")
    with pytest.raises(ValueError, match="tab-separated"):
        HeadPattern.load(tmp_path / "bad.tsv")
    with pytest.raises(FileNotFoundError):
        HeadPattern.load(tmp_path / "none")
    with pytest.raises(ValueError, match="ratio"):
        HeadPattern(scores=[[0.5]]).retrieval(ratio=1.5)
    with pytest.raises(ValueError, match="head pattern"):
        Duo().heads
    with pytest.raises(ValueError, match="percent"):
        Duo(ratio=150)
    with pytest.raises(ValueError, match="budget"):
        Duo(retrieval=((True,),), compress=True)
    fm = kvfn.FunctionalModel(tiny_model("llama"))
    with pytest.raises(ValueError, match="3 layers"):
        kvfn.compact(fm, [i % 97 for i in range(400)], Duo(retrieval=((True, False),), sink_tokens=2,
                                                recent=4))  # fmt: skip


def test_states_of_every_kind_save_and_load(tmp_path):
    fm = kvfn.FunctionalModel(tiny_model("llama"))
    ids = np.random.default_rng(5).integers(0, 97, 50).tolist()
    policy = Duo(retrieval=PATTERN, sink_tokens=2, recent=6, budget=24, window=4, compress=True)
    states, _ = kvfn.compact(fm, ids, policy, max_new_tokens=4)
    kvfn.tree.save(tmp_path / "s.safetensors", states, metadata={"model": "tiny"})
    again, meta = kvfn.tree.load(tmp_path / "s.safetensors")
    assert meta == {"model": "tiny"}
    assert [type(s) for s in again] == [type(s) for s in states]
    assert [kvfn.tree.flatten(s)[1:] for s in again] == [kvfn.tree.flatten(s)[1:] for s in states]
    token = mx.array([[ids[-1]]])
    a, _ = fm.decode(token, states)
    b, _ = fm.decode(token, again)
    assert mx.array_equal(a, b)
    mx.save_safetensors(str(tmp_path / "other.safetensors"), {"x": mx.zeros(2)})
    with pytest.raises(ValueError, match="no kvfn states"):
        kvfn.tree.load(tmp_path / "other.safetensors")


@pytest.mark.parametrize("kind", ["duo", "snapkv"])
def test_states_saved_with_empty_free_slots_load_with_their_next_positions(tmp_path, kind):
    """A file from before free slots held their next positions (EMPTY past ``rows``) loads
    with that tail rebuilt: decoding, then a trim (which drops rows by position), then decoding
    again gives what the states never saved give."""

    def old_layout(g):
        if type(g) is not kv.State:
            return g
        past = mx.arange(g.capacity) >= g.rows
        return g.replace(positions=mx.where(past, kv.EMPTY, g.positions))

    def old(s):
        parts = getattr(s, "parts", None)
        return old_layout(s) if parts is None else s.replace(parts=tuple(map(old_layout, parts)))

    def trim(s):
        return part.trim(s, 1) if isinstance(s, part.HeadPartitionedKVCache) else kv.trim(s, 1)

    def run(states, token):
        out = []
        for step in range(4):
            if step == 2:
                states = tuple(trim(s) for s in states)
            logits, states = fm.decode(token, states)
            out.append(logits)
        return out

    fm = kvfn.FunctionalModel(tiny_model("llama"))
    ids = np.random.default_rng(7).integers(0, 97, 50).tolist()
    policy = (Duo(retrieval=PATTERN, sink_tokens=2, recent=6, budget=24, window=4, compress=True)
              if kind == "duo" else kvfn.SnapKV(budget=24, window=4))  # fmt: skip
    states, _ = kvfn.compact(fm, ids, policy, max_new_tokens=6)
    want = part.HeadPartitionedKVCache if kind == "duo" else kv.State
    assert {type(s) for s in states} == {want}
    kvfn.tree.save(tmp_path / "old.safetensors", tuple(old(s) for s in states))
    again, _ = kvfn.tree.load(tmp_path / "old.safetensors")
    token = mx.array([[ids[-1]]])
    for a, b in zip(run(states, token), run(again, token)):
        assert mx.array_equal(a, b)


def test_rings_saved_with_a_position_per_slot_load_as_they_were(tmp_path):
    """A file from before rings derived their positions (a ``positions`` array, no ``since``)
    loads to the same ring, including one a trim left partly empty."""
    full = rg.update(rg.init(2, 2, 3, sink=2, recent=4), mx.repeat(rows(11), 2, 0),
                     mx.repeat(rows(11), 2, 0))  # fmt: skip
    for ring in (full, rg.prefix_trim(full, mx.array([8, 3], mx.int32)), rg.trim(full, 5)):
        s = kv.from_full(mx.repeat(rows(4, H=1), 2, 0), mx.repeat(rows(4, H=1), 2, 0))
        layer = part.partition([s, ring], [(0,), (1, 2)])
        kvfn.tree.save(tmp_path / "new.safetensors", [layer])
        flat, meta = mx.load(str(tmp_path / "new.safetensors"), return_metadata=True)
        flat["0.1.positions"] = ring.positions
        del flat["0.1.since"]
        mx.save_safetensors(str(tmp_path / "old.safetensors"), flat, metadata=meta)
        (again,), _ = kvfn.tree.load(tmp_path / "old.safetensors")
        assert mx.array_equal(again.parts[1].positions, ring.positions)
        assert again.parts[1].offset.tolist() == ring.offset.tolist()


def test_partitioned_states_saved_with_groups_load_as_they_were(tmp_path):
    """A file from before a partitioned layer's head sets were named ``parts`` (its metadata
    says ``groups``) loads to the same states."""
    fm = kvfn.FunctionalModel(tiny_model("llama"))
    ids = np.random.default_rng(6).integers(0, 97, 40).tolist()
    states, _ = kvfn.compact(fm, ids, Duo(retrieval=PATTERN, sink_tokens=2, recent=6),
                             max_new_tokens=4)  # fmt: skip
    kvfn.tree.save(tmp_path / "new.safetensors", states)
    flat, meta = mx.load(str(tmp_path / "new.safetensors"), return_metadata=True)
    saved = json.loads(meta["kvfn_states"])
    assert '"parts"' in meta["kvfn_states"] and '"groups"' not in meta["kvfn_states"]
    old = json.dumps(saved).replace('"parts"', '"groups"')
    mx.save_safetensors(str(tmp_path / "old.safetensors"), flat, metadata={"kvfn_states": old})
    again, _ = kvfn.tree.load(tmp_path / "old.safetensors")
    assert [kvfn.tree.flatten(s)[1:] for s in again] == [kvfn.tree.flatten(s)[1:] for s in states]
    a, _ = fm.decode(mx.array([[ids[-1]]]), states)
    b, _ = fm.decode(mx.array([[ids[-1]]]), again)
    assert mx.array_equal(a, b).item()


def test_stacked_partitioned_states_decode_as_each_alone():
    """``partitioned.stack`` joins the Duo states of prompts of different lengths (plain parts
    of different rows, rings at different offsets): a chunk and decode steps over the batch give
    each its own logits; layers that cannot share a batch are refused by name."""
    fm = kvfn.FunctionalModel(tiny_model("qwen2"))
    rng = np.random.default_rng(11)
    pattern = PATTERN[: len(fm.n_kv_heads)]
    policy = Duo(retrieval=pattern, sink_tokens=2, recent=6, budget=20, window=4, compress=True)
    prompts = [rng.integers(0, 97, n).tolist() for n in (60, 41)]
    kept = [kvfn.compact(fm, ids, policy)[0] for ids in prompts]
    assert isinstance(kept[0][0], part.HeadPartitionedKVCache)
    offsets = [int(k[0].offset.item()) for k in kept]
    assert offsets[0] != offsets[1]
    stacked = [kvfn.tree.stack([a, b]) for a, b in zip(*kept)]
    tail = rng.integers(0, 97, 3).tolist()
    # 8 steps: past the rings' 6 recent slots, so each ring wraps at its own offset
    assert stacked_gap(fm, stacked, kept, tail, steps=8) < TOL
    _, after = fm.forward(mx.array([tail, tail]), stacked)
    assert after[0].parts[1].offset.tolist() == [o + 3 for o in offsets]
    wider = Duo(retrieval=pattern, sink_tokens=2, recent=7, budget=20, window=4, compress=True)
    other = kvfn.compact(fm, prompts[1], wider)[0]
    with pytest.raises(ValueError, match="cannot stack rings of different sizes"):
        part.stack([kept[0][0], other[0]])
    flipped = Duo(retrieval=((False, True),) * len(pattern), sink_tokens=2, recent=6)
    with pytest.raises(ValueError, match="different head parts"):
        part.stack([kept[0][0], kvfn.compact(fm, prompts[1], flipped)[0][0]])
    with pytest.raises(ValueError, match="at least one"):
        part.stack([])
    with pytest.raises(ValueError, match="at least one"):
        rg.stack([])
    with pytest.raises(ValueError, match="different kinds"):
        kvfn.tree.stack([kept[0][0], kvfn.prefill(fm, mx.array([prompts[1]]))[0]])
    slots = kvfn.slots.pack_layers(kept[0])[0]
    assert not kvfn.tree.stackable(slots) and kvfn.tree.stackable(kept[0][0])
    with pytest.raises(TypeError, match="HeadSlotsKVCache layers do not stack"):
        kvfn.tree.stack([slots, slots])


def test_partitioned_states_trim_exactly():
    fm = kvfn.FunctionalModel(tiny_model("llama"))
    ids = np.random.default_rng(6).integers(0, 97, 40).tolist()
    policy = Duo(retrieval=PATTERN, sink_tokens=2, recent=6)
    states, _ = kvfn.compact(fm, ids, policy, max_new_tokens=8)
    token = mx.array([[ids[-1]]])
    one, after_one = fm.decode(token, states)
    _, after_two = fm.decode(mx.argmax(one, axis=-1)[:, None], after_one)
    rolled = tuple(part.trim(s, 1) if isinstance(s, part.HeadPartitionedKVCache) else kv.trim(s, 1)
                   for s in after_two)  # fmt: skip
    assert [int(s.offset.item()) for s in rolled] == [40] * 3
    # the rolled-back rows are gone and nothing else: the retrieval heads hold exactly what
    # they held after one step; a streaming ring lost the row the second step pushed out
    for r, o in zip(rolled, after_one):
        for gr, go in zip(getattr(r, "parts", (r,)), getattr(o, "parts", (o,))):
            held = lambda g: sorted(  # the stored rows' positions (a plain part's first rows)
                p
                for p in np.array(g.positions)[..., : int(getattr(g, "rows", g.capacity))]
                .ravel()
                .tolist()
                if p != kv.EMPTY
            )
            lost = set(held(go)) - set(held(gr))
            assert set(held(gr)) <= set(held(go)) and (not lost or isinstance(gr, rg.StreamingRing))
    again, _ = fm.decode(mx.argmax(one, axis=-1)[:, None], rolled)
    redo, _ = fm.decode(mx.argmax(one, axis=-1)[:, None], after_one)
    assert mx.abs(again - redo).max().item() < TOL  # the lost ring row was out of view anyway


# -- Ada-KV: per-head budgets, stored ragged ------------------------------------------------------


def test_adakv_allocation_follows_scores_and_keeps_each_heads_floor():
    policy = kvfn.AdaKV(budget=20, window=4, sink_tokens=2, kernel_size=1, floor=25)
    P = 60
    s = np.full((1, 2, P), 1e-3, np.float32)  # 2 KV heads, one query head each
    s[0, 0, 10:40] = 1.0  # head 0 attends to 30 middle rows, head 1 to one row
    s[0, 1, 30] = 5.0
    keep = policy.allocation(mx.array(s), prompt_length=P, n_kv_heads=2)
    assert sum(len(k) for k in keep) == 40  # the layer's budget, shared out
    # head 1 keeps only its sinks, window and floor (25% of 20): 2 + 4 + 5 rows, its hot row
    # among them; head 0 the rest: its sinks and window and 40 - 11 - 6 = 23 of its hot rows
    assert len(keep[1]) == 11 and {0, 1, 30} | set(range(56, 60)) <= set(keep[1].tolist())
    assert len(keep[0]) == 29 and len(set(range(10, 40)) & set(keep[0].tolist())) == 23
    for k in keep:
        assert k.tolist() == sorted(set(k.tolist()))


def test_adakv_decodes_like_per_head_masked_full_attention():
    fm = kvfn.FunctionalModel(tiny_model("llama"))
    ids = np.random.default_rng(7).integers(0, 97, 60).tolist()
    policy = kvfn.parse_policy("adakv", budget=20, window=4, sink_tokens=2)
    states, result = kvfn.compact(fm, ids, policy, max_new_tokens=4)
    P = len(ids) - 1
    kept = []  # per layer, per KV head: the positions it holds
    for s in states:
        held = [np.array(kvfn.ragged.head_rows(s, 0, h)[2]) for h in range(2)]
        kept.append([p[p < P] for p in held])
    assert any(len(k[0]) != len(k[1]) for k in kept)  # some layer is ragged
    assert all(len(k[0]) + len(k[1]) == 40 for k in kept)
    assert kept_sets_gap(fm, ids, states, kept) < TOL
    assert result.total_bytes_after < result.total_bytes_before
    with pytest.raises(ValueError, match="unknown option 'layer' for policy 'adakv'"):
        kvfn.parse_policy("adakv-layer", budget=64)
    with pytest.raises(ValueError, match="per_head"):
        kvfn.AdaKV(budget=64, per_head=False)


def test_a_chunk_after_duo_compaction_sees_what_each_head_keeps():
    """A chunk longer than the ring (a follow-up turn): streaming heads attend over the ring
    before the chunk plus the chunk itself, with the sink + recent rule per query."""
    fm = kvfn.FunctionalModel(tiny_model("llama"))
    rng = np.random.default_rng(8)
    ids = rng.integers(0, 97, 50).tolist()
    policy = Duo(retrieval=PATTERN, sink_tokens=2, recent=6)
    states, _ = kvfn.compact(fm, ids, policy)
    follow = rng.integers(0, 97, 15).tolist()
    chunk = [ids[-1]] + follow
    logits, after = fm.forward(mx.array([chunk]), states)
    P = len(ids) - 1
    T = P + len(chunk)
    ref = reference_logits(fm.model, mx.array([ids[:-1] + chunk]),
                           duo_visibility(fm, states, P, T, policy))[P:]  # fmt: skip
    assert mx.abs(logits[0] - ref).max().item() < TOL
    ring = after[0].parts[1]
    held = sorted(p for p in np.array(ring.positions).ravel().tolist() if p != kv.EMPTY)
    assert held == [0, 1] + list(range(T - 6, T))
    more, _ = kvfn.prefill(fm, mx.array([follow[:3]]), states=states), None
    assert int(more[0].offset.item()) == P + 3

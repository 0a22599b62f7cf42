"""The slots layout (``kvfn.slots``): DuoAttention's two head parts in one buffer a layer.
Laws: it is the two-part state's rows, reshaped (``to_partitioned(op(s)) == op(parts)``);
the one-row write equals the parts' update; and the oracle: decoding from it equals one
full-sequence pass of the unmodified model masked per (layer, KV head) to the kept rows."""

import mlx.core as mx
import numpy as np
import pytest

import kvfn
from kvfn import cache as kv
from kvfn import kernels
from kvfn import partitioned as part
from kvfn import ring as rg
from kvfn import slots as sl
from kvfn.policies.duo import Duo
from tests.test_duo import PATTERN, TOL, duo_visibility, greedy_logits, reference_logits
from tests.tiny import tiny_model


def same(a, b) -> None:
    """Two two-part states hold the same arrays."""
    assert a.heads == b.heads
    for g, h in zip(a.parts, b.parts):
        assert type(g) is type(h)
        fields = rg.ARRAY_FIELDS if isinstance(g, rg.StreamingRing) else kv.ARRAY_FIELDS
        for f in fields:
            x, y = np.array(getattr(g, f)), np.array(getattr(h, f))
            assert x.shape == y.shape and np.array_equal(x, y), f


def layer(B=3, sink=2, recent=5, C=24, prompt=9, ring_first=False, D=8, Dv=8):
    """A two-part layer of 4 KV heads (heads 1, 3 plain, 0, 2 streaming), every head's rows
    distinct, sequences at different offsets (a prefix trim)."""
    rng = np.random.default_rng(0)
    k = mx.array(rng.normal(size=(B, 4, prompt, D)).astype(np.float32))
    v = mx.array(rng.normal(size=(B, 4, prompt, Dv)).astype(np.float32))
    plain = kv.reserve(kv.from_full(k[:, [1, 3]], v[:, [1, 3]]), C)
    ring = rg.init(B, 2, D, sink=sink, recent=recent, value_dim=Dv)
    ring = rg.update(ring, k[:, [0, 2]], v[:, [0, 2]])
    parts, heads = (plain, ring), ((1, 3), (0, 2))
    if ring_first:
        parts, heads = parts[::-1], heads[::-1]
    return part.partition(parts, heads)


def test_slots_round_trip_and_store_no_union():
    p = layer()
    s = sl.from_partitioned(p)
    same(sl.to_partitioned(s), p)
    assert s.keys.shape == (3, 2 * 24 + 2 * 7, 8)  # each head its own range, no union
    assert s.nbytes == p.nbytes
    r = layer(ring_first=True)
    same(sl.to_partitioned(sl.from_partitioned(r)), p)  # the plain part first, whatever order
    assert sl.row_counts(s).tolist() == part.row_counts(p).tolist()


@pytest.mark.parametrize("sink", [0, 2])
@pytest.mark.parametrize("Dv", [8, 4])
def test_slots_one_row_write_equals_the_groups_update(sink, Dv):
    """Law: a decode step's write (one scatter per array over all heads) equals the two-part
    update, whatever each sequence's offset (below the sinks, wrapping, after a trim), with
    values as wide as the keys or not."""
    p = part.prefix_trim(layer(sink=sink, Dv=Dv), mx.array([1, 6, 9], mx.int32))
    s = sl.from_partitioned(p)
    rng = np.random.default_rng(1)
    for step in range(12):
        k = mx.array(rng.normal(size=(3, 4, 1, 8)).astype(np.float32))
        v = mx.array(rng.normal(size=(3, 4, 1, Dv)).astype(np.float32))
        p, s = part.update(p, k, v), sl.update(s, k, v)
        same(sl.to_partitioned(s), p)
    shared = sl.appended(s)  # what layers in lockstep share
    k, v = mx.ones((3, 4, 1, 8)), mx.ones((3, 4, 1, Dv))
    same(sl.to_partitioned(sl.write_at(s, k, v, **shared)), part.update(p, k, v))


def test_slots_chunks_trims_and_masks_are_the_groups():
    p = layer()
    s = sl.from_partitioned(p)
    k = mx.arange(3 * 4 * 5 * 8, dtype=mx.float32).reshape(3, 4, 5, 8)
    same(sl.to_partitioned(sl.update(s, k, k)), part.update(p, k, k))
    same(sl.to_partitioned(sl.trim(s, 2)), part.trim(p, 2))
    same(sl.to_partitioned(sl.prefix_trim(s, 4)), part.prefix_trim(p, 4))
    same(sl.to_partitioned(sl.reserve(s, 40)), part.partition(
        (kv.reserve(p.parts[0], 40), p.parts[1]), p.heads))  # fmt: skip
    for a, b in zip(sl.mask(s, 1), part.mask(p, 1)):
        assert np.array_equal(np.array(a), np.array(b))


def test_slots_reject_bad_input():
    p = layer()
    s = sl.from_partitioned(p)
    with pytest.raises(ValueError, match="two head parts"):
        sl.from_partitioned(part.partition([p.parts[0]], [(0, 1)]))
    with pytest.raises(ValueError, match="StreamingRing"):
        sl.from_partitioned(part.partition([p.parts[1], p.parts[1]], [(0, 2), (1, 3)]))
    windowed = p.parts[0].replace(sliding_window=4)
    with pytest.raises(ValueError, match="window"):
        sl.from_partitioned(p.replace(parts=(windowed, p.parts[1])))
    with pytest.raises(ValueError, match="HeadPartitionedKVCache"):
        sl.from_partitioned(p.parts[0])
    with pytest.raises(ValueError, match="KV heads"):
        sl.update(s, mx.zeros((3, 3, 1, 8)), mx.zeros((3, 3, 1, 8)))
    with pytest.raises(ValueError, match="rows"):
        sl.update(s, mx.zeros((3, 4, 1, 8)), mx.zeros((3, 4, 2, 8)))
    full = sl.from_partitioned(layer(C=9))  # 9 rows in 9 slots
    with pytest.raises(ValueError, match="reserve"):
        sl.update(full, mx.zeros((3, 4, 1, 8)), mx.zeros((3, 4, 1, 8)))
    with pytest.raises(ValueError, match="one query"):
        sl.attend(s, mx.zeros((3, 8, 2, 8)), 1.0)


# a layer of retrieval heads only (a plain state), one of both kinds, one of streaming heads only
MIXED = ((True, True), (False, True), (False, False))


@pytest.mark.parametrize(
    "family, compress, pattern",
    [("llama", False, PATTERN), ("llama", True, PATTERN), ("qwen3", False, PATTERN),
     ("qwen3", True, PATTERN), ("llama", False, MIXED), ("qwen3", True, MIXED)],
)  # fmt: skip
def test_slots_decode_equals_per_head_masked_full_attention(family, compress, pattern):
    """The oracle, and the same logits and rows as the two-part state, traced once; layers
    that are not two parts (``MIXED``) stay as they are beside the packed ones."""
    fm = kvfn.FunctionalModel(tiny_model(family))
    ids = np.random.default_rng(1).integers(0, 97, 70).tolist()
    policy = Duo(retrieval=pattern[: len(fm.n_kv_heads)], sink_tokens=2, recent=6,
                 budget=24 if compress else 2**31 - 1, window=4, compress=compress)  # fmt: skip
    states, _ = kvfn.compact(fm, ids, policy, max_new_tokens=10)
    slots = sl.pack_layers(states)
    two_parts = [isinstance(s, part.HeadPartitionedKVCache) and len(s.parts) == 2 for s in states]
    assert [isinstance(s, sl.HeadSlotsKVCache) for s in slots] == two_parts and any(two_parts)
    assert all(b is a for a, b, two in zip(states, slots, two_parts) if not two)
    before = fm.traces
    got, tokens = greedy_logits(fm, ids, slots, 10)  # the ring wraps
    assert fm.traces == before + 1
    two, _ = greedy_logits(fm, ids, states, 10)
    assert mx.abs(got - two).max().item() < TOL
    P, T = len(ids) - 1, len(tokens) - 1
    seq = mx.array([tokens[:T]])
    ref = reference_logits(fm.model, seq, duo_visibility(fm, states, P, T, policy))[P:]
    full = reference_logits(fm.model, seq, lambda i: "causal")[P:]
    assert mx.abs(got - ref).max().item() < TOL
    assert mx.abs(got - full).max().item() > 100 * TOL  # not vacuous


def test_slots_states_save_and_load(tmp_path):
    """``tree.save`` writes a slots layer as its two-part state and ``load`` gives the slots
    layout back: same arrays, static and host fields, and the same next logits."""
    fm = kvfn.FunctionalModel(tiny_model("llama"))
    ids = np.random.default_rng(3).integers(0, 97, 60).tolist()
    policy = Duo(retrieval=PATTERN[: len(fm.n_kv_heads)], sink_tokens=2, recent=6, budget=24,
                 window=4, compress=True)  # fmt: skip
    states, _ = kvfn.compact(fm, ids, policy, max_new_tokens=6)
    token = mx.array([[ids[-1]]])
    slots = sl.pack_layers(fm.decode(token, sl.pack_layers(states))[1])  # a row decoded in slots
    kvfn.tree.save(tmp_path / "s.safetensors", slots)
    again, _ = kvfn.tree.load(tmp_path / "s.safetensors")
    assert all(isinstance(s, sl.HeadSlotsKVCache) for s in again)
    for a, b in zip(again, slots):
        assert kvfn.tree.flatten(a)[1:] == kvfn.tree.flatten(b)[1:]
        for x, y in zip(kvfn.tree.arrays(a), kvfn.tree.arrays(b)):
            assert x.shape == y.shape and mx.array_equal(x, y).item()
    assert mx.array_equal(fm.decode(token, again)[0], fm.decode(token, slots)[0]).item()
    kvfn.states.layout.LAYOUTS.pop(sl.HeadSlotsKVCache)  # a file of a layout this kvfn does not know
    try:
        with pytest.raises(ValueError, match="saved as 'slots'"):
            kvfn.tree.load(tmp_path / "s.safetensors")
    finally:
        kvfn.states.layout.LAYOUTS[sl.HeadSlotsKVCache] = sl.Layout


def test_slots_chunk_then_decode_and_grow():
    """A chunk (through the parts), decode past the plain heads' capacity (they grow), and a
    rollback: all as the two-part state does."""
    fm = kvfn.FunctionalModel(tiny_model("llama"))
    ids = np.random.default_rng(3).integers(0, 97, 40).tolist()
    states, _ = kvfn.compact(fm, ids, Duo(retrieval=PATTERN, sink_tokens=2, recent=4),
                             max_new_tokens=1)  # fmt: skip
    # the retrieval heads keep the prompt's 39 rows whole, with room for max_new_tokens + 1,
    # not the prefill's bucket (256 slots)
    assert states[0].parts[0].capacity == 39 + 2
    a, b = states, sl.pack_layers(states)
    chunk = mx.array([ids[:5]])
    la, a = fm.step(chunk, a)
    lb, b = fm.step(chunk, b)
    assert mx.abs(la - lb).max().item() < TOL
    token = mx.array([[ids[-1]]])
    for _ in range(6):  # past the reserved slot: the plain heads grow
        la, a = fm.decode(token, a)
        lb, b = fm.decode(token, b)
        assert mx.abs(la - lb).max().item() < TOL
        token = mx.argmax(la, axis=-1)[:, None]
    assert b[0].capacity > states[0].parts[0].capacity
    for x, y in zip(a, b):
        same(sl.to_partitioned(sl.trim(y, 3)), part.trim(x, 3))


needs_cuda = pytest.mark.skipif(
    not (mx.default_device() == mx.gpu and mx.cuda.is_available()), reason="CUDA kernel"
)


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("D,C,prompt", [(64, 300, 200), (128, 2048, 1500)])  # 128: tensor cores
def test_slots_kernel_equals_each_group_alone(dtype, D, C, prompt):
    p = layer(B=1, C=C, prompt=prompt, D=D, Dv=D)
    plain, ring = p.parts
    ring = ring.replace(full=True)  # one sequence, 200 rows through a ring of 7: every slot holds
    p = p.replace(parts=tuple(g.replace(keys=g.keys.astype(dtype), values=g.values.astype(dtype))
                               for g in (plain, ring)))  # fmt: skip
    s = sl.from_partitioned(p)
    q = mx.random.normal((1, 8, 1, D), key=mx.random.key(0)).astype(dtype)
    got = sl.attend(s, q, 0.3)
    assert kernels.slots_fused(q, s.keys, s.values) and s.full
    heads = len(s.heads[0]) + len(s.heads[1])
    assert kernels._mma_applies(q, s.keys, heads, C) == (D == 128 and dtype == mx.bfloat16)
    want = part.attend(p, p, q, [None, None], [None, None], 0.3)  # per group
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    assert mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item() < tol

"""Laws of the pure state functions, checked with hypothesis on small random states."""

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfn import cache as kv

SETTINGS = settings(max_examples=40, deadline=None)


def full_state(B, H, N, D=4, capacity=None, seed=0):
    mx.random.seed(seed)
    k, v = mx.random.normal((B, H, N, D)), mx.random.normal((B, H, N, D))
    s = kv.update(kv.init(B, H, D, capacity or N), k, v)
    return s


def tail_is_next(s: kv.State) -> bool:
    """The layout's invariant: each slot at or past ``rows`` holds the position the next
    appends give it, so appending never writes a position."""
    pos, slots = np.array(s.positions), np.arange(s.capacity)
    want = np.array(s.offset)[:, None, None] + (slots - s.rows.item())
    tail = slots >= s.rows.item()
    return np.array_equal(pos[..., tail], np.broadcast_to(want, pos.shape)[..., tail])


def stored(s: kv.State) -> list:
    """Per (sequence, head), its stored rows in slot order: (positions, keys, values)."""
    pos = np.array(s.positions)
    keys, values = np.array(s.keys), np.array(s.values)
    valid = (pos != kv.EMPTY) & (np.arange(s.capacity) < s.rows.item())
    return [(pos[b, h][valid[b, h]], keys[b, h][valid[b, h]], values[b, h][valid[b, h]])
            for b in range(pos.shape[0]) for h in range(pos.shape[1])]  # fmt: skip


def logically_equal(a: kv.State, b: kv.State) -> bool:
    """Same rows attended in the same way (the same stored rows, positions and offset), both
    holding the layout's invariant."""
    if a.sliding_window != b.sliding_window or a.capacity != b.capacity:
        return False
    if not (tail_is_next(a) and tail_is_next(b)):
        return False
    return np.array_equal(np.array(a.offset), np.array(b.offset)) and all(
        all(np.array_equal(x, y) for x, y in zip(ra, rb)) for ra, rb in zip(stored(a), stored(b))
    )


def random_keep(rng, B, H, N, k):
    return mx.array(
        np.sort(
            np.stack([[rng.choice(N, k, replace=False) for _ in range(H)] for _ in range(B)]), -1
        )
    )


dims = st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 12), st.integers(1, 5))


@SETTINGS
@given(dims)
def test_trim_undoes_update(d):
    B, H, N, n = d
    s = full_state(B, H, N, capacity=N + n)
    k = mx.random.normal((B, H, n, 4))
    assert logically_equal(kv.trim(kv.update(s, k, k), n), s)
    assert kv.trim(kv.update(s, k, k), n).rows.item() == s.rows.item()


@SETTINGS
@given(dims)
def test_evict_with_every_index_is_identity(d):
    B, H, N, _ = d
    s = full_state(B, H, N)
    every = mx.broadcast_to(mx.arange(N), (B, H, N))
    assert logically_equal(kv.evict(s, every), s)


@SETTINGS
@given(dims, st.integers(0, 2**16), st.one_of(st.none(), st.integers(1, 6)))
def test_mask_is_causal_over_kept_true_positions(d, seed, window):
    B, H, N, n = d
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, N + 1))
    s = dataclasses.replace(full_state(B, H, N, capacity=N + n), sliding_window=window)
    s = kv.evict(s, random_keep(rng, B, H, N, k))
    s = kv.update(kv.reserve(s, k + n), *(2 * [mx.zeros((B, H, n, 4))]))
    got = np.array(kv.mask(s, n))
    pos = np.array(s.positions)
    q = np.array(s.offset)[:, None] - n + np.arange(n)
    for b in range(B):
        for h in range(H):
            for i in range(n):
                for j in range(s.capacity):
                    ok = pos[b, h, j] != kv.EMPTY and pos[b, h, j] <= q[b, i]
                    ok = ok and (window is None or pos[b, h, j] > q[b, i] - window)
                    assert got[b, h, i, j] == ok


@SETTINGS
@given(dims, st.integers(0, 2**16))
def test_prefix_trim_commutes_with_eviction(d, seed):
    """Keeping positions < L of a compacted state = compacting what a prefix trim left."""
    B, H, N, _ = d
    rng = np.random.default_rng(seed)
    length = int(rng.integers(0, N + 1))
    s = full_state(B, H, N)
    keep = random_keep(rng, B, H, N, int(rng.integers(1, N + 1)))
    a = kv.prefix_trim(kv.evict(s, keep), length)
    b = kv.evict(kv.prefix_trim(s, length), keep)
    assert logically_equal(a, b)
    assert np.all(np.array(a.offset) == min(length, N))
    kept = np.array(a.positions)[..., : a.rows.item()]
    assert np.all((kept == kv.EMPTY) | (kept < length))


def test_trim_of_generated_rows_restores_the_compacted_state():
    s = full_state(1, 2, 10)
    compacted = kv.reserve(kv.evict(s, mx.array([[[0, 3, 8, 9], [1, 2, 8, 9]]])), 7)
    grown = compacted
    for _ in range(3):
        grown = kv.update(grown, mx.ones((1, 2, 1, 4)), mx.ones((1, 2, 1, 4)))
    assert np.array(grown.positions)[0, 0, :7].tolist() == [0, 3, 8, 9, 10, 11, 12]
    assert logically_equal(kv.trim(grown, 3), compacted)
    # past the generated rows, only the retained rows with those positions go
    trimmed = kv.trim(grown, 5)
    assert np.array(trimmed.positions)[0, :, :4].tolist() == [[0, 3, 8, 9], [1, 2, 8, 9]]
    assert trimmed.offset.item() == 8 and trimmed.rows.item() == 2 and tail_is_next(trimmed)


@SETTINGS
@given(dims, st.integers(1, 6))
def test_rollback_gives_back_the_state_rows_were_appended_to(d, m):
    """Compacted or whole, ``rollback`` of rows just appended is the state after the rows
    before them, flags and bounds included (``trim`` leaves a compacted state unpacked)."""
    B, H, N, n = d
    whole = full_state(B, H, N, capacity=N + n + m)
    keep = mx.broadcast_to(mx.arange(0, N, 2, dtype=mx.int32), (B, H, (N + 1) // 2))
    compacted = kv.reserve(kv.evict(whole, keep), N + n + m)
    for s in (whole, compacted):
        k, extra = mx.random.normal((B, H, n, 4)), mx.random.normal((B, H, m, 4))
        before = kv.update(s, k, k)
        back = kv.rollback(kv.update(before, extra, extra), m)
        assert logically_equal(back, before) and tail_is_next(back)
        for f in ("rows", "offset", "positions"):
            assert mx.array_equal(getattr(back, f), getattr(before, f)).item()
        assert (back.max_rows, back.dense, back.packed) == (before.max_rows, before.dense,
                                                            before.packed)  # fmt: skip


def test_restrict_masks_exactly_the_evicted_slots():
    s = full_state(1, 2, 6)
    keep = mx.array([[[0, 4], [2, 5]]])
    r = kv.restrict(s, keep)
    assert np.array(r.positions).tolist() == [[[0, kv.EMPTY, kv.EMPTY, kv.EMPTY, 4, kv.EMPTY],
                                               [kv.EMPTY, kv.EMPTY, 2, kv.EMPTY, kv.EMPTY, 5]]]  # fmt: skip


@SETTINGS
@given(dims, st.integers(0, 2**16))
def test_appends_never_write_a_position(d, seed):
    """Every function keeps the free tail at the next positions, so an append (at static slots
    or at traced ones) leaves the positions array as it was, and the invariant holds after."""
    B, H, N, n = d
    rng = np.random.default_rng(seed)
    s = kv.reserve(full_state(B, H, N), N + 2 * n)
    k = int(rng.integers(1, N + 1))
    for state in (s, kv.reserve(kv.evict(s, random_keep(rng, B, H, N, k)), k + 2 * n),
                  kv.trim(s, int(rng.integers(0, N + 1))),
                  kv.restrict(s, random_keep(rng, B, H, N, k))):  # fmt: skip
        assert tail_is_next(state)
        rows = mx.random.normal((B, H, n, 4))
        grown = kv.update(state, rows, rows)
        assert grown.positions is state.positions and tail_is_next(grown)
        assert np.array_equal(np.array(kv.valid_rows(grown)), np.array(kv.valid_rows(state)) + n)


def test_functions_do_not_mutate_their_input():
    s = full_state(1, 2, 5, capacity=8)
    snapshot = {f: np.array(getattr(s, f)) for f in kv.ARRAY_FIELDS}
    k = mx.ones((1, 2, 2, 4))
    for out in (kv.update(s, k, k), kv.trim(s, 2), kv.prefix_trim(s, 1), kv.reserve(s, 9),
                kv.evict(s, mx.array([[[0, 1], [2, 3]]])), kv.restrict(s, mx.array([[[0], [1]]]))):  # fmt: skip
        assert out is not s
    kv.mask(s, 2)
    for f, before in snapshot.items():
        assert np.array_equal(np.array(getattr(s, f)), before), f
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.rows = mx.array(0)


def test_stack_pads_shorter_sequences_with_empty_slots():
    a, b = full_state(1, 2, 3, capacity=5), full_state(1, 2, 6, capacity=8, seed=1)
    s = kv.stack([a, b])
    assert s.keys.shape == (2, 2, 8, 4) and s.rows.item() == 6
    assert np.array(s.offset).tolist() == [3, 6]
    # a's free slots below the shared rows are EMPTY; past them, a's next positions
    assert np.array(s.positions)[0, 0].tolist() == [0, 1, 2] + [kv.EMPTY] * 3 + [3, 4]
    assert tail_is_next(s)


def test_flatten_round_trip_and_bad_input():
    s = dataclasses.replace(full_state(1, 1, 3), sliding_window=4)
    arrays, static = kv.flatten(s)
    assert all(isinstance(v, mx.array) for v in arrays.values())
    assert logically_equal(kv.unflatten(arrays, static), s)
    with pytest.raises(ValueError, match="capacity must be >= 0, got -1"):
        kv.init(1, 1, 4, -1)
    with pytest.raises(ValueError, match="trim needs n >= 0, got -2"):
        kv.trim(s, -2)
    with pytest.raises(ValueError, match="reserve cannot shrink capacity 3 to 1"):
        kv.reserve(s, 1)
    with pytest.raises(AssertionError):
        kv.update(s, mx.ones((1, 2, 1, 4)), mx.ones((1, 2, 1, 4)))  # wrong head count


def test_prefix_trim_lengths_are_checked_in_every_state_type():
    from kvfn import partitioned as part
    from kvfn import ragged
    from kvfn import ring as rg

    s = full_state(1, 2, 6)
    r = rg.update(rg.init(1, 2, 4, sink=1, recent=3), s.keys, s.values)
    g = ragged.from_keep_sets(s, [mx.arange(0, 6, 2), mx.arange(4)], room=1)
    p = part.from_keep_sets(s, [mx.arange(0, 6, 2), mx.arange(6)])
    for module, state in ((kv, s), (rg, r), (ragged, g), (part, p)):
        for bad in (-5, 2**31 - 1, 2**40):
            with pytest.raises(ValueError, match=f"0 <= length < 2147483647, got {bad}"):
                module.prefix_trim(state, bad)
        with pytest.raises(TypeError, match="integer length, got dtype mlx.core.float32"):
            module.prefix_trim(state, mx.array([2.7]))
        if module is not part:  # a partitioned layer masks each part with its module
            with pytest.raises(ValueError, match="mask needs n_queries >= 0, got -1"):
                module.mask(state, -1)
        by_numpy = module.prefix_trim(state, np.int64(3))  # a numpy integer is an int
        assert all(
            mx.array_equal(a, b)
            for a, b in zip(leaves(by_numpy), leaves(module.prefix_trim(state, 3)))
        )
        below = module.prefix_trim(state, mx.array([-3]))  # an array's negative keeps nothing
        none = module.prefix_trim(state, 0)
        assert below.offset.tolist() == none.offset.tolist() == [0]
        assert all(mx.array_equal(a, b) for a, b in zip(leaves(below), leaves(none)))


def leaves(x) -> list:
    """Every array of a state of any type, in field order."""
    if isinstance(x, mx.array):
        return [x]
    if isinstance(x, (tuple, list)):
        return [a for item in x for a in leaves(item)]
    if dataclasses.is_dataclass(x):
        return [a for f in dataclasses.fields(x) for a in leaves(getattr(x, f.name))]
    return []


def test_a_hand_built_state_still_refuses_rows_past_its_capacity():
    s = full_state(1, 2, 3, capacity=5)
    hand = kv.State(**{f: getattr(s, f) for f in kv.ARRAY_FIELDS})  # max_rows unknown: None
    assert hand.max_rows is None
    assert kv.prefix_trim(s, np.int32(2)).dense  # a plain cache's prefix stays plain
    with pytest.raises(ValueError, match="cannot append 3 rows to a state holding up to 3"):
        kv.update(hand, mx.ones((1, 2, 3, 4)), mx.ones((1, 2, 3, 4)))
    two = kv.update(hand, mx.ones((1, 2, 2, 4)), mx.ones((1, 2, 2, 4)))
    assert (two.rows.item(), two.max_rows) == (5, 5)


def test_stack_refuses_layers_of_different_dtypes():
    a, b = full_state(1, 2, 3), full_state(1, 2, 3)
    b = kv.from_full(b.keys.astype(mx.float16), b.values.astype(mx.float16))
    with pytest.raises(ValueError, match="different dtypes \\['mlx.core.float16', 'mlx.core.fl"):
        kv.stack([a, b])


def test_from_full_checks_its_values_and_window():
    k = mx.zeros((1, 2, 8, 4))
    with pytest.raises(AssertionError):
        kv.from_full(k, mx.zeros((1, 3, 8, 4)))  # another head count
    with pytest.raises(AssertionError):
        kv.from_full(k, mx.zeros((1, 2, 5, 4)))  # other rows
    for window in (0, -3):
        with pytest.raises(
            ValueError, match=f"sliding_window must be positive or None, got {window}"
        ):
            kv.from_full(k, k, sliding_window=window)


def test_arrays_lists_every_array_for_eval():
    s = full_state(1, 2, 3)
    assert len(kv.arrays(s)) == 5 and len(kv.arrays((s, s))) == 10
    assert all(isinstance(a, mx.array) for a in kv.arrays([s]))


def as_general(s: kv.State) -> kv.State:
    """The same state without the dense layout's static knowledge (the traced path)."""
    return dataclasses.replace(s, dense=False, max_rows=None)


@SETTINGS
@given(dims, st.integers(0, 2**16))
def test_dense_layout_updates_and_trims_like_the_general_one(d, seed):
    B, H, N, n = d
    rng = np.random.default_rng(seed)
    s = full_state(B, H, N, capacity=N + n)
    assert s.dense and s.static_rows == N
    k = mx.array(rng.normal(size=(B, H, n, 4)), mx.float32)
    dense, general = kv.update(s, k, k), kv.update(as_general(s), k, k)
    assert dense.dense and dense.static_rows == N + n
    assert logically_equal(dense, dataclasses.replace(general, dense=True))
    assert dense.rows.item() == general.rows.item() == N + n
    cut = int(rng.integers(0, N + n + 1))
    a, b = kv.trim(dense, cut), kv.trim(as_general(dense), cut)
    assert a.dense and a.static_rows == N + n - cut == a.rows.item() == b.rows.item()
    assert np.array_equal(np.array(a.positions), np.array(b.positions))
    assert np.array_equal(np.array(a.offset), np.array(b.offset))


def test_dense_update_leaves_its_input_alone():
    s = full_state(1, 2, 3, capacity=6)
    before = np.array(s.keys)
    kv.update(s, mx.ones((1, 2, 2, 4)), mx.ones((1, 2, 2, 4)))
    assert np.array_equal(np.array(s.keys), before) and s.rows.item() == 3


def test_eviction_and_masking_leave_the_dense_layout():
    s = full_state(1, 2, 6)
    assert not kv.evict(s, mx.array([[[0, 4], [2, 5]]])).dense
    assert not kv.restrict(s, mx.array([[[0, 4], [2, 5]]])).dense
    assert not kv.prefix_trim(s, mx.array([3])).dense  # a traced length: unknown on the host
    assert kv.reserve(s, 9).dense and kv.stack([s, s]).dense
    assert not kv.stack([s, full_state(1, 2, 4, capacity=6)]).dense


@SETTINGS
@given(dims, st.integers(0, 2**16))
def test_packed_mask_is_the_mask_of_a_packed_state(d, seed):
    """A packed state (compacted from a dense one, then appended to) masks by slot < rows + i + 1,
    exactly what the per-head mask from true positions gives."""
    B, H, N, n = d
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, N + 1))
    s = kv.evict(full_state(B, H, N), random_keep(rng, B, H, N, k))
    assert s.packed and not s.dense
    s = kv.reserve(s, k + 2 * n)
    s = kv.update(s, mx.ones((B, H, n, 4)), mx.ones((B, H, n, 4)))
    assert s.packed
    packed = np.broadcast_to(np.array(kv.packed_mask(s, n)), (B, H, n, s.capacity))
    after = kv.update(s, mx.zeros((B, H, n, 4)), mx.zeros((B, H, n, 4)))
    assert np.array_equal(packed, np.array(kv.mask(after, n)))

"""One suite for every policy under the contract, then each baseline's own rows."""

from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import numpy as np
import pytest

import kvfn
from kvfn import (
    ChunkKV,
    ExpectedAttention,
    FunctionalModel,
    KVzip,
    Policy,
    PyramidKV,
    RandomRows,
    SnapKV,
    StreamingLLM,
    parse_policy,
)
from kvfn.policies import AcrossHeads, AcrossLayers, Plan, Pyramid
from tests.test_duo import TOL, kept_sets_gap
from tests.test_ragged import held_positions, reference_allocation
from tests.tiny import tiny_model


@dataclass(frozen=True)
class EveryOther(Policy):
    """A policy written in a test: the even rows first, no scores."""

    name: ClassVar[str] = "everyother"

    def row_scores(self, scores, *, prompt_length, n_kv_heads, batch, layer):
        even = (mx.arange(prompt_length) % 2 == 0).astype(mx.float32)
        return mx.broadcast_to(even, (batch, 1, prompt_length))


kvfn.register_policy(EveryOther)

POLICIES = [
    SnapKV(budget=20, window=6, sink_tokens=3),
    SnapKV(budget=20, window=6, sink_tokens=3, per_head=False, pooling="avg", kernel_size=5),
    StreamingLLM(budget=20, sink_tokens=3),
    RandomRows(budget=20, window=6, sink_tokens=3, seed=5),
    ChunkKV(budget=20, window=6, sink_tokens=3, chunk_size=4),
    EveryOther(budget=20, window=6, sink_tokens=3),
    PyramidKV(budget=20, window=6, sink_tokens=3, beta=4),
    KVzip(budget=20, window=6, sink_tokens=3, prompt=(5, 6, 7), chunk=7),
    KVzip(budget=20, window=6, sink_tokens=3, per_head=False, kernel_size=3),
    ExpectedAttention(budget=20, window=6, sink_tokens=3, future=16),
    ExpectedAttention(budget=20, window=6, sink_tokens=3, covariance=False, per_head=False),
    # allocations: today's shorthands and scorers they could not wrap before
    kvfn.AdaKV(budget=20, window=6, sink_tokens=3),
    kvfn.AdaKVzip(budget=20, window=6, sink_tokens=3, floor=0, across_layers=True),
    AcrossHeads(ExpectedAttention(budget=20, window=6, sink_tokens=3, future=16), floor=10),
    AcrossHeads(ChunkKV(budget=20, window=6, sink_tokens=3, chunk_size=4)),
    AcrossLayers(KVzip(budget=20, window=6, sink_tokens=3, chunk=16)),
    Pyramid(KVzip(budget=20, window=6, sink_tokens=3, chunk=7), beta=4),
]
IDS = [repr(p) for p in POLICIES]
# stored in head parts, against the per-head masked oracle in tests/test_duo.py
PER_HEAD = {"duo"}


def test_every_policy_of_the_library_runs_through_a_suite():
    from kvfn.policies.policy import POLICIES as REGISTRY

    library = {n for n, cls in REGISTRY.items() if cls.__module__.startswith("kvfn.policies.")}
    assert library == {p.name for p in POLICIES if p.name in REGISTRY} - {"everyother"} | PER_HEAD
    assert all(REGISTRY[n].ragged or REGISTRY[n].head_parts is not kvfn.Policy.head_parts
               for n in PER_HEAD)  # fmt: skip


def scores_for(policy, B=2, H=6, P=50, seed=0):
    rng = np.random.default_rng(seed)
    return mx.array(rng.random((B, H, P)), mx.float32) if policy.needs_scores else None


def select(policy, scores, P: int, n_kv: int = 3, B: int = 2) -> mx.array:
    """One layer's selection: the keep indices (B, n_kv, budget), or a ragged policy's mask
    (B, n_kv, P) of the rows each head keeps."""
    pick = policy.keep_mask if policy.ragged else policy.keep_indices
    return pick(scores, prompt_length=P, n_kv_heads=n_kv, batch=B, layer=1)


def kept_rows(policy, selected: mx.array) -> list:
    """Per sequence and KV head, the rows ``select`` keeps."""
    if policy.ragged:
        return [[np.flatnonzero(h).tolist() for h in b] for b in np.array(selected)]
    return np.array(selected).tolist()


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_contract_shapes_sorted_unique_sinks_window_budget(policy):
    B, n_kv, P = 2, 3, 50
    idx = select(policy, scores_for(policy), P)
    if not policy.ragged:
        assert idx.shape == (B, n_kv, policy.budget) and idx.dtype == mx.int32
    for heads in kept_rows(policy, idx):
        for row in heads:
            assert row == sorted(set(row))  # sorted, unique
            assert min(row) >= 0 and max(row) < P
            assert set(range(policy.sink_tokens)) <= set(row)
            assert set(range(P - policy.window, P)) <= set(row)
        if policy.ragged:  # the layer's rows, shared out
            assert sum(map(len, heads)) == policy.budget * n_kv
        else:
            assert {len(row) for row in heads} == {policy.budget}


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_contract_keeps_short_prompts_whole_and_is_traceable(policy):
    whole = select(policy, scores_for(policy, P=20), 20)
    assert kept_rows(policy, whole) == [[list(range(20))] * 3] * 2
    sc = scores_for(policy)
    eager = select(policy, sc, 50)
    traced = mx.compile(lambda *s: select(policy, s[0] if s else None, 50))(
        *([sc] * (sc is not None))
    )
    assert np.array_equal(np.array(eager), np.array(traced))


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_contract_compact_is_exact_for_every_policy(policy):
    """Decoding from compact(policy) equals the full cache masked to the kept rows."""
    fm = FunctionalModel(tiny_model("llama"))
    ids = np.random.default_rng(1).integers(0, 97, 40).tolist()
    states, result = kvfn.compact(fm, ids, policy, max_new_tokens=3, prefill_step_size=16)
    if policy.ragged:  # each head its own rows: against the per-head masked full attention
        assert kept_sets_gap(fm, ids, states, [held_positions(s, 39) for s in states], 3) < TOL
        assert result.total_rows_after == 3 * policy.budget
        return
    full = kvfn.prefill(fm, mx.array([ids[:-1]]), capacity=len(ids) + 3)
    rows = tuple(policy.for_layer(i, 3).rows_after(39) for i in range(3))
    restricted = tuple(kvfn.restrict(f, c.positions[:, :, :r])
                       for f, c, r in zip(full, states, rows))  # fmt: skip
    token = mx.array([[ids[-1]]])
    for _ in range(3):
        a, states = fm.decode(token, states)
        b, restricted = fm.decode(token, restricted)
        assert mx.abs(a - b).max().item() < 1e-4
        token = mx.argmax(a, axis=-1)[:, None]
    assert result.rows_after == rows and result.rows_before == (39,) * 3


BATCHED = [p for p in POLICIES if isinstance(p, Policy) and p.same_in_every_layer]


@pytest.mark.parametrize("policy", BATCHED, ids=[repr(p) for p in BATCHED])
def test_compacting_every_layer_at_once_is_each_layer_compacted(policy, monkeypatch):
    """``compact_layers`` of a policy the same in every layer selects once for all its layers
    and keeps, array by array, what each layer's own ``compact_layer`` keeps."""
    from kvfn.policies import policy as module
    from kvfn.policies.policy import BasePolicy

    selections = []
    real = module.rank_keep_indices
    monkeypatch.setattr(module, "rank_keep_indices",
                        lambda *a, **k: selections.append(k["batch"]) or real(*a, **k))  # fmt: skip

    B, n_kv, P, L = 2, 3, 50, 4
    rng = np.random.default_rng(3)
    states, scores = {}, {}
    for i in range(L):
        k, v = (mx.array(rng.standard_normal((B, n_kv, P, 8)), mx.float32) for _ in "kv")
        states[i] = kvfn.cache.from_full(k, v)
        scores[i] = scores_for(policy, B=B, P=P, seed=i)
    scores = scores if policy.needs_scores else None
    settings = dict(prompt_length=P, n_layers=L, reserve=5)
    together = policy.compact_layers(states, scores, **settings)
    assert selections == [L * B]  # one selection, the layers folded into the batch
    apart = BasePolicy.compact_layers(policy, states, scores, **settings)
    assert selections == [L * B] + [B] * L
    for i in range(L):
        a, b = kvfn.tree.arrays(together[i]), kvfn.tree.arrays(apart[i])
        assert len(a) == len(b) and all(np.array_equal(np.array(x), np.array(y))
                                        for x, y in zip(a, b))  # fmt: skip


def test_a_policy_says_it_is_the_same_in_every_layer_and_a_subclass_says_it_again():
    assert SnapKV.same_in_every_layer and KVzip.same_in_every_layer
    assert not RandomRows.same_in_every_layer and not kvfn.Duo.same_in_every_layer
    assert not EveryOther.same_in_every_layer  # a scorer of its own, that did not say

    @dataclass(frozen=True)
    class ByLayer(SnapKV):
        def row_scores(self, scores, *, prompt_length, n_kv_heads, batch, layer):
            return super().row_scores(scores, prompt_length=prompt_length,
                                      n_kv_heads=n_kv_heads, batch=batch, layer=layer) * layer

    assert not ByLayer.same_in_every_layer


def test_parser_names_policies_and_options():
    p = parse_policy("snapkv-k15-avg-layer-gmax", budget=64, window=16)
    assert p == SnapKV(budget=64, window=16, kernel_size=15, pooling="avg", per_head=False,
                       group_reduce="max")  # fmt: skip
    assert parse_policy("streaming", budget=8) == StreamingLLM(budget=8)
    assert parse_policy("everyother", budget=64) == EveryOther(budget=64)
    for spec, message in [
        ("snap", "unknown policy 'snap' \\(known: .*snapkv"),
        ("snapkv-k8", "kernel_size must be odd, 1 to 255, got 8"),
        ("snapkv-k257", "snapkv kernel_size must be odd, 1 to 255, got 257"),
        ("snapkv-w9", "unknown option 'w9' for policy 'snapkv' \\(options: avg, max, layer, gmax, k<N>\\)"),
        ("streaming-avg", "unknown option 'avg' for policy 'streaming' \\(options: none\\)"),
        ("", "a policy name must be a non-empty string"),
        ("snapkv-k5-k7", "options 'k5' and 'k7' of policy 'snapkv' both set its kernel_size"),
        ("snapkv-avg-max", "options 'avg' and 'max' of policy 'snapkv' both set its pooling"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            parse_policy(spec, budget=64)
    with pytest.raises(ValueError, match="policy 'streaming' has no setting kernel_size"):
        parse_policy("streaming", budget=64, kernel_size=3)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: SnapKV(budget=20), "snapkv budget 20 is below sink_tokens \\+ window = 4 \\+ 32"),
        (lambda: StreamingLLM(budget=0, sink_tokens=0), "budget must be >= 1, got 0"),
        (lambda: SnapKV(budget=64, sink_tokens=-1), "sink_tokens must be a non-negative int, got -1"),
        (lambda: SnapKV(budget=64.0), "budget must be a non-negative int, got 64.0"),
        (lambda: RandomRows(budget=64, seed=-2), "seed must be a non-negative int, got -2"),
        (lambda: RandomRows(budget=64, seed=2**64), "seed must be below 2\\*\\*64, got 1844"),
        (lambda: kvfn.Duo(ratio=0.25, retrieval=((True,),)), "ratio must be a non-negative int, got 0.25"),
        (lambda: kvfn.Duo(retrieval=(True, False)), "a tuple of bools .* got \\(True, False\\)"),
        (lambda: parse_policy("snapkv-k\u00b2", budget=64), "unknown option 'k\u00b2'"),
        (lambda: parse_policy("snapkv-k\u0663", budget=64), "unknown option 'k\u0663'"),
    ],
)  # fmt: skip
def test_bad_settings_are_named(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_settings_that_do_not_fit_the_model_or_states_are_named_before_tracing():
    fm = FunctionalModel(tiny_model("llama"))  # 3 layers
    ids = list(range(40))
    states, scores = kvfn.scored_prefill(fm, mx.array([ids]), window=4)
    with pytest.raises(ValueError, match="adakvzip plan has 1 budgets; the model has 3 layers"):
        kvfn.compact_states(states, scores, kvfn.AdaKVzip(budget=16, window=4),
                            plan=Plan(budgets=(12,)))  # fmt: skip
    with pytest.raises(ValueError, match="the prompt plus max_new_tokens is 1099511627816 rows"):
        kvfn.compact(fm, ids, SnapKV(budget=16, window=4), max_new_tokens=2**40)
    with pytest.raises(ValueError, match="2 score arrays for 3 layers"):
        kvfn.compact_states(states, scores[:2], SnapKV(budget=16, window=4))
    with pytest.raises(ValueError, match="capacity is 1099511627776 rows, more than a state"):
        kvfn.compact_states(states, scores, SnapKV(budget=16, window=4), reserve=2**40 - 40)
    with pytest.raises(ValueError, match="n_kv_heads must be a positive divisor .* got 0"):
        kvfn.snapkv_keep_indices(scores[0], 16, n_kv_heads=0, window=4)


def test_needs_scores_and_shapes_are_checked():
    with pytest.raises(ValueError, match="policy 'snapkv' needs the observation window's scores"):
        SnapKV(budget=40).keep_indices(None, prompt_length=50, n_kv_heads=1)
    with pytest.raises(
        ValueError, match="scores must have shape \\(batch=1, n_heads, prompt_length=50\\)"
    ):
        SnapKV(budget=40).keep_indices(mx.zeros((1, 2, 49)), prompt_length=50, n_kv_heads=1)
    with pytest.raises(ValueError, match="prompt_length must be >= 1, got 0"):
        StreamingLLM(budget=8).keep_indices(None, prompt_length=0, n_kv_heads=1)
    with pytest.raises(ValueError, match="n_kv_heads must be a positive divisor .* got 0"):
        StreamingLLM(budget=8).keep_indices(None, prompt_length=20, n_kv_heads=0)  # any policy


def test_streaming_keeps_sinks_and_the_latest_rows():
    idx = np.array(StreamingLLM(budget=8, sink_tokens=3).keep_indices(None, prompt_length=20,
                                                                      n_kv_heads=2))  # fmt: skip
    assert idx[0, 0].tolist() == [0, 1, 2, 15, 16, 17, 18, 19] == idx[0, 1].tolist()


def test_random_rows_differ_per_head_layer_and_seed():
    def draw(seed, layer=0):
        p = RandomRows(budget=30, window=8, seed=seed)
        return np.array(p.keep_indices(None, prompt_length=100, n_kv_heads=3, layer=layer))

    idx = draw(1)
    assert not np.array_equal(idx[0, 0], idx[0, 1])  # each head draws its own rows
    assert np.array_equal(idx, draw(1)) and not np.array_equal(idx, draw(2))
    assert not np.array_equal(idx, draw(1, layer=1))


def test_random_middle_rows_are_uniform():
    counts = np.zeros(200)
    for seed in range(40):
        p = RandomRows(budget=60, window=10, sink_tokens=0, seed=seed)
        np.add.at(
            counts, np.array(p.keep_indices(None, prompt_length=200, n_kv_heads=4)).ravel(), 1
        )
    middle = counts[:190]
    assert abs(middle.mean() - 40 * 4 * 50 / 190) < 1e-9
    assert middle.min() > 0.5 * middle.mean() and middle.max() < 1.5 * middle.mean()


def test_chunkkv_keeps_whole_chunks_by_summed_score():
    s = np.zeros((1, 2, 40))
    s[0, :, 13] = 5.0  # one strong row in chunk 12-15
    s[0, :, 24:28] = 1.5  # a chunk (24-27) strong in sum: 6 > 5
    p = ChunkKV(budget=14, window=4, sink_tokens=2, chunk_size=4)
    idx = np.array(p.keep_indices(mx.array(s, mx.float32), prompt_length=40, n_kv_heads=1))
    assert idx[0, 0].tolist() == [0, 1, 12, 13, 14, 15, 24, 25, 26, 27, 36, 37, 38, 39]
    assert parse_policy("chunkkv-c10", budget=64) == ChunkKV(budget=64, chunk_size=10)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        ChunkKV(budget=64, chunk_size=0)


def test_pyramidkv_budgets_fall_with_depth_and_average_the_budget():
    p = PyramidKV(budget=256, window=32, sink_tokens=4, beta=20)
    budgets = p.layer_budgets(24)
    assert budgets == sorted(budgets, reverse=True) and budgets[0] > 256 > budgets[-1]
    assert sum(budgets) == 24 * 256  # equal memory to a flat budget
    assert budgets[-1] == (256 - 32) // 20 + 32
    assert parse_policy("pyramidkv-b10", budget=256).beta == 10
    fm = FunctionalModel(tiny_model("llama"))
    ids = list(range(90))
    small = PyramidKV(budget=40, window=4, sink_tokens=2, beta=4)
    _, result = kvfn.compact(fm, ids, small)
    assert result.rows_after == tuple(small.layer_budgets(3))
    assert result.rows_after[0] > result.rows_after[2]
    with pytest.raises(ValueError, match="beta"):
        PyramidKV(budget=40, beta=0)


# -- scorers and allocations compose --------------------------------------------------------------


def test_an_allocation_shares_out_any_scorers_rows():
    """Ada-KV's allocation over Expected Attention's scores (Ada-KV was a SnapKV subclass, KVzip's
    a class of its own): the traced allocation equals the numpy reference over that scorer's
    row scores; the shorthands are their compositions."""
    rng = np.random.default_rng(4)
    P, H = 90, 3
    scores = rng.random((2 * H, P)) ** 4
    settings = dict(budget=24, window=5, sink_tokens=3)
    policy = AcrossHeads(ExpectedAttention(**settings), floor=20)
    keep = policy.allocation(mx.array(scores[None], mx.float32), prompt_length=P, n_kv_heads=H)
    assert [k.tolist() for k in keep] == reference_allocation(policy, scores, P, H)
    assert policy.name == "acrossheads(expected)" and policy.statistic == "moments"
    assert policy.ragged and policy.budget == 24 and policy.replace(budget=30).scorer.budget == 30
    snap = AcrossHeads(SnapKV(**settings, kernel_size=1), floor=20)
    ada = kvfn.AdaKV(**settings, kernel_size=1, floor=20)
    assert ada.scorer == snap.scorer and ada.name == "adakv"
    for a, b in zip(ada.allocation(mx.array(scores[None], mx.float32), prompt_length=P,
                                   n_kv_heads=H),
                    snap.allocation(mx.array(scores[None], mx.float32), prompt_length=P,
                                    n_kv_heads=H)):  # fmt: skip
        assert a.tolist() == b.tolist()
    assert kvfn.AdaKVzip(**settings).scorer == KVzip(**settings)
    assert PyramidKV(**settings, beta=4).for_layer(2, 3) == Pyramid(
        SnapKV(**settings), beta=4
    ).for_layer(2, 3)
    with pytest.raises(TypeError, match="Pyramid wraps a scorer"):
        Pyramid(kvfn.AdaKV(**settings))
    with pytest.raises(ValueError, match="acrossheads\\(expected\\) allocates rows among heads"):
        AcrossHeads(ExpectedAttention(**settings, per_head=False))
    with pytest.raises(TypeError, match="AdaKV takes SnapKV's settings or one SnapKV"):
        kvfn.AdaKV(scorer=KVzip(**settings))


def test_pyramid_budgets_take_any_scorer():
    """Pyramid over KVzip: each layer keeps the reconstruction pass's top rows at its own budget,
    and the pass runs where only the smallest layer compacts (a budget that fits the prompt)."""
    fm = FunctionalModel(tiny_model("llama"))
    ids = np.random.default_rng(6).integers(0, 97, 90).tolist()
    policy = Pyramid(KVzip(budget=40, window=4, sink_tokens=2, chunk=32), beta=4)
    states, result = kvfn.compact(fm, ids, policy)
    assert result.rows_after == tuple(policy.layer_budgets(3)) == (67, 40, 13)
    context = mx.array([ids[:-1]])
    scores = policy.score_prompt(fm, context, kvfn.prefill(fm, context))
    for i, (s, rows) in enumerate(zip(states, result.rows_after)):
        want = policy.for_layer(i, 3).keep_indices(scores[i], prompt_length=89, n_kv_heads=2,
                                                   layer=i)  # fmt: skip
        assert np.array_equal(np.array(s.positions[..., :rows]), np.array(want))
    roomy = Pyramid(KVzip(budget=60, window=4, sink_tokens=2), beta=4)  # layers 102, 60, 18
    assert not roomy.scorer.observation_window(39) and roomy.scorer.keeps_whole(39)
    _, result = kvfn.compact(fm, ids[:40], roomy)
    assert result.rows_after == (39, 39, 18)


def test_a_plan_is_returned_and_given_not_written_into_the_settings():
    """AcrossLayers (adakvzip-global) decides each layer's rows per prompt: ``plan`` returns
    them, ``compact_states`` follows the one it makes or one given, and the policy is unchanged
    (one compaction's plan is never the next prompt's)."""
    fm = FunctionalModel(tiny_model("llama"))
    rng = np.random.default_rng(8)
    P, L, H = 49, 3, fm.n_kv_heads[0]
    states = kvfn.prefill(fm, mx.array(rng.integers(0, 97, (2, P))))
    scores = [mx.array(rng.random((2, fm.n_heads[i], P)) ** 3, mx.float32) for i in range(L)]
    policy = AcrossLayers(KVzip(budget=12, window=3, sink_tokens=2))
    plan = policy.plan(scores, prompt_length=P, n_kv_heads=(H,) * L)
    assert isinstance(plan, Plan) and len(plan.budgets) == len(plan.totals) == L
    assert [sum(t[b] for t in plan.totals) for b in range(2)] == [12 * H * L] * 2
    assert kvfn.parse_policy("adakvzip-global", budget=12, window=3, sink_tokens=2).plan(
        scores, prompt_length=P, n_kv_heads=(H,) * L) == plan  # fmt: skip

    def lengths(kept):
        return [np.array(s.lengths).tolist() for s in kept]

    made = kvfn.compact_states(states, scores, policy)[0]
    assert lengths(made) == lengths(kvfn.compact_states(states, scores, policy, plan=plan)[0])
    assert [np.sum(x, axis=1).tolist() for x in lengths(made)] == list(map(list, plan.totals))
    flat = Plan(totals=((12 * H, 12 * H),) * L)  # another plan: a flat budget
    assert [np.sum(x, axis=1).tolist() for x in lengths(
        kvfn.compact_states(states, scores, policy, plan=flat)[0])] == [[12 * H] * 2] * L  # fmt: skip
    assert policy == AcrossLayers(KVzip(budget=12, window=3, sink_tokens=2))

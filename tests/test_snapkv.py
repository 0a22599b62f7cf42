import mlx.core as mx
import numpy as np
import pytest

from kvfn import SnapKV
from kvfn import cache as kv
from kvfn import snapkv_keep_indices, window_attention_scores
from kvfn.policies.snapkv import pool1d


def keep(scores, budget, **kw):
    return np.array(snapkv_keep_indices(mx.array(scores, mx.float32), budget, **kw)).tolist()


def test_sinks_window_and_top_middle_rows():
    s = np.zeros((1, 1, 20))
    s[0, 0, [7, 12, 18]] = [5.0, 3.0, 9.0]  # 18 is in the window anyway
    got = keep(s, 7, n_kv_heads=1, window=3, sink_tokens=2, kernel_size=1)
    assert got == [[[0, 1, 7, 12, 17, 18, 19]]]


def test_pooling_spreads_a_peak_to_its_neighbours():
    s = np.zeros((1, 1, 30))
    s[0, 0, 10] = 1.0
    s[0, 0, 20] = 0.9
    # max pooling (kernel 3) makes 9, 10, 11 the top three middle rows
    assert keep(s, 6, n_kv_heads=1, window=2, sink_tokens=1, kernel_size=3)[0][0] == [
        0,
        9,
        10,
        11,
        28,
        29,
    ]
    # avg pooling ranks the same peak first
    assert np.allclose(np.array(pool1d(mx.array([[0.0, 3.0, 0.0]]), 3, "avg")), [[1, 1, 1]])


@pytest.mark.parametrize("pooling", ["max", "avg"])
def test_the_window_lends_no_score_to_the_rows_before_it(pooling):
    """As SnapKV pools: the rows before the window only; the window's own (always kept) rows'
    attention does not spill onto its neighbours (kvpress's SnapKVPress keeps the same rows)."""
    s = np.zeros((1, 1, 30))
    s[0, 0, 26:] = 100.0  # the window's rows, attended by its own queries
    s[0, 0, 12] = 1.0
    policy = SnapKV(budget=8, window=4, sink_tokens=1, kernel_size=7, pooling=pooling)
    row = np.array(policy.row_scores(mx.array(s, mx.float32), prompt_length=30, n_kv_heads=1,
                                     batch=1, layer=0))[0, 0]  # fmt: skip
    assert np.all(row[20:26] == 0) and row[12] > 0 and np.all(row[26:] == 100.0)
    got = keep(s, 8, n_kv_heads=1, window=4, sink_tokens=1, kernel_size=7, pooling=pooling)
    assert set(got[0][0]) - {0, 26, 27, 28, 29} <= set(range(9, 16))  # the peak's neighbours


def test_gqa_reduce_and_per_head_selection():
    s = np.zeros((1, 4, 12))  # 4 query heads over 2 KV heads
    s[0, 0, 4], s[0, 1, 4] = 1.0, 1.0  # KV head 0's group likes row 4
    s[0, 2, 6], s[0, 3, 7] = 1.0, 3.0  # KV head 1's group: row 7 by mean and by max
    got = keep(s, 4, n_kv_heads=2, window=2, sink_tokens=1, kernel_size=1)
    assert got == [[[0, 4, 10, 11], [0, 7, 10, 11]]]
    shared = keep(s, 4, n_kv_heads=2, window=2, sink_tokens=1, kernel_size=1, per_head=False)
    assert shared[0][0] == shared[0][1] == [0, 7, 10, 11]
    s[0, 2, 6], s[0, 3, 6] = 5.0, -4.0  # row 6: mean (5-4)/2 < 3/2 keeps row 7; max 5 > 3 takes 6
    assert keep(s, 4, n_kv_heads=2, window=2, sink_tokens=1, kernel_size=1)[0][1] == [0, 7, 10, 11]
    assert keep(s, 4, n_kv_heads=2, window=2, sink_tokens=1, kernel_size=1, group_reduce="max")[0][
        1
    ] == [0, 6, 10, 11]


def test_short_prompts_are_kept_whole():
    s = np.random.default_rng(0).random((1, 2, 10))
    assert keep(s, 16, n_kv_heads=2, window=4)[0][0] == list(range(10))
    assert keep(s, 6, n_kv_heads=2, window=2, sink_tokens=0, min_tokens=10)[0][1] == list(range(10))
    assert len(keep(s, 6, n_kv_heads=2, window=2, sink_tokens=0, min_tokens=9)[0][1]) == 6


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(budget=5, window=4, sink_tokens=2),
            "budget 5 is below sink_tokens \\+ window = 2 \\+ 4",
        ),
        (dict(budget=8, window=0), "window must be >= 1"),
        (
            dict(budget=8, window=2, sink_tokens=-1),
            "sink_tokens must be a non-negative int, got -1",
        ),
        (dict(budget=8, window=2, kernel_size=4), "kernel_size must be odd, 1 to 255, got 4"),
        (
            dict(budget=8, window=2, pooling="median"),
            "pooling must be 'max' or 'avg', got 'median'",
        ),
        (
            dict(budget=8, window=2, group_reduce="sum"),
            "group_reduce must be 'mean' or 'max', got 'sum'",
        ),
    ],
)
def test_bad_values_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SnapKV(**kwargs)


def test_window_scores_equal_the_attention_matrix_rows():
    """The scores of w window queries equal the sums of the last w rows of the causal softmax."""
    rng = np.random.default_rng(1)
    B, Hq, Hk, P, D, w = 1, 4, 2, 9, 8, 3
    q = rng.normal(size=(B, Hq, P, D)).astype(np.float32)
    k = rng.normal(size=(B, Hk, P, D)).astype(np.float32)
    state = kv.from_full(mx.array(k), mx.array(k))
    qpos = mx.arange(P - w, P)[None]
    got = np.array(window_attention_scores(mx.array(q[:, :, -w:]), qpos, state, 0.5))
    kk = np.repeat(k, Hq // Hk, axis=1)
    logits = 0.5 * q @ kk.swapaxes(-1, -2)
    logits = np.where(np.tril(np.ones((P, P), bool)), logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    assert np.allclose(got, weights[:, :, -w:].sum(-2), atol=1e-5)

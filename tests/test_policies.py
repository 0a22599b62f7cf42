"""StreamingLLM and random baselines: the rows they keep."""

import mlx.core as mx
import numpy as np
import pytest

from kvfn.policies import random_keep_indices, recent_keep_indices


def test_recent_keeps_sinks_and_the_latest_rows():
    idx = np.array(recent_keep_indices(20, 8, n_kv_heads=2, sink_tokens=3))
    assert idx.shape == (1, 2, 8)
    assert idx[0, 0].tolist() == [0, 1, 2, 15, 16, 17, 18, 19] == idx[0, 1].tolist()
    assert np.array(recent_keep_indices(6, 8, n_kv_heads=1)).tolist() == [[list(range(6))]]


def test_random_keeps_sinks_window_and_distinct_random_middle_rows_per_head():
    key = mx.random.key(1)
    idx = np.array(random_keep_indices(100, 30, n_kv_heads=3, key=key, sink_tokens=4, window=8))
    assert idx.shape == (1, 3, 30)
    for h in range(3):
        row = idx[0, h].tolist()
        assert row == sorted(set(row))
        assert row[:4] == [0, 1, 2, 3] and row[-8:] == list(range(92, 100))
    assert not np.array_equal(idx[0, 0], idx[0, 1])  # each head draws its own rows
    again = np.array(random_keep_indices(100, 30, n_kv_heads=3, key=key, sink_tokens=4, window=8))
    other = np.array(random_keep_indices(100, 30, n_kv_heads=3, key=mx.random.key(2),
                                         sink_tokens=4, window=8))  # fmt: skip
    assert np.array_equal(idx, again) and not np.array_equal(idx, other)


def test_random_middle_rows_are_uniform():
    counts = np.zeros(200)
    for seed in range(40):
        idx = np.array(random_keep_indices(200, 60, n_kv_heads=4, key=mx.random.key(seed),
                                           sink_tokens=0, window=10))  # fmt: skip
        np.add.at(counts, idx.reshape(-1), 1)
    middle = counts[:190]
    assert abs(middle.mean() - 40 * 4 * 50 / 190) < 1e-9
    assert middle.min() > 0.5 * middle.mean() and middle.max() < 1.5 * middle.mean()


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: recent_keep_indices(10, 2, n_kv_heads=1, sink_tokens=4), "budget 2 is below"),
        (lambda: recent_keep_indices(0, 8, n_kv_heads=1), "prompt_length must be >= 1, got 0"),
        (lambda: random_keep_indices(50, 20, n_kv_heads=1, key=mx.random.key(0), window=32),
         "budget 20 is below sink_tokens \\+ window = 4 \\+ 32"),
    ],
)  # fmt: skip
def test_bad_values_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()

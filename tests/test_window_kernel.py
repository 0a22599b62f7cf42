import mlx.core as mx
import numpy as np
import pytest

from kvfn.kernels import window as window_kernel
from kvfn.scores import window_attention_max, window_attention_scores
from kvfn.states.cache import EMPTY, State

CUDA = mx.default_device() == mx.gpu and mx.cuda.is_available()
cuda_only = pytest.mark.skipif(not CUDA, reason="the window kernels run on MLX's CUDA backend")


def reference(logits, key_positions, query_positions, op="sum"):
    """float64 numpy: masked softmax over slots, summed or maxed over queries."""
    x = np.array(logits.astype(mx.float32), dtype=np.float64)
    kp = np.array(key_positions)[:, :, None, None, :]
    qp = np.array(query_positions)[:, None, None, :, None]
    x = np.where(kp <= qp, x, -np.inf)
    top = x.max(axis=-1, keepdims=True)
    e = np.where(np.isfinite(top), np.exp(x - np.where(np.isfinite(top), top, 0)), 0)
    total = e.sum(axis=-1, keepdims=True)
    weights = e / np.where(total > 0, total, 1)
    return weights.sum(axis=-2) if op == "sum" else weights.max(axis=-2)


def case(B, n_kv, group, w, C, dtype, shared_positions=False, seed=0):
    rng = np.random.default_rng(seed)
    logits = mx.array(rng.normal(0, 3, (B, n_kv, group, w, C)).astype(np.float32)).astype(dtype)
    heads = 1 if shared_positions else n_kv
    kp = np.tile(np.arange(C, dtype=np.int64), (B, heads, 1))
    kp[rng.random(kp.shape) < 0.2] = EMPTY  # freed slots
    qp = np.stack([np.arange(C - w, C) - 3 * b for b in range(B)])  # a causal window a sequence
    return logits, mx.array(kp.astype(np.int32)), mx.array(qp.astype(np.int32))


SHAPES = [(1, 1, 1, 1, 7), (2, 2, 4, 5, 300), (1, 8, 4, 32, 1024), (2, 1, 3, 9, 257)]


@cuda_only
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize("shared_positions", [False, True])
@pytest.mark.parametrize("op", window_kernel.OPS)
def test_reduced_softmax_matches_float64(shape, dtype, shared_positions, op):
    logits, kp, qp = case(*shape, dtype, shared_positions)
    assert window_kernel.applies(logits)
    got = window_kernel.reduced_softmax(logits, kp, qp, op)
    assert got.dtype == mx.float32 and got.shape == shape[:3] + shape[4:]
    want = reference(logits, kp, qp, op)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-6)


@cuda_only
@pytest.mark.parametrize("op", window_kernel.OPS)
def test_a_query_that_sees_no_slot_adds_nothing(op):
    logits, kp, qp = case(1, 2, 2, 3, 40, mx.float32)
    qp = mx.array([[-1, 39, 39]], dtype=mx.int32)  # the first query sees nothing
    got = np.array(window_kernel.reduced_softmax(logits, kp, qp, op))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, reference(logits, kp, qp, op), rtol=1e-5, atol=1e-6)


def window_case():
    B, n_heads, n_kv, w, C, D = 2, 8, 2, 70, 500, 64
    mx.random.seed(1)
    keys = mx.random.normal((B, n_kv, C, D)).astype(mx.bfloat16)
    positions = mx.broadcast_to(mx.arange(C, dtype=mx.int32), (B, n_kv, C))
    state = State(keys=keys, values=keys, positions=positions, offset=mx.array([C, C - 4]),
                  rows=mx.array(C))  # fmt: skip
    q = mx.random.normal((B, n_heads, w, D)).astype(mx.bfloat16)
    qpos = mx.array([[C - w + i for i in range(w)], [C - 4 - w + i for i in range(w)]])
    return q, qpos, state, D**-0.5


@cuda_only
@pytest.mark.parametrize("fn", [window_attention_scores, window_attention_max])
def test_window_scores_equal_with_and_without_the_kernels(fn):
    q, qpos, state, scale = window_case()
    kernels = fn(q, qpos, state, scale)
    with window_kernel.disabled():
        stock = fn(q, qpos, state, scale)
    assert window_kernel.ENABLED
    assert kernels.shape == stock.shape == (2, 8, 500)
    np.testing.assert_allclose(np.array(kernels), np.array(stock), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fn", [window_attention_scores, window_attention_max])
def test_a_query_that_sees_nothing_adds_nothing_on_every_backend(fn):
    """The stock ops' softmax of a row with no visible slot is NaN; both paths add nothing."""
    q, qpos, state, scale = window_case()
    blind = mx.concatenate([mx.full((2, 1), -1, mx.int32), qpos[:, 1:]], axis=1)
    got = fn(q, blind, state, scale)
    assert not mx.isnan(got).any().item()
    want = fn(q[:, :, 1:], qpos[:, 1:], state, scale)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-6, atol=1e-7)


@cuda_only
def test_query_positions_of_one_sequence_broadcast():
    logits, kp, qp = case(2, 2, 1, 3, 50, mx.float32)
    one = window_kernel.reduced_softmax(logits, kp, qp[:1])
    both = window_kernel.reduced_softmax(logits, kp, mx.concatenate([qp[:1], qp[:1]]))
    assert mx.array_equal(one, both).item()


def test_reduced_softmax_refuses_bad_input():
    logits, kp, qp = case(2, 2, 1, 3, 10, mx.float32)
    with pytest.raises(ValueError, match=r"positions \(2, 2, 9\)"):
        window_kernel.reduced_softmax(logits, kp[..., :9], qp)
    with pytest.raises(ValueError, match=r"\(2, 4\)"):
        window_kernel.reduced_softmax(logits, kp, mx.zeros((2, 4), mx.int32))
    with pytest.raises(ValueError, match="'mean'"):
        window_kernel.reduced_softmax(logits, kp, qp, "mean")
    with pytest.raises(ValueError, match=r"got \(2, 2, 3, 10\)"):
        window_kernel.reduced_softmax(logits[:, :, 0], kp, qp)
    with pytest.raises(ValueError, match=r"got \(2, 2, 1, 0, 10\)"):
        window_kernel.reduced_softmax(logits[:, :, :, :0], kp, qp[:, :0])


def test_window_scores_refuse_queries_of_the_wrong_rank():
    q, qpos, state, scale = window_case()
    for fn in (window_attention_scores, window_attention_max):
        with pytest.raises(AssertionError, match="rank"):
            fn(q[0], qpos, state, scale)


@pytest.mark.skipif(CUDA, reason="off MLX's CUDA backend")
def test_the_kernels_apply_only_on_cuda():
    logits, kp, qp = case(1, 1, 1, 2, 8, mx.float32)
    assert not window_kernel.applies(logits)
    with pytest.raises(RuntimeError, match="CUDA"):
        window_kernel.reduced_softmax(logits, kp, qp)


def test_disabled_turns_the_kernels_off_and_back():
    logits = mx.zeros((1, 1, 1, 1, 4), mx.bfloat16)
    before, enabled = window_kernel.applies(logits), window_kernel.ENABLED
    with window_kernel.disabled():
        assert window_kernel.ENABLED is False and not window_kernel.applies(logits)
        with pytest.raises(RuntimeError, match="CUDA"):
            window_kernel.reduced_softmax(logits, mx.zeros((1, 1, 4), mx.int32),
                                          mx.zeros((1, 1), mx.int32))  # fmt: skip
    assert window_kernel.ENABLED is enabled and window_kernel.applies(logits) == before

import mlx.core as mx
import numpy as np
import pytest

from kvfn import window_kernel
from kvfn.cache import EMPTY, State
from kvfn.scores import window_attention_max, window_attention_scores

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
def test_window_scores_equal_with_and_without_the_kernels(monkeypatch, fn):
    q, qpos, state, scale = window_case()
    fused = fn(q, qpos, state, scale)
    monkeypatch.setattr(window_kernel, "ENABLED", False)
    stock = fn(q, qpos, state, scale)
    assert fused.shape == stock.shape == (2, 8, 500)
    np.testing.assert_allclose(np.array(fused), np.array(stock), rtol=1e-5, atol=1e-6)


def test_reduced_softmax_refuses_what_does_not_fit():
    logits, kp, qp = case(2, 2, 1, 3, 10, mx.float32)
    with pytest.raises(ValueError, match=r"positions \(2, 2, 9\)"):
        window_kernel.reduced_softmax(logits, kp[..., :9], qp)
    with pytest.raises(ValueError, match=r"\(2, 4\)"):
        window_kernel.reduced_softmax(logits, kp, mx.zeros((2, 4), mx.int32))
    with pytest.raises(ValueError, match="'mean'"):
        window_kernel.reduced_softmax(logits, kp, qp, "mean")


@pytest.mark.skipif(CUDA, reason="off MLX's CUDA backend")
def test_the_kernels_apply_only_on_cuda():
    logits, kp, qp = case(1, 1, 1, 2, 8, mx.float32)
    assert not window_kernel.applies(logits)
    with pytest.raises(RuntimeError, match="CUDA"):
        window_kernel.reduced_softmax(logits, kp, qp)

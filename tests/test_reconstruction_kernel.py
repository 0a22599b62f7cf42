"""KVzip's fused reconstruction kernels (MLX's CUDA backend) against a float64 reference, and
the same pass with and without them."""

import mlx.core as mx
import mlx_lm.models.llama as llama
import numpy as np
import pytest

import kvfn
from kvfn.kernels import reconstruction as reconstruction_kernel
from kvfn.scores import reconstruction_attention

CUDA = mx.default_device() == mx.gpu and mx.cuda.is_available()
cuda_only = pytest.mark.skipif(not CUDA, reason="the kernels run on MLX's CUDA backend")


def reference(q, k, sink, start, end, context, scale):
    """float64 numpy: each query's softmax over rows [0, min(sink, start)), [start, end) and the
    input's own (causal), then each row of [start, end)'s largest weight: (B, n_heads, m)."""
    q = np.array(q.astype(mx.float32), np.float64)
    k = np.array(k.astype(mx.float32), np.float64)
    B, n_heads, n, _ = q.shape
    s0 = min(sink, start)
    rows = list(range(s0)) + list(range(start, end)) + list(range(context, context + n))
    kk = np.repeat(k[:, :, rows], n_heads // k.shape[1], axis=1)
    logits = scale * q @ kk.transpose(0, 1, 3, 2)
    fixed = s0 + end - start
    logits[..., fixed:] = np.where(np.tri(n, dtype=bool), logits[..., fixed:], -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    return (w / w.sum(-1, keepdims=True))[..., s0:fixed].max(axis=2)


def case(B, n_kv, group, n, m, start, dim, dtype, seed=0):
    """Queries (B, n_kv x group, n, dim) and keys of ``start + m + 11`` context rows, the n own
    rows after them and 3 free slots; logits spread so that the softmax is far from flat."""
    rng = np.random.default_rng(seed)
    context = start + m + 11
    q = mx.array(rng.normal(0, 2.5, (B, n_kv * group, n, dim)).astype(np.float32)).astype(dtype)
    k = mx.array(rng.normal(0, 1, (B, n_kv, context + n + 3, dim)).astype(np.float32)).astype(dtype)
    return q, k, context


# (B, n_kv, group, queries, chunk rows, start, sink): ragged counts (not multiples of 16 or 64),
# GQA groups 1, 4 and 7, the first chunk and later ones, sinks 0 and 4
CASES = [
    (1, 2, 1, 17, 23, 0, 4),
    (2, 2, 4, 70, 100, 37, 4),
    (1, 1, 7, 33, 65, 5, 0),
    (1, 8, 4, 130, 129, 64, 4),
    (1, 3, 3, 5, 1, 2, 4),
]


@cuda_only
@pytest.mark.parametrize("shape", CASES, ids=str)
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=str)
def test_the_kernels_equal_float64(shape, dim, dtype):
    B, n_kv, group, n, m, start, sink = shape
    q, k, context = case(B, n_kv, group, n, m, start, dim, dtype)
    scale = dim**-0.5
    assert reconstruction_kernel.applies(q, k)
    got = reconstruction_attention(q, k, sink, start, start + m, context, scale)
    assert got.dtype == mx.float32 and got.shape == (B, n_kv * group, m)
    want = reference(q, k, sink, start, start + m, context, scale)
    np.testing.assert_allclose(np.array(got), want, rtol=2e-4, atol=1e-6)


@cuda_only
def test_the_kernels_and_the_stock_ops_agree_at_a_chunk_of_the_8b_shape():
    q, k, context = case(1, 8, 4, 2068, 2048, 4096, 128, mx.bfloat16, seed=1)
    scale = 128**-0.5
    got = reconstruction_attention(q, k, 4, 4096, 6144, context, scale)
    with reconstruction_kernel.disabled():
        stock = reconstruction_attention(q, k, 4, 4096, 6144, context, scale)
    assert reconstruction_kernel.ENABLED
    np.testing.assert_allclose(np.array(got), np.array(stock), rtol=2e-3, atol=1e-6)


def head_dim_64_model():
    args = llama.ModelArgs(model_type="llama", hidden_size=256, num_hidden_layers=2,
                           intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=97, rope_theta=10000.0)  # fmt: skip
    mx.random.seed(0)
    model = llama.Model(args)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model


@cuda_only
def test_the_pass_gives_the_same_scores_with_and_without_the_kernels():
    fm = kvfn.FunctionalModel(head_dim_64_model())
    ids = mx.array([np.random.default_rng(2).integers(0, 97, 300).tolist()])
    states = kvfn.prefill(fm, ids)
    assert reconstruction_kernel.applies(states[0].keys, states[0].keys)  # bf16, head_dim 64
    got = kvfn.reconstruction_scores(fm, ids, states, chunk=128, resume=(1, 2), suffix=(3,))
    with reconstruction_kernel.disabled():
        stock = kvfn.reconstruction_scores(fm, ids, states, chunk=128, resume=(1, 2), suffix=(3,))
    for a, b in zip(got, stock):
        assert a.shape == (1, 4, 300)
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=2e-3, atol=1e-6)


@pytest.mark.skipif(CUDA, reason="off MLX's CUDA backend")
def test_the_kernels_apply_only_on_cuda():
    q, k, context = case(1, 1, 1, 4, 8, 0, 64, mx.bfloat16)
    assert not reconstruction_kernel.applies(q, k)
    with pytest.raises(RuntimeError, match="CUDA"):
        reconstruction_kernel.scores(q, k, 0, 0, 8, context, 0.1)
    got = reconstruction_attention(q, k, 4, 0, 8, context, 0.1)  # the stock ops
    np.testing.assert_allclose(np.array(got), reference(q, k, 4, 0, 8, context, 0.1), rtol=1e-5,
                               atol=1e-7)  # fmt: skip


def test_disabled_turns_the_kernels_off_and_back():
    q = mx.zeros((1, 1, 2, 64), mx.bfloat16)
    before, enabled = reconstruction_kernel.applies(q, q), reconstruction_kernel.ENABLED
    with reconstruction_kernel.disabled():
        assert reconstruction_kernel.ENABLED is False and not reconstruction_kernel.applies(q, q)
    assert reconstruction_kernel.ENABLED is enabled
    assert reconstruction_kernel.applies(q, q) == before
    for other in (q.astype(mx.float32), mx.zeros((1, 1, 2, 96), mx.bfloat16)):
        assert not reconstruction_kernel.applies(other, other)  # float32, head_dim 96: stock ops

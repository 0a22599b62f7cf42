import shutil

import mlx.core as mx
import numpy as np
import pytest

import kvfn.kernels as kernels
from kvfn.kernels import MIN_KEYS_PER_SPLIT, plan, ragged_decode_attention

B, KV, C = 2, 2, 16


def make(q_heads, dim, dtype, seed=0):
    mx.random.seed(seed)
    q = mx.random.normal((B, q_heads, 1, dim)).astype(dtype)
    k = mx.random.normal((B, KV, C, dim)).astype(dtype)
    v = mx.random.normal((B, KV, C, dim)).astype(dtype)
    return q, k, v


def reference(q, k, v, lengths, scale):
    """Float64 attention of each query head to its KV head's first ``lengths`` rows."""
    q, k, v = (np.array(x.astype(mx.float32), dtype=np.float64) for x in (q, k, v))
    batch, kv_heads = k.shape[:2]
    n = np.array(lengths)
    n = np.broadcast_to(n.reshape(-1, 1) if n.ndim == 1 else n, (batch, kv_heads))
    group = q.shape[1] // kv_heads
    out = np.zeros(q.shape)
    for b in range(batch):
        for h in range(q.shape[1]):
            rows = min(max(int(n[b, h // group]), 0), k.shape[2])
            if rows == 0:
                continue
            keys, values = k[b, h // group, :rows], v[b, h // group, :rows]
            s = keys @ q[b, h, 0] * scale
            p = np.exp(s - s.max())
            out[b, h, 0] = p @ values / p.sum()
    return out


def tolerance(dtype):
    return 2e-2 if dtype == mx.bfloat16 else 1e-5


LENGTHS = [
    mx.array(5, dtype=mx.int32),
    mx.array(C, dtype=mx.int32),
    mx.array(0, dtype=mx.int32),
    mx.array([3, C], dtype=mx.int32),
    mx.array([[0, 7], [C, 1]], dtype=mx.int32),
    mx.array([[4, 9]], dtype=mx.int32),
]


@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda x: str(x.tolist()))
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
def test_matches_reference(lengths, group, dim, dtype):
    assert plan(B, KV * group, KV, C)[2] == 1  # on CUDA one split, writing the output itself
    q, k, v = make(KV * group, dim, dtype)
    scale = dim**-0.5
    out = ragged_decode_attention(q, k, v, lengths, scale=scale)
    assert out.shape == q.shape and out.dtype == dtype
    expected = reference(q, k, v, lengths, scale)
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), expected, atol=tolerance(dtype))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
def test_lengths_across_split_boundaries_match_reference(dtype):
    capacity = 6 * MIN_KEYS_PER_SPLIT
    assert plan(B, KV * 4, KV, capacity)[2] > 1  # on CUDA, several splits and their combine
    mx.random.seed(1)
    q = mx.random.normal((B, KV * 4, 1, 64)).astype(dtype)
    k, v = (mx.random.normal((B, KV, capacity, 64)).astype(dtype) for _ in range(2))
    edge = MIN_KEYS_PER_SPLIT
    lengths = mx.array([[0, edge - 1], [edge + 1, capacity]], dtype=mx.int32)
    out = ragged_decode_attention(q, k, v, lengths, scale=0.125)
    expected = reference(q, k, v, lengths, 0.125)
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), expected, atol=tolerance(dtype))


needs_cuda = pytest.mark.skipif(not kernels.on_cuda(), reason="tensor cores: MLX's CUDA backend")


def mma_tolerance(dtype):
    """The probabilities are rounded to the inputs' dtype before the value product."""
    return 2e-2 if dtype == mx.bfloat16 else 3e-3


@needs_cuda
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda x: str(x.tolist()))
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["f16", "bf16"])
def test_tensor_core_kernel_matches_reference(monkeypatch, lengths, group, dim, dtype):
    monkeypatch.setattr(kernels, "TENSOR_CORES", True)
    monkeypatch.setattr(kernels, "MMA_MIN_KEYS_PER_SPLIT", 0)
    monkeypatch.setattr(kernels, "MMA_RUN_DIMS", None)
    q, k, v = make(KV * group, dim, dtype)
    assert kernels._mma_applies(q, k)
    out = ragged_decode_attention(q, k, v, lengths, scale=dim**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    expected = reference(q, k, v, lengths, dim**-0.5)
    np.testing.assert_allclose(
        np.array(out.astype(mx.float32)), expected, atol=mma_tolerance(dtype)
    )


@needs_cuda
@pytest.mark.parametrize("group", [4, 8])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["f16", "bf16"])
def test_tensor_core_kernel_across_splits_matches_reference(monkeypatch, group, dtype):
    """Many 64-key block steps in several splits, lengths at and around the split and
    16-key warp boundaries, against the float64 reference and the CUDA-core kernel."""
    capacity = 9 * MIN_KEYS_PER_SPLIT + 5
    assert plan(B, KV * group, KV, capacity, mma=True)[2] > 1
    mx.random.seed(2)
    q = mx.random.normal((B, KV * group, 1, 128)).astype(dtype)
    k, v = (mx.random.normal((B, KV, capacity, 128)).astype(dtype) for _ in range(2))
    lengths = mx.array([[1, 17], [2 * MIN_KEYS_PER_SPLIT + 63, capacity]], dtype=mx.int32)
    monkeypatch.setattr(kernels, "TENSOR_CORES", False)
    plain = ragged_decode_attention(q, k, v, lengths, scale=0.088)
    monkeypatch.setattr(kernels, "TENSOR_CORES", True)
    monkeypatch.setattr(kernels, "MMA_MIN_KEYS_PER_SPLIT", 0)
    monkeypatch.setattr(kernels, "MMA_RUN_DIMS", None)
    assert kernels._mma_applies(q, k)
    out = ragged_decode_attention(q, k, v, lengths, scale=0.088)
    expected = reference(q, k, v, lengths, 0.088)
    got = np.array(out.astype(mx.float32))
    np.testing.assert_allclose(got, expected, atol=mma_tolerance(dtype))
    # over hundreds of rows both kernels land within a few output roundings; one wrong 64-key
    # step would move the output by about 1e-2
    plain_err = np.abs(np.array(plain.astype(mx.float32)) - expected).max()
    assert np.abs(got - expected).max() <= 3 * plain_err + 1e-3, plain_err


@needs_cuda
def test_tensor_core_kernel_compiles_into_a_decode_step(monkeypatch):
    """Traced inside mx.compile with a traced length, as a decode step runs it."""
    monkeypatch.setattr(kernels, "TENSOR_CORES", True)
    monkeypatch.setattr(kernels, "MMA_MIN_KEYS_PER_SPLIT", 0)
    monkeypatch.setattr(kernels, "MMA_RUN_DIMS", None)
    q, k, v = make(8, 128, mx.bfloat16, seed=3)
    assert kernels._mma_applies(q, k)
    step = mx.compile(lambda q, k, v, n: ragged_decode_attention(q, k, v, n, scale=0.1))
    for n in (1, 9, C):
        got = np.array(step(q, k, v, mx.array(n, dtype=mx.int32)).astype(mx.float32))
        np.testing.assert_allclose(got, reference(q, k, v, n, 0.1), atol=2e-2)


# the module's tensor-core settings with KVFN_TENSOR_CORES unset
DEFAULTS = dict(TENSOR_CORES=True, MMA_RUN_DIMS=(128,), MMA_MIN_KEYS_PER_SPLIT=256,
                MMA_KEYS_PER_SPLIT=512, MMA_FILL=0.75, MMA_THREADS=256,
                MMA_BLOCKS_PER_SM=1)  # fmt: skip


@needs_cuda
@pytest.mark.parametrize("group", [4, 8])
def test_head_dim_256_gets_the_shared_memory_it_needs(group):
    """At head_dim 256 (Gemma's) a CUDA-core block holds more than 48 KB of shared memory, which
    the kernel asks MLX for (over 48000 dynamic bytes); it matches the float64 reference."""
    unroll = kernels.UNROLL or (4 if group <= 4 else 2)
    static, dynamic = kernels.split_shared_bytes(group, 256, unroll)
    assert static + dynamic > 48 * 1024 and dynamic > 48000
    capacity = 3 * MIN_KEYS_PER_SPLIT + 7
    mx.random.seed(8)
    q = mx.random.normal((B, KV * group, 1, 256)).astype(mx.bfloat16)
    k, v = (mx.random.normal((B, KV, capacity, 256)).astype(mx.bfloat16) for _ in range(2))
    assert not kernels._mma_applies(q, k)
    lengths = mx.array([[5, capacity], [MIN_KEYS_PER_SPLIT + 1, 0]], dtype=mx.int32)
    out = ragged_decode_attention(q, k, v, lengths, scale=0.0625)
    want = reference(q, k, v, lengths, 0.0625)
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), want, atol=tolerance(mx.bfloat16))


@needs_cuda
@pytest.mark.parametrize("threads", [64, 128, 256])
@pytest.mark.parametrize("tensor_cores", [False, True], ids=["cuda_cores", "tensor_cores"])
def test_blocks_of_other_warp_counts_match_reference(monkeypatch, threads, tensor_cores):
    """The split kernels take their warps a block from THREADS, the tensor-core one from
    MMA_THREADS (W = threads / 32): blocks of 2, 4 or 8 warps give the float64 reference's
    attention across splits."""
    monkeypatch.setattr(kernels, "MMA_THREADS" if tensor_cores else "THREADS", threads)
    monkeypatch.setattr(kernels, "TENSOR_CORES", tensor_cores)
    monkeypatch.setattr(kernels, "MMA_MIN_KEYS_PER_SPLIT", 0)
    capacity = 9 * MIN_KEYS_PER_SPLIT + 5
    mx.random.seed(7)
    q = mx.random.normal((B, KV * 4, 1, 128)).astype(mx.bfloat16)
    k, v = (mx.random.normal((B, KV, capacity, 128)).astype(mx.bfloat16) for _ in range(2))
    assert kernels._mma_applies(q, k) == tensor_cores
    assert plan(B, KV * 4, KV, capacity, tensor_cores)[2] > 1
    lengths = mx.array([[1, 17], [2 * MIN_KEYS_PER_SPLIT + 63, capacity]], dtype=mx.int32)
    out = ragged_decode_attention(q, k, v, lengths, scale=0.088)
    want = reference(q, k, v, lengths, 0.088)
    atol = mma_tolerance(mx.bfloat16) if tensor_cores else tolerance(mx.bfloat16)
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), want, atol=atol)


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["f16", "bf16"])
def test_tensor_core_kernel_runs_by_default_on_long_splits(monkeypatch, dtype):
    """With the module's default settings (blocks of 8 warps) a long capacity takes the
    tensor-core kernel in plan's splits for it, over ragged lengths, against the float64
    reference."""
    for name, value in DEFAULTS.items():  # whatever KVFN_TENSOR_CORES this process has
        monkeypatch.setattr(kernels, name, value)
    batch, kv_heads, group = 1, 8, 4  # MMA_FILL of a wave of one block an SM: 99 // 8 splits
    capacity = 16384 + 5
    assert plan(batch, kv_heads * group, kv_heads, capacity, mma=True)[2] == 12
    mx.random.seed(5)
    q = mx.random.normal((batch, kv_heads * group, 1, 128)).astype(dtype)
    k, v = (mx.random.normal((batch, kv_heads, capacity, 128)).astype(dtype) for _ in range(2))
    assert kernels._mma_applies(q, k)
    lengths = mx.array([[capacity, 1, 0, 511, 512, 9000, 12345, capacity - 3]], mx.int32)
    out = np.array(ragged_decode_attention(q, k, v, lengths, scale=0.088).astype(mx.float32))
    want = reference(q, k, v, lengths, 0.088)
    np.testing.assert_allclose(out, want, atol=mma_tolerance(dtype))


@pytest.mark.parametrize(
    "env, settings",
    [
        (None, DEFAULTS),
        ("", DEFAULTS),
        ("0", dict(DEFAULTS, TENSOR_CORES=False)),
        ("1", dict(DEFAULTS, MMA_RUN_DIMS=None, MMA_MIN_KEYS_PER_SPLIT=0)),
    ],
)
def test_tensor_core_settings_follow_the_environment(monkeypatch, env, settings):
    """KVFN_TENSOR_CORES unset: tensor cores at head_dim 128 from 256 rows; 0: off;
    1: every split and head_dim the kernel takes (the module read fresh from its file)."""
    from examples.benchmark_kernels import load_kernels

    if env is None:
        monkeypatch.delenv("KVFN_TENSOR_CORES", raising=False)
    else:
        monkeypatch.setenv("KVFN_TENSOR_CORES", env)
    monkeypatch.delenv("KVFN_DECODE_KERNEL", raising=False)
    fresh = load_kernels()
    assert {name: getattr(fresh, name) for name in settings} == settings


@pytest.mark.parametrize("env", ["yes", "2", " 1"])
def test_tensor_core_setting_names_a_bad_value(monkeypatch, env):
    from examples.benchmark_kernels import load_kernels

    monkeypatch.setenv("KVFN_TENSOR_CORES", env)
    with pytest.raises(ValueError, match=f"KVFN_TENSOR_CORES must be 0 or 1.*{env!r}"):
        load_kernels()


@needs_cuda
@pytest.mark.parametrize(
    "dtype, tensor_cores", [(mx.float32, False), (mx.bfloat16, False), (mx.bfloat16, True)]
)
def test_one_split_writes_the_output_itself(monkeypatch, dtype, tensor_cores):
    """Forced to one split, a long capacity's attention (no combine launch: the split kernel
    writes q's dtype) matches the float64 reference, as the many splits plan() picks do."""
    monkeypatch.setattr(kernels, "TENSOR_CORES", tensor_cores)
    monkeypatch.setattr(kernels, "MMA_MIN_KEYS_PER_SPLIT", 0)
    capacity = 9 * MIN_KEYS_PER_SPLIT + 5
    mx.random.seed(6)
    q = mx.random.normal((B, KV * 4, 1, 128)).astype(dtype)
    k, v = (mx.random.normal((B, KV, capacity, 128)).astype(dtype) for _ in range(2))
    assert kernels._mma_applies(q, k) == tensor_cores
    assert plan(B, KV * 4, KV, capacity, tensor_cores)[2] > 1
    lengths = mx.array([[0, 65], [capacity - 1, capacity]], dtype=mx.int32)
    want = reference(q, k, v, lengths, 0.088)
    many = ragged_decode_attention(q, k, v, lengths, scale=0.088)
    monkeypatch.setattr(kernels, "plan", lambda *a, **kw: plan(*a, **kw)[:2] + (1,))
    one = ragged_decode_attention(q, k, v, lengths, scale=0.088)
    assert one.dtype == dtype and one.shape == q.shape
    atol = mma_tolerance(dtype) if tensor_cores else tolerance(dtype)
    for out in (many, one):
        np.testing.assert_allclose(np.array(out.astype(mx.float32)), want, atol=atol)


def test_tensor_core_kernel_applies_to_the_shapes_it_takes(monkeypatch):
    """Checked before any launch, on any backend: float16 / bfloat16, head_dim 64 or 128 (by
    default 128 only), at most 8 query heads a block, plan's splits for it (MMA_FILL of a
    wave of one block of MMA_THREADS an SM, at least MMA_KEYS_PER_SPLIT rows where the
    capacity has them) of at least MMA_MIN_KEYS_PER_SPLIT rows; elsewhere the CUDA-core kernel
    runs."""
    for name, value in DEFAULTS.items():
        monkeypatch.setattr(kernels, name, value)
    q, k, _ = make(8 * 4, 128, mx.bfloat16)  # 8 KV heads: at most 12 splits (99 blocks)
    long = mx.zeros((1, 8, 1 << 16, 128), mx.bfloat16)
    for capacity, splits in ((1 << 16, 12), (8192, 12), (4096, 8), (1024, 2), (1023, 1),
                             (512, 1), (256, 1)):  # fmt: skip
        assert kernels._mma_applies(q[:1], long[:, :, :capacity])
        assert plan(1, 32, 8, capacity, mma=True)[2] == splits
    assert plan(1, 32, 8, 1 << 16)[2] == 49  # the CUDA-core plan: three blocks an SM
    assert not kernels._mma_applies(q[:1], long[:, :, :255])  # one split of 255 rows
    assert [plan(b, 32, 8, 1 << 16, mma=True)[2] for b in (6, 7)] == [2, 1]  # 99 // (8 b)
    assert plan(1, 64, 4, 1 << 16, mma=True) == (8, 2, 12)  # 2 head tiles a KV head: 8 rows
    many = mx.broadcast_to(mx.zeros((1, 1, 1, 1), mx.bfloat16), (32, 8, 1024, 128))
    qs = mx.broadcast_to(mx.zeros((1, 1, 1, 1), mx.bfloat16), (32, 32, 1, 128))
    assert plan(32, 32, 8, 1024, mma=True)[2] == 1 and kernels._mma_applies(qs, many)
    assert not kernels._mma_applies(q, k)  # 16 rows: one split of 16
    assert not kernels._mma_applies(q[:1, :, :, :64], long[..., :64])  # takes, does not run
    monkeypatch.setattr(kernels, "MMA_MIN_KEYS_PER_SPLIT", 0)
    monkeypatch.setattr(kernels, "MMA_RUN_DIMS", None)
    assert kernels._mma_applies(q[:1, :, :, :64], long[..., :64])
    q, k, _ = make(KV * 4, 128, mx.bfloat16)
    assert kernels._mma_applies(q, k)
    q32, k32, _ = make(KV * 4, 128, mx.float32)
    assert not kernels._mma_applies(q32, k32)
    q96, k96, _ = make(KV * 4, 96, mx.bfloat16)
    assert not kernels._mma_applies(q96, k96)
    monkeypatch.setattr(kernels, "MAX_HEADS_PER_BLOCK", 16)
    q16, k16, _ = make(KV * 16, 64, mx.float16)
    assert plan(B, KV * 16, KV, C)[0] == 16 and not kernels._mma_applies(q16, k16)
    monkeypatch.setattr(kernels, "TENSOR_CORES", False)
    assert not kernels._mma_applies(q, k)


def test_tensor_core_plan_keeps_the_rows_it_runs_on(monkeypatch):
    """Whatever the batch and head layout, a capacity takes the tensor-core kernel exactly from
    MMA_MIN_KEYS_PER_SPLIT rows: plan's splits for it (MMA_FILL of a wave, at least
    MMA_KEYS_PER_SPLIT rows) never drop under that least, even where it exceeds the split size."""
    for name, value in DEFAULTS.items():
        monkeypatch.setattr(kernels, name, value)
    layouts = [(1, 32, 8), (3, 32, 8), (7, 32, 8), (1, 64, 4), (2, 14, 2), (32, 32, 8)]
    for batch, q_heads, kv_heads in layouts:
        q = mx.zeros((batch, q_heads, 1, 128), mx.bfloat16)
        for capacity in (255, 256, 511, 1023, 1024, 5000, 1 << 16):
            k = mx.broadcast_to(
                mx.zeros((1, 1, 1, 1), mx.bfloat16), (batch, kv_heads, capacity, 128)
            )
            assert kernels._mma_applies(q, k) == (capacity >= 256), (batch, q_heads, capacity)
    monkeypatch.setattr(kernels, "MMA_MIN_KEYS_PER_SPLIT", 2048)  # above MMA_KEYS_PER_SPLIT
    q = mx.zeros((1, 32, 1, 128), mx.bfloat16)
    assert plan(1, 32, 8, 8192, mma=True)[2] == 4
    assert kernels._mma_applies(q, mx.zeros((1, 8, 8192, 128), mx.bfloat16))
    assert not kernels._mma_applies(q, mx.zeros((1, 8, 2047, 128), mx.bfloat16))


@pytest.mark.parametrize("stages", [0, 1, 2, 3])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("threads", [32, 64, 128, 256])
def test_tensor_core_staging_holds_the_warp_merge(monkeypatch, stages, dim, threads):
    """The kernel merges its W warps' partial results (m, l and D floats a query head, up to
    8 heads) in the memory it staged rows in, for every W a block."""
    monkeypatch.setattr(kernels, "STAGES", stages)
    monkeypatch.setattr(kernels, "MMA_THREADS", threads)
    warps = threads // 32
    assert kernels.mma_staged_bytes(dim) >= 4 * warps * kernels.MMA_MAX_HEADS * (dim + 2)


@pytest.mark.parametrize("threads", [64, 128, 256])
@pytest.mark.parametrize("tile, unroll", [(4, 4), (8, 2)])
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_split_kernels_shared_memory_fits_a_block(monkeypatch, threads, tile, unroll, dim):
    """A CUDA-core block's static merge arrays and staged rows: past 48 KB in all the dynamic
    part exceeds 48000 bytes, where MLX opts the kernel in to more (head_dim 256 needs it);
    static arrays past 48 KB, which no kernel can declare, are named before any launch."""
    monkeypatch.setattr(kernels, "THREADS", threads)
    static = threads // 32 * tile * (dim + 2) * 4
    if static > 48 * 1024:
        with pytest.raises(ValueError, match=f"head_dim {dim} need {static} bytes"):
            kernels.split_shared_bytes(tile, dim, unroll)
        return
    got_static, dynamic = kernels.split_shared_bytes(tile, dim, unroll)
    assert got_static == static and dynamic >= kernels.staged_bytes(unroll)
    assert static + dynamic <= 48 * 1024 or dynamic > 48000
    assert static + dynamic <= 227 * 1024  # Hopper's most a block can opt in to
    if static + kernels.staged_bytes(unroll) <= 48 * 1024:
        assert dynamic == kernels.staged_bytes(unroll)  # nothing raised that fits already


def test_zero_length_gives_zeros_not_nan():
    q, k, v = make(4, 64, mx.float32)
    out = np.array(ragged_decode_attention(q, k, v, mx.array([0, 2], dtype=mx.int32), scale=0.1))
    assert not np.isnan(out).any()
    assert (out[0] == 0).all() and (out[1] != 0).any()


def test_slots_past_length_are_ignored():
    q, k, v = make(4, 64, mx.float32)
    lengths = mx.array([[3, 8], [1, 16]], dtype=mx.int32)
    slot = mx.arange(C)[None, None, :, None]
    limit = lengths[:, :, None, None]
    k2 = mx.where(slot < limit, k, 1e4)  # finite: the masked SDPA fallback multiplies them by 0
    v2 = mx.where(slot < limit, v, -1e4)
    out = ragged_decode_attention(q, k, v, lengths, scale=0.1)
    out2 = ragged_decode_attention(q, k2, v2, lengths, scale=0.1)
    np.testing.assert_allclose(np.array(out2), np.array(out), atol=1e-6)


def test_per_head_lengths_differ_from_shared():
    q, k, v = make(8, 64, mx.float32)
    per_head = ragged_decode_attention(q, k, v, mx.array([[2, 9], [2, 9]], mx.int32), scale=0.1)
    shared = ragged_decode_attention(q, k, v, mx.array(2, mx.int32), scale=0.1)
    same = np.isclose(np.array(per_head), np.array(shared), atol=1e-6).all(axis=-1)
    assert same[:, :4].all() and not same[:, 4:].any()  # q heads 4-7 read KV head 1


def test_compiled_follows_traced_lengths():
    q, k, v = make(8, 128, mx.bfloat16)
    traces = []

    def step(q, k, v, lengths):
        traces.append(1)
        return ragged_decode_attention(q, k, v, lengths, scale=0.125)

    compiled = mx.compile(step)
    for lengths in ([[1, 2], [3, 4]], [[16, 0], [9, 12]]):
        lengths = mx.array(lengths, dtype=mx.int32)
        got = np.array(compiled(q, k, v, lengths).astype(mx.float32))
        np.testing.assert_allclose(got, reference(q, k, v, lengths, 0.125), atol=2e-2)
    assert len(traces) == 1


def test_python_int_length():
    q, k, v = make(4, 64, mx.float32)
    out = ragged_decode_attention(q, k, v, 6, scale=0.1)
    np.testing.assert_allclose(np.array(out), reference(q, k, v, 6, 0.1), atol=1e-5)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda q, k, v, n: (q[0], k, v, n), "q must be"),
        (lambda q, k, v, n: (mx.concatenate([q, q], axis=2), k, v, n), "one query token"),
        (lambda q, k, v, n: (q, k, v[:, :, :4], n), "k and v shapes differ"),
        (lambda q, k, v, n: (q[:, :3], k, v, n), "not a multiple of n_kv_heads=2"),
        (lambda q, k, v, n: (q[..., :32], k, v, n), "batch or head_dim"),
        (lambda q, k, v, n: (q, k, v, n.astype(mx.int64)), "int32; got mlx.core.int64"),
        (lambda q, k, v, n: (q, k, v, n.astype(mx.float32)), "int32"),
        (lambda q, k, v, n: (q, k, v, mx.zeros((3,), mx.int32)), r"lengths.shape=\(3,\)"),
        (lambda q, k, v, n: (q, k, v, mx.zeros((2, 3), mx.int32)), r"\(2, 2\)"),
        (lambda q, k, v, n: (q, k, v, mx.zeros((2, 2, 1), mx.int32)), "lengths.shape"),
        (lambda q, k, v, n: (q, k, v, [1, 2]), "lengths must be an int32 mx.array"),
        (lambda q, k, v, n: (q.astype(mx.int32), k, v, n), "q must be floating"),
    ],
)
def test_validation(change, message):
    q, k, v = make(4, 64, mx.float32)
    args = change(q, k, v, mx.array([1, 2], dtype=mx.int32))
    with pytest.raises(ValueError, match=message):
        ragged_decode_attention(*args, scale=0.1)


def test_plan_fills_the_gpu_and_tiles_heads():
    tile, tiles, small = plan(1, 32, 8, 1024)
    assert (tile, tiles) == (4, 1) and small == 1024 // MIN_KEYS_PER_SPLIT
    assert plan(1, 32, 8, 131072)[2] > small
    assert plan(64, 32, 8, 131072)[2] == 1  # enough (batch, head) rows already
    assert plan(1, 64, 4, 4096)[:2] == (8, 2)
    assert plan(1, 14, 2, 4096)[:2] == (7, 1)


def two_part_operands():
    """A layer of 5 KV heads (3 plain of 24 slots, 2 a full ring of 9), 4 query heads each."""
    from kvfn.states.partitioned import _head_map

    q = mx.zeros((B, 20, 1, 64))
    k0, k1 = mx.zeros((B, 3, 24, 64)), mx.zeros((B, 2, 9, 64))
    return q, k0, k1, mx.array(11, mx.int32), _head_map(((1, 3, 4), (0, 2)))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda q, k0, k1, n: (q[:, :, [0, 0]], k0, k1, n), r"q \(2, 20, 2, 64\) does not fit"),
        (lambda q, k0, k1, n: (q, k0, k1[:, :1], n), "do not hold 5 KV heads"),
        (lambda q, k0, k1, n: (q, k0, k1, n.astype(mx.int64)), "lengths must be int32"),
        (lambda q, k0, k1, n: (q, k0, k1, mx.zeros((3,), mx.int32)), r"int32 \(\) or \(2,\)"),
    ],
)
def test_two_part_validation(change, message):
    """The fused kernels refuse operands that do not fit, before any launch (on any backend)."""
    from kvfn.kernels import two_part_decode_attention

    q, k0, k1, n, hmap = two_part_operands()
    q, k0, k1, n = change(q, k0, k1, n)
    with pytest.raises(ValueError, match=message):
        two_part_decode_attention(q, k0, k0, n, k1, k1, 9, hmap, scale=0.1)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda q, k, v, n: (q[..., :32], k, v, n), r"does not fit slots \(2, 90, 64\)"),
        (lambda q, k, v, n: (q, k, v[:, :89], n), r"slots keys \(2, 90, 64\) and values"),
        (lambda q, k, v, n: (q, k, v, mx.zeros((3,), mx.int32)), r"int32 \(\) or \(2,\)"),
        (lambda q, k, v, n: (q, k[:, :89], v[:, :89], n), "89 slots are not 5 KV heads"),
    ],
)
def test_slots_validation(change, message):
    from kvfn.kernels import slots_decode_attention
    from kvfn.states.slots import _layout

    q, _, _, n, _ = two_part_operands()
    k = mx.zeros((B, 3 * 24 + 2 * 9, 64))
    q, k, v, n = change(q, k, k, n)
    hmap = _layout(((1, 3, 4), (0, 2)), 24, 9)[2]
    with pytest.raises(ValueError, match=message):
        slots_decode_attention(q, k, v, n, 24, 9, hmap, scale=0.1)


@pytest.mark.parametrize("lengths", [mx.array(11, mx.int32), mx.array([0, 24], mx.int32)])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("threads", [128, 256])
def test_two_parts_in_head_order_match_each_group_alone(monkeypatch, lengths, dim, dtype, threads):
    """The fused two-part kernel (CUDA) equals each part's float64 attention put back in head
    order, in blocks of 4 warps or 8 (``THREADS``)."""
    from kvfn.kernels import two_part_decode_attention, two_part_fused
    from kvfn.states.partitioned import _head_map

    monkeypatch.setattr(kernels, "THREADS", threads)

    heads, group = ((1, 3, 4), (0, 2)), 4
    mx.random.seed(1)
    q = mx.random.normal((B, 5 * group, 1, dim)).astype(dtype)
    k0, v0 = (mx.random.normal((B, 3, 24, dim)).astype(dtype) for _ in range(2))
    k1, v1 = (mx.random.normal((B, 2, 9, dim)).astype(dtype) for _ in range(2))
    if not two_part_fused(q, k0, k1):
        pytest.skip("the fused kernel runs on MLX's CUDA backend")
    out = two_part_decode_attention(q, k0, v0, lengths, k1, v1, 9, _head_map(heads),
                                     scale=dim**-0.5)  # fmt: skip
    expected = np.zeros(q.shape)
    for (k, v, n), hs in zip(((k0, v0, lengths), (k1, v1, mx.array(9, mx.int32))), heads):
        qi = mx.array([h * group + r for h in hs for r in range(group)], mx.int32)
        expected[:, np.array(qi)] = reference(mx.take(q, qi, axis=1), k, v, n, dim**-0.5)
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), expected, atol=tolerance(dtype))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc compiles the kernels offline")
@pytest.mark.parametrize(
    "name", ["SPLIT_SOURCE", "TWO_PART_SOURCE", "SLOTS_SOURCE", "MMA_SPLIT_SOURCE"]
)
@pytest.mark.parametrize("dtype", ["__nv_bfloat16", "__half"])
@pytest.mark.parametrize("one_split", [False, True], ids=["splits", "one_split"])
def test_split_kernels_compile_to_the_blocks_plan_assumes(name, dtype, one_split):
    """Each split kernel's source (its partial outputs in float32, or with one split the
    output in T) compiles for Hopper as MLX wraps it, spills nothing, and
    needs few enough registers for kernels.BLOCKS_PER_SM blocks of THREADS an SM
    (MMA_BLOCKS_PER_SM of MMA_THREADS for the tensor-core kernel), which ``plan`` sizes its
    single wave of splits by (more registers: a second, straggling wave); their shared memory
    (static, and the rows staged by cp.async) fits as many blocks."""
    import kvfn.kernels as kernels
    from examples.kernel_registers import compiled, load_kernels, resident_blocks, wrapped

    unroll = kernels.UNROLL or 4
    kk = load_kernels()
    mma = name == "MMA_SPLIT_SOURCE"
    threads = kk.MMA_THREADS if mma else kk.THREADS
    blocks = kk.MMA_BLOCKS_PER_SM if mma else kk.BLOCKS_PER_SM
    r = compiled(wrapped(kk, name, 128, unroll, kernels.STAGES, dtype, one_split, threads))
    assert r["spill_stores"] == r["spill_loads"] == 0
    assert resident_blocks(r["registers"], threads) >= blocks, r
    staged = kernels.mma_staged_bytes(128) if mma else kernels.staged_bytes(unroll)
    per_block = r["smem"] + staged + 1024  # 1 KB the driver reserves
    assert per_block * blocks <= 228 * 1024, (per_block, r)  # Hopper, an SM


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc compiles the kernels offline")
@pytest.mark.parametrize("heads, unroll", [(4, 4), (8, 2)])
def test_split_kernel_compiles_in_blocks_of_8_warps(monkeypatch, heads, unroll):
    """With THREADS = 256 (``--configs ...,8``) the CUDA-core kernel compiles without spills
    to a block an SM holds, its static shared memory is what ``split_shared_bytes`` plans
    for, and the tensor-core kernel compiles too."""
    from examples.kernel_registers import compiled, load_kernels, resident_blocks, wrapped

    kk = load_kernels()
    monkeypatch.setattr(kk, "THREADS", 256)
    r = compiled(wrapped(kk, "SPLIT_SOURCE", 128, unroll, kk.STAGES, threads=256, heads=heads))
    assert r["spill_stores"] == r["spill_loads"] == 0 and resident_blocks(r["registers"], 256)
    static, dynamic = kk.split_shared_bytes(heads, 128, unroll)
    assert r["smem"] == static and static + dynamic <= 227 * 1024
    mma = compiled(wrapped(kk, "MMA_SPLIT_SOURCE", 128, None, kk.STAGES, threads=256, heads=heads))
    assert mma["spill_stores"] == mma["spill_loads"] == 0 and resident_blocks(mma["registers"], 256)


@pytest.mark.parametrize("mma", [False, True], ids=["cuda_cores", "tensor_cores"])
def test_each_split_kernel_launches_in_its_own_blocks(monkeypatch, mma):
    """The CUDA-core split kernel launches blocks of THREADS, the tensor-core one blocks of
    MMA_THREADS, in the split count plan gives each (caught on the host: nothing launches)."""
    launched = []

    def kernel(shared):
        def launch(**kw):
            launched.append(kw)
            return [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]

        return launch

    monkeypatch.setattr(kernels, "_combine_kernel", lambda: kernel(0))
    q, k, v = make(KV * 4, 128, mx.bfloat16)
    kernels._split_and_combine(kernel, [q, k, v], q, KV, 4096, k.dtype, 0.1, [], [4096], mma)
    threads = kernels.MMA_THREADS if mma else kernels.THREADS
    splits = plan(B, KV * 4, KV, 4096, mma)[2]
    assert kernels.MMA_THREADS != kernels.THREADS and splits > 1 and len(launched) == 2
    split = launched[0]
    assert split["threadgroup"] == (threads, 1, 1) and split["grid"][0] == splits * threads
    assert dict(split["template"])["W"] == threads // 32


@pytest.mark.parametrize("threads", [48, 0, 512])
@pytest.mark.parametrize("name, mma", [("THREADS", False), ("MMA_THREADS", True)])
def test_a_bad_block_size_is_named_before_any_launch(monkeypatch, threads, name, mma):
    """``THREADS`` and ``MMA_THREADS`` (benchmark settings) must be whole warps, at most 8:
    checked on the host before the split kernel is built or launched, on any backend."""
    monkeypatch.setattr(kernels, name, threads)
    q, k, v = make(KV * 4, 128, mx.bfloat16)
    with pytest.raises(ValueError, match=f"kernels.{name} must be .*; got {threads}"):
        kernels._split_and_combine(None, [q, k, v], q, KV, C, k.dtype, 0.1, [], [C], mma)


def _launches(monkeypatch) -> list:
    """Each kernel launch's arguments (nothing runs: the kernels are stand-ins)."""
    launched = []

    def kernel(*_):
        def launch(**kw):
            launched.append(kw)
            return [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]

        return launch

    for name in ("_split_kernel", "_mma_split_kernel", "_ranges_kernel", "_mma_ranges_kernel",
                 "_slots_kernel", "_mma_slots_kernel", "_two_part_kernel", "_combine_kernel"):
        monkeypatch.setattr(kernels, name, kernel)
    return launched


def _each_layout(rows: int, ring: int) -> list:
    """One decode attention call per layout's kernel over ``rows`` rows a KV head (a ring of
    ``ring``), 8 query heads, bf16 head_dim 128: the plain split kernel, the ragged one, the
    slots one and the two-part one."""
    from kvfn.states.partitioned import _head_map

    q = mx.zeros((1, 8, 1, 128), mx.bfloat16)
    k = mx.zeros((1, 2, rows, 128), mx.bfloat16)
    flat = mx.zeros((1, 2 * rows + 3, 128), mx.bfloat16)
    slots = mx.zeros((1, rows + ring, 128), mx.bfloat16)
    k1 = mx.zeros((1, 1, ring, 128), mx.bfloat16)
    n = mx.array(rows - 1, mx.int32)
    starts, lengths = mx.array([[0, rows]], mx.int32), mx.array([[rows - 2, rows]], mx.int32)
    hmap = mx.array([0, 0, rows, 1], mx.int32)
    return [
        lambda: kernels._kernel_attention(q, k, k, n, 0.1),
        lambda: kernels.ranges_decode_attention(q, flat, flat, starts, lengths, scale=0.1),
        lambda: kernels.slots_decode_attention(q, slots, slots, n, rows, ring, hmap, scale=0.1),
        lambda: kernels.two_part_decode_attention(q, k[:, :1], k[:, :1], n, k1, k1, ring,
                                                   _head_map(((0,), (1,))), scale=0.1),
    ]


@pytest.mark.parametrize("layout", range(4), ids=["plain", "ragged", "slots", "two_part"])
@pytest.mark.parametrize("mma", [False, True], ids=["cuda_cores", "tensor_cores"])
def test_a_new_capacity_compiles_no_new_kernel(monkeypatch, layout, mma):
    """What MLX compiles a custom kernel by (its name, source and template arguments) does not
    depend on a layer's sizes: capacities, slots, ring fill and the split count are read at run
    time (``dims``, the grid), so a prompt of a new length, or a policy whose per-layer
    allocation differs by prompt, compiles nothing new (on the GPU a compile took ~0.1-0.5 s a
    kernel, and a ragged layer's slots differ per prompt). The sizes still reach the kernel."""
    monkeypatch.setattr(kernels, "TENSOR_CORES", mma)
    launched = _launches(monkeypatch)
    for rows, ring in ((2000, 64), (4321, 72)):  # different sizes and split counts
        _each_layout(rows, ring)[layout]()
    first, second = launched[0], launched[len(launched) // 2]
    assert len(launched) == 4  # split and combine, twice
    assert first["template"] == second["template"]
    assert launched[1]["template"] == launched[3]["template"]  # the combine's
    dims = lambda kw: np.array(kw["inputs"][-1]).tolist()  # noqa: E731
    assert dims(first) != dims(second) and dims(launched[1]) != dims(launched[3])
    assert dims(launched[1]) == [first["grid"][0] // first["threadgroup"][0]]  # the splits

"""The window queries' softmax reduced over the queries, fused, on MLX's CUDA backend.

``reduced_softmax`` takes the window queries' logits over every slot, in the keys' dtype, and
returns each slot's attention summed (SnapKV's window) or maxed (KVzip's reconstruction) over
the queries, in float32, as the stock ops do (cast, causal mask, softmax, sum or max;
``kvfn.scores``), in two launches: each query's log-sum-exp (its maximum, then its sum, over
the slots it sees), then each slot's reduction. They read the logits three times and write
nothing of their size, where the stock ops make several float32 arrays of (heads x queries x
capacity) a layer, which pile up in a prefill while the host runs layers ahead of the GPU.
"""

import os
from contextlib import contextmanager
from functools import lru_cache

import mlx.core as mx

from .kernels import KERNEL_DTYPES, cuda_kernel, on_cuda

# KVFN_SCORE_KERNEL=0 turns the CUDA kernels off (the stock ops run everywhere)
ENABLED = os.environ.get("KVFN_SCORE_KERNEL", "1") != "0"
THREADS = 256

HEADER = r"""
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// (m, s) with s = sum of exp(x - m) over what it holds, merged with (m2, s2)
__device__ __forceinline__ void merge_lse(float& m, float& s, float m2, float s2) {
  const float top = fmaxf(m, m2);
  if (top == neg_inf()) {
    return;
  }
  s = s * expf(m - top) + s2 * expf(m2 - top);
  m = top;
}
"""

# One block a query row (sequence b, KV head, group member, query q) of logits (C slots):
# the log-sum-exp over the slots it sees (position <= its own); -inf where it sees none.
LSE_SOURCE = r"""
  const int C = dims[0], W = dims[1], G = dims[2], HKV = dims[3];
  const int row = blockIdx.x;
  const int bh = row / (G * W);
  const int b = bh / HKV;
  const int qp = qpos[b * W + row % W];
  const T* x = logits + (size_t)row * C;
  const int* kp = kpos + (size_t)bh * C;
  float m = neg_inf(), s = 0.f;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    if (kp[c] <= qp) {
      m = fmaxf(m, static_cast<float>(x[c]));
    }
  }
  if (m != neg_inf()) {  // the second read of the row comes from cache
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      if (kp[c] <= qp) {
        s += expf(static_cast<float>(x[c]) - m);
      }
    }
  }
  for (int d = 16; d > 0; d /= 2) {
    const float m2 = __shfl_xor_sync(0xffffffff, m, d);
    const float s2 = __shfl_xor_sync(0xffffffff, s, d);
    merge_lse(m, s, m2, s2);
  }
  __shared__ float ms[32], ss[32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if (lane == 0) {
    ms[warp] = m;
    ss[warp] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int i = 1; i < warps; ++i) {
      merge_lse(m, s, ms[i], ss[i]);
    }
    lse[row] = m == neg_inf() ? neg_inf() : m + logf(s);
  }
"""

# One thread a slot c of one (sequence, KV head, group member): its softmax weight summed over
# the W queries that see it, or (MAX) their largest.
REDUCE_SOURCE = r"""
  const int C = dims[0], W = dims[1], G = dims[2], HKV = dims[3];
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  const int r = blockIdx.y;
  const int b = r / (G * HKV);
  if (c < C) {
    const int p = kpos[(size_t)(r / G) * C + c];
    const T* x = logits + (size_t)r * W * C + c;
    float acc = 0.f;
    for (int q = 0; q < W; ++q) {
      const float l = lse[r * W + q];
      if (p <= qpos[b * W + q] && l != neg_inf()) {
        const float e = expf(static_cast<float>(x[(size_t)q * C]) - l);
        acc = MAX ? fmaxf(acc, e) : acc + e;
      }
    }
    out[(size_t)r * C + c] = acc;
  }
"""


OPS = ("sum", "max")


@contextmanager
def disabled():
    """Within it the stock ops run everywhere (to compare them with the kernels). It acts on
    what runs or is traced inside it: a step ``mx.compile`` traced before keeps its kernels."""
    global ENABLED
    before, ENABLED = ENABLED, False
    try:
        yield
    finally:
        ENABLED = before


def applies(logits: mx.array) -> bool:
    """Whether ``reduced_softmax`` runs for these logits (MLX's CUDA backend, a floating dtype;
    ``KVFN_SCORE_KERNEL=0`` or ``disabled()`` turns it off)."""
    return ENABLED and logits.dtype in KERNEL_DTYPES and on_cuda()


def reduced_softmax(
    logits: mx.array, key_positions: mx.array, query_positions: mx.array, op: str = "sum"
) -> mx.array:
    """Softmax over the slots of each query's ``logits`` (B, n_kv, group, w, C), masked to the
    slots whose ``key_positions`` (B, n_kv or 1, C) are at most the query's
    ``query_positions`` (B or 1, w), then summed (``op="sum"``) or maxed (``"max"``) over the
    queries: (B, n_kv, group, C) float32. A query that sees no slot adds nothing. Only where
    ``applies`` says so."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if logits.ndim != 5 or 0 in logits.shape:
        raise ValueError(f"logits must be (B, n_kv, group, w >= 1, C >= 1), got {logits.shape}")
    B, n_kv, group, w, C = logits.shape
    if key_positions.shape not in ((B, n_kv, C), (B, 1, C)) or query_positions.shape not in (
        (B, w),
        (1, w),
    ):
        raise ValueError(
            f"positions {key_positions.shape} and {query_positions.shape} do not fit logits "
            f"{logits.shape}"
        )
    if not applies(logits):
        raise RuntimeError(
            f"the window kernels do not apply to {logits.dtype} logits here: they need MLX's "
            "CUDA backend, a floating dtype, and not disabled (KVFN_SCORE_KERNEL=0, disabled())"
        )
    rows = B * n_kv * group
    if rows * w * THREADS >= 2**31 or rows >= 2**16:  # CUDA's grid limits
        raise ValueError(f"{rows} x {w} query rows are too many for one launch")
    kpos = mx.broadcast_to(key_positions, (B, n_kv, C)).astype(mx.int32)
    qpos = mx.broadcast_to(query_positions, (B, w)).astype(mx.int32)
    dims = mx.array([C, w, group, n_kv], dtype=mx.int32)
    (lse,) = _lse_kernel()(
        inputs=[logits, kpos, qpos, dims],
        template=[("T", logits.dtype)],
        grid=(rows * w * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows * w,)],
        output_dtypes=[mx.float32],
    )
    (out,) = _reduce_kernel()(
        inputs=[logits, kpos, qpos, dims, lse],
        template=[("T", logits.dtype), ("MAX", op == "max")],
        grid=(-(-C // THREADS) * THREADS, rows, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, n_kv, group, C)],
        output_dtypes=[mx.float32],
    )
    return out


@lru_cache(maxsize=None)
def _lse_kernel():
    return cuda_kernel("kvfn_window_lse", ["logits", "kpos", "qpos", "dims"], ["lse"], LSE_SOURCE,
                       HEADER)  # fmt: skip


@lru_cache(maxsize=None)
def _reduce_kernel():
    return cuda_kernel("kvfn_window_reduce", ["logits", "kpos", "qpos", "dims", "lse"], ["out"],
                       REDUCE_SOURCE, HEADER)  # fmt: skip

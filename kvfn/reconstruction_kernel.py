"""KVzip's reconstruction scores of one chunk, fused, on tensor cores (MLX's CUDA backend).

A reconstruction input's n queries (B, n_heads, n, D) each take a softmax over restricted keys:
the first ``s0`` rows, the chunk's rows [start, end) and the input's own rows up to its own; a
chunk row scores the most weight any query of its head gives it. Two launches, neither writing
anything of size queries x keys: each query's log-sum-exp over the restricted keys (online
maximum and sum), then for each chunk row the maximum over the queries of its logit minus that
log-sum-exp (one exponential at the end: the maximum commutes with it). Both multiply on tensor
cores (mma.sync m16n8k16, float32 accumulators; operands from shared memory by ldmatrix, staged
by cp.async in two steps), float16 / bfloat16 at head_dim 64 or 128; elsewhere the stock ops run
(``kvfn.scores.reconstruction_attention``). Logits are in base 2 (scale * log2(e)).
"""

import math
import os
from contextlib import contextmanager
from functools import lru_cache

import mlx.core as mx

from .kernels import cuda_kernel, on_cuda

# KVFN_SCORE_KERNEL=0 turns the CUDA kernels off (the stock ops run everywhere)
ENABLED = os.environ.get("KVFN_SCORE_KERNEL", "1") != "0"
DTYPES = (mx.float16, mx.bfloat16)
DIMS = (64, 128)
LSE_WARPS = 4  # a block of the log-sum-exp kernel: 16 query rows a warp
MAX_WARPS = 4  # a block of the maximum kernel: 16 chunk rows a warp
TILE = 64  # keys (log-sum-exp) or queries (maximum) a staged step
LOG2E = 1.0 / math.log(2.0)

HEADER = r"""
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// 16 bytes global -> shared without registers (cp.async, L2 only); not `valid`: zeros.
__device__ __forceinline__ void copy16_async(uint4* dst, const void* src, bool valid) {
  const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(at), "l"(src),
               "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8x8 16-bit matrices from shared memory, lane i giving row i % 8 of matrix i / 8.
__device__ __forceinline__ void ldmatrix4(unsigned (&r)[4], const uint4* row) {
  const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at));
}

__device__ __forceinline__ unsigned kvfn_load2(const void* at) {
  return *reinterpret_cast<const unsigned*>(at);
}

// d += A B on tensor cores (m16n8k16, float32 accumulators), A's 16 rows in a[4].
template <typename T>
struct KvfnMma16816;
#define KVFN_MMA16816_(TYPE, PTX)                                                          \
  template <>                                                                             \
  struct KvfnMma16816<TYPE> {                                                                 \
    static __device__ __forceinline__ void run(                                           \
        float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {                \
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX "." PTX ".f32 "           \
                   "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"    \
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                       \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));       \
    }                                                                                     \
  };
KVFN_MMA16816_(__nv_bfloat16, "bf16")
KVFN_MMA16816_(__half, "f16")
#undef KVFN_MMA16816_

// The A fragments (16 rows x D) of this lane (g = lane / 4, t = lane % 4): rows g and g + 8
// at `lo` and `hi` (nullptr: a zero row).
template <typename T, int D>
__device__ __forceinline__ void kvfn_load_rows(unsigned (&a)[D / 16][4], const T* lo, const T* hi,
                                          int t) {
#pragma unroll
  for (int kc = 0; kc < D / 16; ++kc) {
    const int d = 16 * kc + 2 * t;
    a[kc][0] = lo ? kvfn_load2(lo + d) : 0u;
    a[kc][1] = hi ? kvfn_load2(hi + d) : 0u;
    a[kc][2] = lo ? kvfn_load2(lo + d + 8) : 0u;
    a[kc][3] = hi ? kvfn_load2(hi + d + 8) : 0u;
  }
}

// S (16 rows x TILE) += A B^T over a staged tile of TILE rows of D: n-tile j holds tile rows
// 8j..8j+7; lane (g, t) holds rows g, g + 8 at columns 2t, 2t + 1. Chunk c of staged row r sits
// at c ^ (r % 8), so the 8 rows an ldmatrix reads at one chunk sit in different banks.
template <typename T, int D, int TILE>
__device__ __forceinline__ void kvfn_tile_mma(float (&s)[TILE / 8][4],
                                              const unsigned (&a)[D / 16][4], const uint4* tile,
                                              int lane) {
  constexpr int CH = D / 8;
#pragma unroll
  for (int j = 0; j < TILE / 8; ++j) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      s[j][i] = 0.f;
    }
  }
  const int rk = 8 * (lane / 16) + lane % 8;  // matrices: (rows 0-7, 8-15) x (chunk 2kc, 2kc + 1)
#pragma unroll
  for (int kc = 0; kc < D / 16; ++kc) {
    const int c = 2 * kc + (lane / 8) % 2;
#pragma unroll
    for (int p = 0; p < TILE / 16; ++p) {
      unsigned b[4];
      ldmatrix4(b, tile + (16 * p + rk) * CH + (c ^ (rk & 7)));
      KvfnMma16816<T>::run(s[2 * p], a[kc], b[0], b[1]);
      KvfnMma16816<T>::run(s[2 * p + 1], a[kc], b[2], b[3]);
    }
  }
}
"""

# One block a (sequence, KV head) x 16 W query rows; row r is query r / G of query head
# h G + r % G. Keys are indexed virtually: v < s0 the sinks, then the chunk's m rows from
# `start`, then the input's own rows from `ctx` (own row j seen by query i when j <= i), staged
# TILE at a time for all the block's warps. Writes each row's log-sum-exp (base 2).
LSE_SOURCE = r"""
  constexpr int KC = D / 16;
  constexpr int CH = D / 8;
  constexpr int ROWS = 16 * W;
  constexpr int NTH = 32 * W;
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");
  static_assert(TILE * CH % NTH == 0, "whole staging steps");

  const int n = dims[0], s0 = dims[1], start = dims[2], m = dims[3], ctx = dims[4], C = dims[5];
  const int HKV = dims[6];
  const int rows = n * G;
  const int bh = blockIdx.y;
  const int b = bh / HKV, h = bh % HKV;
  const int r0 = blockIdx.x * ROWS;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int ra = r0 + warp * 16 + g, rb = ra + 8;
  const int ia = ra / G, ib = rb / G;
  const size_t heads = (size_t)b * HKV * G + h * G;
  const T* qa = ra < rows ? q + ((heads + ra % G) * n + ia) * D : nullptr;
  const T* qb = rb < rows ? q + ((heads + rb % G) * n + ib) * D : nullptr;
  unsigned a[KC][4];
  kvfn_load_rows<T, D>(a, qa, qb, t);

  const int last = (min(r0 + ROWS, rows) - 1) / G;  // the block's last query
  const int fixed = s0 + m;
  const int V = fixed + min(n, last + 1);
  const int steps = (V + TILE - 1) / TILE;
  const size_t base = (size_t)bh * C * D;
  extern __shared__ uint4 staged[];  // two steps of TILE rows

  auto stage = [&](int step) {
    uint4* tile = staged + (step & 1) * TILE * CH;
#pragma unroll
    for (int i = 0; i < TILE * CH / NTH; ++i) {
      const int x = i * NTH + threadIdx.x;
      const int r = x / CH, c = x % CH;
      const int v = step * TILE + r;
      const int slot = v < s0 ? v : v < fixed ? start + v - s0 : ctx + v - fixed;
      const bool valid = v < V;
      copy16_async(tile + r * CH + (c ^ (r & 7)), k + base + (size_t)(valid ? slot : 0) * D + 8 * c,
                   valid);
    }
    async_commit();
  };

  const float qscale = scale[0];
  float ma = neg_inf(), mb = neg_inf(), la = 0.f, lb = 0.f;
  stage(0);
  for (int it = 0; it < steps; ++it) {
    if (it + 1 < steps) {
      stage(it + 1);
    } else {
      async_commit();  // an empty group: the wait below counts alike
    }
    async_wait<1>();
    __syncthreads();
    float s[TILE / 8][4];
    kvfn_tile_mma<T, D, TILE>(s, a, staged + (it & 1) * TILE * CH, lane);
    float ta = neg_inf(), tb = neg_inf();
#pragma unroll
    for (int j = 0; j < TILE / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int v = it * TILE + 8 * j + 2 * t + (e & 1);
        const bool seen = v < V && (v < fixed || v - fixed <= (e < 2 ? ia : ib));
        s[j][e] = seen ? s[j][e] * qscale : neg_inf();
        if (e < 2) {
          ta = fmaxf(ta, s[j][e]);
        } else {
          tb = fmaxf(tb, s[j][e]);
        }
      }
    }
    ta = fmaxf(ta, __shfl_xor_sync(0xffffffffu, ta, 1));
    ta = fmaxf(ta, __shfl_xor_sync(0xffffffffu, ta, 2));
    tb = fmaxf(tb, __shfl_xor_sync(0xffffffffu, tb, 1));
    tb = fmaxf(tb, __shfl_xor_sync(0xffffffffu, tb, 2));
    const float na = fmaxf(ma, ta), nb = fmaxf(mb, tb);
    const float ua = na == neg_inf() ? 0.f : na, ub = nb == neg_inf() ? 0.f : nb;
    float sa = la * exp2f(ma - ua), sb = lb * exp2f(mb - ub);
#pragma unroll
    for (int j = 0; j < TILE / 8; ++j) {
      sa += exp2f(s[j][0] - ua) + exp2f(s[j][1] - ua);
      sb += exp2f(s[j][2] - ub) + exp2f(s[j][3] - ub);
    }
    ma = na, mb = nb, la = sa, lb = sb;
    __syncthreads();  // every warp is done with this step before it is staged over
  }
  la += __shfl_xor_sync(0xffffffffu, la, 1);
  la += __shfl_xor_sync(0xffffffffu, la, 2);
  lb += __shfl_xor_sync(0xffffffffu, lb, 1);
  lb += __shfl_xor_sync(0xffffffffu, lb, 2);
  if (t == 0) {
    if (ra < rows) {
      lse[(size_t)bh * rows + ra] = ma + log2f(la);
    }
    if (rb < rows) {
      lse[(size_t)bh * rows + rb] = mb + log2f(lb);
    }
  }
"""

# One block a (sequence, query head) x 16 W chunk rows, looping over the head's n queries
# (TILE at a time, staged for all the block's warps with their log-sum-exps): each chunk row's
# largest logit minus its query's log-sum-exp, raised to a weight once at the end. Every query
# sees every chunk row, so no mask but the queries' count.
MAX_SOURCE = r"""
  constexpr int KC = D / 16;
  constexpr int CH = D / 8;
  constexpr int KEYS = 16 * W;
  constexpr int NTH = 32 * W;
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");
  static_assert(TILE * CH % NTH == 0 && TILE <= NTH, "whole staging steps");

  const int n = dims[0], start = dims[2], m = dims[3], C = dims[5], HKV = dims[6];
  const int HQ = HKV * G;
  const int bq = blockIdx.y;
  const int b = bq / HQ, hq = bq % HQ, h = hq / G;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int ka = blockIdx.x * KEYS + warp * 16 + g, kb = ka + 8;
  const T* rows = k + ((size_t)(b * HKV + h) * C + start) * D;
  unsigned a[KC][4];
  kvfn_load_rows<T, D>(a, ka < m ? rows + (size_t)ka * D : nullptr,
                  kb < m ? rows + (size_t)kb * D : nullptr, t);

  const T* queries = q + (size_t)bq * n * D;
  const float* lses = lse + (size_t)(b * HKV + h) * n * G + hq % G;  // query i at i * G
  const int steps = (n + TILE - 1) / TILE;
  extern __shared__ uint4 staged[];  // two steps of TILE query rows, then their 2 TILE lses
  float* tile_lse = reinterpret_cast<float*>(staged + 2 * TILE * CH);

  auto stage = [&](int step) {
    uint4* tile = staged + (step & 1) * TILE * CH;
#pragma unroll
    for (int i = 0; i < TILE * CH / NTH; ++i) {
      const int x = i * NTH + threadIdx.x;
      const int r = x / CH, c = x % CH;
      const int query = step * TILE + r;
      const bool valid = query < n;
      copy16_async(tile + r * CH + (c ^ (r & 7)),
                   queries + (size_t)(valid ? query : 0) * D + 8 * c, valid);
    }
    async_commit();
    if (threadIdx.x < TILE) {
      const int query = step * TILE + threadIdx.x;
      tile_lse[(step & 1) * TILE + threadIdx.x] =
          query < n ? lses[(size_t)query * G] : __int_as_float(0x7f800000);  // +inf: no query
    }
  };

  const float qscale = scale[0];
  float best_a = neg_inf(), best_b = neg_inf();
  stage(0);
  for (int it = 0; it < steps; ++it) {
    if (it + 1 < steps) {
      stage(it + 1);
    } else {
      async_commit();
    }
    async_wait<1>();
    __syncthreads();
    float s[TILE / 8][4];
    kvfn_tile_mma<T, D, TILE>(s, a, staged + (it & 1) * TILE * CH, lane);
    const float* l = tile_lse + (it & 1) * TILE;
#pragma unroll
    for (int j = 0; j < TILE / 8; ++j) {
      const float l0 = l[8 * j + 2 * t], l1 = l[8 * j + 2 * t + 1];
      best_a = fmaxf(best_a, fmaxf(s[j][0] * qscale - l0, s[j][1] * qscale - l1));
      best_b = fmaxf(best_b, fmaxf(s[j][2] * qscale - l0, s[j][3] * qscale - l1));
    }
    __syncthreads();
  }
  best_a = fmaxf(best_a, __shfl_xor_sync(0xffffffffu, best_a, 1));
  best_a = fmaxf(best_a, __shfl_xor_sync(0xffffffffu, best_a, 2));
  best_b = fmaxf(best_b, __shfl_xor_sync(0xffffffffu, best_b, 1));
  best_b = fmaxf(best_b, __shfl_xor_sync(0xffffffffu, best_b, 2));
  if (t == 0) {
    if (ka < m) {
      out[(size_t)bq * m + ka] = exp2f(best_a);
    }
    if (kb < m) {
      out[(size_t)bq * m + kb] = exp2f(best_b);
    }
  }
"""


@contextmanager
def disabled():
    """Within it the stock ops run everywhere (to compare them with the kernels)."""
    global ENABLED
    before, ENABLED = ENABLED, False
    try:
        yield
    finally:
        ENABLED = before


def applies(queries: mx.array, keys: mx.array) -> bool:
    """Whether ``scores`` runs for these (MLX's CUDA backend, float16 or bfloat16 queries and
    keys alike, head_dim 64 or 128; ``KVFN_SCORE_KERNEL=0`` or ``disabled()`` turns it off)."""
    return (
        ENABLED
        and queries.dtype == keys.dtype
        and keys.dtype in DTYPES
        and keys.shape[-1] in DIMS
        and on_cuda()
    )


def scores(
    queries: mx.array, keys: mx.array, s0: int, start: int, end: int, context: int, scale: float
) -> mx.array:
    """``kvfn.scores.reconstruction_attention`` (its arguments checked there; ``s0`` the sinks
    seen, ``min(sink, start)``) by the two kernels: (B, n_heads, end - start) float32. Only
    where ``applies`` says so."""
    if not applies(queries, keys):
        raise RuntimeError(
            f"the reconstruction kernels do not apply to {queries.dtype} queries over "
            f"{keys.dtype} keys of head_dim {keys.shape[-1]} here: they need MLX's CUDA backend, "
            f"float16 or bfloat16, head_dim 64 or 128, and not disabled (KVFN_SCORE_KERNEL=0)"
        )
    B, n_heads, n, D = queries.shape
    n_kv, capacity = keys.shape[1], keys.shape[2]
    group, m = n_heads // n_kv, end - start
    dims = mx.array([n, s0, start, m, context, capacity, n_kv], mx.int32)
    qscale = mx.array([scale * LOG2E], mx.float32)
    template = [("T", keys.dtype), ("D", D), ("G", group), ("TILE", TILE)]
    row_blocks = -(-n * group // (16 * LSE_WARPS))
    (lse,) = _lse_kernel(D)(
        inputs=[queries, keys, dims, qscale],
        template=[*template, ("W", LSE_WARPS)],
        grid=(row_blocks * 32 * LSE_WARPS, B * n_kv, 1),
        threadgroup=(32 * LSE_WARPS, 1, 1),
        output_shapes=[(B * n_kv * n * group,)],
        output_dtypes=[mx.float32],
    )
    key_blocks = -(-m // (16 * MAX_WARPS))
    (out,) = _max_kernel(D)(
        inputs=[queries, keys, lse, dims, qscale],
        template=[*template, ("W", MAX_WARPS)],
        grid=(key_blocks * 32 * MAX_WARPS, B * n_heads, 1),
        threadgroup=(32 * MAX_WARPS, 1, 1),
        output_shapes=[(B, n_heads, m)],
        output_dtypes=[mx.float32],
    )
    return out


def staged_bytes(dim: int, lses: bool = False) -> int:
    """Shared memory a block stages in: two steps of ``TILE`` rows of ``dim`` 2-byte elements
    (and, for the maximum kernel, their log-sum-exps)."""
    return 2 * TILE * dim * 2 + (2 * TILE * 4 if lses else 0)


@lru_cache(maxsize=None)
def _lse_kernel(dim: int):
    return cuda_kernel("kvfn_reconstruction_lse", ["q", "k", "dims", "scale"], ["lse"],
                       LSE_SOURCE, HEADER, shared_memory=staged_bytes(dim))  # fmt: skip


@lru_cache(maxsize=None)
def _max_kernel(dim: int):
    return cuda_kernel("kvfn_reconstruction_max", ["q", "k", "lse", "dims", "scale"], ["out"],
                       MAX_SOURCE, HEADER, shared_memory=staged_bytes(dim, lses=True))  # fmt: skip


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

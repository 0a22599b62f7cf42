
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

template <typename T, int N>
__device__ __forceinline__ void unpack(const uint4& raw, float (&out)[N]) {
  static_assert(sizeof(T) * N == 16, "one 16-byte vector per lane");
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < N; ++i) {
    out[i] = static_cast<float>(e[i]);
  }
}

template <typename T, int U, int D>
__device__ __forceinline__ void load_rows(
    const T* k, const T* v, size_t base, int j0, int stop, uint4 (&kr)[U], uint4 (&vr)[U]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    kr[u] = make_uint4(0, 0, 0, 0);
    vr[u] = make_uint4(0, 0, 0, 0);
    if (j0 + u < stop) {
      kr[u] = *reinterpret_cast<const uint4*>(k + base + (size_t)(j0 + u) * D);
      vr[u] = *reinterpret_cast<const uint4*>(v + base + (size_t)(j0 + u) * D);
    }
  }
}

// Copies 16 bytes global -> shared without registers (cp.async, L2 only); not `valid`: zeros.
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

// Stage `slot` of this thread's rows [j0, j0 + U) (K then V, 16 bytes each): the rows it reads
// later, so only its own cp.async groups need waiting for. Rows at or past `stop` are zeros.
template <typename T, int U, int D, int NTH>
__device__ __forceinline__ void stage_rows(
    uint4* staged, int slot, const T* k, const T* v, size_t base, int j0, int stop) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const bool valid = j0 + u < stop;
    const size_t at = base + (size_t)(valid ? j0 + u : 0) * D;
    copy16_async(staged + (slot * 2 * U + u) * NTH + threadIdx.x, k + at, valid);
    copy16_async(staged + (slot * 2 * U + U + u) * NTH + threadIdx.x, v + at, valid);
  }
}

// Split `split` of query heads [head0, head0 + G): the block's W warps' online-softmax states
// (in shared memory: m, l W x G, acc W x G x D) merged into its output in o_part's type (the
// partial output in float, or with one split the attention's in T) and its log-sum-exp.
template <int W, int G, int D, typename O>
__device__ __forceinline__ void write_split(const float* sm_m, const float* sm_l,
                                            const float* sm_acc, O* o_part, float* lse,
                                            int head0, int split, int NS) {
  for (int x = threadIdx.x; x < G * D; x += W * 32) {
    const int g = x / D;
    const int d = x % D;
    float mm = neg_inf();
#pragma unroll
    for (int w = 0; w < W; ++w) {
      mm = fmaxf(mm, sm_m[w * G + g]);
    }
    float ll = 0.f;
    float aa = 0.f;
    if (mm != neg_inf()) {
#pragma unroll
      for (int w = 0; w < W; ++w) {
        const float c = exp2f(sm_m[w * G + g] - mm);
        ll += sm_l[w * G + g] * c;
        aa += sm_acc[(w * G + g) * D + d] * c;
      }
    }
    const size_t at = (size_t)(head0 + g) * NS + split;
    o_part[at * D + d] = static_cast<O>(ll > 0.f ? aa / ll : 0.f);
    if (d == 0) {
      lse[at] = ll > 0.f ? mm + log2f(ll) : neg_inf();
    }
  }
}

// Merges a second online-softmax state (m2, l2, acc2) into (m, l, acc); exponents are base 2.
template <int N>
__device__ __forceinline__ void merge(
    float& m, float& l, float (&acc)[N], float m2, float l2, const float (&acc2)[N]) {
  const float mn = fmaxf(m, m2);
  if (mn == neg_inf()) {
    return;
  }
  const float c1 = exp2f(m - mn);
  const float c2 = exp2f(m2 - mn);
  l = l * c1 + l2 * c2;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    acc[i] = acc[i] * c1 + acc2[i] * c2;
  }
  m = mn;
}

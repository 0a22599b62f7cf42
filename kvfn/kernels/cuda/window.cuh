
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

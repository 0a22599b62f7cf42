
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

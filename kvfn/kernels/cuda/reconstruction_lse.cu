
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

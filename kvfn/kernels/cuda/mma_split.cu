
  constexpr int KC = D / 16;
  constexpr int NTL = D / 8;
  constexpr int CH = D / 8;  // 16-byte chunks a row
  constexpr int STEP = W * 16;
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");
  static_assert(G <= 8, "at most 8 query heads a block");
  static_assert(ST >= 1, "at least one staged step");

  const int split = blockIdx.x;
  const int row = blockIdx.y;
  const int bh = row / NT;
  const int head0 = bh * GT + (row % NT) * G;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;
  const int t = lane % 4;

  const int NS = gridDim.x;
  const int C = dims[0];
  const int len = min(max(lengths[(bh / HKV) * LSB + (bh % HKV) * LSH], 0), C);
  int chunk = (len + NS - 1) / NS;
  chunk = (chunk + STEP - 1) / STEP * STEP;
  const int start = min(split * chunk, len);
  const int stop = min(start + chunk, len);
  const size_t base = (size_t)bh * C * D;
  const float qscale = scale[0];

  // Row g of the A operand: query head head0 + g (rows G..7 zero).
  const T* qrow = q + (size_t)(head0 + min(g, G - 1)) * D;
  unsigned qa[KC][2];
#pragma unroll
  for (int kc = 0; kc < KC; ++kc) {
    const T* at = qrow + 16 * kc + 2 * t;
    qa[kc][0] = g < G ? *reinterpret_cast<const unsigned*>(at) : 0u;
    qa[kc][1] = g < G ? *reinterpret_cast<const unsigned*>(at + 8) : 0u;
  }

  float m = neg_inf();
  float l = 0.f;
  float acc[NTL][4];
#pragma unroll
  for (int n = 0; n < NTL; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      acc[n][i] = 0.f;
    }
  }

  // ST steps of W warps' 16 whole K and 16 V rows (SLOT 16-byte chunks a step)
  constexpr int SLOT = W * 32 * CH;
  extern __shared__ uint4 staged[];
  uint4* const own = staged + warp * 32 * CH;
  for (int p = 0; p + 1 < ST; ++p) {
    stage_whole_rows<T, D>(own + p * SLOT, k, v, base, start + p * STEP + warp * 16, stop, lane);
    async_commit();
  }
  for (int s0 = start, it = 0; s0 < stop; s0 += STEP, ++it) {
    const int kb = s0 + warp * 16;
    __syncwarp();  // every lane is done reading the slot staged next
    stage_whole_rows<T, D>(own + ((it + ST - 1) % ST) * SLOT, k, v, base,
                           kb + (ST - 1) * STEP, stop, lane);
    async_commit();
    async_wait<ST - 1>();
    __syncwarp();  // the other lanes' copies are visible
    const uint4* tile = own + (it % ST) * SLOT;  // the warp's rows

    // S (16 heads x 16 keys) in two tiles of 8 keys: lane (g, t) holds keys kb + 8h + 2t, +1.
    float s[2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        s[h][i] = 0.f;
      }
    }
    const int rk = 8 * (lane / 16) + lane % 8;  // matrices: (keys 0-7, 8-15) x (2 kc, 2 kc + 1)
#pragma unroll
    for (int kc = 0; kc < KC; ++kc) {
      const int c = 2 * kc + (lane / 8) % 2;
      unsigned b[4];
      ldmatrix4<false>(b, tile + rk * CH + (c ^ (rk & 7)));
      Mma<T>::run(s[0], qa[kc][0], qa[kc][1], b[0], b[1]);
      Mma<T>::run(s[1], qa[kc][0], qa[kc][1], b[2], b[3]);
    }
    float sv[4] = {s[0][0], s[0][1], s[1][0], s[1][1]};
    float mx = neg_inf();
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int key = kb + 2 * t + (i & 1) + 8 * (i >> 1);
      sv[i] = key < stop ? sv[i] * qscale : neg_inf();
      mx = fmaxf(mx, sv[i]);
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float mn = fmaxf(m, mx);
    const float corr = mn == neg_inf() ? 1.f : exp2f(m - mn);
    float p[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      p[i] = sv[i] == neg_inf() ? 0.f : exp2f(sv[i] - mn);
    }
    l = l * corr + (p[0] + p[1]) + (p[2] + p[3]);
    m = mn;
    const unsigned pa0 = Mma<T>::pack(p[0], p[1]);
    const unsigned pa2 = Mma<T>::pack(p[2], p[3]);
#pragma unroll
    for (int n = 0; n < NTL; ++n) {
      acc[n][0] *= corr;
      acc[n][1] *= corr;
    }

    // O (16 heads x D) += P V; n-tile n holds dims 8n + column.
    const int rv = 8 * ((lane / 8) % 2) + lane % 8;  // matrices: (keys 0-7, 8-15) x (n, n + 1)
#pragma unroll
    for (int n = 0; n < NTL; n += 2) {
      const int c = n + lane / 16;
      unsigned b[4];
      ldmatrix4<true>(b, tile + (16 + rv) * CH + (c ^ (rv & 7)));
      Mma<T>::run(acc[n], pa0, pa2, b[0], b[1]);
      Mma<T>::run(acc[n + 1], pa0, pa2, b[2], b[3]);
    }
  }
  async_wait<0>();
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);

  // Merge the warps through the staging memory (every warp is done reading it).
  __syncthreads();
  float* sm_m = reinterpret_cast<float*>(staged);
  float* sm_l = sm_m + W * G;
  float* sm_acc = sm_l + W * G;
  if (g < G) {
#pragma unroll
    for (int n = 0; n < NTL; ++n) {
      sm_acc[(warp * G + g) * D + 8 * n + 2 * t] = acc[n][0];
      sm_acc[(warp * G + g) * D + 8 * n + 2 * t + 1] = acc[n][1];
    }
    if (t == 0) {
      sm_m[warp * G + g] = m;
      sm_l[warp * G + g] = l;
    }
  }
  __syncthreads();
  write_split<W, G, D>(sm_m, sm_l, sm_acc, o_part, lse, head0, split, NS);


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

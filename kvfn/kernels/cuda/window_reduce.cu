
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

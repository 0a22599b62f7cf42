
  constexpr int EPT = 16 / sizeof(T);
  constexpr int LPK = D / EPT;
  constexpr int KPW = 32 / LPK;
  constexpr int STEP = W * KPW * U;
  static_assert(LPK * EPT == D && LPK <= 32 && 32 % LPK == 0, "unsupported head_dim");

  __shared__ float sm_m[W][G];
  __shared__ float sm_l[W][G];
  __shared__ float sm_acc[W][G][D];

  const int split = blockIdx.x;
  const int row = blockIdx.y;
  const int bh = row / NT;
  const int head0 = bh * GT + (row % NT) * G;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int part = lane % LPK;
  const int group = warp * KPW + lane / LPK;

  const int NS = gridDim.x;
  const int C = dims[0];
  const int len = min(max(lengths[(bh / HKV) * LSB + (bh % HKV) * LSH], 0), C);
  int chunk = (len + NS - 1) / NS;
  chunk = (chunk + STEP - 1) / STEP * STEP;
  const int start = min(split * chunk, len);
  const int stop = min(start + chunk, len);

  const float qscale = scale[0];
  float qf[G][EPT];
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int e = 0; e < EPT; ++e) {
      qf[g][e] = static_cast<float>(q[(size_t)(head0 + g) * D + part * EPT + e]) * qscale;
    }
  }

  float m[G];
  float l[G];
  float acc[G][EPT];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = neg_inf();
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < EPT; ++e) {
      acc[g][e] = 0.f;
    }
  }

  const size_t base = (size_t)bh * C * D + part * EPT;
  extern __shared__ uint4 staged[];  // ST steps of this thread's K/V rows (ST > 0)
  uint4 kraw[U];
  uint4 vraw[U];
  if (ST > 0) {
    for (int p = 0; p + 1 < ST; ++p) {
      stage_rows<T, U, D, W * 32>(staged, p, k, v, base, start + p * STEP + group * U, stop);
      async_commit();
    }
  } else if (P) {
    load_rows<T, U, D>(k, v, base, start + group * U, stop, kraw, vraw);
  }
  for (int s0 = start, it = 0; s0 < stop; s0 += STEP, ++it) {
    const int j0 = s0 + group * U;
    uint4 knext[U];
    uint4 vnext[U];
    if (ST > 0) {
      stage_rows<T, U, D, W * 32>(staged, (it + ST - 1) % ST, k, v, base,
                                  j0 + (ST - 1) * STEP, stop);
      async_commit();
      async_wait<(ST > 1 ? ST - 1 : 0)>();
      const uint4* mine = staged + (it % ST) * 2 * U * W * 32 + threadIdx.x;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        kraw[u] = mine[u * W * 32];
        vraw[u] = mine[(U + u) * W * 32];
      }
    } else if (P) {
      load_rows<T, U, D>(k, v, base, j0 + STEP, stop, knext, vnext);
    } else {
      load_rows<T, U, D>(k, v, base, j0, stop, kraw, vraw);
    }
    float s[U][G];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[EPT];
      unpack<T>(kraw[u], kf);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < EPT; ++e) {
          dot += qf[g][e] * kf[e];
        }
        s[u][g] = dot;
      }
    }
#pragma unroll
    for (int off = LPK / 2; off > 0; off /= 2) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
          s[u][g] += __shfl_xor_sync(0xffffffffu, s[u][g], off);
        }
      }
    }
    float vf[U][EPT];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      unpack<T>(vraw[u], vf[u]);
      if (j0 + u >= stop) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
          s[u][g] = neg_inf();
        }
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float mn = m[g];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        mn = fmaxf(mn, s[u][g]);
      }
      if (mn == neg_inf()) {
        continue;
      }
      const float corr = exp2f(m[g] - mn);
      l[g] *= corr;
#pragma unroll
      for (int e = 0; e < EPT; ++e) {
        acc[g][e] *= corr;
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float p = exp2f(s[u][g] - mn);
        l[g] += p;
#pragma unroll
        for (int e = 0; e < EPT; ++e) {
          acc[g][e] += p * vf[u][e];
        }
      }
      m[g] = mn;
    }
    if (ST == 0 && P) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        kraw[u] = knext[u];
        vraw[u] = vnext[u];
      }
    }
  }
  if (ST > 0) {
    async_wait<0>();  // no copy may land in shared memory after the block exits
  }

  // Merge the key groups of a warp (lanes LPK apart), then the warps through shared memory.
#pragma unroll
  for (int off = LPK; off < 32; off *= 2) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m[g], off);
      const float l2 = __shfl_xor_sync(0xffffffffu, l[g], off);
      float acc2[EPT];
#pragma unroll
      for (int e = 0; e < EPT; ++e) {
        acc2[e] = __shfl_xor_sync(0xffffffffu, acc[g][e], off);
      }
      merge<EPT>(m[g], l[g], acc[g], m2, l2, acc2);
    }
  }
  if (lane < LPK) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
      for (int e = 0; e < EPT; ++e) {
        sm_acc[warp][g][part * EPT + e] = acc[g][e];
      }
      if (lane == 0) {
        sm_m[warp][g] = m[g];
        sm_l[warp][g] = l[g];
      }
    }
  }
  __syncthreads();
  write_split<W, G, D>(&sm_m[0][0], &sm_l[0][0], &sm_acc[0][0][0], o_part, lse, head0, split, NS);

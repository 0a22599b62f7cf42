
  const int NS = dims[0];
  const int r = blockIdx.x;
  const int d = threadIdx.x;
  float mm = neg_inf();
  for (int s = 0; s < NS; ++s) {
    mm = fmaxf(mm, lse[r * NS + s]);
  }
  float ll = 0.f;
  float aa = 0.f;
  if (mm != neg_inf()) {
    for (int s = 0; s < NS; ++s) {
      const float c = exp2f(lse[r * NS + s] - mm);
      ll += c;
      aa += c * o_part[((size_t)r * NS + s) * D + d];
    }
  }
  out[(size_t)r * D + d] = static_cast<T>(ll > 0.f ? aa / ll : 0.f);

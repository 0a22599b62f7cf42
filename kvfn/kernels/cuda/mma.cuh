
template <typename T>
struct Mma;

// Mma<T>::pack: a float pair as two T (lo first); Mma<T>::run: d += A B on tensor cores
// (m16n8k16, float32 accumulators), A's rows 8-15 zero (a1 = a3 = 0). One specialization a
// dtype: the type, its pair type and conversion, its PTX name.
#define KVFN_MMA(TYPE, PAIR, TO_PAIR, PTX)                                                 \
  template <>                                                                             \
  struct Mma<TYPE> {                                                                      \
    static __device__ __forceinline__ unsigned pack(float lo, float hi) {                 \
      PAIR h = TO_PAIR(lo, hi);                                                            \
      return *reinterpret_cast<unsigned*>(&h);                                            \
    }                                                                                     \
    static __device__ __forceinline__ void run(                                           \
        float (&d)[4], unsigned a0, unsigned a2, unsigned b0, unsigned b1) {              \
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX "." PTX ".f32 "           \
                   "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"    \
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                       \
                   : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));               \
    }                                                                                     \
  };
KVFN_MMA(__nv_bfloat16, __nv_bfloat162, __floats2bfloat162_rn, "bf16")
KVFN_MMA(__half, __half2, __floats2half2_rn, "f16")
#undef KVFN_MMA

// Four 8x8 16-bit matrices from shared memory, lane i giving row i % 8 of matrix i / 8;
// `trans` delivers each transposed (lane (g, t) gets column g, rows 2t and 2t + 1).
template <bool TRANS>
__device__ __forceinline__ void ldmatrix4(unsigned (&r)[4], const uint4* row) {
  const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if (TRANS) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at));
  }
}

// Stage a warp's 16 K rows then 16 V rows [kb, kb + 16) whole: each instruction copies two
// 256-byte rows (D = 128); 16-byte chunk c of row r lands at c ^ (r % 8), so the 8 rows an
// ldmatrix reads at one chunk sit in different banks. Keys at or past `stop` are zeros.
template <typename T, int D>
__device__ __forceinline__ void stage_whole_rows(
    uint4* tile, const T* k, const T* v, size_t base, int kb, int stop, int lane) {
  constexpr int CH = D / 8;
  // a loop: unrolled, ptxas keeps every copy's addresses across the whole step (177 registers
  // at D = 128, two blocks an SM; 141 so)
#pragma unroll 1
  for (int i = 0; i < 16 * CH / 32; ++i) {
    const int x = i * 32 + lane;
    const int r = x / CH;
    const int c = x % CH;
    const bool valid = kb + r < stop;
    const size_t at = base + (size_t)(valid ? kb + r : 0) * D + 8 * c;
    copy16_async(tile + r * CH + (c ^ (r & 7)), k + at, valid);
    copy16_async(tile + (16 + r) * CH + (c ^ (r & 7)), v + at, valid);
  }
}

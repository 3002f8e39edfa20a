// AVX-512 target: a 12 x 32 f32 register tile (24 accumulators, 2 B vectors and one
// broadcast of the 32 zmm registers). Reached via dispatch only, on CPUs with AVX-512.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "cpu/formats/format_kernels.h"
#include "gemm_kernels.h"

namespace moekit::detail {
namespace {

#include "gemm_decode.inc"
#include "fused_avx2.inc"

struct G {
  static constexpr int N = 16, MR = 12, NV = 2;
  using F = __m512;
  static F zero() { return _mm512_setzero_ps(); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static F bcast(float x) { return _mm512_set1_ps(x); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }

  // 16 x 16 transpose as four 8 x 8 ones.
  static void transpose_block(const float* src, int64_t lds, float* dst, int64_t ldd) {
    for (int r = 0; r < 16; r += 8)
      for (int c = 0; c < 16; c += 8) transpose8(src + r * lds + c, lds, dst + c * ldd + r, ldd);
  }

#include "decode_avx2.inc"
};

#include "gemm_simd.inc"

}  // namespace

const GemmKernels& gemm_kernels_avx512() { return kernels_table(); }

}  // namespace moekit::detail

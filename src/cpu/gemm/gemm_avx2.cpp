// AVX2 + FMA target: a 6 x 16 f32 register tile (12 accumulators, 2 B vectors and one
// broadcast of the 16 ymm registers). Compiled with -mavx2 -mfma; reached via dispatch only.
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
  static constexpr int N = 8, MR = 6, NV = 2;
  using F = __m256;
  static F zero() { return _mm256_setzero_ps(); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F bcast(float x) { return _mm256_set1_ps(x); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }

  static void transpose_block(const float* src, int64_t lds, float* dst, int64_t ldd) {
    transpose8(src, lds, dst, ldd);
  }

#include "decode_avx2.inc"
};

#include "gemm_simd.inc"

}  // namespace

const GemmKernels& gemm_kernels_avx2() { return kernels_table(); }

}  // namespace moekit::detail

// AVX2 + FMA target: a 6 x 16 f32 register tile (12 accumulators, 2 B vectors and one
// broadcast of the 16 ymm registers). Compiled with -mavx2 -mfma; reached via dispatch only.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <limits>
#include <utility>

#include "cpu/formats/format_kernels.h"
#include "gemm_kernels.h"

namespace moekit::detail {
namespace {

struct G {
  static constexpr int N = 8, MR = 6, NV = 2;
  using F = __m256;
  static F zero() { return _mm256_setzero_ps(); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F bcast(float x) { return _mm256_set1_ps(x); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
};

#include "gemm_simd.inc"

}  // namespace

const GemmKernels& gemm_kernels_avx2() { return kernels_table(); }

}  // namespace moekit::detail

// AVX-512 target: a 12 x 32 f32 register tile (24 accumulators, 2 B vectors and one
// broadcast of the 32 zmm registers). Reached via dispatch only, on CPUs with AVX-512.
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
  static constexpr int N = 16, MR = 12, NV = 2;
  using F = __m512;
  static F zero() { return _mm512_setzero_ps(); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static F bcast(float x) { return _mm512_set1_ps(x); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
};

#include "gemm_simd.inc"

}  // namespace

const GemmKernels& gemm_kernels_avx512() { return kernels_table(); }

}  // namespace moekit::detail

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

  // 8-lane vectors of the small-M path (ymm on every x86 target, so lanes match).
  using F8 = __m256;
  static F8 load8(const float* p) { return _mm256_loadu_ps(p); }
  static void store8(float* p, F8 x) { _mm256_storeu_ps(p, x); }
  static F8 bcast8(float x) { return _mm256_set1_ps(x); }
  static F8 fma8(F8 a, F8 b, F8 c) { return _mm256_fmadd_ps(a, b, c); }
  // ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), as the portable target.
  static float reduce8(const float* l) {
    const __m256 v = _mm256_loadu_ps(l);
    const __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 u = _mm_add_ps(t, _mm_movehl_ps(t, t));
    return _mm_cvtss_f32(_mm_add_ss(u, _mm_shuffle_ps(u, u, 1)));
  }
  // 8 x 8 transpose: dst[c * ldd + r] = src[r * lds + c].
  static void transpose8(const float* src, int64_t lds, float* dst, int64_t ldd) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
    for (int i = 0; i < 8; i += 2) {
      t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
      r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
      r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
      r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
      r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; ++i) {
      _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
      _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
  }
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

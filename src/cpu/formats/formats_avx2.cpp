// AVX2 target (8 lanes). Compiled with -mavx2 -mfma -mf16c; only reached via dispatch.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "format_kernels.h"

namespace moekit::detail {
namespace {

struct V {
  static constexpr int N = 8;
  using F = __m256;
  using I = __m256i;
  using M = __m256i;

  static I bits(F x) { return _mm256_castps_si256(x); }
  static F from_bits(I x) { return _mm256_castsi256_ps(x); }
  static I seti(int32_t x) { return _mm256_set1_epi32(x); }
  static F set(float x) { return _mm256_set1_ps(x); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I min(I a, I b) { return _mm256_min_epi32(a, b); }
  template <int k> static I shr(I a) { return _mm256_srli_epi32(a, k); }
  template <int k> static I shl(I a) { return _mm256_slli_epi32(a, k); }
  static M lt(I a, I b) { return _mm256_cmpgt_epi32(b, a); }
  static M gt(I a, I b) { return _mm256_cmpgt_epi32(a, b); }
  static M eq(I a, I b) { return _mm256_cmpeq_epi32(a, b); }
  static I select(M m, I a, I b) { return _mm256_blendv_epi8(b, a, m); }

  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(b, a); }  // NaN rule as the scalar target
  static F abs(F a) { return from_bits(and_(bits(a), seti(0x7fffffff))); }
  static F to_float(I a) { return _mm256_cvtepi32_ps(a); }
  static float hmax(F a) {
    alignas(32) float t[8];
    _mm256_store_ps(t, a);
    float m = t[0];
    for (int i = 1; i < 8; ++i) m = t[i] > m ? t[i] : m;
    return m;
  }

  static F load_f32(const float* p) { return _mm256_loadu_ps(p); }
  static void store_f32(float* p, F a) { _mm256_storeu_ps(p, a); }
  static I load_u16(const uint16_t* p) { return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static void store_u16(uint16_t* p, I a) {
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, a), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static I load_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static void store_u8(uint8_t* p, I a) {
    const __m256i w = _mm256_packus_epi16(_mm256_packus_epi32(a, a), _mm256_setzero_si256());
    const __m128i lo = _mm256_castsi256_si128(w), hi = _mm256_extracti128_si256(w, 1);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_unpacklo_epi32(lo, hi));
  }
  static I load_nibble_pairs(const uint8_t* p) {
    int32_t word;
    std::memcpy(&word, p, 4);
    const __m256i b = _mm256_cvtepu8_epi64(_mm_cvtsi32_si128(word));
    const __m256i lo = _mm256_and_si256(b, _mm256_set1_epi64x(0xf));
    const __m256i hi = _mm256_slli_epi64(_mm256_srli_epi64(b, 4), 32);
    return _mm256_or_si256(lo, hi);
  }
  static void store_nibble_pairs(uint8_t* p, I a) {
    const __m256i m = _mm256_and_si256(a, _mm256_set1_epi32(0xf));
    const __m256i pairs = _mm256_or_si256(m, _mm256_slli_epi64(_mm256_srli_epi64(m, 32), 4));
    const __m256i bytes = _mm256_shuffle_epi8(
        pairs, _mm256_setr_epi8(0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
    const uint16_t lo = static_cast<uint16_t>(_mm256_extract_epi16(bytes, 0));
    const uint16_t hi = static_cast<uint16_t>(_mm256_extract_epi16(bytes, 8));
    std::memcpy(p, &lo, 2);
    std::memcpy(p + 2, &hi, 2);
  }
};

#include "formats_simd.inc"

}  // namespace

const FormatKernels& format_kernels_avx2() { return make_table(); }

}  // namespace moekit::detail

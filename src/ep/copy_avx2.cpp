#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "ep/copy.h"

namespace moekit::ep::detail {

namespace {

inline __m256 load_bf16x8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// f32 -> bf16 bits in the low half of each lane: round to nearest even; NaN -> quiet NaN.
inline __m256i round_bf16x8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, quiet, nan);
}

inline __m256 sum8(const uint16_t* const* rows, int n, const uint16_t* b0, const uint16_t* b1, int64_t i) {
  __m256 acc = n > 0 ? load_bf16x8(rows[0] + i) : _mm256_setzero_ps();
  for (int r = 1; r < n; ++r) acc = _mm256_add_ps(acc, load_bf16x8(rows[r] + i));
  if (b0) acc = _mm256_add_ps(acc, load_bf16x8(b0 + i));
  if (b1) acc = _mm256_add_ps(acc, load_bf16x8(b1 + i));
  return acc;
}

}  // namespace

// Rounds without the NaN fix-up (the caller checked there is no NaN).
inline __m256i round_bf16x8_finite(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb), 16);
}

void reduce_rows_bf16_avx2(uint16_t* out, const uint16_t* const* rows, int n, const uint16_t* bias_0,
                           const uint16_t* bias_1, int64_t hidden, RowsAhead ahead) {
  // Rows of the combined output are not read again soon: stream them past the cache.
  const bool stream = hidden >= 512 && (reinterpret_cast<uintptr_t>(out) & 31) == 0;
  int64_t i = 0;
  for (; i + 16 <= hidden; i += 16) {
    if (i % 32 == 0) ahead.request(i);
    const __m256 a = sum8(rows, n, bias_0, bias_1, i), b = sum8(rows, n, bias_0, bias_1, i + 8);
    const bool nan = _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q)) != 0;
    const __m256i lo = nan ? round_bf16x8(a) : round_bf16x8_finite(a);
    const __m256i hi = nan ? round_bf16x8(b) : round_bf16x8_finite(b);
    // packus interleaves 128-bit lanes; the permute restores element order.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
    if (stream) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(out + i), packed);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), packed);
    }
  }
  reduce_rows_bf16_scalar(out, rows, n, bias_0, bias_1, i, hidden);
}

void reduce_weighted_rows_bf16_avx2(uint16_t* out, const uint16_t* const* rows, const float* weights, int n,
                                    int64_t hidden, RowsAhead ahead) {
  int64_t i = 0;
  for (; i + 16 <= hidden; i += 16) {
    if (i % 32 == 0) ahead.request(i);
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int r = 0; r < n; ++r) {
      const __m256 w = _mm256_set1_ps(weights[r]);
      lo = _mm256_fmadd_ps(w, load_bf16x8(rows[r] + i), lo);
      hi = _mm256_fmadd_ps(w, load_bf16x8(rows[r] + i + 8), hi);
    }
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(round_bf16x8(lo), round_bf16x8(hi)), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), packed);
  }
  reduce_weighted_rows_bf16_scalar(out, rows, weights, n, i, hidden);
}

}  // namespace moekit::ep::detail

// AVX-512 targets of the EP row reductions (copy.h); only reached through runtime dispatch.
// 32 bf16 lanes per step, kept as pairs: a dword of the input holds elements 2i (low word)
// and 2i + 1 (high word), so the even ones widen by a shift and the odd ones by a mask, and
// the rounded sums go back by one shift and a word blend; no lane shuffles at all. The AVX2
// path shuffles twice per 16 elements on the way in and twice on the way out.
#include <immintrin.h>

#include <cstdint>

#include "ep/copy.h"

namespace moekit::ep::detail {

namespace {

struct Lanes {
  __m512 even, odd;
};

inline Lanes load_pairs(const uint16_t* p, __mmask32 live) {
  const __m512i v = _mm512_maskz_loadu_epi16(live, p);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),
          _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u))))};
}

// The bf16 pattern of v, rounded to nearest even, in the high word of each lane (NaN: quiet,
// as f32_to_bf16 makes it); the low word is left over.
inline __m512i round_high(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_or_epi32(rounded, nan, bits, _mm512_set1_epi32(0x00400000));
}

inline __m512i pack(const Lanes& sum) {
  return _mm512_mask_blend_epi16(0xaaaaaaaau, _mm512_srli_epi32(round_high(sum.even), 16), round_high(sum.odd));
}

inline void store(uint16_t* out, __m512i v, __mmask32 live, bool stream) {
  if (stream) _mm512_stream_si512(reinterpret_cast<__m512i*>(out), v);
  else _mm512_mask_storeu_epi16(out, live, v);
}

inline __mmask32 live_lanes(int64_t left) { return left >= 32 ? ~__mmask32{0} : (__mmask32{1} << left) - 1; }

}  // namespace

void reduce_rows_bf16_avx512(uint16_t* out, const uint16_t* const* rows, int n, const uint16_t* bias_0,
                             const uint16_t* bias_1, int64_t hidden, RowsAhead ahead) {
  // Rows of the combined output are not read again soon: stream them past the cache.
  const bool aligned = hidden >= 512 && (reinterpret_cast<uintptr_t>(out) & 63) == 0;
  for (int64_t i = 0; i < hidden; i += 32) {
    ahead.request(i);
    const __mmask32 live = live_lanes(hidden - i);
    // f32 sums in the portable path's order: rows[0] itself, or 0 when there is none.
    Lanes acc = n > 0 ? load_pairs(rows[0] + i, live) : Lanes{_mm512_setzero_ps(), _mm512_setzero_ps()};
    auto add = [&](const uint16_t* row) {
      const Lanes v = load_pairs(row + i, live);
      acc = {_mm512_add_ps(acc.even, v.even), _mm512_add_ps(acc.odd, v.odd)};
    };
    for (int r = 1; r < n; ++r) add(rows[r]);
    if (bias_0) add(bias_0);
    if (bias_1) add(bias_1);
    store(out + i, pack(acc), live, aligned && live == ~__mmask32{0});
  }
}

void reduce_weighted_rows_bf16_avx512(uint16_t* out, const uint16_t* const* rows, const float* weights, int n,
                                      int64_t hidden, RowsAhead ahead) {
  for (int64_t i = 0; i < hidden; i += 32) {
    ahead.request(i);
    const __mmask32 live = live_lanes(hidden - i);
    Lanes acc{_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int r = 0; r < n; ++r) {
      const __m512 w = _mm512_set1_ps(weights[r]);
      const Lanes v = load_pairs(rows[r] + i, live);
      acc = {_mm512_fmadd_ps(w, v.even, acc.even), _mm512_fmadd_ps(w, v.odd, acc.odd)};
    }
    store(out + i, pack(acc), live, false);
  }
}

}  // namespace moekit::ep::detail

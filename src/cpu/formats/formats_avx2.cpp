// AVX2 target (8 lanes). Compiled with -mavx2 -mfma -mf16c; only reached via dispatch.
#include <immintrin.h>

#include <array>
#include <bit>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "../../core/check.h"  // ceil_div
#include "format_kernels.h"

namespace moekit::detail {
namespace {

// ---- bf16 -> e4m3 codes on byte lanes (per-scale staircases; see "per-block bf16 -> e4m3
// casts through per-scale thresholds" below) ----
// Lanes of 32 bf16 values (v0: elements 0-15, v1: 16-31) under scales sf = 2^k·f, with d0 /
// d1 the lanes' D = C - 8·k (C: the staircase's base, below). P = |x|'s pattern - k << 7 is the
// pattern of |x| / 2^k, and a normal code is 8·(P >> 7) + C + (the staircase at P & 127), where
// 8·(P >> 7) + C = 8·(|x|'s exponent field) + D and P & 127 = |x| & 127. All bytes in packs
// order: elements 0-7, 16-23, 8-15, 24-31 in the four qwords (e4m3_finish restores element
// order).
// top: 8·(|x| >> 7) + D, saturated to int8; mantissa: |x| & 127; sign: x's sign in bit 7.
// band: lane-wise unsigned min of top + 32 (bytes). With C in [-968, -960] (the base code of
// the probes 2^(3+k)·(1 + m/128) is 72 to 80), top < -32 means P < 117 << 7: quotients below
// 2^-11, code 0 (top plus the staircase, at most 9, stays negative and is clamped to 0); top
// >= 16 means P >= 122 << 7: quotients above 2^-6, normal. Lanes between, with top + 32 below
// 48 (band_hit), are (or may be) near the e4m3 subnormals and go to the general kernel.
struct E4m3Lanes {
  __m256i top, mantissa, sign;
};
inline E4m3Lanes e4m3_lanes(__m256i v0, __m256i v1, __m256i d0, __m256i d1, __m256i& band) {
  const __m256i magnitude = _mm256_set1_epi16(0x7fff), exponent8 = _mm256_set1_epi16(0x7ff8), low7 = _mm256_set1_epi16(0x7f);
  const __m256i a0 = _mm256_and_si256(v0, magnitude), a1 = _mm256_and_si256(v1, magnitude);
  const __m256i top = _mm256_packs_epi16(_mm256_add_epi16(_mm256_and_si256(_mm256_srli_epi16(a0, 4), exponent8), d0),
                                         _mm256_add_epi16(_mm256_and_si256(_mm256_srli_epi16(a1, 4), exponent8), d1));
  band = _mm256_min_epu8(band, _mm256_add_epi8(top, _mm256_set1_epi8(32)));
  return {top, _mm256_packus_epi16(_mm256_and_si256(a0, low7), _mm256_and_si256(a1, low7)),
          _mm256_and_si256(_mm256_packs_epi16(v0, v1), _mm256_set1_epi8(static_cast<char>(0x80)))};
}
// Codes in element order from the lanes' magnitudes (top plus the staircase) and signs.
inline __m256i e4m3_finish(__m256i code, __m256i sign) {
  // (capped at 126, 448: no finite value can become the NaN code, whatever the caller's bound)
  code = _mm256_min_epu8(_mm256_max_epi8(code, _mm256_setzero_si256()), _mm256_set1_epi8(0x7e));
  return _mm256_permute4x64_epi64(_mm256_or_si256(code, sign), 0xd8);
}
inline __m256i no_band() { return _mm256_set1_epi8(-1); }
inline bool band_hit(__m256i band) {
  const __m256i below = _mm256_subs_epu8(_mm256_set1_epi8(48), band);
  return !_mm256_testz_si256(below, below);
}
// Bit j set where scale j of four (f32 bits) is a table_scale: 2^-100 to below 2^100, positive
// (the sign bit puts negative scales' field out of range).
inline uint32_t table_scales4(__m128i bits) {
  const __m128i field = _mm_srli_epi32(bits, 23);
  const __m128i in_range = _mm_and_si128(_mm_cmpgt_epi32(field, _mm_set1_epi32(127 - 100 - 1)), _mm_cmplt_epi32(field, _mm_set1_epi32(127 + 100)));
  return static_cast<uint32_t>(_mm_movemask_ps(_mm_castsi128_ps(in_range)));
}
inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

constexpr int kTableExponent = 130;  // bf16 exponent field of the probes 2^(3+k)·(1 + m/128)
constexpr int16_t kNoTable = INT16_MIN;

// The words of a scale's table (kE4m3TableWords int16): word 0 is C less 8·kTableExponent (or
// kNoTable); bytes 16-31 hold A[16], bytes 32-47 hold S[16] - 1 (7: no step in that run).
constexpr int kStepsAt = 16, kFirstsAt = 32;

struct ThresholdTable {
  __m256i base, steps, firsts;  // C (words), A and S - 1 (bytes, in both 128-bit halves)
  explicit ThresholdTable(const int16_t* table)
      : base(_mm256_set1_epi16(table[0])),
        steps(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table) + kStepsAt / 16))),
        firsts(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table) + kFirstsAt / 16))) {}
};

// D of 16 lanes from their shifts k << 7 and a table's base C.
inline __m256i lane_bases(__m256i base, __m256i shift) { return _mm256_sub_epi16(base, _mm256_srai_epi16(shift, 4)); }

// Codes of 32 bf16 lanes by a scale's table (see e4m3_lanes; d = t.base - 8·k, lane_bases).
inline __m256i threshold_codes(__m256i v0, __m256i v1, __m256i d0, __m256i d1, const ThresholdTable& t, __m256i& band) {
  const E4m3Lanes l = e4m3_lanes(v0, v1, d0, d1, band);
  const __m256i run = _mm256_and_si256(_mm256_srli_epi16(l.mantissa, 3), _mm256_set1_epi8(15));
  const __m256i stepped = _mm256_cmpgt_epi8(_mm256_and_si256(l.mantissa, _mm256_set1_epi8(7)), _mm256_shuffle_epi8(t.firsts, run));
  return e4m3_finish(_mm256_subs_epi8(_mm256_adds_epi8(l.top, _mm256_shuffle_epi8(t.steps, run)), stepped), l.sign);
}

// The table of the scale 1.0 (e4m3_tables, below): per-channel and per-token casts under
// power-of-two scales share it, with a shift per lane or per 32 elements.
const int16_t* unit_e4m3_table();

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
  // ---- cast fast path (formats_simd.inc: quotient_codes, encode_bounded) ----
  static constexpr bool kFastCasts = true;
  static I xor_(I a, I b) { return _mm256_xor_si256(a, b); }
  static bool none(I a) { return _mm256_testz_si256(a, a); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }     // a·b + c, one rounding
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }   // c - a·b, one rounding
  static I round_int(F a) { return _mm256_cvtps_epi32(a); }  // current rounding mode: nearest-even
  static I max(I a, I b) { return _mm256_max_epi32(a, b); }
  // amax_groups of bf16 rows for groups of gran elements (a multiple of 16), eight groups at
  // a time; returns how many groups it did (the caller does the rest). bf16 is the top half
  // of f32, so |x| compares the same on 16-bit lanes, which hold twice the elements and need
  // no widening; the eight horizontal maxima come out of one shuffle tree rather than eight
  // serial reductions (whose latency dominated groups of 32).
  static constexpr bool kBf16Amax = true;
  static int64_t bf16_amax_groups(const uint16_t* x, int64_t groups, int64_t gran, float* out) {
    if (gran % 16) return 0;
    const __m256i abs_mask = _mm256_set1_epi16(0x7fff);
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8) {
      __m256i v[8];
      for (int j = 0; j < 8; ++j) {
        const uint16_t* p = x + (g + j) * gran;
        __m256i m = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), abs_mask);
        for (int64_t i = 16; i < gran; i += 16)
          m = _mm256_max_epu16(m, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)), abs_mask));
        v[j] = m;
      }
      // Interleave and max at 16, 32, 64 bits: each 128-bit half ends with one partial
      // maximum per group, in group order.
      __m256i t[4], u[2];
      for (int j = 0; j < 4; ++j)
        t[j] = _mm256_max_epu16(_mm256_unpacklo_epi16(v[2 * j], v[2 * j + 1]), _mm256_unpackhi_epi16(v[2 * j], v[2 * j + 1]));
      for (int j = 0; j < 2; ++j)
        u[j] = _mm256_max_epu16(_mm256_unpacklo_epi32(t[2 * j], t[2 * j + 1]), _mm256_unpackhi_epi32(t[2 * j], t[2 * j + 1]));
      const __m256i w = _mm256_max_epu16(_mm256_unpacklo_epi64(u[0], u[1]), _mm256_unpackhi_epi64(u[0], u[1]));
      const __m128i h = _mm_max_epu16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + g), _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return g;
  }
  // acc[i] = max(acc[i], |x[i]|) on bf16 patterns, 16 lanes per op; returns how many it did.
  // over Rows rows stride elements apart: one load and store of acc for all of them.
  template <int Rows>
  static int64_t bf16_amax_accumulate(const uint16_t* x, int64_t stride, int64_t n, uint16_t* acc) {
    const __m256i abs_mask = _mm256_set1_epi16(0x7fff);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      __m256i* a = reinterpret_cast<__m256i*>(acc + i);
      __m256i m = _mm256_loadu_si256(a);
      for (int r = 0; r < Rows; ++r)
        m = _mm256_max_epu16(m, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + r * stride + i)), abs_mask));
      _mm256_storeu_si256(a, m);
    }
    return i;
  }
  // ---- codes of bf16 under power-of-two scales (formats_simd.inc: bf16_pow2_codes) ----
  // |v| / 2^k as a bf16 pattern (int16; see bf16_e2m1_pow2), shift = k << 7.
  static __m256i pattern_over_scale(__m256i v, int16_t shift) {
    return _mm256_sub_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x7fff)), _mm256_set1_epi16(shift));
  }
  // Requests the 64 elements at p + i (the caller's next row) into L2.
  static void prefetch_step(const uint16_t* p, int64_t i) {
    if (!p) return;
    __builtin_prefetch(p + i, 0, 2);
    __builtin_prefetch(p + i + 32, 0, 2);
  }
  // x / 2^k is exact, and its bf16 pattern is |x|'s minus k << 7 (for values far below 0.25,
  // some pattern below 0.25's, possibly negative as int16). Non-negative patterns order like
  // their values, so a code is the number of rounding boundaries its pattern lies above: ties
  // to even go down at 0.25, 1.25, 2.5 and 5, and up at 0.75, 1.75 and 3.5. 16 lanes per op,
  // no division and no widening; the count cannot pass 7, so values the bound lets slightly
  // above 6 saturate by themselves. n: a multiple of 64; shift[b] = k << 7 of x[32b, 32b + 32).
  static constexpr bool kBf16Pow2Codes = true;
  template <bool Stream>
  static void bf16_e2m1_pow2(const uint16_t* x, uint8_t* q, int64_t n, const int16_t* shift, const uint16_t* prefetch) {
    const __m256i sign_code = _mm256_set1_epi16(8);
    // (tie-up boundaries as "above the pattern just below")
    static constexpr int16_t kBoundaries[7] = {0x3e80, 0x3f3f, 0x3fa0, 0x3fdf, 0x4020, 0x405f, 0x40a0};
    const __m256i nibble_pair = _mm256_set1_epi32(1 | 16 << 16);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t i = 0; i < n; i += 64) {
      prefetch_step(prefetch, i);
      __m256i pairs[4];
      for (int j = 0; j < 4; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i + 16 * j));
        const __m256i y = pattern_over_scale(v, shift[i / 32 + j / 2]);
        __m256i code = _mm256_and_si256(_mm256_srai_epi16(v, 15), sign_code);
        for (const int16_t b : kBoundaries) code = _mm256_sub_epi16(code, _mm256_cmpgt_epi16(y, _mm256_set1_epi16(b)));
        pairs[j] = _mm256_madd_epi16(code, nibble_pair);  // 32-bit lane t: code[2t] | code[2t + 1] << 4
      }
      // Dword d of each 128-bit half holds pairs[d] lanes 0-3 (low half) or 4-7 (high half).
      const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(pairs[0], pairs[1]), _mm256_packus_epi32(pairs[2], pairs[3]));
      put<Stream>(q + i / 2, _mm256_permutevar8x32_epi32(bytes, order));
    }
  }
  // e4m3 codes under power-of-two scales (formats_simd.inc: bf16_pow2_codes): the unit scale's
  // staircase table (threshold_codes) with the group's shift, 32 codes per two vpshufb; it
  // replaced a 16-bit kernel that rounded the pattern at bit 4 (1.1x, per-block casts, Zen 3).
  // A 64-element block holding a lane the table cannot answer (quotients in or near the e4m3
  // subnormals) is left unwritten and flagged in the returned mask (bit b: x[64b, 64b + 64)),
  // for the caller's general path. n: a multiple of 64, at most 2048; shift[b] = k << 7 of
  // x[32b, 32b + 32).
  template <bool Stream>
  static uint32_t bf16_e4m3_pow2(const uint16_t* x, uint8_t* q, int64_t n, const int16_t* shift, const uint16_t* prefetch) {
    const int16_t* unit = unit_e4m3_table();
    if (unit[0] == kNoTable) return n >= 2048 ? ~uint32_t{0} : (uint32_t{1} << (n / 64)) - 1;  // (not expected)
    const ThresholdTable t(unit);
    uint32_t fallback = 0;
    for (int64_t i = 0; i < n; i += 64) {
      prefetch_step(prefetch, i);
      const bool stored = put_unless_band<Stream>(q + i, [&](int64_t at, __m256i& band) {
        const __m256i d = lane_bases(t.base, _mm256_set1_epi16(shift[(i + at) / 32]));
        return threshold_codes(load256(x + i + at), load256(x + i + at + 16), d, d, t, band);
      });
      if (!stored) fallback |= uint32_t{1} << (i / 64);
    }
    return fallback;
  }
  // ---- e4m3 codes of bf16 under f32 scales (formats_simd.inc: bf16_e4m3_threshold_codes) ----
  // The per-block staircase (below, "per-block bf16 -> e4m3 casts through per-scale
  // thresholds") made per group from the scale itself, without probes: of the 8 e4m3 rounding
  // boundaries the quotients of m = 0..127 cross, boundary i lies between c = c0 + i and c + 1
  // (c0 the code of RN(8 / f)), at b = (17 + 2r)·2^(e - 11) for c = 8e + r. Where c is even the
  // tie at b goes down, so q > b, which in f32 means x / sf > b + ulp(b)/2; where c is odd it
  // goes up, q >= b, x / sf >= b - ulp(b)/2 (ulp(b) = 2^(e - 30); the ties at those bounds
  // round to b, whose f32 significand has five bits). With x = 2^(3+k)·(1 + m/128) that is m
  // above (or at least) w - 128, w = f·((17 + 2r)·2^20 ± 1)·2^(e - 27): at most 50 significant
  // bits, exact in f64, as is its ceiling. t_i is the least such m (1..128; 128: no step below the
  // next binade), and a code is 8·(P >> 7) + c0 - 8·130 plus the count of t_i <= m: eight byte
  // compares, where a probe table would cost a group as much as its codes.
  static constexpr bool kE4m3Thresholds = true;
  static constexpr int kThresholdChunk = 32;  // groups per e4m3_thresholds call
  // For groups g < count <= kThresholdChunk: t[j·kThresholdChunk + g] holds the threshold of
  // residue j (below) less one, in each of its bytes; d[g] = D = c0 - 8·130 - 8·k.
  // Returns the groups it takes (bit g): table_scale(sf[g]), with every sf positive normal (the
  // caller's bound).
  // The boundaries c0 + i (i = 0..7) are taken by residue r = c & 7 rather than in order: r
  // fixes 17 + 2r and the tie's direction, and the boundary lies in c0's binade e0 for r >= r0
  // (r0 = c0 & 7), in the next for r < r0. So w = G·K_r, G = f·2^(e0 - 27) per group, K_r one
  // of two constants; counting needs no order.
  static uint32_t e4m3_thresholds(const float* sf, int count, uint32_t* t, int16_t* d) {
    alignas(16) float scales[kThresholdChunk];
    for (int g = 0; g < kThresholdChunk; ++g) scales[g] = g < count ? sf[g] : 1.0f;
    const __m128i one = _mm_set1_epi32(1);
    const __m128i replicate = _mm_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12);
    uint32_t take = 0;
    for (int g = 0; g < count; g += 4) {
      const __m128i bits = _mm_load_si128(reinterpret_cast<const __m128i*>(scales + g));
      take |= table_scales4(bits) << g;
      const __m128i field = _mm_srli_epi32(bits, 23);
      const __m128 f = _mm_castsi128_ps(_mm_or_si128(_mm_and_si128(bits, _mm_set1_epi32(0x007fffff)), _mm_set1_epi32(0x3f800000)));
      // c0: the code of RN(8 / f), in (4, 8]: normal, rounded at bit 20 and re-biased by 120 << 23
      const __m128i q0 = _mm_castps_si128(_mm_div_ps(_mm_set1_ps(8.0f), f));
      const __m128i c0 = _mm_srli_epi32(
          _mm_add_epi32(_mm_add_epi32(q0, _mm_set1_epi32((1 << 19) - 1 - (120 << 23))), _mm_and_si128(_mm_srli_epi32(q0, 20), one)), 20);
      // D = c0 - 8·130 - 8·(field - 127) (int16 for the scales taken: field within 127 ± 100)
      const __m128i D = _mm_sub_epi32(_mm_sub_epi32(c0, _mm_set1_epi32(8 * 130 - 8 * 127)), _mm_slli_epi32(field, 3));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(d + g), _mm_packs_epi32(D, D));
      const __m256i e0 = _mm256_slli_epi64(_mm256_cvtepi32_epi64(_mm_add_epi32(_mm_srli_epi32(c0, 3), _mm_set1_epi32(1023 - 27))), 52);
      const __m256d G = _mm256_mul_pd(_mm256_cvtps_pd(f), _mm256_castsi256_pd(e0));
      const __m256d r0 = _mm256_cvtepi32_pd(_mm_and_si128(c0, _mm_set1_epi32(7)));
      auto residue = [&](auto r_constant) {
        constexpr int r = decltype(r_constant)::value;
        // one f32 half-ulp above b (even c: the tie goes down, q must pass b) or below (odd c)
        constexpr double n = (17 + 2 * r) * double(1 << 20) + (r % 2 ? -1 : 1);
        const __m256d k = _mm256_blendv_pd(_mm256_set1_pd(n), _mm256_set1_pd(2 * n), _mm256_cmp_pd(_mm256_set1_pd(r), r0, _CMP_LT_OQ));
        // The least m at or above y (odd c), or above it (even c): both are ceil(y), since y is
        // never an integer (f·2^23 < 2^24 times the odd n, over 2^(50 - e0) with e0 <= 11).
        const __m256d y = _mm256_fmsub_pd(G, k, _mm256_set1_pd(128.0));
        const __m128i ti = _mm_min_epi32(_mm_max_epi32(_mm256_cvttpd_epi32(_mm256_ceil_pd(y)), one), _mm_set1_epi32(128));
        _mm_store_si128(reinterpret_cast<__m128i*>(t + r * kThresholdChunk + g), _mm_shuffle_epi8(_mm_sub_epi32(ti, one), replicate));
      };
      [&]<int... r>(std::integer_sequence<int, r...>) { (residue(std::integral_constant<int, r>{}), ...); }(std::make_integer_sequence<int, 8>{});
    }
    return take & static_cast<uint32_t>((uint64_t{1} << count) - 1);
  }
  // Codes of n bf16 (a multiple of 64, at most 4096) from their groups' e4m3_thresholds (t
  // and d of the group x starts at; the next groups, if n holds more, follow in those
  // arrays; gran a multiple of 64). A 64-element block holding a lane between the
  // zero region and the normal one (band_hit) is left unwritten and flagged in the returned
  // mask (bit b: x[64b, 64b + 64)), for the caller's general path.
  template <bool Stream>
  static uint64_t bf16_e4m3_by_thresholds(const uint16_t* x, uint8_t* q, int64_t n, int64_t gran, const uint32_t* t,
                                          const int16_t* d, const uint16_t* prefetch) {
    __m256i thresholds[8], lane_d;
    auto load_group = [&] {
      for (int j = 0; j < 8; ++j) thresholds[j] = _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(t + j * kThresholdChunk)));
      lane_d = _mm256_set1_epi16(*d);
    };
    auto codes = [&](int64_t at, __m256i& band) {
      const E4m3Lanes l = e4m3_lanes(load256(x + at), load256(x + at + 16), lane_d, lane_d, band);
      __m256i code = l.top;
      for (const __m256i& threshold : thresholds) code = _mm256_subs_epi8(code, _mm256_cmpgt_epi8(l.mantissa, threshold));
      return e4m3_finish(code, l.sign);
    };
    load_group();
    uint64_t fallback = 0;
    for (int64_t i = 0, next = gran; i < n; i += 64) {
      if (i == next) {
        ++t, ++d, next += gran;
        load_group();
      }
      prefetch_step(prefetch, i);
      if (!put_unless_band<Stream>(q + i, [&](int64_t at, __m256i& band) { return codes(i + at, band); }))
        fallback |= uint64_t{1} << (i / 64);
    }
    return fallback;
  }
  // ---- e2m1 codes of bf16 under f32 scales (formats_simd.inc: bf16_e2m1_threshold_codes) ----
  // As on AVX-512 (formats_avx512.cpp, "e2m1 casts of bf16 by thresholds per scale"): a code
  // counts the rounding boundaries b = 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 that q = RN(|x| / sf)
  // passes, q > b where the tie goes down (to the even code), q >= b where it goes up; in f32
  // that is |x| / sf > b + ulp(b)/2, or >= b - ulp(b)/2, bounds whose products with sf are
  // exact in f64. The first bf16 at (or above) each product is the group's threshold T_b, and
  // a code is seven 16-bit compares: no division (a vdivps per 8 codes bounded this cast).
  static constexpr bool kE2m1Thresholds = true;
  // For groups g < count <= kThresholdChunk: t[b·kThresholdChunk + g] holds T_b - 1 in both
  // of its 16-bit halves, b = 0..6. Returns the groups it takes (bit g): sf from 2^-100 to below
  // 2^100 (the bounds stay normal f32), every sf positive normal (the caller's bound).
  static uint32_t e2m1_thresholds(const float* sf, int count, uint32_t* t) {
    static constexpr double kBounds[7] = {0.25 + 0x1p-26, 0.75 - 0x1p-25, 1.25 + 0x1p-24, 1.75 - 0x1p-24,
                                          2.5 + 0x1p-23,  3.5 - 0x1p-23,  5.0 + 0x1p-22};
    static constexpr bool kStrict[7] = {true, false, true, false, true, false, true};
    alignas(16) float scales[kThresholdChunk];
    for (int g = 0; g < kThresholdChunk; ++g) scales[g] = g < count ? sf[g] : 1.0f;
    uint32_t take = 0;
    for (int g = 0; g < count; g += 4) {
      const __m128i bits = _mm_load_si128(reinterpret_cast<const __m128i*>(scales + g));
      take |= table_scales4(bits) << g;
      const __m256d s = _mm256_cvtps_pd(_mm_castsi128_ps(bits));
      // The first bf16 at or above a bound, straight from its f64 pattern (bf16 values are
      // f64 values with 7 mantissa bits): the pattern rounded up at bit 45, re-biased from
      // 1023 to 127 and shifted down to 16 bits. The bounds of the scales taken are normal in
      // bf16. (Before 2026-12-04: through the nearest f32 and a compare, 14 ops a bound.)
      constexpr int64_t kLow = (int64_t{1} << 45) - 1, kRebias = int64_t{1023 - 127} << 52;
      for (int b = 0; b < 7; ++b) {
        __m256i bound = _mm256_castpd_si256(_mm256_mul_pd(s, _mm256_set1_pd(kBounds[b])));
        // strict bounds: the next double up (bf16 values above the bound reach it)
        bound = _mm256_add_epi64(bound, _mm256_set1_epi64x(kStrict[b] ? kLow + 1 : kLow));
        const __m256i bf16 = _mm256_srli_epi64(_mm256_sub_epi64(bound, _mm256_set1_epi64x(kRebias)), 45);
        // less one, in both 16-bit halves of each dword (four groups: dwords 0, 2, 4, 6)
        const __m256i less = _mm256_sub_epi64(bf16, _mm256_set1_epi64x(1));
        const __m256i both = _mm256_or_si256(less, _mm256_slli_epi64(less, 16));
        const __m128i packed = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(both, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6)));
        _mm_store_si128(reinterpret_cast<__m128i*>(t + b * kThresholdChunk + g), packed);
      }
    }
    return take & static_cast<uint32_t>((uint64_t{1} << count) - 1);
  }
  // Packed codes of n bf16 (a multiple of 32) from their groups' e2m1_thresholds (t of the
  // group x starts at, the next groups following; gran a multiple of 32).
  template <bool Stream>
  static void bf16_e2m1_by_thresholds(const uint16_t* x, uint8_t* q, int64_t n, int64_t gran, const uint32_t* t,
                                      const uint16_t* prefetch) {
    __m256i thresholds[7];
    auto load_group = [&] {
      for (int b = 0; b < 7; ++b) thresholds[b] = _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(t + b * kThresholdChunk)));
    };
    const __m256i magnitude = _mm256_set1_epi16(0x7fff), sign_code = _mm256_set1_epi16(8);
    const __m256i nibble_pair = _mm256_set1_epi32(1 | 16 << 16), order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    auto codes = [&](__m256i v) {  // dword d: code[2d] | code[2d + 1] << 4
      const __m256i a = _mm256_and_si256(v, magnitude);
      __m256i code = _mm256_and_si256(_mm256_srli_epi16(v, 12), sign_code);
      for (const __m256i& threshold : thresholds) code = _mm256_sub_epi16(code, _mm256_cmpgt_epi16(a, threshold));
      return _mm256_madd_epi16(code, nibble_pair);
    };
    load_group();
    for (int64_t i = 0, next = gran; i < n; i += 32) {
      if (i == next) {
        ++t, next += gran;
        load_group();
      }
      if (prefetch && i % 64 == 0) prefetch_step(prefetch, i);
      const __m256i words = _mm256_packus_epi32(codes(load256(x + i)), codes(load256(x + i + 16)));
      const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(words, words), order);
      put<Stream>(q + i / 2, _mm256_castsi256_si128(bytes));
    }
  }
  static F lut8(const float* table, I idx) { return _mm256_permutevar8x32_ps(_mm256_load_ps(table), idx); }
  static F to_float(I a) { return _mm256_cvtepi32_ps(a); }
  static int32_t hmax(I a) {
    __m128i m = _mm_max_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0x4e));
    m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0xb1));
    return _mm_cvtsi128_si32(m);
  }

  static F load_f32(const float* p) { return _mm256_loadu_ps(p); }
  static void store_f32(float* p, F a) { _mm256_storeu_ps(p, a); }
  static I load_u16(const uint16_t* p) { return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static void stream_u16(uint16_t* p, I a) { store_u16(p, a); }  // (plain stores on this target)
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
  // ---- 4-vector blocks (see formats_simd.inc) ----
  // Lane order of a 32-element block on the quantise side: y0 = e[0-3, 8-11],
  // y1 = e[4-7, 12-15], y2 = e[16-19, 24-27], y3 = e[20-23, 28-31]. It is what
  // unpacking bf16 against zero produces, and packus/packs restore it for free.
  static constexpr bool kCustomBlocks = true;

  static void load_wide_x4(const uint16_t* p, F y[4]) {
    const __m256i zero = _mm256_setzero_si256();
    const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
    y[0] = from_bits(_mm256_unpacklo_epi16(zero, l0));
    y[1] = from_bits(_mm256_unpackhi_epi16(zero, l0));
    y[2] = from_bits(_mm256_unpacklo_epi16(zero, l1));
    y[3] = from_bits(_mm256_unpackhi_epi16(zero, l1));
  }
  static void load_wide_x4(const float* p, F y[4]) {
    const F f0 = _mm256_loadu_ps(p), f1 = _mm256_loadu_ps(p + 8);
    const F f2 = _mm256_loadu_ps(p + 16), f3 = _mm256_loadu_ps(p + 24);
    y[0] = _mm256_permute2f128_ps(f0, f1, 0x20);
    y[1] = _mm256_permute2f128_ps(f0, f1, 0x31);
    y[2] = _mm256_permute2f128_ps(f2, f3, 0x20);
    y[3] = _mm256_permute2f128_ps(f2, f3, 0x31);
  }
  // Codes (magnitudes < 128) and sign bytes packed with the same shuffles: packus keeps the
  // magnitudes, packs saturates each f32 bit pattern to a byte whose top bit is its sign.
  static __m256i pack_codes(const I mag[4], const F y[4], int sign_bit) {
    const __m256i m = _mm256_packus_epi16(_mm256_packus_epi32(mag[0], mag[1]), _mm256_packus_epi32(mag[2], mag[3]));
    const __m256i s = _mm256_packs_epi16(_mm256_packs_epi32(bits(y[0]), bits(y[1])),
                                         _mm256_packs_epi32(bits(y[2]), bits(y[3])));
    // Saturated bytes are 0x80..0xff when negative: bit 7 is the sign; other bits are not.
    const __m256i negative = sign_bit == 0x80 ? s : _mm256_cmpgt_epi8(_mm256_setzero_si256(), s);
    const __m256i codes = _mm256_or_si256(m, _mm256_and_si256(negative, _mm256_set1_epi8(static_cast<char>(sign_bit))));
    return _mm256_permute4x64_epi64(codes, 0xd8);  // qwords e[0-7], e[16-23], e[8-15], e[24-31] → in order
  }
  // Stores; Stream uses non-temporal stores when the destination is aligned for them.
  template <bool Stream>
  static void put(void* p, __m256i v) {
    if (Stream && (reinterpret_cast<uintptr_t>(p) & 31) == 0) _mm256_stream_si256(static_cast<__m256i*>(p), v);
    else _mm256_storeu_si256(static_cast<__m256i*>(p), v);
  }
  template <bool Stream>
  static void put(void* p, __m128i v) {
    if (Stream && (reinterpret_cast<uintptr_t>(p) & 15) == 0) _mm_stream_si128(static_cast<__m128i*>(p), v);
    else _mm_storeu_si128(static_cast<__m128i*>(p), v);
  }
  static void fence() { _mm_sfence(); }
  // One 64-element step of the e4m3 staircase kernels: codes(at, band) gives the 32 codes of
  // elements at..at + 31 (at = 0, 32) and accumulates their band; they are stored unless a lane
  // lies in the band (band_hit), and then nothing is stored and false returned.
  template <bool Stream, class Codes>
  static bool put_unless_band(uint8_t* q, Codes codes) {
    __m256i band = no_band();
    const __m256i lo = codes(0, band), hi = codes(32, band);
    if (band_hit(band)) [[unlikely]] return false;
    put<Stream>(q, lo);
    put<Stream>(q + 32, hi);
    return true;
  }

  template <bool Stream>
  static void store_byte_codes_x4(uint8_t* p, const I mag[4], const F y[4]) { put<Stream>(p, pack_codes(mag, y, 0x80)); }
  template <bool Stream>
  static void store_nibble_codes_x4(uint8_t* p, const I mag[4], const F y[4]) {
    const __m256i bytes = pack_codes(mag, y, 0x08);
    const __m256i pairs = _mm256_and_si256(_mm256_or_si256(bytes, _mm256_srli_epi16(bytes, 4)), _mm256_set1_epi16(0xff));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi16(pairs, pairs), 0x08);
    put<Stream>(p, _mm256_castsi256_si128(packed));
  }
  // Dequantise side: c0 = e[0-3, 16-19], c1 = e[4-7, 20-23], c2 = e[8-11, 24-27],
  // c3 = e[12-15, 28-31] (unpacking bytes against zero); the stores below restore order.
  static void expand_codes(__m256i bytes, I c[4]) {
    const __m256i zero = _mm256_setzero_si256();
    const __m256i lo = _mm256_unpacklo_epi8(bytes, zero), hi = _mm256_unpackhi_epi8(bytes, zero);
    c[0] = _mm256_unpacklo_epi16(lo, zero);
    c[1] = _mm256_unpackhi_epi16(lo, zero);
    c[2] = _mm256_unpacklo_epi16(hi, zero);
    c[3] = _mm256_unpackhi_epi16(hi, zero);
  }
  static void load_byte_codes_x4(const uint8_t* p, I c[4]) {
    expand_codes(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), c);
  }
  static void load_nibble_codes_x4(const uint8_t* p, I c[4]) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    expand_codes(_mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi)), c);
  }
  static void store_f32_x4(float* p, const F v[4]) {
    put<false>(p, bits(_mm256_permute2f128_ps(v[0], v[1], 0x20)));
    put<false>(p + 8, bits(_mm256_permute2f128_ps(v[2], v[3], 0x20)));
    put<false>(p + 16, bits(_mm256_permute2f128_ps(v[0], v[1], 0x31)));
    put<false>(p + 24, bits(_mm256_permute2f128_ps(v[2], v[3], 0x31)));
  }
  static void store_u16_x4(uint16_t* p, const I r[4]) {
    const __m256i a = _mm256_packus_epi32(r[0], r[1]), b = _mm256_packus_epi32(r[2], r[3]);
    put<false>(p, _mm256_permute2x128_si256(a, b, 0x20));
    put<false>(p + 16, _mm256_permute2x128_si256(a, b, 0x31));
  }

  // ---- dequantisation through f16 (formats_simd.inc: dequantize_block) ----
  // 32 e4m3 codes as f32 · scale256 in natural order; false, with nothing done, when one of
  // them is NaN. Unpacking against zero gives code << 8; an arithmetic shift right by one
  // and clearing bit 14 leaves sign, then the 7 magnitude bits at f16's exponent/mantissa.
  static constexpr bool kF16Decode = true;
  static bool decode_e4m3_x4(const uint8_t* p, F scale256, F v[4]) {
    const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i magnitude = _mm256_set1_epi8(0x7f);
    if (_mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_and_si256(codes, magnitude), magnitude))) return false;
    const __m128i zero = _mm_setzero_si128(), keep = _mm_set1_epi16(static_cast<short>(0xbfff));
    const __m128i lo = _mm256_castsi256_si128(codes), hi = _mm256_extracti128_si256(codes, 1);
    auto half = [&](__m128i shifted) { return _mm256_cvtph_ps(_mm_and_si128(_mm_srai_epi16(shifted, 1), keep)); };
    v[0] = _mm256_mul_ps(half(_mm_unpacklo_epi8(zero, lo)), scale256);
    v[1] = _mm256_mul_ps(half(_mm_unpackhi_epi8(zero, lo)), scale256);
    v[2] = _mm256_mul_ps(half(_mm_unpacklo_epi8(zero, hi)), scale256);
    v[3] = _mm256_mul_ps(half(_mm_unpackhi_epi8(zero, hi)), scale256);
    return true;
  }
  // Stores of 32 values (f32, or bf16 bit patterns in 32-bit lanes) given in natural order,
  // as decode_e4m3_x4 produces them.
  static void store_f32_natural_x4(float* p, const F v[4]) {
    for (int j = 0; j < 4; ++j) put<false>(p + 8 * j, bits(v[j]));
  }
  static void store_u16_natural_x4(uint16_t* p, const I r[4]) {
    // packus of lanes e[0-7] and e[8-15] interleaves their 128-bit halves; the qword permute restores order.
    put<false>(p, _mm256_permute4x64_epi64(_mm256_packus_epi32(r[0], r[1]), 0xd8));
    put<false>(p + 16, _mm256_permute4x64_epi64(_mm256_packus_epi32(r[2], r[3]), 0xd8));
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

// ---- per-block bf16 -> e4m3 casts through per-scale thresholds ----
// As on AVX-512 (formats_avx512.cpp, "per-block bf16 -> e4m3 casts through code tables"):
// with sf = 2^k·f (1 <= f < 2) and P the bf16 pattern of |x| / 2^k (|x|'s minus k << 7), a
// normal code is 8·(P >> 7) + c(m), m = P & 127, where c depends on f alone (scaling by 2^e
// commutes with both roundings while the quotient stays normal). AVX2 has no 128-word
// permute, but c is a staircase: over m = 0..127 the quotient grows by a factor of two, so c
// climbs by 8 in steps at least 8 apart in m (the quotient's e4m3 spacing, 2^e / 8, is 8·f or
// 16·f in units of m). Each run of 8 m therefore holds at most one step, and c(m) =
// C + A[m >> 3] + (m & 7 >= S[m >> 3]): two vpshufb on the 16 runs. On byte lanes that is
// about 32 ops per 32 codes, against about 55 for the quotient kernel (two FMAs, the rounding
// on 32-bit lanes, the packing), most of which compete for Zen 3's two FMA / shuffle pipes.
// The table of a scale comes from the general kernel's codes of 128 probes (as on AVX-512) and
// is checked to be such a staircase; if not, the scale gets kNoTable and the general kernel.
// Lanes between the zero region and the normal one (x / 2^k in (2^-10, 2^-5): quotients in or
// near the e4m3 subnormals) send their 64-element step to the general kernel.
void e4m3_tables(const float* sf, int64_t groups, int16_t* tables) {
  alignas(32) uint16_t probe[kE4m3TableWords];
  uint8_t codes[kE4m3TableWords];
  for (int64_t g = 0; g < groups; ++g) {
    int16_t* table = tables + g * kE4m3TableWords;
    table[0] = kNoTable;
    if (!table_scale(sf[g])) continue;
    for (int m = 0; m < kE4m3TableWords; ++m) probe[m] = static_cast<uint16_t>(((kTableExponent << 7) + table_shift(sf[g])) | m);
    quantize_span<E4M3, uint16_t, false, false, false>(probe, codes, kE4m3TableWords, sf + g, Reciprocals{}, nullptr);
    auto* bytes = reinterpret_cast<uint8_t*>(table);
    bool staircase = true;
    for (int run = 0; run < 16; ++run) {
      const int first = codes[8 * run];
      int step = 8;  // the first r in 1..7 whose code is one above the run's first
      for (int r = 1; r < 8; ++r) {
        const int rise = codes[8 * run + r] - first;
        if (rise == 1 && step == 8) step = r;
        staircase &= rise == (r >= step ? 1 : 0);
      }
      bytes[kStepsAt + run] = static_cast<uint8_t>(first - codes[0]);
      bytes[kFirstsAt + run] = static_cast<uint8_t>(step - 1);
    }
    if (staircase) table[0] = static_cast<int16_t>(codes[0] - 8 * kTableExponent);
  }
}

const int16_t* unit_e4m3_table() {
  static const auto table = [] {
    std::array<int16_t, kE4m3TableWords> t{};
    const float unit = 1.0f;
    e4m3_tables(&unit, 1, t.data());
    return t;
  }();
  return table.data();
}

template <bool Stream>
void e4m3_rows_by_thresholds(const uint16_t* x, uint8_t* q, int64_t n, const float* sf, int64_t gran, const int16_t* tables,
                             const uint16_t* prefetch) {
  for (int64_t g = 0, i = 0; i < n; ++g) {
    const int64_t end = min64(n, i + gran);
    const int16_t* table = tables + g * kE4m3TableWords;
    if (table[0] == kNoTable) {  // (the scale may be inf or NaN: no bound)
      quantize_span<E4M3, uint16_t, false, false, false>(x + i, q + i, end - i, sf + g, Reciprocals{}, nullptr);
      i = end;
      continue;
    }
    const ThresholdTable t(table);
    const __m256i d = lane_bases(t.base, _mm256_set1_epi16(table_shift(sf[g])));
    for (; i + 64 <= end; i += 64) {
      if (prefetch) V::prefetch_step(prefetch, i);
      const bool stored = V::put_unless_band<Stream>(q + i, [&](int64_t at, __m256i& band) {
        return threshold_codes(load256(x + i + at), load256(x + i + at + 16), d, d, t, band);
      });
      if (!stored) quantize_span<E4M3, uint16_t, false, false, true>(x + i, q + i, 64, sf + g, Reciprocals{}, nullptr);
    }
    if (i < end) quantize_span<E4M3, uint16_t, false, false, true>(x + i, q + i, end - i, sf + g, Reciprocals{}, nullptr);
    i = end;
  }
  if (Stream) _mm_sfence();
}

void quantize_e4m3_tables(const uint16_t* x, uint8_t* q, int64_t n, const float* sf, int64_t gran, const int16_t* tables,
                          bool stream, const uint16_t* prefetch) {
  if (stream) e4m3_rows_by_thresholds<true>(x, q, n, sf, gran, tables, prefetch);
  else e4m3_rows_by_thresholds<false>(x, q, n, sf, gran, tables, prefetch);
}

// Per-channel casts under power-of-two scales: a shift per lane, and the unit scale's table.
template <bool Stream>
void e4m3_rows_by_shifts(const uint16_t* x, uint8_t* q, int64_t n, const float* sf, const int16_t* shift,
                         const int16_t* unit_table, const uint16_t* prefetch) {
  int64_t i = 0;
  if (unit_table[0] != kNoTable) {
    const ThresholdTable t(unit_table);
    for (; i + 64 <= n; i += 64) {
      if (prefetch) V::prefetch_step(prefetch, i);
      auto d = [&](int64_t at) { return lane_bases(t.base, load256(shift + at)); };
      const bool stored = V::put_unless_band<Stream>(q + i, [&](int64_t at, __m256i& band) {
        return threshold_codes(load256(x + i + at), load256(x + i + at + 16), d(i + at), d(i + at + 16), t, band);
      });
      if (!stored) quantize_span<E4M3, uint16_t, true, false, false>(x + i, q + i, 64, sf + i, Reciprocals{}, nullptr);
    }
  }
  if (i < n) quantize_span<E4M3, uint16_t, true, false, false>(x + i, q + i, n - i, sf + i, Reciprocals{}, nullptr);
  if (Stream) _mm_sfence();
}

void quantize_e4m3_shifts(const uint16_t* x, uint8_t* q, int64_t n, const float* sf, const int16_t* shift,
                          const int16_t* unit_table, bool stream, const uint16_t* prefetch) {
  if (stream) e4m3_rows_by_shifts<true>(x, q, n, sf, shift, unit_table, prefetch);
  else e4m3_rows_by_shifts<false>(x, q, n, sf, shift, unit_table, prefetch);
}

}  // namespace

const FormatKernels& format_kernels_avx2() {
  static const FormatKernels table = [] {
    FormatKernels t = make_table();
    t.e4m3_tables = &e4m3_tables;
    t.quantize_e4m3_tables = &quantize_e4m3_tables;
    t.quantize_e4m3_shifts = &quantize_e4m3_shifts;
    return t;
  }();
  return table;
}

}  // namespace moekit::detail

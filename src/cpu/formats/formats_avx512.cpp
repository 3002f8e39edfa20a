// AVX-512 target (16 lanes, F/BW/VL/DQ). Only reached via dispatch on CPUs that have it.
#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../../core/check.h"  // ceil_div
#include "format_kernels.h"

namespace moekit::detail {
namespace {

struct V {
  static constexpr bool kCustomBlocks = false;  // natural lane order (formats_simd.inc)
  static constexpr bool kBf16Amax = false;      // amax_groups widens bf16 like f32
  static constexpr bool kF16Decode = false;     // e4m3 decodes by bit arithmetic
  static constexpr bool kBf16Pow2Codes = false; // casts of bf16 widen to f32
  static constexpr bool kE4m3Thresholds = false, kE2m1Thresholds = false;  // (AVX2 only: formats_avx2.cpp)
  static void fence() {}  // (quantize's blocks store plainly here; stream_u16's callers fence themselves)
  static constexpr int N = 16;
  using F = __m512;
  using I = __m512i;
  using M = __mmask16;

  static I bits(F x) { return _mm512_castps_si512(x); }
  static F from_bits(I x) { return _mm512_castsi512_ps(x); }
  static I seti(int32_t x) { return _mm512_set1_epi32(x); }
  static F set(float x) { return _mm512_set1_ps(x); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I min(I a, I b) { return _mm512_min_epi32(a, b); }
  template <int k> static I shr(I a) { return _mm512_srli_epi32(a, k); }
  template <int k> static I shl(I a) { return _mm512_slli_epi32(a, k); }
  static M lt(I a, I b) { return _mm512_cmplt_epi32_mask(a, b); }
  static M gt(I a, I b) { return _mm512_cmpgt_epi32_mask(a, b); }
  static M eq(I a, I b) { return _mm512_cmpeq_epi32_mask(a, b); }
  static I select(M m, I a, I b) { return _mm512_mask_blend_epi32(m, b, a); }

  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  // ---- cast fast path (formats_simd.inc: quotient_codes, encode_bounded) ----
  // A zmm vdivps issues once per 10-16 cycles on Intel cores, most of the cast's time.
  static constexpr bool kFastCasts = true;
  static I xor_(I a, I b) { return _mm512_xor_si512(a, b); }
  static bool none(I a) { return _mm512_test_epi32_mask(a, a) == 0; }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }     // a·b + c, one rounding
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }   // c - a·b, one rounding
  static I round_int(F a) { return _mm512_cvtps_epi32(a); }  // current rounding mode: nearest-even
  static I max(I a, I b) { return _mm512_max_epi32(a, b); }
  // The whole 32-lane blocks of amax_accumulate_bf16 (formats_simd.inc; the column amaxes
  // of per-block and per-channel casts). kBf16Amax stays false: amax_groups widens here.
  // Rows rows stride elements apart go into one load and store of acc (from L2, 1.5x the
  // bytes per cycle of one row per pass).
  template <int Rows>
  static int64_t bf16_amax_accumulate(const uint16_t* x, int64_t stride, int64_t n, uint16_t* acc) {
    const __m512i magnitude = _mm512_set1_epi16(0x7fff);
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
      __m512i m = _mm512_loadu_si512(acc + i);
      for (int r = 0; r < Rows; ++r) m = _mm512_max_epu16(m, _mm512_and_si512(_mm512_loadu_si512(x + r * stride + i), magnitude));
      _mm512_storeu_si512(acc + i, m);
    }
    return i;
  }
  static F lut8(const float* table, I idx) {
    return _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(_mm256_load_ps(table)));  // idx < 8
  }
  static F to_float(I a) { return _mm512_cvtepi32_ps(a); }
  static int32_t hmax(I a) { return _mm512_reduce_max_epi32(a); }

  static F load_f32(const float* p) { return _mm512_loadu_ps(p); }
  static void store_f32(float* p, F a) { _mm512_storeu_ps(p, a); }
  static I load_u16(const uint16_t* p) { return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static void store_u16(uint16_t* p, I a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(a)); }
  // store_u16 past the cache where p allows it (32-byte aligned); the caller fences
  // (_mm_sfence) before the stores are read elsewhere.
  static void stream_u16(uint16_t* p, I a) {
    const __m256i v = _mm512_cvtepi32_epi16(a);
    if ((reinterpret_cast<uintptr_t>(p) & 31) == 0) _mm256_stream_si256(reinterpret_cast<__m256i*>(p), v);
    else _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
  }
  static I load_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static void store_u8(uint8_t* p, I a) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(a)); }
  static I load_nibble_pairs(const uint8_t* p) {
    const __m512i b = _mm512_cvtepu8_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m512i lo = _mm512_and_si512(b, _mm512_set1_epi64(0xf));
    const __m512i hi = _mm512_slli_epi64(_mm512_srli_epi64(b, 4), 32);
    return _mm512_or_si512(lo, hi);
  }
  static void store_nibble_pairs(uint8_t* p, I a) {
    const __m512i m = _mm512_and_si512(a, _mm512_set1_epi32(0xf));
    const __m512i pairs = _mm512_or_si512(m, _mm512_slli_epi64(_mm512_srli_epi64(m, 32), 4));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm512_cvtepi64_epi8(pairs));
  }
};

#include "formats_simd.inc"

// bf16 -> e4m3 casts: this target's f32 path beats AVX2's (1.05-1.15x, measured in L2 on
// Emerald Rapids), but for ue8m0 scales the AVX2 target's 16-bit path (bf16_pow2_codes) wins
// by 1.1-1.2x (zmm ops issue on two ports there, ymm ones on three). A row whose first scale
// qualifies goes there, unless the VBMI quotient kernels below take it (groups of a multiple
// of 64); any of these kernels gives the same codes for any row.
using QuantizeKernel = void (*)(const void*, uint8_t*, int64_t, const float*, int64_t, bool, const void*, bool, Reciprocals);
QuantizeKernel g_e4m3_bf16_zmm = nullptr, g_e4m3_bf16_ymm = nullptr;

// body(g, i, end) for each scale group g of a row of n elements, [i, end).
template <class Body>
inline void for_each_group(int64_t n, int64_t gran, Body body) {
  for (int64_t g = 0, i = 0; i < n; ++g, i += gran) body(g, i, min64(n, i + gran));
}

// ---- bf16 -> e4m3 casts under f32 scales: codes of the quotients ----
// Each code comes from the quotient RN(x / sf), formed by quotient_codes' two FMAs
// (formats_simd.inc) and rounded on its bit pattern. Against the generic 512-bit kernel this
// one saves shuffles, which with the data in L2 compete for the two vector ports that bound
// these casts:
// - it widens 32 bf16 lanes by a shift (the even ones, the low word of each dword) and a mask
//   (the odd ones), where vpmovzxwd costs a shuffle per 16;
// - it places each code and x's sign in the top byte of its lane (a shift and a ternlog, no
//   separate sign extraction) and gathers the 64 top bytes in element order with two
//   vpermt2b and a blend, where four vpmovdb cost eight shuffles.
// Per-token casts give it one scale (and reciprocal) per group of a multiple of 64 lanes;
// per-channel casts one per lane, in the lanes' order (bf16_lane_order). Blocks with a
// quotient below the least normal (zeros, e4m3 subnormals) go through the generic kernel,
// which divides. Measured on the 2-vCPU AMX Xeon (2026-12-01): docs/FORMATS.md.
// (vpermt2b is AVX512_VBMI: CPUs without it keep the generic kernel.)
bool g_vbmi = false;

struct QuotientConstants {
  static constexpr int kShift = 20;  // 23 - M: the rounding bit of the quotient's pattern
  static constexpr int32_t kLeastNormal = static_cast<int32_t>(pow2_bits(-6));
  static constexpr int32_t kRebias = kLeastNormal - (8 << kShift);  // the least normal's pattern less its code's
  __m512i high_words = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
  __m512i half_down = _mm512_set1_epi32((1 << (kShift - 1)) - 1 - kRebias), rounding_bit = _mm512_set1_epi32(1 << kShift);
  __m512i one = _mm512_set1_epi32(1), least = _mm512_set1_epi32(kLeastNormal), sign_bits = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i top_bytes, high_bytes;
  // Output byte j < 32 of two vectors of even and odd lanes (lane i: elements 2i and 2i + 1)
  // is the top byte of lane j / 2 of the first (j even) or (bit 6) the second; bytes 32-63 alike.
  // high_bytes: byte j is the high byte of bf16 element j of two vectors of 32 (its sign on top).
  __attribute__((target("avx512vbmi"))) QuotientConstants() {
    alignas(64) uint8_t idx[64], high[64];
    for (int j = 0; j < 64; ++j) {
      idx[j] = static_cast<uint8_t>((j % 2) * 64 + (j % 32 / 2) * 4 + 3);
      high[j] = static_cast<uint8_t>(2 * j + 1);
    }
    top_bytes = _mm512_load_si512(idx);
    high_bytes = _mm512_load_si512(high);
  }
};

// Lane i of vector 2h holds element 32h + 2i, of vector 2h + 1 element 32h + 2i + 1.
inline int64_t quotient_lane_element(int64_t lane64) { return lane64 / 32 * 32 + lane64 % 16 * 2 + lane64 % 32 / 16; }

// out = in with every whole 64-element block in the kernel's lane order (the tail as is).
void bf16_lane_order(const float* in, float* out, int64_t n) {
  alignas(64) int32_t even[16], odd[16];  // vpermt2ps indices over 32 elements
  for (int l = 0; l < 16; ++l) even[l] = static_cast<int32_t>(quotient_lane_element(l)), odd[l] = static_cast<int32_t>(quotient_lane_element(16 + l));
  const __m512i even_idx = _mm512_load_si512(even), odd_idx = _mm512_load_si512(odd);
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    for (int h = 0; h < 2; ++h) {
      const __m512 a = _mm512_loadu_ps(in + i + 32 * h), b = _mm512_loadu_ps(in + i + 32 * h + 16);
      _mm512_storeu_ps(out + i + 32 * h, _mm512_permutex2var_ps(a, even_idx, b));
      _mm512_storeu_ps(out + i + 32 * h + 16, _mm512_permutex2var_ps(a, odd_idx, b));
    }
  }
  for (; i < n; ++i) out[i] = in[i];
}

// The codes of 64 bf16 elements at x, vector j under reciprocals r[j] and scales sf[j]
// (lane order above); false (codes unset) when a quotient lies below the least normal.
__attribute__((target("avx512vbmi"))) inline bool quotient_codes_64(const uint16_t* x, const __m512 r[4], const __m512 sf[4],
                                                                    const QuotientConstants& c, __m512i& codes) {
  constexpr int kShift = QuotientConstants::kShift;
  __m512i top[4];
  const __m512i pairs[2] = {_mm512_loadu_si512(x), _mm512_loadu_si512(x + 32)};
  __m512 lowest = _mm512_castsi512_ps(c.high_words);  // (a NaN pattern: vrangeps keeps the other operand)
  for (int j = 0; j < 4; ++j) {
    const __m512 v = _mm512_castsi512_ps(j % 2 ? _mm512_and_si512(pairs[j / 2], c.high_words) : _mm512_slli_epi32(pairs[j / 2], 16));
    const __m512 y0 = _mm512_mul_ps(v, r[j]);
    const __m512 y = _mm512_fmadd_ps(_mm512_fnmadd_ps(y0, sf[j], v), r[j], y0);
    const __m512i b = _mm512_castps_si512(y);
    lowest = _mm512_range_ps(lowest, y, 0x0a);  // min |.|, sign cleared: one uop for and + min
    // Nearest even at the rounding bit (half less one, plus one where the bit is set: a test
    // and a masked add, one op fewer than extracting the bit), on the signed pattern (for
    // normal quotients the sum stays clear of bit 31 and leaves bits 27-30 clear); then the
    // code in the top byte, bit 31 shifted out.
    const __m512i half = _mm512_add_epi32(b, c.half_down);
    const __m512i rounded = _mm512_mask_add_epi32(half, _mm512_test_epi32_mask(b, c.rounding_bit), half, c.one);
    top[j] = _mm512_slli_epi32(rounded, 24 - kShift);
  }
  if (_mm512_cmplt_epu32_mask(_mm512_castps_si512(lowest), c.least)) [[unlikely]] return false;
  // The magnitudes in element order, and x's signs (the sign of each quotient: sf > 0) from
  // the high bytes of its bf16 elements, once per 64 codes rather than once per 16.
  const __m512i magnitudes = _mm512_mask_blend_epi64(0xf0, _mm512_permutex2var_epi8(top[0], c.top_bytes, top[1]),
                                                     _mm512_permutex2var_epi8(top[2], c.top_bytes, top[3]));
  codes = _mm512_ternarylogic_epi32(magnitudes, _mm512_permutex2var_epi8(pairs[0], c.high_bytes, pairs[1]), c.sign_bits, 0xf8);
  return true;
}

template <bool Stream>
inline void store_64(uint8_t* q, __m512i codes) {
  if (Stream && (reinterpret_cast<uintptr_t>(q) & 63) == 0) _mm512_stream_si512(reinterpret_cast<__m512i*>(q), codes);
  else _mm512_storeu_si512(q, codes);
}

// Codes of the whole 64-element blocks of x[i, end), block b's reciprocals and scales from
// load(b, r, s); a block with a quotient below the least normal goes to fallback(b) (the
// generic kernel: a call, which clobbers every vector register, so it sits outside the
// inner loop and the constants stay in registers there). Returns where the blocks end.
template <bool Stream, class Load, class Fallback>
__attribute__((target("avx512vbmi"))) inline int64_t quotient_blocks(const uint16_t* x, uint8_t* q, int64_t i, int64_t end,
                                                                     const uint16_t* prefetch, Load load, Fallback fallback) {
  while (i + 64 <= end) {
    const QuotientConstants c;
    for (; i + 64 <= end; i += 64) {
      if (prefetch) prefetch_block(prefetch + i);
      __m512 r[4], s[4];
      load(i, r, s);
      __m512i codes;
      if (!quotient_codes_64(x + i, r, s, c, codes)) [[unlikely]] break;
      store_64<Stream>(q + i, codes);
    }
    if (i + 64 > end) break;
    fallback(i);
    i += 64;
  }
  return i;
}

// Per-channel: inv_lanes / sf_lanes are RN(1 / sf) and sf in bf16_lane_order; sf itself
// (element order) serves the blocks and the tail left to the generic kernel, which divides.
template <bool Stream>
__attribute__((target("avx512vbmi"))) void e4m3_rows_by_quotients(const uint16_t* x, uint8_t* q, int64_t n, const float* sf,
                                                                  const float* inv_lanes, const float* sf_lanes,
                                                                  const uint16_t* prefetch) {
  auto divide = [&](int64_t i, int64_t len) {
    quantize_span<E4M3, uint16_t, true, false, false>(x + i, q + i, len, sf + i, Reciprocals{}, nullptr);
  };
  const int64_t i = quotient_blocks<Stream>(
      x, q, 0, n, prefetch,
      [&](int64_t b, __m512* r, __m512* s) {
        for (int j = 0; j < 4; ++j) r[j] = _mm512_loadu_ps(inv_lanes + b + 16 * j), s[j] = _mm512_loadu_ps(sf_lanes + b + 16 * j);
      },
      [&](int64_t b) { divide(b, 64); });
  if (i < n) divide(i, n - i);
  if (Stream) _mm_sfence();
}

// Per-token: one scale per group of gran elements, gran a multiple of 64. A group whose
// scale is not a positive normal number (an inf or NaN amax) goes through the generic kernel.
template <bool Stream>
__attribute__((target("avx512vbmi"))) void e4m3_groups_by_quotients(const uint16_t* x, uint8_t* q, int64_t n, const float* sf,
                                                                    int64_t gran, const uint16_t* prefetch) {
  for (int64_t g = 0, i = 0; i < n; ++g, i = min64(n, i + gran)) {
    const int64_t end = min64(n, i + gran);
    if (!is_positive_normal(sf[g])) {  // no bound either
      quantize_span<E4M3, uint16_t, false, false, false>(x + i, q + i, end - i, sf + g, Reciprocals{}, nullptr);
      continue;
    }
    auto bounded = [&](int64_t b, int64_t len) {
      quantize_span<E4M3, uint16_t, false, false, true>(x + b, q + b, len, sf + g, Reciprocals{}, nullptr);
    };
    const __m512 inv = _mm512_set1_ps(1.0f / sf[g]), scale = _mm512_set1_ps(sf[g]);
    const int64_t done = quotient_blocks<Stream>(
        x, q, i, end, prefetch,
        [&](int64_t, __m512* r, __m512* s) {
          for (int j = 0; j < 4; ++j) r[j] = inv, s[j] = scale;
        },
        [&](int64_t b) { bounded(b, 64); });
    if (done < end) bounded(done, end - done);
  }
  if (Stream) _mm_sfence();
}

void quantize_e4m3_bf16(const void* x, uint8_t* q, int64_t n, const float* sf, int64_t gran, bool stream,
                        const void* prefetch, bool scales_from_amax, Reciprocals inv) {
  const auto* in = static_cast<const uint16_t*>(x);
  const auto* next = static_cast<const uint16_t*>(prefetch);
  if (inv.scales != nullptr) {  // (set only where bf16_lane_order is: g_vbmi)
    if (stream) return e4m3_rows_by_quotients<true>(in, q, n, sf, inv.values, inv.scales, next);
    return e4m3_rows_by_quotients<false>(in, q, n, sf, inv.values, inv.scales, next);
  }
  // (ue8m0 groups too: 1.1x the 16-bit path below, per-token FP8 of 2 GiB bf16 on 2 threads
  // and in L2 on one, 2026-12-01)
  if (g_vbmi && scales_from_amax && gran % 64 == 0) {
    if (stream) return e4m3_groups_by_quotients<true>(in, q, n, sf, gran, next);
    return e4m3_groups_by_quotients<false>(in, q, n, sf, gran, next);
  }
  const bool pow2_path = scales_from_amax && is_bf16_pow2_group(gran) && n >= 64 && is_normal_power_of_two(sf[0]);
  (pow2_path ? g_e4m3_bf16_ymm : g_e4m3_bf16_zmm)(x, q, n, sf, gran, stream, prefetch, scales_from_amax, inv);
}

// ---- per-block bf16 -> e4m3 casts through code tables ----
// Write sf = 2^k·f (1 <= f < 2) and P for the bf16 pattern of |x| / 2^k (|x|'s minus k << 7,
// exact). For x / 2^k = 2^e·(1 + m/128) the quotient RN(x / sf) is 2^e·RN((1 + m/128) / f):
// scaling by 2^e commutes with f32 rounding, and, within the e4m3 normal range, with e4m3
// rounding too (whose ties go by the mantissa's parity, which moves with it). So a normal code
// is (P >> 4) + T[m], m = P & 127, with T depending on f alone: one table of 128 int16 per
// scale, looked up 32 lanes at a time by two vpermt2w (each indexes 64 words by P's low six
// bits) and a blend on bit 6. A per-block cast shares each scale between 128 rows, so the
// tables cost under 1 % of the elements' work; per-token scales change every group, and keep
// the reciprocal path. Measured on a 2-vCPU Xeon (AMX host, 2026-12-01): see docs/FORMATS.md.
//
// The same holds lane by lane: with a shift per lane and one table, scales that differ by
// powers of two only (per-channel ue8m0 scales) share the unit scale's table.
//
// Lanes with P <= 0x3a80 (x / 2^k <= 2^-10, so the quotient is at most half the least e4m3
// subnormal) are code 0; those with P >= 0x3d00 (x / 2^k >= 2^-5, the quotient above 2^-6)
// are normal. Lanes between (an e4m3 subnormal, or near one) take the division; a group's
// last < 64 elements go through the general kernel.
constexpr int kTableExponent = 130;  // bf16 exponent field of the probe values (below)

// The table of one scale holds the general kernel's codes of the 128 probes 2^(3+k)·(1 + m/128)
// (quotients in (4, 16): normal, unsaturated), less their (P >> 4). Scales are taken from 2^-100
// to below 2^100: the probes are normal bf16 then, and a bf16 subnormal x lands in the zero
// region (its P stays below 0x3a80). Other scales (and NaN, inf, zero) get kNoTable, and their
// groups the general kernel.
constexpr int16_t kNoTable = INT16_MIN;  // (table entries lie in [-1047, -920])

void e4m3_tables(const float* sf, int64_t groups, int16_t* tables) {
  alignas(64) uint16_t probe[kE4m3TableWords];
  uint8_t codes[kE4m3TableWords];
  for (int64_t g = 0; g < groups; ++g) {
    int16_t* table = tables + g * kE4m3TableWords;
    if (!table_scale(sf[g])) {
      table[0] = kNoTable;
      continue;
    }
    for (int m = 0; m < kE4m3TableWords; ++m) probe[m] = static_cast<uint16_t>(((kTableExponent << 7) + table_shift(sf[g])) | m);
    quantize_span<E4M3, uint16_t, false, false, false>(probe, codes, kE4m3TableWords, sf + g, Reciprocals{}, nullptr);
    for (int m = 0; m < kE4m3TableWords; ++m) table[m] = static_cast<int16_t>(codes[m] - ((kTableExponent << 7 | m) >> 4));
  }
}

// Constants of table_codes, set up once per call so that they stay in registers.
struct TableConstants {
  __m512i magnitude = _mm512_set1_epi16(0x7fff), bit6 = _mm512_set1_epi16(0x40);
  __m512i zero_to = _mm512_set1_epi16(0x3a80), normal_from = _mm512_set1_epi16(0x3d00);
  __m512i max_code = _mm512_set1_epi16(0x7e), sign_code = _mm512_set1_epi16(0x80);
  __m512i qword_order = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);  // undoes packus's lane interleave
};

// Stores the codes of 64 lanes, lo and hi as table_codes gives them (words).
template <bool Stream>
inline void store_codes(uint8_t* q, __m512i lo, __m512i hi, const TableConstants& c) {
  const __m512i codes = _mm512_permutexvar_epi64(c.qword_order, _mm512_packus_epi16(lo, hi));
  if (Stream && (reinterpret_cast<uintptr_t>(q) & 63) == 0) _mm512_stream_si512(reinterpret_cast<__m512i*>(q), codes);
  else _mm512_storeu_si512(q, codes);
}

// Codes of 32 bf16 lanes (as words) from their group's table t[4] and shift (k << 7). The
// lanes the table cannot answer (`unsure`: quotients in or near the e4m3 subnormals) get
// theirs from the quotient itself, x / sf by vdivps and the general kernel's encoder, with
// sf_lo / sf_hi the scales of lanes 0-15 / 16-31.
inline __m512i table_codes(__m512i v, const __m512i t[4], __m512i shift, const TableConstants& c, __m512 sf_lo, __m512 sf_hi) {
  const __m512i magnitude = _mm512_and_si512(v, c.magnitude);
  const __m512i p = _mm512_sub_epi16(magnitude, shift);
  const __m512i low = _mm512_permutex2var_epi16(t[0], p, t[1]), high = _mm512_permutex2var_epi16(t[2], p, t[3]);
  const __m512i offset = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(p, c.bit6), low, high);
  const __mmask32 nonzero = _mm512_cmpgt_epi16_mask(p, c.zero_to);
  const __mmask32 unsure = _mm512_mask_cmplt_epi16_mask(nonzero, p, c.normal_from);
  // (capped at 126, 448: no finite value can become the NaN code, whatever the caller's bound)
  __m512i code = _mm512_min_epi16(_mm512_maskz_add_epi16(nonzero, _mm512_srli_epi16(p, 4), offset), c.max_code);
  if (unsure) [[unlikely]] {
    auto exact = [](__m256i half, __m512 sf) {  // codes of 16 |x| patterns, as words
      const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
      return _mm512_cvtepi32_epi16(encode_bounded<E4M3>(_mm512_div_ps(x, sf)));
    };
    const __m512i quotient_codes = _mm512_inserti64x4(_mm512_castsi256_si512(exact(_mm512_castsi512_si256(magnitude), sf_lo)),
                                                      exact(_mm512_extracti64x4_epi64(magnitude, 1), sf_hi), 1);
    code = _mm512_mask_mov_epi16(code, unsure, quotient_codes);
  }
  // code | (sign of x: bit 15 of v, moved to bit 7)
  return _mm512_ternarylogic_epi32(code, _mm512_srli_epi16(v, 8), c.sign_code, 0xf8);
}

template <bool Stream>
void e4m3_rows_by_table(const uint16_t* x, uint8_t* q, int64_t n, const float* sf, int64_t gran, const int16_t* tables,
                        const uint16_t* prefetch) {
  const TableConstants c;
  for_each_group(n, gran, [&](int64_t g, int64_t i, int64_t end) {
    const int16_t* table = tables + g * kE4m3TableWords;
    if (table[0] == kNoTable)  // (the scale may be inf or NaN: no bound)
      return quantize_span<E4M3, uint16_t, false, false, false>(x + i, q + i, end - i, sf + g, Reciprocals{}, nullptr);
    __m512i t[4];
    for (int j = 0; j < 4; ++j) t[j] = _mm512_loadu_si512(table + 32 * j);
    const __m512i shift = _mm512_set1_epi16(table_shift(sf[g]));
    const __m512 scale = _mm512_set1_ps(sf[g]);
    for (; i + 64 <= end; i += 64) {
      if (prefetch) prefetch_block(prefetch + i);
      store_codes<Stream>(q + i, table_codes(_mm512_loadu_si512(x + i), t, shift, c, scale, scale),
                          table_codes(_mm512_loadu_si512(x + i + 32), t, shift, c, scale, scale), c);
    }
    if (i < end) quantize_span<E4M3, uint16_t, false, false, true>(x + i, q + i, end - i, sf + g, Reciprocals{}, nullptr);
  });
  if (Stream) _mm_sfence();
}

// Per-channel casts under power-of-two scales: one scale 2^k_i per element (column), so every
// lane has its own shift and all share the unit scale's table.
template <bool Stream>
void e4m3_rows_by_shifts(const uint16_t* x, uint8_t* q, int64_t n, const float* sf, const int16_t* shift,
                         const int16_t* unit_table, const uint16_t* prefetch) {
  const TableConstants c;
  __m512i t[4];
  for (int j = 0; j < 4; ++j) t[j] = _mm512_loadu_si512(unit_table + 32 * j);
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    if (prefetch) prefetch_block(prefetch + i);
    const __m512i lo = table_codes(_mm512_loadu_si512(x + i), t, _mm512_loadu_si512(shift + i), c, _mm512_loadu_ps(sf + i),
                                   _mm512_loadu_ps(sf + i + 16));
    const __m512i hi = table_codes(_mm512_loadu_si512(x + i + 32), t, _mm512_loadu_si512(shift + i + 32), c,
                                   _mm512_loadu_ps(sf + i + 32), _mm512_loadu_ps(sf + i + 48));
    store_codes<Stream>(q + i, lo, hi, c);
  }
  if (i < n) quantize_span<E4M3, uint16_t, true, false, false>(x + i, q + i, n - i, sf + i, Reciprocals{}, nullptr);
  if (Stream) _mm_sfence();
}

void quantize_e4m3_shifts(const uint16_t* x, uint8_t* q, int64_t n, const float* sf, const int16_t* shift,
                          const int16_t* unit_table, bool stream, const uint16_t* prefetch) {
  if (stream) e4m3_rows_by_shifts<true>(x, q, n, sf, shift, unit_table, prefetch);
  else e4m3_rows_by_shifts<false>(x, q, n, sf, shift, unit_table, prefetch);
}

void quantize_e4m3_tables(const uint16_t* x, uint8_t* q, int64_t n, const float* sf, int64_t gran, const int16_t* tables,
                          bool stream, const uint16_t* prefetch) {
  if (stream) e4m3_rows_by_table<true>(x, q, n, sf, gran, tables, prefetch);
  else e4m3_rows_by_table<false>(x, q, n, sf, gran, tables, prefetch);
}

// ---- e2m1 casts of bf16 by thresholds per scale ----
// An e2m1 code counts the rounding boundaries b = 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 that
// q = RN(|x| / sf) passes: q > b where the tie goes down (to the even code), q >= b where it
// goes up (0.75, 1.75, 3.5). In f32, q > b iff |x| / sf > b + ulp(b)/2 (the tie at b + ulp/2
// rounds to b, which is even), and q >= b iff |x| / sf >= b - ulp(b)/2; those bounds times
// sf are exact in f64 (at most 26 + 24 significant bits), and the first bf16 at or above
// (strictly above) that product is the group's threshold T_b. Since q is monotone in |x|, a
// code is the number of thresholds the |x| pattern reaches, found by a binary search over
// the group's seven 16-bit thresholds held in one register: three compares for 32 lanes, the
// second and third threshold picked per lane by vpermw (2026-12-04; seven compares before,
// 1.5x slower on Zen 4). No division and no widening.
struct E2m1Bound {
  double value;
  bool strict;
};
constexpr E2m1Bound kE2m1Bounds[7] = {{0.25 + 0x1p-26, true}, {0.75 - 0x1p-25, false}, {1.25 + 0x1p-24, true},
                                      {1.75 - 0x1p-24, false}, {2.5 + 0x1p-23, true},  {3.5 - 0x1p-23, false},
                                      {5.0 + 0x1p-22, true}};
constexpr int64_t kE2m1Chunk = 64;  // groups whose thresholds are made at a time
constexpr int kE2m1Words = 8;       // words per group in the thresholds (T_0..T_6, one unused)

// thresholds[g * kE2m1Words + b]: T_b of group g < groups, every sf a table_scale (its bounds
// are normal bf16). bf16 values are f64 values with 7 mantissa bits, so the first bf16 at
// or above a bound is the bound's f64 pattern rounded up at bit 45, re-biased from 1023 to
// 127 and shifted down (as the AVX2 target does; 2026-12-04, where this went through the
// nearest f32 and a rounding add). The strict bounds' next-double-up step cannot change a
// bf16 threshold (docs/FORMATS.md), but it costs nothing here.
void e2m1_thresholds(const float* sf, int64_t groups, uint16_t* thresholds) {
  constexpr int64_t kLow = (int64_t{1} << 45) - 1, kRebias = int64_t{1023 - 127} << 52;
  auto up = [&](int b) { return (kE2m1Bounds[b].strict ? kLow + 1 : kLow) - kRebias; };
  const __m512d bounds = _mm512_setr_pd(kE2m1Bounds[0].value, kE2m1Bounds[1].value, kE2m1Bounds[2].value, kE2m1Bounds[3].value,
                                        kE2m1Bounds[4].value, kE2m1Bounds[5].value, kE2m1Bounds[6].value, 1.0);
  const __m512i round_up = _mm512_setr_epi64(up(0), up(1), up(2), up(3), up(4), up(5), up(6), kLow - kRebias);
  for (int64_t g = 0; g < groups; ++g) {
    const __m512d bound = _mm512_mul_pd(_mm512_set1_pd(static_cast<double>(sf[g])), bounds);
    const __m512i bf16 = _mm512_srli_epi64(_mm512_add_epi64(_mm512_castpd_si512(bound), round_up), 45);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(thresholds + g * kE2m1Words), _mm512_cvtepi64_epi16(bf16));
  }
}

// code | x's sign in bit 3, for 32 words.
inline __m512i with_sign(__m512i code, __m512i v) {
  return _mm512_ternarylogic_epi32(code, _mm512_srli_epi16(v, 12), _mm512_set1_epi16(0x8), 0xf8);
}

// Word codes (sign in bit 3) of 32 bf16 lanes under one group's thresholds: t holds T_0..T_6
// in words 0-6, t3 is T_3 in every word. code >= 4 iff |x| reaches T_3; then T_1 or T_5 adds
// 2, then T_c (c = 0, 2, 4 or 6) adds 1 (the thresholds increase with b).
inline __m512i e2m1_codes_by_thresholds(__m512i v, __m512i t, __m512i t3) {
  const __m512i magnitude = _mm512_and_si512(v, _mm512_set1_epi16(0x7fff));
  const __mmask32 upper = _mm512_cmpge_epu16_mask(magnitude, t3);
  const __m512i half = _mm512_maskz_mov_epi16(upper, _mm512_set1_epi16(4));
  const __m512i middle = _mm512_mask_mov_epi16(_mm512_set1_epi16(1), upper, _mm512_set1_epi16(5));  // half + 1
  const __mmask32 quarter_up = _mm512_cmpge_epu16_mask(magnitude, _mm512_permutexvar_epi16(middle, t));
  const __m512i quarter = _mm512_mask_add_epi16(half, quarter_up, half, _mm512_set1_epi16(2));
  const __mmask32 last_up = _mm512_cmpge_epu16_mask(magnitude, _mm512_permutexvar_epi16(quarter, t));
  return with_sign(_mm512_mask_add_epi16(quarter, last_up, quarter, _mm512_set1_epi16(1)), v);
}

// Bytes of 32 word codes, two per byte (element 2d in the low nibble of byte d): dword d
// holds codes 2d (low word) and 2d + 1 (high word), so its low byte is low | high << 4.
// (vpmaddwd for the pair, or vpermb for the gather, measured slower on Zen 4.)
inline __m128i pack_nibbles(__m512i code) { return _mm512_cvtepi32_epi8(_mm512_or_si512(code, _mm512_srli_epi32(code, 12))); }

QuantizeKernel g_e2m1_bf16_general = nullptr;  // for rows the thresholds do not take, and tails

// ---- e2m1 casts of bf16 with power-of-two scales, by a table of the quotient's pattern ----
// With sf = 2^s, q = |x| / sf is |x|'s bf16 pattern minus s · 128 (exact while both are
// normal), and every rounding boundary of e2m1 (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) is the
// first pattern of a run of 32 patterns (0x3e80, 0x3f40, ...: at most two significant
// mantissa bits). So the code of q depends only on its run (q >> 5) and on whether it is
// the run's first pattern (where the ties sit): a 64-word table indexed by the run, plus 32
// past a first pattern, does what seven compares against per-group thresholds did. Patterns
// are offset by the run below 0.25 (kE2m1FirstRun), so that runs below it are clamped to 0 and
// runs go up to 6.0's (0x40c0 >> 5) at most: amax / sf <= 6 for the scales this is given.
constexpr int kE2m1FirstRun = (0x3e80 >> 5) - 1;
// Scales 2^s with s from -100 (a subnormal x then gives q below 2^-26: code 0, as the pattern
// arithmetic also does) to 127. (The casts clamp amax at 1e-4, so their scales stay above
// 2^-16; the bound is the kernel's own guard.)
constexpr int kE2m1LowestShift = -100;

struct E2m1RunTable {
  __m512i first, rest;  // entries 0-31 (the run's first pattern), 32-63 (the others)
  E2m1RunTable() {
    alignas(64) uint16_t codes[64];
    for (int run = 0; run < 32; ++run)
      for (int past_first = 0; past_first < 2; ++past_first) {
        const auto pattern = static_cast<uint32_t>(((kE2m1FirstRun + run) << 5) + past_first);
        codes[past_first * 32 + run] = static_cast<uint16_t>(encode_scalar(Narrow::e2m1, std::bit_cast<float>(pattern << 16)) & 7);
      }
    first = _mm512_load_si512(codes);
    rest = _mm512_load_si512(codes + 32);
  }
};

// The first min(count, 16) lanes of 16 (count > 0).
inline __mmask16 first_lanes16(int64_t count) {
  return count >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << count) - 1);
}

// offset[g]: the pattern offset of group g's scale 2^s, s · 128 + kE2m1FirstRun · 32, in both
// halves of the word; false if some scale is not 2^s with s in [kE2m1LowestShift, 127].
// (16 groups at a time: a scalar loop here was as slow as the codes themselves.)
bool e2m1_run_offsets(const float* sf, int64_t groups, int32_t* offset) {
  const __m512i other_bits = _mm512_set1_epi32(static_cast<int>(0x807fffffu));
  const __m512i lowest = _mm512_set1_epi32(kE2m1LowestShift + 127), highest = _mm512_set1_epi32(127 + 127);
  for (int64_t g = 0; g < groups; g += 16) {
    const __mmask16 live = first_lanes16(groups - g);
    const __m512i bits = _mm512_maskz_loadu_epi32(live, sf + g);
    const __m512i field = _mm512_srli_epi32(bits, 23);  // s + 127 (the sign bit is in other_bits)
    const __mmask16 bad = _mm512_mask_test_epi32_mask(live, bits, other_bits) | _mm512_mask_cmplt_epi32_mask(live, field, lowest) |
                          _mm512_mask_cmpgt_epi32_mask(live, field, highest);
    if (bad) return false;
    const __m512i o = _mm512_and_si512(_mm512_add_epi32(_mm512_slli_epi32(field, 7), _mm512_set1_epi32(kE2m1FirstRun * 32 - 127 * 128)),
                                       _mm512_set1_epi32(0xffff));
    _mm512_mask_storeu_epi32(offset + g, live, _mm512_or_si512(o, _mm512_slli_epi32(o, 16)));
  }
  return true;
}

// Word codes of 32 lanes of bf16 v with the group's offset (e2m1_run_offsets), as
// e2m1_codes_by_thresholds.
inline __m512i e2m1_codes_by_run(const E2m1RunTable& table, __m512i v, __m512i offset) {
  const __m512i q = _mm512_max_epi16(_mm512_subs_epi16(_mm512_and_si512(v, _mm512_set1_epi16(0x7fff)), offset),
                                     _mm512_setzero_si512());
  const __mmask32 past_first = _mm512_test_epi16_mask(q, _mm512_set1_epi16(31));
  const __m512i run = _mm512_srli_epi16(q, 5);  // (at most 19, as q <= 6: bit 5 is free)
  const __m512i index = _mm512_mask_add_epi16(run, past_first, run, _mm512_set1_epi16(32));
  __m512i code = _mm512_permutex2var_epi16(table.first, index, table.rest);
  return with_sign(code, v);
}

// Codes of x[0, count) (count a multiple of 32) of the groups from the chunk's first, gran
// elements each (a multiple of 32): by the run table (ByRun: offsets) or by thresholds. Stream:
// non-temporal stores (q 16-byte aligned).
template <bool Stream, bool ByRun>
void e2m1_span(const uint16_t* x, uint8_t* q, int64_t count, int64_t gran, const int32_t* offsets, const uint16_t* thresholds,
               const uint16_t* next) {
  static const E2m1RunTable run_table;
  const E2m1RunTable table = run_table;  // (a local copy: the compiler keeps it in registers)
  auto codes = [&](int64_t g, __m512i v) {
    if constexpr (ByRun) {
      return e2m1_codes_by_run(table, v, _mm512_set1_epi32(offsets[g]));
    } else {
      const uint16_t* t = thresholds + g * kE2m1Words;
      return e2m1_codes_by_thresholds(v, _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t))),
                                      _mm512_set1_epi16(static_cast<int16_t>(t[3])));
    }
  };
  auto put = [&](int64_t i, int64_t g) {
    if (next) __builtin_prefetch(next + i, 0, 2);
    const __m128i bytes = pack_nibbles(codes(g, _mm512_loadu_si512(x + i)));
    if constexpr (Stream) _mm_stream_si128(reinterpret_cast<__m128i*>(q + i / 2), bytes);
    else _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i / 2), bytes);
  };
  if (gran == 32) {  // (one vector a group: a flat loop; per group, its bookkeeping cost 5-10 %)
    for (int64_t i = 0; i < count; i += 32) put(i, i / 32);
    return;
  }
  for (int64_t i = 0, g = 0; i < count; ++g)
    for (const int64_t end = min64(count, i + gran); i < end; i += 32) put(i, g);
}

using E2m1Span = void (*)(const uint16_t*, uint8_t*, int64_t, int64_t, const int32_t*, const uint16_t*, const uint16_t*);
template <bool Stream>
E2m1Span e2m1_span_for(bool by_run) {
  return by_run ? &e2m1_span<Stream, true> : &e2m1_span<Stream, false>;
}

void quantize_e2m1_bf16(const void* xv, uint8_t* q, int64_t n, const float* sf, int64_t gran, bool stream,
                        const void* prefetch, bool scales_from_amax, Reciprocals inv) {
  const int64_t groups = ceil_div(n, gran);
  bool take = scales_from_amax && gran % 32 == 0 && n >= 64, table_scales = true;
  // Positive normal scales (the bound holds), and whether all are table_scales (the
  // thresholds' range), 16 at a time.
  for (int64_t g = 0; take && g < groups; g += 16) {
    const __mmask16 live = first_lanes16(groups - g);
    const __m512i bits = _mm512_maskz_loadu_epi32(live, sf + g);
    const __m512i biased = _mm512_sub_epi32(bits, _mm512_set1_epi32(0x00800000));
    take = _mm512_mask_cmpge_epu32_mask(live, biased, _mm512_set1_epi32(0x7f000000)) == 0;
    const __m512i field = _mm512_sub_epi32(_mm512_srli_epi32(bits, 23), _mm512_set1_epi32(127 - 100));
    table_scales &= _mm512_mask_cmpge_epu32_mask(live, field, _mm512_set1_epi32(200)) == 0;
  }
  if (!take) return g_e2m1_bf16_general(xv, q, n, sf, gran, stream, prefetch, scales_from_amax, inv);
  const auto* x = static_cast<const uint16_t*>(xv);
  const auto* next = static_cast<const uint16_t*>(prefetch);
  const bool streamed = stream && (reinterpret_cast<uintptr_t>(q) & 15) == 0;
  alignas(64) uint16_t thresholds[kE2m1Chunk * kE2m1Words];
  alignas(64) int32_t offsets[kE2m1Chunk];
  const int64_t whole = n / 32 * 32;  // (the last partial vector goes to the general kernel)
  int64_t i = 0;
  for (int64_t g0 = 0; g0 < groups && i < whole; g0 += kE2m1Chunk) {
    const int64_t chunk = min64(kE2m1Chunk, groups - g0);
    const int64_t end = min64(whole, (g0 + chunk) * gran);
    // Power-of-two scales (the ue8m0 recipes) by the run table, other table scales by
    // thresholds, anything else (beyond 2^±100) by the general kernel.
    const bool by_run = e2m1_run_offsets(sf + g0, chunk, offsets);
    if (!by_run && !table_scales) {
      g_e2m1_bf16_general(x + i, q + i / 2, end - i, sf + g0, gran, stream, nullptr, scales_from_amax, inv);
    } else {
      if (!by_run) e2m1_thresholds(sf + g0, chunk, thresholds);
      const E2m1Span span = streamed ? e2m1_span_for<true>(by_run) : e2m1_span_for<false>(by_run);
      span(x + i, q + i / 2, end - i, gran, offsets, thresholds, next ? next + i : nullptr);
    }
    i = end;
  }
  if (streamed) _mm_sfence();
  if (i < n) g_e2m1_bf16_general(x + i, q + i / 2, n - i, sf + i / gran, gran, false, nullptr, scales_from_amax, inv);
}

// ---- e2m1 dequantisation through a table per scale ----
// A group's outputs are one of 16 values, wide(decode(c)·sf) for the 16 codes c: computed
// once per group (one vmulps of the signed magnitudes, the same products the general kernel
// forms, then its bf16 rounding), they make a table that vpermw (bf16: 32 outputs) or vpermps
// (f32: 16) indexes by the codes themselves. Index words (dwords) are the bytes' low and high
// nibbles in element order; bits the permutes ignore may hold anything.
using DequantizeKernel = void (*)(const uint8_t*, void*, int64_t, const float*, int64_t);
DequantizeKernel g_e2m1_general[2] = {nullptr, nullptr};  // the generic kernels, for tails and other groups

inline __m512 e2m1_values(float sf) {
  static constexpr float kSigned[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                        -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  return _mm512_mul_ps(_mm512_loadu_ps(kSigned), _mm512_set1_ps(sf));
}

template <class Out>
void dequantize_e2m1_tables(const uint8_t* q, void* outv, int64_t n, const float* sf, int64_t gran) {
  const int wide = std::is_same_v<Out, float> ? static_cast<int>(Wide::f32) : static_cast<int>(Wide::bf16);
  if (gran % 32 != 0) return g_e2m1_general[wide](q, outv, n, sf, gran);
  Out* out = static_cast<Out*>(outv);
  const __m512i low_nibble = _mm512_set1_epi32(0x0f);
  for_each_group(n, gran, [&](int64_t g, int64_t i, int64_t end) {
    const __m512 values = e2m1_values(sf[g]);
    if constexpr (std::is_same_v<Out, float>) {
      for (; i + 16 <= end; i += 16) {
        const __m512i b = _mm512_cvtepu8_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i / 2)));
        // dword 2j: byte j's low nibble; dword 2j + 1: its high nibble (b << 28, above bit 31)
        const __m512i idx = _mm512_ternarylogic_epi64(b, _mm512_slli_epi64(b, 28), _mm512_set1_epi64(0x0f), 0xec);
        _mm512_storeu_ps(out + i, _mm512_permutexvar_ps(idx, values));
      }
    } else {
      const __m512i table = _mm512_castsi256_si512(_mm512_cvtepi32_epi16(bf16_bits(values)));  // 16 words
      for (; i + 32 <= end; i += 32) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i / 2)));
        // word 2j: byte j's low nibble (bits 12-15 from the shift are ignored); word 2j + 1: high
        const __m512i idx = _mm512_ternarylogic_epi32(b, _mm512_slli_epi32(b, 12), low_nibble, 0xec);
        _mm512_storeu_si512(out + i, _mm512_permutexvar_epi16(idx, table));
      }
    }
    if (i < end) g_e2m1_general[wide](q + i / 2, out + i, end - i, sf + g, end - i);
  });
}

// ---- e4m3 -> bf16 dequantisation through a table per scale ----
// A normal code with exponent field e and mantissa j is 2^(e-1)·(2^-6·(1 + j/8)), so its
// product with sf, rounded to f32 and then to bf16, is 2^(e-1) times that of field 1 (both
// roundings commute with the power of two while the results stay normal; a table_scale
// keeps them so): its bf16 pattern is the field-1 pattern plus (e - 1) << 7. With
// the eight subnormal codes' patterns beside them, 16 words per scale (one vmulps and the
// general kernel's bf16 rounding) give every code's output by one vpermw and an add; the
// sign flips the result (rounding is symmetric), and the NaN codes give the general kernel's
// quiet NaN.
DequantizeKernel g_e4m3_bf16_general = nullptr;

inline __m512i e4m3_bf16_table(float sf) {
  static constexpr float kProbes[16] = {0x1p-6f, 0x1.2p-6f, 0x1.4p-6f, 0x1.6p-6f, 0x1.8p-6f, 0x1.ap-6f, 0x1.cp-6f, 0x1.ep-6f,
                                        0.0f,    0x1p-9f,   0x2p-9f,   0x3p-9f,   0x4p-9f,   0x5p-9f,   0x6p-9f,   0x7p-9f};
  const __m512i patterns = bf16_bits(_mm512_mul_ps(_mm512_loadu_ps(kProbes), _mm512_set1_ps(sf)));
  // (normal entries less field 1's 1 << 7, which the code's own field adds back)
  return _mm512_castsi256_si512(_mm512_cvtepi32_epi16(_mm512_mask_sub_epi32(patterns, 0x00ff, patterns, _mm512_set1_epi32(1 << 7))));
}

void dequantize_e4m3_bf16(const uint8_t* q, void* outv, int64_t n, const float* sf, int64_t gran) {
  if (gran % 32 != 0) return g_e4m3_bf16_general(q, outv, n, sf, gran);
  auto* out = static_cast<uint16_t*>(outv);
  const __m512i field = _mm512_set1_epi16(0x78), low3 = _mm512_set1_epi16(7), subnormal_entry = _mm512_set1_epi16(8);
  const __m512i magnitude = _mm512_set1_epi16(0x7f), quiet_nan = _mm512_set1_epi16(0x7fc0), sign = _mm512_set1_epi16(static_cast<int16_t>(0x8000));
  for_each_group(n, gran, [&](int64_t g, int64_t i, int64_t end) {
    if (!table_scale(sf[g])) return g_e4m3_bf16_general(q + i, out + i, end - i, sf + g, end - i);
    const __m512i table = e4m3_bf16_table(sf[g]);
    for (; i + 32 <= end; i += 32) {
      const __m512i c = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i)));
      const __m512i j = _mm512_and_si512(c, low3);
      const __m512i idx = _mm512_mask_add_epi16(j, _mm512_testn_epi16_mask(c, field), j, subnormal_entry);
      __m512i v = _mm512_add_epi16(_mm512_permutexvar_epi16(idx, table), _mm512_slli_epi16(_mm512_and_si512(c, field), 4));
      v = _mm512_mask_mov_epi16(v, _mm512_cmpeq_epi16_mask(_mm512_and_si512(c, magnitude), magnitude), quiet_nan);
      _mm512_storeu_si512(out + i, _mm512_ternarylogic_epi32(v, _mm512_slli_epi16(c, 8), sign, 0x78));  // v ^ (sign of c)
    }
    if (i < end) g_e4m3_bf16_general(q + i, out + i, end - i, sf + g, end - i);
  });
}

}  // namespace

// The table in three layers, each measured against the one below (docs/FORMATS.md):
// 1. the generic 512-bit kernels (formats_simd.inc);
// 2. AVX2 entries where that target's fast paths won on Sapphire Rapids / Emerald Rapids
//    (e2m1 quantisation 1.4-1.8x, e4m3 dequantisation through F16C 1.0-1.15x, bf16 amaxes on
//    16-bit lanes, ue8m0 bf16->e4m3 rows);
// 3. the table kernels above for bf16 (and FP4 dequantisation), measured on the AMX host
//    (2026-12-01), which fall back on layer 1 or 2 for what they do not take.
const FormatKernels& format_kernels_avx512() {
  static const FormatKernels table = [] {
    FormatKernels t = make_table();
    const FormatKernels& avx2 = format_kernels_avx2();
    for (int wide = 0; wide < 2; ++wide) {
      t.quantize[static_cast<int>(Narrow::e2m1)][wide] = avx2.quantize[static_cast<int>(Narrow::e2m1)][wide];
      t.dequantize[static_cast<int>(Narrow::e4m3)][wide] = avx2.dequantize[static_cast<int>(Narrow::e4m3)][wide];
    }
    const int e4m3 = static_cast<int>(Narrow::e4m3), bf16 = static_cast<int>(Wide::bf16);
    g_e4m3_bf16_zmm = t.quantize[e4m3][bf16];
    g_e4m3_bf16_ymm = avx2.quantize[e4m3][bf16];
    g_vbmi = cpu_features().avx512vbmi;
    if (g_vbmi) t.bf16_lane_order = &bf16_lane_order;
    t.quantize[e4m3][bf16] = &quantize_e4m3_bf16;
    // bf16 amaxes on 16-bit lanes (the AVX2 target's kBf16Amax kernels) rather than widened
    // (1.1-1.4x for the FP4 cast, whose groups of 32 make the amax pass a third of its work).
    t.amax_groups[static_cast<int>(Wide::bf16)] = avx2.amax_groups[static_cast<int>(Wide::bf16)];
    t.amax_accumulate_bf16 = &amax_accumulate_bf16<V>;
    // Layer 3 (above); each keeps the entry it replaces for the cases it leaves.
    for (int wide = 0; wide < 2; ++wide) g_e2m1_general[wide] = t.dequantize[static_cast<int>(Narrow::e2m1)][wide];
    t.dequantize[static_cast<int>(Narrow::e2m1)][static_cast<int>(Wide::f32)] = &dequantize_e2m1_tables<float>;
    t.dequantize[static_cast<int>(Narrow::e2m1)][static_cast<int>(Wide::bf16)] = &dequantize_e2m1_tables<uint16_t>;
    g_e4m3_bf16_general = t.dequantize[static_cast<int>(Narrow::e4m3)][static_cast<int>(Wide::bf16)];
    t.dequantize[static_cast<int>(Narrow::e4m3)][static_cast<int>(Wide::bf16)] = &dequantize_e4m3_bf16;
    g_e2m1_bf16_general = t.quantize[static_cast<int>(Narrow::e2m1)][static_cast<int>(Wide::bf16)];
    t.quantize[static_cast<int>(Narrow::e2m1)][static_cast<int>(Wide::bf16)] = &quantize_e2m1_bf16;
    t.e4m3_tables = &e4m3_tables;
    t.quantize_e4m3_tables = &quantize_e4m3_tables;
    t.quantize_e4m3_shifts = &quantize_e4m3_shifts;
    return t;
  }();
  return table;
}

}  // namespace moekit::detail

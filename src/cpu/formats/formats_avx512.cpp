// AVX-512 target (16 lanes, F/BW/VL/DQ). Only reached via dispatch on CPUs that have it.
#include <immintrin.h>

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
  static void fence() {}  // no streaming stores on this target
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
  // ---- cast fast path (formats_simd.inc: reciprocal_codes, encode_bounded) ----
  // A zmm vdivps issues once per 10-16 cycles on Intel cores, most of the cast's time.
  static constexpr bool kFastCasts = true;
  static I xor_(I a, I b) { return _mm512_xor_si512(a, b); }
  static bool none(I a) { return _mm512_test_epi32_mask(a, a) == 0; }
  static I round_int(F a) { return _mm512_cvtps_epi32(a); }  // current rounding mode: nearest-even
  static I max(I a, I b) { return _mm512_max_epi32(a, b); }
  static F lut8(const float* table, I idx) {
    return _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(_mm256_load_ps(table)));  // idx < 8
  }
  static F to_float(I a) { return _mm512_cvtepi32_ps(a); }
  static int32_t hmax(I a) { return _mm512_reduce_max_epi32(a); }

  static F load_f32(const float* p) { return _mm512_loadu_ps(p); }
  static void store_f32(float* p, F a) { _mm512_storeu_ps(p, a); }
  static I load_u16(const uint16_t* p) { return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static void store_u16(uint16_t* p, I a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(a)); }
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
// qualifies goes there; either kernel gives the same codes for any row.
using QuantizeKernel = void (*)(const void*, uint8_t*, int64_t, const float*, int64_t, bool, const void*, bool, Reciprocals);
QuantizeKernel g_e4m3_bf16_zmm = nullptr, g_e4m3_bf16_ymm = nullptr;

void quantize_e4m3_bf16(const void* x, uint8_t* q, int64_t n, const float* sf, int64_t gran, bool stream,
                        const void* prefetch, bool scales_from_amax, Reciprocals inv) {
  const bool pow2_path = scales_from_amax && is_bf16_pow2_group(gran) && n >= 64 && is_normal_power_of_two(sf[0]);
  (pow2_path ? g_e4m3_bf16_ymm : g_e4m3_bf16_zmm)(x, q, n, sf, gran, stream, prefetch, scales_from_amax, inv);
}

}  // namespace

// Measured on Sapphire Rapids (bench formats --peer-isa avx2: alternating runs, DRAM-sized
// and in-cache, 16 threads and one; docs/FORMATS.md): the AVX2 target's fast paths (casts
// by reciprocal, e4m3 decoding through F16C), which this generic 512-bit target lacks, win
// for e2m1 quantisation (1.4-1.8x) and e4m3 dequantisation (1.0-1.15x); those entries come
// from the AVX2 table, the rest (even, or faster here: per-channel 1.1-1.27x) stay 512-bit.
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
    t.quantize[e4m3][bf16] = &quantize_e4m3_bf16;
    // bf16 amaxes on 16-bit lanes (the AVX2 target's kBf16Amax kernels) rather than widened
    // (1.1-1.4x for the FP4 cast, whose groups of 32 make the amax pass a third of its work).
    t.amax_groups[static_cast<int>(Wide::bf16)] = avx2.amax_groups[static_cast<int>(Wide::bf16)];
    t.amax_accumulate_bf16 = avx2.amax_accumulate_bf16;
    return t;
  }();
  return table;
}

}  // namespace moekit::detail

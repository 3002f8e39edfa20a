// AMX target (Isa::amx): a 32 x 32 f32 output tile held as four 16 x 16 AMX tiles, fed by
// bf16 micro-panels laid out as the tiles load them. Reached via dispatch only, on CPUs
// with AMX-BF16 that the OS granted to this process. The packing of those panels (AVX-512
// code only) and the register-decoded dot products for a few rows of A (dot_row_amx.inc)
// also serve the avx512_bf16 target (bf16_panels.h, gemm_avx512_bf16.cpp).
//
// Accuracy class: tdpbf16ps sums each pair of products into the f32 accumulator with its own
// rounding and flushes denormal inputs and outputs, so the results are not the FMA paths'
// bits; they are the same on every run and for any thread count (fixed K blocks, fixed
// order of 32-deep steps within a block).
//
// FP8/FP4 operands are decoded to bf16 while packing, which is exact. Power-of-two scales
// are folded into the bf16 values (exact); other scales stay beside the raw values and are
// promoted per K group (prepare() below decides, per operand).
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "core/scratch.h"
#include "moekit/runtime.h"
#include "cpu/formats/format_kernels.h"
#include "bf16_panels.h"
#include "gemm_kernels.h"

namespace moekit::detail {
namespace {

#include "gemm_decode.inc"

using bf16_panels::kHeaderFloats;
using bf16_panels::kStep;  // K per tdpbf16ps (16 pairs)
using bf16_panels::PanelHeader;
using bf16_panels::panel_floats;
using bf16_panels::panel_steps;
using bf16_panels::scales_offset;
using bf16_panels::step_count;

constexpr int kMr = bf16_panels::kWidth, kNr = bf16_panels::kWidth;
constexpr int64_t kStreamM = 32;  // rows of A that take the streaming small-M kernel
constexpr int kTileBytes = bf16_panels::kBlockBytes;  // an AMX tile: 16 rows x 64 bytes
// K block: long, because the partial sums of C go through memory once per block (at
// 2048, 8 bytes per 4096 FLOPs). Measured on 2 cores of a Xeon with AMX, bf16 4096 x 2112
// x 7168: 1.42 TF/s at 256, 1.77 at 1024, 1.94 at 2048 (mc 96); mc 192: 2.17.
constexpr int64_t kKc = bf16_panels::kMaxKc;
constexpr int64_t kMc = 192;
// Passes (GemmKernels::pass_k): 16 steps, so that a B panel's pass (32 KiB) stays in the 48
// KiB L1 while the column's A panels stream past it (with the no-reuse hint). On 1 thread of
// the AMX Xeon, bf16 2048 x 2112 x 7168: whole 64-step tiles 54.6-57.2 ms, passes of 8
// steps 52.5-53.3, 12 44.0-46.4, 16 44.2-48.2, 20 48.5-49.2, 24 56.1-57.8 (B's pass no
// longer in L1). With K blocks of 1024 and 256-512 rows (more tiles per pass) no faster.
constexpr int64_t kPassK = 16 * bf16_panels::kStep;
// Rows of A that take medium_m: at 256 x 7168 x 2048 (2 threads) it took 3.0-3.1 ms against
// 4.3-4.5 on the blocked path (bf16; FP8 4.0 against 4.8); at 384 x 4096 x 7168 about even.
constexpr int64_t kMediumM = 256;
constexpr int64_t kMaxWords = kKc / 2;
// Small M: K decoded per strip of 32 weight rows at a time (32 x 512 bytes of bf16).
constexpr int64_t kChunk = 256;
constexpr int64_t kChunkWords = kChunk / 2;

// ldtilecfg's 64-byte operand, palette 1: tiles 0-3 hold C (16 x 16 f32), 4-5 A (16 rows x
// 32 bf16), 6-7 B (16 pairs of K x 16 columns).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) {
      rows[t] = 16;
      bytes_per_row[t] = 64;
    }
  }
};

// Loaded on every tile call: other AMX users on the same thread (oneDNN, the peak loop) may
// have configured the tiles differently since the last call.
void configure() {
  static const TileConfig config;
  _tile_loadconfig(&config);
}

// ---------------------------------------------------------------- packing
// (The panel format: bf16_panels.h.) Packing starts from "words": the operand's rows as
// 32-bit bf16 pairs along K.

// Rows [i0, i0 + rows) x K [k0, k0 + kc) of a K-major bf16 operand as words:
// out[r * ldw + p] holds elements (k0 + 2p, k0 + 2p + 1) of row i0 + r (low half first),
// zero past the operand and up to ldw words.
void load_words(const GemmOperand& op, int64_t i0, int rows, int64_t k0, int64_t kc, uint32_t* out, int64_t ldw) {
  for (int r = 0; r < kMr; ++r) std::memset(out + r * ldw, 0, static_cast<size_t>(ldw) * 4);
  for (int r = 0; r < rows; ++r) std::memcpy(out + r * ldw, op.data + ((i0 + r) * op.ld + k0) * 2, static_cast<size_t>(kc) * 2);
}

// Two rows of 32 bf16 (K = 2p and 2p + 1 of 32 operand rows) as the 32 words of pair p:
// pairs[r] = lo[r] | hi[r] << 16.
inline void interleave_pair(__m512i lo, __m512i hi, uint32_t* pairs) {
  static const __m512i first = [] {
    alignas(64) uint16_t idx[32];
    for (int i = 0; i < 16; ++i) idx[2 * i] = static_cast<uint16_t>(i), idx[2 * i + 1] = static_cast<uint16_t>(32 + i);
    return _mm512_load_si512(idx);
  }();
  static const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(16));
  _mm512_storeu_si512(pairs, _mm512_permutex2var_epi16(lo, first, hi));
  _mm512_storeu_si512(pairs + 16, _mm512_permutex2var_epi16(lo, second, hi));
}

// Pair p of an MN-major bf16 operand's panel q (stored rows k and k + 1 hold the operand's
// rows side by side; `lo` and `hi` point at their column mn0, null past K): the panel's 32
// columns of both (zero past `count` columns from mn0) as 32 words lo | hi << 16.
inline void panel_pair(const uint8_t* lo, const uint8_t* hi, int64_t q, int64_t count, uint32_t* pairs) {
  const int64_t cols = std::min<int64_t>(kMr, count - q * kMr);
  const __mmask32 valid = cols >= 32 ? ~__mmask32{0} : (__mmask32{1} << cols) - 1;
  interleave_pair(lo ? _mm512_maskz_loadu_epi16(valid, lo + q * kMr * 2) : _mm512_setzero_si512(),
                  hi ? _mm512_maskz_loadu_epi16(valid, hi + q * kMr * 2) : _mm512_setzero_si512(), pairs);
}

// The high halves of n f32 values (n a multiple of 32) as bf16: exact for the values the
// target takes (at most 8 significant bits; accepts()), NaN stays NaN.
void high_halves(const float* src, int64_t n, uint16_t* dst) {
  static const __m512i odd = [] {
    alignas(64) uint16_t idx[32];
    for (int i = 0; i < 32; ++i) idx[i] = static_cast<uint16_t>(2 * i + 1);
    return _mm512_load_si512(idx);
  }();
  for (int64_t t = 0; t < n; t += 32) {
    const __m512i lo = _mm512_castps_si512(_mm512_loadu_ps(src + t)), hi = _mm512_castps_si512(_mm512_loadu_ps(src + t + 16));
    _mm512_storeu_si512(dst + t, _mm512_permutex2var_epi16(lo, odd, hi));
  }
}

// Where the operand is not plain bf16 (FP8/FP4, scaled values), the avx512 decoders give f32
// (exact tables; scaled unless the operand is promoted, whose raw values are packed) and the
// high halves are taken.
GemmOperand values_to_pack(const GemmOperand& src) {
  GemmOperand op = src;
  if (op.promote) op.sf = nullptr;  // raw values; the scales go beside them
  return op;
}

// Raw e4m3 codes straight to bf16 with AVX-512 VBMI: byte tables of the 128 magnitudes'
// bf16 bits (from the exact decoder; every e4m3 value, subnormals included, is a bf16
// normal or zero, NaN stays NaN), the sign byte or-ed in, bytes interleaved. `factor` (a
// power of two that keeps every value a bf16 normal) scales the values; `code_of(v, w)`
// is the code that word w of output vector v holds (by default codes 0-31, then 32-63).
struct E4m3ToBf16 {
  __m512i lo_a, lo_b, hi_a, hi_b, first, second;
  static constexpr int in_order(int v, int w) { return 32 * v + w; }
  explicit E4m3ToBf16(float factor = 1.0f, int (*code_of)(int, int) = &in_order) {
    alignas(64) uint8_t lo[128], hi[128], i0[64], i1[64];
    for (int c = 0; c < 128; ++c) {
      const uint32_t bits = std::bit_cast<uint32_t>(tables().e4m3[c] * factor) >> 16;  // exact; NaN stays NaN
      lo[c] = static_cast<uint8_t>(bits & 0xff);
      hi[c] = static_cast<uint8_t>(bits >> 8);
    }
    for (int w = 0; w < 32; ++w) {
      i0[2 * w] = static_cast<uint8_t>(code_of(0, w)), i0[2 * w + 1] = static_cast<uint8_t>(64 + code_of(0, w));
      i1[2 * w] = static_cast<uint8_t>(code_of(1, w)), i1[2 * w + 1] = static_cast<uint8_t>(64 + code_of(1, w));
    }
    lo_a = _mm512_load_si512(lo), lo_b = _mm512_load_si512(lo + 64);
    hi_a = _mm512_load_si512(hi), hi_b = _mm512_load_si512(hi + 64);
    first = _mm512_load_si512(i0), second = _mm512_load_si512(i1);
  }
};

// 64 codes x as bf16: v0 for codes 0-31, v1 for 32-63.
__attribute__((target("avx512vbmi"))) inline void e4m3_block(const E4m3ToBf16& t, __m512i x, __m512i& v0, __m512i& v1) {
  const __m512i magnitude = _mm512_set1_epi8(0x7f), sign = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i mag = _mm512_and_si512(x, magnitude);
  const __m512i lo = _mm512_permutex2var_epi8(t.lo_a, mag, t.lo_b);
  const __m512i hi = _mm512_or_si512(_mm512_permutex2var_epi8(t.hi_a, mag, t.hi_b), _mm512_and_si512(x, sign));
  v0 = _mm512_permutex2var_epi8(lo, t.first, hi);
  v1 = _mm512_permutex2var_epi8(lo, t.second, hi);
}

__attribute__((target("avx512vbmi"))) void e4m3_to_bf16(const uint8_t* src, int64_t n, uint16_t* dst) {
  static const E4m3ToBf16 t;
  for (int64_t i = 0; i < n; i += 64) {
    const int64_t len = std::min<int64_t>(64, n - i);
    const __mmask64 m = len == 64 ? ~__mmask64{0} : (__mmask64{1} << len) - 1;
    __m512i v0, v1;
    e4m3_block(t, _mm512_maskz_loadu_epi8(m, src + i), v0, v1);
    const __mmask32 m0 = static_cast<__mmask32>(len >= 32 ? ~0u : (1u << len) - 1);
    const __mmask32 m1 = static_cast<__mmask32>(len == 64 ? ~0u : len <= 32 ? 0u : (1u << (len - 32)) - 1);
    _mm512_mask_storeu_epi16(dst + i, m0, v0);
    _mm512_mask_storeu_epi16(dst + i + 32, m1, v1);
  }
}

// 64 codes x as bf16 through the byte tables, to dst; `shifts` (null: raw codes) folds
// power-of-two scales: shifts[h] is the scale exponent times 128, added to the bf16 bits of
// every finite nonzero value of codes 32h to 32h + 31, which is exact when the results stay
// bf16 normals (StripSource::rowwise says which scales those are).
__attribute__((target("avx512vbmi"))) inline void e4m3_block_by_tables(const E4m3ToBf16& t, __m512i x,
                                                                       const int16_t* shifts, uint16_t* dst) {
  __m512i v0, v1;
  e4m3_block(t, x, v0, v1);
  if (shifts) {
    const __m512i magnitude = _mm512_set1_epi8(0x7f);
    const __m512i mag = _mm512_and_si512(x, magnitude);
    // Finite nonzero codes (not 0 or NaN 0x7f, either sign) take the shift. NaN codes of
    // either sign give the positive quiet NaN, as the scaling decoders (f32 value times
    // scale) that the blocked path folds with do.
    const __mmask64 nan = _mm512_cmpeq_epi8_mask(mag, magnitude);
    const __mmask64 scaled = _mm512_test_epi8_mask(x, magnitude) & ~nan;
    const __m512i quiet_nan = _mm512_set1_epi16(0x7fc0);
    v0 = _mm512_mask_add_epi16(v0, static_cast<__mmask32>(scaled), v0, _mm512_set1_epi16(shifts[0]));
    v1 = _mm512_mask_add_epi16(v1, static_cast<__mmask32>(scaled >> 32), v1, _mm512_set1_epi16(shifts[1]));
    v0 = _mm512_mask_mov_epi16(v0, static_cast<__mmask32>(nan), quiet_nan);
    v1 = _mm512_mask_mov_epi16(v1, static_cast<__mmask32>(nan >> 32), quiet_nan);
  }
  _mm512_store_si512(dst, v0);
  _mm512_store_si512(dst + 32, v1);
}

// e4m3 normals to bf16 without tables (GFNI). A normal code s eeee mmm is 2^(e - 7) ·
// 1.mmm; times 2^8 its bf16 exponent field is e + 128 = 1000eeee, a carry-free bit
// pattern, so both bytes of the bf16 word are fixed rearrangements of the code's bits:
//   high byte s1000eee (e's top three bits), low byte emmm0000 (e's low bit, m),
// which two affine byte transforms (vgf2p8affineqb: a bit matrix and a constant) form. The
// 2^8 comes off again in the exponent field, together with any folded scale's shift (bf16
// normals in, bf16 normals out: exact). Zeros, subnormals (e = 0) and NaN codes do not
// follow that pattern; a block of 64 codes holding one goes through the tables instead.
struct E4m3Affine {
  // The matrix whose output bit i is the parity of the input bits in masks[i]. (Byte 7 - i
  // of the qword selects the input bits that output bit i sums.)
  static constexpr uint64_t matrix_of_masks(const uint8_t (&masks)[8]) {
    uint64_t m = 0;
    for (int i = 0; i < 8; ++i) m |= uint64_t{masks[i]} << (8 * (7 - i));
    return m;
  }
  // The matrix whose output bit i is input bit from[i] (-1: zero).
  static constexpr uint64_t matrix(const int (&from)[8]) {
    uint8_t masks[8] = {};
    for (int i = 0; i < 8; ++i) masks[i] = from[i] >= 0 ? static_cast<uint8_t>(1u << from[i]) : uint8_t{0};
    return matrix_of_masks(masks);
  }
  static constexpr int kHighFrom[8] = {4, 5, 6, -1, -1, -1, -1, 7};  // eee (bits 6-4) -> 2-0, s -> 7
  static constexpr int kLowFrom[8] = {-1, -1, -1, -1, 0, 1, 2, 3};   // emmm (bits 3-0) -> 7-4
  static constexpr uint8_t kHighConstant = 0x40;                      // the exponent field's 128
  static constexpr int16_t kUnbias = -8 * 128;                        // 2^-8 in the exponent field
  // The codes this gets wrong, by one more affine transform and one compare (two adds and a
  // compare before): y = P(code) keeps m in bits 2-0 xor e0, and maps e by an invertible
  // matrix to bits 6-3, sending e = 15 to 0001. So y < 8 exactly where e = 0 (zero,
  // subnormal), y = 8 exactly where e = 15 and m = 7 (NaN), and y > 8 elsewhere; the sign
  // is not read. (Every code is checked in GemmAmx.StreamedE4m3WeightsEveryCode.)
  static constexpr uint8_t kProbeMasks[8] = {0x09, 0x0a, 0x0c, 0x08, 0x18, 0x28, 0x48, 0x00};
  __m512i high, low, order, probe;
  E4m3Affine()
      : high(_mm512_set1_epi64(static_cast<int64_t>(matrix(kHighFrom)))),
        low(_mm512_set1_epi64(static_cast<int64_t>(matrix(kLowFrom)))),
        // Quadwords 0 4 1 5 2 6 3 7: the in-lane byte unpacks then give codes 0-31 and 32-63.
        order(_mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7)),
        probe(_mm512_set1_epi64(static_cast<int64_t>(matrix_of_masks(kProbeMasks)))) {}
  // Whether any of 64 codes is a zero, subnormal or NaN.
  __attribute__((target("avx512bw,gfni"))) bool any_special(__m512i x) const {
    return _mm512_cmplt_epu8_mask(_mm512_gf2p8affine_epi64_epi8(x, probe, 0), _mm512_set1_epi8(9)) != 0;
  }
};

// One row of a chunk (256 codes) as bf16, 64 codes at a time: by E4m3Affine, or where a
// block holds a zero, subnormal or NaN code by the tables. `offsets` (null: raw codes)
// holds, per 32-wide group, the word pair (o, o) with o = that group's shift plus kUnbias;
// `shifts` the shifts themselves, for the tables. Returns how many blocks took the tables.
// (Choosing per block: weights whose rows mostly hold one such code, e.g. uniformly random
// codes, had been decoded twice when the choice was made per row.)
__attribute__((target("avx512bw,avx512vbmi,gfni"))) inline int e4m3_row_by_affine(const E4m3Affine& a,
                                                                                  const E4m3ToBf16& t,
                                                                                  const uint8_t* src,
                                                                                  const int16_t* shifts,
                                                                                  const int32_t* offsets,
                                                                                  uint16_t* dst) {
  const __m512i unbias = _mm512_set1_epi16(E4m3Affine::kUnbias);
  int by_tables = 0;
  for (int i = 0; i < kChunk; i += 64) {
    const __m512i x = _mm512_loadu_si512(src + i);
    if (a.any_special(x)) [[unlikely]] {
      e4m3_block_by_tables(t, x, shifts ? shifts + i / 32 : nullptr, dst + i);
      ++by_tables;
      continue;
    }
    const __m512i ordered = _mm512_permutexvar_epi64(a.order, x);
    const __m512i high = _mm512_gf2p8affine_epi64_epi8(ordered, a.high, E4m3Affine::kHighConstant);
    const __m512i low = _mm512_gf2p8affine_epi64_epi8(ordered, a.low, 0);
    // (a broadcast from memory is a plain load; a 16-bit one would need a shuffle)
    const __m512i o0 = offsets ? _mm512_set1_epi32(offsets[i / 32]) : unbias;
    const __m512i o1 = offsets ? _mm512_set1_epi32(offsets[i / 32 + 1]) : unbias;
    _mm512_store_si512(dst + i, _mm512_add_epi16(_mm512_unpacklo_epi8(low, high), o0));
    _mm512_store_si512(dst + i + 32, _mm512_add_epi16(_mm512_unpackhi_epi8(low, high), o1));
  }
  return by_tables;
}

// A whole chunk by the tables alone (returns its block count, as below), in a function of
// its own: with this loop inside the affine dispatcher, weights that take the tables
// (uniformly random codes, masked decode 32 x 20 on a standalone timer) ran 80-88 against
// 72-80 ms.
__attribute__((target("avx512vbmi"))) int e4m3_chunk_by_tables(const uint8_t* src, int64_t row_bytes, int rows,
                                                               const int16_t* shifts, uint32_t* out) {
  static const E4m3ToBf16 table;
  const E4m3ToBf16 t = table;  // (a local copy: the compiler keeps it in registers)
  constexpr int kGroups = kChunk / 32;
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < kChunk; i += 64)
      e4m3_block_by_tables(t, _mm512_loadu_si512(src + r * row_bytes + i), shifts ? shifts + r * kGroups + i / 32 : nullptr,
                           reinterpret_cast<uint16_t*>(out + r * kChunkWords) + i);
  return rows * static_cast<int>(kChunk / 64);
}

// A whole chunk of `rows` rows x 256 e4m3 codes (rows `row_bytes` apart) as load_words lays
// out bf16, row by row: by E4m3Affine where the CPU has GFNI (`affine`), blocks with special
// codes (and every block elsewhere) by the tables, which stay in registers across the chunk
// (the per-row decoder above reloads them and handles tails; there that overhead was most of
// the streaming kernel's time). `shifts` / `offsets`: per row, kChunk / 32 of each (null:
// raw codes). Returns how many blocks of 64 took the tables.
__attribute__((target("avx512bw,avx512vbmi,gfni"))) int e4m3_chunk_to_bf16(const uint8_t* src, int64_t row_bytes,
                                                                          int rows, const int16_t* shifts,
                                                                          const int32_t* offsets, bool affine,
                                                                          uint32_t* out) {
  if (!affine) return e4m3_chunk_by_tables(src, row_bytes, rows, shifts, out);
  static const E4m3ToBf16 table;
  static const E4m3Affine affine_table;
  const E4m3ToBf16 t = table;  // (local copies: the compiler keeps them in registers)
  const E4m3Affine a = affine_table;
  constexpr int kGroups = kChunk / 32;
  int by_tables = 0;
  for (int r = 0; r < rows; ++r) {
    auto* dst = reinterpret_cast<uint16_t*>(out + r * kChunkWords);
    const int16_t* row_shifts = shifts ? shifts + r * kGroups : nullptr;
    by_tables += e4m3_row_by_affine(a, t, src + r * row_bytes, row_shifts, offsets ? offsets + r * kGroups : nullptr, dst);
  }
  return by_tables;
}

// A folded scale's shift: its exponent times 128 (what adds it to a bf16 pattern), when it
// is a power of two from 2^lowest to 2^highest; false otherwise.
inline bool exponent_shift(float scale, int lowest, int highest, int16_t& shift) {
  const uint32_t bits = std::bit_cast<uint32_t>(scale);
  const int exponent = static_cast<int>((bits >> 23) & 0xff) - 127;
  if ((bits & 0x807fffffu) != 0 || exponent < lowest || exponent > highest) return false;
  shift = static_cast<int16_t>(exponent * 128);
  return true;
}

// chunk_shifts for packed ue8m0 scales, one per 32 (FP4's recipe): byte g of a row's
// scales is group g's exponent e, in range when e - (127 + lowest) is at most
// highest - lowest as an unsigned byte (ue8m0 0, 2^-127, and 255, NaN, are outside every
// range asked for). Two rows per vector: their 16 bytes checked by one compare and widened
// to 16 shifts by one conversion. (Widening each row to 32-bit lanes, with two compares and
// a narrowing store, had been 7 % of FP8 x FP4 16 x 4096 x 7168 on the tiles: perf.)
__attribute__((target("avx512bw,avx512vl"))) bool ue8m0_chunk_shifts_per_32(const void* const* sf_rows, int rows,
                                                                            int64_t k0, int lowest, int highest,
                                                                            int16_t* out) {
  const __m128i low = _mm_set1_epi8(static_cast<char>(127 + lowest));  // (lowest >= -127)
  const __m128i span = _mm_set1_epi8(static_cast<char>(highest - lowest));
  const __m256i unbias = _mm256_set1_epi16(127 * 128);
  const auto row_bytes = [&](int r) { return static_cast<const uint8_t*>(sf_rows[r]) + k0 / 32; };
  for (int r = 0; r < rows; r += 2) {
    const bool pair = r + 1 < rows;
    __m128i e = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row_bytes(r)));
    if (pair) e = _mm_castpd_si128(_mm_loadh_pd(_mm_castsi128_pd(e), reinterpret_cast<const double*>(row_bytes(r + 1))));
    if (_mm_mask_cmpgt_epu8_mask(pair ? 0xffff : 0x00ff, _mm_sub_epi8(e, low), span)) return false;
    const __m256i shifts = _mm256_sub_epi16(_mm256_slli_epi16(_mm256_cvtepu8_epi16(e), 7), unbias);
    if (pair) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * 8), shifts);
    else _mm_storeu_si128(reinterpret_cast<__m128i*>(out + r * 8), _mm256_castsi256_si128(shifts));
  }
  return true;
}

// chunk_shifts for one f32 scale per 32 stored contiguously: a row's 8 scales at once.
__attribute__((target("avx512bw,avx512vl"))) bool chunk_shifts_per_32(const GemmOperand& op, const void* const* sf_rows,
                                                                     int rows, int64_t k0, int lowest, int highest,
                                                                     int16_t* out) {
  if (op.sf_dtype != DType::f32) return ue8m0_chunk_shifts_per_32(sf_rows, rows, k0, lowest, highest, out);
  const __m256i bias = _mm256_set1_epi32(127), lo = _mm256_set1_epi32(lowest), hi = _mm256_set1_epi32(highest);
  const __m256i other_bits = _mm256_set1_epi32(static_cast<int>(0x807fffffu));
  for (int r = 0; r < rows; ++r) {
    const void* sf_row = sf_rows[r];
    // (the scales two chunks on, requested now: 32 rows' scales are 32 streams too, and
    // their loads had stalled this function for most of its time)
    _mm_prefetch(reinterpret_cast<const char*>(static_cast<const float*>(sf_row) + (k0 + 2 * kChunk) / 32), _MM_HINT_T1);
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const float*>(sf_row) + k0 / 32));
    const __m256i exponent = _mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(0xff)), bias);
    const __m256i clean = _mm256_and_si256(bits, other_bits);
    const __mmask8 bad = _mm256_test_epi32_mask(clean, clean) | _mm256_cmpgt_epi32_mask(lo, exponent) |
                         _mm256_cmpgt_epi32_mask(exponent, hi);
    if (bad) return false;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + r * 8), _mm256_cvtepi32_epi16(_mm256_slli_epi32(exponent, 7)));
  }
  return true;
}

// The bf16 exponent shifts (scale exponent x 128) of the scales of `rows` rows (their rows
// of scales in sf_rows) for the chunk's 32-wide K groups: out[r * 8 + g] (gran_k a multiple
// of 32). False when a scale is not a power of two from 2^lowest to 2^highest: the caller
// then decodes the chunk the general way. (The callers find each row's scales once per
// strip: with a division per row here, this function had been 15 % of 16 x 2048 x 7168
// FP8 with ue8m0 scales on one thread.)
bool chunk_shifts(const GemmOperand& op, const void* const* sf_rows, int rows, int64_t k0, int lowest, int highest,
                  int16_t* out) {
  constexpr int kGroups = kChunk / 32;
  if (op.gran_k == 32 && op.sf_stride_k == 1) return chunk_shifts_per_32(op, sf_rows, rows, k0, lowest, highest, out);
  int64_t group[kGroups];  // (gran_k a multiple of 32: one scale group per 32; the same for every row)
  group[0] = k0 / op.gran_k;
  for (int g = 1, within = static_cast<int>(k0 % op.gran_k); g < kGroups; ++g) {
    within += 32;
    group[g] = group[g - 1] + (within == op.gran_k);
    if (within == op.gran_k) within = 0;
  }
  // A row's shifts are formed once per row of scales (rows of one scale block, 128 x 128
  // FP8 weights, share them) and stored from a copy held aside: copying each row from the
  // one before made the rows a chain of store-to-load forwards.
  static_assert(kGroups == 8);  // (one row's shifts: a 16-byte vector)
  int16_t shifts[kGroups];
  __m128i held = _mm_setzero_si128();
  const void* previous = nullptr;
  for (int r = 0; r < rows; ++r) {
    const void* sf_row = sf_rows[r];
    if (sf_row != previous) {
      previous = sf_row;
      for (int g = 0; g < kGroups; ++g) {
        if (g > 0 && group[g] == group[g - 1]) {
          shifts[g] = shifts[g - 1];
          continue;
        }
        if (!exponent_shift(group_scale(op, sf_row, group[g]), lowest, highest, shifts[g])) return false;
      }
      // (set from values, not loaded back from the array: a load right after those stores
      // waits for them)
      held = _mm_setr_epi16(shifts[0], shifts[1], shifts[2], shifts[3], shifts[4], shifts[5], shifts[6], shifts[7]);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + r * kGroups), held);
  }
  return true;
}

// Rows of a chunk of 256 e2m1 values (K-major, scales folded: every scale of the chunk a
// power of two) as load_words lays out bf16: rows [i0, i0 + rows) of op, with their
// chunk_shifts in shift (8 per row). A value is the code's bf16 bits from a 16-word table
// (sign included) plus the scale's exponent in the bf16 exponent field; exact, since the
// target folds only scales from 2^-100 (products stay bf16 normals) and the callers take
// only exponents up to 2^120 (no overflow). Each group of 32 shares a scale, so the shift
// goes into the table (its nonzero entries) rather than into the values.
//
// Codes to word lanes: a row's 128 bytes in two loads, and each 16 bytes to 32 words by one
// byte permute (the low byte of word w is byte w / 2) and a variable word shift (odd words
// right by 4, so that their low nibble is the byte's high one). That is one vector op fewer
// per 32 values than a zero extension to 32-bit lanes, a shift and an or (b | b << 12), the
// same values: FP8 x FP4 with packed ue8m0 scales, from DRAM, 2 threads, alternated medians:
// 16 x 24576 x 1536 1.47-1.61 -> 1.41-1.51 ms, 16 x 4096 x 7168 1.05-1.08 -> 1.02-1.03, 16 x
// 32768 x 512 0.80-0.81 -> 0.77. (The avx512_bf16 target's StreamDp decodes FP4 rows here too;
// not measured on Zen 4. A host without VBMI, which no AMX host is, decodes them by
// decode_words instead: StripSource::folded_e2m1_.)
__attribute__((target("avx512bw,avx512vl,avx512vbmi"))) void e2m1_rows_to_bf16(const GemmOperand& op, int64_t i0, int rows,
                                                                                int64_t k0, const int16_t* shift,
                                                                                uint32_t* out) {
  constexpr int kGroups = kChunk / 32;  // one shift per output vector of 32
  static_assert(kChunk / 2 == 2 * 64);  // (a row's chunk: two 64-byte loads of four vectors each)
  // The 16 codes' bf16 bits, twice: vpermw reads five index bits, and bit 4 of each index
  // below is another code's bit.
  static const __m512i table = [] {
    alignas(64) uint16_t t[32] = {};
    for (int c = 0; c < 32; ++c) t[c] = static_cast<uint16_t>(std::bit_cast<uint32_t>(tables().e2m1[c % 16]) >> 16);
    return _mm512_load_si512(t);
  }();
  const __mmask32 nonzero = _mm512_test_epi16_mask(table, _mm512_set1_epi16(0x7fff));
  // The shifts as word pairs, so that each group's is a dword broadcast from memory, which
  // is a plain load (a word broadcast, or one from a register, takes the shuffle port that
  // the lookups below need). The compiler barrier keeps it from forwarding them in
  // registers. FP8 x FP4 16 x 4096 x 7168 from L3, 2 threads, with the two-row shifts
  // above: 0.94-1.03 -> 0.83-0.85 ms (alternated; docs/GEMM.md).
  alignas(64) int32_t pairs[kMr * kGroups];
  for (int i = 0; i < rows * kGroups; i += 16) {
    const auto live = static_cast<__mmask16>(rows * kGroups - i >= 16 ? 0xffff : 0x00ff);  // (an odd last row)
    const __m512i s = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, shift + i));
    _mm512_store_si512(pairs + i, _mm512_or_si512(s, _mm512_slli_epi32(s, 16)));
  }
  asm volatile("" ::: "memory");
  // spread[q]: byte 2w (word w's index) and 2w + 1 (unread) are byte 16q + w / 2 of 64.
  alignas(64) static const auto spread = [] {
    std::array<std::array<uint8_t, 64>, 4> c{};
    for (int q = 0; q < 4; ++q)
      for (int p = 0; p < 64; ++p) c[q][p] = static_cast<uint8_t>(16 * q + p / 4);
    return c;
  }();
  __m512i to_words[4];
  for (int q = 0; q < 4; ++q) to_words[q] = _mm512_load_si512(spread[q].data());
  const __m512i odd_by_4 = _mm512_set1_epi32(4 << 16);
  const uint8_t* src = row_ptr(op, i0) + k0 / 2;
  for (int r = 0; r < rows; ++r, src += op.ld) {  // (e2m1x2: ld counts bytes)
    auto* dst = reinterpret_cast<uint16_t*>(out + r * kChunkWords);
    const __m512i halves[2] = {_mm512_loadu_si512(src), _mm512_loadu_si512(src + 64)};
    for (int g = 0; g < kGroups; ++g) {
      // Word 2i indexes by code 2i (byte i's low nibble), word 2i + 1 by code 2i + 1 (its
      // high nibble); bit 4 of each index is another nibble's, which the doubled table ignores.
      const __m512i codes = _mm512_srlv_epi16(_mm512_permutexvar_epi8(to_words[g % 4], halves[g / 4]), odd_by_4);
      const __m512i scaled = _mm512_mask_add_epi16(table, nonzero, table, _mm512_set1_epi32(pairs[r * kGroups + g]));
      _mm512_store_si512(dst + 32 * g, _mm512_permutexvar_epi16(codes, scaled));
    }
  }
}

// K-major: row by row, as load_words lays them out.
void decode_words(const GemmOperand& src, int64_t i0, int rows, int64_t k0, int64_t kc, uint32_t* out, int64_t ldw) {
  const GemmOperand op = values_to_pack(src);
  if (op.dtype == DType::e4m3 && !op.sf && cpu_features().avx512vbmi) {
    for (int r = rows; r < kMr; ++r) std::memset(out + r * ldw, 0, static_cast<size_t>(ldw) * 4);
    for (int r = 0; r < rows; ++r) {
      // The next row's segment is a page away: ask for it while this one decodes
      // (measured: 20 x 4096 x 7168 FP8 with f32 scales, one thread: 8.9 -> 6.9-7.3 ms).
      if (r + 1 < rows)
        for (int64_t b = 0; b < kc; b += 64) __builtin_prefetch(row_ptr(op, i0 + r + 1) + k0 + b);
      auto* dst = reinterpret_cast<uint16_t*>(out + r * ldw);
      e4m3_to_bf16(row_ptr(op, i0 + r) + k0, kc, dst);
      std::memset(dst + kc, 0, static_cast<size_t>(2 * ldw - kc) * 2);
    }
    return;
  }
  for (int r = 0; r < kMr; ++r) std::memset(out + r * ldw, 0, static_cast<size_t>(ldw) * 4);
  alignas(64) static thread_local float row[kKc + kStep];
  const int64_t padded = step_count(kc) * kStep;
  for (int r = 0; r < rows; ++r) {
    gemm_kernels_avx512().decode_row(op, i0 + r, k0, kc, row);
    std::memset(row + kc, 0, static_cast<size_t>(padded - kc) * sizeof(float));
    high_halves(row, padded, reinterpret_cast<uint16_t*>(out + r * ldw));
  }
}

// MN-major: through the avx512 pack's f32 micro-panels (panel[kk * 32 + r], zero past the
// rows), at most kGemmKc deep at a time, as pair-major words: pairs[p * 32 + r], zero past
// the operand and up to whole steps.
void decode_pairs(const GemmOperand& src, int64_t i0, int rows, int64_t k0, int64_t kc, uint32_t* pairs) {
  const GemmOperand op = values_to_pack(src);
  alignas(64) static thread_local float panel[(kGemmKc + kStep) * kMr];
  const int64_t padded = step_count(kc) * kStep;
  for (int64_t c0 = 0; c0 < padded; c0 += kGemmKc) {
    const int64_t len = std::min(kGemmKc, kc - c0), span = std::min(kGemmKc, padded - c0);
    if (len > 0) gemm_kernels_avx512().pack(op, i0, rows, k0 + c0, len, kMr, panel, PackNext::next_rows);
    std::memset(panel + std::max<int64_t>(len, 0) * kMr, 0, static_cast<size_t>(span - std::max<int64_t>(len, 0)) * kMr * sizeof(float));
    for (int64_t p = 0; p < span / 2; ++p) {
      alignas(64) uint16_t two_rows[2 * kMr];  // kk = 2p, then 2p + 1
      high_halves(panel + 2 * p * kMr, 2 * kMr, two_rows);
      interleave_pair(_mm512_load_si512(two_rows), _mm512_load_si512(two_rows + kMr), pairs + (c0 / 2 + p) * kMr);
    }
  }
}

// A 16 x 16 block of 32-bit words (rows `stride` bytes apart) transposed into 16 contiguous
// rows.
void transpose16(const uint8_t* src, int64_t stride, uint32_t* dst) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * stride);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // u[4q + j], lane L: column 4L + j of rows 4q .. 4q + 3.
  for (int q = 0; q < 16; q += 4) {
    r[q] = _mm512_unpacklo_epi64(t[q], t[q + 2]);
    r[q + 1] = _mm512_unpackhi_epi64(t[q], t[q + 2]);
    r[q + 2] = _mm512_unpacklo_epi64(t[q + 1], t[q + 3]);
    r[q + 3] = _mm512_unpackhi_epi64(t[q + 1], t[q + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i v = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88), w = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xdd);
    const __m512i x = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88), y = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xdd);
    _mm512_storeu_si512(dst + (0 + j) * 16, _mm512_shuffle_i32x4(v, x, 0x88));
    _mm512_storeu_si512(dst + (8 + j) * 16, _mm512_shuffle_i32x4(v, x, 0xdd));
    _mm512_storeu_si512(dst + (4 + j) * 16, _mm512_shuffle_i32x4(w, y, 0x88));
    _mm512_storeu_si512(dst + (12 + j) * 16, _mm512_shuffle_i32x4(w, y, 0xdd));
  }
}

bool plain_bf16(const GemmOperand& op) { return op.dtype == DType::bf16 && !op.sf; }

// The bytes of final registers [q0, q0 + count) that come from source rows [r0, r0 + rows),
// in the registers' order; final_byte(q, t) is byte t of register q as (source row, byte).
std::vector<std::pair<int, int>> bytes_from_rows(std::pair<int, int> (*final_byte)(int, int), int q0, int count, int r0,
                                                 int rows) {
  std::vector<std::pair<int, int>> bytes;
  for (int q = q0; q < q0 + count; ++q)
    for (int t = 0; t < 64; ++t) {
      const auto b = final_byte(q, t);
      if (b.first >= r0 && b.first < r0 + rows) bytes.push_back(b);
    }
  return bytes;
}

// Folded scales of a B tile (step s, columns 16h..16h+15) as the 32 word lanes of its rows:
// lane l belongs to column l / 2 (zero without shifts).
__attribute__((target("avx512bw"))) inline __m512i tile_shifts(const int16_t* shifts, int64_t s, int h) {
  static const __m512i column_of_lane = [] {
    alignas(64) uint16_t idx[32];
    for (int l = 0; l < 32; ++l) idx[l] = static_cast<uint16_t>(l / 2);
    return _mm512_load_si512(idx);
  }();
  if (!shifts) return _mm512_setzero_si512();
  const __m256i columns = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(shifts + s * kMr + 16 * h));
  return _mm512_permutexvar_epi16(column_of_lane, _mm512_castsi256_si512(columns));
}

// The bytes of loaded register i holding `per_register` source rows of 64 / per_register
// bytes each (rows per_register · i onwards), as (source row, byte).
std::vector<std::pair<int, int>> loaded_rows(int i, int per_register) {
  const int width = 64 / per_register;
  std::vector<std::pair<int, int>> bytes;
  for (int t = 0; t < 64; ++t) bytes.push_back({per_register * i + t / width, t % width});
  return bytes;
}

// vpermt2b indices that build `want` from registers `lo` (0-63) and `hi` (64-127).
__m512i merge_indices(const std::vector<std::pair<int, int>>& want, const std::vector<std::pair<int, int>>& lo,
                      const std::vector<std::pair<int, int>>& hi) {
  alignas(64) uint8_t idx[64];
  for (int t = 0; t < 64; ++t) {
    const auto in_lo = std::find(lo.begin(), lo.end(), want[t]), in_hi = std::find(hi.begin(), hi.end(), want[t]);
    idx[t] = static_cast<uint8_t>(in_lo != lo.end() ? in_lo - lo.begin() : 64 + (in_hi - hi.begin()));
  }
  return _mm512_load_si512(idx);
}

// B tiles of a K-major operand of raw e4m3 codes, straight from the codes. A B tile of one
// step is pair-major (tile row p: columns 0-15, each as the bf16 of codes 2p and 2p + 1), so
// the step's 16 source rows of 32 codes are transposed as 16-bit code pairs, in three rounds
// of byte permutations over registers holding two rows each, and only then decoded, 64 codes
// (two tile rows) at a time. Against decoding the rows into a buffer and transposing their
// 32-bit words (transpose16), it takes a third fewer shuffles and no round trip through L2
// (a block's 32 decoded rows of 2048 are 128 KiB).
//
// Register contents are lists of (source row, code) bytes. The final register O[q] holds tile
// rows 2q and 2q + 1; round 1 merges source rows 4i..4i+3 into two registers, `half` 0 and 1
// holding the bytes for O[4 half .. 4 half + 3]; round 2 rows 8j..8j+7 into quarters g (the
// bytes for O[4 half + 2g] and O[4 half + 2g + 1]); round 3 all 16 rows into O[4 half + 2g + e].
// Seen from the pair of registers merged, the permutations depend only on half, g and e, so
// six index vectors serve every register.
struct CodeTranspose {
  __m512i round1[2], round2[2], round3[2];
  // Byte t of O[q] as (source row, code): tile row p = 2q + t / 32 holds, for column c =
  // (t % 32) / 2 (source row c), codes 2p and 2p + 1.
  static std::pair<int, int> final_byte(int q, int t) {
    const int p = 2 * q + t / 32, column = (t % 32) / 2;
    return {column, 2 * p + t % 2};
  }
  static std::vector<std::pair<int, int>> content(int q0, int count, int r0, int rows) {
    return bytes_from_rows(&final_byte, q0, count, r0, rows);
  }
  CodeTranspose() {
    // Loaded register i: row 2i in bytes 0-31, row 2i + 1 in 32-63.
    for (int h = 0; h < 2; ++h) round1[h] = merge_indices(content(4 * h, 4, 0, 4), loaded_rows(0, 2), loaded_rows(1, 2));
    for (int g = 0; g < 2; ++g) round2[g] = merge_indices(content(2 * g, 2, 0, 8), content(0, 4, 0, 4), content(0, 4, 4, 4));
    for (int e = 0; e < 2; ++e) round3[e] = merge_indices(content(e, 1, 0, 16), content(0, 2, 0, 8), content(0, 2, 8, 8));
  }
};

// Folded scales: shifts[s * 32 + r], the exponent of row r's scale for step s times 128 (what
// adds it to a bf16 pattern), when every scale of rows [i0, i0 + rows) x K [k0, k0 + kc) is a
// power of two from 2^-100 to 2^highest and scale groups are whole steps: then each scaled
// value is its code's bf16 with the exponent moved, a bf16 normal (e4m3 magnitudes run from
// 2^-9 to 1.75 · 2^8: highest 119; e2m1 from 0.5 to 6: 120), exactly what decoding to f32,
// scaling and taking the high half gives.
// (Rows of one row of scales, as the 32 rows of a 128 x 128 FP8 block, copy the row before;
// a scale is looked up once per group, and the group is counted, not divided for: two
// divisions per step had made FP4 128 x 7168 x 16384 10-15 % slower.)
bool step_shifts(const GemmOperand& op, int64_t i0, int rows, int64_t k0, int64_t kc, int highest, int16_t* shifts) {
  if (op.gran_k % kStep != 0) return false;
  const int64_t steps = step_count(kc), first_group = k0 / op.gran_k, first_within = k0 % op.gran_k;
  const void* previous = nullptr;
  for (int r = 0; r < rows; ++r) {
    const void* sf_row = scale_row(op, i0 + r);
    if (sf_row == previous) {
      for (int64_t s = 0; s < steps; ++s) shifts[s * kMr + r] = shifts[s * kMr + r - 1];
      continue;
    }
    previous = sf_row;
    int16_t shift = 0;
    for (int64_t s = 0, group = first_group, within = first_within; s < steps; ++s) {
      if ((s == 0 || within == 0) && !exponent_shift(group_scale(op, sf_row, group), -100, highest, shift)) return false;
      shifts[s * kMr + r] = shift;
      within += kStep;
      if (within == op.gran_k) within = 0, ++group;
    }
  }
  return true;
}

// Requests the next panel's source rows into L2 while a K-major FP8/FP4 panel is packed,
// a share of its lines per step, row after row. A step reads 32 bytes (FP8) of each of 32
// rows, and the hardware prefetcher follows those 32 short streams poorly: the row loads
// waited on memory for most of the pack. Row-major requests (each row's lines in order)
// stream. Measured on the 2-vCPU AMX Xeon (2026-12-02), contiguous FP8 8 x 512 x 7168 x
// 2048 (random group sizes, weights in L3), perf: the pack's share of the GEMM
// 17.4 -> 13.0-13.6 %. (Requesting each row's lines a few steps ahead instead, into L1 or
// L2, was no faster: the requests themselves then waited.)
// What the packing of one B panel requests meanwhile: rows [i0, i0 + rows) from K k0 on
// (the next panel of the call, or the same rows' next K block).
struct NextPanel {
  int64_t i0;
  int rows;
  int64_t k0;
};

class NextPanelRequests {
 public:
  // row_bytes bytes from byte k0_bytes of rows [i0, i0 + rows) of op, spread over `steps`
  // calls of step().
  NextPanelRequests(const GemmOperand& op, int64_t i0, int rows, int64_t k0_bytes, int64_t row_bytes, int64_t steps)
      : next_(reinterpret_cast<const char*>(row_ptr(op, i0)) + k0_bytes),
        stride_(reinterpret_cast<const char*>(row_ptr(op, 1)) - reinterpret_cast<const char*>(row_ptr(op, 0))),
        rows_(rows), row_lines_((row_bytes + 63) / 64), per_step_((rows * row_lines_ + steps - 1) / std::max<int64_t>(1, steps)) {}
  // (A row and line counter rather than a division per line: a step requests 16 or more.)
  void step() {
    for (int64_t n = 0; n < per_step_ && row_ < rows_; ++n) {
      _mm_prefetch(next_ + line_ * 64, _MM_HINT_T1);
      if (++line_ == row_lines_) line_ = 0, ++row_, next_ += stride_;
    }
  }

 private:
  const char* next_;  // the current row's first requested byte
  int64_t stride_, rows_, row_lines_, per_step_, row_ = 0, line_ = 0;
};

// Tiles of steps [0, step_count(kc)) for rows [i0, i0 + rows) (zero past them and past kc)
// into `data` (panel_steps layout); `shifts` (null: raw codes) as step_shifts gives them.
// The rows `np` names are requested meanwhile (NextPanelRequests).
__attribute__((target("avx512vbmi"))) void pack_e4m3_b_tiles(const GemmOperand& op, int64_t i0, int rows, int64_t k0,
                                                            int64_t kc, const int16_t* shifts, uint8_t* data, NextPanel np) {
  static const CodeTranspose t;
  static const E4m3ToBf16 decode;
  const __m512i magnitude = _mm512_set1_epi8(0x7f), one = _mm512_set1_epi8(1), top = _mm512_set1_epi8(0x7e);
  const __m512i quiet_nan = _mm512_set1_epi16(0x7fc0);
  const uint8_t* src[kMr];
  for (int r = 0; r < kMr; ++r) src[r] = r < rows ? row_ptr(op, i0 + r) + k0 : nullptr;
  const int64_t steps = step_count(kc);
  NextPanelRequests next(op, np.i0, np.rows, np.k0, kc, steps);
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t len = std::min<int64_t>(kStep, kc - s * kStep);
    const __mmask32 valid = len >= 32 ? ~__mmask32{0} : (__mmask32{1} << len) - 1;
    next.step();
    for (int h = 0; h < 2; ++h) {
      __m512i z[8], l1[2][4];
      for (int i = 0; i < 8; ++i) {
        const uint8_t* a = src[16 * h + 2 * i];
        const uint8_t* b = src[16 * h + 2 * i + 1];
        const __m256i lo = a ? _mm256_maskz_loadu_epi8(valid, a + s * kStep) : _mm256_setzero_si256();
        const __m256i hi = b ? _mm256_maskz_loadu_epi8(valid, b + s * kStep) : _mm256_setzero_si256();
        z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      }
      for (int i = 0; i < 4; ++i)
        for (int half = 0; half < 2; ++half) l1[half][i] = _mm512_permutex2var_epi8(z[2 * i], t.round1[half], z[2 * i + 1]);
      uint8_t* tile = data + (2 * s + h) * kTileBytes;
      const __m512i shift = tile_shifts(shifts, s, h);
      for (int half = 0; half < 2; ++half)
        for (int g = 0; g < 2; ++g) {
          const __m512i lower = _mm512_permutex2var_epi8(l1[half][0], t.round2[g], l1[half][1]);  // rows 0-7
          const __m512i upper = _mm512_permutex2var_epi8(l1[half][2], t.round2[g], l1[half][3]);  // rows 8-15
          for (int e = 0; e < 2; ++e) {
            const int q = 4 * half + 2 * g + e;
            __m512i v0, v1;
            const __m512i codes = _mm512_permutex2var_epi8(lower, t.round3[e], upper);
            e4m3_block(decode, codes, v0, v1);
            if (shifts) {
              // Finite nonzero codes (magnitude 1 to 0x7e) take the scale's exponent; NaN codes
              // of either sign give the positive quiet NaN, as decoding to f32 and scaling does
              // (e4m3_block_by_tables alike).
              const __m512i mag = _mm512_and_si512(codes, magnitude);
              const __mmask64 scaled = _mm512_cmplt_epu8_mask(_mm512_sub_epi8(mag, one), top);
              const __mmask64 nan = _mm512_cmpeq_epi8_mask(mag, magnitude);
              v0 = _mm512_mask_add_epi16(v0, static_cast<__mmask32>(scaled), v0, shift);
              v1 = _mm512_mask_add_epi16(v1, static_cast<__mmask32>(scaled >> 32), v1, shift);
              v0 = _mm512_mask_mov_epi16(v0, static_cast<__mmask32>(nan), quiet_nan);
              v1 = _mm512_mask_mov_epi16(v1, static_cast<__mmask32>(nan >> 32), quiet_nan);
            }
            _mm512_storeu_si512(tile + (2 * q) * 64, v0);
            _mm512_storeu_si512(tile + (2 * q + 1) * 64, v1);
          }
        }
    }
  }
}

// The same for K-major e2m1 B (two codes a byte, low nibble first: a byte is one K pair, so
// a step of a source row is 16 bytes and a B tile row is one byte of each of 16 rows): the
// step's 16 x 16 bytes are transposed in two rounds of vpermt2b over registers holding four
// rows each (O[q]: tile rows 4q..4q+3), then each tile row's 16 bytes become 32-bit lanes
// b | b << 12, whose words index a 16-entry bf16 table by the two nibbles (vpermw; the table
// is doubled, as e2m1_rows_to_bf16's, since bit 4 of the low word's index is the other
// nibble's). Folded scales add their exponent to nonzero values.
struct NibbleTranspose {
  __m512i round1[2], round2[2];
  // Byte t of O[q] as (source row, byte): tile row p = 4q + t / 16 holds byte p of row t % 16.
  static std::pair<int, int> final_byte(int q, int t) { return {t % 16, 4 * q + t / 16}; }
  static std::vector<std::pair<int, int>> content(int q0, int count, int r0, int rows) {
    return bytes_from_rows(&final_byte, q0, count, r0, rows);
  }
  NibbleTranspose() {
    // Loaded register i: rows 4i..4i+3, 16 bytes each.
    for (int h = 0; h < 2; ++h) round1[h] = merge_indices(content(2 * h, 2, 0, 8), loaded_rows(0, 4), loaded_rows(1, 4));
    for (int e = 0; e < 2; ++e) round2[e] = merge_indices(content(e, 1, 0, 16), content(0, 2, 0, 8), content(0, 2, 8, 8));
  }
};

__attribute__((target("avx512vbmi"))) void pack_e2m1_b_tiles(const GemmOperand& op, int64_t i0, int rows, int64_t k0,
                                                            int64_t kc, const int16_t* shifts, uint8_t* data, NextPanel np) {
  static const NibbleTranspose t;
  static const __m512i table = [] {
    alignas(64) uint16_t v[32] = {};
    for (int c = 0; c < 32; ++c) v[c] = static_cast<uint16_t>(std::bit_cast<uint32_t>(tables().e2m1[c % 16]) >> 16);
    return _mm512_load_si512(v);
  }();
  // Tile row j of O: its 16 bytes zero-extended to 32-bit lanes (vpermb index j, kept
  // bytes 0x1111...).
  struct Spread {
    __m512i idx[4];
    Spread() {
      for (int j = 0; j < 4; ++j) {
        alignas(64) uint8_t v[64];
        for (int b = 0; b < 64; ++b) v[b] = static_cast<uint8_t>(16 * j + b / 4);
        idx[j] = _mm512_load_si512(v);
      }
    }
  };
  static const Spread spread;
  const __m512i magnitude = _mm512_set1_epi16(0x7fff);
  const uint8_t* src[kMr];
  for (int r = 0; r < kMr; ++r) src[r] = r < rows ? row_ptr(op, i0 + r) + k0 / 2 : nullptr;
  const int64_t steps = step_count(kc);
  NextPanelRequests next(op, np.i0, np.rows, np.k0 / 2, (kc + 1) / 2, steps);
  for (int64_t s = 0; s < steps; ++s) {
    next.step();
    // The step's bytes. An odd K ends in a byte whose high nibble lies past it: that value
    // (finite, e2m1 has no NaN or inf) meets A's zero padding, so it adds nothing.
    const int64_t len = (std::min<int64_t>(kStep, kc - s * kStep) + 1) / 2;
    const __mmask16 valid = len >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << len) - 1);
    for (int h = 0; h < 2; ++h) {
      __m512i z[4];
      for (int i = 0; i < 4; ++i) {
        auto row = [&](int r) {
          const uint8_t* p = src[16 * h + 4 * i + r];
          return p ? _mm_maskz_loadu_epi8(valid, p + s * (kStep / 2)) : _mm_setzero_si128();
        };
        // (insert positions spelled out: they must be immediates at every optimisation level)
        const __m512i two = _mm512_inserti32x4(_mm512_castsi128_si512(row(0)), row(1), 1);
        z[i] = _mm512_inserti32x4(_mm512_inserti32x4(two, row(2), 2), row(3), 3);
      }
      __m512i l1[2][2];
      for (int j = 0; j < 2; ++j)
        for (int half = 0; half < 2; ++half) l1[half][j] = _mm512_permutex2var_epi8(z[2 * j], t.round1[half], z[2 * j + 1]);
      uint8_t* tile = data + (2 * s + h) * kTileBytes;
      const __m512i shift = tile_shifts(shifts, s, h);
      for (int half = 0; half < 2; ++half)
        for (int e = 0; e < 2; ++e) {
          const int q = 2 * half + e;
          const __m512i codes = _mm512_permutex2var_epi8(l1[half][0], t.round2[e], l1[half][1]);
          for (int j = 0; j < 4; ++j) {
            const __m512i bytes = _mm512_maskz_permutexvar_epi8(0x1111111111111111ull, spread.idx[j], codes);
            __m512i v = _mm512_permutexvar_epi16(_mm512_or_si512(bytes, _mm512_slli_epi32(bytes, 12)), table);
            if (shifts) v = _mm512_mask_add_epi16(v, _mm512_test_epi16_mask(v, magnitude), v, shift);
            _mm512_storeu_si512(tile + (4 * q + j) * 64, v);
          }
        }
    }
  }
}

// The scales of a promoted panel: scales[g * 32 + r] for the K groups g of block [k0, k0 + kc)
// (the block starts on a group boundary: kKc is a multiple of every promoted group).
// (Rows of one row of scales, as the 32 rows of a 128 x 128 FP8 block, copy the row before;
// the rows' scale rows take one division. Perf of medium_m, 128 x 7168 x 2048 FP8 with f32
// scales: pack_scales 3.5 -> 2.3 % of the samples; the call's time within noise.)
void pack_scales(const GemmOperand& op, int64_t i0, int rows, int64_t k0, int64_t kc, float* scales) {
  const int64_t g0 = k0 / op.gran_k, groups = (kc + op.gran_k - 1) / op.gran_k;
  const void* sf_rows[kMr] = {};
  scale_rows(op, i0, rows, sf_rows);
  for (int r = 0; r < kMr; ++r) {
    if (r > 0 && r < rows && sf_rows[r] == sf_rows[r - 1]) {
      for (int64_t g = 0; g < groups; ++g) scales[g * kMr + r] = scales[g * kMr + r - 1];
      continue;
    }
    for (int64_t g = 0; g < groups; ++g) scales[g * kMr + r] = r < rows ? group_scale(op, sf_rows[r], g0 + g) : 0.0f;
  }
}

// B panels of an MN-major plain bf16 operand (stored row k holds the columns side by side),
// every panel of the call at once: for each pair of stored rows, the call's whole segment of
// both rows is read front to back and its pairs go straight into the tiles (a B tile is
// pair-major: tile row p % 16 of step p / 16 holds pair p of 16 columns). One panel at a
// time, each pair of rows had been two 64-byte reads a page apart for every panel; weight
// gradients (k-grouped 4 x 4096 x 7168 x 512, 2 threads) spent a sixth of the call there.
void pack_mn_major_bf16_b(const GemmOperand& op, int64_t mn0, int64_t count, int64_t k0, int64_t kc, float* out) {
  const int64_t steps = step_count(kc), panels = (count + kMr - 1) / kMr;
  for (int64_t q = 0; q < panels; ++q) *reinterpret_cast<PanelHeader*>(out + q * panel_floats(kc, kMr)) = PanelHeader{};
  for (int64_t p = 0; p < steps * (kStep / 2); ++p) {
    const uint8_t* lo_row = 2 * p < kc ? op.data + ((k0 + 2 * p) * op.ld + mn0) * 2 : nullptr;
    const uint8_t* hi_row = 2 * p + 1 < kc ? op.data + ((k0 + 2 * p + 1) * op.ld + mn0) * 2 : nullptr;
    for (int64_t q = 0; q < panels; ++q) {
      alignas(64) uint32_t pairs[kMr];
      panel_pair(lo_row, hi_row, q, count, pairs);
      uint8_t* tiles = reinterpret_cast<uint8_t*>(out + q * panel_floats(kc, kMr) + kHeaderFloats) +
                       (p / 16) * 2 * kTileBytes + (p % 16) * 64;
      std::memcpy(tiles, pairs, 64);
      std::memcpy(tiles + kTileBytes, pairs + 16, 64);
    }
  }
}

// A panels of an MN-major plain bf16 operand, the same way: each step's 32 stored rows are
// read front to back across every panel of the call, each panel's 16 pairs x 32 words go to
// a block of its own, and the block is transposed into the step's two A tiles (K-grouped 4
// x 4096 x 7168 x 512: A, re-packed for every column block, had been a ninth of the call).
void pack_mn_major_bf16_a(const GemmOperand& op, int64_t mn0, int64_t count, int64_t k0, int64_t kc, float* out) {
  const int64_t steps = step_count(kc), panels = (count + kMr - 1) / kMr;
  static thread_local Scratch scratch;
  auto* blocks = reinterpret_cast<uint32_t*>(scratch.get(static_cast<size_t>(panels * 16 * kMr)));  // [panel][pair][word]
  for (int64_t q = 0; q < panels; ++q) *reinterpret_cast<PanelHeader*>(out + q * panel_floats(kc, kMr)) = PanelHeader{};
  for (int64_t s = 0; s < steps; ++s) {
    for (int p = 0; p < 16; ++p) {
      const int64_t k = 32 * s + 2 * p;  // (within the block)
      const uint8_t* lo_row = k < kc ? op.data + ((k0 + k) * op.ld + mn0) * 2 : nullptr;
      const uint8_t* hi_row = k + 1 < kc ? op.data + ((k0 + k + 1) * op.ld + mn0) * 2 : nullptr;
      for (int64_t q = 0; q < panels; ++q) panel_pair(lo_row, hi_row, q, count, blocks + (q * 16 + p) * kMr);
    }
    for (int64_t q = 0; q < panels; ++q) {
      const auto* block = reinterpret_cast<const uint8_t*>(blocks + q * 16 * kMr);
      uint8_t* tiles = reinterpret_cast<uint8_t*>(out + q * panel_floats(kc, kMr) + kHeaderFloats) + s * 2 * kTileBytes;
      transpose16(block, kMr * 4, reinterpret_cast<uint32_t*>(tiles));
      transpose16(block + 64, kMr * 4, reinterpret_cast<uint32_t*>(tiles + kTileBytes));
    }
  }
}

template <bool kB>
void pack_panels(const GemmOperand& op, int64_t mn0, int64_t count, int64_t k0, int64_t kc, float* out,
                 PackNext then = PackNext::next_rows) {
  if (plain_bf16(op) && !op.k_major)
    return kB ? pack_mn_major_bf16_b(op, mn0, count, k0, kc, out) : pack_mn_major_bf16_a(op, mn0, count, k0, kc, out);
  alignas(64) static thread_local uint32_t words[kMr * kMaxWords];
  const int64_t steps = step_count(kc), ldw = steps * (kStep / 2);
  for (int64_t p0 = 0; p0 < count; p0 += kMr) {
    float* panel = out + (p0 / kMr) * panel_floats(kc, kMr);
    auto* header = reinterpret_cast<PanelHeader*>(panel);
    *header = PanelHeader{};
    const int rows = static_cast<int>(std::min<int64_t>(kMr, count - p0));
    uint8_t* data = reinterpret_cast<uint8_t*>(panel + kHeaderFloats);
    if (op.promote) {
      header->promoted = 1;
      header->group_steps = static_cast<uint32_t>(op.gran_k / kStep);
      pack_scales(op, mn0 + p0, rows, k0, kc, panel + scales_offset(kc));
    }
    // Where the 16-row blocks that become tiles are: `base`, rows `row` bytes apart, the next
    // step `step` bytes on, rows (or pairs) 16-31 `half` bytes on. K-major sources hold
    // operand rows (A tiles as they are, B tiles transposed); MN-major ones pair-major words
    // (B tiles as they are, A tiles transposed).
    // K-major FP8 / FP4 B: tiles straight from the codes where the scales allow.
    if (kB && op.k_major && (op.dtype == DType::e4m3 || op.dtype == DType::e2m1x2) && cpu_features().avx512vbmi) {
      alignas(64) static thread_local int16_t shifts[kMaxWords / (kStep / 2) * kMr];
      const bool e4m3 = op.dtype == DType::e4m3, raw = !values_to_pack(op).sf;
      if (raw || step_shifts(op, mn0 + p0, rows, k0, kc, e4m3 ? 119 : 120, shifts)) {
        // Requested meanwhile: the next panel's rows, or where this is the call's last panel
        // and the caller packs the same rows further along K next (a panel over all of K, M
        // up to a row block), their next K block. (Zen 5, 2 cores, alternated: FP8 16 x 7168
        // x 16384 12.6-12.9 -> 10.3-10.4 ms, masked 32 x 20 x 4096 x 7168 120-186 -> 104-117
        // ms, 128 rows even to 15 % faster. On the AMX Xeon, requesting the next K block at
        // 128 rows had measured even.)
        NextPanel np{mn0 + p0 + kMr, static_cast<int>(std::clamp<int64_t>(count - p0 - kMr, 0, kMr)), k0};
        if (np.rows == 0 && then == PackNext::next_k && k0 + kc < op.k) np = {mn0 + p0, rows, k0 + kc};
        (e4m3 ? pack_e4m3_b_tiles : pack_e2m1_b_tiles)(op, mn0 + p0, rows, k0, kc, raw ? nullptr : shifts, data, np);
        continue;
      }
    }
    const uint8_t* base;
    int64_t row, step, half;
    bool from_memory = false;
    if (plain_bf16(op) && op.k_major && rows == kMr && kc % kStep == 0) {
      // Whole steps of 32 full rows of a K-major bf16 operand: tiles straight from the source.
      base = op.data + ((mn0 + p0) * op.ld + k0) * 2, row = op.ld * 2, step = 64, half = 16 * row;
      from_memory = true;
    } else if (op.k_major) {
      if (plain_bf16(op)) load_words(op, mn0 + p0, rows, k0, kc, words, ldw);
      else decode_words(op, mn0 + p0, rows, k0, kc, words, ldw);
      base = reinterpret_cast<const uint8_t*>(words), row = ldw * 4, step = 64, half = 16 * row;
    } else {
      decode_pairs(op, mn0 + p0, rows, k0, kc, words);  // (plain bf16 took pack_mn_major_bf16_*)
      base = reinterpret_cast<const uint8_t*>(words), row = kMr * 4, step = 16 * row, half = 64;
    }
    const bool transpose = kB == op.k_major;
    for (int64_t s = 0; s < steps; ++s)
      for (int h = 0; h < 2; ++h) {
        uint32_t* tile = reinterpret_cast<uint32_t*>(data + (2 * s + h) * kTileBytes);
        const uint8_t* from = base + s * step + h * half;
        // 32 row streams of a weight far from cache: ask for each row's line 20 steps (1280
        // bytes) on, into L2. (Zen 5, 2 cores, bf16 weights 7168 x 16384, alternated runs:
        // 16 rows 16.9-29 -> 13.4-15.3 ms, 128 rows 46-48 -> 42-48 ms, against 8 steps on
        // into L1, which this was until 2026-12-02.)
        if (from_memory)
          for (int r = 0; r < 16; ++r) _mm_prefetch(reinterpret_cast<const char*>(from + r * row + 20 * step), _MM_HINT_T1);
        if (transpose) transpose16(from, row, tile);
        else
          for (int r = 0; r < 16; ++r) std::memcpy(tile + r * 16, from + r * row, 64);
      }
  }
}


// ---------------------------------------------------------------- microkernel

inline void load_c(const float* c, int64_t stride) {
  _tile_loadd(0, c, stride);
  _tile_loadd(1, c + 16, stride);
  _tile_loadd(2, c + 16 * (stride / 4), stride);
  _tile_loadd(3, c + 16 * (stride / 4) + 16, stride);
}
inline void store_c(float* c, int64_t stride) {
  _tile_stored(0, c, stride);
  _tile_stored(1, c + 16, stride);
  _tile_stored(2, c + 16 * (stride / 4), stride);
  _tile_stored(3, c + 16 * (stride / 4) + 16, stride);
}
inline void zero_c() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// Which operand the current sweep streams (a new panel for every tile; the other panel is
// reused): its tiles are loaded with the no-reuse hint (tileloaddt1), so that they do not
// push the reused panel out of L1. Set by begin_tiles. Measured on the 2-vCPU AMX Xeon
// (2026-12-02), alternated runs: k-grouped 4 x 4096 x 7168 x 512 (B streams) 81-82 against
// 88-90 ms; bf16 4096 x 7168 x 2048 (A streams) even to 4 % faster; the hint on the reused
// operand instead was 1-4 % slower. Promoted tiles (4 steps per K group, then the
// sums go out) take it too since their promotion overlaps the next group's products
// (PromotionPipe): FP8 with f32 scales, 4096 x N x K, 2 threads, alternated minima, 2112
// x 7168 66.3 -> 63.6 ms, 4096 x 7168 118.9 -> 115.7, 32768 x 512 115.8 -> 110.2 (before
// that overlap the hint had made them 5-7 % slower).
thread_local bool t_b_streams = false;

enum class Hint { none, b_streams, a_streams };

template <Hint kHint>
inline void load_step(const uint8_t* as, const uint8_t* bs) {
  if constexpr (kHint == Hint::none) {
    _tile_loadd(4, as, 64);
    _tile_loadd(6, bs, 64);
    _tile_loadd(5, as + kTileBytes, 64);
    _tile_loadd(7, bs + kTileBytes, 64);
  } else if constexpr (kHint == Hint::b_streams) {
    _tile_loadd(4, as, 64);
    _tile_stream_loadd(6, bs, 64);
    _tile_loadd(5, as + kTileBytes, 64);
    _tile_stream_loadd(7, bs + kTileBytes, 64);
  } else {
    _tile_stream_loadd(4, as, 64);
    _tile_loadd(6, bs, 64);
    _tile_stream_loadd(5, as + kTileBytes, 64);
    _tile_loadd(7, bs + kTileBytes, 64);
  }
}

// The weight rows medium_m reads next, requested a share per step of the tiles that run
// meanwhile (request_during_tiles), so that a micro-panel's rows are in L2 when its chunks
// are decoded or tile-loaded: the next micro-panel's, or, where the next one is decoded
// during these tiles (AheadDecode), the one after it.
thread_local std::optional<NextPanelRequests> t_tile_requests;

// Byte offset of element k along a K-major row of op (e2m1x2: two per byte, rounded up).
int64_t k_bytes(const GemmOperand& op, int64_t k) {
  return op.dtype == DType::e2m1x2 ? (k + 1) / 2 : k * static_cast<int64_t>(element_size(op.dtype));
}

void request_during_tiles(const GemmOperand& op, int64_t mn0, int count, int64_t k0, int64_t kc, int64_t tiles,
                          int64_t tile_kc) {
  if (count <= 0 || kc <= 0) return t_tile_requests.reset();
  const int64_t first = k_bytes(op, k0);
  t_tile_requests.emplace(op, mn0, count, first, k_bytes(op, k0 + kc) - first, tiles * step_count(tile_kc));
}

// What the blocked path's next tile requests into L2 meanwhile (request_during_tile): one
// run of `lines` lines from `next`, `per_step` a step. (NextPanelRequests, with its row
// counter, made these calls 3-5 % slower: bf16 4096 x 7168 x 2048, 2 threads, 38.8-41.7
// against 40.7-43.5 ms alternated.)
struct TileRequests {
  const char* next = nullptr;
  int64_t lines = 0, per_step = 0;
  void step() {
    const int64_t n = std::min(lines, per_step);
    for (int64_t l = 0; l < n; ++l) _mm_prefetch(next + l * 64, _MM_HINT_T1);
    next += n * 64;
    lines -= n;
  }
};
thread_local TileRequests t_requests;

void request_during_tile(const void* p, int64_t bytes, int64_t k) {
  const int64_t lines = (bytes + 63) / 64;
  t_requests = {static_cast<const char*>(p), lines, (lines + step_count(k) - 1) / std::max<int64_t>(1, step_count(k))};
}

// C tiles += steps [s0, s1) of the panels.
template <Hint kHint>
inline void run_steps(const uint8_t* a, const uint8_t* b, int64_t s0, int64_t s1) {
  for (int64_t s = s0; s < s1; ++s) {
    if (t_requests.lines > 0) t_requests.step();
    load_step<kHint>(a + s * 2 * kTileBytes, b + s * 2 * kTileBytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}
inline void run_hinted_steps(const uint8_t* a, const uint8_t* b, int64_t s0, int64_t s1) {
  if (t_b_streams) run_steps<Hint::b_streams>(a, b, s0, s1);
  else run_steps<Hint::a_streams>(a, b, s0, s1);
}

// rows [r0, r1) of acc += part · (sa[i] · sb[j]) (sa / sb null: 1).
inline void promote_rows(const float* part, const float* sa, const float* sb, int r0, int r1, float* acc) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 sb0 = sb ? _mm512_load_ps(sb) : one, sb1 = sb ? _mm512_load_ps(sb + 16) : one;
  for (int i = r0; i < r1; ++i) {
    const __m512 ai = _mm512_set1_ps(sa ? sa[i] : 1.0f);
    float* row = acc + i * kNr;
    _mm512_store_ps(row, _mm512_fmadd_ps(_mm512_load_ps(part + i * kNr), _mm512_mul_ps(ai, sb0), _mm512_load_ps(row)));
    _mm512_store_ps(row + 16,
                    _mm512_fmadd_ps(_mm512_load_ps(part + i * kNr + 16), _mm512_mul_ps(ai, sb1), _mm512_load_ps(row + 16)));
  }
}

// Promoted tiles: the tiles sum one K group (the finer of the two operands' groups) at a
// time from zero; each group's sums go to memory and are promoted in f32 with AVX-512,
// acc = fma(partial, sa[i] · sb[j], acc) (an operand that is not promoted has scale 1).
// Group g's sums are promoted a slice of rows per step of group g + 1, so that the vector
// work sits between tile products in program order and overlaps them, rather than waiting
// for the group's store while the tiles wait for it (FP8 (1,128,128) with f32 scales, 4096
// x 2112 x 7168, 2 threads, alternated: 63.6-68.1 -> 61.1-65.5 ms; 4096 x 24576 x 1536
// even; the hint on A, which this made pay, gains more: t_b_streams). Group g + 1 may
// belong to another tile (passes over several tiles, medium_m): a pass ending then does not
// wait for its last group's promotion either. Without that, promoted tiles had run slower
// in passes than as whole tiles (4096 x 2112 x 7168: 70.3 against 63.6 ms). Each element
// takes its groups' fmas in order: the same bits however the steps are split into runs.
// What is pending must be promoted (finish) before the sums are read or the scales it
// reads replaced.
class PromotionPipe {
 public:
  // Steps [s0, s1) of a tile (whole promotion groups of `group` steps but the K block's
  // last); sa / sb: the row and column operands' scales, kMr per group of ga / gb steps
  // (null: not promoted); run(t0, t1) adds steps [t0, t1) to the C tiles; acc: the tile's
  // sums (32 x 32, row stride kNr, 64-byte aligned), accumulated onto, else from zero.
  template <class Steps>
  void run(int64_t s0, int64_t s1, int64_t group, const float* sa, int64_t ga, const float* sb, int64_t gb, Steps steps,
           float* acc, bool accumulate) {
    if (!accumulate) {
      if (acc_ == acc) finish();
      std::memset(acc, 0, sizeof(float) * kMr * kNr);
    }
    for (int64_t g0 = s0; g0 < s1; g0 += group) {
      const int64_t g1 = std::min(s1, g0 + group);
      const int slice = static_cast<int>((kMr + (g1 - g0) - 1) / (g1 - g0));  // rows promoted per step
      zero_c();
      for (int64_t s = g0; s < g1; ++s) {
        steps(s, s + 1);
        if (pending_ && row_ < kMr) {
          promote_rows(part_, sa_, sb_, row_, std::min(kMr, row_ + slice), acc_);
          row_ += slice;
        }
      }
      finish();  // (before part_ is stored again)
      store_c(part_, kNr * 4);
      pending_ = true, row_ = 0;
      sa_ = sa ? sa + (g0 / ga) * kMr : nullptr;
      sb_ = sb ? sb + (g0 / gb) * kNr : nullptr;
      acc_ = acc;
    }
  }
  void finish() {
    if (pending_ && row_ < kMr) promote_rows(part_, sa_, sb_, row_, kMr, acc_);
    pending_ = false, acc_ = nullptr;
  }

 private:
  alignas(64) float part_[kMr * kNr];  // the pending group's sums
  int row_ = 0;  // its rows promoted so far
  bool pending_ = false;
  const float *sa_ = nullptr, *sb_ = nullptr;
  float* acc_ = nullptr;
};

// Steps [s0, s1) of the panels a and b (kc deep, at least one promoted) through `pipe`,
// into acc (as PromotionPipe::run takes it).
void run_promoted(PromotionPipe& pipe, int64_t kc, const float* a, const float* b, int64_t s0, int64_t s1, float* acc,
                  bool accumulate) {
  const auto& ha = *reinterpret_cast<const PanelHeader*>(a);
  const auto& hb = *reinterpret_cast<const PanelHeader*>(b);
  const int64_t steps = step_count(kc);
  const int64_t ga = ha.promoted ? ha.group_steps : steps, gb = hb.promoted ? hb.group_steps : steps;
  const uint8_t *as = panel_steps(a), *bs = panel_steps(b);
  pipe.run(
      s0, s1, std::min(ga, gb), ha.promoted ? a + scales_offset(kc) : nullptr, ga, hb.promoted ? b + scales_offset(kc) : nullptr,
      gb, [&](int64_t t0, int64_t t1) { run_hinted_steps(as, bs, t0, t1); }, acc, accumulate);
}

// Steps [s0, s1) of a promoted tile whose panels are kc deep, as one run of its own (c: any
// row stride), its sums gathered into an aligned block.
void promoted_tile(int64_t kc, const float* a, const float* b, int64_t s0, int64_t s1, float* c, int64_t ldc,
                   bool accumulate) {
  alignas(64) float acc[kMr * kNr];
  for (int i = 0; i < kMr; ++i)
    for (int h = 0; h < 2; ++h)
      _mm512_store_ps(acc + i * kNr + 16 * h, accumulate ? _mm512_loadu_ps(c + i * ldc + 16 * h) : _mm512_setzero_ps());
  PromotionPipe pipe;
  run_promoted(pipe, kc, a, b, s0, s1, acc, true);
  pipe.finish();
  for (int i = 0; i < kMr; ++i)
    for (int h = 0; h < 2; ++h) _mm512_storeu_ps(c + i * ldc + 16 * h, _mm512_load_ps(acc + i * kNr + 16 * h));
}

void full_tile(int64_t kc, const float* a, const float* b, int64_t s0, int64_t s1, float* c, int64_t ldc,
               bool accumulate) {
  if (reinterpret_cast<const PanelHeader*>(a)->promoted || reinterpret_cast<const PanelHeader*>(b)->promoted)
    return promoted_tile(kc, a, b, s0, s1, c, ldc, accumulate);
  const int64_t stride = ldc * 4;
  if (accumulate) load_c(c, stride);
  else zero_c();
  run_hinted_steps(panel_steps(a), panel_steps(b), s0, s1);
  store_c(c, stride);
}

void begin_tiles(bool b_streams) {
  configure();
  t_b_streams = b_streams;
  t_requests.lines = 0;  // (what an earlier run of tiles requested and did not take)
}

// K [k0, k1) of a tile (the driver calls begin_tiles first).
void tile_steps_now(int64_t kc, const float* a, const float* b, int64_t k0, int64_t k1, float* c, int64_t ldc, int rows,
                    int cols, bool accumulate) {
  const int64_t s0 = k0 / kStep, s1 = step_count(k1);
  if (rows == kMr && cols == kNr) return full_tile(kc, a, b, s0, s1, c, ldc, accumulate);
  // Partial tile: the full one on a scratch copy (padded panel rows and columns are zero).
  alignas(64) float scratch[kMr * kNr];
  if (accumulate)
    for (int i = 0; i < rows; ++i) std::memcpy(scratch + i * kNr, c + i * ldc, static_cast<size_t>(cols) * 4);
  full_tile(kc, a, b, s0, s1, scratch, kNr, accumulate);
  for (int i = 0; i < rows; ++i) std::memcpy(c + i * ldc, scratch + i * kNr, static_cast<size_t>(cols) * 4);
}

// The passes' promotion pipe (GemmKernels::tile_steps, settle_tiles).
thread_local PromotionPipe t_pipe;
void settle_tiles() { t_pipe.finish(); }

// GemmKernels::tile_steps: whole promoted tiles whose sums lie as the driver's partial-sum
// buffers hold them (row stride kNr, aligned) go through the passes' promotion pipe; the
// rest as whole tiles do, after what is pending. Through the pipe, alternated minima
// against whole tiles (FP8 (1,128,128) f32 scales, 2 threads): 4096 x 2112 x 7168 63.2 ->
// 60.6 ms and 61.1 -> 59.1, 4096 x 4096 x 7168 115.3 -> 111.1, 4096 x 24576 x 1536 150.4 ->
// 147.7, 4096 x 32768 x 512 75.3 -> 73.1, 4096 x 7168 x 2048 even (the same bits).
void tile_steps(int64_t kc, const float* a, const float* b, int64_t k0, int64_t k1, float* c, int64_t ldc, int rows,
                int cols, bool accumulate) {
  const bool promoted = reinterpret_cast<const PanelHeader*>(a)->promoted || reinterpret_cast<const PanelHeader*>(b)->promoted;
  if (promoted && rows == kMr && cols == kNr && ldc == kNr && reinterpret_cast<uintptr_t>(c) % 64 == 0)
    return run_promoted(t_pipe, kc, a, b, k0 / kStep, step_count(k1), c, accumulate);
  t_pipe.finish();
  tile_steps_now(kc, a, b, k0, k1, c, ldc, rows, cols, accumulate);
}

// Passes keep each promotion group within one pass (a group's sums are one chain of tile
// products from zero), so panels promoted in groups longer than a pass take whole tiles.
bool passes_take(const float* a, const float* b) {
  const auto fits = [](const float* panel) {
    const auto& h = *reinterpret_cast<const PanelHeader*>(panel);
    return !h.promoted || h.group_steps * kStep <= kPassK;
  };
  return fits(a) && fits(b);
}

void tile(int64_t kc, const float* a, const float* b, float* c, int64_t ldc, int rows, int cols, bool accumulate) {
  tile_steps_now(kc, a, b, 0, kc, c, ldc, rows, cols, accumulate);
}

// ---------------------------------------------------------------- small M: weights streamed
// Decode (M at most kStreamM rows of A) is bound by reading B once. Packing B into panels
// first would read it, write it and read it again; here the tiles compute D^T = B · A^T
// instead: a strip of B rows (K-major) is decoded 256 K at a time into an L1 buffer that
// the tiles load as A tiles (row stride 512 bytes; plain bf16 rows are loaded where they
// are), and A, packed once per call as B panels, supplies the other operand. Each C tile is
// weights x activations, stationary over all of K. The sums are those of the blocked path,
// step for step (tdpbf16ps is symmetric in its operands; the same steps, groups and
// promotion fma in the same order), so a call gives the same bits whichever path its M takes.
//
// Strips of 32 weight rows. Promoted scales send each K group's sums out of the tiles:
//  - narrow (at most 16 rows of A): one activation tile column, so two of the four C tiles
//    hold a strip; groups alternate between tiles (0, 2) and (1, 3), and storing and
//    promoting one group overlaps the next group's products;
//  - wide (17 to 32 rows of A): both activation tile columns on all four C tiles, drained
//    together at each group's end. (Strips of 16 weight rows whose groups alternated
//    between tiles (0, 1) and (2, 3), as narrow strips do, loaded twice the tiles per weight
//    and promoted twice as often per weight: masked-decode-sized calls, 20 or 32 x 4096 x
//    7168 FP8 with f32 activation scales, ran 5-20 % slower, alternated; docs/GEMM.md.)

enum class StreamShape : uint8_t { narrow, wide };

struct Stream {
  const GemmOperand& a;  // activations: columns of the C tiles
  const GemmOperand& b;  // weights: rows of the C tiles
  const float* act;      // A's panels, one per K block of kKc
  const float* sa;       // A's scale per promotion group and row: sa[g * 32 + m] (1 if A is not promoted)
  StreamShape shape;
  bool promoted;
  int64_t group_steps;   // steps per promotion group
  const uint8_t* narrow_tiles;  // narrow: the first tile of every step of A, contiguous
};

// (The tile intrinsics take register numbers as literals.) The activation tiles, read once
// per strip from L2, load with the no-reuse hint, so that they do not push the decoded
// chunks out of L1: alternated, masked FP8 32 x 20 x 4096 x 7168 (f32 activation scales)
// 60.8-72.9 -> 51.5-61.4 ms, 16 x 4096 x 7168 FP8 with ue8m0 scales 1.50-1.96 -> 1.38-1.49
// ms, promoted 16-row calls even (docs/GEMM.md).
template <bool kOdd>
inline void narrow_steps(const uint8_t* w, int64_t stride, const uint8_t* x, int64_t s0, int64_t s1) {
  for (int64_t s = s0; s < s1; ++s) {
    _tile_loadd(4, w + s * 64, stride);
    _tile_stream_loadd(6, x + s * kTileBytes, 64);
    _tile_loadd(5, w + 16 * stride + s * 64, stride);
    if constexpr (kOdd) {
      _tile_dpbf16ps(1, 4, 6);
      _tile_dpbf16ps(3, 5, 6);
    } else {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(2, 5, 6);
    }
  }
}

inline void wide_steps(const uint8_t* w, int64_t stride, const uint8_t* x, int64_t s0, int64_t s1) {
  for (int64_t s = s0; s < s1; ++s) {
    const uint8_t* xs = x + s * 2 * kTileBytes;
    _tile_loadd(4, w + s * 64, stride);
    _tile_stream_loadd(6, xs, 64);
    _tile_loadd(5, w + 16 * stride + s * 64, stride);
    _tile_stream_loadd(7, xs + kTileBytes, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

// Steps [s0, s1) of the chunk into the C tiles of group parity `odd`.
void run_steps_streamed(const Stream& st, bool odd, const uint8_t* w, int64_t stride, const uint8_t* x, int64_t s0,
                        int64_t s1) {
  switch (st.shape) {
    case StreamShape::wide: return wide_steps(w, stride, x, s0, s1);
    case StreamShape::narrow: return odd ? narrow_steps<true>(w, stride, x, s0, s1) : narrow_steps<false>(w, stride, x, s0, s1);
  }
}

// Tiles t0 and t1 to `first` and `second` (rows of 32 f32), then zeroed. (A macro: the tile
// intrinsics take register numbers as literals.)
#define MOEKIT_TAKE_TILE_PAIR(t0, first, t1, second) \
  do {                                               \
    _tile_stored(t0, first, kNr * 4);                \
    _tile_stored(t1, second, kNr * 4);               \
    _tile_zero(t0);                                  \
    _tile_zero(t1);                                  \
  } while (0)

// The C tiles of group parity `odd` to sums[n * 32 + m] (narrow: columns 0-15 only), then
// zeroed.
void take_sums(const Stream& st, bool odd, float* sums) {
  float* lower = sums + 16 * kNr;  // narrow: weight rows 16-31
  switch (st.shape) {
    case StreamShape::wide:
      store_c(sums, kNr * 4);
      return zero_c();
    case StreamShape::narrow:
      if (odd) MOEKIT_TAKE_TILE_PAIR(1, sums, 3, lower);
      else MOEKIT_TAKE_TILE_PAIR(0, sums, 2, lower);
      return;
  }
}
#undef MOEKIT_TAKE_TILE_PAIR

// The C tiles as stream_strip's products (StreamDp, stream_dp.inc, is the vdpbf16ps one).
struct StreamTiles {
  static constexpr int64_t kSlice = 1;  // steps per call while the next chunk is decoded by rows
  static bool bf16_by_rows(const GemmOperand&) { return false; }  // plain bf16 weight rows loaded where they are
  static constexpr bool kFarRequests = false;  // (StripSource::decode_rows)
  static constexpr bool kTakeLater = true;  // (stream_rows)
  const Stream& st;
  void zero() const { zero_c(); }
  void steps(bool odd, const uint8_t* w, int64_t stride, const uint8_t* x, int64_t s0, int64_t s1) const {
    run_steps_streamed(st, odd, w, stride, x, s0, s1);
  }
  void take(bool odd, float* sums) const { take_sums(st, odd, sums); }
};

// acc[n][m] = fma(part[n][m], sa[m] · sb[n], acc[n][m]) for every row of the strip (and m < 16 unless
// wide): the blocked path's promotion, transposed.
template <bool kWide, bool kUniform>
void promote_strip_as(const float* part, const float* sa, const float* sb, float* acc) {
  const __m512 sa0 = _mm512_loadu_ps(sa), sa1 = _mm512_loadu_ps(sa + 16);
  // (Uniform: every row's product sa[m] · sb[n] is the same, made once.)
  const __m512 uniform0 = _mm512_mul_ps(sa0, _mm512_set1_ps(sb[0])), uniform1 = _mm512_mul_ps(sa1, _mm512_set1_ps(sb[0]));
  for (int n = 0; n < kMr; ++n) {
    const __m512 bn = _mm512_set1_ps(sb[n]);
    float* row = acc + n * kNr;
    const __m512 s0 = kUniform ? uniform0 : _mm512_mul_ps(sa0, bn);
    _mm512_store_ps(row, _mm512_fmadd_ps(_mm512_load_ps(part + n * kNr), s0, _mm512_load_ps(row)));
    if constexpr (kWide) {
      const __m512 s1 = kUniform ? uniform1 : _mm512_mul_ps(sa1, bn);
      _mm512_store_ps(row + 16, _mm512_fmadd_ps(_mm512_load_ps(part + n * kNr + 16), s1, _mm512_load_ps(row + 16)));
    }
  }
}
void promote_strip(const float* part, const float* sa, const float* sb, bool wide, bool uniform, float* acc) {
  if (wide) return uniform ? promote_strip_as<true, true>(part, sa, sb, acc) : promote_strip_as<true, false>(part, sa, sb, acc);
  return uniform ? promote_strip_as<false, true>(part, sa, sb, acc) : promote_strip_as<false, false>(part, sa, sb, acc);
}

// `rows` rows of kChunk bf16 (`row_bytes` apart) into rows of kChunkWords words.
void copy_rows(const uint8_t* src, int64_t row_bytes, int rows, uint32_t* out) {
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < kChunk * 2; i += 64)
      _mm512_store_si512(reinterpret_cast<uint8_t*>(out + r * kChunkWords) + i, _mm512_loadu_si512(src + r * row_bytes + i));
}

// Lines [0, bytes) of rows [r0, r1) (row_bytes apart) from `first`, into L2. Addresses as
// integers: they may lie past B, where the requests are dropped.
inline void request_lines_into_l2(uintptr_t first, int64_t row_bytes, int r0, int r1, int64_t bytes) {
  for (int r = r0; r < r1; ++r)
    for (int64_t c = 0; c < bytes; c += 64)
      _mm_prefetch(reinterpret_cast<const char*>(first + static_cast<uintptr_t>(r * row_bytes + c)), _MM_HINT_T1);
}

// One strip's weights for the tiles: rows [j0, j0 + rows) of B (rows at most the strip),
// chunk by chunk. Whole chunks of e4m3 (raw, or with folded power-of-two scales) and of
// folded e2m1 can also be decoded a few rows at a time (rowwise, decode_rows).
class StripSource {
 public:
  static constexpr int kGroups = kChunk / 32;  // scale shifts per row of a chunk
  // The shifts of a chunk's rows (kMr x kGroups), for folded chunks decoded by rows.
  struct Shifts {
    alignas(64) int16_t values[kMr * kGroups];
  };

  // next_rows: how many rows the strip after this one has (0: none), whose first chunk
  // this strip's last chunk requests. requests: whether decode_rows requests what the
  // streaming path reads next (medium_m requests its own); far_requests: whether also
  // the chunk two strips on (see decode_rows).
  StripSource(const GemmOperand& b, int64_t j0, int rows, int next_rows, bool bf16_by_rows, bool requests = true,
              bool far_requests = true)
      : b_(b), j0_(j0), rows_(rows), next_rows_(next_rows), full_(rows == kMr), requests_(requests),
        far_requests_(far_requests),
        bf16_by_rows_(bf16_by_rows && plain_bf16(b)),
        row_bytes_(b.ld * static_cast<int64_t>(element_size(b.dtype))),
        first_row_(row_ptr(b, j0)),
        raw_e4m3_(b.dtype == DType::e4m3 && (!b.sf || b.promote) && cpu_features().avx512vbmi),
        folded_e4m3_(b.dtype == DType::e4m3 && b.sf && !b.promote && b.gran_k % 32 == 0 && cpu_features().avx512vbmi),
        folded_e2m1_(b.dtype == DType::e2m1x2 && b.sf && !b.promote && b.gran_k % 32 == 0 && cpu_features().avx512vbmi),
        affine_(cpu_features().gfni) {
    if (folded_e4m3_ || folded_e2m1_) scale_rows(b, j0, rows, sf_rows_);
  }

  int64_t first_row() const { return j0_; }
  int rows() const { return rows_; }

  // Chunk [k0, k0 + kChunk) as A tiles: where they are (plain bf16 rows in place, unless
  // bf16_by_rows) or decoded (copied) into `words` (rows past a short strip's end stay as
  // they are: their sums are never read); sets the row stride.
  const uint8_t* chunk(int64_t k0, uint32_t* words, int64_t& stride) const {
    const int64_t len = std::min(kChunk, b_.k - k0);
    stride = kChunkWords * 4;
    if (plain_bf16(b_) && full_ && !bf16_by_rows_ && len % kStep == 0) {
      stride = row_bytes_;
      return first_row_ + k0 * 2;
    }
    Shifts shifts;
    if (plain_bf16(b_)) load_words(b_, j0_, rows_, k0, len, words, kChunkWords);
    else if (rowwise(k0, shifts)) decode_rows(k0, 0, rows_, shifts, words);
    else decode_words(b_, j0_, rows_, k0, len, words, kChunkWords);
    return reinterpret_cast<const uint8_t*>(words);
  }

  // Whether chunk k0 can be decoded by rows (decode_rows): a whole chunk of a full strip,
  // of raw e4m3, of plain bf16 copied by rows (bf16_by_rows), or of folded e4m3 or e2m1
  // whose scales are all powers of two in the range that keeps the values bf16 normals
  // (then their shifts are in `shifts`).
  bool rowwise(int64_t k0, Shifts& shifts) const {
    if (!full_ || b_.k - k0 < kChunk) return false;
    if (raw_e4m3_ || bf16_by_rows_) return true;
    // e4m3 values run from 2^-9 to 1.75 · 2^8: scaled by 2^-100 .. 2^119 they stay bf16
    // normals; e2m1 values (0.5 to 6) up to 2^120.
    if (folded_e4m3_) return chunk_shifts(b_, sf_rows_, rows_, k0, -100, 119, shifts.values);
    if (folded_e2m1_) return chunk_shifts(b_, sf_rows_, rows_, k0, -100, 120, shifts.values);
    return false;
  }
  // Rows [r0, r1) of chunk k0, as chunk() lays them out (rowwise(k0, shifts) must hold).
  // Requests the same rows of the chunk after into L2 meanwhile, or, decoding the last
  // chunk, the same rows of the next strip's first chunk: a strip reads 32 rows a few lines
  // at a time, streams the hardware prefetcher follows poorly (FP4, 16 x 7168 x 16384 on
  // one thread: the first load of each row was 60 % of the decoder's time; the next strip's
  // first chunk, unrequested, had been read on demand: docs/GEMM.md, session 21).
  void decode_rows(int64_t k0, int r0, int r1, const Shifts& shifts, uint32_t* words) const {
    if (!requests_) return decode_rows_here(k0, r0, r1, shifts, words);
    const int bits = b_.dtype == DType::e2m1x2 ? 4 : b_.dtype == DType::e4m3 ? 8 : 16;  // per value
    const auto bytes = [&](int64_t values) { return (values * bits + 7) / 8; };
    const int64_t after = b_.k - k0 - kChunk;  // values of the rows after this chunk
    const auto first = reinterpret_cast<uintptr_t>(first_row_);
    if (after > 0) request_rows(first + bytes(k0 + kChunk), r0, r1, bytes(std::min(kChunk, after)));
    if (after < kChunk) request_rows(first + kMr * row_bytes_, r0, std::min(r1, next_rows_), bytes(std::min(kChunk, b_.k)));
    // Rows of at most 4 KiB: also this chunk's place two strips on (256 KiB ahead at most),
    // where the next strip's first chunk, requested during this strip's last, came too late
    // (session 38, 2 Zen 4 threads, from DRAM, alternated: bf16 16 x 32768 x 512 2.66-3.00 ->
    // 2.42-2.67 ms, 8 x 65536 x 256 2.23-2.30 -> 1.97-2.19, 20 x 16384 x 768 2.45-2.49 ->
    // 2.29-2.38; FP8 16 x 32768 x 512 2.20-2.47 -> 2.01-2.04, 16 x 7168 x 2048 1.82-2.04 ->
    // 1.72-1.95; longer rows even, FP8 16 x 7168 x 16384 14.2-14.6 against 14.1-15.0).
    // On the AMX tiles (StreamTiles::kFarRequests) they were slower: session 42, 2 threads
    // of the AMX Xeon, from DRAM, alternated: FP8 (1,128,128) f32 scales 16 x 7168 x 2048
    // 0.80 -> 0.71 ms without them, 16 x 24576 x 1536 2.05 -> 1.75, 4 x 24576 x 1536 1.95
    // -> 1.66; 16 x 32768 x 512 and bf16 even.
    if (far_requests_ && row_bytes_ <= kFarRowBytes)
      request_rows(first + static_cast<uintptr_t>(2 * kMr * row_bytes_ + bytes(k0)), r0, r1, bytes(std::min(kChunk, b_.k - k0)));
    decode_rows_here(k0, r0, r1, shifts, words);
  }

 private:
  // decode_rows without the requests.
  void decode_rows_here(int64_t k0, int r0, int r1, const Shifts& shifts, uint32_t* words) const {
    uint32_t* out = words + r0 * kChunkWords;
    if (bf16_by_rows_) return copy_rows(first_row_ + r0 * row_bytes_ + k0 * 2, row_bytes_, r1 - r0, out);
    if (folded_e2m1_) return e2m1_rows_to_bf16(b_, j0_ + r0, r1 - r0, k0, shifts.values + r0 * kGroups, out);
    // Weights whose blocks mostly hold a zero, subnormal or NaN code (uniformly random codes,
    // say: 1 in 16 has e = 0) pay for the affine path's check and take the tables anyway.
    // After a call in which at least 3 blocks in 4 took the tables, the strip uses the tables
    // alone, trying the affine path again every 64th call.
    const bool affine = affine_ && (tabled_calls_ == 0 || ++skipped_ % 64 == 0);
    const int blocks = (r1 - r0) * static_cast<int>(kChunk / 64);
    const int16_t* row_shifts = raw_e4m3_ ? nullptr : shifts.values + r0 * kGroups;
    alignas(64) int32_t offsets[kMr * kGroups];  // (E4m3Affine: each shift plus kUnbias, as a word pair)
    if (affine && row_shifts)
      for (int i = 0; i < (r1 - r0) * kGroups; ++i) {
        const auto o = static_cast<uint16_t>(row_shifts[i] + E4m3Affine::kUnbias);
        offsets[i] = static_cast<int32_t>(o | static_cast<uint32_t>(o) << 16);
      }
    const int by_tables = e4m3_chunk_to_bf16(first_row_ + r0 * row_bytes_ + k0, row_bytes_, r1 - r0, row_shifts,
                                             row_shifts ? offsets : nullptr, affine, out);
    if (affine) tabled_calls_ = 4 * by_tables >= 3 * blocks ? tabled_calls_ + 1 : 0;
  }

  static constexpr int64_t kFarRowBytes = 4096;
  void request_rows(uintptr_t first, int r0, int r1, int64_t bytes) const {
    request_lines_into_l2(first, row_bytes_, r0, r1, bytes);
  }

  const GemmOperand& b_;
  int64_t j0_;
  int rows_, next_rows_;
  bool full_, requests_, far_requests_;
  bool bf16_by_rows_;  // plain bf16 rows copied into the chunk buffer by rows (decode_rows), not read in place
  int64_t row_bytes_;
  const uint8_t* first_row_;
  bool raw_e4m3_, folded_e4m3_, folded_e2m1_;
  bool affine_;  // e4m3 rows by E4m3Affine (GFNI)
  const void* sf_rows_[kMr] = {};  // (folded: each row's scales)
  mutable int tabled_calls_ = 0, skipped_ = 0;  // (decode_rows: calls mostly by tables, calls skipped)
};

// Whether rows' scales are all one row of scales (rows of one scale block).
bool same_scale_row(const void* const* sf_rows, int rows) {
  return std::all_of(sf_rows, sf_rows + rows, [&](const void* r) { return r == sf_rows[0]; });
}

// Where a strip's first chunk is: decoded during the previous strip's last chunk (`ready`,
// in buffers[buffer]), or still to be decoded (into buffers[buffer]).
struct StripCursor {
  int buffer = 0;
  bool ready = false;
};

// out[m * ld_out + n] = acc[n * 32 + m] for m < cols, n < rows: a strip's sums as rows of
// D, 16 x 16 blocks at a time (a scalar loop had been half of a short-K decode call's
// bookkeeping: 16 x 32768 x 512 FP8, docs/GEMM.md, session 21). Only columns below `cols`
// of acc are read where cols <= 16.
void write_transposed(const float* acc, int cols, int rows, float* out, int64_t ld_out) {
  alignas(64) uint32_t block[16 * 16];
  for (int m0 = 0; m0 < cols; m0 += 16)
    for (int n0 = 0; n0 < rows; n0 += 16) {
      transpose16(reinterpret_cast<const uint8_t*>(acc + n0 * kNr + m0), kNr * 4, block);
      const auto live = static_cast<__mmask16>((1u << std::min(16, rows - n0)) - 1);
      for (int m = m0; m < std::min(cols, m0 + 16); ++m)
        _mm512_mask_storeu_ps(out + m * ld_out + n0, live, _mm512_load_ps(reinterpret_cast<const float*>(block + (m - m0) * 16)));
    }
}

// A strip whose sums stay in its pair of C tiles (narrow calls whose sums are not
// promoted, on the tiles): stream_strip neither zeroes nor takes them, and the caller takes
// them after the next strip's first step (stream_rows).
struct LaterTake {
  bool odd;  // the pair of C tiles this strip sums into (its index's parity)
};

// The source's weight rows against every row of A, all of K: acc[n * 32 + m] (or, with a
// LaterTake, left in the tiles; then take_previous() runs after the strip's first step).
// Software-pipelined: chunk c + 1 is decoded before (or, where it can be decoded by rows, a
// few rows before each slice of Steps::kSlice steps of) the products of chunk c, so the
// tile loads read words stored well before them (tile loads wait for earlier stores to reach
// the cache) and the products overlap the next decode. The last chunk's steps likewise
// decode the first chunk of the next strip (`next`, null if none), so that short K (one or
// two chunks a strip) overlaps as long K does; `cursor` carries that chunk from strip to
// strip.
template <class Steps, class TakePrevious>
void stream_strip(const Stream& st, Steps& products, const StripSource& source, const StripSource* next, StripCursor& cursor,
                  float* acc, const LaterTake* later, TakePrevious&& take_previous) {
  const GemmOperand& b = st.b;
  const int rows = source.rows();
  const int64_t k = b.k, steps = step_count(k);
  alignas(64) static thread_local uint32_t buffers[2][kMr * kChunkWords];
  alignas(64) float part[kMr * kNr], sb[kMr];
  StripSource::Shifts next_shifts;
  const void* sf_rows[kMr] = {};
  if (b.promote) scale_rows(b, source.first_row(), rows, sf_rows);
  // Rows of one row of scales (128 x 128 FP8 weights: every strip) take one lookup per group.
  const bool one_scale_row = b.promote && same_scale_row(sf_rows, rows);
  for (int r = 0; r < kMr; ++r) sb[r] = b.promote && r >= rows ? 0.0f : 1.0f;
  // Every row's weight scale the same (no weight scales, or a full strip of one row of scales).
  const bool uniform_sb = !b.promote || (one_scale_row && rows == kMr);
  if (st.promoted) std::memset(acc, 0, sizeof(float) * kMr * kNr);
  if (!later) products.zero();  // (else the pair was zeroed when its last sums were taken)
  bool previous_taken = !later;
  int64_t group = 0;  // promotion groups finished
  int64_t stride = kChunkWords * 4, next_stride = 0;
  int current = cursor.buffer;
  const uint8_t* w = cursor.ready ? reinterpret_cast<const uint8_t*>(buffers[current]) : source.chunk(0, buffers[current], stride);
  cursor.ready = false;
  for (int64_t k0 = 0; k0 < k; k0 += kChunk) {
    uint32_t* next_words = buffers[current ^ 1];
    const int64_t first = k0 / kStep, n = step_count(std::min(kChunk, k - k0));  // steps [first, first + n) of K
    const bool last = k0 + kChunk >= k;
    // The chunk after this one (of this strip, or the next strip's first) a few rows per
    // step where it can, so that the products are spread through the decode (whose loads
    // wait on memory); else, within the strip, all of it first. (Raw e4m3, 16 x 7168 x
    // 16384 on one thread: 16 -> 13 ms.)
    const StripSource* decoder = last ? next : &source;
    const int64_t next_k0 = last ? 0 : k0 + kChunk;
    const bool interleave = decoder && (last || n == kChunk / kStep) && decoder->rowwise(next_k0, next_shifts);
    const int decode_rows = decoder ? decoder->rows() : 0;
    const int per_step = (decode_rows + static_cast<int>(n) - 1) / static_cast<int>(n);
    const uint8_t* following = nullptr;
    if (interleave) following = reinterpret_cast<const uint8_t*>(next_words), next_stride = kChunkWords * 4;
    else if (!last) following = source.chunk(next_k0, next_words, next_stride);
    const uint8_t* x = st.narrow_tiles ? st.narrow_tiles + first * kTileBytes
                                       : panel_steps(st.act + (k0 / kKc) * panel_floats(kKc, kMr)) + (k0 % kKc) / kStep * 2 * kTileBytes;
    for (int64_t s = 0; s < n;) {
      const int64_t group_end = (group + 1) * st.group_steps;  // (a step of K; no division per step)
      int64_t end = st.promoted ? std::min(n, group_end - first) : n;
      if (interleave) {
        end = std::min(end, s + Steps::kSlice);
        const int r0 = std::min(decode_rows, static_cast<int>(s) * per_step);
        const int r1 = std::min(decode_rows, static_cast<int>(end) * per_step);
        if (r0 < r1) decoder->decode_rows(next_k0, r0, r1, next_shifts, next_words);
      }
      products.steps(later ? later->odd : (group & 1), w, stride, x, s, end);
      if (!previous_taken) take_previous(), previous_taken = true;
      s = end;
      if (st.promoted && (first + s == group_end || first + s == steps)) {
        products.take(group & 1, part);
        if (b.promote) {
          const int64_t g = group * st.group_steps * kStep / b.gran_k;
          if (one_scale_row) std::fill(sb, sb + rows, group_scale(b, sf_rows[0], g));
          else
            for (int r = 0; r < rows; ++r) sb[r] = group_scale(b, sf_rows[r], g);
        }
        promote_strip(part, st.sa + group * kMr, sb, st.shape != StreamShape::narrow, uniform_sb, acc);
        ++group;
      }
    }
    current ^= 1;
    if (last) cursor = {current, interleave};
    w = following, stride = next_stride;
  }
  if (!st.promoted && !later) products.take(false, acc);
}

void stream_small_m_tiles(const GemmOperand& a, const GemmOperand& b, int64_t n0, int64_t n1, float* out, int64_t ld_out);
template <class Steps>
void stream_rows(const GemmOperand& a, const GemmOperand& b, int64_t n0, int64_t n1, float* out, int64_t ld_out);

#include "dot_row_amx.inc"
#include "stream_dp.inc"

// out[m, j - n0] = Σ_k a[m, k] · b[j, k] for m < a.mn (at most kStreamM), j in [n0, n1); B
// K-major. A is packed once per call.
void stream_small_m(const GemmOperand& a, const GemmOperand& b, int64_t n0, int64_t n1, float* out, int64_t ld_out) {
  if (fp4_dot_takes(a, b)) return fp4_dot_small_m(a, b, n0, n1, out, ld_out, &stream_small_m_tiles);
  return stream_small_m_tiles(a, b, n0, n1, out, ld_out);
}

void stream_small_m_tiles(const GemmOperand& a, const GemmOperand& b, int64_t n0, int64_t n1, float* out, int64_t ld_out) {
  // One or two rows of A use a sixteenth or an eighth of each product: against e4m3
  // weights they take bf16 dot products on weights decoded in registers (dot_row_amx.inc);
  // one row against bf16 weights the FMA kernel, which decodes B straight into registers
  // too, and gives the FMA paths' bits. (Measured on 2 cores of a Xeon with AMX, 1 x 7168
  // x 16384: bf16 weights 7.8 ms there, 8.4-8.7 on the tiles; FP4 weights 8.4-8.7 there,
  // 5.3-6.1 on the tiles, which take them.)
  if (dot_row_takes(a, b)) return dot_row_small_m(a, b, n0, n1, out, ld_out, kAmxFarBytes);
  if (a.mn == 1 && a.k_major && b.dtype != DType::e2m1x2 && (!b.sf || b.gran_k % 8 == 0))
    return gemm_kernels_avx512().small_m(a, b, n0, n1, out, ld_out);
  configure();
  stream_rows<StreamTiles>(a, b, n0, n1, out, ld_out);
}

// What stream_rows derives from A: its panels (one per K block of kKc), its scale per
// promotion group of `group` steps and row (1 where A is not promoted, 0 past its rows), and
// for narrow calls (narrow_tiles not null) the first tile of every step, contiguous: out of
// the panels (where each K block's lie between a header and its scales, two tiles a step),
// the 1 KiB a step loads (every strip reads them all from L2) then lie 1 KiB apart instead
// of 2, which took FP8 x 7168 x 16384 on 2 threads from 7.1-7.25 to 6.7-6.8 ms at 16 rows,
// and from 7.3-7.8 to 6.3 ms at 4. (Copying both tiles of a step for 17 to 32 rows gained
// nothing and cost the copy: masked decode of 32 experts x 20 rows 2 % slower.)
void prepare_stream(const GemmOperand& a, int64_t steps, int64_t group, float* act, float* sa, uint8_t* narrow_tiles) {
  const int64_t k = a.k, groups = (steps + group - 1) / group;
  for (int64_t pc = 0; pc < k; pc += kKc)
    pack_panels<true>(a, 0, a.mn, pc, std::min(kKc, k - pc), act + (pc / kKc) * panel_floats(kKc, kMr));
  for (int m = 0; m < kMr; ++m) {
    const void* sf_row = a.promote && m < a.mn ? scale_row(a, m) : nullptr;
    for (int64_t g = 0; g < groups; ++g)
      sa[g * kMr + m] = !a.promote ? 1.0f : sf_row ? group_scale(a, sf_row, g * group * kStep / a.gran_k) : 0.0f;
  }
  if (!narrow_tiles) return;
  for (int64_t s = 0; s < steps; ++s)
    std::memcpy(narrow_tiles + s * kTileBytes,
                panel_steps(act + (s * kStep / kKc) * panel_floats(kKc, kMr)) + (s % (kKc / kStep)) * 2 * kTileBytes,
                kTileBytes);
}

// stream_small_m's body for either kind of products (Steps: StreamTiles or StreamDp, built
// from the Stream): A packed once, then strip after strip of weight rows.
template <class Steps>
void stream_rows(const GemmOperand& a, const GemmOperand& b, int64_t n0, int64_t n1, float* out, int64_t ld_out) {
  const int64_t k = a.k, blocks = std::max<int64_t>(1, (k + kKc - 1) / kKc), steps = step_count(k);
  // Steps between promotions: the finer group of a promoted operand, as in promoted_tile.
  int64_t group = steps;
  if (a.promote) group = std::min(group, a.gran_k / kStep);
  if (b.promote) group = std::min(group, b.gran_k / kStep);
  const int64_t groups = (steps + group - 1) / group;
  // A's panels, scales and activation tiles are made once per thread and GEMM call (the
  // driver hands a thread several column chunks: at 16 x 576 x 7168 FP8 on 2 threads,
  // packing A for each had been a tenth of the call).
  static thread_local uint64_t prepared_for = 0;
  static thread_local Scratch buffer, scales;  // (panels start with a 64-byte aligned header)
  float* act = buffer.get(static_cast<size_t>(blocks * panel_floats(kKc, kMr)));
  float* sa = scales.get(static_cast<size_t>(groups * kMr));
  const bool promoted = a.promote || b.promote;
  const StreamShape shape = a.mn <= 16 ? StreamShape::narrow : StreamShape::wide;
  static thread_local Scratch step_tiles;
  uint8_t* narrow_tiles =
      shape == StreamShape::narrow ? reinterpret_cast<uint8_t*>(step_tiles.get(static_cast<size_t>(steps * kTileBytes / 4))) : nullptr;
  once_per_call(prepared_for, [&] { prepare_stream(a, steps, group, act, sa, narrow_tiles); });
  const Stream st{a, b, act, sa, shape, promoted, group, narrow_tiles};
  Steps products{st};
  alignas(64) float acc[kMr * kNr];
  std::optional<StripSource> sources[2];  // this strip's and the next one's
  auto strip_rows = [&](int64_t j0) { return static_cast<int>(std::clamp<int64_t>(n1 - j0, 0, kMr)); };
  if (n0 < n1) sources[0].emplace(b, n0, strip_rows(n0), strip_rows(n0 + kMr), Steps::bf16_by_rows(b), true, Steps::kFarRequests);
  StripCursor cursor;
  // Narrow sums that are not promoted are taken from the tiles a strip late (LaterTake), so
  // that the tile stores do not wait at each strip's end for its last products (and the
  // next strip's decode and products behind them): strips alternate between the two pairs
  // of C tiles. Alternated medians, 2 threads, from DRAM: FP8 x FP4 (packed ue8m0) 16 x
  // 32768 x 512 0.90 -> 0.85 ms, 16 x 7168 x 2048 0.632 -> 0.626; FP8 ue8m0 16 x 32768 x
  // 512 1.16 -> 1.12; K = 1536 and 7168 within 1 %.
  const bool take_later = Steps::kTakeLater && shape == StreamShape::narrow && !promoted;
  int64_t pending = -1;  // (take_later: the first row of the strip whose sums are still in its tiles)
  auto take_pending = [&] {
    if (pending < 0) return;
    products.take(((pending - n0) / kMr) & 1, acc);
    write_transposed(acc, static_cast<int>(a.mn), strip_rows(pending), out + (pending - n0), ld_out);
    pending = -1;
  };
  if (take_later) products.zero();
  for (int64_t j0 = n0, i = 0; j0 < n1; j0 += kMr, i ^= 1) {
    const int rows = strip_rows(j0);
    StripSource* next = nullptr;
    if (j0 + kMr < n1)
      next = &sources[i ^ 1].emplace(b, j0 + kMr, strip_rows(j0 + kMr), strip_rows(j0 + 2 * kMr), Steps::bf16_by_rows(b), true,
                                     Steps::kFarRequests);
    const LaterTake later{i == 1};
    stream_strip(st, products, *sources[i], next, cursor, acc, take_later ? &later : nullptr, take_pending);
    if (take_later) pending = j0;
    else write_transposed(acc, static_cast<int>(a.mn), rows, out + (j0 - n0), ld_out);
  }
  take_pending();
}

// ---------------------------------------------------------------- medium M: weights as tile rows
// kStreamM + 1 to kMediumM (256) rows of A against K-major B (the weights). The blocked path packs
// B into pair-major panels, a 16 x 16 transpose per KiB: at 128 x 7168 x 2048 bf16 that
// packing took about 1 of 2.7 ms and did not overlap the products, even when spread through
// the tile steps (its shuffles and stores compete with the tile loads; docs/GEMM.md). Here
// the roles swap, as on the streaming path: weight rows are the tiles' row operand, read
// 256 K at a time where they are (bf16) or decoded (StripSource::chunk), and A, packed once
// per call as B panels, the other. Each micro-panel of 32 weight rows is swept against
// every panel of A, K block by K block, while the next micro-panel is decoded (or, read in
// place, its source rows requested). tdpbf16ps is symmetric in its operands and the promotion's scale product
// commutes, so every element is the blocked path's chain, K block for K block: the same
// bits (tested against pre-packed weights, which take the blocked path).

// The row operand of a medium_m tile, 256 K at a time, as StripSource::chunk gives it:
// plain bf16 rows where they are, or rows decoded into a buffer (FP8, and folded FP8 or FP4
// scales, by the streaming path's row decoders).
class AheadDecode;
struct RowChunks {
  static_assert(kChunk == 8 * kStep);
  const uint8_t* at[kKc / kChunk];
  int64_t stride[kKc / kChunk];
  AheadDecode* meanwhile = nullptr;  // the next micro-panel's decode, a share per tile step (null: none)
};

// The next micro-panel's chunks of one K block, decoded a few rows every kSlice tile steps
// of the current micro-panel (step), where StripSource can decode them by rows; the rest (a
// short strip, a partial chunk, scales that do not fold) are decoded when the panel's tiles
// begin (take). The same decoder and layout as decoding it all upfront: the same bits.
// Decoding each micro-panel upfront left the tiles idle meanwhile: 2 threads, alternated
// minima, FP8 (1,128,128) f32 scales 128 x 4096 x 7168 4.95 -> 4.44 ms, 128 x 24576 x 1536
// 6.98 -> 6.13, 64 x 4096 x 7168 3.09 -> 2.77, 256 x 4096 x 7168 9.10 -> 8.76; FP8 x FP4 128
// x 4096 x 7168 4.70 -> 4.33. One row every step gained nothing (each call's setup), 2 rows
// every 2 steps half of it, 8 every 8 steps less than 4 every 4. (Skipping the decode
// altogether, wrong bits, gives 4.08 ms at 128 x 4096 x 7168: the decode's vector work does
// not hide entirely behind the tiles.)
class AheadDecode {
 public:
  static constexpr int kChunks = kKc / kChunk;
  static constexpr int kSlice = 4;

  // Chunks of K [pc, pc + kc) of rows [j0, j0 + rows) of b, into `words` (kMr x kChunkWords
  // words a chunk), spread over `steps` calls of step().
  void begin(const GemmOperand& b, int64_t j0, int rows, int64_t pc, int64_t kc, uint32_t* words, int64_t steps) {
    source_.emplace(b, j0, rows, 0, false, false);
    j0_ = j0, pc_ = pc, kc_ = kc, words_ = words;
    count_ = chunk_ = row_ = tick_ = 0;
    for (int c = 0; c * kChunk < kc; ++c)
      if (source_->rowwise(pc + c * kChunk, shifts_[count_])) list_[count_++] = c;
    const int64_t slices = std::max<int64_t>(1, steps / kSlice), rows_in_all = static_cast<int64_t>(count_) * rows;
    per_slice_ = static_cast<int>((rows_in_all + slices - 1) / slices);
  }
  // Whether any chunk is decoded during the tiles (else its rows are read when its tiles begin).
  bool any() const { return source_ && count_ > 0; }
  bool holds(int64_t j0, int64_t pc) const { return source_ && j0_ == j0 && pc_ == pc; }

  void step() {
    if (++tick_ < kSlice) return;
    tick_ = 0;
    decode(per_slice_);
  }

  // The held micro-panel's chunks as RowChunks: those decoded by rows finished, the rest
  // decoded now.
  void take(RowChunks& chunks) {
    decode(count_ * source_->rows());
    for (int c = 0, i = 0; c * kChunk < kc_; ++c) {
      uint32_t* words = words_ + c * kMr * kChunkWords;
      if (i < count_ && list_[i] == c) {
        chunks.at[c] = reinterpret_cast<const uint8_t*>(words), chunks.stride[c] = kChunkWords * 4, ++i;
      } else {
        chunks.at[c] = source_->chunk(pc_ + c * kChunk, words, chunks.stride[c]);
      }
    }
    source_.reset();
  }

 private:
  // The next n rows (at most) of the chunks decoded by rows, in order.
  void decode(int n) {
    while (n > 0 && chunk_ < count_) {
      const int rows = source_->rows(), r1 = std::min(rows, row_ + n), c = list_[chunk_];
      source_->decode_rows(pc_ + c * kChunk, row_, r1, shifts_[chunk_], words_ + c * kMr * kChunkWords);
      n -= r1 - row_;
      row_ = r1;
      if (row_ == rows) row_ = 0, ++chunk_;
    }
  }

  std::optional<StripSource> source_;
  int64_t j0_ = 0, pc_ = 0, kc_ = 0;
  uint32_t* words_ = nullptr;
  StripSource::Shifts shifts_[kChunks];
  int list_[kChunks] = {};  // the chunks decoded by rows
  int count_ = 0, chunk_ = 0, row_ = 0, tick_ = 0, per_slice_ = 0;
};

// Steps [s0, s1) of a medium_m tile: weight rows as RowChunks against a B panel's steps.
inline void rows_steps(const RowChunks& w, const uint8_t* bs, int64_t s0, int64_t s1) {
  NextPanelRequests* requests = t_tile_requests ? &*t_tile_requests : nullptr;
  AheadDecode* ahead = w.meanwhile;
  for (int64_t s = s0; s < s1; ++s) {
    if (requests) requests->step();
    if (ahead) ahead->step();
    const uint8_t* ws = w.at[s >> 3] + (s & 7) * 64;
    const int64_t stride = w.stride[s >> 3];
    _tile_loadd(4, ws, stride);
    _tile_stream_loadd(6, bs + s * 2 * kTileBytes, 64);
    _tile_loadd(5, ws + 16 * stride, stride);
    _tile_stream_loadd(7, bs + s * 2 * kTileBytes + kTileBytes, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

// Steps [s0, s1) of a 32 x 32 tile of medium_m where neither the weights nor the B panel
// are promoted (c: 32 x 32, row stride kNr), full_tile's sums from zero or onto c's (accumulate), with the
// weights' tiles loaded from their rows (in place, or decoded a chunk at a time) rather
// than from a packed copy (copying plain bf16 rows into panels had taken a third as long as
// the products at 128 x 32768 x 512).
void rows_tile(const RowChunks& w, const float* b, int64_t s0, int64_t s1, float* c, bool accumulate) {
  if (accumulate) load_c(c, kNr * 4);
  else zero_c();
  rows_steps(w, panel_steps(b), s0, s1);
  store_c(c, kNr * 4);
}

// Up to kMediumM rows of A against K-major weights.
bool medium_m_takes(const GemmOperand& a, const GemmOperand& b) { return a.mn <= kMediumM && b.k_major; }

void medium_m(const GemmOperand& a, const GemmOperand& b, int64_t n0, int64_t n1, GemmKernels::ColumnSink sink, void* ctx) {
  // Weight rows go in blocks of block_rows, K block by K block, so that A's panels of one K
  // block (128 rows: 512 KiB) and the block's sums stay in L2 while every micro-panel of the
  // block passes; the finished block goes to the sink. (A micro-panel over all of K against
  // all of A's panels read those from L3 once K outgrew L2: 128 x 7168 x 16384 bf16 took
  // 40 instead of 28 ms.) Where K spans several blocks, each K block's panels of A are
  // loaded once per block of weight rows, so those blocks are 1024 rows rather than 256
  // (AMX host, 2 threads, bf16 x 7168, alternated minima: 128 x 4096 3.99 -> 3.54 ms, 128 x
  // 2112 2.05 -> 1.91, 256 x 4096 7.68 -> 7.07, 64 x 4096 2.17 -> 2.09; FP8 128 x 4096 5.79
  // -> 5.41; 128 x 7168 x 16384 even); with one K block they stay at 256 (1024 was 5-20 %
  // slower there: 128 x 32768 x 512 2.15 -> 2.55 ms).
  const int64_t block_rows = (a.k > kKc ? 32 : 8) * kMr;
  const int64_t k = a.k, act_panels = (a.mn + kMr - 1) / kMr;
  const int64_t act_block = act_panels * panel_floats(kKc, kMr);
  static thread_local Scratch act_buffer, weight_buffer, acc_buffer, res_buffer;
  float* act = act_buffer.get(static_cast<size_t>((k + kKc - 1) / kKc * act_block));
  // Two K blocks of decoded chunks: the current micro-panel's and the next one's.
  float* weights = weight_buffer.get(static_cast<size_t>(2 * kKc / kChunk * kMr * kChunkWords));
  float* acc = acc_buffer.get(static_cast<size_t>(block_rows / kMr * act_panels * kMr * kNr));
  float* res = res_buffer.get(static_cast<size_t>(a.mn * block_rows));  // A's rows by the block's columns
  for (int64_t pc = 0; pc < k; pc += kKc) pack_panels<true>(a, 0, a.mn, pc, std::min(kKc, k - pc), act + (pc / kKc) * act_block);
  begin_tiles(true);  // (each weight panel is reused, A's panels stream)
  // (a K block's promoted weight scales, kMr per group)
  alignas(64) float w_scales[kKc / kStep * kMr];
  // The micro-panel after (jb, pc, p) in this thread's order: along the block of weight
  // rows, then down its K blocks, then the next block.
  struct Panel {
    int64_t jb, pc, p;
    int64_t j0() const { return jb + p * kMr; }
  };
  const auto rows_of = [&](const Panel& q) { return static_cast<int>(std::min<int64_t>(kMr, std::min(n1, q.jb + block_rows) - q.j0())); };
  const auto next_of = [&](const Panel& q) -> std::optional<Panel> {
    if (q.j0() + kMr < std::min(n1, q.jb + block_rows)) return Panel{q.jb, q.pc, q.p + 1};
    if (q.pc + kKc < k) return Panel{q.jb, q.pc + kKc, 0};
    if (q.jb + block_rows < n1) return Panel{q.jb + block_rows, 0, 0};
    return std::nullopt;
  };
  AheadDecode ahead;
  PromotionPipe pipe;
  int buffer = 0;  // the half of weights the current micro-panel's chunks are decoded into
  const int64_t half = kKc / kChunk * kMr * kChunkWords;
  for (int64_t jb = n0; jb < n1; jb += block_rows) {
    const int64_t jb1 = std::min(n1, jb + block_rows), panels = (jb1 - jb + kMr - 1) / kMr;
    for (int64_t pc = 0; pc < k; pc += kKc) {
      const int64_t kc = std::min(kKc, k - pc);
      for (int64_t p = 0; p < panels; ++p) {
        const Panel here{jb, pc, p};
        const int64_t j0 = here.j0();
        const int rows = rows_of(here);
        // (Raw values where the weights are promoted: their scales go to the promotion.)
        RowChunks chunks;
        auto* words = reinterpret_cast<uint32_t*>(weights) + buffer * half;
        if (!ahead.holds(j0, pc)) ahead.begin(b, j0, rows, pc, kc, words, 1);
        ahead.take(chunks);
        chunks.meanwhile = &ahead;
        pipe.finish();  // (before w_scales are replaced)
        if (b.promote) pack_scales(b, j0, rows, pc, kc, w_scales);
        // The next micro-panel is decoded during these tiles where it can be by rows, and
        // the rows it reads where it cannot; then the one after it is requested into L2.
        const auto next = next_of(here);
        std::optional<Panel> fetch = next;
        if (next) {
          ahead.begin(b, next->j0(), rows_of(*next), next->pc, std::min(kKc, k - next->pc),
                      reinterpret_cast<uint32_t*>(weights) + (buffer ^ 1) * half, act_panels * step_count(kc));
          if (ahead.any()) fetch = next_of(*next);
        }
        if (fetch) request_during_tiles(b, fetch->j0(), rows_of(*fetch), fetch->pc, std::min(kKc, k - fetch->pc), act_panels, kc);
        else request_during_tiles(b, 0, 0, 0, 0, 0, 0);
        // The tiles go in passes of a chunk (8 steps) over A's panels, so that the chunk's
        // 16 KiB of weights are loaded from L1 after the first panel rather than from L2
        // each time, where the weights are decoded: bf16 rows read in place were slower in
        // passes (128 x 32768 x 512 1.90 -> 2.04 ms). Promoted tiles run through the
        // promotion pipe, without which passes were slower, as on the blocked path. 2
        // threads, alternated minima, against whole K blocks a tile: FP8 ue8m0 128 x 4096 x
        // 7168 3.92 -> 3.71 ms, 128 x 7168 x 2048 1.79 -> 1.66, 256 x 4096 x 7168 6.93 ->
        // 6.49; FP8 x FP4 128 x 24576 x 1536 5.10 -> 4.68; FP8 f32 scales 128 x 4096 x 7168
        // 4.56 -> 4.16, 128 x 24576 x 1536 5.77 -> 5.45. Passes of 4 or 16 steps gained less
        // or lost. The same bits: each element's sums and promotions in the same order.
        // (Promoted tiles: passes of whole promotion groups, which may be longer.)
        const auto& act_header = *reinterpret_cast<const PanelHeader*>(act + (pc / kKc) * act_block);
        const bool promoted_tiles = b.promote || act_header.promoted;
        const int64_t steps = step_count(kc);
        const int64_t ga = b.promote ? b.gran_k / kStep : steps, gb = act_header.promoted ? act_header.group_steps : steps;
        const int64_t pass = plain_bf16(b) ? steps : promoted_tiles ? std::max(kChunk / kStep, std::min(ga, gb)) : kChunk / kStep;
        for (int64_t s0 = 0; s0 < steps; s0 += pass)
          for (int64_t q = 0; q < act_panels; ++q) {
            const float* act_panel = act + (pc / kKc) * act_block + q * panel_floats(kc, kMr);
            float* c = acc + (p * act_panels + q) * kMr * kNr;  // (whole 32 x 32 tiles: past the operands, zeros)
            const int64_t s1 = std::min(steps, s0 + pass);
            const bool accumulate = pc > 0 || s0 > 0;
            if (!promoted_tiles) {
              rows_tile(chunks, act_panel, s0, s1, c, accumulate);
              continue;
            }
            pipe.run(
                s0, s1, std::min(ga, gb), b.promote ? w_scales : nullptr, ga, act_header.promoted ? act_panel + scales_offset(kc) : nullptr, gb,
                [&](int64_t t0, int64_t t1) { rows_steps(chunks, panel_steps(act_panel), t0, t1); }, c, accumulate);
          }
        buffer ^= 1;
      }
    }
    request_during_tiles(b, 0, 0, 0, 0, 0, 0);
    pipe.finish();
    for (int64_t p = 0; p < panels; ++p)
      for (int64_t q = 0; q < act_panels; ++q)
        write_transposed(acc + (p * act_panels + q) * kMr * kNr, static_cast<int>(std::min<int64_t>(kMr, a.mn - q * kMr)),
                         static_cast<int>(std::min<int64_t>(kMr, jb1 - jb - p * kMr)), res + q * kMr * block_rows + p * kMr,
                         block_rows);
    sink(ctx, res, block_rows, jb, jb1 - jb);
  }
}

// ---------------------------------------------------------------- what the target takes

// A scale whose products with the decoded values stay exact f32 normals, or that makes
// them ±0, ±inf or NaN exactly as the FMA path would: mantissa zero and an exponent of at
// least 2^-100 (the smallest e4m3 value is 2^-9), or NaN.
bool exact_scale_bits(uint32_t bits) {
  const uint32_t exponent = (bits >> 23) & 0xff, mantissa = bits & 0x7fffff;
  if (exponent == 0xff) return true;  // inf or NaN
  return mantissa == 0 && (exponent == 0 || exponent >= 127 - 100);
}

// Every scale of the operand (f32, or packed ue8m0 as the decoders read it).
// (Every call checks every scale, so contiguous rows are checked 16 f32 or 64 ue8m0 at a
// time: FP4 weights of 7168 x 16384 have 3.7 M scales, and the scalar loop took about as
// long as streaming the weights.)
bool exact_scale_row(const GemmOperand& op, const void* sf_row, int64_t groups) {
  if (op.sf_stride_k != 1) {
    for (int64_t g = 0; g < groups; ++g)
      if (!exact_scale_bits(std::bit_cast<uint32_t>(group_scale(op, sf_row, g)))) return false;
    return true;
  }
  if (op.sf_dtype == DType::f32) {
    // exact_scale_bits on 16 lanes: mantissa zero and exponent 0 or >= 27, or exponent 255.
    const __m512i exponent_mask = _mm512_set1_epi32(0x7f800000), mantissa_mask = _mm512_set1_epi32(0x7fffff);
    const __m512i smallest = _mm512_set1_epi32((127 - 100) << 23), all_ones = exponent_mask;
    const auto* f = static_cast<const float*>(sf_row);
    for (int64_t g = 0; g < groups; g += 16) {
      const __mmask16 lanes = groups - g >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (groups - g)) - 1);
      const __m512i bits = _mm512_maskz_loadu_epi32(lanes, f + g);
      const __m512i exponent = _mm512_and_si512(bits, exponent_mask);
      const __mmask16 special = _mm512_cmpeq_epi32_mask(exponent, all_ones);
      const __mmask16 clean = _mm512_testn_epi32_mask(bits, mantissa_mask) &
                              (_mm512_cmpeq_epi32_mask(exponent, _mm512_setzero_si512()) |
                               _mm512_cmpge_epi32_mask(exponent, smallest));
      if (((special | clean) & lanes) != lanes) return false;
    }
    return true;
  }
  // Packed ue8m0: byte g of the row is group g's exponent; 0 (2^-127, an f32 subnormal) and
  // 1..26 are below 2^-100; 255 (NaN) is taken.
  const auto* e = static_cast<const uint8_t*>(sf_row);
  const __m512i smallest = _mm512_set1_epi8(127 - 100);
  for (int64_t g = 0; g < groups; g += 64) {
    const __mmask64 lanes = groups - g >= 64 ? ~__mmask64{0} : (__mmask64{1} << (groups - g)) - 1;
    if ((_mm512_mask_cmplt_epu8_mask(lanes, _mm512_maskz_loadu_epi8(lanes, e + g), smallest)) != 0) return false;
  }
  return true;
}

// (Row by row of scales, without a division per row: FP4 weights of 32768 x 512 have 32768
// rows of scales, checked on every call.) Rows stored back to back, with no padding between
// them, are checked as one run, split between the threads where it is long: FP4 24576 x
// 1536 has 4.7 MB of f32 scales, which one thread had read before every 16-row call while
// the other waited (5 % of the call's samples, perf). The answer is one AND, whatever the split.
bool exact_scales(const GemmOperand& op) {
  const int64_t groups = (op.k + op.gran_k - 1) / op.gran_k, rows = (op.mn + op.gran_mn - 1) / op.gran_mn;
  const bool f32 = op.sf_dtype == DType::f32;
  if (op.sf_stride_k == 1 && (f32 || groups % 4 == 0) && op.sf_stride_mn == (f32 ? groups : groups / 4)) {
    const int64_t count = rows * groups, per = f32 ? 1 : 4;  // (scales per 4-byte word)
    constexpr int64_t kPart = int64_t{1} << 16;  // scales a thread checks at a time (a multiple of 64)
    if (count <= kPart) return exact_scale_row(op, op.sf, count);
    bool exact = true;
    const int64_t parts = (count + kPart - 1) / kPart;
#pragma omp parallel for schedule(static) reduction(&& : exact) num_threads(static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(parts, num_threads()))))
    for (int64_t p = 0; p < parts; ++p)
      exact = exact && exact_scale_row(op, static_cast<const int32_t*>(op.sf) + p * kPart / per,
                                       std::min(kPart, count - p * kPart));
    return exact;
  }
  for (int64_t r = 0; r < rows; ++r)
    if (!exact_scale_row(op, nth_scale_row(op, r), groups)) return false;
  return true;
}

// bf16, e4m3 or e2m1 values (exact in bf16), with no scales, scales folded exactly (powers
// of two) or scales promoted per K group (groups of 32 · 2^j up to the K block, so that
// groups are whole steps and every block starts a group).
bool prepare_operand(GemmOperand& op, int64_t kc) {
  op.promote = false;
  if (op.dtype != DType::bf16 && op.dtype != DType::e4m3 && op.dtype != DType::e2m1x2) return false;
  if (!op.sf || exact_scales(op)) return true;
  const int64_t g = op.gran_k;
  if (g < kStep || g > kc || (g & (g - 1)) != 0) return false;
  op.promote = true;
  return true;
}

bool prepare(GemmOperand& a, GemmOperand& b) { return bf16_panels::prepare(a, b, kKc); }

}  // namespace

namespace bf16_panels {

void pack_a(const GemmOperand& op, int64_t mn0, int64_t count, int64_t k0, int64_t kc, int, float* out, PackNext) {
  pack_panels<false>(op, mn0, count, k0, kc, out);
}
void pack_b(const GemmOperand& op, int64_t mn0, int64_t count, int64_t k0, int64_t kc, int, float* out, PackNext then) {
  pack_panels<true>(op, mn0, count, k0, kc, out, then);
}

bool dot_rows_take(const GemmOperand& a, const GemmOperand& b, int64_t max_rows) {
  return dot_row_takes(a, b, max_rows) || fp4_dot_takes(a, b, max_rows) || bf16_dot_takes(a, b, max_rows);
}

void dot_rows(const GemmOperand& a, const GemmOperand& b, int64_t n0, int64_t n1, float* out, int64_t ld_out,
              SmallMFn fallback) {
  if (dot_row_takes(a, b, kMaxDotRowsOfA)) return dot_row_small_m(a, b, n0, n1, out, ld_out);
  if (bf16_dot_takes(a, b, kMaxDotRowsOfA)) return bf16_dot_small_m(a, b, n0, n1, out, ld_out);
  fp4_dot_small_m(a, b, n0, n1, out, ld_out, fallback);
}

void stream_small_m(const GemmOperand& a, const GemmOperand& b, int64_t n0, int64_t n1, float* out, int64_t ld_out) {
  stream_rows<StreamDp>(a, b, n0, n1, out, ld_out);
}

bool prepare(GemmOperand& a, GemmOperand& b, int64_t kc) {
  GemmOperand pa = a, pb = b;
  if (!prepare_operand(pa, kc) || !prepare_operand(pb, kc)) return false;
  a = pa;
  b = pb;
  return true;
}

GemmKernels panel_kernels(int64_t kc, int64_t mc) {
  GemmKernels t = gemm_kernels_avx512();  // (the FMA small-M kernel unless the target sets its own)
  t.mr = kWidth;
  t.nr = kWidth;
  t.kc = kc;
  t.mc = mc;
  t.pack = &pack_a;
  t.pack_b = &pack_b;
  t.panel_floats = &panel_floats;
  t.tiles_start_from_c = true;
  return t;
}

}  // namespace bf16_panels

const GemmKernels& gemm_kernels_amx() {
  static const GemmKernels k = [] {
    GemmKernels t = bf16_panels::panel_kernels(kKc, kMc);
    t.tile = &tile;
    // ldtilecfg per tile had been 10-18 % of a k-grouped call (K = 512: a tile is 16 steps).
    t.begin_tiles = &begin_tiles;
    t.request_during_tile = &request_during_tile;
    t.tile_steps = &tile_steps;
    t.settle_tiles = &settle_tiles;
    t.passes_take = &passes_take;
    t.pass_k = kPassK;
    t.medium_m = &medium_m;
    t.medium_m_takes = &medium_m_takes;
    t.prepare = &prepare;
    t.small_m = &stream_small_m;
    t.small_m_rows = kStreamM;
    t.small_m_cols = 4096;
    t.small_m_align = kMr;
    t.small_m_any_a = true;
    return t;
  }();
  return k;
}

}  // namespace moekit::detail

// Per-ISA row kernels of the formats component. One generic implementation
// (formats_simd.inc) is instantiated for each target by a small file that supplies the
// vector operations (scalar, AVX2, AVX-512); dispatch.cpp picks the table at run time.
#pragma once

#include <cstdint>
#include <cstring>

#include "moekit/runtime.h"

namespace moekit::detail {

constexpr int kAmaxRows = 4;  // rows per amax_accumulate_bf16 call at most
enum class Narrow { e4m3 = 0, e5m2 = 1, e2m1 = 2 };  // e2m1 rows are packed two per byte
enum class Wide { f32 = 0, bf16 = 1 };                // element type of the wide side

// Per-element reciprocals that quantize may use with gran 1 (the per-channel cast, whose
// rows share one set of scales): values[i] = RN(1/sf[i]), reordered by block_order, passed
// only with scales_from_amax when every sf is a positive normal number; they let fast
// targets skip most of the per-element divisions (see quotient_codes in formats_simd.inc).
// exact: every sf is a power of two (ue8m0), so values[i] is 1/sf[i] exactly and x·values[i]
// rounds like the division; no division and no tie check is needed then.
// scales (may be null): sf again, both arrays in bf16_lane_order rather than block_order;
// only quantize of bf16 to e4m3 takes them (format_kernels_avx512: the quotient kernels).
struct Reciprocals {
  const float* values = nullptr;
  bool exact = false;
  const float* scales = nullptr;
};

// All spans are plain arrays. "gran" selects the scale of element i: sf[i / gran].
struct FormatKernels {
  // out[g] = max |x| over group g of gran elements (last group may be partial).
  void (*amax_groups[2])(const void* x, int64_t n, int64_t gran, float* out);
  // acc[i] = max(acc[i], |x[i]|).
  void (*amax_accumulate[2])(const void* x, int64_t n, float* acc);
  // The same for bf16 x on |x| bf16 bit patterns (acc[i] << 16 is amax_accumulate's float),
  // over `rows` rows (1 to kAmaxRows) `stride` elements apart: acc[i] = max(acc[i], |x[r ·
  // stride + i]|); null on targets without a faster 16-bit kernel.
  void (*amax_accumulate_bf16)(const uint16_t* x, int64_t stride, int rows, int64_t n, uint16_t* acc);
  // out = in reordered for quantize's per-element reciprocals (inv, below); n elements; out
  // may be in.
  void (*block_order)(const float* in, float* out, int64_t n);
  // The order in which quantize of bf16 to e4m3 takes per-element reciprocals and scales
  // (Reciprocals::scales) instead, where it has a kernel for it; null elsewhere. out != in.
  void (*bf16_lane_order)(const float* in, float* out, int64_t n);
  // q = narrow(x / sf[i / gran]); e2m1: n values into ceil(n/2) bytes, gran even or >= n.
  // stream = true: non-temporal stores (for outputs far larger than the cache).
  // prefetch (may be null): n elements the caller reads next, requested into L2 meanwhile.
  // scales_from_amax: each sf is the cast's scale for its own group's amax (so |x/sf| is
  // bounded by the format's max finite), which lets the encoder skip saturation.
  // inv (gran 1 only): see Reciprocals.
  void (*quantize[3][2])(const void* x, uint8_t* q, int64_t n, const float* sf, int64_t gran, bool stream,
                         const void* prefetch, bool scales_from_amax, Reciprocals inv);
  // out = wide(decode(q) * sf[i / gran]), ordinary stores: callers stream big outputs out
  // of a cache-sized stage instead (quant.cpp: StreamedRows).
  void (*dequantize[3][2])(const uint8_t* q, void* out, int64_t n, const float* sf, int64_t gran);
  void (*f32_to_bf16)(const float* x, uint16_t* out, int64_t n);
  void (*bf16_to_f32)(const uint16_t* x, float* out, int64_t n);
  // rows x cols of f32 (rows ldx apart) to bf16 (rows ldo apart) as f32_to_bf16, but every
  // NaN as the canonical quiet NaN 0x7fc0 (the GEMMs' sums). stream: D will not be read soon,
  // so aligned stores bypass the cache (AVX-512; plain stores elsewhere). This function does
  // not fence: the caller issues _mm_sfence before the stores are read elsewhere (the GEMMs:
  // once per thread's item; a fence per call, a band of 16 rows, waited for DRAM every KiB).
  void (*f32_rows_to_bf16_canonical)(const float* x, int64_t ldx, int64_t rows, int64_t cols, uint16_t* out,
                                     int64_t ldo, bool stream);
  // Per-block casts (many rows under one row of scales): bf16 -> e4m3 through a code table
  // per scale (formats_avx512.cpp). e4m3_tables fills kE4m3TableWords int16 per scale (or
  // marks a scale the tables cannot take, whose group then goes through the general kernel);
  // quantize_e4m3_tables is quantize of bf16 x to e4m3 with scales_from_amax, gran a multiple
  // of 64. Null on targets without them.
  void (*e4m3_tables)(const float* sf, int64_t groups, int16_t* tables);
  void (*quantize_e4m3_tables)(const uint16_t* x, uint8_t* q, int64_t n, const float* sf, int64_t gran,
                               const int16_t* tables, bool stream, const uint16_t* prefetch);
  // Per-channel casts under power-of-two scales 2^k_i (one per element, each a table_scale):
  // the same with shift[i] = table_shift(sf[i]) and the table of the scale 1.0. Null where
  // e4m3_tables is.
  void (*quantize_e4m3_shifts)(const uint16_t* x, uint8_t* q, int64_t n, const float* sf, const int16_t* shift,
                               const int16_t* unit_table, bool stream, const uint16_t* prefetch);
};
inline constexpr int64_t kE4m3TableWords = 128;

// The scales the table kernels take: positive normal, 2^-100 <= sf < 2^100 (their probes stay
// normal bf16, and bf16 subnormal inputs land in the zero region).
inline bool table_scale(float sf) {
  uint32_t bits;
  std::memcpy(&bits, &sf, 4);
  const uint32_t exponent = bits >> 23;  // (the sign bit puts negative scales far above)
  return exponent >= 127 - 100 && exponent < 127 + 100;
}
// k << 7 for a table scale sf = 2^k·f (1 <= f < 2): the bf16 pattern offset of dividing by 2^k.
inline int16_t table_shift(float sf) {
  uint32_t bits;
  std::memcpy(&bits, &sf, 4);
  return static_cast<int16_t>((static_cast<int32_t>(bits >> 23) - 127) * 128);
}

const FormatKernels& format_kernels_scalar();
const FormatKernels& format_kernels_avx2();
const FormatKernels& format_kernels_avx512();  // only called when the CPU has AVX-512
const FormatKernels& format_kernels(Isa isa);
inline const FormatKernels& format_kernels() { return format_kernels(active_isa()); }

// Outputs of at least this many bytes are written with non-temporal stores (default
// 64 MiB): by the quantize kernels themselves, and for dequantisation through a stage (see
// quant.cpp). Returns the previous value; tests lower it to cover the streaming paths.
int64_t set_streaming_threshold(int64_t bytes);

// Per-block and per-channel casts read each scale group twice (amax, then quantise). They
// work on column strips whose input (the group's rows x the strip) fits this many bytes, so
// that the second read hits L2, where strips give rows segments of at least 8 KiB; else on
// whole rows. Default: half this core's L2 (sysconf; 0, no strips, when unknown). Returns
// the previous value; tests set it to cover strips on any machine.
int64_t set_cast_strip_budget(int64_t bytes);

// 2^ceil(log2 sf) for positive finite sf by exponent arithmetic; zero, negative, inf and NaN
// pass through unchanged (so it may run inside parallel regions, where nothing may throw).
float ceil_pow2(float sf) noexcept;

// Scalar element conversions (from the scalar instantiation; exact by construction).
uint8_t encode_scalar(Narrow fmt, float x);
float decode_scalar(Narrow fmt, uint8_t code);

}  // namespace moekit::detail

// Numeric formats (bf16, fp8 e4m3/e5m2, fp4 e2m1, ue8m0), quantisation casts and calc_diff,
// as fixed by shared/spec/formats.md. Scalar conversions are exact and branch-light; the
// tensor-level casts are vectorised (runtime ISA dispatch) and multi-threaded.
#pragma once

#include <cstdint>
#include <utility>

#include "moekit/error.h"
#include "moekit/tensor.h"

namespace moekit {

// ---- scalar element conversions (round-to-nearest-even, rules of formats.md) ----
float bf16_to_f32(uint16_t bits);
uint16_t f32_to_bf16(float x);          // NaN stays a quiet NaN
float e4m3_to_f32(uint8_t code);
uint8_t f32_to_e4m3(float x);           // |x| > 448 saturates to ±448; ±inf and NaN → NaN
float e5m2_to_f32(uint8_t code);
uint8_t f32_to_e5m2(float x);           // overflow → ±inf; NaN → quiet NaN
float e2m1_to_f32(uint8_t nibble);      // low 4 bits used
uint8_t f32_to_e2m1(float x);           // |x| > 6 saturates to ±6; NaN → ±6 (its sign)
float ue8m0_to_f32(uint8_t code);       // 2^(code-127); 255 → NaN
uint8_t f32_to_ue8m0(float power_of_two);  // exponent byte of a positive power of two
float ceil_to_ue8m0(float sf);          // 2^ceil(log2(sf)), 0 < sf <= 2^127

// ---- quantisation casts (formats.md "Casts") ----
// x: f32 or bf16, 2-D, last dim unit-stride. Returns (q, sf) with sf f32 (the power of two
// itself when use_ue8m0). The "_into" forms write caller-provided outputs.
struct Quantized {
  Tensor values;  // e4m3 [M, K] or e2m1x2 [M, ceil(K/2)]
  Tensor sf;      // f32
};

// per token: one scale per row per gran_k columns; sf [M, ceil(K/gran_k)].
Quantized per_token_cast_to_fp8(const Tensor& x, bool use_ue8m0, int64_t gran_k = 128);
void per_token_cast_to_fp8_into(const Tensor& x, const Tensor& q, const Tensor& sf,
                                bool use_ue8m0, int64_t gran_k = 128);
// per block: one scale per block_m x block_k tile; sf [ceil(M/block_m), ceil(K/block_k)].
Quantized per_block_cast_to_fp8(const Tensor& x, bool use_ue8m0, int64_t block_m = 128,
                                int64_t block_k = 128);
void per_block_cast_to_fp8_into(const Tensor& x, const Tensor& q, const Tensor& sf,
                                bool use_ue8m0, int64_t block_m = 128, int64_t block_k = 128);
// per channel (upstream's meaning): x [K, MN] stored K-major rows, one scale per column per
// gran_k rows; sf [ceil(K/gran_k), MN]. This is recipe (1,1,128) for operands given as
// [K, MN] (the tn / k-grouped layouts); for an [MN, K] operand use per_token_cast_to_fp8.
Quantized per_channel_cast_to_fp8(const Tensor& x, bool use_ue8m0, int64_t gran_k = 128);
void per_channel_cast_to_fp8_into(const Tensor& x, const Tensor& q, const Tensor& sf,
                                  bool use_ue8m0, int64_t gran_k = 128);
// per token to fp4: sf = amax/6, values packed two per byte; sf [M, ceil(K/gran_k)].
Quantized per_token_cast_to_fp4(const Tensor& x, bool use_ue8m0, int64_t gran_k = 32);
void per_token_cast_to_fp4_into(const Tensor& x, const Tensor& q, const Tensor& sf,
                                bool use_ue8m0, int64_t gran_k = 32);

// Dequantise (values * sf) to f32 or bf16. The scale grid is explicit: element (r, c) uses
// sf[r / gran_m, c / gran_k] (per token: 1 x gran_k; per block: 128 x 128; per channel:
// gran_k x 1). sf is f32, or packed ue8m0 (i32, four exponents per word along columns).
// For fp4, k is the unpacked column count (-1: 2 * q.size(1)). bf16 output is the RNE of the
// f32 product (as upstream's (q.float() * sf).to(bf16)).
Tensor cast_back_from_fp8(const Tensor& q, const Tensor& sf, DType out = DType::f32,
                          int64_t gran_m = 1, int64_t gran_k = 128);
Tensor cast_back_from_fp4(const Tensor& q, const Tensor& sf, DType out = DType::f32,
                          int64_t gran_m = 1, int64_t gran_k = 32, int64_t k = -1);
// Destination-first forms: out is f32 or bf16 [M, K].
void cast_back_from_fp8_into(const Tensor& q, const Tensor& sf, const Tensor& out,
                             int64_t gran_m = 1, int64_t gran_k = 128);
void cast_back_from_fp4_into(const Tensor& q, const Tensor& sf, const Tensor& out,
                             int64_t gran_m = 1, int64_t gran_k = 32);

// ---- scale-factor helpers ----
// Elementwise 2^ceil(log2(sf)) on an f32 tensor of values in (0, 2^127] (returns a new tensor).
Tensor ceil_to_ue8m0(const Tensor& sf);
// sf f32 [MN, G] of powers of two → i32 [MN, ceil(G/4)], byte i of word j = group 4j+i
// (trailing bytes of the last word are 0, i.e. 2^-127, never read).
Tensor pack_ue8m0_to_int(const Tensor& sf);
// i32 [MN, W] → f32 [MN, groups] (groups ≤ 4W; default 4W).
Tensor unpack_ue8m0_from_int(const Tensor& packed, int64_t groups = -1);

// ---- bulk element casts between f32/bf16 and the narrow formats (same shapes; for
// e2m1x2 the last dim of the packed side is ceil(n/2)) ----
void convert(const Tensor& src, const Tensor& dst);

// calc_diff(x, y) = 1 - 2·Σxy / Σ(x²+y²) in f64 over the whole tensor (f32/bf16 inputs,
// same shape). Both all-zero → 0.
double calc_diff(const Tensor& x, const Tensor& y);

}  // namespace moekit

// The scalar f64 oracle. Used only by tests and benchmarks to judge correctness; written
// independently of the kernels (no shared conversion code: element values come from the
// format definitions, quantisation from a nearest-value search), and tested on hand-checked
// cases in tests/test_reference.cpp.
#pragma once

#include <cstdint>
#include <vector>

#include "moekit/formats.h"
#include "moekit/tensor.h"

namespace moekit::ref {

// Element values straight from formats.md (s, e, m fields), in f64.
double bf16_value(uint16_t bits);
double e4m3_value(uint8_t code);   // NaN for S.1111.111
double e5m2_value(uint8_t code);
double e2m1_value(uint8_t nibble);
// Nearest representable code, ties to the even code, with formats.md's overflow rules
// (e4m3: saturate finite, inf/NaN → NaN; e5m2: overflow → inf; e2m1: saturate).
uint8_t nearest_e4m3(double x);
uint8_t nearest_e5m2(double x);
uint8_t nearest_e2m1(double x);
uint16_t nearest_bf16(double x);

// The value of element [r, c] of a 2-D f32/bf16/e4m3/e5m2 tensor; for e2m1x2, c indexes the
// unpacked column. Any strides.
double value_at(const Tensor& t, int64_t r, int64_t c);

// Reference quantisers: same contract as moekit's (formats.md), f32 scales.
Quantized per_token_cast_to_fp8(const Tensor& x, bool use_ue8m0, int64_t gran_k = 128);
Quantized per_block_cast_to_fp8(const Tensor& x, bool use_ue8m0, int64_t block_m = 128, int64_t block_k = 128);
Quantized per_channel_cast_to_fp8(const Tensor& x, bool use_ue8m0, int64_t gran_k = 128);
Quantized per_token_cast_to_fp4(const Tensor& x, bool use_ue8m0, int64_t gran_k = 32);
// values[r, c] * sf[r / gran_m, c / gran_k] in f64, row-major [M, K] (sf f32 or packed i32).
std::vector<double> dequantize(const Tensor& q, const Tensor& sf, int64_t gran_m, int64_t gran_k, int64_t k);

// ---- GEMM ----
// Layout letters as DeepGEMM: first A ('n' = [M, K], 't' = [K, M]), second B
// ('t' = [N, K], 'n' = [K, N]).
enum class Layout { nt, nn, tn, tt };

// An operand: values (bf16, f32, e4m3 or e2m1x2) and optional scales in canonical form
// sf[ceil(MN / gran_mn), ceil(K / gran_k)], f32 or packed ue8m0 (i32, 4 groups per word).
struct Operand {
  Tensor values;
  Tensor sf;  // undefined: no scaling
  int64_t gran_mn = 1;
  int64_t gran_k = 128;
  // e2m1x2 only: the logical extent of the packed (stored last) dimension when it is odd;
  // -1 means 2 x stored columns.
  int64_t packed_extent = -1;
};

struct GemmProblem {
  int64_t m = 0, n = 0, k = 0;
};

// Checks shapes against the layout and returns (m, n, k).
GemmProblem gemm_problem(Layout layout, const Operand& a, const Operand& b);
// D = C + A·Bᵀ in f64 with per-K-group promotion when scaled; returns row-major [M, N].
// c may be undefined (no C).
std::vector<double> gemm(Layout layout, const Operand& a, const Operand& b, const Tensor& c = Tensor());

// Converts f64 results to a new f32/bf16 tensor [rows, cols] (RNE) / copies a tensor to f64.
Tensor to_tensor(const std::vector<double>& values, int64_t rows, int64_t cols, DType dtype);
std::vector<double> to_f64(const Tensor& t2d);

// calc_diff in f64 over two f64 arrays (the metric of formats.md).
double calc_diff(const std::vector<double>& x, const std::vector<double>& y);

}  // namespace moekit::ref

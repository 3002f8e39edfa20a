// Argument validation shared by every public call: each helper throws moekit::Error naming
// the function, the argument, what was expected and what was given.
#pragma once

#include <initializer_list>
#include <string>
#include <utility>

#include "moekit/error.h"
#include "moekit/tensor.h"

namespace moekit::detail {

[[noreturn]] void fail(const char* fn, const std::string& arg, const std::string& expected,
                       const std::string& actual);

void check_defined(const char* fn, const char* arg, const Tensor& t);
void check_cpu(const char* fn, const char* arg, const Tensor& t);
void check_dtype(const char* fn, const char* arg, const Tensor& t,
                 std::initializer_list<DType> allowed);
void check_rank(const char* fn, const char* arg, const Tensor& t, int64_t rank);
void check_shape(const char* fn, const char* arg, const Tensor& t, const Shape& expected);
void check_last_dim_contiguous(const char* fn, const char* arg, const Tensor& t);
void check_positive(const char* fn, const char* arg, int64_t value);
// An output whose elements are all distinct: its dimensions (those of extent > 1, by
// stride) must nest, each stride at least the span of the smaller ones. (Conservative: a
// layout whose strides interleave without overlapping is refused too.)
void check_no_self_overlap(const char* fn, const char* arg, const Tensor& t);
// The common prologue: defined, on the CPU, one of the dtypes, the rank, unit last stride.
void check_cpu_matrix(const char* fn, const char* arg, const Tensor& t,
                      std::initializer_list<DType> allowed);

// Whether the byte ranges two views reach intersect (conservative: interleaved views of one
// buffer count as overlapping); false when either is undefined or empty.
bool views_overlap(const Tensor& x, const Tensor& y);
// An output apart from every input (undefined or empty inputs pass): kernels read their
// inputs after writing parts of the output (review finding, 2026-12-03: bf16_gemm_nt(a, b, a)
// was accepted).
void check_apart(const char* fn, const char* arg, const Tensor& out,
                 std::initializer_list<std::pair<const char*, const Tensor*>> inputs);
// Both: an output with distinct elements (check_no_self_overlap) apart from every input.
void check_output_apart(const char* fn, const char* arg, const Tensor& out,
                        std::initializer_list<std::pair<const char*, const Tensor*>> inputs);

// a >= 0, b > 0; no intermediate overflow even for b near INT64_MAX.
inline int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0); }

}  // namespace moekit::detail

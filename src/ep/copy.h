// Row copies into peers' shared memory. Destinations are not read again by the writer, so
// large copies use non-temporal stores (no read-for-ownership of the destination line,
// which is most of what a cached memcpy costs here); stream_fence() orders them before the
// flag that publishes them.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/stream_copy.h"

namespace moekit::ep::detail {

using moekit::detail::copy_stream;
using moekit::detail::kStreamMinBytes;
using moekit::detail::stream_fence;

// out = bf16(rows[0] + rows[1] + ... + rows[n-1] (+ bias_0) (+ bias_1)), summed in f32 in
// exactly that order, rounded to nearest even (NaN stays a quiet NaN); n = 0 gives the
// biases alone (or zeros). Bit-identical across ISA paths. May use non-temporal stores:
// the calling thread must stream_fence() before another thread reads out.
void reduce_rows_bf16(uint16_t* out, const uint16_t* const* rows, int n, const uint16_t* bias_0,
                      const uint16_t* bias_1, int64_t hidden);
void reduce_rows_bf16_scalar(uint16_t* out, const uint16_t* const* rows, int n, const uint16_t* bias_0,
                             const uint16_t* bias_1, int64_t begin, int64_t end);
// out = bf16(sum_i weights[i] * rows[i]) in f32, i ascending, one fused multiply-add per
// term (std::fma on the portable path); n = 0 gives zeros.
void reduce_weighted_rows_bf16(uint16_t* out, const uint16_t* const* rows, const float* weights, int n,
                               int64_t hidden);
void reduce_weighted_rows_bf16_scalar(uint16_t* out, const uint16_t* const* rows, const float* weights, int n,
                                      int64_t begin, int64_t end);
void reduce_weighted_rows_bf16_avx2(uint16_t* out, const uint16_t* const* rows, const float* weights, int n,
                                    int64_t hidden);
void reduce_rows_bf16_avx2(uint16_t* out, const uint16_t* const* rows, int n, const uint16_t* bias_0,
                           const uint16_t* bias_1, int64_t hidden);  // full rows
}  // namespace moekit::ep::detail

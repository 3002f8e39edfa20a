// Row copies into peers' shared memory. Destinations are not read again by the writer, so
// large copies use non-temporal stores (no read-for-ownership of the destination line,
// which is most of what a cached memcpy costs here); stream_fence() orders them before the
// flag that publishes them.
#pragma once

#include <xmmintrin.h>

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
// ahead: the n rows (of `hidden` elements) the caller reduces next, the next token's,
// requested into L2 line by line as this row advances; none by default. Measured on the
// 2-vCPU AMX Xeon (2026-12-02, 2 processes, 4 KiB pages, 2 rows of 7168 summed per token):
// the AVX2 path 10.5 -> 15.3 GB/s of traffic per process; the AVX-512 path is no slower.
struct RowsAhead {
  const uint16_t* const* rows = nullptr;
  int n = 0;
  // Requests element i's line of every row (call once per 32 elements).
  void request(int64_t i) const {
    for (int r = 0; r < n; ++r) _mm_prefetch(reinterpret_cast<const char*>(rows[r] + i), _MM_HINT_T1);
  }
};
void reduce_rows_bf16(uint16_t* out, const uint16_t* const* rows, int n, const uint16_t* bias_0,
                      const uint16_t* bias_1, int64_t hidden, RowsAhead ahead = {});
void reduce_rows_bf16_scalar(uint16_t* out, const uint16_t* const* rows, int n, const uint16_t* bias_0,
                             const uint16_t* bias_1, int64_t begin, int64_t end);
// out = bf16(sum_i weights[i] * rows[i]) in f32, i ascending, one fused multiply-add per
// term (std::fma on the portable path); n = 0 gives zeros.
void reduce_weighted_rows_bf16(uint16_t* out, const uint16_t* const* rows, const float* weights, int n,
                               int64_t hidden, RowsAhead ahead = {});
void reduce_weighted_rows_bf16_scalar(uint16_t* out, const uint16_t* const* rows, const float* weights, int n,
                                      int64_t begin, int64_t end);
void reduce_weighted_rows_bf16_avx2(uint16_t* out, const uint16_t* const* rows, const float* weights, int n,
                                    int64_t hidden, RowsAhead ahead = {});
// The ISA paths of the two, full rows (active_isa() picks among them).
void reduce_rows_bf16_avx2(uint16_t* out, const uint16_t* const* rows, int n, const uint16_t* bias_0,
                           const uint16_t* bias_1, int64_t hidden, RowsAhead ahead = {});
void reduce_rows_bf16_avx512(uint16_t* out, const uint16_t* const* rows, int n, const uint16_t* bias_0,
                             const uint16_t* bias_1, int64_t hidden, RowsAhead ahead = {});
void reduce_weighted_rows_bf16_avx512(uint16_t* out, const uint16_t* const* rows, const float* weights, int n,
                                      int64_t hidden, RowsAhead ahead = {});

}  // namespace moekit::ep::detail

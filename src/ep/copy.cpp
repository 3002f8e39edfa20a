#include "ep/copy.h"

#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "moekit/formats.h"
#include "moekit/runtime.h"

namespace moekit::ep::detail {

void reduce_rows_bf16_scalar(uint16_t* out, const uint16_t* const* rows, int n, const uint16_t* bias_0,
                             const uint16_t* bias_1, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    float acc = n > 0 ? bf16_to_f32(rows[0][i]) : 0.0f;
    for (int r = 1; r < n; ++r) acc += bf16_to_f32(rows[r][i]);
    if (bias_0) acc += bf16_to_f32(bias_0[i]);
    if (bias_1) acc += bf16_to_f32(bias_1[i]);
    out[i] = f32_to_bf16(acc);
  }
}

void reduce_rows_bf16(uint16_t* out, const uint16_t* const* rows, int n, const uint16_t* bias_0,
                      const uint16_t* bias_1, int64_t hidden, RowsAhead ahead) {
  if (active_isa() >= Isa::avx512) {
    reduce_rows_bf16_avx512(out, rows, n, bias_0, bias_1, hidden, ahead);
  } else if (active_isa() >= Isa::avx2) {
    reduce_rows_bf16_avx2(out, rows, n, bias_0, bias_1, hidden, ahead);
  } else {
    reduce_rows_bf16_scalar(out, rows, n, bias_0, bias_1, 0, hidden);
  }
}

void reduce_weighted_rows_bf16_scalar(uint16_t* out, const uint16_t* const* rows, const float* weights, int n,
                                      int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    float acc = 0.0f;
    for (int r = 0; r < n; ++r) acc = std::fma(weights[r], bf16_to_f32(rows[r][i]), acc);
    out[i] = f32_to_bf16(acc);
  }
}

void reduce_weighted_rows_bf16(uint16_t* out, const uint16_t* const* rows, const float* weights, int n,
                               int64_t hidden, RowsAhead ahead) {
  if (active_isa() >= Isa::avx512) {
    reduce_weighted_rows_bf16_avx512(out, rows, weights, n, hidden, ahead);
  } else if (active_isa() >= Isa::avx2) {
    reduce_weighted_rows_bf16_avx2(out, rows, weights, n, hidden, ahead);
  } else {
    reduce_weighted_rows_bf16_scalar(out, rows, weights, n, 0, hidden);
  }
}

}  // namespace moekit::ep::detail

// Register-resident and streaming loops for AVX2 (+FMA). Compiled with -mavx2 -mfma.
#include <immintrin.h>

#include <cstdint>

#include "peak.h"

namespace moekit::tools::kernels {

// 12 independent accumulators hide the 4-cycle FMA latency on two FMA pipes.
double fma_f32_avx2(int64_t iterations) {
  __m256 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps(static_cast<float>(i) * 1e-3f);
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  }
  __m256 s = acc[0];
  for (int i = 1; i < 12; ++i) s = _mm256_add_ps(s, acc[i]);
  volatile float sink = _mm256_cvtss_f32(s);
  (void)sink;
  return static_cast<double>(iterations) * 12 * 8 * 2;
}

void read_avx2(const void* data, int64_t bytes, int64_t* sink) {
  const auto* p = static_cast<const __m256i*>(data);
  const int64_t n = bytes / 32;
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    a0 = _mm256_xor_si256(a0, _mm256_load_si256(p + i));
    a1 = _mm256_xor_si256(a1, _mm256_load_si256(p + i + 1));
    a2 = _mm256_xor_si256(a2, _mm256_load_si256(p + i + 2));
    a3 = _mm256_xor_si256(a3, _mm256_load_si256(p + i + 3));
    a0 = _mm256_xor_si256(a0, _mm256_load_si256(p + i + 4));
    a1 = _mm256_xor_si256(a1, _mm256_load_si256(p + i + 5));
    a2 = _mm256_xor_si256(a2, _mm256_load_si256(p + i + 6));
    a3 = _mm256_xor_si256(a3, _mm256_load_si256(p + i + 7));
  }
  const __m256i s = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
  *sink ^= _mm256_extract_epi64(s, 0) ^ _mm256_extract_epi64(s, 3);
}

void copy_stream_avx2(const void* src, void* dst, int64_t bytes) {
  const auto* s = static_cast<const __m256i*>(src);
  auto* d = static_cast<__m256i*>(dst);
  const int64_t n = bytes / 32;
  for (int64_t i = 0; i + 4 <= n; i += 4) {
    const __m256i v0 = _mm256_load_si256(s + i), v1 = _mm256_load_si256(s + i + 1);
    const __m256i v2 = _mm256_load_si256(s + i + 2), v3 = _mm256_load_si256(s + i + 3);
    _mm256_stream_si256(d + i, v0);
    _mm256_stream_si256(d + i + 1, v1);
    _mm256_stream_si256(d + i + 2, v2);
    _mm256_stream_si256(d + i + 3, v3);
  }
  _mm_sfence();
}

}  // namespace moekit::tools::kernels

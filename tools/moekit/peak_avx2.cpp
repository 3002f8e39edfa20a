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

// Four xor chains over the range; Prefetch adds software prefetches 1 KiB ahead (more misses
// in flight than the hardware prefetcher alone keeps on some cores).
namespace {
template <bool Prefetch>
void read_loop(const void* data, int64_t bytes, int64_t* sink) {
  const auto* p = static_cast<const __m256i*>(data);
  const auto* c = static_cast<const char*>(data);
  const int64_t n = bytes / 32;
  constexpr int64_t kAhead = 1024;
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i + 8 <= n; i += 8) {
    if constexpr (Prefetch)
      for (int line = 0; line < 4; ++line) _mm_prefetch(c + i * 32 + kAhead + 64 * line, _MM_HINT_T0);
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
}  // namespace

void read_avx2(const void* data, int64_t bytes, int64_t* sink) { read_loop<false>(data, bytes, sink); }
void read_prefetch_avx2(const void* data, int64_t bytes, int64_t* sink) { read_loop<true>(data, bytes, sink); }

// Four interleaved streams (quarters of the range): four prefetch streams per core.
void read_4streams_avx2(const void* data, int64_t bytes, int64_t* sink) {
  const int64_t quarter = bytes / 4 / 256 * 256;
  const char* base = static_cast<const char*>(data);
  const auto* p0 = reinterpret_cast<const __m256i*>(base);
  const auto* p1 = reinterpret_cast<const __m256i*>(base + quarter);
  const auto* p2 = reinterpret_cast<const __m256i*>(base + 2 * quarter);
  const auto* p3 = reinterpret_cast<const __m256i*>(base + 3 * quarter);
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i + 2 <= quarter / 32; i += 2) {
    a0 = _mm256_xor_si256(a0, _mm256_load_si256(p0 + i));
    a1 = _mm256_xor_si256(a1, _mm256_load_si256(p1 + i));
    a2 = _mm256_xor_si256(a2, _mm256_load_si256(p2 + i));
    a3 = _mm256_xor_si256(a3, _mm256_load_si256(p3 + i));
    a0 = _mm256_xor_si256(a0, _mm256_load_si256(p0 + i + 1));
    a1 = _mm256_xor_si256(a1, _mm256_load_si256(p1 + i + 1));
    a2 = _mm256_xor_si256(a2, _mm256_load_si256(p2 + i + 1));
    a3 = _mm256_xor_si256(a3, _mm256_load_si256(p3 + i + 1));
  }
  int64_t tail = 0;
  for (int64_t b = 4 * quarter; b + 8 <= bytes; b += 8) tail ^= *reinterpret_cast<const int64_t*>(base + b);
  const __m256i s = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
  *sink ^= _mm256_extract_epi64(s, 0) ^ _mm256_extract_epi64(s, 3) ^ tail;
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

// AVX-512 loops; only called when the CPU has AVX-512 (BF16 for the dot loop).
#include <immintrin.h>

#include <cstdint>

#include "peak.h"

namespace moekit::tools::kernels {

// Independent accumulator chains: 12 cover latency x throughput on the CPUs seen so far
// (4 x 2 FMAs, 6 x 2 vdpbf16ps); 24 leave room for longer latencies (Zen 5's vdpbf16ps
// reads about a sixth faster with 24). The peak keeps the faster.
template <int kChains>
double fma_f32_chains(int64_t iterations) {
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i) * 1e-3f);
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 24
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  }
  __m512 s = acc[0];
  for (int i = 1; i < kChains; ++i) s = _mm512_add_ps(s, acc[i]);
  volatile float sink = _mm512_reduce_add_ps(s);
  (void)sink;
  return static_cast<double>(iterations) * kChains * 16 * 2;
}

// vdpbf16ps: 32 bf16 products + adds per instruction = 64 FLOPs.
template <int kChains>
double dot_bf16_chains(int64_t iterations) {
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_setzero_ps();
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3380);
  for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 24
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  }
  __m512 s = acc[0];
  for (int i = 1; i < kChains; ++i) s = _mm512_add_ps(s, acc[i]);
  volatile float sink = _mm512_reduce_add_ps(s);
  (void)sink;
  return static_cast<double>(iterations) * kChains * 32 * 2;
}

double fma_f32_avx512(int64_t iterations) { return fma_f32_chains<12>(iterations); }
double fma_f32_avx512_24(int64_t iterations) { return fma_f32_chains<24>(iterations); }
double dot_bf16_avx512(int64_t iterations) { return dot_bf16_chains<12>(iterations); }
double dot_bf16_avx512_24(int64_t iterations) { return dot_bf16_chains<24>(iterations); }

void read_avx512(const void* data, int64_t bytes, int64_t* sink) {
  const auto* p = static_cast<const __m512i*>(data);
  const int64_t n = bytes / 64;
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i + 4 <= n; i += 4) {
    a0 = _mm512_xor_si512(a0, _mm512_load_si512(p + i));
    a1 = _mm512_xor_si512(a1, _mm512_load_si512(p + i + 1));
    a2 = _mm512_xor_si512(a2, _mm512_load_si512(p + i + 2));
    a3 = _mm512_xor_si512(a3, _mm512_load_si512(p + i + 3));
  }
  const __m512i s = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
  *sink ^= _mm512_reduce_add_epi64(s);
}

// Whole-line non-temporal stores (the AVX2 copy writes each line in two halves).
void copy_stream_avx512(const void* src, void* dst, int64_t bytes) {
  const auto* s = static_cast<const __m512i*>(src);
  auto* d = static_cast<__m512i*>(dst);
  const int64_t n = bytes / 64;
  for (int64_t i = 0; i + 4 <= n; i += 4) {
    const __m512i v0 = _mm512_load_si512(s + i), v1 = _mm512_load_si512(s + i + 1);
    const __m512i v2 = _mm512_load_si512(s + i + 2), v3 = _mm512_load_si512(s + i + 3);
    _mm512_stream_si512(d + i, v0);
    _mm512_stream_si512(d + i + 1, v1);
    _mm512_stream_si512(d + i + 2, v2);
    _mm512_stream_si512(d + i + 3, v3);
  }
  _mm_sfence();
}

}  // namespace moekit::tools::kernels

// AVX-512 target of copy_stream (stream_copy.h); only reached through runtime dispatch.
// Whole 64-byte lines per non-temporal store: measured on the 2-vCPU AMX Xeon (2026-12-02,
// 58 MiB from private memory into a 4 KiB-page shared mapping, two processes at once),
// 6.4-7.0 ms against the AVX2 copy's 7.5-8.2 (its two 32-byte halves per line). In
// `bench ep` the combine's staging copy is a third of the call, and there the two were
// within the host's noise.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "stream_copy.h"

namespace moekit::detail {

void copy_stream_avx512(void* dst, const void* src, size_t n) {
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  // Head: bring the destination to a line boundary with an ordinary copy.
  const size_t head = (64 - (reinterpret_cast<uintptr_t>(d) & 63)) & 63;
  std::memcpy(d, s, head);
  d += head, s += head, n -= head;
  size_t i = 0;
  for (; i + 256 <= n; i += 256) {
    const __m512i a = _mm512_loadu_si512(s + i), b = _mm512_loadu_si512(s + i + 64);
    const __m512i c = _mm512_loadu_si512(s + i + 128), e = _mm512_loadu_si512(s + i + 192);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i), a);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i + 64), b);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i + 128), c);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i + 192), e);
  }
  for (; i + 64 <= n; i += 64) _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i), _mm512_loadu_si512(s + i));
  std::memcpy(d + i, s + i, n - i);
}

}  // namespace moekit::detail

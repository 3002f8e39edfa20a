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

namespace {

// Copies the head that brings the destination to a line boundary with an ordinary copy and
// advances past it.
void align_destination(char*& d, const char*& s, size_t& n) {
  const size_t head = (64 - (reinterpret_cast<uintptr_t>(d) & 63)) & 63;
  std::memcpy(d, s, head);
  d += head, s += head, n -= head;
}

}  // namespace

void copy_stream_avx512(void* dst, const void* src, size_t n) {
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  align_destination(d, s, n);
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

// One line per iteration, each load preceded by a request for the source line 3 KiB ahead
// (while it lies within the source). Measured on the 2-vCPU AMX Xeon (2026-12-03): two
// threads at once, 512 MiB each into private huge pages, 11.7 GB/s per thread against
// 8.3-8.8 for the loop above (glibc memcpy 11.4-11.8; requests 1, 2 or 4 KiB ahead
// 10.7-11.1, 11.4-11.9, 10.7-11.0; one line per iteration without requests 10.2-10.7).
// Two processes each copying 58 MiB into the other's shared segment: 11.7 GB/s on 2 MiB
// pages against 9.3 for the loop above, but 8.0 against 9.3 on 4 KiB pages, hence its own
// entry (copy_stream_to_huge_pages).
void copy_stream_avx512_ahead(void* dst, const void* src, size_t n) {
  constexpr size_t kAheadBytes = 3072;
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  align_destination(d, s, n);
  size_t i = 0;
  for (; i + kAheadBytes + 64 <= n; i += 64) {
    _mm_prefetch(s + i + kAheadBytes, _MM_HINT_T0);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i), _mm512_loadu_si512(s + i));
  }
  for (; i + 64 <= n; i += 64) _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i), _mm512_loadu_si512(s + i));
  std::memcpy(d + i, s + i, n - i);
}

}  // namespace moekit::detail

#include "stream_copy.h"

#include <immintrin.h>

#include <cstring>

#include "moekit/runtime.h"

namespace moekit::detail {

void copy_stream(void* dst, const void* src, size_t n) {
  if (n >= kStreamMinBytes && active_isa() >= Isa::avx512) {
    copy_stream_avx512(dst, src, n);
  } else if (n >= kStreamMinBytes && active_isa() >= Isa::avx2) {
    copy_stream_avx2(dst, src, n);
  } else {
    std::memcpy(dst, src, n);
  }
}

void copy_stream_to_huge_pages(void* dst, const void* src, size_t n) {
  if (n >= kStreamMinBytes && active_isa() >= Isa::avx512) copy_stream_avx512_ahead(dst, src, n);
  else copy_stream(dst, src, n);
}

void stream_fence() { _mm_sfence(); }

}  // namespace moekit::detail

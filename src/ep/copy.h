// Row copies into peers' shared memory. Destinations are not read again by the writer, so
// large copies use non-temporal stores (no read-for-ownership of the destination line,
// which is most of what a cached memcpy costs here); stream_fence() orders them before the
// flag that publishes them.
#pragma once

#include <cstddef>

namespace moekit::ep::detail {

// Copies n bytes; non-temporal when n >= kStreamMinBytes and the CPU has AVX2.
void copy_stream(void* dst, const void* src, size_t n);
void stream_fence();
inline constexpr size_t kStreamMinBytes = 2048;

void copy_stream_avx2(void* dst, const void* src, size_t n);  // n >= 64

}  // namespace moekit::ep::detail

// Copies to memory the writer will not read again soon (shared-memory rows for peers, cast
// outputs far larger than the cache): non-temporal stores skip the read-for-ownership of each
// destination line, which is most of what a cached memcpy costs. stream_fence() orders them
// before whatever publishes the data (a flag, the end of a parallel region).
#pragma once

#include <cstddef>

namespace moekit::detail {

// Copies n bytes; non-temporal when n >= kStreamMinBytes and the CPU has AVX2 (whole-line
// stores with AVX-512).
void copy_stream(void* dst, const void* src, size_t n);
void stream_fence();
inline constexpr size_t kStreamMinBytes = 2048;

// copy_stream for destinations on 2 MiB pages: with AVX-512, one line per iteration with
// each source line requested a few KiB ahead, which streams faster into huge pages and
// slower into 4 KiB ones (stream_copy_avx512.cpp); elsewhere copy_stream.
void copy_stream_to_huge_pages(void* dst, const void* src, size_t n);

void copy_stream_avx2(void* dst, const void* src, size_t n);          // n >= 64
void copy_stream_avx512(void* dst, const void* src, size_t n);        // n >= 64
void copy_stream_avx512_ahead(void* dst, const void* src, size_t n);  // n >= 64

}  // namespace moekit::detail

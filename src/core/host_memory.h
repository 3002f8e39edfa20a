// Host memory for tensors and kernel scratch buffers.
#pragma once

#include <cstddef>

namespace moekit::detail {

// 64-byte aligned memory of at least `bytes` bytes, released with std::free; null when the
// allocation fails. Blocks of 4 MiB and more are 2 MiB aligned and asked to be backed by
// transparent huge pages (where the kernel only grants them on request).
void* host_alloc(size_t bytes);

}  // namespace moekit::detail

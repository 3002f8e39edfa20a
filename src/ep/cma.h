// Cross-memory attach: reading a node peer's private memory with one kernel copy
// (process_vm_readv), so that combine can take the expert ranks' rows straight from their x
// instead of having them copied into shared memory first (docs/EP.md, "Combine from private
// memory"). Linux only; where the kernel or its ptrace policy refuses, the probe says no and
// the buffers keep staging through shared memory.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>

namespace moekit::ep::detail {

// Copies `rows` rows of `row_bytes` bytes, `stride` bytes apart from address `remote` in
// process `pid`, to `local` (rows packed back to back). False (errno set) where the kernel
// refused or the peer's memory was not there.
bool read_peer_rows(pid_t pid, uint64_t remote, int64_t stride, int64_t rows, size_t row_bytes, char* local);
// The same for `rows` rows at the addresses `from` (any order).
bool read_peer_rows_at(pid_t pid, const uint64_t* from, int64_t rows, size_t row_bytes, char* local);

}  // namespace moekit::ep::detail

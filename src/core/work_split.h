// How memory-bound loops share their work between threads.
#pragma once

#include <algorithm>
#include <cstdint>

namespace moekit::detail {

// Memory-bound loops (the casts, the small-M GEMM) hand their rows or columns out in chunks
// that threads claim as they go (OpenMP schedule(dynamic, chunk)), about kChunksPerThread
// per thread, rather than one fixed share each. On a shared or virtualised host one core
// often streams memory markedly slower than another for seconds at a time, and a fixed
// split waits for the slow one (docs/ARCHITECTURE.md, "Threads"). Each row or column is
// still computed by the same operations whichever thread claims it, so results do not
// depend on the split.
inline constexpr int64_t kChunksPerThread = 8;

// Loop iterations per claimed chunk for `count` iterations over `threads` threads.
inline int64_t claim_chunk(int64_t count, int threads) {
  return std::max<int64_t>(1, count / (std::max<int64_t>(1, threads) * kChunksPerThread));
}

}  // namespace moekit::detail

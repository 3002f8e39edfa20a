// Shared by the fuzz targets: the input reader, and the ctest stand-in for libFuzzer that
// feeds a target deterministic pseudo-random inputs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace moekit::fuzzing {

// Draws bytes from a fuzz input; zeros once it is used up.
struct Reader {
  const uint8_t* p;
  size_t n;
  uint8_t byte() { return n ? (--n, *p++) : 0; }
  int64_t small(int64_t limit) { return static_cast<int64_t>(byte()) % limit; }
};

// `iterations` inputs; input i has length min_len + (i * stride) % span bytes.
inline void run_smoke(long iterations, uint64_t seed, size_t min_len, size_t stride, size_t span) {
  uint64_t state = seed;
  std::vector<uint8_t> buf(min_len + span);
  for (long i = 0; i < iterations; ++i) {
    const size_t len = min_len + static_cast<size_t>(i) * stride % span;
    for (size_t j = 0; j < len; ++j) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      buf[j] = static_cast<uint8_t>(state >> 56);
    }
    LLVMFuzzerTestOneInput(buf.data(), len);
  }
}

}  // namespace moekit::fuzzing

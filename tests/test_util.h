// Shared test helpers.
#pragma once

#include <vector>

#include "moekit/runtime.h"

namespace moekit::testing {

// Every instruction-set path this CPU can run (the others are reported as skipped by the
// tests that need them, never silently dropped).
inline std::vector<Isa> supported_isas() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512})
    if (isa_supported(isa)) out.push_back(isa);
  return out;
}

}  // namespace moekit::testing

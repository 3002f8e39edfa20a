// Shared test helpers.
#pragma once

#include <gtest/gtest.h>

#include <string>
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

// Runs body(isa) under every supported ISA, with the ISA in the failure trace.
template <class Body>
void for_each_isa(Body body) {
  for (Isa isa : supported_isas()) {
    SCOPED_TRACE(std::string("isa=") + isa_name(isa));
    ScopedIsa scoped(isa);
    body(isa);
  }
}

}  // namespace moekit::testing

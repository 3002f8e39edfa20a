// Shared test helpers.
#pragma once

#include <gtest/gtest.h>

#include <exception>
#include <string>
#include <vector>

#include "moekit/error.h"

#include "moekit/runtime.h"

// Runs `stmt`, expects a moekit::Error; when `arg` is non-empty its argument() must equal it.
// Any other exception, or none, fails the test.
#define EXPECT_MOEKIT_ERROR_ARG(stmt, arg)                                                    \
  do {                                                                                        \
    try {                                                                                     \
      stmt;                                                                                   \
      ADD_FAILURE() << "no moekit::Error from: " #stmt;                                       \
    } catch (const moekit::Error& e_) {                                                       \
      if (!std::string(arg).empty()) {                                                        \
        EXPECT_EQ(e_.argument(), std::string(arg)) << #stmt << " -> " << e_.what();           \
      }                                                                                       \
    } catch (const std::exception& e_) {                                                      \
      ADD_FAILURE() << "wrong exception type from: " #stmt << " -> " << e_.what();            \
    }                                                                                         \
  } while (0)

namespace moekit::testing {

// Every vector instruction-set path this CPU can run (the others are reported as skipped
// by the tests that need them, never silently dropped). Isa::amx is left out: outside the
// GEMMs it runs the avx512 kernels, so it would test nothing new.
inline std::vector<Isa> supported_isas() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512})
    if (isa_supported(isa)) out.push_back(isa);
  return out;
}

// The GEMM paths: supported_isas() and, where granted, the AMX one (its own accuracy class).
inline std::vector<Isa> gemm_isas() {
  std::vector<Isa> out = supported_isas();
  if (isa_supported(Isa::amx)) out.push_back(Isa::amx);
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

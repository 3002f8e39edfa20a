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
// by the tests that need them, never silently dropped). Isa::avx512_bf16 and Isa::amx are
// left out: outside the GEMMs they run the avx512 kernels, so they would test nothing new.
inline std::vector<Isa> supported_isas() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512})
    if (isa_supported(isa)) out.push_back(isa);
  return out;
}

// The GEMM paths: supported_isas() and, where the CPU has them, the bf16-pair ones
// (avx512_bf16, amx: their own accuracy class).
inline std::vector<Isa> gemm_isas() {
  std::vector<Isa> out = supported_isas();
  for (Isa isa : {Isa::avx512_bf16, Isa::amx})
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

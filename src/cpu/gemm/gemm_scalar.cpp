// Portable target: plain arrays and std::fma (correctly rounded, so it matches the
// hardware FMA of the vector paths bit for bit).
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "cpu/formats/format_kernels.h"
#include "gemm_kernels.h"

namespace moekit::detail {
namespace {

struct G {
  static constexpr int N = 4, MR = 4, NV = 2;
  struct F { float v[N]; };
  static F zero() { return F{}; }
  static F load(const float* p) { F r; std::memcpy(r.v, p, sizeof r.v); return r; }
  static void store(float* p, const F& x) { std::memcpy(p, x.v, sizeof x.v); }
  static F bcast(float x) { F r; for (float& e : r.v) e = x; return r; }
  static F fma(const F& a, const F& b, const F& c) {
    F r;
    for (int i = 0; i < N; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
    return r;
  }
};

#include "gemm_simd.inc"

}  // namespace

const GemmKernels& gemm_kernels_scalar() { return kernels_table(); }

const GemmKernels& gemm_kernels(Isa isa) {
  switch (isa) {
    case Isa::avx512: return gemm_kernels_avx512();
    case Isa::avx2: return gemm_kernels_avx2();
    case Isa::scalar: break;
  }
  return gemm_kernels_scalar();
}

}  // namespace moekit::detail

// Portable target: plain arrays and std::fma (correctly rounded, so it matches the
// hardware FMA of the vector paths bit for bit).
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "cpu/formats/format_kernels.h"
#include "gemm_kernels.h"

namespace moekit::detail {
namespace {

#include "gemm_decode.inc"

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
  // 8-lane vectors of the small-M path.
  struct F8 { float v[8]; };
  static F8 load8(const float* p) { F8 r; std::memcpy(r.v, p, sizeof r.v); return r; }
  static void store8(float* p, const F8& x) { std::memcpy(p, x.v, sizeof x.v); }
  static F8 bcast8(float x) { F8 r; for (float& e : r.v) e = x; return r; }
  static F8 mul8(const F8& a, const F8& b) {
    F8 r;
    for (int i = 0; i < 8; ++i) r.v[i] = a.v[i] * b.v[i];
    return r;
  }
  static F8 fma8(const F8& a, const F8& b, const F8& c) {
    F8 r;
    for (int i = 0; i < 8; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
    return r;
  }
  // The fixed reduction tree of every target: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)).
  static float reduce8(const float* l) { return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7])); }
  static void transpose_block(const float* src, int64_t lds, float* dst, int64_t ldd) {
    for (int r = 0; r < N; ++r)
      for (int c = 0; c < N; ++c) dst[c * ldd + r] = src[r * lds + c];
  }
  static bool pack_k_major_fast(const GemmOperand&, int64_t, int, int64_t, int64_t, int, float*, PackNext) { return false; }
  static int64_t pack_mn_major_fast(const GemmOperand&, int64_t, int64_t, int64_t, int64_t, int, float*) { return 0; }
  static constexpr bool kFusedSmallM = false;
  template <class Raw>
  static void fused_dot(const GemmOperand&, int64_t, int, const float*, int64_t, int, float*, const float*, Raw) {}
  // No vector decoder: the exact tables do every element.
  static int64_t decode_scaled(DType, const uint8_t*, int64_t, int64_t, float, float*) { return 0; }
};

#include "gemm_simd.inc"

}  // namespace

const GemmKernels& gemm_kernels_scalar() { return kernels_table(); }

const GemmKernels& gemm_kernels(Isa isa) {
  switch (isa) {
    case Isa::amx: return gemm_kernels_amx();
    case Isa::avx512_bf16: return gemm_kernels_avx512_bf16();
    case Isa::avx512: return gemm_kernels_avx512();
    case Isa::avx2: return gemm_kernels_avx2();
    case Isa::scalar: break;
  }
  return gemm_kernels_scalar();
}

Isa gemm_prepare(Isa isa, GemmOperand& a, GemmOperand& b) {
  const GemmKernels& k = gemm_kernels(isa);
  return !k.prepare || k.prepare(a, b) ? isa : Isa::avx512;
}

}  // namespace moekit::detail

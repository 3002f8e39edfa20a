// Portable target: the generic kernels over 8-lane plain arrays (no intrinsics; the
// compiler may use the baseline SSE2 it is allowed). Also provides the scalar element
// conversions behind moekit's public f32_to_e4m3() & co.
#include <bit>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../../core/check.h"  // ceil_div
#include "format_kernels.h"

namespace moekit::detail {
namespace {

struct V {
  static constexpr bool kCustomBlocks = false;  // natural lane order (formats_simd.inc)
  static constexpr bool kFastCasts = false;     // casts divide and use encode_magnitude
  static constexpr bool kBf16Amax = false;      // amax_groups widens bf16 like f32
  static constexpr bool kF16Decode = false;     // e4m3 decodes by bit arithmetic
  static constexpr bool kBf16Pow2Codes = false; // casts of bf16 widen to f32
  static constexpr bool kE4m3Thresholds = false, kE2m1Thresholds = false;  // (AVX2 only: formats_avx2.cpp)
  static void fence() {}  // no streaming stores on this target
  static constexpr int N = 8;
  struct F { float v[N]; };
  struct I { int32_t v[N]; };
  using M = I;

  template <class Op>
  static I map(const I& a, const I& b, Op op) { I r; for (int i = 0; i < N; ++i) r.v[i] = op(a.v[i], b.v[i]); return r; }
  template <class Op>
  static F mapf(const F& a, const F& b, Op op) { F r; for (int i = 0; i < N; ++i) r.v[i] = op(a.v[i], b.v[i]); return r; }
  static uint32_t u(int32_t x) { return static_cast<uint32_t>(x); }
  static int32_t s(uint32_t x) { return static_cast<int32_t>(x); }

  static I bits(const F& x) { I r; for (int i = 0; i < N; ++i) r.v[i] = std::bit_cast<int32_t>(x.v[i]); return r; }
  static F from_bits(const I& x) { F r; for (int i = 0; i < N; ++i) r.v[i] = std::bit_cast<float>(x.v[i]); return r; }
  static I seti(int32_t x) { I r; for (int32_t& e : r.v) e = x; return r; }
  static F set(float x) { F r; for (float& e : r.v) e = x; return r; }
  static I and_(const I& a, const I& b) { return map(a, b, [](int32_t x, int32_t y) { return x & y; }); }
  static I or_(const I& a, const I& b) { return map(a, b, [](int32_t x, int32_t y) { return x | y; }); }
  static I add(const I& a, const I& b) { return map(a, b, [](int32_t x, int32_t y) { return s(u(x) + u(y)); }); }
  static I sub(const I& a, const I& b) { return map(a, b, [](int32_t x, int32_t y) { return s(u(x) - u(y)); }); }
  static I min(const I& a, const I& b) { return map(a, b, [](int32_t x, int32_t y) { return x < y ? x : y; }); }
  static I max(const I& a, const I& b) { return map(a, b, [](int32_t x, int32_t y) { return x > y ? x : y; }); }
  template <int k> static I shr(const I& a) { I r; for (int i = 0; i < N; ++i) r.v[i] = s(u(a.v[i]) >> k); return r; }
  template <int k> static I shl(const I& a) { I r; for (int i = 0; i < N; ++i) r.v[i] = s(u(a.v[i]) << k); return r; }
  static M lt(const I& a, const I& b) { return map(a, b, [](int32_t x, int32_t y) { return x < y ? -1 : 0; }); }
  static M gt(const I& a, const I& b) { return map(a, b, [](int32_t x, int32_t y) { return x > y ? -1 : 0; }); }
  static M eq(const I& a, const I& b) { return map(a, b, [](int32_t x, int32_t y) { return x == y ? -1 : 0; }); }
  static I select(const M& m, const I& a, const I& b) { I r; for (int i = 0; i < N; ++i) r.v[i] = m.v[i] ? a.v[i] : b.v[i]; return r; }

  static F add(const F& a, const F& b) { return mapf(a, b, [](float x, float y) { return x + y; }); }
  static F mul(const F& a, const F& b) { return mapf(a, b, [](float x, float y) { return x * y; }); }
  static F div(const F& a, const F& b) { return mapf(a, b, [](float x, float y) { return x / y; }); }
  static F lut8(const float* table, const I& idx) { F r; for (int i = 0; i < N; ++i) r.v[i] = table[idx.v[i] & 7]; return r; }
  static F to_float(const I& a) { F r; for (int i = 0; i < N; ++i) r.v[i] = static_cast<float>(a.v[i]); return r; }
  static int32_t hmax(const I& a) { int32_t m = a.v[0]; for (int i = 1; i < N; ++i) m = a.v[i] > m ? a.v[i] : m; return m; }

  static F load_f32(const float* p) { F r; std::memcpy(r.v, p, sizeof r.v); return r; }
  static void store_f32(float* p, const F& a) { std::memcpy(p, a.v, sizeof a.v); }
  static I load_u16(const uint16_t* p) { I r; for (int i = 0; i < N; ++i) r.v[i] = p[i]; return r; }
  static void stream_u16(uint16_t* p, I a) { store_u16(p, a); }  // (plain stores on this target)
  static void store_u16(uint16_t* p, const I& a) { for (int i = 0; i < N; ++i) p[i] = static_cast<uint16_t>(a.v[i]); }
  static I load_u8(const uint8_t* p) { I r; for (int i = 0; i < N; ++i) r.v[i] = p[i]; return r; }
  static void store_u8(uint8_t* p, const I& a) { for (int i = 0; i < N; ++i) p[i] = static_cast<uint8_t>(a.v[i]); }
  static I load_nibble_pairs(const uint8_t* p) {
    I r;
    for (int i = 0; i < N / 2; ++i) r.v[2 * i] = p[i] & 0xf, r.v[2 * i + 1] = p[i] >> 4;
    return r;
  }
  static void store_nibble_pairs(uint8_t* p, const I& a) {
    for (int i = 0; i < N / 2; ++i) p[i] = static_cast<uint8_t>((a.v[2 * i] & 0xf) | ((a.v[2 * i + 1] & 0xf) << 4));
  }
};

#include "formats_simd.inc"

}  // namespace

const FormatKernels& format_kernels_scalar() { return make_table(); }

uint8_t encode_scalar(Narrow fmt, float x) {
  const V::F v = V::set(x);
  switch (fmt) {
    case Narrow::e4m3: return static_cast<uint8_t>(encode<E4M3>(v).v[0]);
    case Narrow::e5m2: return static_cast<uint8_t>(encode<E5M2>(v).v[0]);
    case Narrow::e2m1: return static_cast<uint8_t>(encode<E2M1>(v).v[0]);
  }
  return 0;
}

float decode_scalar(Narrow fmt, uint8_t code) {
  const V::I c = V::seti(code);
  switch (fmt) {
    case Narrow::e4m3: return decode<E4M3>(c).v[0];
    case Narrow::e5m2: return decode<E5M2>(c).v[0];
    case Narrow::e2m1: return decode<E2M1>(c).v[0];
  }
  return 0.0f;
}

}  // namespace moekit::detail

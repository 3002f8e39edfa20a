// Public scalar element conversions and scale helpers (formats.md).
#include <bit>
#include <cmath>
#include <limits>
#include <string>

#include "format_kernels.h"
#include "moekit/error.h"
#include "moekit/formats.h"

namespace moekit {

using detail::Narrow;

float bf16_to_f32(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

uint16_t f32_to_bf16(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

float e4m3_to_f32(uint8_t code) { return detail::decode_scalar(Narrow::e4m3, code); }
uint8_t f32_to_e4m3(float x) { return detail::encode_scalar(Narrow::e4m3, x); }
float e5m2_to_f32(uint8_t code) { return detail::decode_scalar(Narrow::e5m2, code); }
uint8_t f32_to_e5m2(float x) { return detail::encode_scalar(Narrow::e5m2, x); }
float e2m1_to_f32(uint8_t nibble) { return detail::decode_scalar(Narrow::e2m1, nibble & 0xf); }
uint8_t f32_to_e2m1(float x) { return detail::encode_scalar(Narrow::e2m1, x); }

float ue8m0_to_f32(uint8_t code) {
  if (code == 255) return std::numeric_limits<float>::quiet_NaN();
  // 2^-127 is an f32 subnormal: build it with ldexp rather than from exponent bits.
  return std::ldexp(1.0f, static_cast<int>(code) - 127);
}

uint8_t f32_to_ue8m0(float power_of_two) {
  int exponent = 0;
  const float mantissa = std::frexp(power_of_two, &exponent);  // power_of_two = m * 2^e, m in [0.5, 1)
  if (!(power_of_two > 0.0f) || !std::isfinite(power_of_two) || mantissa != 0.5f ||
      exponent - 1 < -127 || exponent - 1 > 127)
    throw Error("f32_to_ue8m0", "power_of_two", "a power of two in [2^-127, 2^127]",
                std::to_string(power_of_two));
  return static_cast<uint8_t>(exponent - 1 + 127);
}

float ceil_to_ue8m0(float sf) {
  // Above 2^127, the largest ue8m0 value, the power of two would be 2^128: no ue8m0 code
  // (and +inf in f32).
  if (!(sf > 0.0f && sf <= 0x1p127f))
    throw Error("ceil_to_ue8m0", "sf", "a positive scale <= 2^127 (the largest ue8m0 value)", std::to_string(sf));
  return detail::ceil_pow2(sf);
}

float detail::ceil_pow2(float sf) noexcept {
  const uint32_t bits = std::bit_cast<uint32_t>(sf);
  if (bits - 0x00800000u < 0x7f000000u) {  // positive normal: clear the mantissa, bump the exponent if it was not 0
    const uint32_t exponent = bits & 0x7f800000u;
    return std::bit_cast<float>((bits & 0x007fffffu) ? exponent + 0x00800000u : exponent);
  }
  if (!(sf > 0.0f) || !std::isfinite(sf)) return sf;
  int e = 0;  // positive subnormal
  return std::frexp(sf, &e) == 0.5f ? sf : std::ldexp(1.0f, e);
}

}  // namespace moekit

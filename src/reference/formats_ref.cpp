// Reference element values and quantisers: written from the format definitions alone.
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

#include "reference.h"

namespace moekit::ref {

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// A minifloat with e exponent bits, m mantissa bits and the given bias.
double minifloat_value(unsigned code, int e_bits, int m_bits, int bias) {
  const unsigned sign = (code >> (e_bits + m_bits)) & 1u;
  const unsigned e = (code >> m_bits) & ((1u << e_bits) - 1u);
  const unsigned m = code & ((1u << m_bits) - 1u);
  const double frac = static_cast<double>(m) / static_cast<double>(1u << m_bits);
  const double mag = e == 0 ? std::ldexp(frac, 1 - bias) : std::ldexp(1.0 + frac, static_cast<int>(e) - bias);
  return sign ? -mag : mag;
}

// Nearest of the codes [0, count) of a sign-magnitude format to |x|, ties to the even code.
template <class ValueOf>
unsigned nearest_magnitude(double ax, unsigned count, ValueOf value_of) {
  unsigned best = 0;
  double best_err = std::abs(value_of(0) - ax);
  for (unsigned c = 1; c < count; ++c) {
    const double err = std::abs(value_of(c) - ax);
    if (err < best_err || (err == best_err && (c % 2 == 0) && (best % 2 == 1))) {
      best = c;
      best_err = err;
    }
  }
  return best;
}

}  // namespace

double bf16_value(uint16_t bits) {
  const uint32_t w = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}

double e4m3_value(uint8_t code) {
  if ((code & 0x7f) == 0x7f) return kNaN;
  return minifloat_value(code, 4, 3, 7);
}

double e5m2_value(uint8_t code) {
  const unsigned e = (code >> 2) & 0x1f, m = code & 3;
  if (e == 31) return m ? kNaN : ((code & 0x80) ? -INFINITY : INFINITY);
  return minifloat_value(code, 5, 2, 15);
}

double e2m1_value(uint8_t nibble) { return minifloat_value(nibble & 0xf, 2, 1, 1); }

uint8_t nearest_e4m3(double x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  if (std::isnan(x) || std::isinf(x)) return sign | 0x7f;
  const double ax = std::abs(x);
  if (ax >= 448.0) return sign | 0x7e;
  return sign | static_cast<uint8_t>(nearest_magnitude(ax, 0x7f, [](unsigned c) { return e4m3_value(static_cast<uint8_t>(c)); }));
}

uint8_t nearest_e5m2(double x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  if (std::isnan(x)) return sign | 0x7e;
  const double ax = std::abs(x);
  // Values at or above the midpoint between the max finite (57344) and 2^16 round to inf.
  if (ax >= 61440.0) return sign | 0x7c;
  return sign | static_cast<uint8_t>(nearest_magnitude(ax, 0x7c, [](unsigned c) { return e5m2_value(static_cast<uint8_t>(c)); }));
}

uint8_t nearest_e2m1(double x) {
  const uint8_t sign = std::signbit(x) ? 0x8 : 0;
  const double ax = std::isnan(x) ? 6.0 : std::min(std::abs(x), 6.0);
  return sign | static_cast<uint8_t>(nearest_magnitude(ax, 8, [](unsigned c) { return e2m1_value(static_cast<uint8_t>(c)); }));
}

uint16_t nearest_bf16(double x) {
  // Exact for doubles that are f32 values (the only use): RNE of the f32 bit pattern.
  const float f = static_cast<float>(x);
  uint32_t w;
  std::memcpy(&w, &f, 4);
  if (std::isnan(f)) return static_cast<uint16_t>((w >> 16) | 0x40);
  const uint32_t lower = w & 0xffff, upper = w >> 16;
  if (lower > 0x8000 || (lower == 0x8000 && (upper & 1))) return static_cast<uint16_t>(upper + 1);
  return static_cast<uint16_t>(upper);
}

double value_at(const Tensor& t, int64_t r, int64_t c) {
  const int64_t col = t.dtype() == DType::e2m1x2 ? c / 2 : c;
  const char* p = static_cast<const char*>(t.data()) +
                  (r * t.stride(0) + col * t.stride(1)) * static_cast<int64_t>(t.element_size());
  switch (t.dtype()) {
    case DType::f32: { float f; std::memcpy(&f, p, 4); return f; }
    case DType::bf16: { uint16_t b; std::memcpy(&b, p, 2); return bf16_value(b); }
    case DType::e4m3: return e4m3_value(static_cast<uint8_t>(*p));
    case DType::e5m2: return e5m2_value(static_cast<uint8_t>(*p));
    case DType::e2m1x2: {
      const auto byte = static_cast<uint8_t>(*p);
      return e2m1_value(c % 2 ? byte >> 4 : byte & 0xf);
    }
    default: throw std::invalid_argument(std::string("ref::value_at: unsupported dtype ") + dtype_name(t.dtype()));
  }
}

namespace {

// The scale contract in f32 arithmetic (formats.md): sf = fl(max(amax, 1e-4) / max_code),
// then 2^ceil(log2 sf) for ue8m0. Computed in f64 and rounded to f32 where the contract
// says f32 (a correctly rounded f64 quotient of two floats rounds to the f32 quotient).
float ref_scale(double amax, double max_code, bool use_ue8m0) {
  const double floor_value = static_cast<float>(1e-4);
  const float sf = static_cast<float>(std::max(amax, floor_value) / max_code);
  if (!use_ue8m0) return sf;
  return static_cast<float>(std::exp2(std::ceil(std::log2(static_cast<double>(sf)))));
}

// q = code(fl32(x / sf)).
uint8_t quantize_one(double x, float sf, bool fp4) {
  const double scaled = static_cast<float>(x / static_cast<double>(sf));
  return fp4 ? nearest_e2m1(scaled) : nearest_e4m3(scaled);
}

// Quantises with scale groups of gm rows × gk columns.
Quantized quantize_grid(const Tensor& x, bool use_ue8m0, int64_t gm, int64_t gk, bool fp4) {
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t sm = (m + gm - 1) / gm, sk = (k + gk - 1) / gk;
  Quantized out{fp4 ? Tensor::zeros({m, (k + 1) / 2}, DType::e2m1x2) : Tensor::zeros({m, k}, DType::e4m3),
                Tensor::zeros({sm, sk}, DType::f32)};
  float* sf = out.sf.data_ptr<float>();
  auto* q = out.values.data_ptr<uint8_t>();
  for (int64_t bi = 0; bi < sm; ++bi)
    for (int64_t bj = 0; bj < sk; ++bj) {
      double amax = 0.0;
      for (int64_t r = bi * gm; r < std::min(m, (bi + 1) * gm); ++r)
        for (int64_t c = bj * gk; c < std::min(k, (bj + 1) * gk); ++c) {
          const double a = std::abs(value_at(x, r, c));
          amax = std::isnan(a) || std::isnan(amax) ? kNaN : std::max(amax, a);  // NaN is sticky
        }
      const float s = ref_scale(amax, fp4 ? 6.0 : 448.0, use_ue8m0);
      sf[bi * sk + bj] = s;
      for (int64_t r = bi * gm; r < std::min(m, (bi + 1) * gm); ++r)
        for (int64_t c = bj * gk; c < std::min(k, (bj + 1) * gk); ++c) {
          const uint8_t code = quantize_one(value_at(x, r, c), s, fp4);
          if (fp4) q[r * ((k + 1) / 2) + c / 2] |= static_cast<uint8_t>(c % 2 ? code << 4 : code);
          else q[r * k + c] = code;
        }
    }
  return out;
}

}  // namespace

Quantized per_token_cast_to_fp8(const Tensor& x, bool use_ue8m0, int64_t gran_k) {
  return quantize_grid(x, use_ue8m0, 1, gran_k, false);
}
Quantized per_block_cast_to_fp8(const Tensor& x, bool use_ue8m0, int64_t block_m, int64_t block_k) {
  return quantize_grid(x, use_ue8m0, block_m, block_k, false);
}
Quantized per_channel_cast_to_fp8(const Tensor& x, bool use_ue8m0, int64_t gran_k) {
  return quantize_grid(x, use_ue8m0, gran_k, 1, false);
}
Quantized per_token_cast_to_fp4(const Tensor& x, bool use_ue8m0, int64_t gran_k) {
  return quantize_grid(x, use_ue8m0, 1, gran_k, true);
}

namespace {
double scale_at(const Tensor& sf, int64_t r, int64_t g) {
  if (sf.dtype() == DType::f32) return value_at(sf, r, g);
  const auto* bytes = static_cast<const uint8_t*>(sf.data()) + r * sf.stride(0) * 4;
  const uint8_t e = bytes[g];  // little-endian: byte g%4 of word g/4
  return e == 255 ? kNaN : std::ldexp(1.0, static_cast<int>(e) - 127);
}
}  // namespace

std::vector<double> dequantize(const Tensor& q, const Tensor& sf, int64_t gran_m, int64_t gran_k, int64_t k) {
  const int64_t m = q.size(0);
  std::vector<double> out(static_cast<size_t>(m * k));
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < k; ++c) out[r * k + c] = value_at(q, r, c) * scale_at(sf, r / gran_m, c / gran_k);
  return out;
}

double calc_diff(const std::vector<double>& x, const std::vector<double>& y) {
  if (x.size() != y.size()) throw std::invalid_argument("ref::calc_diff: size mismatch");
  double dot = 0.0, norm = 0.0;
  for (size_t i = 0; i < x.size(); ++i) dot += x[i] * y[i], norm += x[i] * x[i] + y[i] * y[i];
  return norm == 0.0 ? 0.0 : 1.0 - 2.0 * dot / norm;
}

// Exposed for gemm_ref.cpp.
double operand_scale(const Tensor& sf, int64_t r, int64_t g) { return scale_at(sf, r, g); }

}  // namespace moekit::ref

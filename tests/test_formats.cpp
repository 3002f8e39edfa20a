// Element formats (formats.md "Element formats" and "Packing"): exhaustive decode tables,
// round-to-nearest-even encoding with the documented overflow rules, the bulk convert()
// kernels under every ISA this CPU can run, and the ue8m0 scale helpers.
//
// Expected values come from tables and formulas written here from the spec, not from the
// library or the reference oracle (the oracle is itself checked against them).
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

// First and alone: a public header declares moekit::Error itself, so that a caller that
// includes only it can catch what it raises.
#include "moekit/formats.h"
static_assert(sizeof(moekit::Error) > 0, "moekit/formats.h must declare moekit::Error");

#include "moekit/error.h"
#include "moekit/runtime.h"
#include "moekit/tensor.h"
#include "cpu/formats/format_kernels.h"
#include "reference.h"
#include "test_util.h"

namespace moekit {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr float kNaNf = std::numeric_limits<float>::quiet_NaN();
constexpr float kInff = std::numeric_limits<float>::infinity();

std::string hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}
uint32_t bits_of(float x) { return std::bit_cast<uint32_t>(x); }
float float_of(uint32_t bits) { return std::bit_cast<float>(bits); }
// bf16 is the top half of an f32 (formats.md); decoded here without the library.
float bf16_bits_to_float(uint16_t b) { return float_of(static_cast<uint32_t>(b) << 16); }
bool bf16_is_nan(uint16_t b) { return (b & 0x7f80) == 0x7f80 && (b & 0x7f) != 0; }

// Same value including the sign of zero; any NaN matches any NaN.
::testing::AssertionResult same_value(double got, double want) {
  if (std::isnan(want)) {
    if (std::isnan(got)) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "got " << got << ", want NaN";
  }
  if (got == want && std::signbit(got) == std::signbit(want)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "got " << got << ", want " << want << " (sign bits " << std::signbit(got)
                                       << " vs " << std::signbit(want) << ")";
}

using moekit::testing::for_each_isa;

// ---------------------------------------------------------------- independent tables
// e4m3fn: s1 e4 (bias 7) m3, subnormals m/8 * 2^-6, only S.1111.111 special (NaN).
double e4m3_expected(unsigned code) {
  const double sign = (code & 0x80) ? -1.0 : 1.0;
  const unsigned e = (code >> 3) & 0xf, m = code & 7;
  if (e == 15 && m == 7) return kNaN;
  if (e == 0) return sign * m * 0x1p-9;
  return sign * (8 + m) * std::ldexp(1.0, static_cast<int>(e) - 10);
}

// e5m2: s1 e5 (bias 15) m2, IEEE-like inf (e=31, m=0) and NaN (e=31, m!=0).
double e5m2_expected(unsigned code) {
  const double sign = (code & 0x80) ? -1.0 : 1.0;
  const unsigned e = (code >> 2) & 0x1f, m = code & 3;
  if (e == 31) return m == 0 ? sign * kInf : kNaN;
  if (e == 0) return sign * m * 0x1p-16;
  return sign * (4 + m) * std::ldexp(1.0, static_cast<int>(e) - 17);
}

// e2m1: all 16 codes, literally.
constexpr double kE2m1[16] = {0.0,  0.5,  1.0,  1.5,  2.0,  3.0,  4.0,  6.0,
                              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0};

struct CodeValue {
  unsigned code;
  double value;
};

// Hand-written spot values (not derived from the formulas above).
const std::vector<CodeValue> kE4m3Literal = {
    {0x00, 0.0},         {0x01, 0x1p-9},      {0x02, 0x1p-8},   {0x07, 7 * 0x1p-9}, {0x08, 0x1p-6},
    {0x09, 1.125 * 0x1p-6}, {0x38, 1.0},      {0x39, 1.125},    {0x3c, 1.5},        {0x40, 2.0},
    {0x77, 240.0},       {0x78, 256.0},       {0x7e, 448.0},    {0x7f, kNaN},       {0x80, -0.0},
    {0x81, -0x1p-9},     {0xb8, -1.0},        {0xfe, -448.0},   {0xff, kNaN},
};
const std::vector<CodeValue> kE5m2Literal = {
    {0x00, 0.0},   {0x01, 0x1p-16}, {0x03, 3 * 0x1p-16}, {0x04, 0x1p-14}, {0x3c, 1.0},
    {0x3d, 1.25},  {0x40, 2.0},     {0x7b, 57344.0},     {0x7c, kInf},    {0x7d, kNaN},
    {0x7e, kNaN},  {0x7f, kNaN},    {0x80, -0.0},        {0xbc, -1.0},    {0xfb, -57344.0},
    {0xfc, -kInf}, {0xfd, kNaN},    {0xfe, kNaN},        {0xff, kNaN},
};
const std::vector<std::pair<uint16_t, double>> kBf16Literal = {
    {0x0000, 0.0},      {0x8000, -0.0},           {0x3f80, 1.0},  {0xbf80, -1.0},
    {0x4049, 3.140625}, {0x0080, 0x1p-126},       {0x0001, 0x1p-133},
    {0x7f7f, 255 * 0x1p120}, {0x7f80, kInf},      {0xff80, -kInf}, {0x7fc0, kNaN}, {0xffc1, kNaN},
};

TEST(FormatsTables, LiteralValuesAgreeWithFormulas) {
  for (const auto& [code, value] : kE4m3Literal)
    EXPECT_TRUE(same_value(e4m3_expected(code), value)) << "e4m3 code " << code;
  for (const auto& [code, value] : kE5m2Literal)
    EXPECT_TRUE(same_value(e5m2_expected(code), value)) << "e5m2 code " << code;
}

// ---------------------------------------------------------------- scalar decode
TEST(FormatsE4m3, ScalarDecodeMatchesLiteralTable) {
  for (const auto& [code, value] : kE4m3Literal)
    EXPECT_TRUE(same_value(e4m3_to_f32(static_cast<uint8_t>(code)), value)) << "code 0x" << std::hex << code;
}

TEST(FormatsE4m3, ScalarDecodeAll256Codes) {
  int nans = 0;
  for (unsigned c = 0; c < 256; ++c) {
    const float got = e4m3_to_f32(static_cast<uint8_t>(c));
    EXPECT_TRUE(same_value(got, e4m3_expected(c))) << "code 0x" << std::hex << c;
    nans += std::isnan(got);
  }
  EXPECT_EQ(nans, 2);  // exactly 0x7f and 0xff
}

TEST(FormatsE5m2, ScalarDecodeMatchesLiteralTable) {
  for (const auto& [code, value] : kE5m2Literal)
    EXPECT_TRUE(same_value(e5m2_to_f32(static_cast<uint8_t>(code)), value)) << "code 0x" << std::hex << code;
}

TEST(FormatsE5m2, ScalarDecodeAll256Codes) {
  int nans = 0, infs = 0;
  for (unsigned c = 0; c < 256; ++c) {
    const float got = e5m2_to_f32(static_cast<uint8_t>(c));
    EXPECT_TRUE(same_value(got, e5m2_expected(c))) << "code 0x" << std::hex << c;
    nans += std::isnan(got);
    infs += std::isinf(got);
  }
  EXPECT_EQ(nans, 6);  // 0x7d-0x7f, 0xfd-0xff
  EXPECT_EQ(infs, 2);
}

TEST(FormatsE2m1, ScalarDecodeAll16Codes) {
  for (unsigned c = 0; c < 16; ++c) {
    EXPECT_TRUE(same_value(e2m1_to_f32(static_cast<uint8_t>(c)), kE2m1[c])) << "nibble " << c;
    // Only the low 4 bits are used.
    EXPECT_TRUE(same_value(e2m1_to_f32(static_cast<uint8_t>(c | 0xa0)), kE2m1[c])) << "nibble " << c << " | 0xa0";
  }
}

TEST(FormatsBf16, ScalarDecodeLiteralValues) {
  for (const auto& [b, value] : kBf16Literal) EXPECT_TRUE(same_value(bf16_to_f32(b), value)) << "bf16 0x" << std::hex << b;
}

TEST(FormatsReference, OracleElementValuesAgreeWithTables) {
  for (unsigned c = 0; c < 256; ++c) {
    EXPECT_TRUE(same_value(ref::e4m3_value(static_cast<uint8_t>(c)), e4m3_expected(c))) << "e4m3 0x" << std::hex << c;
    EXPECT_TRUE(same_value(ref::e5m2_value(static_cast<uint8_t>(c)), e5m2_expected(c))) << "e5m2 0x" << std::hex << c;
  }
  for (unsigned c = 0; c < 16; ++c) EXPECT_TRUE(same_value(ref::e2m1_value(static_cast<uint8_t>(c)), kE2m1[c])) << c;
  for (const auto& [b, value] : kBf16Literal) EXPECT_TRUE(same_value(ref::bf16_value(b), value)) << std::hex << b;
}

// ---------------------------------------------------------------- bulk convert helpers
// convert(src -> dst) into a buffer followed by a guard area; returns the dst bytes and
// checks the guard is untouched. The dst region itself is pre-filled with a sentinel, so
// bytes the kernel fails to write (e.g. an odd fp4 tail's high nibble) show up.
std::vector<uint8_t> convert_bytes(const void* src, const Shape& src_shape, DType src_dtype,
                                   const Shape& dst_shape, DType dst_dtype) {
  constexpr size_t kGuard = 64;
  constexpr uint8_t kSentinel = 0xa5;
  int64_t n = 1;
  for (int64_t s : dst_shape) n *= s;
  const size_t bytes = static_cast<size_t>(n) * element_size(dst_dtype);
  std::vector<uint8_t> buffer(bytes + kGuard, kSentinel);
  convert(Tensor::from_blob(src, src_shape, src_dtype), Tensor::from_blob(buffer.data(), dst_shape, dst_dtype));
  for (size_t i = bytes; i < buffer.size(); ++i)
    if (buffer[i] != kSentinel) {
      ADD_FAILURE() << "convert wrote past the end of dst (byte " << i - bytes << " of the guard)";
      break;
    }
  buffer.resize(bytes);
  return buffer;
}

template <class T>
std::vector<T> as(const std::vector<uint8_t>& bytes) {
  std::vector<T> out(bytes.size() / sizeof(T));
  std::memcpy(out.data(), bytes.data(), out.size() * sizeof(T));
  return out;
}

enum class Fmt { e4m3, e5m2, e2m1 };
const char* fmt_name(Fmt f) { return f == Fmt::e4m3 ? "e4m3" : f == Fmt::e5m2 ? "e5m2" : "e2m1"; }
DType dtype_of(Fmt f) { return f == Fmt::e4m3 ? DType::e4m3 : f == Fmt::e5m2 ? DType::e5m2 : DType::e2m1x2; }
uint8_t encode(Fmt f, float x) {
  return f == Fmt::e4m3 ? f32_to_e4m3(x) : f == Fmt::e5m2 ? f32_to_e5m2(x) : f32_to_e2m1(x);
}

// Expected bytes of a narrow row of n values (e2m1: two per byte, even index low nibble,
// the unused high nibble of an odd tail is 0).
std::vector<uint8_t> expected_codes(Fmt f, const std::vector<float>& x, int64_t rows, int64_t cols) {
  std::vector<uint8_t> out;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x.data() + r * cols;
    if (f != Fmt::e2m1) {
      for (int64_t c = 0; c < cols; ++c) out.push_back(encode(f, row[c]));
    } else {
      for (int64_t c = 0; c < cols; c += 2) {
        const uint8_t lo = encode(f, row[c]) & 0xf;
        const uint8_t hi = c + 1 < cols ? encode(f, row[c + 1]) & 0xf : 0;
        out.push_back(static_cast<uint8_t>(lo | hi << 4));
      }
    }
  }
  return out;
}

int64_t packed_cols(Fmt f, int64_t cols) { return f == Fmt::e2m1 ? (cols + 1) / 2 : cols; }

::testing::AssertionResult same_bytes(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want,
                                      const std::vector<float>* inputs = nullptr) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "size " << got.size() << " vs " << want.size();
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i] && bad++ == 0) first = i;
  if (bad == 0) return ::testing::AssertionSuccess();
  auto r = ::testing::AssertionFailure();
  r << bad << " of " << got.size() << " bytes differ; first at " << first << ": got " << hex(got[first]) << ", want "
    << hex(want[first]);
  if (inputs && first < inputs->size()) r << " (input bits " << hex(bits_of((*inputs)[first])) << ")";
  return r;
}

// Encodes x (as rows x cols f32, and as bf16 after truncation) under the active ISA.
void check_encode_f32(Fmt f, const std::vector<float>& x, int64_t rows, int64_t cols) {
  SCOPED_TRACE(std::string(fmt_name(f)) + " f32 rows=" + std::to_string(rows) + " cols=" + std::to_string(cols));
  const auto got = convert_bytes(x.data(), {rows, cols}, DType::f32, {rows, packed_cols(f, cols)}, dtype_of(f));
  EXPECT_TRUE(same_bytes(got, expected_codes(f, x, rows, cols), f == Fmt::e2m1 ? nullptr : &x));
}

void check_encode_bf16(Fmt f, const std::vector<uint16_t>& x, int64_t rows, int64_t cols) {
  SCOPED_TRACE(std::string(fmt_name(f)) + " bf16 rows=" + std::to_string(rows) + " cols=" + std::to_string(cols));
  std::vector<float> widened(x.size());
  for (size_t i = 0; i < x.size(); ++i) widened[i] = bf16_bits_to_float(x[i]);
  const auto got = convert_bytes(x.data(), {rows, cols}, DType::bf16, {rows, packed_cols(f, cols)}, dtype_of(f));
  EXPECT_TRUE(same_bytes(got, expected_codes(f, widened, rows, cols), f == Fmt::e2m1 ? nullptr : &widened));
}

// 1-D then 2-D convert of a prefix/all of x.
void check_encode_lengths(Fmt f, const std::vector<float>& x) {
  for (int64_t n : {1, 7, 9, 15, 17, 33, 1000}) {
    if (n > static_cast<int64_t>(x.size())) continue;
    const std::vector<float> prefix(x.begin(), x.begin() + n);
    const auto got = convert_bytes(prefix.data(), {n}, DType::f32, {packed_cols(f, n)}, dtype_of(f));
    EXPECT_TRUE(same_bytes(got, expected_codes(f, prefix, 1, n))) << fmt_name(f) << " 1-D n=" << n;
    if (3 * n <= static_cast<int64_t>(x.size())) {
      const std::vector<float> block(x.begin(), x.begin() + 3 * n);
      check_encode_f32(f, block, 3, n);
    }
  }
}

// Every finite value of f's grid, the midpoints between neighbours and their f32
// neighbours, plus specials.
std::vector<float> interesting_values(Fmt f) {
  std::vector<double> grid;
  if (f == Fmt::e2m1) {
    grid.assign(kE2m1, kE2m1 + 8);
  } else {
    for (unsigned c = 0; c < 0x80; ++c) {
      const double v = f == Fmt::e4m3 ? e4m3_expected(c) : e5m2_expected(c);
      if (std::isfinite(v)) grid.push_back(v);
    }
  }
  std::vector<float> out;
  for (size_t i = 0; i < grid.size(); ++i) {
    out.push_back(static_cast<float>(grid[i]));
    if (i + 1 < grid.size()) {
      const float mid = static_cast<float>((grid[i] + grid[i + 1]) / 2);
      out.insert(out.end(), {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, kInff)});
    }
  }
  const float top = static_cast<float>(grid.back());
  out.insert(out.end(), {top * 1.03f, top * 1.0625f, top * 1.07f, top * 1.2f, 1e9f, FLT_MAX, kInff, kNaNf,
                         float_of(0x7fa00001u), 1e-40f, FLT_MIN, 0.0f});
  const size_t n = out.size();
  for (size_t i = 0; i < n; ++i) out.push_back(-out[i]);
  return out;
}

// ---------------------------------------------------------------- scalar encode: e4m3
TEST(FormatsE4m3, EncodeEveryFiniteCodeValue) {
  for (unsigned c = 0; c < 256; ++c) {
    const double v = e4m3_expected(c);
    if (std::isnan(v)) continue;
    EXPECT_EQ(f32_to_e4m3(static_cast<float>(v)), c) << "value " << v << " (code 0x" << std::hex << c << ")";
  }
}

// Between every pair of adjacent magnitudes (codes c, c+1): the midpoint goes to the even
// code, one f32 ulp below to c, one above to c+1; the same with the sign bit.
void check_midpoints(Fmt f, unsigned last_finite_code) {
  for (unsigned c = 0; c < last_finite_code; ++c) {
    const double lo = f == Fmt::e4m3 ? e4m3_expected(c) : f == Fmt::e5m2 ? e5m2_expected(c) : kE2m1[c];
    const double hi = f == Fmt::e4m3 ? e4m3_expected(c + 1) : f == Fmt::e5m2 ? e5m2_expected(c + 1) : kE2m1[c + 1];
    const float mid = static_cast<float>((lo + hi) / 2);
    ASSERT_EQ(static_cast<double>(mid), (lo + hi) / 2) << "midpoint not exact in f32";
    const unsigned even = c % 2 == 0 ? c : c + 1;
    const unsigned sign = f == Fmt::e2m1 ? 0x8 : 0x80;
    SCOPED_TRACE(std::string(fmt_name(f)) + " between codes " + std::to_string(c) + " and " + std::to_string(c + 1));
    EXPECT_EQ(encode(f, mid), even) << "midpoint " << mid;
    EXPECT_EQ(encode(f, std::nextafter(mid, 0.0f)), c) << "midpoint - ulp";
    EXPECT_EQ(encode(f, std::nextafter(mid, kInff)), c + 1) << "midpoint + ulp";
    EXPECT_EQ(encode(f, -mid), even | sign) << "-midpoint";
    EXPECT_EQ(encode(f, -std::nextafter(mid, 0.0f)), c | sign);
    EXPECT_EQ(encode(f, -std::nextafter(mid, kInff)), (c + 1) | sign);
  }
}

TEST(FormatsE4m3, EncodeMidpointsTiesToEven) { check_midpoints(Fmt::e4m3, 0x7e); }

TEST(FormatsE4m3, EncodeSubnormalTies) {
  EXPECT_EQ(f32_to_e4m3(0x1p-10f), 0x00);            // tie between 0 and 2^-9 -> 0
  EXPECT_EQ(f32_to_e4m3(3 * 0x1p-10f), 0x02);        // tie between 2^-9 and 2^-8 -> even code 2
  EXPECT_EQ(f32_to_e4m3(5 * 0x1p-10f), 0x02);        // tie between codes 2 and 3 -> 2
  EXPECT_EQ(f32_to_e4m3(7 * 0x1p-10f), 0x04);        // tie between codes 3 and 4 -> 4
  EXPECT_EQ(f32_to_e4m3(15 * 0x1p-10f), 0x08);       // tie between 7*2^-9 and 2^-6 -> 0x08
  EXPECT_EQ(f32_to_e4m3(0x1p-10f * 1.0001f), 0x01);
  EXPECT_EQ(f32_to_e4m3(-3 * 0x1p-10f), 0x82);
  EXPECT_EQ(f32_to_e4m3(0x1p-12f), 0x00);
  EXPECT_EQ(f32_to_e4m3(1e-40f), 0x00);              // f32 subnormal input
  EXPECT_EQ(f32_to_e4m3(-1e-40f), 0x80);
  EXPECT_EQ(f32_to_e4m3(-0.0f), 0x80);
  EXPECT_EQ(f32_to_e4m3(0.0f), 0x00);
}

TEST(FormatsE4m3, EncodeNormalCases) {
  EXPECT_EQ(f32_to_e4m3(1.0f), 0x38);
  EXPECT_EQ(f32_to_e4m3(1.0625f), 0x38);  // tie between 1 and 1.125 -> even (1.0)
  EXPECT_EQ(f32_to_e4m3(1.1875f), 0x3a);  // tie between 1.125 and 1.25 -> even (1.25)
  EXPECT_EQ(f32_to_e4m3(-2.9f), 0xc4);    // nearest -3.0 = -1.5*2^1: e=8, m=4
  EXPECT_EQ(f32_to_e4m3(2.8f), 0x43);     // nearest 2.75 = 1.375*2^1: e=8, m=3
}

TEST(FormatsE4m3, EncodeSaturatesAndMapsSpecialsToNaN) {
  for (float x : {448.0f, 449.0f, 460.0f, 464.0f, 465.0f, 480.0f, 1000.0f, 1e9f, FLT_MAX}) {
    EXPECT_EQ(f32_to_e4m3(x), 0x7e) << x;
    EXPECT_EQ(f32_to_e4m3(-x), 0xfe) << -x;
  }
  EXPECT_EQ(f32_to_e4m3(447.9f), 0x7e);
  EXPECT_EQ(f32_to_e4m3(432.0f), 0x7e);  // tie between 416 (0x7d) and 448 (0x7e) -> even 0x7e
  EXPECT_EQ(f32_to_e4m3(431.0f), 0x7d);
  EXPECT_EQ(f32_to_e4m3(kInff), 0x7f);
  EXPECT_EQ(f32_to_e4m3(-kInff), 0xff);
  EXPECT_EQ(f32_to_e4m3(kNaNf), 0x7f);
  EXPECT_EQ(f32_to_e4m3(-kNaNf), 0xff);
  EXPECT_EQ(f32_to_e4m3(float_of(0x7f800001u)), 0x7f);  // signalling NaN
  EXPECT_EQ(f32_to_e4m3(float_of(0xffbfffffu)), 0xff);
}

// ---------------------------------------------------------------- scalar encode: e5m2
TEST(FormatsE5m2, EncodeEveryFiniteCodeValue) {
  for (unsigned c = 0; c < 256; ++c) {
    const double v = e5m2_expected(c);
    if (!std::isfinite(v)) continue;
    EXPECT_EQ(f32_to_e5m2(static_cast<float>(v)), c) << "value " << v << " (code 0x" << std::hex << c << ")";
  }
}

TEST(FormatsE5m2, EncodeMidpointsTiesToEven) { check_midpoints(Fmt::e5m2, 0x7b); }

TEST(FormatsE5m2, EncodeOverflowInfAndNaN) {
  EXPECT_EQ(f32_to_e5m2(57344.0f), 0x7b);
  EXPECT_EQ(f32_to_e5m2(61439.0f), 0x7b);
  EXPECT_EQ(f32_to_e5m2(std::nextafter(61440.0f, 0.0f)), 0x7b);
  EXPECT_EQ(f32_to_e5m2(61440.0f), 0x7c);  // the midpoint to 2^16 rounds (to even) to inf
  EXPECT_EQ(f32_to_e5m2(-61440.0f), 0xfc);
  EXPECT_EQ(f32_to_e5m2(65536.0f), 0x7c);
  EXPECT_EQ(f32_to_e5m2(1e9f), 0x7c);
  EXPECT_EQ(f32_to_e5m2(FLT_MAX), 0x7c);
  EXPECT_EQ(f32_to_e5m2(-FLT_MAX), 0xfc);
  EXPECT_EQ(f32_to_e5m2(kInff), 0x7c);
  EXPECT_EQ(f32_to_e5m2(-kInff), 0xfc);
  EXPECT_EQ(f32_to_e5m2(kNaNf), 0x7e);
  EXPECT_EQ(f32_to_e5m2(-kNaNf), 0xfe);
  EXPECT_EQ(f32_to_e5m2(float_of(0x7f800001u)), 0x7e);
  EXPECT_EQ(f32_to_e5m2(0x1p-17f), 0x00);       // tie between 0 and 2^-16
  EXPECT_EQ(f32_to_e5m2(3 * 0x1p-17f), 0x02);   // tie between codes 1 and 2
  EXPECT_EQ(f32_to_e5m2(-0.0f), 0x80);
  EXPECT_EQ(f32_to_e5m2(1e-40f), 0x00);
}

// ---------------------------------------------------------------- scalar encode: e2m1
TEST(FormatsE2m1, EncodeEveryCodeValue) {
  for (unsigned c = 0; c < 16; ++c) EXPECT_EQ(f32_to_e2m1(static_cast<float>(kE2m1[c])), c) << kE2m1[c];
}

TEST(FormatsE2m1, EncodeTiesToEven) {
  // codes: 0->0, 1->0.5, 2->1, 3->1.5, 4->2, 5->3, 6->4, 7->6
  const std::vector<std::pair<float, unsigned>> cases = {
      {0.25f, 0}, {0.75f, 2}, {1.25f, 2}, {1.75f, 4}, {2.5f, 4}, {3.5f, 6}, {5.0f, 6},
      {0.26f, 1}, {0.74f, 1}, {1.3f, 3},  {2.6f, 5},  {3.4f, 5}, {5.1f, 7}, {4.9f, 6}, {0.1f, 0},
  };
  for (const auto& [x, code] : cases) {
    EXPECT_EQ(f32_to_e2m1(x), code) << x;
    EXPECT_EQ(f32_to_e2m1(-x), code | 0x8) << -x;
  }
  check_midpoints(Fmt::e2m1, 7);
}

TEST(FormatsE2m1, EncodeSaturates) {
  for (float x : {6.0f, 6.5f, 7.0f, 100.0f, 1e30f, FLT_MAX, kInff}) {
    EXPECT_EQ(f32_to_e2m1(x), 0x7) << x;
    EXPECT_EQ(f32_to_e2m1(-x), 0xf) << -x;
  }
  EXPECT_EQ(f32_to_e2m1(kNaNf), 0x7);  // documented: NaN -> +6
  EXPECT_EQ(f32_to_e2m1(-0.0f), 0x8);
  EXPECT_EQ(f32_to_e2m1(1e-40f), 0x0);
}

// ---------------------------------------------------------------- scalar encode: bf16
TEST(FormatsBf16, EncodeRoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(f32_to_bf16(-1.0f), 0xbf80);
  EXPECT_EQ(f32_to_bf16(float_of(0x3f808000u)), 0x3f80);  // tie, even below
  EXPECT_EQ(f32_to_bf16(float_of(0x3f818000u)), 0x3f82);  // tie, even above
  EXPECT_EQ(f32_to_bf16(float_of(0x3f808001u)), 0x3f81);
  EXPECT_EQ(f32_to_bf16(float_of(0x3f807fffu)), 0x3f80);
  EXPECT_EQ(f32_to_bf16(float_of(0xbf818000u)), 0xbf82);
  EXPECT_EQ(f32_to_bf16(float_of(0x3fff8000u)), 0x4000);  // carry into the exponent
  EXPECT_EQ(f32_to_bf16(3.14159265f), 0x4049);
  EXPECT_EQ(f32_to_bf16(float_of(0x00008000u)), 0x0000);  // subnormal tie -> even 0
  EXPECT_EQ(f32_to_bf16(float_of(0x00018000u)), 0x0002);
  EXPECT_EQ(f32_to_bf16(-0.0f), 0x8000);
}

TEST(FormatsBf16, EncodeSpecialsAndOverflow) {
  EXPECT_EQ(f32_to_bf16(kInff), 0x7f80);
  EXPECT_EQ(f32_to_bf16(-kInff), 0xff80);
  EXPECT_EQ(f32_to_bf16(float_of(0x7f7f7fffu)), 0x7f7f);  // below the boundary: max finite bf16
  EXPECT_EQ(f32_to_bf16(float_of(0x7f7f8000u)), 0x7f80);  // tie at the overflow boundary -> inf
  EXPECT_EQ(f32_to_bf16(FLT_MAX), 0x7f80);
  EXPECT_EQ(f32_to_bf16(-FLT_MAX), 0xff80);
  EXPECT_EQ(f32_to_bf16(static_cast<float>(255 * 0x1p120)), 0x7f7f);
  for (uint32_t nan : {0x7fc00000u, 0x7f800001u, 0x7f80ffffu, 0x7fffffffu, 0xffc00000u, 0xff800001u}) {
    const uint16_t b = f32_to_bf16(float_of(nan));
    EXPECT_TRUE(bf16_is_nan(b)) << std::hex << nan << " -> " << b;
    EXPECT_NE(b & 0x40, 0) << "not a quiet NaN: " << std::hex << nan << " -> " << b;
    EXPECT_EQ(static_cast<uint32_t>(b & 0x8000), (nan >> 16) & 0x8000u) << "sign lost: " << std::hex << nan;
  }
}

TEST(FormatsBf16, DecodeEncodeRoundTripAllPatterns) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float f = bf16_to_f32(static_cast<uint16_t>(b));
    ASSERT_EQ(bits_of(f), b << 16) << std::hex << b;
    if (!bf16_is_nan(static_cast<uint16_t>(b))) {
      ASSERT_EQ(f32_to_bf16(f), b) << std::hex << b;
    }
  }
}

// ------------------------------------------- finished GEMM tiles: f32 rows to bf16
// The GEMMs' writer of bf16 D: each ISA's f32_rows_to_bf16_canonical against the scalar
// converter, with every NaN as 0x7fc0; rows strided on both sides, the gaps left alone;
// ordinary and streaming stores (rows ldo apart on a 64-byte aligned buffer: with ldo a
// multiple of 16 every vector store is aligned and streams; cols + 3 mixes both).
TEST(FormatsConvert, F32RowsToBf16CanonicalEveryIsa) {
  const uint32_t specials[] = {0x00000000u, 0x80000000u, 0x00000001u, 0x807fffffu, 0x00008000u, 0x00018000u,
                               0x3f808000u, 0x3f818000u, 0x3f80ffffu, 0x7f7fffffu, 0xff7fffffu, 0x7f800000u,
                               0xff800000u, 0x7f800001u, 0xffc12345u, 0x7fffffffu, 0x7fc00000u, 0xff800001u};
  std::mt19937 rng(35);
  for_each_isa([&](Isa) {
    for (bool stream : {false, true})
      for (int64_t cols : {1, 15, 16, 17, 31, 32, 33, 40, 64, 70})
        for (int64_t ldo : {cols + 3, (cols + 15) / 16 * 16 + 16}) {
          SCOPED_TRACE("cols " + std::to_string(cols) + " ldo " + std::to_string(ldo) + (stream ? " streamed" : ""));
          const int64_t rows = 3, ldx = cols + 5;
          std::vector<float> x(static_cast<size_t>(rows * ldx));
          for (size_t i = 0; i < x.size(); ++i) {
            const uint32_t bits = i % 3 == 0 ? specials[(i / 3) % std::size(specials)] : static_cast<uint32_t>(rng());
            x[i] = std::bit_cast<float>(bits);
          }
          std::vector<uint16_t> store(static_cast<size_t>(rows * ldo + 32), 0xdead);
          uint16_t* out = store.data() + (64 - reinterpret_cast<uintptr_t>(store.data()) % 64) % 64 / 2;
          moekit::detail::format_kernels().f32_rows_to_bf16_canonical(x.data(), ldx, rows, cols, out, ldo, stream);
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < ldo; ++c) {
              const uint16_t got = out[r * ldo + c];
              if (c >= cols) {
                EXPECT_EQ(got, 0xdead) << "gap written, row " << r << " col " << c;
                continue;
              }
              const float v = x[static_cast<size_t>(r * ldx + c)];
              const uint16_t want = std::isnan(v) ? uint16_t{0x7fc0} : moekit::f32_to_bf16(v);
              EXPECT_EQ(got, want) << "row " << r << " col " << c << " input 0x" << std::hex
                                   << std::bit_cast<uint32_t>(v);
            }
        }
  });
}

// ---------------------------------------------------------------- bulk decode
TEST(FormatsConvert, DecodeAllCodesEveryIsa) {
  std::vector<uint8_t> codes(256);
  for (unsigned c = 0; c < 256; ++c) codes[c] = static_cast<uint8_t>(c);
  for_each_isa([&](Isa) {
    for (Fmt f : {Fmt::e4m3, Fmt::e5m2}) {
      SCOPED_TRACE(fmt_name(f));
      for (const Shape& shape : {Shape{256}, Shape{16, 16}, Shape{32, 8}, Shape{8, 32}}) {
        const auto f32 = as<float>(convert_bytes(codes.data(), shape, dtype_of(f), shape, DType::f32));
        const auto bf = as<uint16_t>(convert_bytes(codes.data(), shape, dtype_of(f), shape, DType::bf16));
        for (unsigned c = 0; c < 256; ++c) {
          const double want = f == Fmt::e4m3 ? e4m3_expected(c) : e5m2_expected(c);
          EXPECT_TRUE(same_value(f32[c], want)) << "f32 out, code 0x" << std::hex << c;
          EXPECT_TRUE(same_value(bf16_bits_to_float(bf[c]), want)) << "bf16 out, code 0x" << std::hex << c;
        }
      }
      // Short and odd lengths: a window of codes starting at each offset.
      for (int64_t n : {1, 7, 9, 15, 17, 33}) {
        for (int64_t start = 0; start + n <= 256; start += 37) {
          const auto f32 = as<float>(convert_bytes(codes.data() + start, {n}, dtype_of(f), {n}, DType::f32));
          for (int64_t i = 0; i < n; ++i)
            EXPECT_TRUE(same_value(f32[i], f == Fmt::e4m3 ? e4m3_expected(start + i) : e5m2_expected(start + i)))
                << "n=" << n << " code " << start + i;
        }
      }
    }
  });
}

TEST(FormatsConvert, DecodeE2m1AllNibblesEveryIsa) {
  std::vector<uint8_t> packed(256);
  for (unsigned b = 0; b < 256; ++b) packed[b] = static_cast<uint8_t>(b);
  for_each_isa([&](Isa) {
    for (int64_t n : {512, 511, 1, 7, 9, 15, 17, 33}) {
      SCOPED_TRACE("n=" + std::to_string(n));
      const int64_t bytes = (n + 1) / 2;
      const auto f32 = as<float>(convert_bytes(packed.data(), {bytes}, DType::e2m1x2, {n}, DType::f32));
      const auto bf = as<uint16_t>(convert_bytes(packed.data(), {bytes}, DType::e2m1x2, {n}, DType::bf16));
      for (int64_t i = 0; i < n; ++i) {
        const uint8_t byte = packed[i / 2];
        const double want = kE2m1[i % 2 ? byte >> 4 : byte & 0xf];
        EXPECT_TRUE(same_value(f32[i], want)) << "element " << i;
        EXPECT_TRUE(same_value(bf16_bits_to_float(bf[i]), want)) << "bf16 element " << i;
      }
    }
    // 2-D: rows of 5 values, 3 bytes each (the high nibble of each row's last byte unused).
    const auto f32 = as<float>(convert_bytes(packed.data(), {4, 3}, DType::e2m1x2, {4, 5}, DType::f32));
    for (int r = 0; r < 4; ++r)
      for (int c = 0; c < 5; ++c) {
        const uint8_t byte = packed[r * 3 + c / 2];
        EXPECT_TRUE(same_value(f32[r * 5 + c], kE2m1[c % 2 ? byte >> 4 : byte & 0xf])) << r << "," << c;
      }
  });
}

// ---------------------------------------------------------------- bulk encode
TEST(FormatsConvert, EncodeGridValuesAndMidpointsEveryIsa) {
  for_each_isa([&](Isa) {
    for (Fmt f : {Fmt::e4m3, Fmt::e5m2, Fmt::e2m1}) {
      const auto x = interesting_values(f);
      check_encode_f32(f, x, 1, static_cast<int64_t>(x.size()));
      check_encode_lengths(f, x);
    }
  });
}

// 100k f32 values: mostly random sign/exponent/mantissa over the narrow formats' ranges,
// some with short mantissas (exact ties), some arbitrary bit patterns (NaN, inf, f32
// subnormals, huge values).
std::vector<float> random_floats(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<float> out(n);
  for (auto& x : out) {
    const uint64_t r = rng();
    const uint32_t kind = r % 20, sign = (r >> 8) & 1, exponent = 127 - 28 + static_cast<uint32_t>((r >> 9) % 49);
    uint32_t mantissa = static_cast<uint32_t>(r >> 32) & 0x7fffff;
    if (kind == 0) {
      x = float_of(static_cast<uint32_t>(r >> 32));
      continue;
    }
    if (kind == 1) mantissa &= 0x7f0000;  // short mantissa: exact ties for the narrow formats
    x = float_of(sign << 31 | exponent << 23 | mantissa);
  }
  return out;
}

// The scalar encoders (the expectation of the bulk tests) agree with the oracle's
// nearest-value search on random values, the grid values / midpoints and every bf16 value.
TEST(FormatsReference, ScalarEncodeAgreesWithOracleNearest) {
  std::vector<float> x = random_floats(30000, 0xfeed);
  for (Fmt f : {Fmt::e4m3, Fmt::e5m2, Fmt::e2m1}) {
    const auto v = interesting_values(f);
    x.insert(x.end(), v.begin(), v.end());
  }
  for (uint32_t b = 0; b < 0x10000; b += 3) x.push_back(bf16_bits_to_float(static_cast<uint16_t>(b)));
  int64_t bad[4] = {0, 0, 0, 0};
  for (float v : x) {
    const uint8_t e4 = f32_to_e4m3(v), e5 = f32_to_e5m2(v), e2 = f32_to_e2m1(v);
    const uint16_t b = f32_to_bf16(v);
    if (e4 != ref::nearest_e4m3(v) && bad[0]++ == 0) ADD_FAILURE() << "e4m3 of " << hex(bits_of(v)) << ": " << hex(e4);
    if (e5 != ref::nearest_e5m2(v) && bad[1]++ == 0) ADD_FAILURE() << "e5m2 of " << hex(bits_of(v)) << ": " << hex(e5);
    if (e2 != ref::nearest_e2m1(v) && bad[2]++ == 0) ADD_FAILURE() << "e2m1 of " << hex(bits_of(v)) << ": " << hex(e2);
    const bool bf_ok = std::isnan(v) ? bf16_is_nan(b) : b == ref::nearest_bf16(v);
    if (!bf_ok && bad[3]++ == 0) ADD_FAILURE() << "bf16 of " << hex(bits_of(v)) << ": " << hex(b);
  }
  EXPECT_EQ(bad[0] + bad[1] + bad[2] + bad[3], 0) << "mismatches e4m3/e5m2/e2m1/bf16: " << bad[0] << "/" << bad[1]
                                                  << "/" << bad[2] << "/" << bad[3];
}

TEST(FormatsConvert, EncodeRandomF32EveryIsa) {
  const auto x = random_floats(100000, 0x5eed);
  std::vector<std::vector<uint8_t>> first;
  for_each_isa([&](Isa) {
    std::vector<std::vector<uint8_t>> outs;
    for (Fmt f : {Fmt::e4m3, Fmt::e5m2, Fmt::e2m1}) {
      const int64_t n = static_cast<int64_t>(x.size());
      outs.push_back(convert_bytes(x.data(), {n}, DType::f32, {packed_cols(f, n)}, dtype_of(f)));
      EXPECT_TRUE(same_bytes(outs.back(), expected_codes(f, x, 1, n), f == Fmt::e2m1 ? nullptr : &x)) << fmt_name(f);
      check_encode_f32(f, std::vector<float>(x.begin(), x.begin() + 999 * 7), 7, 999);  // odd row length
      check_encode_lengths(f, x);
    }
    if (first.empty()) {
      first = outs;
    } else {
      EXPECT_EQ(outs, first) << "bulk encode differs between ISAs";
    }
  });
}

TEST(FormatsConvert, EncodeAllBf16PatternsEveryIsa) {
  std::vector<uint16_t> x(0x10000);
  for (uint32_t b = 0; b < 0x10000; ++b) x[b] = static_cast<uint16_t>(b);
  for_each_isa([&](Isa) {
    for (Fmt f : {Fmt::e4m3, Fmt::e5m2, Fmt::e2m1}) {
      check_encode_bf16(f, x, 1, 0x10000);
      check_encode_bf16(f, std::vector<uint16_t>(x.begin() + 0x3000, x.begin() + 0x3000 + 33 * 5), 5, 33);
      check_encode_bf16(f, std::vector<uint16_t>(x.begin() + 0x3f00, x.begin() + 0x3f00 + 7), 1, 7);
    }
  });
}

TEST(FormatsConvert, E2m1OddTailHighNibbleIsZero) {
  // Values whose codes have all bits set (-6 -> 0xf) make a missing zero obvious.
  for_each_isa([&](Isa) {
    for (int64_t n : {1, 7, 9, 15, 17, 33}) {
      const std::vector<float> x(static_cast<size_t>(n), -6.0f);
      const auto got = convert_bytes(x.data(), {n}, DType::f32, {(n + 1) / 2}, DType::e2m1x2);
      for (int64_t j = 0; j + 1 < static_cast<int64_t>(got.size()); ++j) EXPECT_EQ(got[j], 0xff) << "n=" << n;
      EXPECT_EQ(got.back(), 0x0f) << "n=" << n;
    }
    // Even index in the low nibble: [0.5, 3] -> 0x51, [-1, 6, 1.5] -> 0x7a 0x03.
    const float a[2] = {0.5f, 3.0f}, b[3] = {-1.0f, 6.0f, 1.5f};
    EXPECT_EQ(convert_bytes(a, {2}, DType::f32, {1}, DType::e2m1x2), std::vector<uint8_t>({0x51}));
    EXPECT_EQ(convert_bytes(b, {3}, DType::f32, {2}, DType::e2m1x2), std::vector<uint8_t>({0x7a, 0x03}));
  });
}

TEST(FormatsConvert, F32Bf16BothWaysEveryIsa) {
  auto x = random_floats(20000, 77);
  for (uint32_t special : {0x7f7f7fffu, 0x7f7f8000u, 0x7f800000u, 0x7fc00000u, 0x7f800001u, 0xff800001u, 0x3f808000u,
                           0x3f818000u, 0x00008000u, 0x80000000u})
    x.push_back(float_of(special));
  for_each_isa([&](Isa) {
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{9}, int64_t{15}, int64_t{17}, int64_t{33}, int64_t{1000},
                      static_cast<int64_t>(x.size())}) {
      SCOPED_TRACE("n=" + std::to_string(n));
      const auto bf = as<uint16_t>(convert_bytes(x.data(), {n}, DType::f32, {n}, DType::bf16));
      const std::vector<float> tail(x.end() - n, x.end());  // the specials are at the end
      const auto bf_tail = as<uint16_t>(convert_bytes(tail.data(), {n}, DType::f32, {n}, DType::bf16));
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(bf[i], f32_to_bf16(x[i])) << "index " << i << " input " << std::hex << bits_of(x[i]);
        ASSERT_EQ(bf_tail[i], f32_to_bf16(tail[i])) << "tail index " << i << " input " << std::hex << bits_of(tail[i]);
      }
      const auto back = as<float>(convert_bytes(bf.data(), {n}, DType::bf16, {n}, DType::f32));
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(bits_of(back[i]), static_cast<uint32_t>(bf[i]) << 16) << i;
    }
  });
}

TEST(FormatsConvert, RejectsBadArguments) {
  const Tensor f = Tensor::zeros({4, 8}, DType::f32);
  EXPECT_THROW(convert(f, Tensor::zeros({4, 7}, DType::e4m3)), Error);
  EXPECT_THROW(convert(f, Tensor::zeros({4, 8}, DType::e2m1x2)), Error);  // packed side must be [4, 4]
  EXPECT_THROW(convert(f, Tensor::zeros({4, 8}, DType::i32)), Error);
  EXPECT_THROW(convert(Tensor::zeros({4, 8}, DType::e4m3), Tensor::zeros({4, 8}, DType::e5m2)), Error);
  EXPECT_THROW(convert(Tensor::zeros({8, 4}, DType::f32).t(), Tensor::zeros({4, 8}, DType::e4m3)), Error);
}

// ---------------------------------------------------------------- ue8m0
TEST(FormatsUe8m0, DecodeCodes) {
  EXPECT_EQ(bits_of(ue8m0_to_f32(0)), 0x00400000u);  // 2^-127, an f32 subnormal
  EXPECT_EQ(ue8m0_to_f32(1), 0x1p-126f);
  EXPECT_EQ(ue8m0_to_f32(127), 1.0f);
  EXPECT_EQ(ue8m0_to_f32(128), 2.0f);
  EXPECT_EQ(ue8m0_to_f32(120), 0x1p-7f);
  EXPECT_EQ(ue8m0_to_f32(254), 0x1p127f);
  EXPECT_TRUE(std::isnan(ue8m0_to_f32(255)));
  for (int c = 0; c < 255; ++c) EXPECT_EQ(ue8m0_to_f32(static_cast<uint8_t>(c)), std::ldexp(1.0f, c - 127)) << c;
}

TEST(FormatsUe8m0, EncodePowersOfTwoRoundTrip) {
  for (int c = 0; c < 255; ++c) EXPECT_EQ(f32_to_ue8m0(std::ldexp(1.0f, c - 127)), c) << "2^" << c - 127;
  EXPECT_EQ(f32_to_ue8m0(1.0f), 127);
  EXPECT_EQ(f32_to_ue8m0(0.25f), 125);
}

TEST(FormatsUe8m0, EncodeRejectsNonPowersOfTwo) {
  for (float x : {3.0f, 0.75f, 1.5f, 1.0000001f, 0.0f, -0.0f, -1.0f, -0.5f, kInff, kNaNf, 0x1p-128f}) {
    try {
      f32_to_ue8m0(x);
      ADD_FAILURE() << "no Error for " << x;
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "power_of_two") << x;
    }
  }
}

TEST(FormatsUe8m0, CeilScalar) {
  EXPECT_EQ(ceil_to_ue8m0(1.0f), 1.0f);
  EXPECT_EQ(ceil_to_ue8m0(1.5f), 2.0f);
  EXPECT_EQ(ceil_to_ue8m0(0.75f), 1.0f);
  EXPECT_EQ(ceil_to_ue8m0(0x1p-20f * 1.1f), 0x1p-19f);
  EXPECT_EQ(ceil_to_ue8m0(448.0f), 512.0f);
  EXPECT_EQ(ceil_to_ue8m0(std::nextafter(1.0f, 2.0f)), 2.0f);
  EXPECT_EQ(ceil_to_ue8m0(std::nextafter(1.0f, 0.0f)), 1.0f);
  EXPECT_EQ(ceil_to_ue8m0(1e-4f / 448.0f), 0x1p-22f);  // the amax floor's scale: 2.23e-7 -> 2^-22
  EXPECT_EQ(ceil_to_ue8m0(0x1p-126f), 0x1p-126f);
  EXPECT_EQ(ceil_to_ue8m0(0x1p100f * 1.5f), 0x1p101f);
  for (float bad : {0.0f, -1.0f, -0.5f, kInff, kNaNf}) EXPECT_THROW(ceil_to_ue8m0(bad), Error) << bad;
}

TEST(FormatsUe8m0, CeilTensor) {
  const float in[6] = {1.0f, 1.5f, 0.75f, 0x1p-20f * 1.1f, 3.0f, 0x1p-30f};
  const float want[6] = {1.0f, 2.0f, 1.0f, 0x1p-19f, 4.0f, 0x1p-30f};
  const Tensor t = Tensor::from_blob(in, {2, 3}, DType::f32);
  const Tensor out = ceil_to_ue8m0(t);
  ASSERT_EQ(out.shape(), Shape({2, 3}));
  ASSERT_EQ(out.dtype(), DType::f32);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(out.data_ptr<float>()[i], want[i]) << i;
  EXPECT_EQ(in[1], 1.5f);  // input untouched
  // A transposed view: the result follows the view's logical order.
  const Tensor tt = ceil_to_ue8m0(t.t());
  ASSERT_EQ(tt.shape(), Shape({3, 2}));
  const Tensor ttc = tt.contiguous();
  for (int r = 0; r < 3; ++r)
    for (int c = 0; c < 2; ++c) EXPECT_EQ(ttc.data_ptr<float>()[r * 2 + c], want[c * 3 + r]) << r << "," << c;
  const float bad[2] = {1.0f, 0.0f};
  EXPECT_THROW(ceil_to_ue8m0(Tensor::from_blob(bad, {1, 2}, DType::f32)), Error);
  EXPECT_THROW(ceil_to_ue8m0(Tensor::zeros({1, 2}, DType::bf16)), Error);
}

uint32_t word_at(const Tensor& packed, int64_t r, int64_t w) {
  return static_cast<uint32_t>(packed.data_ptr<int32_t>()[r * packed.stride(0) + w]);
}

TEST(FormatsUe8m0, PackHandCheckedLayout) {
  // Row 0: 1, 2, 0.5, 2^-10, 4, 2^20 -> exponent bytes 0x7f 0x80 0x7e 0x75 | 0x81 0x93
  // Row 1: 2^-127 is avoided here (see PackAcceptsSmallestCode); 2^127, 2^-126, 1, 1, 1, 8.
  const float sf[12] = {1.0f, 2.0f, 0.5f, 0x1p-10f, 4.0f, 0x1p20f,
                        0x1p127f, 0x1p-126f, 1.0f, 1.0f, 1.0f, 8.0f};
  const Tensor packed = pack_ue8m0_to_int(Tensor::from_blob(sf, {2, 6}, DType::f32));
  ASSERT_EQ(packed.dtype(), DType::i32);
  ASSERT_EQ(packed.shape(), Shape({2, 2}));
  EXPECT_EQ(word_at(packed, 0, 0), 0x757e807fu);
  EXPECT_EQ(word_at(packed, 0, 1), 0x00009381u);  // trailing bytes 0
  EXPECT_EQ(word_at(packed, 1, 0), 0x7f7f01feu);
  EXPECT_EQ(word_at(packed, 1, 1), 0x0000827fu);
  // Byte i of word j is group 4j+i, in memory order.
  const auto* bytes = packed.data_ptr<uint8_t>();
  const uint8_t want_row0[8] = {0x7f, 0x80, 0x7e, 0x75, 0x81, 0x93, 0x00, 0x00};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(bytes[i], want_row0[i]) << "byte " << i;

  const Tensor back = unpack_ue8m0_from_int(packed, 6);
  ASSERT_EQ(back.shape(), Shape({2, 6}));
  for (int i = 0; i < 12; ++i) EXPECT_EQ(back.data_ptr<float>()[i], sf[i]) << i;
  const Tensor all = unpack_ue8m0_from_int(packed);
  ASSERT_EQ(all.shape(), Shape({2, 8}));
  EXPECT_EQ(all.data_ptr<float>()[5], 0x1p20f);
  EXPECT_EQ(all.data_ptr<float>()[6], 0x1p-127f);  // trailing byte 0 -> 2^-127
  EXPECT_EQ(all.data_ptr<float>()[15], 0x1p-127f);
}

TEST(FormatsUe8m0, PackUnpackRoundTripOddGroupCounts) {
  std::mt19937 rng(3);
  for (int64_t groups : {1, 3, 4, 5, 6, 7, 8, 9, 13}) {
    SCOPED_TRACE("groups=" + std::to_string(groups));
    const int64_t rows = 3;
    std::vector<float> sf(static_cast<size_t>(rows * groups));
    for (auto& s : sf) s = std::ldexp(1.0f, static_cast<int>(rng() % 254) - 126);  // 2^-126 .. 2^127
    const Tensor packed = pack_ue8m0_to_int(Tensor::from_blob(sf.data(), {rows, groups}, DType::f32));
    ASSERT_EQ(packed.shape(), Shape({rows, (groups + 3) / 4}));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < 4 * packed.size(1); ++g) {
        const uint32_t byte = (word_at(packed, r, g / 4) >> (8 * (g % 4))) & 0xff;
        const uint32_t want = g < groups ? (bits_of(sf[r * groups + g]) >> 23) : 0;
        EXPECT_EQ(byte, want) << "row " << r << " group " << g;
      }
    const Tensor back = unpack_ue8m0_from_int(packed, groups);
    ASSERT_EQ(back.shape(), Shape({rows, groups}));
    for (size_t i = 0; i < sf.size(); ++i) EXPECT_EQ(back.data_ptr<float>()[i], sf[i]) << i;
  }
}

TEST(FormatsUe8m0, PackStridedInput) {
  float wide[2][8] = {{1, 2, 4, 8, 16, -1, -1, -1}, {0.5f, 0.25f, 1, 1, 1, -1, -1, -1}};
  const Tensor view = Tensor::from_blob(&wide[0][0], {2, 8}, DType::f32).slice(1, 0, 5);
  const Tensor packed = pack_ue8m0_to_int(view);
  ASSERT_EQ(packed.shape(), Shape({2, 2}));
  EXPECT_EQ(word_at(packed, 0, 0), 0x8281807fu);
  EXPECT_EQ(word_at(packed, 0, 1), 0x00000083u);
  EXPECT_EQ(word_at(packed, 1, 0), 0x7f7f7d7eu);
  EXPECT_EQ(word_at(packed, 1, 1), 0x0000007fu);
}

TEST(FormatsUe8m0, PackRejectsNonPowersOfTwo) {
  for (float bad : {3.0f, 1.5f, 0.0f, -2.0f, -0.0f, kInff, kNaNf, 0x1p-127f * 3.0f}) {
    const float sf[5] = {1.0f, 2.0f, 4.0f, 8.0f, bad};
    try {
      pack_ue8m0_to_int(Tensor::from_blob(sf, {1, 5}, DType::f32));
      ADD_FAILURE() << "no Error for " << bad;
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "sf") << bad;
    }
  }
  EXPECT_THROW(pack_ue8m0_to_int(Tensor::zeros({2, 4}, DType::bf16)), Error);
  EXPECT_THROW(pack_ue8m0_to_int(Tensor::zeros({8}, DType::f32)), Error);
  const Tensor packed = Tensor::zeros({2, 2}, DType::i32);
  EXPECT_THROW(unpack_ue8m0_from_int(packed, 9), Error);
  EXPECT_THROW(unpack_ue8m0_from_int(packed, 4), Error);
  EXPECT_THROW(unpack_ue8m0_from_int(Tensor::zeros({2, 2}, DType::f32)), Error);
}

// ue8m0 code 0 is 2^-127 (formats.md: 2^(e-127), e in 0..254), which f32_to_ue8m0 accepts
// and unpack produces; pack must round-trip it too.
TEST(FormatsUe8m0, PackAcceptsSmallestCode) {
  const float sf[2] = {0x1p-127f, 1.0f};
  ASSERT_EQ(f32_to_ue8m0(sf[0]), 0);
  Tensor packed;
  ASSERT_NO_THROW(packed = pack_ue8m0_to_int(Tensor::from_blob(sf, {1, 2}, DType::f32)));
  EXPECT_EQ(word_at(packed, 0, 0), 0x00007f00u);
}

// ---------------------------------------------------------------- ISA coverage
TEST(FormatsIsa, Avx512PathRunsOrIsReportedSkipped) {
  if (!isa_supported(Isa::avx512))
    GTEST_SKIP() << "AVX-512 format kernels could NOT be run on this CPU (no AVX-512F/BW/VL/DQ); only "
                 << moekit::testing::supported_isas().size() << " ISA path(s) tested";
  // When supported, every for_each_isa test above ran it; check a value here too.
  ScopedIsa scoped(Isa::avx512);
  const float x[3] = {1.0f, 448.0f, 1e9f};
  EXPECT_EQ(convert_bytes(x, {3}, DType::f32, {3}, DType::e4m3), std::vector<uint8_t>({0x38, 0x7e, 0x7e}));
}

TEST(FormatsIsa, SupportedIsasIncludeScalarAndRunnableAvx2) {
  const auto isas = moekit::testing::supported_isas();
  ASSERT_FALSE(isas.empty());
  EXPECT_EQ(isas.front(), Isa::scalar);
  if (cpu_features().avx2 && cpu_features().fma && cpu_features().f16c) {
    EXPECT_NE(std::find(isas.begin(), isas.end(), Isa::avx2), isas.end());
  }
}

}  // namespace
}  // namespace moekit

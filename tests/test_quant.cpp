// Quantisation casts (formats.md "Casts"): per-token / per-block / per-channel FP8 and
// per-token FP4 against the f64 oracle bit-exactly under every ISA, strided views and the
// "_into" forms, thread-count determinism, dequantisation (cast_back_*), error bounds,
// calc_diff, and argument validation.
#include <gtest/gtest.h>

#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "moekit/error.h"
#include "moekit/formats.h"
#include "moekit/runtime.h"
#include "moekit/tensor.h"
#include "cpu/formats/format_kernels.h"
#include "reference.h"
#include "test_util.h"

namespace moekit {
namespace {

using Bytes = std::vector<uint8_t>;

uint32_t bits_of(float x) { return std::bit_cast<uint32_t>(x); }
float float_of(uint32_t b) { return std::bit_cast<float>(b); }
std::string hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

using moekit::testing::for_each_isa;

// Restores the thread count on scope exit.
struct ThreadGuard {
  int previous = num_threads();
  ~ThreadGuard() { set_num_threads(previous); }
};

// ---------------------------------------------------------------- inputs
// e4m3 / e2m1 midpoints (values halfway between neighbouring codes), hand-listed.
const std::vector<float> kE4m3Midpoints = {0x1p-10f, 3 * 0x1p-10f, 15 * 0x1p-10f, 1.0625f, 1.1875f, 1.9375f,
                                           2.125f,   3.75f,        13.0f,         104.0f,  432.0f,  0.46875f};
const std::vector<float> kE2m1Midpoints = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};

// Row kinds: 0 normal with per-element exponent spread (many e4m3 subnormals), 1 all
// zero, 2 one huge value, 3 exact e4m3 ties (amax 56 at every 8th column, so per-group
// sf = 56/448 = 0.125 and x/sf lands on midpoints), 4 exact e2m1 ties (amax 1.5 -> sf 0.25
// for fp4), 5 mixed signs with -0 and tiny f32 subnormals.
int row_kind(int64_t r, int64_t m, uint64_t seed) {
  if (m > 2 && r == 1) return 1;
  if (m > 2 && r == 2) return 2;
  static constexpr int kCycle[4] = {0, 3, 4, 5};
  return kCycle[(r + seed) % 4];
}

// An f32 [m, k] input (rows per row_kind), deterministic in seed.
Tensor make_input(int64_t m, int64_t k, uint64_t seed) {
  Tensor t = Tensor::empty({m, k}, DType::f32);
  std::mt19937_64 rng(seed * 7919 + static_cast<uint64_t>(m * 131 + k));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> spread(-8, 8), row_scale(-14, 14);
  for (int64_t r = 0; r < m; ++r) {
    float* row = t.data_ptr<float>() + r * k;
    const int kind = row_kind(r, m, seed);
    const float scale = std::ldexp(1.0f, row_scale(rng));
    for (int64_t c = 0; c < k; ++c) {
      const float sign = rng() & 1 ? -1.0f : 1.0f;
      switch (kind) {
        case 0: row[c] = normal(rng) * std::ldexp(scale, spread(rng)); break;
        case 1: row[c] = 0.0f; break;
        case 2: row[c] = normal(rng) * scale; break;
        case 3: row[c] = sign * (c % 8 == 0 ? 56.0f : kE4m3Midpoints[rng() % kE4m3Midpoints.size()] * 0.125f); break;
        case 4: row[c] = sign * (c % 8 == 0 ? 1.5f : kE2m1Midpoints[rng() % kE2m1Midpoints.size()] * 0.25f); break;
        default: {
          const uint64_t pick = rng() % 4;
          row[c] = pick == 0 ? -0.0f : pick == 1 ? sign * 1e-40f : normal(rng) * scale;
        }
      }
    }
    if (kind == 2) row[static_cast<size_t>(rng() % static_cast<uint64_t>(k))] = 1e30f;
  }
  return t;
}

// bf16 copy by truncation (every value exactly representable; the ties rows survive).
Tensor to_bf16(const Tensor& f32) {
  Tensor out = Tensor::empty(f32.shape(), DType::bf16);
  for (int64_t i = 0; i < f32.numel(); ++i)
    out.data_ptr<uint16_t>()[i] = static_cast<uint16_t>(bits_of(f32.data_ptr<float>()[i]) >> 16);
  return out;
}

Tensor with_dtype(const Tensor& f32, DType dtype) { return dtype == DType::bf16 ? to_bf16(f32) : f32; }

// ---------------------------------------------------------------- comparisons
// The logical bytes of a 2-D tensor with a unit last stride (rows may be strided).
Bytes logical_bytes(const Tensor& t) {
  const int64_t row_bytes = t.size(1) * static_cast<int64_t>(t.element_size());
  Bytes out;
  out.reserve(static_cast<size_t>(t.size(0) * row_bytes));
  for (int64_t r = 0; r < t.size(0); ++r) {
    const auto* p = static_cast<const uint8_t*>(t.data()) + r * t.stride(0) * static_cast<int64_t>(t.element_size());
    out.insert(out.end(), p, p + row_bytes);
  }
  return out;
}

::testing::AssertionResult same_tensor_bytes(const char* what, const Tensor& got, const Tensor& want) {
  if (got.shape() != want.shape() || got.dtype() != want.dtype())
    return ::testing::AssertionFailure() << what << ": got " << got.str() << ", want " << want.str();
  const Bytes g = logical_bytes(got), w = logical_bytes(want);
  const int64_t es = static_cast<int64_t>(got.element_size());
  const int64_t row_bytes = got.size(1) * es;
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < g.size(); ++i)
    if (g[i] != w[i] && bad++ == 0) first = i;
  if (bad == 0) return ::testing::AssertionSuccess();
  const int64_t r = static_cast<int64_t>(first) / row_bytes, c = (static_cast<int64_t>(first) % row_bytes) / es;
  auto result = ::testing::AssertionFailure();
  result << what << ": " << bad << " of " << g.size() << " bytes differ; first at [" << r << ", " << c << "]: ";
  if (got.dtype() == DType::f32) {
    float a, b;
    std::memcpy(&a, g.data() + r * row_bytes + c * es, 4);
    std::memcpy(&b, w.data() + r * row_bytes + c * es, 4);
    result << "got " << a << " (" << hex(bits_of(a)) << "), want " << b << " (" << hex(bits_of(b)) << ")";
  } else {
    result << "got " << hex(g[first]) << ", want " << hex(w[first]);
  }
  return result;
}

::testing::AssertionResult same_quantized(const Quantized& got, const Quantized& want) {
  auto q = same_tensor_bytes("values", got.values, want.values);
  if (!q) return q;
  return same_tensor_bytes("sf", got.sf, want.sf);
}

// ---------------------------------------------------------------- the casts under test
enum class Cast { token_fp8, block_fp8, channel_fp8, token_fp4 };
const char* cast_name(Cast c) {
  switch (c) {
    case Cast::token_fp8: return "per_token_cast_to_fp8";
    case Cast::block_fp8: return "per_block_cast_to_fp8";
    case Cast::channel_fp8: return "per_channel_cast_to_fp8";
    case Cast::token_fp4: return "per_token_cast_to_fp4";
  }
  return "?";
}

// (rows, cols) of the input and the scale grid parameters (gran; block_m for per block).
struct Case {
  int64_t m, k, gran, block_m = 128;
};
std::string describe(Cast cast, const Case& c, DType dtype, bool ue8m0) {
  return std::string(cast_name(cast)) + " x=" + dtype_name(dtype) + "[" + std::to_string(c.m) + ", " +
         std::to_string(c.k) + "] gran=" + std::to_string(c.gran) +
         (cast == Cast::block_fp8 ? " block_m=" + std::to_string(c.block_m) : "") + " ue8m0=" + (ue8m0 ? "1" : "0");
}

Quantized run_cast(Cast cast, const Tensor& x, bool ue8m0, const Case& c) {
  switch (cast) {
    case Cast::token_fp8: return per_token_cast_to_fp8(x, ue8m0, c.gran);
    case Cast::block_fp8: return per_block_cast_to_fp8(x, ue8m0, c.block_m, c.gran);
    case Cast::channel_fp8: return per_channel_cast_to_fp8(x, ue8m0, c.gran);
    case Cast::token_fp4: return per_token_cast_to_fp4(x, ue8m0, c.gran);
  }
  return {};
}

Quantized run_ref(Cast cast, const Tensor& x, bool ue8m0, const Case& c) {
  switch (cast) {
    case Cast::token_fp8: return ref::per_token_cast_to_fp8(x, ue8m0, c.gran);
    case Cast::block_fp8: return ref::per_block_cast_to_fp8(x, ue8m0, c.block_m, c.gran);
    case Cast::channel_fp8: return ref::per_channel_cast_to_fp8(x, ue8m0, c.gran);
    case Cast::token_fp4: return ref::per_token_cast_to_fp4(x, ue8m0, c.gran);
  }
  return {};
}

void run_into(Cast cast, const Tensor& x, const Tensor& q, const Tensor& sf, bool ue8m0, const Case& c) {
  switch (cast) {
    case Cast::token_fp8: return per_token_cast_to_fp8_into(x, q, sf, ue8m0, c.gran);
    case Cast::block_fp8: return per_block_cast_to_fp8_into(x, q, sf, ue8m0, c.block_m, c.gran);
    case Cast::channel_fp8: return per_channel_cast_to_fp8_into(x, q, sf, ue8m0, c.gran);
    case Cast::token_fp4: return per_token_cast_to_fp4_into(x, q, sf, ue8m0, c.gran);
  }
}

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Expected output shapes, from formats.md / formats.h.
Shape values_shape(Cast cast, const Case& c) { return {c.m, cast == Cast::token_fp4 ? cdiv(c.k, 2) : c.k}; }
Shape sf_shape(Cast cast, const Case& c) {
  switch (cast) {
    case Cast::block_fp8: return {cdiv(c.m, c.block_m), cdiv(c.k, c.gran)};
    case Cast::channel_fp8: return {cdiv(c.m, c.gran), c.k};
    default: return {c.m, cdiv(c.k, c.gran)};
  }
}

// The "_into" form on outputs filled with a sentinel first, so that an element a kernel
// forgets to write cannot pass for right (freshly allocated memory may hold the previous
// call's correct bytes).
Quantized run_cast_poisoned(Cast cast, const Tensor& x, bool ue8m0, const Case& c) {
  Quantized out{Tensor::empty(values_shape(cast, c), cast == Cast::token_fp4 ? DType::e2m1x2 : DType::e4m3),
                Tensor::empty(sf_shape(cast, c), DType::f32)};
  std::memset(out.values.data(), 0x5a, static_cast<size_t>(out.values.numel()));
  std::memset(out.sf.data(), 0xff, static_cast<size_t>(out.sf.numel()) * 4);
  run_into(cast, x, out.values, out.sf, ue8m0, c);
  return out;
}

// Both forms against the oracle, under every ISA.
void expect_oracle_under_every_isa(Cast cast, const Tensor& x, bool ue8m0, const Case& c) {
  const Quantized want = run_ref(cast, x, ue8m0, c);
  for_each_isa([&](Isa) {
    EXPECT_TRUE(same_quantized(run_cast(cast, x, ue8m0, c), want));
    EXPECT_TRUE(same_quantized(run_cast_poisoned(cast, x, ue8m0, c), want));
  });
}

// Library vs oracle, bit-exact, for f32 and bf16 inputs, both scale modes, every ISA.
void check_against_oracle(Cast cast, const std::vector<Case>& cases) {
  uint64_t seed = 0;
  for (const Case& c : cases) {
    const Tensor x32 = make_input(c.m, c.k, ++seed);
    for (DType dtype : {DType::f32, DType::bf16}) {
      const Tensor x = with_dtype(x32, dtype);
      for (bool ue8m0 : {false, true}) {
        SCOPED_TRACE(describe(cast, c, dtype, ue8m0));
        const Quantized want = run_ref(cast, x, ue8m0, c);
        ASSERT_EQ(want.sf.shape(), sf_shape(cast, c));
        for_each_isa([&](Isa) {
          const Quantized got = run_cast(cast, x, ue8m0, c);
          ASSERT_EQ(got.values.dtype(), cast == Cast::token_fp4 ? DType::e2m1x2 : DType::e4m3);
          ASSERT_EQ(got.values.shape(), values_shape(cast, c));
          ASSERT_EQ(got.sf.dtype(), DType::f32);
          ASSERT_EQ(got.sf.shape(), sf_shape(cast, c));
          EXPECT_TRUE(same_quantized(got, want));
          EXPECT_TRUE(same_quantized(run_cast_poisoned(cast, x, ue8m0, c), want));
        });
      }
    }
  }
}

// ---------------------------------------------------------------- oracle comparisons
TEST(QuantOracle, PerTokenFp8) {
  check_against_oracle(Cast::token_fp8, {{1, 1, 128},    {1, 7, 128},    {3, 7, 32},     {1, 1000, 128},
                                         {3, 100, 64},   {3, 130, 128},  {3, 300, 32},   {129, 130, 128},
                                         {129, 300, 64}, {257, 100, 32}, {257, 7, 128},  {3, 1000, 32},
                                         {3, 1000, 64}});
}

TEST(QuantOracle, PerBlockFp8) {
  check_against_oracle(Cast::block_fp8, {{1, 7, 128, 128},
                                         {3, 300, 128, 128},
                                         {129, 130, 128, 128},
                                         {257, 100, 128, 128},
                                         {100, 130, 64, 32},
                                         {257, 33, 32, 64},
                                         {3, 1000, 128, 128}});
}

TEST(QuantOracle, PerChannelFp8) {
  // x is [K, MN] here: one scale per column per gran rows.
  check_against_oracle(Cast::channel_fp8, {{1, 7, 128},    {130, 3, 128},  {300, 33, 64}, {129, 100, 32},
                                           {1000, 3, 128}, {257, 40, 128}, {7, 1000, 32}, {3, 1, 128}});
}

// Per-block and per-channel casts work in column strips where the L2 holds a group's rows
// (format_kernels.h: set_cast_strip_budget); a 256 KiB budget forces them on any machine:
// 4096 bf16 / 2048 f32 columns per strip for 32-row groups (8192 / 4096 for 16 rows), with a
// partial last strip, partial groups and a block width that is not a power of two. (Small
// groups of rows keep the f64 oracle's share of the test time low.)
TEST(QuantOracle, ColumnStrips) {
  struct Budget {
    int64_t previous = detail::set_cast_strip_budget(int64_t{256} << 10);
    ~Budget() { detail::set_cast_strip_budget(previous); }
  } budget;
  check_against_oracle(Cast::block_fp8, {{40, 4500, 128, 32}, {33, 4500, 96, 32}});
  check_against_oracle(Cast::channel_fp8, {{40, 4500, 32}, {20, 8300, 16}});
}

TEST(QuantOracle, PerTokenFp4) {
  check_against_oracle(Cast::token_fp4, {{1, 1, 32},     {1, 7, 32},    {3, 100, 32},   {3, 130, 64},
                                         {3, 300, 128},  {129, 130, 32}, {257, 100, 32}, {129, 1000, 32},
                                         {3, 1000, 64},  {257, 7, 32},  {3, 99, 16},    {5, 33, 2},
                                         {1, 1000, 128}, {129, 300, 64}});
}

// bf16 rows under power-of-two scales take a 16-bit path (formats_simd.inc: bf16_pow2_codes)
// for gran = 32·2^j, in chunks of 1024 elements: group sizes on and off it, groups larger
// than a chunk, and extents that leave a tail for the general path.
TEST(QuantOracle, PerTokenFp4PowerOfTwoGroupSizes) {
  check_against_oracle(Cast::token_fp4, {{3, 4096, 256}, {2, 5000, 2048}, {3, 700, 96}, {5, 1100, 32}, {3, 2112, 512}});
}

// Scales that are powers of two only for the first chunk of each row (amax 1.5 -> sf 0.25
// without ue8m0): the 16-bit path stops where the first other scale appears and the general
// path finishes the row; both halves must match the oracle, ties included.
TEST(QuantOracle, PerTokenFp4PowerOfTwoScalesThenOthers) {
  const int64_t m = 4, k = 3000;
  Tensor x = Tensor::empty({m, k}, DType::bf16);
  std::mt19937_64 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < k; ++c) {
      const float sign = rng() & 1 ? -1.0f : 1.0f;
      const float v = c < 1100 + 300 * r ? sign * (c % 8 == 0 ? 1.5f : kE2m1Midpoints[rng() % kE2m1Midpoints.size()] * 0.25f)
                                         : normal(rng);
      x.data_ptr<uint16_t>()[r * k + c] = static_cast<uint16_t>(bits_of(v) >> 16);
    }
  const Case c{m, k, 32};
  for (bool ue8m0 : {false, true}) {
    SCOPED_TRACE(describe(Cast::token_fp4, c, DType::bf16, ue8m0));
    expect_oracle_under_every_isa(Cast::token_fp4, x, ue8m0, c);
  }
}

// Every bf16 magnitude pattern up to the format's max (6 or 448), each sign, with the group
// scale 2^k for several k (amax pinned by one element per group, so sf = 2^k with f32 and
// with ue8m0 scales): every rounding boundary and its neighbours, the e4m3 subnormals (left
// to the general path by the 16-bit kernel), the largest shifts either way, and patterns far
// below the least code.
void check_every_bf16_pattern(Cast cast, float max_value, int64_t gran, std::initializer_list<int> exponents) {
  std::vector<uint16_t> patterns;
  for (uint32_t p = 0; p <= (bits_of(max_value) >> 16); ++p) patterns.push_back(static_cast<uint16_t>(p));
  const int64_t per_group = gran - 1;  // element 0 of each group holds its amax
  const int64_t groups = static_cast<int64_t>(2 * patterns.size() + per_group - 1) / per_group;
  for (int k : exponents) {
    SCOPED_TRACE("sf = 2^" + std::to_string(k));
    Tensor x = Tensor::empty({1, groups * gran}, DType::bf16);
    uint16_t* p = x.data_ptr<uint16_t>();
    const float amax = std::ldexp(max_value, k);  // sf = amax / max = 2^k exactly
    int64_t next = 0;
    for (int64_t g = 0; g < groups; ++g) {
      p[g * gran] = static_cast<uint16_t>(bits_of(amax) >> 16);
      for (int64_t i = 1; i < gran; ++i, ++next) {
        const int64_t at = next % static_cast<int64_t>(2 * patterns.size());
        const uint16_t mag = patterns[static_cast<size_t>(at / 2)];
        // x / 2^k has the pattern's value: add k to the exponent field (exact; patterns that
        // would leave the normal range are kept as they are, all far below the least code).
        const int32_t shifted = mag >= 0x0080 ? mag + k * 128 : mag;
        const uint16_t v = static_cast<uint16_t>(shifted >= 0x0080 && shifted < 0x7f80 ? shifted : mag);
        p[g * gran + i] = static_cast<uint16_t>(v | (at % 2 ? 0x8000 : 0));
      }
    }
    const Case c{1, groups * gran, gran};
    for (bool ue8m0 : {false, true}) expect_oracle_under_every_isa(cast, x, ue8m0, c);
  }
}

TEST(QuantOracle, PerTokenFp4EveryBf16PatternUnderPowerOfTwoScales) {
  check_every_bf16_pattern(Cast::token_fp4, 6.0f, 32, {-15, -1, 0, 7, 100, 125});  // 6·2^125 < FLT_MAX
}

TEST(QuantOracle, PerTokenFp8EveryBf16PatternUnderPowerOfTwoScales) {
  check_every_bf16_pattern(Cast::token_fp8, 448.0f, 128, {-20, -1, 0, 5, 100, 119});  // 448·2^119 < FLT_MAX
  check_every_bf16_pattern(Cast::token_fp8, 448.0f, 32, {3});
}

// FP4 casts of bf16 may count per-scale thresholds (formats_avx512.cpp: e2m1_thresholds):
// every magnitude pattern within 10 binades below the group's amax, each sign, under the
// scales sf = RN(amax / 6) of 256 amaxes (every bf16 mantissa at two exponents). Among them,
// x = amax / 8 sits within an f32 ulp of the 0.75 boundary, on either side depending on how
// amax / 6 rounded: the boundary's half-ulp rule decides its code.
TEST(QuantOracle, PerTokenFp4EveryBf16PatternUnderArbitraryScales) {
  const int64_t gran = 32, per_group = gran - 1;
  std::vector<uint16_t> values;
  for (int e : {0, -3})
    for (int j = 0; j < 128; ++j) {
      const uint16_t amax = static_cast<uint16_t>((0x81 + e) << 7 | j);  // 6·2^e·(1 + j/128)/1.5
      std::vector<uint16_t> patterns;
      for (int32_t p = amax - 0x500; p <= amax; ++p) patterns.insert(patterns.end(), {static_cast<uint16_t>(p), static_cast<uint16_t>(p | 0x8000)});
      for (size_t at = 0; at < patterns.size(); at += per_group) {
        values.push_back(amax);
        for (size_t i = at; i < at + per_group; ++i) values.push_back(i < patterns.size() ? patterns[i] : amax);
      }
    }
  Tensor x = Tensor::empty({1, static_cast<int64_t>(values.size())}, DType::bf16);
  std::copy(values.begin(), values.end(), x.data_ptr<uint16_t>());
  const Case c{1, x.size(1), gran};
  for (bool ue8m0 : {false, true}) {
    SCOPED_TRACE(describe(Cast::token_fp4, c, DType::bf16, ue8m0));
    expect_oracle_under_every_isa(Cast::token_fp4, x, ue8m0, c);
  }
}

// Per-block casts of bf16 may run on per-scale code tables (formats_avx512.cpp:
// e4m3_tables): every magnitude pattern within 26 binades below the block's amax (past the
// zero region), each sign, plus a few tiny ones, under scales with arbitrary mantissas
// (amax = 2^(8+e)·(1 + j/128): sf = amax/448 = 2^k·f with f from 1 to 1.99) from 2^-12 to 2^118,
// beyond the tables' range at the top. Blocks of 4 rows x 128 columns, element 0 the amax.
TEST(QuantOracle, PerBlockFp8EveryBf16PatternUnderArbitraryScales) {
  const int64_t block_m = 4, gran = 128, per_block = block_m * gran - 1;
  std::vector<uint16_t> amaxes;
  for (int e : {-20, 0, 7, 91, 110})
    for (int j : {0x01, 0x2d, 0x5f, 0x60, 0x7f}) amaxes.push_back(static_cast<uint16_t>((0x87 + e) << 7 | j));
  std::vector<std::vector<uint16_t>> contents;  // per block: amax then its patterns
  for (uint16_t amax : amaxes) {
    std::vector<uint16_t> patterns = {0x0000, 0x0001, 0x007f, 0x0080, 0x0100};
    for (int32_t p = std::max<int32_t>(0x0101, amax - 0x0d00); p <= amax; ++p) patterns.push_back(static_cast<uint16_t>(p));
    std::vector<uint16_t> values;
    for (uint16_t p : patterns) values.insert(values.end(), {p, static_cast<uint16_t>(p | 0x8000)});
    for (size_t at = 0; at < values.size(); at += per_block) {
      std::vector<uint16_t> block = {amax};
      for (size_t i = at; i < std::min(values.size(), at + per_block); ++i) block.push_back(values[i]);
      while (static_cast<int64_t>(block.size()) < block_m * gran) block.push_back(0x3f80);  // 1.0
      contents.push_back(std::move(block));
    }
  }
  // The same scales with the tables' region edges (x / 2^k patterns around 0x3a80, half the
  // least subnormal, and 0x3d00, 2^-5), each alone among normal values in its 64-element
  // step: a step holding any lane between the two goes wholly to the general kernel, which
  // would hide a wrong edge in a step shared with such a lane.
  for (uint16_t amax : amaxes) {
    int k = 0;
    std::frexp(bf16_to_f32(amax) / 448.0f, &k);
    k -= 1;  // sf = 2^k·f, 1 <= f < 2
    std::vector<int32_t> edges;
    for (int32_t p = 0x3a70; p <= 0x3a90; ++p) edges.push_back(p);
    for (int32_t p = 0x3c70; p <= 0x3d10; ++p) edges.push_back(p);
    for (size_t at = 0; at < edges.size(); at += block_m * gran / 64) {
      std::vector<uint16_t> block(static_cast<size_t>(block_m * gran), static_cast<uint16_t>(amax - 0x0100));
      block[0] = amax;
      for (size_t e = at; e < std::min(edges.size(), at + block_m * gran / 64); ++e) {
        const size_t step = e - at;
        block[step * 64 + 1 + step % 63] = static_cast<uint16_t>((edges[e] + k * 128) | (e % 2 ? 0x8000 : 0));
      }
      contents.push_back(std::move(block));
    }
  }
  const int64_t blocks = static_cast<int64_t>(contents.size());
  Tensor x = Tensor::empty({block_m, blocks * gran}, DType::bf16);
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t i = 0; i < block_m * gran; ++i) x.data_ptr<uint16_t>()[(i / gran) * blocks * gran + b * gran + i % gran] = contents[b][i];
  const Case c{block_m, blocks * gran, gran, block_m};
  for (bool ue8m0 : {false, true}) {
    SCOPED_TRACE(describe(Cast::block_fp8, c, DType::bf16, ue8m0));
    expect_oracle_under_every_isa(Cast::block_fp8, x, ue8m0, c);
  }
}

// Calls a bf16 quantize kernel of every ISA directly with scales_from_amax, against the scalar
// kernel (which divides): codes of x (n elements, groups of gran) under sf, plain and streamed.
void expect_kernels_match_scalar(detail::Narrow fmt, const std::vector<uint16_t>& x, const std::vector<float>& sf, int64_t gran) {
  const int64_t n = static_cast<int64_t>(x.size()), bytes = fmt == detail::Narrow::e2m1 ? (n + 1) / 2 : n;
  const int f = static_cast<int>(fmt), bf16 = static_cast<int>(detail::Wide::bf16);
  std::vector<uint8_t> want(static_cast<size_t>(bytes)), got(static_cast<size_t>(bytes));
  detail::format_kernels(Isa::scalar).quantize[f][bf16](x.data(), want.data(), n, sf.data(), gran, false, nullptr, true,
                                                        detail::Reciprocals{});
  for (Isa isa : moekit::testing::supported_isas())
    for (bool stream : {false, true}) {
      SCOPED_TRACE(::testing::Message() << isa_name(isa) << (stream ? " streamed" : ""));
      std::fill(got.begin(), got.end(), uint8_t{0x55});
      detail::format_kernels(isa).quantize[f][bf16](x.data(), got.data(), n, sf.data(), gran, stream, nullptr, true,
                                                    detail::Reciprocals{});
      int64_t wrong = 0, first = -1;
      for (int64_t i = 0; i < bytes; ++i)
        if (got[i] != want[i]) wrong += 1, first = first < 0 ? i : first;
      EXPECT_EQ(wrong, 0) << "first at byte " << first;
    }
}

// The e4m3 kernels of bf16 under f32 scales from their amax (the per-token casts' path; on
// AVX2, per-group thresholds: formats_avx2.cpp) on every bf16 magnitude up to 448·sf, both
// signs: under scales 2^k·f whose quotient RN(8 / f) is an e4m3 rounding tie (4.25, 4.75, ...,
// 7.75: the thresholds' base code must round it to even), and under f = 1 and the largest
// mantissa. Casts of bf16 never give such scales (sf = RN(amax / 448) with an 8-bit amax), so
// only a direct call reaches them. Groups of 128, 192 (three per threshold batch of 64-element
// steps) and 4160 (past the kernel's 4096-element calls), the last one partial.
TEST(QuantKernels, E4m3OfBf16UnderScalesWhoseBaseQuotientIsATie) {
  const uint32_t tie_mantissas[] = {0x3ff0f0f1u, 0x3fd79436u, 0x3fc30c31u, 0x3fb21643u,  // RN(8 / f) = 4.25 ... 5.75
                                    0x3fa3d70au, 0x3f97b426u, 0x3f8d3dcbu, 0x3f842108u,  // 6.25 ... 7.75
                                    0x3f800000u, 0x3fffffffu};
  for (const int64_t gran : {128, 192, 4160})
    for (const uint32_t mantissa : tie_mantissas)
      for (const int k : {0, -10, 40}) {
        const float sf = std::bit_cast<float>(mantissa + static_cast<uint32_t>(k * (1 << 23)));
        SCOPED_TRACE(::testing::Message() << "gran=" << gran << " sf=" << sf);
        std::vector<uint16_t> x;
        const uint32_t top = std::bit_cast<uint32_t>(448.0f * sf) >> 16;  // |x| <= 448·sf (bf16 truncation)
        for (uint32_t p = 0; p <= top; ++p) x.insert(x.end(), {static_cast<uint16_t>(p), static_cast<uint16_t>(p | 0x8000)});
        x.resize((x.size() + gran - 1) / gran * gran - gran / 2, 0);  // (the last group half full)
        expect_kernels_match_scalar(detail::Narrow::e4m3, x, std::vector<float>(x.size() / gran + 1, sf), gran);
      }
}

// bf16 subnormal (and tiny normal) inputs under the least power-of-two scales, where x / 2^k
// is no longer |x|'s pattern minus k << 7: the 16-bit and staircase paths must leave such
// scales to the general kernel. e4m3 and e2m1, groups of 32, 64 and 128.
TEST(QuantKernels, SubnormalInputsUnderTheLeastPowerOfTwoScales) {
  for (const auto fmt : {detail::Narrow::e4m3, detail::Narrow::e2m1})
    for (const int64_t gran : {32, 64, 128})
      for (const int k : {-126, -125, -121, -117, -101, -100, -99}) {
        SCOPED_TRACE(::testing::Message() << "fmt=" << static_cast<int>(fmt) << " gran=" << gran << " k=" << k);
        const float sf = std::ldexp(1.0f, k), bound = (fmt == detail::Narrow::e2m1 ? 6.0f : 448.0f) * sf;
        std::vector<uint16_t> x;
        for (uint32_t p = 0; std::bit_cast<float>(p << 16) <= bound; ++p) x.insert(x.end(), {static_cast<uint16_t>(p), static_cast<uint16_t>(p | 0x8000)});
        x.resize((x.size() + gran - 1) / gran * gran, 0);
        expect_kernels_match_scalar(fmt, x, std::vector<float>(x.size() / gran, sf), gran);
      }
}

// The e4m3 byte-lane kernels' edges one at a time, each alone among normal values in its
// 64-element block (so that no neighbour sends the block to the general path): half the least
// subnormal and the patterns around it, the least normal and the pattern below, tiny and
// negative values, and the largest code.
TEST(QuantOracle, PerTokenFp8SixteenBitEdgesAloneInTheirBlock) {
  const uint16_t edges[] = {0x3a7f, 0x3a80, 0x3a81, 0x3c7f, 0x3c80, 0x3c81, 0x0001, 0x8000, 0xbc80, 0xba81, 0x43e0, 0xc3e0};
  const int64_t gran = 128, groups = std::size(edges);
  Tensor x = Tensor::empty({1, groups * gran}, DType::bf16);
  uint16_t* p = x.data_ptr<uint16_t>();
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t i = 0; i < gran; ++i) p[g * gran + i] = static_cast<uint16_t>(i % 2 ? 0x3f80 : 0xbfc0);  // 1, -1.5
    p[g * gran] = 0x43e0;  // amax 448: sf = 1
    p[g * gran + 64 + g % 64] = edges[g];
  }
  const Case c{1, groups * gran, gran};
  for (bool ue8m0 : {false, true}) expect_oracle_under_every_isa(Cast::token_fp8, x, ue8m0, c);
}

// The same edges in per-channel casts (per-column scales, which keep the f32 path):
// x [128, 256], column c's amax 448·2^(c % 5 - 2) in row 0, an edge pattern (scaled alike)
// in row 1 + c % 100 of some columns, normal values elsewhere.
TEST(QuantOracle, PerChannelFp8SixteenBitEdges) {
  const uint16_t edges[] = {0x3a7f, 0x3a80, 0x3a81, 0x3c7f, 0x3c80, 0x3c81, 0x0001, 0x8000, 0xbc80, 0xba81};
  const int64_t rows = 128, cols = 256;
  Tensor x = Tensor::empty({rows, cols}, DType::bf16);
  uint16_t* p = x.data_ptr<uint16_t>();
  for (int64_t c = 0; c < cols; ++c) {
    const int k = static_cast<int>(c % 5) - 2;  // column scale 2^k
    auto scaled = [&](uint16_t pattern) {
      const int32_t mag = pattern & 0x7fff;
      return static_cast<uint16_t>((pattern & 0x8000) | (mag >= 0x0080 ? mag + k * 128 : mag));
    };
    for (int64_t r = 0; r < rows; ++r) p[r * cols + c] = scaled(r % 2 ? 0x3f80 : 0xbfc0);
    p[c] = scaled(0x43e0);
    if (c % 3 == 0) p[(1 + c % 100) * cols + c] = scaled(edges[(c / 3) % std::size(edges)]);
  }
  const Case c{rows, cols, 128};
  for (bool ue8m0 : {false, true}) expect_oracle_under_every_isa(Cast::channel_fp8, x, ue8m0, c);
}

// ---------------------------------------------------------------- hand-checked cases
// bf16 amaxes may be taken on the 16-bit patterns, eight groups at a time: NaN (either
// sign; the default payload, which the oracle's scale keeps), inf, -0 and subnormals at the start, middle and end of groups,
// with group sizes that are and are not multiples of 16 and counts that leave a partial batch.
TEST(QuantOracle, Bf16SpecialsInGroups) {
  const uint16_t specials[] = {0x7fc0, 0xffc0, 0x7f80, 0xff80, 0x8000, 0x0001, 0x807f};
  uint64_t seed = 100;
  for (const Case& c : {Case{3, 1000, 16}, Case{3, 1000, 32}, Case{2, 2100, 128}, Case{130, 520, 128}, Case{3, 1000, 40}}) {
    Tensor x = with_dtype(make_input(c.m, c.k, ++seed), DType::bf16);
    std::mt19937_64 rng(seed);
    auto* p = x.data_ptr<uint16_t>();
    for (int64_t i = 0; i < x.numel(); i += 1 + static_cast<int64_t>(rng() % (3 * c.gran)))
      p[i] = specials[rng() % std::size(specials)];
    for (Cast cast : {Cast::token_fp8, Cast::token_fp4, Cast::block_fp8}) {
      for (bool ue8m0 : {false, true}) {
        SCOPED_TRACE(describe(cast, c, DType::bf16, ue8m0));
        const Quantized want = run_ref(cast, x, ue8m0, c);
        for_each_isa([&](Isa) { EXPECT_TRUE(same_quantized(run_cast(cast, x, ue8m0, c), want)); });
      }
    }
  }
}

// Empty inputs with a huge other extent (2^40 rows of nothing): every cast returns at once
// with empty values and scales (before, each looped over the 2^40 empty rows; a regression
// shows as ctest's timeout).
TEST(QuantHand, EmptyInputsWithHugeExtentsReturnAtOnce) {
  constexpr int64_t kHuge = int64_t{1} << 40;
  for (const Shape& shape : {Shape{kHuge, 0}, Shape{0, kHuge}}) {
    SCOPED_TRACE(shape_str(shape));
    const Tensor x = Tensor::empty(shape, DType::bf16);
    const Quantized t8 = per_token_cast_to_fp8(x, false);
    EXPECT_EQ(t8.values.shape(), shape);
    EXPECT_EQ(t8.sf.numel(), 0);
    EXPECT_EQ(per_block_cast_to_fp8(x, true).values.shape(), shape);
    EXPECT_EQ(per_channel_cast_to_fp8(x, false).values.shape(), shape);
    EXPECT_EQ(per_token_cast_to_fp4(x, false).sf.numel(), 0);
    EXPECT_EQ(cast_back_from_fp8(t8.values, t8.sf, DType::bf16, 1, 128).shape(), shape);
  }
}

TEST(QuantHand, PerTokenFp8SmallRow) {
  const float x[2][4] = {{1.0f, -2.0f, 448.0f, 0.5f}, {0.0f, 0.0f, 0.0f, 0.0f}};
  for_each_isa([&](Isa) {
    for (bool ue8m0 : {false, true}) {
      const Quantized got = per_token_cast_to_fp8(Tensor::from_blob(&x[0][0], {2, 4}, DType::f32), ue8m0);
      ASSERT_EQ(got.sf.shape(), Shape({2, 1}));
      EXPECT_EQ(got.sf.data_ptr<float>()[0], 1.0f);  // 448 / 448
      const uint8_t want[4] = {0x38, 0xc0, 0x7e, 0x30};
      for (int c = 0; c < 4; ++c) EXPECT_EQ(got.values.data_ptr<uint8_t>()[c], want[c]) << c;
      // All-zero row: amax floors at 1e-4, sf = 1e-4/448 (f32), or 2^-22 rounded up.
      EXPECT_EQ(got.sf.data_ptr<float>()[1], ue8m0 ? 0x1p-22f : 1e-4f / 448.0f) << "ue8m0=" << ue8m0;
      for (int c = 0; c < 4; ++c) EXPECT_EQ(got.values.data_ptr<uint8_t>()[4 + c], 0) << c;
    }
  });
}

TEST(QuantHand, PerTokenFp4SmallRows) {
  // Row 0: amax 6 -> sf 1: codes 3->5, 6->7, -0.5->9, 1.25->2 (tie -> 1.0), 0.25->0 (tie -> 0)
  // Row 1: all zero -> sf = 1e-4/6, or 2^-15 with ue8m0 (1.67e-5 rounded up).
  const float x[2][5] = {{3.0f, 6.0f, -0.5f, 1.25f, 0.25f}, {0, 0, 0, 0, 0}};
  for_each_isa([&](Isa) {
    for (bool ue8m0 : {false, true}) {
      const Quantized got = per_token_cast_to_fp4(Tensor::from_blob(&x[0][0], {2, 5}, DType::f32), ue8m0);
      ASSERT_EQ(got.values.shape(), Shape({2, 3}));
      ASSERT_EQ(got.sf.shape(), Shape({2, 1}));
      EXPECT_EQ(got.sf.data_ptr<float>()[0], 1.0f);
      EXPECT_EQ(got.sf.data_ptr<float>()[1], ue8m0 ? 0x1p-15f : 1e-4f / 6.0f);
      const uint8_t want[6] = {0x75, 0x29, 0x00, 0x00, 0x00, 0x00};  // odd tail: high nibble 0
      for (int i = 0; i < 6; ++i) EXPECT_EQ(got.values.data_ptr<uint8_t>()[i], want[i]) << "byte " << i;
    }
  });
}

// Quotients within a few ulps of e4m3 rounding boundaries under scales that are not powers
// of two: fast paths that multiply by the reciprocal scale must still round x / sf exactly.
TEST(QuantOracle, PerTokenFp8NearTiesWithArbitraryScales) {
  const int64_t m = 64, k = 512;
  Tensor x = Tensor::empty({m, k}, DType::f32);
  std::mt19937_64 rng(77);
  std::uniform_real_distribution<float> amax_dist(0.5f, 3.0f);
  // Even groups: ties and values at or above the least normal only (a fast path may leave
  // blocks with e4m3 subnormals to the division, so these blocks are the ones that test it).
  // Odd groups add the subnormal ties and the least normal's lower neighbourhood.
  std::vector<float> normal_range, all = kE4m3Midpoints;
  for (float v : kE4m3Midpoints)
    if (v >= 0.015625f) normal_range.push_back(v);
  for (float v : {0.015625f, 448.0f, 416.0f}) normal_range.push_back(v), all.push_back(v);
  for (float v : {0.0146484375f, 0.0151367188f}) all.push_back(v);
  for (int64_t r = 0; r < m; ++r) {
    float* row = x.data_ptr<float>() + r * k;
    for (int64_t g = 0; g < k / 128; ++g) {
      const float amax = amax_dist(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 20) - 10);
      const float sf = amax / 448.0f;
      const std::vector<float>& boundaries = g % 2 ? all : normal_range;
      for (int64_t c = 0; c < 128; ++c) {
        const float t = boundaries[rng() % boundaries.size()];
        const int32_t nudge = static_cast<int32_t>(rng() % 9) - 4;  // a few f32 steps either side
        // Never above amax, which must stay the group's amax for sf to be the one above.
        const float v = std::min(float_of(bits_of(t * sf) + static_cast<uint32_t>(nudge)), amax);
        row[g * 128 + c] = c == 0 ? amax : (rng() & 1 ? -v : v);
      }
    }
  }
  const Quantized want = ref::per_token_cast_to_fp8(x, false);
  for_each_isa([&](Isa) { EXPECT_TRUE(same_quantized(per_token_cast_to_fp8(x, false), want)); });
  // The same values as columns: per-channel scales, one reciprocal per column.
  const Tensor xt = x.transpose(0, 1).contiguous();
  const Quantized want_t = ref::per_channel_cast_to_fp8(xt, false);
  for_each_isa([&](Isa) { EXPECT_TRUE(same_quantized(per_channel_cast_to_fp8(xt, false), want_t)); });
}

// bf16 inputs under f32 scales: every bf16 value from a group's amax down 16 binades, for
// amaxes of every bf16 mantissa. Column c's amax (row 0) has mantissa c % 128, at 1.0 or
// 2^-32; the rows below hold the 2047 patterns under it, alternately negated, with zeros in
// a few 64-element blocks. About one quotient in 200 lies within a few f32 steps of an e4m3
// rounding boundary (a bf16 value over a bf16 amax), the last binade or so is in the e4m3
// subnormals (blocks that fast kernels leave to the division), and 40 columns past the
// 256 make a tail. Per-channel (one scale per column) and, transposed, per-token casts
// (groups of 2048, one scale per row).
TEST(QuantOracle, Bf16EveryValueBelowEveryAmaxMantissa) {
  const int64_t rows = 2048, cols = 296;
  Tensor x = Tensor::empty({rows, cols}, DType::bf16);
  uint16_t* p = x.data_ptr<uint16_t>();
  for (int64_t c = 0; c < cols; ++c) {
    const uint16_t amax = static_cast<uint16_t>((c / 128 % 2 ? 0x2f80 : 0x3f80) | (c % 128));
    for (int64_t r = 0; r < rows; ++r) {
      const bool zero = r % 97 == 5 && c % 64 < 20;
      const uint16_t magnitude = zero ? 0 : static_cast<uint16_t>(amax - r);
      p[r * cols + c] = static_cast<uint16_t>(magnitude | ((r + c) % 2 ? 0x8000 : 0));
    }
  }
  const Tensor xt = x.transpose(0, 1).contiguous();
  for (bool ue8m0 : {false, true}) {
    SCOPED_TRACE(ue8m0 ? "ue8m0" : "f32 scales");
    expect_oracle_under_every_isa(Cast::channel_fp8, x, ue8m0, Case{rows, cols, rows});
    expect_oracle_under_every_isa(Cast::token_fp8, xt, ue8m0, Case{cols, rows, rows});
  }
}

TEST(QuantHand, SingleHugeValueRow) {
  // One 1e30 among N(0,1) values: sf = 1e30/448, the huge one maps to 448 and every other
  // value to a signed zero. With ue8m0, sf = 2^91 (2.23e27 rounded up) and 1e30/2^91 =
  // 403.9 -> nearest e4m3 is 416 (0x7d; 384 and 448 are the neighbours).
  const int64_t k = 300;
  Tensor x = Tensor::empty({1, k}, DType::f32);
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  for (int64_t c = 0; c < k; ++c) x.data_ptr<float>()[c] = normal(rng);
  x.data_ptr<float>()[5] = 1e30f;
  for_each_isa([&](Isa) {
    for (bool ue8m0 : {false, true}) {
      const Quantized got = per_token_cast_to_fp8(x, ue8m0, 1024);
      EXPECT_EQ(got.sf.data_ptr<float>()[0], ue8m0 ? 0x1p91f : 1e30f / 448.0f);
      const auto* q = got.values.data_ptr<uint8_t>();
      EXPECT_EQ(q[5], ue8m0 ? 0x7d : 0x7e);
      for (int64_t c = 0; c < k; ++c) {
        if (c == 5) continue;
        EXPECT_EQ(q[c], std::signbit(x.data_ptr<float>()[c]) ? 0x80 : 0x00) << c;
      }
    }
  });
}

// ---------------------------------------------------------------- strided views, _into
// Fills a tensor's whole storage with a byte.
void fill_bytes(const Tensor& t, uint8_t value) {
  std::memset(t.data(), value, static_cast<size_t>(t.numel()) * t.element_size());
}

// Every byte of `whole` outside the 2-D view `view` (which lies inside it) equals value.
::testing::AssertionResult untouched_outside(const Tensor& whole, const Tensor& view, uint8_t value) {
  const auto* base = static_cast<const uint8_t*>(whole.data());
  const auto* vbase = static_cast<const uint8_t*>(view.data());
  const int64_t es = static_cast<int64_t>(whole.element_size());
  const int64_t total = whole.numel() * es;
  std::vector<bool> inside(static_cast<size_t>(total), false);
  for (int64_t r = 0; r < view.size(0); ++r) {
    const int64_t start = (vbase - base) + r * view.stride(0) * es;
    for (int64_t b = 0; b < view.size(1) * es; ++b) inside[static_cast<size_t>(start + b)] = true;
  }
  for (int64_t i = 0; i < total; ++i)
    if (!inside[static_cast<size_t>(i)] && base[i] != value)
      return ::testing::AssertionFailure() << "byte " << i << " outside the view changed to " << hex(base[i]);
  return ::testing::AssertionSuccess();
}

TEST(QuantStrided, SlicedInputAndOutputs) {
  constexpr uint8_t kSentinel = 0xa7;
  const std::vector<std::pair<Cast, Case>> cases = {
      {Cast::token_fp8, {129, 300, 128}},   {Cast::token_fp8, {3, 7, 32}},     {Cast::block_fp8, {257, 130, 128, 128}},
      {Cast::channel_fp8, {300, 33, 128}},  {Cast::token_fp4, {129, 99, 32}}, {Cast::token_fp4, {3, 1000, 64}},
  };
  uint64_t seed = 100;
  for (const auto& [cast, c] : cases) {
    // x: columns [5, 5 + k) of a wider tensor, so the row stride is k + 12.
    const Tensor src = make_input(c.m, c.k, ++seed);
    for (DType dtype : {DType::f32, DType::bf16}) {
      const Tensor wide_x = with_dtype(make_input(c.m, c.k + 12, seed + 1000), dtype);
      const Tensor x = wide_x.slice(1, 5, 5 + c.k);
      x.copy_from(with_dtype(src, dtype));
      ASSERT_EQ(x.stride(0), c.k + 12);
      for (bool ue8m0 : {false, true}) {
        SCOPED_TRACE(describe(cast, c, dtype, ue8m0) + " (strided)");
        const Quantized want = run_ref(cast, x, ue8m0, c);
        const Shape vs = values_shape(cast, c), ss = sf_shape(cast, c);
        for_each_isa([&](Isa) {
          const Tensor q_all = Tensor::empty({vs[0] + 3, vs[1] + 9}, want.values.dtype());
          const Tensor sf_all = Tensor::empty({ss[0] + 2, ss[1] + 5}, DType::f32);
          fill_bytes(q_all, kSentinel);
          fill_bytes(sf_all, kSentinel);
          const Quantized got{q_all.slice(0, 1, 1 + vs[0]).slice(1, 4, 4 + vs[1]),
                              sf_all.slice(0, 2, 2 + ss[0]).slice(1, 3, 3 + ss[1])};
          run_into(cast, x, got.values, got.sf, ue8m0, c);
          EXPECT_TRUE(same_quantized(got, want));
          EXPECT_TRUE(untouched_outside(q_all, got.values, kSentinel)) << "values buffer";
          EXPECT_TRUE(untouched_outside(sf_all, got.sf, kSentinel)) << "sf buffer";
          // The strided input gives the same result as a contiguous copy.
          EXPECT_TRUE(same_quantized(run_cast(cast, x.contiguous(), ue8m0, c), want));
        });
      }
    }
  }
}

// ---------------------------------------------------------------- determinism
TEST(QuantDeterminism, SameBytesForOneTwoThreeThreads) {
  ThreadGuard guard;
  // 384 x 512: above the parallel threshold (2^15 elements), 3 row blocks of 128 for the
  // per-block / per-channel casts and 3 calc_diff chunks, so every thread count splits work.
  const Tensor x32 = make_input(384, 512, 42);
  for (DType dtype : {DType::f32, DType::bf16}) {
    const Tensor x = with_dtype(x32, dtype);
    SCOPED_TRACE(dtype_name(dtype));
    for_each_isa([&](Isa) {
      std::vector<Quantized> first;
      std::vector<Tensor> first_back;
      for (int threads : {1, 2, 3}) {
        set_num_threads(threads);
        SCOPED_TRACE("threads=" + std::to_string(threads));
        std::vector<Quantized> outs = {
            per_token_cast_to_fp8(x, false), per_token_cast_to_fp8(x, true, 64), per_block_cast_to_fp8(x, false),
            per_block_cast_to_fp8(x, true),  per_channel_cast_to_fp8(x, true),  per_token_cast_to_fp4(x, false),
            per_token_cast_to_fp4(x, true, 64)};
        std::vector<Tensor> back = {cast_back_from_fp8(outs[0].values, outs[0].sf, DType::f32),
                                    cast_back_from_fp8(outs[2].values, outs[2].sf, DType::bf16, 128, 128),
                                    cast_back_from_fp4(outs[5].values, outs[5].sf, DType::f32)};
        if (first.empty()) {
          first = outs;
          first_back = back;
          continue;
        }
        for (size_t i = 0; i < outs.size(); ++i) EXPECT_TRUE(same_quantized(outs[i], first[i])) << "cast #" << i;
        for (size_t i = 0; i < back.size(); ++i) EXPECT_TRUE(same_tensor_bytes("cast_back", back[i], first_back[i])) << i;
        EXPECT_EQ(calc_diff(back[0], x), calc_diff(first_back[0], x));
      }
    });
  }
}

// ---------------------------------------------------------------- cast back
// Round-to-nearest-even of an exact value to bf16 bits, computed directly (no f32 step).
uint16_t rne_bf16(double v) {
  const uint16_t sign = std::signbit(v) ? 0x8000 : 0;
  if (std::isnan(v)) return 0x7fc0;
  if (std::isinf(v)) return sign | 0x7f80;
  if (v == 0.0) return sign;
  int e = 0;
  std::frexp(std::abs(v), &e);                          // |v| = f * 2^e, f in [0.5, 1)
  const int quantum = std::max(e - 8, -133);            // 8 significant bits; subnormal quantum 2^-133
  const double rounded = std::ldexp(std::nearbyint(std::ldexp(std::abs(v), -quantum)), quantum);
  if (rounded >= 0x1p128) return sign | 0x7f80;
  const uint32_t b = bits_of(static_cast<float>(rounded));
  EXPECT_EQ(b & 0xffff, 0u);
  return static_cast<uint16_t>(sign | (b >> 16));
}

// out (f32 or bf16 [m, k]) against the oracle's exact products: f32 out is the f32
// rounding of the exact product (exact when sf is a power of two), bf16 out its direct RNE.
::testing::AssertionResult matches_dequantized(const Tensor& out, const std::vector<double>& want) {
  const int64_t m = out.size(0), k = out.size(1);
  if (static_cast<int64_t>(want.size()) != m * k) return ::testing::AssertionFailure() << "size mismatch";
  const bool f32 = out.dtype() == DType::f32;
  int64_t bad = 0;
  std::string first;
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < k; ++c) {
      const double w = want[static_cast<size_t>(r * k + c)];
      const char* p = static_cast<const char*>(out.data()) + (r * out.stride(0) + c) * static_cast<int64_t>(out.element_size());
      uint32_t got = 0, expected = 0;
      bool ok;
      if (f32) {
        std::memcpy(&got, p, 4);
        expected = bits_of(static_cast<float>(w));
        ok = std::isnan(w) ? std::isnan(float_of(got)) : got == expected;
      } else {
        uint16_t g;
        std::memcpy(&g, p, 2);
        got = g;
        expected = rne_bf16(w);
        ok = std::isnan(w) ? ((g & 0x7f80) == 0x7f80 && (g & 0x7f) != 0) : got == expected;
      }
      if (!ok && bad++ == 0) {
        char text[160];
        std::snprintf(text, sizeof text, "[%lld, %lld]: got %s, want %s (exact product %.17g)", static_cast<long long>(r),
                      static_cast<long long>(c), hex(got).c_str(), hex(expected).c_str(), w);
        first = text;
      }
    }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << m * k << " elements differ; first at " << first;
}

// Random codes (every byte value, including NaN codes) and positive f32 scales with full
// mantissas over a wide exponent range.
Tensor random_codes(int64_t rows, int64_t cols, DType dtype, uint64_t seed) {
  Tensor t = Tensor::empty({rows, cols}, dtype);
  std::mt19937_64 rng(seed);
  for (int64_t i = 0; i < t.numel(); ++i) t.data_ptr<uint8_t>()[i] = static_cast<uint8_t>(rng());
  return t;
}
Tensor random_scales(int64_t rows, int64_t cols, uint64_t seed) {
  Tensor t = Tensor::empty({rows, cols}, DType::f32);
  std::mt19937_64 rng(seed);
  for (int64_t i = 0; i < t.numel(); ++i) {
    const uint64_t r = rng();
    const uint32_t exponent = static_cast<uint32_t>(127 - 20 + r % 41), mantissa = static_cast<uint32_t>(r >> 40) & 0x7fffffu;
    t.data_ptr<float>()[i] = float_of((exponent << 23) | mantissa);
  }
  return t;
}
// Powers of two as f32, and the same as packed ue8m0 words.
Tensor random_pow2_scales(int64_t rows, int64_t cols, uint64_t seed) {
  Tensor t = Tensor::empty({rows, cols}, DType::f32);
  std::mt19937_64 rng(seed);
  for (int64_t i = 0; i < t.numel(); ++i) t.data_ptr<float>()[i] = std::ldexp(1.0f, static_cast<int>(rng() % 41) - 20);
  return t;
}

struct Grid {
  const char* name;
  int64_t m, k, gran_m, gran_k;
};

void check_cast_back(bool fp4, const Grid& g, uint64_t seed) {
  SCOPED_TRACE(std::string(fp4 ? "fp4 " : "fp8 ") + g.name + " [" + std::to_string(g.m) + ", " + std::to_string(g.k) +
               "] grid " + std::to_string(g.gran_m) + "x" + std::to_string(g.gran_k));
  const Tensor q = random_codes(g.m, fp4 ? cdiv(g.k, 2) : g.k, fp4 ? DType::e2m1x2 : DType::e4m3, seed);
  const int64_t sm = cdiv(g.m, g.gran_m), groups = cdiv(g.k, g.gran_k);
  const Tensor sf_any = random_scales(sm, groups, seed + 1);
  const Tensor sf_pow2 = random_pow2_scales(sm, groups, seed + 2);
  const Tensor sf_packed = pack_ue8m0_to_int(sf_pow2);
  ASSERT_EQ(sf_packed.shape(), Shape({sm, cdiv(groups, 4)}));
  for (const Tensor* sf : {&sf_any, &sf_pow2, &sf_packed}) {
    SCOPED_TRACE(sf == &sf_any ? "f32 sf" : sf == &sf_pow2 ? "f32 power-of-two sf" : "packed ue8m0 sf");
    const std::vector<double> want = ref::dequantize(q, *sf, g.gran_m, g.gran_k, g.k);
    for_each_isa([&](Isa) {
      for (DType out_dtype : {DType::f32, DType::bf16}) {
        SCOPED_TRACE(std::string("out=") + dtype_name(out_dtype));
        const Tensor out = fp4 ? cast_back_from_fp4(q, *sf, out_dtype, g.gran_m, g.gran_k, g.k)
                               : cast_back_from_fp8(q, *sf, out_dtype, g.gran_m, g.gran_k);
        ASSERT_EQ(out.shape(), Shape({g.m, g.k}));
        ASSERT_EQ(out.dtype(), out_dtype);
        EXPECT_TRUE(matches_dequantized(out, want));
      }
    });
  }
}

TEST(QuantCastBack, Fp8PerToken) {
  check_cast_back(false, {"per token", 129, 300, 1, 128}, 1);
  check_cast_back(false, {"per token", 3, 1000, 1, 32}, 2);
  check_cast_back(false, {"per token", 1, 7, 1, 128}, 3);
}

TEST(QuantCastBack, Fp8PerBlock) {
  check_cast_back(false, {"per block", 257, 300, 128, 128}, 4);
  check_cast_back(false, {"per block", 130, 129, 128, 128}, 5);
}

TEST(QuantCastBack, Fp8PerChannel) {
  check_cast_back(false, {"per channel", 300, 70, 128, 1}, 6);
  check_cast_back(false, {"per channel", 129, 9, 128, 1}, 7);
}

TEST(QuantCastBack, Fp4PerToken) {
  check_cast_back(true, {"per token", 129, 100, 1, 32}, 8);
  check_cast_back(true, {"per token odd k", 129, 99, 1, 32}, 9);
  check_cast_back(true, {"per token", 3, 1000, 1, 64}, 10);
  check_cast_back(true, {"per token odd k", 5, 7, 1, 32}, 11);
}

TEST(QuantCastBack, Fp4DefaultKAndIntoForm) {
  const Tensor q = random_codes(4, 5, DType::e2m1x2, 12);
  const Tensor sf = random_scales(4, 1, 13);
  const Tensor out = cast_back_from_fp4(q, sf);  // k = 2 * 5, gran_k 32
  ASSERT_EQ(out.shape(), Shape({4, 10}));
  EXPECT_TRUE(matches_dequantized(out, ref::dequantize(q, sf, 1, 32, 10)));
  // _into with an odd k (9): the high nibble of each row's last byte is ignored.
  const Tensor out9 = Tensor::empty({4, 9}, DType::f32);
  cast_back_from_fp4_into(q, sf, out9);
  EXPECT_TRUE(matches_dequantized(out9, ref::dequantize(q, sf, 1, 32, 9)));
}

TEST(QuantCastBack, IntoStridedOutput) {
  constexpr uint8_t kSentinel = 0x5c;
  const Tensor q = random_codes(130, 140, DType::e4m3, 14);
  const Tensor sf = random_pow2_scales(2, 2, 15);
  const std::vector<double> want = ref::dequantize(q, sf, 128, 128, 140);
  for_each_isa([&](Isa) {
    for (DType dtype : {DType::f32, DType::bf16}) {
      const Tensor all = Tensor::empty({133, 150}, dtype);
      fill_bytes(all, kSentinel);
      const Tensor out = all.slice(0, 2, 132).slice(1, 7, 147);
      cast_back_from_fp8_into(q, sf, out, 128, 128);
      EXPECT_TRUE(matches_dequantized(out, want)) << dtype_name(dtype);
      EXPECT_TRUE(untouched_outside(all, out, kSentinel)) << dtype_name(dtype);
    }
  });
}

// Round trip through the library's own quantiser on data with exact e4m3 products.
TEST(QuantCastBack, RoundTripOfQuantisedTensor) {
  const Tensor x = make_input(129, 300, 77);
  for (bool ue8m0 : {false, true}) {
    const Quantized qt = per_token_cast_to_fp8(x, ue8m0);
    const Tensor back = cast_back_from_fp8(qt.values, qt.sf, DType::f32);
    EXPECT_TRUE(matches_dequantized(back, ref::dequantize(qt.values, qt.sf, 1, 128, 300)));
    if (ue8m0) {
      const Tensor packed = pack_ue8m0_to_int(qt.sf);
      EXPECT_TRUE(same_tensor_bytes("packed vs f32 sf", cast_back_from_fp8(qt.values, packed, DType::f32), back));
    }
  }
}

// The bf16 output is one rounding of the exact product: 1.125 (e4m3 0x39) times
// sf = 7835193 * 2^-23 is 70516737 * 2^-26, just above the bf16 midpoint 134.5 * 2^-7, so
// it rounds up to 135 * 2^-7 (0x3f87). Rounding to f32 first lands exactly on the midpoint
// and then ties to even, 134 * 2^-7 (0x3f86): a double rounding.
// The contract (docs/FORMATS.md, as upstream's `(q.float() * sf).to(bf16)`): the product is
// an f32 multiply, then RNE to bf16. This case sits where rounding once from the exact
// product would differ: exact 70516737·2^-26 is just above the bf16 midpoint 134.5·2^-7,
// but its f32 rounding lands exactly on the midpoint, which ties to even (134·2^-7).
TEST(QuantCastBack, Bf16OutputIsRneOfTheF32Product) {
  const uint8_t code = 0x39;
  const float sf = 7835193 * 0x1p-23f;
  ASSERT_EQ(static_cast<double>(sf), 7835193 * 0x1p-23);
  ASSERT_EQ(1.125 * static_cast<double>(sf), 70516737 * 0x1p-26);
  ASSERT_EQ(1.125f * sf, 134.5f * 0x1p-7f);  // the f32 product is the bf16 midpoint
  const Tensor q = Tensor::from_blob(&code, {1, 1}, DType::e4m3);
  const Tensor s = Tensor::from_blob(&sf, {1, 1}, DType::f32);
  for_each_isa([&](Isa) {
    const Tensor out = cast_back_from_fp8(q, s, DType::bf16);
    EXPECT_EQ(hex(out.data_ptr<uint16_t>()[0]), hex(0x3f86));
    const Tensor out32 = cast_back_from_fp8(q, s, DType::f32);
    EXPECT_EQ(out32.data_ptr<float>()[0], static_cast<float>(70516737 * 0x1p-26));
  });
}

// Every code under scales the fast dequantisation path must not take (|sf| ≥ 2^120, where
// sf·2^8 overflows; inf; NaN, one with a payload) and under ordinary ones around them (negative, zero, f32
// subnormal, products that round up to inf in bf16), for each group layout (gran 32 and 256:
// block loop; gran = k = 1024: span loop) and output type. Every ISA must give the oracle's
// value and the scalar ISA's exact bytes, except that where both the code and the scale are
// NaN (nan_times_nan), which NaN the product keeps is the compiler's operand order
// (docs/FORMATS.md); there both must still be NaN.
template <class NanTimesNan>
::testing::AssertionResult same_bytes_but_nan_times_nan(const Tensor& got, const Tensor& want, NanTimesNan nan_times_nan) {
  const bool f32 = got.dtype() == DType::f32;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const float g = f32 ? got.data_ptr<float>()[i] : bf16_to_f32(got.data_ptr<uint16_t>()[i]);
    const float w = f32 ? want.data_ptr<float>()[i] : bf16_to_f32(want.data_ptr<uint16_t>()[i]);
    if (nan_times_nan(i) && std::isnan(g) && std::isnan(w)) continue;
    if (bits_of(g) != bits_of(w)) return ::testing::AssertionFailure() << "element " << i << ": " << hex(bits_of(g)) << " vs scalar ISA " << hex(bits_of(w));
  }
  return ::testing::AssertionSuccess();
}

TEST(QuantCastBack, EveryCodeUnderExtremeScales) {
  // 0x1.fffp119 times the code 256 is 0x1.fffp127, a finite f32 that rounds to inf in bf16.
  const float scales[] = {0x1.8p119f, 0x1p120f, 0x1.fffffep127f, INFINITY, -INFINITY, NAN, -2.5f, 0.0f, -0.0f,
                          1e-40f, 0x1.4p-126f, 0x1.fep119f, 0x1.fffp119f, 1.0f,
                          std::bit_cast<float>(0x7f80ffffu)};  // a signalling NaN whose payload carries when rounded
  constexpr int64_t kScales = std::size(scales);
  for (bool fp4 : {false, true}) {
    const int64_t k = fp4 ? 512 : 256;  // every byte once: 256 e4m3 codes, or all 256 nibble pairs
    for (int64_t gran : {int64_t{32}, int64_t{256}, int64_t{1024}}) {
      const int64_t cols = gran == 1024 ? 1024 : k;  // gran 1024: the codes four times over, one group per row
      SCOPED_TRACE(std::string(fp4 ? "fp4" : "fp8") + " gran " + std::to_string(gran));
      Tensor q = Tensor::empty({kScales, fp4 ? cols / 2 : cols}, fp4 ? DType::e2m1x2 : DType::e4m3);
      for (int64_t i = 0; i < q.numel(); ++i) q.data_ptr<uint8_t>()[i] = static_cast<uint8_t>(i);
      const int64_t groups = cdiv(cols, gran);
      Tensor sf = Tensor::empty({kScales, groups}, DType::f32);
      for (int64_t r = 0; r < kScales; ++r)  // each row its own scale; gran 32 also mixes them within a row
        for (int64_t g = 0; g < groups; ++g) sf.data_ptr<float>()[r * groups + g] = scales[(r + (gran == 32 ? g : 0)) % kScales];
      const std::vector<double> want = ref::dequantize(q, sf, 1, gran, cols);
      for (DType out_dtype : {DType::f32, DType::bf16}) {
        SCOPED_TRACE(std::string("out=") + dtype_name(out_dtype));
        Tensor scalar_out;
        for_each_isa([&](Isa isa) {
          const Tensor out = fp4 ? cast_back_from_fp4(q, sf, out_dtype, 1, gran, cols) : cast_back_from_fp8(q, sf, out_dtype, 1, gran);
          EXPECT_TRUE(matches_dequantized(out, want));
          if (isa == Isa::scalar) scalar_out = out;
          else EXPECT_TRUE(same_bytes_but_nan_times_nan(out, scalar_out, [&](int64_t i) {
            const int64_t r = i / cols, c = i % cols;
            return !fp4 && (q.data_ptr<uint8_t>()[r * cols + c] & 0x7f) == 0x7f && std::isnan(sf.data_ptr<float>()[r * groups + c / gran]);
          }));
        });
      }
    }
  }
}

// ---------------------------------------------------------------- error bounds, calc_diff
Tensor random_normal(int64_t m, int64_t k, uint64_t seed) {
  Tensor t = Tensor::empty({m, k}, DType::f32);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  for (int64_t i = 0; i < t.numel(); ++i) t.data_ptr<float>()[i] = normal(rng);
  return t;
}

TEST(QuantError, RoundTripCalcDiffBounds) {
  const Tensor x = random_normal(128, 1024, 9);
  for_each_isa([&](Isa) {
    for (bool ue8m0 : {false, true}) {
      SCOPED_TRACE(ue8m0 ? "ue8m0" : "f32 sf");
      const Quantized t = per_token_cast_to_fp8(x, ue8m0);
      const double d_token = calc_diff(cast_back_from_fp8(t.values, t.sf), x);
      const Quantized b = per_block_cast_to_fp8(x, ue8m0);
      const double d_block = calc_diff(cast_back_from_fp8(b.values, b.sf, DType::f32, 128, 128), x);
      const Quantized f = per_token_cast_to_fp4(x, ue8m0);
      const double d_fp4 = calc_diff(cast_back_from_fp4(f.values, f.sf), x);
      const double d_bf16 = calc_diff(cast_back_from_fp8(t.values, t.sf, DType::bf16), x);
      RecordProperty(std::string("calc_diff_fp8_token") + (ue8m0 ? "_ue8m0" : ""), std::to_string(d_token));
      // Measured (128x1024 N(0,1), seeds 9-11): fp8 per token / per block 3.3e-4 - 3.5e-4 (both
      // scale modes, f32 or bf16 out); fp4 5.1e-3 (f32 sf) / 6.7e-3 (ue8m0). Bounds leave ~3x.
      EXPECT_LT(d_token, 1e-3);
      EXPECT_LT(d_block, 1e-3);
      EXPECT_LT(d_bf16, 1e-3);
      EXPECT_LT(d_fp4, 2e-2);
      // Not vacuous: quantisation loses something.
      EXPECT_GT(d_token, 1e-4);
      EXPECT_GT(d_fp4, 1e-3);
    }
  });
}

TEST(QuantCalcDiff, HandChecked) {
  const float a[4] = {1.0f, 2.0f, -3.0f, 0.5f};
  const float neg[4] = {-1.0f, -2.0f, 3.0f, -0.5f};
  const float zero[4] = {0, 0, 0, 0};
  const Tensor x = Tensor::from_blob(a, {2, 2}, DType::f32);
  EXPECT_EQ(calc_diff(x, x), 0.0);
  EXPECT_DOUBLE_EQ(calc_diff(x, Tensor::from_blob(neg, {2, 2}, DType::f32)), 2.0);
  EXPECT_DOUBLE_EQ(calc_diff(x, Tensor::from_blob(zero, {2, 2}, DType::f32)), 1.0);
  EXPECT_EQ(calc_diff(Tensor::from_blob(zero, {2, 2}, DType::f32), Tensor::from_blob(zero, {2, 2}, DType::f32)), 0.0);
  // x = (1, 2), y = (3, 4): 1 - 2 * 11 / 30 = 4/15.
  const float u[2] = {1.0f, 2.0f}, v[2] = {3.0f, 4.0f};
  EXPECT_NEAR(calc_diff(Tensor::from_blob(u, {1, 2}, DType::f32), Tensor::from_blob(v, {1, 2}, DType::f32)), 4.0 / 15.0,
              1e-15);
  // bf16 y (3, 4 are exact in bf16: 0x4040, 0x4080), and a 1-D shape.
  const uint16_t vb[2] = {0x4040, 0x4080};
  EXPECT_NEAR(calc_diff(Tensor::from_blob(u, {2}, DType::f32), Tensor::from_blob(vb, {2}, DType::bf16)), 4.0 / 15.0,
              1e-15);
  // Strided views pair elements by logical index: x^T vs a row-major copy of x^T is 0,
  // while x itself vs that copy is not: sum xy = -10.75, sum x^2+y^2 = 28.5 -> 1 + 21.5/28.5.
  const float xt_data[4] = {1.0f, -3.0f, 2.0f, 0.5f};  // (x^T) row-major
  EXPECT_EQ(calc_diff(x.t(), Tensor::from_blob(xt_data, {2, 2}, DType::f32)), 0.0);
  EXPECT_DOUBLE_EQ(calc_diff(x, Tensor::from_blob(xt_data, {2, 2}, DType::f32)), 1.0 + 21.5 / 28.5);
  EXPECT_THROW(calc_diff(x, Tensor::from_blob(u, {1, 2}, DType::f32)), Error);
  EXPECT_THROW(calc_diff(Tensor::zeros({2, 2}, DType::i32), x), Error);
}

// ---------------------------------------------------------------- bad input
void expect_error(const std::function<void()>& call, const std::string& argument, const char* what) {
  try {
    call();
    ADD_FAILURE() << what << ": no moekit::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), argument) << what << ": " << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": wrong exception type: " << e.what();
  }
}

TEST(QuantErrors, BadInputTensor) {
  const Tensor x = Tensor::zeros({4, 64}, DType::f32);
  const Tensor xt = Tensor::zeros({64, 4}, DType::f32).t();  // [4, 64] with last stride 4
  for (bool fp4 : {false, true}) {
    auto cast = [&](const Tensor& in) { return fp4 ? per_token_cast_to_fp4(in, false) : per_token_cast_to_fp8(in, false); };
    expect_error([&] { cast(Tensor::zeros({4, 64}, DType::i32)); }, "x", "x i32");
    expect_error([&] { cast(Tensor::zeros({4, 64}, DType::e4m3)); }, "x", "x e4m3");
    expect_error([&] { cast(Tensor::zeros({64}, DType::f32)); }, "x", "x 1-D");
    expect_error([&] { cast(Tensor::zeros({2, 4, 64}, DType::f32)); }, "x", "x 3-D");
    expect_error([&] { cast(xt); }, "x", "x transposed");
    expect_error([&] { cast(Tensor()); }, "x", "x undefined");
  }
  expect_error([&] { per_block_cast_to_fp8(Tensor::zeros({4, 64}, DType::i32), false); }, "x", "block x i32");
  expect_error([&] { per_block_cast_to_fp8(xt, false); }, "x", "block x transposed");
  expect_error([&] { per_channel_cast_to_fp8(Tensor::zeros({64}, DType::bf16), false); }, "x", "channel x 1-D");
  expect_error([&] { per_channel_cast_to_fp8(xt, false); }, "x", "channel x transposed");
  EXPECT_NO_THROW(per_token_cast_to_fp8(x, false));
}

TEST(QuantErrors, BadGranularity) {
  const Tensor x = Tensor::zeros({4, 64}, DType::f32);
  for (int64_t g : {0, -1, -128}) {
    expect_error([&] { per_token_cast_to_fp8(x, false, g); }, "gran_k", "fp8 gran_k");
    expect_error([&] { per_token_cast_to_fp4(x, false, g); }, "gran_k", "fp4 gran_k");
    expect_error([&] { per_channel_cast_to_fp8(x, false, g); }, "gran_k", "channel gran_k");
    expect_error([&] { per_block_cast_to_fp8(x, false, g, 128); }, "block_m", "block_m");
    expect_error([&] { per_block_cast_to_fp8(x, false, 128, g); }, "block_k", "block_k");
  }
  expect_error([&] { per_token_cast_to_fp4(x, false, 33); }, "gran_k", "fp4 odd gran_k");
  expect_error([&] { per_token_cast_to_fp4(x, false, 1); }, "gran_k", "fp4 gran_k 1");
}

TEST(QuantErrors, BadOutputs) {
  const Tensor x = Tensor::zeros({4, 64}, DType::f32);
  const Tensor q8 = Tensor::empty({4, 64}, DType::e4m3), q4 = Tensor::empty({4, 32}, DType::e2m1x2);
  const Tensor sf = Tensor::empty({4, 1}, DType::f32);
  EXPECT_NO_THROW(per_token_cast_to_fp8_into(x, q8, sf, false));
  EXPECT_NO_THROW(per_token_cast_to_fp4_into(x, q4, Tensor::empty({4, 2}, DType::f32), false));
  expect_error([&] { per_token_cast_to_fp8_into(x, Tensor::empty({4, 63}, DType::e4m3), sf, false); }, "q", "q shape");
  expect_error([&] { per_token_cast_to_fp8_into(x, Tensor::empty({4, 64}, DType::e5m2), sf, false); }, "q", "q e5m2");
  expect_error([&] { per_token_cast_to_fp8_into(x, Tensor::empty({4, 64}, DType::u8), sf, false); }, "q", "q u8");
  expect_error([&] { per_token_cast_to_fp8_into(x, q8, Tensor::empty({4, 2}, DType::f32), false); }, "sf", "sf shape");
  expect_error([&] { per_token_cast_to_fp8_into(x, q8, Tensor::empty({4, 1}, DType::bf16), false); }, "sf", "sf bf16");
  expect_error([&] { per_token_cast_to_fp8_into(x, q8, Tensor::empty({4, 1}, DType::i32), false); }, "sf", "sf i32");
  expect_error([&] { per_token_cast_to_fp8_into(x, q8, Tensor::empty({4}, DType::f32), false); }, "sf", "sf 1-D");
  expect_error([&] { per_token_cast_to_fp4_into(x, q8, Tensor::empty({4, 2}, DType::f32), false); }, "q", "fp4 q e4m3");
  expect_error([&] { per_token_cast_to_fp4_into(x, Tensor::empty({4, 64}, DType::e2m1x2), Tensor::empty({4, 2}, DType::f32), false); },
               "q", "fp4 q unpacked shape");
  expect_error([&] { per_token_cast_to_fp4_into(x, q4, sf, false); }, "sf", "fp4 sf shape (gran 32 -> 2 groups)");
  expect_error([&] { per_block_cast_to_fp8_into(x, q8, Tensor::empty({4, 1}, DType::f32), false); }, "sf", "block sf shape");
  expect_error([&] { per_block_cast_to_fp8_into(x, Tensor::empty({64, 4}, DType::e4m3), Tensor::empty({1, 1}, DType::f32), false); },
               "q", "block q shape");
  expect_error([&] { per_channel_cast_to_fp8_into(x, q8, Tensor::empty({4, 1}, DType::f32), false); }, "sf", "channel sf shape");
  expect_error([&] { per_channel_cast_to_fp8_into(x, q8, Tensor::empty({1, 64}, DType::bf16), false); }, "sf", "channel sf dtype");
}

TEST(QuantErrors, BadCastBack) {
  const Tensor q8 = Tensor::zeros({4, 64}, DType::e4m3), q4 = Tensor::zeros({4, 32}, DType::e2m1x2);
  const Tensor sf = Tensor::zeros({4, 1}, DType::f32);
  EXPECT_NO_THROW(cast_back_from_fp8(q8, sf));
  expect_error([&] { cast_back_from_fp8(q8, Tensor::zeros({4, 2}, DType::f32)); }, "sf", "sf shape");
  expect_error([&] { cast_back_from_fp8(q8, Tensor::zeros({2, 1}, DType::f32)); }, "sf", "sf rows");
  expect_error([&] { cast_back_from_fp8(q8, Tensor::zeros({4, 1}, DType::bf16)); }, "sf", "sf bf16");
  expect_error([&] { cast_back_from_fp8(q8, Tensor::zeros({4, 2}, DType::i32)); }, "sf", "packed sf width");
  expect_error([&] { cast_back_from_fp8(q8, Tensor::zeros({4, 1}, DType::f32), DType::f32, 128, 128); }, "sf", "block sf rows");
  expect_error([&] { cast_back_from_fp8(Tensor::zeros({4, 64}, DType::e5m2), sf); }, "q", "q e5m2");
  expect_error([&] { cast_back_from_fp8(q8, sf, DType::i32); }, "out", "out i32");
  expect_error([&] { cast_back_from_fp8(q8, sf, DType::f32, 0, 128); }, "gran_m", "gran_m 0");
  expect_error([&] { cast_back_from_fp8(q8, sf, DType::f32, 1, -1); }, "gran_k", "gran_k -1");
  expect_error([&] { cast_back_from_fp8_into(q8, sf, Tensor::empty({4, 63}, DType::f32)); }, "q", "out shape");
  expect_error([&] { cast_back_from_fp4(q4, Tensor::zeros({4, 1}, DType::f32)); }, "sf", "fp4 sf shape");
  expect_error([&] { cast_back_from_fp4(q4, Tensor::zeros({4, 2}, DType::f32), DType::f32, 1, 32, 10); }, "k", "fp4 k");
  expect_error([&] { cast_back_from_fp4(q8, sf); }, "q", "fp4 q e4m3");
  EXPECT_THROW(cast_back_from_fp8(Tensor::zeros({64, 4}, DType::e4m3).t(), sf), Error);
}

// ---------------------------------------------------------------- ISA coverage
TEST(QuantIsa, Avx512PathRunsOrIsReportedSkipped) {
  if (!isa_supported(Isa::avx512))
    GTEST_SKIP() << "AVX-512 quantisation kernels could NOT be run on this CPU (no AVX-512F/BW/VL/DQ); "
                 << "the casts were tested on " << moekit::testing::supported_isas().size() << " ISA path(s) only";
  ScopedIsa scoped(Isa::avx512);
  const Tensor x = make_input(3, 300, 1);
  EXPECT_TRUE(same_quantized(per_token_cast_to_fp8(x, false), ref::per_token_cast_to_fp8(x, false)));
}

}  // namespace
}  // namespace moekit

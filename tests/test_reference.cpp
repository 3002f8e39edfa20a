// The f64 oracle (src/reference) on hand-computed cases: every expected number below is
// written literally, with the arithmetic in the comments.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#include "moekit/formats.h"
#include "moekit/tensor.h"
#include "reference.h"

namespace {

using moekit::DType;
using moekit::Shape;
using moekit::Tensor;
namespace ref = moekit::ref;
using Layout = ref::Layout;

template <class T>
Tensor mat(int64_t rows, int64_t cols, DType dtype, const std::vector<T>& v) {
  Tensor t = Tensor::empty({rows, cols}, dtype);
  EXPECT_EQ(static_cast<int64_t>(v.size()) * static_cast<int64_t>(sizeof(T)),
            rows * cols * static_cast<int64_t>(t.element_size()));
  std::memcpy(t.data(), v.data(), v.size() * sizeof(T));
  return t;
}
Tensor f32(int64_t r, int64_t c, const std::vector<float>& v) { return mat(r, c, DType::f32, v); }
Tensor bf16(int64_t r, int64_t c, const std::vector<uint16_t>& v) { return mat(r, c, DType::bf16, v); }
Tensor e4m3(int64_t r, int64_t c, const std::vector<uint8_t>& v) { return mat(r, c, DType::e4m3, v); }
Tensor fp4(int64_t r, int64_t bytes, const std::vector<uint8_t>& v) { return mat(r, bytes, DType::e2m1x2, v); }
Tensor i32(int64_t r, int64_t c, const std::vector<int32_t>& v) { return mat(r, c, DType::i32, v); }

void expect_values(const std::vector<double>& got, const std::vector<double>& expected) {
  ASSERT_EQ(got.size(), expected.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], expected[i]) << "index " << i;
}

std::vector<uint8_t> bytes_of(const Tensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.data());
  return std::vector<uint8_t>(p, p + t.numel());
}
std::vector<float> floats_of(const Tensor& t) {
  const auto* p = t.data_ptr<float>();
  return std::vector<float>(p, p + t.numel());
}

ref::Operand op(Tensor values, Tensor sf = Tensor(), int64_t gran_mn = 1, int64_t gran_k = 128) {
  return ref::Operand{std::move(values), std::move(sf), gran_mn, gran_k};
}

// ------------------------------------------------------------------ GEMM, f32

// A [M=2, K=3] = [[1,2,3],[4,5,6]]; B [N=4, K=3] = [[1,0,-1],[2,1,0],[0,0,1],[-1,1,2]].
// D = A·Bᵀ:
//   row 0: 1-3 = -2 | 2+2 = 4 | 3 | -1+2+6 = 7
//   row 1: 4-6 = -2 | 8+5 = 13 | 6 | -4+5+12 = 13
const std::vector<float> kA = {1, 2, 3, 4, 5, 6};
const std::vector<float> kAt = {1, 4, 2, 5, 3, 6};                          // [K, M]
const std::vector<float> kB = {1, 0, -1, 2, 1, 0, 0, 0, 1, -1, 1, 2};       // [N, K]
const std::vector<float> kBt = {1, 2, 0, -1, 0, 1, 0, 1, -1, 0, 1, 2};      // [K, N]
const std::vector<double> kD = {-2, 4, 3, 7, -2, 13, 6, 13};

TEST(Reference, GemmF32AllLayouts) {
  const Tensor a = f32(2, 3, kA), at = f32(3, 2, kAt), b = f32(4, 3, kB), bt = f32(3, 4, kBt);
  expect_values(ref::gemm(Layout::nt, op(a), op(b)), kD);
  expect_values(ref::gemm(Layout::nn, op(a), op(bt)), kD);
  expect_values(ref::gemm(Layout::tn, op(at), op(bt)), kD);
  expect_values(ref::gemm(Layout::tt, op(at), op(b)), kD);
  // The transposed operands given as strided views of the row-major ones.
  expect_values(ref::gemm(Layout::tn, op(a.t()), op(b.t())), kD);
  expect_values(ref::gemm(Layout::nn, op(a), op(b.t())), kD);
  expect_values(ref::gemm(Layout::tt, op(at), op(bt.t())), kD);
  for (Layout l : {Layout::nt, Layout::nn, Layout::tn, Layout::tt}) {
    const bool a_t = l == Layout::tn || l == Layout::tt, b_n = l == Layout::nn || l == Layout::tn;
    const ref::GemmProblem p = ref::gemm_problem(l, op(a_t ? at : a), op(b_n ? bt : b));
    EXPECT_EQ(p.m, 2);
    EXPECT_EQ(p.n, 4);
    EXPECT_EQ(p.k, 3);
  }
}

TEST(Reference, GemmF32WithC) {
  // C = [[10,20,30,40],[50,60,70,80]] -> D + C = [[8,24,33,47],[48,73,76,93]].
  const Tensor c = f32(2, 4, {10, 20, 30, 40, 50, 60, 70, 80});
  const std::vector<double> expected = {8, 24, 33, 47, 48, 73, 76, 93};
  expect_values(ref::gemm(Layout::nt, op(f32(2, 3, kA)), op(f32(4, 3, kB)), c), expected);
  expect_values(ref::gemm(Layout::tn, op(f32(3, 2, kAt)), op(f32(3, 4, kBt)), c), expected);
  expect_values(ref::gemm(Layout::nn, op(f32(2, 3, kA)), op(f32(3, 4, kBt)), c), expected);
  expect_values(ref::gemm(Layout::tt, op(f32(3, 2, kAt)), op(f32(4, 3, kB)), c), expected);
}

// ------------------------------------------------------------------ GEMM, bf16

// A = [[1.5, -2, 0.25], [3, 0.5, -1]], B [N=2, K=3] = [[2, 1, 4], [-1, 0.5, 8]].
// bf16 bits: 1.5=3FC0 -2=C000 0.25=3E80 3=4040 0.5=3F00 -1=BF80 2=4000 1=3F80 4=4080 8=4100.
// D[0,0] = 3 - 2 + 1 = 2          D[0,1] = -1.5 - 1 + 2 = -0.5
// D[1,0] = 6 + 0.5 - 4 = 2.5      D[1,1] = -3 + 0.25 - 8 = -10.75
TEST(Reference, GemmBf16AllLayoutsWithAndWithoutC) {
  const Tensor a = bf16(2, 3, {0x3FC0, 0xC000, 0x3E80, 0x4040, 0x3F00, 0xBF80});
  const Tensor at = bf16(3, 2, {0x3FC0, 0x4040, 0xC000, 0x3F00, 0x3E80, 0xBF80});
  const Tensor b = bf16(2, 3, {0x4000, 0x3F80, 0x4080, 0xBF80, 0x3F00, 0x4100});
  const Tensor bt = bf16(3, 2, {0x4000, 0xBF80, 0x3F80, 0x3F00, 0x4080, 0x4100});
  const std::vector<double> d = {2, -0.5, 2.5, -10.75};
  expect_values(ref::gemm(Layout::nt, op(a), op(b)), d);
  expect_values(ref::gemm(Layout::nn, op(a), op(bt)), d);
  expect_values(ref::gemm(Layout::tn, op(at), op(bt)), d);
  expect_values(ref::gemm(Layout::tt, op(at), op(b)), d);
  // bf16 C of ones: [[3, 0.5], [3.5, -9.75]].
  const Tensor c = bf16(2, 2, {0x3F80, 0x3F80, 0x3F80, 0x3F80});
  expect_values(ref::gemm(Layout::nt, op(a), op(b), c), {3, 0.5, 3.5, -9.75});
  expect_values(ref::gemm(Layout::tt, op(at), op(b), c), {3, 0.5, 3.5, -9.75});
}

// ------------------------------------------------------------------ GEMM, scaled FP8

// gran_k = 2, K = 4: two K-groups.
// A e4m3 [2, 4] = [[1, 2, 0.5, -1], [3, 1, 1.5, 4]]
//   codes: 1=0x38 2=0x40 0.5=0x30 -1=0xB8 3=0x44 1.5=0x3C 4=0x48
// B e4m3 [2, 4] = [[1, 1, 2, 2], [0.5, -1, 1, 4]]
// sfa [M=2, 2] = [[2, 0.5], [1, 4]] (gran_mn 1); sfb [ceil(2/128)=1, 2] = [[0.25, 8]] (gran_mn 128)
// D[i,j] = Σ_g sfa[i,g]·sfb[0,g]·(Σ_{k in g} a[i,k]·b[j,k]):
//   D[0,0] = 2·0.25·(1+2)        + 0.5·8·(1-2)       = 1.5 - 4      = -2.5
//   D[0,1] = 2·0.25·(0.5-2)      + 0.5·8·(0.5-4)     = -0.75 - 14   = -14.75
//   D[1,0] = 1·0.25·(3+1)        + 4·8·(3+8)         = 1 + 352      = 353
//   D[1,1] = 1·0.25·(1.5-1)      + 4·8·(1.5+16)      = 0.125 + 560  = 560.125
const std::vector<uint8_t> kQa = {0x38, 0x40, 0x30, 0xB8, 0x44, 0x38, 0x3C, 0x48};
const std::vector<uint8_t> kQb = {0x38, 0x38, 0x40, 0x40, 0x30, 0xB8, 0x38, 0x48};
const std::vector<double> kScaledD = {-2.5, -14.75, 353, 560.125};

TEST(Reference, GemmFp8PerGroupPromotion) {
  const Tensor a = e4m3(2, 4, kQa), b = e4m3(2, 4, kQb);
  const Tensor sfa = f32(2, 2, {2, 0.5f, 1, 4}), sfb = f32(1, 2, {0.25f, 8});
  expect_values(ref::gemm(Layout::nt, op(a, sfa, 1, 2), op(b, sfb, 128, 2)), kScaledD);
  // Same problem through the other layouts (operands given as [K, MN] views; scales stay canonical).
  expect_values(ref::gemm(Layout::nn, op(a, sfa, 1, 2), op(b.t(), sfb, 128, 2)), kScaledD);
  expect_values(ref::gemm(Layout::tn, op(a.t(), sfa, 1, 2), op(b.t(), sfb, 128, 2)), kScaledD);
  expect_values(ref::gemm(Layout::tt, op(a.t(), sfa, 1, 2), op(b, sfb, 128, 2)), kScaledD);
  // With C = [[1, 2], [3, 4]].
  expect_values(ref::gemm(Layout::nt, op(a, sfa, 1, 2), op(b, sfb, 128, 2), f32(2, 2, {1, 2, 3, 4})),
                {-1.5, -12.75, 356, 564.125});
  // Unscaled (no sf): plain products [[1+2+1-2, 0.5-2+0.5-4], [3+1+3+8, 1.5-1+1.5+16]].
  expect_values(ref::gemm(Layout::nt, op(a), op(b)), {2, -5, 15, 18});
  // Only B scaled with gran_k 4 (one group): sfb [1, 1] = 3 -> 3 x the unscaled result.
  expect_values(ref::gemm(Layout::nt, op(a), op(b, f32(1, 1, {3}), 128, 4)), {6, -15, 45, 54});
}

TEST(Reference, GemmPackedUe8m0MatchesF32PowersOfTwo) {
  const Tensor a = e4m3(2, 4, kQa), b = e4m3(2, 4, kQb);
  // ue8m0 bytes: 2 -> 128 (0x80), 0.5 -> 126 (0x7E), 1 -> 127 (0x7F), 4 -> 129 (0x81),
  //              0.25 -> 125 (0x7D), 8 -> 130 (0x82); byte g of the word = group g.
  const Tensor sfa_packed = i32(2, 1, {0x00007E80, 0x0000817F});
  const Tensor sfb_packed = i32(1, 1, {0x0000827D});
  expect_values(ref::gemm(Layout::nt, op(a, sfa_packed, 1, 2), op(b, sfb_packed, 128, 2)), kScaledD);
  // Mixed: packed A scales with f32 B scales.
  expect_values(ref::gemm(Layout::nt, op(a, sfa_packed, 1, 2), op(b, f32(1, 2, {0.25f, 8}), 128, 2)), kScaledD);
  // The library's packer produces these very words from the f32 scales.
  const Tensor packed = moekit::pack_ue8m0_to_int(f32(2, 2, {2, 0.5f, 1, 4}));
  ASSERT_EQ(packed.shape(), (Shape{2, 1}));
  EXPECT_EQ(packed.data_ptr<int32_t>()[0], 0x00007E80);
  EXPECT_EQ(packed.data_ptr<int32_t>()[1], 0x0000817F);
}

// ------------------------------------------------------------------ GEMM, FP4 operand

// K = 64, gran_k = 32 (two groups), M = N = 1.
// A e4m3 [1, 64]: a[0]=2 (0x40), a[1]=4 (0x48), a[32]=1 (0x38), a[33]=3 (0x44), rest 0.
// B e2m1x2 [1, 32 bytes]: byte 0 = 0x21 -> b[0] = low nibble 1 = 0.5, b[1] = high nibble 2 = 1.0;
//   byte 16 = 0xC3 -> b[32] = 3 -> 1.5, b[33] = 0xC -> -2.0; rest 0.
// sfa = [0.5, 2], sfb = [4, 0.25].
// g0: 2·0.5 + 4·1.0 = 5 -> ·0.5·4 = 10;  g1: 1·1.5 + 3·(-2) = -4.5 -> ·2·0.25 = -2.25;  D = 7.75.
// (With the nibbles swapped it would be 4·2 + 2.5·0.5 = 9.25.)
TEST(Reference, GemmFp4OperandGranK32) {
  std::vector<uint8_t> qa(64, 0);
  qa[0] = 0x40, qa[1] = 0x48, qa[32] = 0x38, qa[33] = 0x44;
  std::vector<uint8_t> qb(32, 0);
  qb[0] = 0x21, qb[16] = 0xC3;
  const Tensor a = e4m3(1, 64, qa), b = fp4(1, 32, qb);
  const ref::GemmProblem p = ref::gemm_problem(Layout::nt, op(a), op(b));
  EXPECT_EQ(p.k, 64);
  EXPECT_EQ(p.m, 1);
  EXPECT_EQ(p.n, 1);
  const Tensor sfa = f32(1, 2, {0.5f, 2});
  expect_values(ref::gemm(Layout::nt, op(a, sfa, 1, 32), op(b, f32(1, 2, {4, 0.25f}), 1, 32)), {7.75});
  // sfb packed: 4 -> 129 (0x81) in byte 0, 0.25 -> 125 (0x7D) in byte 1.
  expect_values(ref::gemm(Layout::nt, op(a, sfa, 1, 32), op(b, i32(1, 1, {0x00007D81}), 1, 32)), {7.75});
  // FP4 x FP4: A byte 0 = 0x75 -> a[0] = 5 -> 3.0, a[1] = 7 -> 6.0; sfa = [1, 1]:
  // g0: 3·0.5 + 6·1 = 7.5 -> ·1·4 = 30; g1: 0.
  std::vector<uint8_t> qa4(32, 0);
  qa4[0] = 0x75;
  expect_values(ref::gemm(Layout::nt, op(fp4(1, 32, qa4), f32(1, 2, {1, 1}), 1, 32),
                          op(b, f32(1, 2, {4, 0.25f}), 1, 32)),
                {30});
}

// Different gran_k per operand: promotion over the common refinement of both groupings.
// a = b = 1 everywhere, sfa = {2, 3} per 2 columns, sfb = {5} per 4: 2·(2·5) + 2·(3·5) = 50.
TEST(Reference, GemmMixedGranK) {
  expect_values(ref::gemm(Layout::nt, op(f32(1, 4, {1, 1, 1, 1}), f32(1, 2, {2, 3}), 1, 2),
                          op(f32(1, 4, {1, 1, 1, 1}), f32(1, 1, {5}), 1, 4)),
                {50});
}

// An odd FP4 extent: 3 values in 2 bytes (codes 2 = 1.0, 4 = 2.0, 6 = 4.0; the fourth
// nibble is padding and must be ignored) against e4m3 {1, 1, 1} (0x38): 1 + 2 + 4 = 7.
TEST(Reference, GemmOddPackedFp4Extent) {
  ref::Operand b = op(fp4(1, 2, {0x42, 0x76}));
  b.packed_extent = 3;
  expect_values(ref::gemm(Layout::nt, op(e4m3(1, 3, {0x38, 0x38, 0x38})), b), {7});
}

TEST(Reference, GemmRejectsMismatchedK) {
  const Tensor a = f32(2, 3, kA);
  EXPECT_THROW(ref::gemm(Layout::nt, op(a), op(f32(2, 4, {1, 2, 3, 4, 5, 6, 7, 8}))), std::invalid_argument);
  EXPECT_THROW(ref::gemm(Layout::nn, op(a), op(f32(4, 2, {1, 2, 3, 4, 5, 6, 7, 8}))), std::invalid_argument);
  EXPECT_THROW(ref::gemm_problem(Layout::tn, op(f32(2, 3, kA)), op(f32(3, 2, kAt))), std::invalid_argument);
  // An e2m1x2 operand counts unpacked columns: 31 bytes = 62 values != 64.
  EXPECT_THROW(ref::gemm(Layout::nt, op(e4m3(1, 64, std::vector<uint8_t>(64, 0))), op(fp4(1, 31, std::vector<uint8_t>(31, 0)))),
               std::invalid_argument);
  // A packed FP4 extent that does not fit its stored columns.
  ref::Operand bad = op(fp4(1, 2, std::vector<uint8_t>(2, 0)));
  bad.packed_extent = 5;
  EXPECT_THROW(ref::gemm(Layout::nt, op(e4m3(1, 5, std::vector<uint8_t>(5, 0))), bad), std::invalid_argument);
  // 1-D operand.
  EXPECT_THROW(ref::gemm(Layout::nt, op(Tensor::zeros({3}, DType::f32)), op(f32(4, 3, kB))), std::invalid_argument);
}

// ------------------------------------------------------------------ element values

TEST(Reference, E4m3Values) {
  EXPECT_EQ(ref::e4m3_value(0x38), 1.0);       // e=7, m=0
  EXPECT_EQ(ref::e4m3_value(0x44), 3.0);       // e=8, m=4: 2·1.5
  EXPECT_EQ(ref::e4m3_value(0x7E), 448.0);     // e=15, m=6: 256·1.75
  EXPECT_EQ(ref::e4m3_value(0xFE), -448.0);
  EXPECT_EQ(ref::e4m3_value(0x08), 0.015625);  // min normal 2^-6
  EXPECT_EQ(ref::e4m3_value(0x07), 0.013671875);  // subnormal 7/8·2^-6
  EXPECT_EQ(ref::e4m3_value(0x01), 0.001953125);  // 2^-9
  EXPECT_EQ(ref::e4m3_value(0x00), 0.0);
  EXPECT_TRUE(std::signbit(ref::e4m3_value(0x80)));
  EXPECT_EQ(ref::e4m3_value(0x80), 0.0);
  EXPECT_TRUE(std::isnan(ref::e4m3_value(0x7F)));
  EXPECT_TRUE(std::isnan(ref::e4m3_value(0xFF)));
  EXPECT_EQ(ref::e4m3_value(0x77), 240.0);     // e=14 m=7: 128·1.875 (not NaN: only m=7 with e=15 is)
}

TEST(Reference, E5m2Values) {
  EXPECT_EQ(ref::e5m2_value(0x3C), 1.0);       // e=15
  EXPECT_EQ(ref::e5m2_value(0x7B), 57344.0);   // e=30 m=3: 32768·1.75
  EXPECT_EQ(ref::e5m2_value(0x04), 6.103515625e-05);  // 2^-14
  EXPECT_EQ(ref::e5m2_value(0x03), 4.57763671875e-05);  // 0.75·2^-14
  EXPECT_EQ(ref::e5m2_value(0x01), 1.52587890625e-05);  // 2^-16
  EXPECT_EQ(ref::e5m2_value(0xC2), -3.0);      // 1 10000 10: -2·1.5
  EXPECT_EQ(ref::e5m2_value(0xC1), -2.5);      // 1 10000 01: -2·1.25
  EXPECT_EQ(ref::e5m2_value(0x7C), std::numeric_limits<double>::infinity());
  EXPECT_EQ(ref::e5m2_value(0xFC), -std::numeric_limits<double>::infinity());
  EXPECT_TRUE(std::isnan(ref::e5m2_value(0x7D)));
  EXPECT_TRUE(std::isnan(ref::e5m2_value(0xFF)));
}

TEST(Reference, E2m1AndBf16Values) {
  const double table[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  for (uint8_t c = 0; c < 8; ++c) {
    EXPECT_EQ(ref::e2m1_value(c), table[c]) << int(c);
    EXPECT_EQ(ref::e2m1_value(static_cast<uint8_t>(c | 8)), -table[c]) << int(c);
  }
  EXPECT_EQ(ref::e2m1_value(0xF7), 6.0);  // only the low nibble counts
  EXPECT_EQ(ref::e2m1_value(0x1D), -3.0);
  EXPECT_EQ(ref::bf16_value(0x3F80), 1.0);
  EXPECT_EQ(ref::bf16_value(0xC040), -3.0);
  EXPECT_EQ(ref::bf16_value(0x3E80), 0.25);
  EXPECT_EQ(ref::bf16_value(0x7F80), std::numeric_limits<double>::infinity());
  EXPECT_EQ(ref::bf16_value(0x0001), std::ldexp(1.0, -133));  // smallest subnormal
  EXPECT_TRUE(std::isnan(ref::bf16_value(0x7FC0)));
}

// ------------------------------------------------------------------ nearest codes

TEST(Reference, NearestE4m3) {
  EXPECT_EQ(ref::nearest_e4m3(1.0), 0x38);
  EXPECT_EQ(ref::nearest_e4m3(-1.0), 0xB8);
  EXPECT_EQ(ref::nearest_e4m3(0.0), 0x00);
  EXPECT_EQ(ref::nearest_e4m3(-0.0), 0x80);
  EXPECT_EQ(ref::nearest_e4m3(0.3), 0x2A);      // [0.25, 0.5) step 1/32: 0.28125 | 0.3125 -> 0.3125, m=2
  // Ties go to the even code.
  EXPECT_EQ(ref::nearest_e4m3(1.0625), 0x38);   // 1.0 (m=0) | 1.125 (m=1)
  EXPECT_EQ(ref::nearest_e4m3(1.1875), 0x3A);   // 1.125 (m=1) | 1.25 (m=2)
  EXPECT_EQ(ref::nearest_e4m3(17.0), 0x58);     // 16 (0x58) | 18 (0x59)
  EXPECT_EQ(ref::nearest_e4m3(-336.0), 0xFA);   // 320 (m=2) | 352 (m=3)
  // Subnormals: 2^-10 is half of the smallest 2^-9; 1.5·2^-9 is between codes 1 and 2.
  EXPECT_EQ(ref::nearest_e4m3(0.0009765625), 0x00);
  EXPECT_EQ(ref::nearest_e4m3(0.0029296875), 0x02);
  EXPECT_EQ(ref::nearest_e4m3(0.0015), 0x01);
  // Top of the range and saturation.
  EXPECT_EQ(ref::nearest_e4m3(424.0), 0x7D);    // 416 | 448: nearer 416
  EXPECT_EQ(ref::nearest_e4m3(440.0), 0x7E);
  EXPECT_EQ(ref::nearest_e4m3(448.0), 0x7E);
  EXPECT_EQ(ref::nearest_e4m3(464.0), 0x7E);
  EXPECT_EQ(ref::nearest_e4m3(1e6), 0x7E);
  EXPECT_EQ(ref::nearest_e4m3(-1e6), 0xFE);
  EXPECT_EQ(ref::nearest_e4m3(std::numeric_limits<double>::infinity()), 0x7F);
  EXPECT_EQ(ref::nearest_e4m3(-std::numeric_limits<double>::infinity()), 0xFF);
  EXPECT_EQ(ref::nearest_e4m3(std::numeric_limits<double>::quiet_NaN()) & 0x7F, 0x7F);
}

TEST(Reference, NearestE5m2) {
  EXPECT_EQ(ref::nearest_e5m2(1.0), 0x3C);
  EXPECT_EQ(ref::nearest_e5m2(-2.0), 0xC0);
  EXPECT_EQ(ref::nearest_e5m2(1.125), 0x3C);    // tie 1.0 (m=0) | 1.25 (m=1)
  EXPECT_EQ(ref::nearest_e5m2(1.375), 0x3E);    // tie 1.25 (m=1) | 1.5 (m=2)
  EXPECT_EQ(ref::nearest_e5m2(57344.0), 0x7B);
  EXPECT_EQ(ref::nearest_e5m2(60000.0), 0x7B);  // below the midpoint 61440
  EXPECT_EQ(ref::nearest_e5m2(61440.0), 0x7C);  // tie 57344 (m=3) | 65536 (even) -> inf
  EXPECT_EQ(ref::nearest_e5m2(1e9), 0x7C);
  EXPECT_EQ(ref::nearest_e5m2(-1e9), 0xFC);
  EXPECT_EQ(ref::nearest_e5m2(-std::numeric_limits<double>::infinity()), 0xFC);
  const uint8_t nan = ref::nearest_e5m2(std::numeric_limits<double>::quiet_NaN());
  EXPECT_EQ((nan >> 2) & 0x1F, 0x1F);
  EXPECT_NE(nan & 3, 0);
  EXPECT_EQ(ref::nearest_e5m2(7.62939453125e-06), 0x00);  // 2^-17: tie 0 | 2^-16 -> 0
}

TEST(Reference, NearestE2m1) {
  EXPECT_EQ(ref::nearest_e2m1(0.0), 0x0);
  EXPECT_EQ(ref::nearest_e2m1(0.2), 0x0);
  EXPECT_EQ(ref::nearest_e2m1(0.25), 0x0);   // tie 0 | 0.5
  EXPECT_EQ(ref::nearest_e2m1(0.3), 0x1);
  EXPECT_EQ(ref::nearest_e2m1(0.75), 0x2);   // tie 0.5 (1) | 1.0 (2)
  EXPECT_EQ(ref::nearest_e2m1(1.25), 0x2);   // tie 1.0 (2) | 1.5 (3)
  EXPECT_EQ(ref::nearest_e2m1(1.75), 0x4);   // tie 1.5 (3) | 2 (4)
  EXPECT_EQ(ref::nearest_e2m1(2.5), 0x4);    // tie 2 (4) | 3 (5)
  EXPECT_EQ(ref::nearest_e2m1(3.5), 0x6);    // tie 3 (5) | 4 (6)
  EXPECT_EQ(ref::nearest_e2m1(5.0), 0x6);    // tie 4 (6) | 6 (7)
  EXPECT_EQ(ref::nearest_e2m1(5.1), 0x7);
  EXPECT_EQ(ref::nearest_e2m1(7.0), 0x7);    // saturates
  EXPECT_EQ(ref::nearest_e2m1(1e30), 0x7);
  EXPECT_EQ(ref::nearest_e2m1(-100.0), 0xF);
  EXPECT_EQ(ref::nearest_e2m1(-0.75), 0xA);
  EXPECT_EQ(ref::nearest_e2m1(-3.0), 0xD);
  EXPECT_EQ(ref::nearest_e2m1(std::numeric_limits<double>::quiet_NaN()), 0x7);  // NaN -> +6
}

TEST(Reference, NearestBf16) {
  EXPECT_EQ(ref::nearest_bf16(1.0), 0x3F80);
  EXPECT_EQ(ref::nearest_bf16(-2.0), 0xC000);
  EXPECT_EQ(ref::nearest_bf16(1.00390625), 0x3F80);   // 1 + 2^-8: tie 3F80 | 3F81 -> even
  EXPECT_EQ(ref::nearest_bf16(1.01171875), 0x3F82);   // 1 + 3·2^-8: tie 3F81 | 3F82 -> even
  EXPECT_EQ(ref::nearest_bf16(1.0039072036743164), 0x3F81);  // 1 + 2^-8 + 2^-20: above the tie
  EXPECT_EQ(ref::nearest_bf16(3.4028234663852886e38), 0x7F80);  // FLT_MAX rounds up to inf
  EXPECT_EQ(ref::nearest_bf16(std::numeric_limits<double>::infinity()), 0x7F80);
  EXPECT_EQ(ref::nearest_bf16(std::numeric_limits<double>::quiet_NaN()), 0x7FC0);
}

TEST(Reference, NearestRoundTripsEveryCode) {
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<uint8_t>(c);
    if ((c & 0x7F) != 0x7F) {
      EXPECT_EQ(ref::nearest_e4m3(ref::e4m3_value(code)), code) << c;
    }
    if (((c >> 2) & 0x1F) != 0x1F || (c & 3) == 0) {
      EXPECT_EQ(ref::nearest_e5m2(ref::e5m2_value(code)), code) << c;
    }
  }
  for (uint8_t c = 0; c < 16; ++c) EXPECT_EQ(ref::nearest_e2m1(ref::e2m1_value(c)), c) << int(c);
  // Positive e4m3 codes are strictly increasing in value.
  for (int c = 1; c < 0x7F; ++c) EXPECT_LT(ref::e4m3_value(static_cast<uint8_t>(c - 1)), ref::e4m3_value(static_cast<uint8_t>(c))) << c;
}

// ------------------------------------------------------------------ quantisers

TEST(Reference, PerTokenFp8) {
  // Row 0: amax 448 -> sf 1: codes 448=0x7E, 224=0x76 (e=14 m=6), -112=0xEE (e=13 m=6), 1=0x38.
  // Row 1: amax 300 -> sf = 300/448 (f32); x/sf = [448, -224, 112, 0] -> 0x7E, 0xF6, 0x6E, 0x00.
  const Tensor x = f32(2, 4, {448, 224, -112, 1, 300, -150, 75, 0});
  const moekit::Quantized q = ref::per_token_cast_to_fp8(x, false, 4);
  ASSERT_EQ(q.values.shape(), (Shape{2, 4}));
  ASSERT_EQ(q.sf.shape(), (Shape{2, 1}));
  EXPECT_EQ(q.values.dtype(), DType::e4m3);
  EXPECT_EQ(floats_of(q.sf), (std::vector<float>{1.0f, 300.0f / 448.0f}));
  EXPECT_EQ(bytes_of(q.values), (std::vector<uint8_t>{0x7E, 0x76, 0xEE, 0x38, 0x7E, 0xF6, 0x6E, 0x00}));
}

TEST(Reference, PerTokenFp8Ue8m0) {
  // Row 1: 300/448 = 0.6696 -> 2^ceil(log2) = 2^0 = 1. Codes of x/1:
  //   300 in [256, 512) step 32: 288 | 320 -> 288 = 0x79; -150 in [128, 256) step 16: 144 -> 0xF1;
  //   75 in [64, 128) step 8: 72 -> 0x69.
  const Tensor x = f32(2, 4, {448, 224, -112, 1, 300, -150, 75, 0});
  const moekit::Quantized q = ref::per_token_cast_to_fp8(x, true, 4);
  EXPECT_EQ(floats_of(q.sf), (std::vector<float>{1.0f, 1.0f}));
  EXPECT_EQ(bytes_of(q.values), (std::vector<uint8_t>{0x7E, 0x76, 0xEE, 0x38, 0x79, 0xF1, 0x69, 0x00}));
  // Round up, not to nearest: amax 500 -> 500/448 = 1.116 -> 2; amax 896 -> exactly 2 stays 2.
  const moekit::Quantized r = ref::per_token_cast_to_fp8(f32(2, 2, {500, 1, -896, 3}), true, 2);
  EXPECT_EQ(floats_of(r.sf), (std::vector<float>{2.0f, 2.0f}));
  // 500/2 = 250 -> [240, 256]: 256 = 0x78; 0.5 = 0x30; -448 = 0xFE; 1.5 = 0x3C.
  EXPECT_EQ(bytes_of(r.values), (std::vector<uint8_t>{0x78, 0x30, 0xFE, 0x3C}));
}

TEST(Reference, PerTokenFp8ZeroAndTinyRows) {
  // amax clamped below at 1e-4: sf = 1e-4f / 448 (f32 division).
  const Tensor x = f32(2, 4, {0, 0, 0, 0, 5e-5f, 0, 0, 0});
  const moekit::Quantized q = ref::per_token_cast_to_fp8(x, false, 4);
  EXPECT_EQ(floats_of(q.sf), (std::vector<float>{1e-4f / 448.0f, 1e-4f / 448.0f}));
  // 5e-5 / (1e-4/448) = 224 -> 0x76.
  EXPECT_EQ(bytes_of(q.values), (std::vector<uint8_t>{0, 0, 0, 0, 0x76, 0, 0, 0}));
  // ue8m0: 1e-4/448 = 2.23e-7, between 2^-23 = 1.19e-7 and 2^-22 = 2.38e-7 -> 2^-22.
  const moekit::Quantized u = ref::per_token_cast_to_fp8(x, true, 4);
  EXPECT_EQ(floats_of(u.sf), (std::vector<float>{2.384185791015625e-07f, 2.384185791015625e-07f}));
  // 5e-5 / 2^-22 = 209.7 -> [192, 224] step 16: 208 (m=5) -> 0 1110 101 = 0x75.
  EXPECT_EQ(bytes_of(u.values)[4], 0x75);
}

TEST(Reference, PerTokenFp8PartialLastGroup) {
  // K = 5, gran 4: groups [224, 56, 168, -7] (amax 224 -> sf 0.5) and [14] (sf 14/448 = 2^-5).
  // x/sf: 448 -> 0x7E, 112 -> 0x6E, 336 -> tie 320 (m=2) | 352 -> 0x7A, -14 -> 0xD6 (e=10 m=6),
  //       14/2^-5 = 448 -> 0x7E.
  const Tensor x = f32(1, 5, {224, 56, 168, -7, 14});
  const moekit::Quantized q = ref::per_token_cast_to_fp8(x, false, 4);
  ASSERT_EQ(q.sf.shape(), (Shape{1, 2}));
  EXPECT_EQ(floats_of(q.sf), (std::vector<float>{0.5f, 0.03125f}));
  EXPECT_EQ(bytes_of(q.values), (std::vector<uint8_t>{0x7E, 0x6E, 0x7A, 0xD6, 0x7E}));
  // bf16 input with the same values as row 0 of PerTokenFp8: 448=43E0 224=4360 -112=C2E0 1=3F80.
  const moekit::Quantized b = ref::per_token_cast_to_fp8(bf16(1, 4, {0x43E0, 0x4360, 0xC2E0, 0x3F80}), false, 4);
  EXPECT_EQ(floats_of(b.sf), (std::vector<float>{1.0f}));
  EXPECT_EQ(bytes_of(b.values), (std::vector<uint8_t>{0x7E, 0x76, 0xEE, 0x38}));
}

TEST(Reference, PerBlockFp8) {
  // x [3, 3], blocks 2x2 -> sf [2, 2]:
  //   b00 {224, -56, -112, 28} amax 224 -> 0.5;  b01 {448, 7} -> 1;  b10 {896, 1} -> 2;  b11 {0} -> 1e-4/448.
  // codes: row0 448->7E, -112->EE, 448->7E; row1 -224->F6, 56->66 (e=12 m=6), 7->4E (e=9 m=6);
  //        row2 448->7E, 0.5->30, 0->00.
  const Tensor x = f32(3, 3, {224, -56, 448, -112, 28, 7, 896, 1, 0});
  const moekit::Quantized q = ref::per_block_cast_to_fp8(x, false, 2, 2);
  ASSERT_EQ(q.sf.shape(), (Shape{2, 2}));
  EXPECT_EQ(floats_of(q.sf), (std::vector<float>{0.5f, 1.0f, 2.0f, 1e-4f / 448.0f}));
  const std::vector<uint8_t> codes = {0x7E, 0xEE, 0x7E, 0xF6, 0x66, 0x4E, 0x7E, 0x30, 0x00};
  EXPECT_EQ(bytes_of(q.values), codes);
  const moekit::Quantized u = ref::per_block_cast_to_fp8(x, true, 2, 2);
  EXPECT_EQ(floats_of(u.sf), (std::vector<float>{0.5f, 1.0f, 2.0f, 2.384185791015625e-07f}));
  EXPECT_EQ(bytes_of(u.values), codes);
}

TEST(Reference, PerChannelFp8) {
  // x [K=3, MN=2], gran_k 2 along K -> sf [2, 2]:
  //   col 0 rows 0-1 {112, -224} -> 0.5; col 1 rows 0-1 {-448, 14} -> 1;
  //   col 0 row 2 {56} -> 0.125; col 1 row 2 {0} -> 1e-4/448.
  // codes: 224->76, -448->FE; -448->FE, 14->56 (e=10 m=6); 448->7E, 0->00.
  const Tensor x = f32(3, 2, {112, -448, -224, 14, 56, 0});
  const moekit::Quantized q = ref::per_channel_cast_to_fp8(x, false, 2);
  ASSERT_EQ(q.sf.shape(), (Shape{2, 2}));
  EXPECT_EQ(floats_of(q.sf), (std::vector<float>{0.5f, 1.0f, 0.125f, 1e-4f / 448.0f}));
  EXPECT_EQ(bytes_of(q.values), (std::vector<uint8_t>{0x76, 0xFE, 0xFE, 0x56, 0x7E, 0x00}));
}

TEST(Reference, PerTokenFp4) {
  // gran 4: g0 [6, -3, 1.5, 0.75] amax 6 -> sf 1: codes 7, D, 3, tie(0.5|1.0)->2.
  //         g1 [12, 2, -5, 0.5] amax 12 -> sf 2: [6, 1, -2.5, 0.25] -> 7, 2, tie(2|3)->C, tie(0|0.5)->0.
  // bytes (even index low): D7, 23, 27, 0C.
  const Tensor x = f32(1, 8, {6, -3, 1.5f, 0.75f, 12, 2, -5, 0.5f});
  const moekit::Quantized q = ref::per_token_cast_to_fp4(x, false, 4);
  EXPECT_EQ(q.values.dtype(), DType::e2m1x2);
  ASSERT_EQ(q.values.shape(), (Shape{1, 4}));
  EXPECT_EQ(floats_of(q.sf), (std::vector<float>{1.0f, 2.0f}));
  EXPECT_EQ(bytes_of(q.values), (std::vector<uint8_t>{0xD7, 0x23, 0x27, 0x0C}));
  // Odd K = 3: [1, 2, 3] amax 3 -> sf 0.5: [2, 4, 6] -> 4, 6, 7 -> bytes 64, 07.
  const moekit::Quantized o = ref::per_token_cast_to_fp4(f32(1, 3, {1, 2, 3}), false, 4);
  ASSERT_EQ(o.values.shape(), (Shape{1, 2}));
  EXPECT_EQ(floats_of(o.sf), (std::vector<float>{0.5f}));
  EXPECT_EQ(bytes_of(o.values), (std::vector<uint8_t>{0x64, 0x07}));
}

TEST(Reference, PerTokenFp4Ue8m0) {
  // [5, -2.5, 1, 0]: sf = 5/6; ue8m0 -> 2^ceil(log2 0.833) = 1.
  //   ue8m0: 5 tie(4|6) -> 6, -2.5 tie(2|3) -> C, 1 -> 2, 0 -> 0: bytes C6, 02.
  //   f32 sf: x/sf = [6, -3, 1.2, 0] -> 7, D, 2, 0: bytes D7, 02.
  const Tensor x = f32(1, 4, {5, -2.5f, 1, 0});
  const moekit::Quantized u = ref::per_token_cast_to_fp4(x, true, 4);
  EXPECT_EQ(floats_of(u.sf), (std::vector<float>{1.0f}));
  EXPECT_EQ(bytes_of(u.values), (std::vector<uint8_t>{0xC6, 0x02}));
  const moekit::Quantized f = ref::per_token_cast_to_fp4(x, false, 4);
  EXPECT_EQ(floats_of(f.sf), (std::vector<float>{5.0f / 6.0f}));
  EXPECT_EQ(bytes_of(f.values), (std::vector<uint8_t>{0xD7, 0x02}));
  // All-zero: sf = 1e-4f / 6.
  EXPECT_EQ(floats_of(ref::per_token_cast_to_fp4(f32(1, 2, {0, 0}), false, 32).sf), (std::vector<float>{1e-4f / 6.0f}));
}

// ------------------------------------------------------------------ dequantize

TEST(Reference, DequantizeFp8) {
  // q = [[1, 2, -1], [0.5, 448, 0]]; sf [2, 2] gran_k 2 = [[2, 0.5], [4, 0.25]]:
  //   [[2, 4, -0.5], [2, 1792, 0]].
  const Tensor q = e4m3(2, 3, {0x38, 0x40, 0xB8, 0x30, 0x7E, 0x00});
  expect_values(ref::dequantize(q, f32(2, 2, {2, 0.5f, 4, 0.25f}), 1, 2, 3), {2, 4, -0.5, 2, 1792, 0});
  // gran_m 2: both rows use sf row 0 = [2, 0.5]: [[2, 4, -0.5], [1, 896, 0]].
  expect_values(ref::dequantize(q, f32(1, 2, {2, 0.5f}), 2, 2, 3), {2, 4, -0.5, 1, 896, 0});
  // Packed ue8m0: row 0 (2 -> 0x80, 0.5 -> 0x7E), row 1 (4 -> 0x81, 0.25 -> 0x7D).
  expect_values(ref::dequantize(q, i32(2, 1, {0x00007E80, 0x00007D81}), 1, 2, 3), {2, 4, -0.5, 2, 1792, 0});
}

TEST(Reference, DequantizeFp4) {
  // bytes D7, 03 -> values [6, -3, 1.5, 0]; k = 3, gran_k 2, sf [2, 0.5]: [12, -6, 0.75].
  const Tensor q = fp4(1, 2, {0xD7, 0x03});
  expect_values(ref::dequantize(q, f32(1, 2, {2, 0.5f}), 1, 2, 3), {12, -6, 0.75});
  expect_values(ref::dequantize(q, f32(1, 1, {-1}), 1, 32, 4), {-6, 3, -1.5, -0.0});
}

// ------------------------------------------------------------------ value_at, conversions, calc_diff

TEST(Reference, ValueAtAnyStridesAndDtypes) {
  const Tensor a = f32(2, 3, kA);
  EXPECT_EQ(ref::value_at(a, 1, 2), 6.0);
  EXPECT_EQ(ref::value_at(a.t(), 2, 1), 6.0);
  EXPECT_EQ(ref::value_at(a.slice(1, 1, 3), 0, 1), 3.0);
  EXPECT_EQ(ref::value_at(bf16(1, 2, {0x3F80, 0xC040}), 0, 1), -3.0);
  EXPECT_EQ(ref::value_at(mat(1, 1, DType::e5m2, std::vector<uint8_t>{0x7B}), 0, 0), 57344.0);
  const Tensor q = fp4(2, 1, {0x5A, 0x71});  // row 0: [-1 (A), 3 (5)]; row 1: [0.5 (1), 6 (7)]
  EXPECT_EQ(ref::value_at(q, 0, 0), -1.0);
  EXPECT_EQ(ref::value_at(q, 0, 1), 3.0);
  EXPECT_EQ(ref::value_at(q, 1, 0), 0.5);
  EXPECT_EQ(ref::value_at(q, 1, 1), 6.0);
  expect_values(ref::to_f64(q), {-1, 3, 0.5, 6});
  EXPECT_THROW(ref::value_at(i32(1, 1, {1}), 0, 0), std::invalid_argument);
}

TEST(Reference, ToTensorRoundsToNearestEven) {
  const Tensor b = ref::to_tensor({1.00390625, 1.01171875, -2.0, 0.1}, 2, 2, DType::bf16);
  ASSERT_EQ(b.shape(), (Shape{2, 2}));
  const auto* bits = b.data_ptr<uint16_t>();
  EXPECT_EQ(bits[0], 0x3F80);
  EXPECT_EQ(bits[1], 0x3F82);
  EXPECT_EQ(bits[2], 0xC000);
  EXPECT_EQ(bits[3], 0x3DCD);  // 0.1f = 0x3DCCCCCD -> 3DCC | CCCD > 8000 -> 3DCD
  const Tensor f = ref::to_tensor({0.1, -3.5}, 1, 2, DType::f32);
  EXPECT_EQ(f.data_ptr<float>()[0], 0.1f);
  EXPECT_EQ(f.data_ptr<float>()[1], -3.5f);
  EXPECT_THROW(ref::to_tensor({1, 2, 3}, 2, 2, DType::f32), std::invalid_argument);
  EXPECT_THROW(ref::to_tensor({1}, 1, 1, DType::e4m3), std::invalid_argument);
}

TEST(Reference, CalcDiff) {
  EXPECT_EQ(ref::calc_diff({1, 2}, {1, 2}), 0.0);
  EXPECT_EQ(ref::calc_diff({1, 0}, {0, 1}), 1.0);      // Σxy = 0
  EXPECT_EQ(ref::calc_diff({1}, {-1}), 2.0);           // 1 - 2·(-1)/2
  EXPECT_DOUBLE_EQ(ref::calc_diff({3, 4}, {3, 0}), 8.0 / 17.0);  // Σxy = 9, Σ = 25 + 9: 1 - 18/34
  EXPECT_DOUBLE_EQ(ref::calc_diff({2, 0}, {1, 0}), 0.2);          // 1 - 4/5
  EXPECT_DOUBLE_EQ(ref::calc_diff({1, 1}, {2, 2}), 0.2);          // Σxy = 4, Σ = 2 + 8: 1 - 8/10
  EXPECT_EQ(ref::calc_diff({0, 0}, {0, 0}), 0.0);
  EXPECT_EQ(ref::calc_diff({}, {}), 0.0);
  EXPECT_THROW(ref::calc_diff({1, 2}, {1}), std::invalid_argument);
}

}  // namespace

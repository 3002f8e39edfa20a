// A systematic bad-input sweep over every public function of moekit/formats.h: each bad
// argument must raise moekit::Error naming that argument, and nothing may crash or write
// out of bounds (these tests also run under ASan/UBSan).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "moekit/error.h"
#include "moekit/formats.h"
#include "moekit/tensor.h"
#include "test_util.h"

namespace {

using moekit::Device;
using moekit::DType;
using moekit::Shape;
using moekit::Tensor;


constexpr int64_t M = 4, K = 256;

// Owned storage for the bad inputs (every tensor below stays valid while the sweep runs).
struct Bad {
  // The bad variants of a 2-D operand of dtype `dt` and shape [rows, cols]:
  // name -> tensor. Each one is bad for any function expecting a CPU matrix of that shape.
  std::vector<std::pair<std::string, Tensor>> variants(int64_t rows, int64_t cols, DType dt, DType wrong_dtype) {
    std::vector<std::pair<std::string, Tensor>> v;
    v.emplace_back("undefined", Tensor());
    v.emplace_back("wrong dtype", Tensor::zeros({rows, cols}, wrong_dtype));
    v.emplace_back("rank 1", Tensor::zeros({rows * cols}, dt));
    v.emplace_back("rank 3", Tensor::zeros({rows, cols, 1}, dt));
    v.emplace_back("rank 0", Tensor::zeros({}, dt));
    // Non-unit last stride: every other column of a [rows, 2*cols] buffer.
    v.emplace_back("strided last dim", Tensor::zeros({rows, 2 * cols}, dt).slice(1, 0, 2 * cols, 2));
    // Right shape and dtype, but labelled as GPU memory (the bytes are host memory).
    keep.push_back(Tensor::zeros({rows, cols}, dt));
    v.emplace_back("cuda device", Tensor::from_blob(keep.back().data(), {rows, cols}, dt, Device::cuda(0)));
    return v;
  }
  std::vector<Tensor> keep;
};

Tensor filled(const Shape& shape, float value) {
  Tensor t = Tensor::empty(shape, DType::f32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data_ptr<float>()[i] = value + static_cast<float>(i % 7);
  return t;
}

// ------------------------------------------------------------------ from_blob / null data

TEST(Errors, NullDataIsRejectedAtFromBlob) {
  EXPECT_MOEKIT_ERROR_ARG(Tensor::from_blob(static_cast<void*>(nullptr), {M, K}, DType::f32), "data");
  EXPECT_MOEKIT_ERROR_ARG(Tensor::from_blob(static_cast<const void*>(nullptr), {1}, DType::e4m3), "data");
  // Zero elements: a null pointer is fine, and the casts accept the empty tensor.
  const Tensor empty = Tensor::from_blob(static_cast<void*>(nullptr), {0, K}, DType::f32);
  const moekit::Quantized q = moekit::per_token_cast_to_fp8(empty, false);
  EXPECT_EQ(q.values.shape(), (Shape{0, K}));
  EXPECT_EQ(q.sf.shape(), (Shape{0, 2}));
}

// Strides whose furthest element lies 2^63 bytes or more away are refused at from_blob: views
// and kernels form byte offsets index · stride · element size in int64 (UB past it).
TEST(Errors, FromBlobStridesBeyondInt64Raise) {
  float x[4] = {};
  const int64_t huge = int64_t{1} << 62;
  EXPECT_MOEKIT_ERROR_ARG(Tensor::from_blob(x, {4}, DType::f32, Device::cpu(), {huge}), "strides");  // 3·2^62·4 bytes
  EXPECT_MOEKIT_ERROR_ARG(Tensor::from_blob(x, {2, 2}, DType::f32, Device::cpu(), {huge / 4, huge / 4}), "strides");  // 2^62 + 2^62
  // An empty tensor's other extents count too (a select on them forms the offset).
  EXPECT_MOEKIT_ERROR_ARG(Tensor::from_blob(x, {0, 3}, DType::f32, Device::cpu(), {1, huge}), "strides");
  // At the limit: the last bf16 element of {2} ending at byte 2^63 - 2 is fine, at 2^63 not.
  EXPECT_MOEKIT_ERROR_ARG(Tensor::from_blob(x, {2}, DType::bf16, Device::cpu(), {huge - 1}), "strides");
  const Tensor edge = Tensor::from_blob(x, {2}, DType::bf16, Device::cpu(), {huge - 2});
  EXPECT_EQ(edge.stride(0), huge - 2);  // (its second element, 2^63 - 4 bytes on, is not formed here)
  const Tensor t = Tensor::from_blob(x, {2, 3}, DType::bf16, Device::cpu(), {huge / 2 - 1, 1});
  EXPECT_EQ(static_cast<const char*>(t.select(1, 2).data()) - static_cast<const char*>(t.data()), 4);
  const Tensor empty = Tensor::from_blob(x, {0, 3}, DType::u8, Device::cpu(), {huge, 1});  // extent 0: no reach
  EXPECT_EQ(empty.select(1, 2).numel(), 0);
  // Default (row-major) strides: an empty tensor's other extents are bounded as if they held
  // elements (their strides are products of the later extents).
  EXPECT_MOEKIT_ERROR_ARG(Tensor::from_blob(x, {0, int64_t{1} << 40, int64_t{1} << 40}, DType::f32), "shape");
  EXPECT_MOEKIT_ERROR_ARG(Tensor::from_blob(x, {0, huge}, DType::f32), "shape");
  EXPECT_MOEKIT_ERROR_ARG(Tensor::empty({0, huge}, DType::f32), "shape");
  EXPECT_EQ(Tensor::empty({0, int64_t{1} << 40}, DType::f32).select(1, (int64_t{1} << 40) - 1).numel(), 0);
}

// ------------------------------------------------------------------ outputs over inputs

// A cast's outputs must hold distinct elements and lie apart from its input and from each
// other (the scales are written before the codes are made from x; rows are written while
// later rows are read): every overlap raises on the output's name and writes nothing.
TEST(Errors, CastOutputsOverlappingInputsRaise) {
  const int64_t m = 8, k = 256;
  std::vector<float> buf(4 * m * k, 1.0f);  // one slab: x, then room for views over it
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = 0.25f + static_cast<float>(i % 7);
  const std::vector<float> before = buf;
  char* base = reinterpret_cast<char*>(buf.data());
  const Tensor x = Tensor::from_blob(base, {m, k}, DType::f32);
  const Tensor q_over_x = Tensor::from_blob(base + k, {m, k}, DType::e4m3);   // inside x's rows
  const Tensor sf_over_x = Tensor::from_blob(base + 64, {m, 2}, DType::f32);  // inside x's row 0
  const Tensor q = Tensor::empty({m, k}, DType::e4m3), sf = Tensor::empty({m, 2}, DType::f32);
  const Tensor q_over_sf = Tensor::from_blob(sf.data(), {2, 4}, DType::e4m3);
  using moekit::per_token_cast_to_fp8_into;
  EXPECT_MOEKIT_ERROR_ARG(per_token_cast_to_fp8_into(x, q_over_x, sf, false), "q");
  EXPECT_MOEKIT_ERROR_ARG(per_token_cast_to_fp8_into(x, q, sf_over_x, false), "sf");
  EXPECT_MOEKIT_ERROR_ARG(per_token_cast_to_fp8_into(x.slice(0, 0, 2).slice(1, 0, 4), q_over_sf, sf.slice(0, 0, 2).slice(1, 0, 1), false, 4), "q");
  // q overlapping itself (a zero row stride)
  EXPECT_MOEKIT_ERROR_ARG(per_token_cast_to_fp8_into(x, Tensor::from_blob(q.data(), {m, k}, DType::e4m3, Device::cpu(), {0, 1}), sf, false), "q");
  EXPECT_MOEKIT_ERROR_ARG(moekit::per_token_cast_to_fp4_into(x, Tensor::from_blob(base + 2 * k, {m, k / 2}, DType::e2m1x2), Tensor::empty({m, 8}, DType::f32), true, 32), "q");
  EXPECT_MOEKIT_ERROR_ARG(moekit::per_block_cast_to_fp8_into(x, q_over_x, Tensor::empty({1, 2}, DType::f32), false), "q");
  EXPECT_MOEKIT_ERROR_ARG(moekit::per_block_cast_to_fp8_into(x, q, Tensor::from_blob(base, {1, 2}, DType::f32), false), "sf");
  EXPECT_MOEKIT_ERROR_ARG(moekit::per_channel_cast_to_fp8_into(x, q_over_x, Tensor::empty({1, k}, DType::f32), false, 128), "q");
  EXPECT_MOEKIT_ERROR_ARG(moekit::per_channel_cast_to_fp8_into(x, q, Tensor::from_blob(base + 4 * k, {1, k}, DType::f32), false, 128), "sf");
  EXPECT_EQ(buf, before) << "a refused cast wrote into its input";
  // Dequantisation: out over q or over sf.
  const moekit::Quantized qz = moekit::per_token_cast_to_fp8(x, false);
  std::vector<float> slab(2 * m * k, 0.0f);  // q's codes, then an f32 out starting inside them
  std::memcpy(slab.data(), qz.values.data(), static_cast<size_t>(m * k));
  const Tensor q_in_slab = Tensor::from_blob(slab.data(), {m, k}, DType::e4m3);
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8_into(q_in_slab, qz.sf, Tensor::from_blob(slab.data() + 64, {m, k}, DType::f32), 1, 128), "out");
  const Tensor wide_out = Tensor::empty({m, k}, DType::f32);
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8_into(qz.values, Tensor::from_blob(wide_out.data(), {m, 2}, DType::f32), wide_out, 1, 128), "out");
  // convert: dst over src refused unless it is the same view (a copy onto itself).
  EXPECT_MOEKIT_ERROR_ARG(moekit::convert(x, Tensor::from_blob(base + 2 * k, {m, k}, DType::bf16)), "dst");
  moekit::convert(x, x);
  EXPECT_EQ(buf, before);
}

// ------------------------------------------------------------------ per-token fp8

TEST(Errors, PerTokenCastToFp8) {
  Bad bad;
  const Tensor x = filled({M, K}, 1.0f);
  for (auto& [what, t] : bad.variants(M, K, DType::f32, DType::i32)) {
    SCOPED_TRACE(what);
    EXPECT_MOEKIT_ERROR_ARG(moekit::per_token_cast_to_fp8(t, false), "x");
    EXPECT_MOEKIT_ERROR_ARG(moekit::per_token_cast_to_fp8(t, true, 64), "x");
  }
  EXPECT_MOEKIT_ERROR_ARG(moekit::per_token_cast_to_fp8(Tensor::zeros({M, K}, DType::e4m3), false), "x");
  for (int64_t g : {int64_t{0}, int64_t{-1}, int64_t{-128}}) {
    SCOPED_TRACE(g);
    EXPECT_MOEKIT_ERROR_ARG(moekit::per_token_cast_to_fp8(x, false, g), "gran_k");
  }
  // Sanity: the good call works.
  EXPECT_NO_THROW(moekit::per_token_cast_to_fp8(x, false));
}

TEST(Errors, PerTokenCastToFp8Into) {
  Bad bad;
  const Tensor x = filled({M, K}, 1.0f);
  const Tensor q = Tensor::zeros({M, K}, DType::e4m3);
  const Tensor sf = Tensor::zeros({M, 2}, DType::f32);
  EXPECT_NO_THROW(moekit::per_token_cast_to_fp8_into(x, q, sf, false));
  for (auto& [what, t] : bad.variants(M, K, DType::f32, DType::e4m3)) {
    SCOPED_TRACE("x: " + what);
    EXPECT_MOEKIT_ERROR_ARG(moekit::per_token_cast_to_fp8_into(t, q, sf, false), "x");
  }
  for (auto& [what, t] : bad.variants(M, K, DType::e4m3, DType::e5m2)) {
    SCOPED_TRACE("q: " + what);
    EXPECT_MOEKIT_ERROR_ARG(moekit::per_token_cast_to_fp8_into(x, t, sf, false), "q");
  }
  for (auto& [what, t] : bad.variants(M, 2, DType::f32, DType::i32)) {
    SCOPED_TRACE("sf: " + what);
    EXPECT_MOEKIT_ERROR_ARG(moekit::per_token_cast_to_fp8_into(x, q, t, false), "sf");
  }
  EXPECT_MOEKIT_ERROR_ARG(moekit::per_token_cast_to_fp8_into(x, Tensor::zeros({M, K - 1}, DType::e4m3), sf, false), "q");
  EXPECT_MOEKIT_ERROR_ARG(moekit::per_token_cast_to_fp8_into(x, Tensor::zeros({M + 1, K}, DType::e4m3), sf, false), "q");
  EXPECT_MOEKIT_ERROR_ARG(moekit::per_token_cast_to_fp8_into(x, q, Tensor::zeros({M, 3}, DType::f32), false), "sf");
  EXPECT_MOEKIT_ERROR_ARG(moekit::per_token_cast_to_fp8_into(x, q, Tensor::zeros({M, 1}, DType::f32), false), "sf");
  // sf shaped for gran 128, call with gran 64.
  EXPECT_MOEKIT_ERROR_ARG(moekit::per_token_cast_to_fp8_into(x, q, sf, false, 64), "sf");
  EXPECT_MOEKIT_ERROR_ARG(moekit::per_token_cast_to_fp8_into(x, q, sf, false, 0), "gran_k");
  EXPECT_MOEKIT_ERROR_ARG(moekit::per_token_cast_to_fp8_into(x, q, sf, true, -128), "gran_k");
}

// Huge (but positive) granularities and counts: each is a legal value (a group larger than
// the data is one partial group), so the call must either work with the right shapes or
// raise moekit::Error naming the argument. Values near INT64_MAX must not overflow the
// ceil-divisions of the scale shapes (signed overflow: UB, and wrong shapes in practice).
TEST(Errors, HugeCountsDoNotOverflow) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  const Tensor x = filled({2, 8}, 1.0f);
  auto works_or_names = [](const std::function<void()>& call, const char* arg, const char* what) {
    try {
      call();
    } catch (const moekit::Error& e) {
      EXPECT_EQ(e.argument(), arg) << what << ": " << e.what();
    }
  };
  for (int64_t g : {int64_t{1} << 40, kMax - 1, kMax}) {
    SCOPED_TRACE(g);
    works_or_names([&] { EXPECT_EQ(moekit::per_token_cast_to_fp8(x, false, g).sf.shape(), (Shape{2, 1})); },
                   "gran_k", "per_token_cast_to_fp8");
    works_or_names([&] { EXPECT_EQ(moekit::per_token_cast_to_fp4(x, false, g - g % 2).sf.shape(), (Shape{2, 1})); },
                   "gran_k", "per_token_cast_to_fp4");
    works_or_names([&] { EXPECT_EQ(moekit::per_block_cast_to_fp8(x, false, g, 4).sf.shape(), (Shape{1, 2})); },
                   "block_m", "per_block_cast_to_fp8 block_m");
    works_or_names([&] { EXPECT_EQ(moekit::per_block_cast_to_fp8(x, false, 1, g).sf.shape(), (Shape{2, 1})); },
                   "block_k", "per_block_cast_to_fp8 block_k");
    works_or_names([&] { EXPECT_EQ(moekit::per_channel_cast_to_fp8(x, false, g).sf.shape(), (Shape{1, 8})); },
                   "gran_k", "per_channel_cast_to_fp8");
    // One scale for the whole [2, 8] block.
    const Tensor q = Tensor::zeros({2, 8}, DType::e4m3);
    const Tensor sf11 = filled({1, 1}, 2.0f);
    works_or_names([&] { EXPECT_EQ(moekit::cast_back_from_fp8(q, sf11, DType::f32, g, g).shape(), (Shape{2, 8})); },
                   "gran_m", "cast_back_from_fp8");
  }
  // Counts that cannot match are rejected (and computing ceil(count/4) must not overflow).
  EXPECT_MOEKIT_ERROR_ARG(moekit::unpack_ue8m0_from_int(Tensor::zeros({1, 2}, DType::i32), kMax), "groups");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp4(Tensor::zeros({1, 2}, DType::e2m1x2), filled({1, 1}, 1.0f), DType::f32, 1, 32, kMax), "k");
}

// ------------------------------------------------------------------ per-block fp8

TEST(Errors, PerBlockCastToFp8) {
  Bad bad;
  const Tensor x = filled({M, K}, 1.0f);
  EXPECT_NO_THROW(moekit::per_block_cast_to_fp8(x, false));
  for (auto& [what, t] : bad.variants(M, K, DType::bf16, DType::e5m2)) {
    SCOPED_TRACE(what);
    EXPECT_MOEKIT_ERROR_ARG(moekit::per_block_cast_to_fp8(t, false), "x");
  }
  EXPECT_MOEKIT_ERROR_ARG(moekit::per_block_cast_to_fp8(x, false, 0, 128), "block_m");
  EXPECT_MOEKIT_ERROR_ARG(moekit::per_block_cast_to_fp8(x, false, -1, 128), "block_m");
  EXPECT_MOEKIT_ERROR_ARG(moekit::per_block_cast_to_fp8(x, false, 128, 0), "block_k");
  EXPECT_MOEKIT_ERROR_ARG(moekit::per_block_cast_to_fp8(x, true, 128, -64), "block_k");
}

TEST(Errors, PerBlockCastToFp8Into) {
  Bad bad;
  const Tensor x = filled({M, K}, 1.0f);
  const Tensor q = Tensor::zeros({M, K}, DType::e4m3);
  const Tensor sf = Tensor::zeros({1, 2}, DType::f32);  // ceil(4/128) x ceil(256/128)
  EXPECT_NO_THROW(moekit::per_block_cast_to_fp8_into(x, q, sf, false));
  for (auto& [what, t] : bad.variants(M, K, DType::f32, DType::u8)) {
    SCOPED_TRACE("x: " + what);
    EXPECT_MOEKIT_ERROR_ARG(moekit::per_block_cast_to_fp8_into(t, q, sf, false), "x");
  }
  for (auto& [what, t] : bad.variants(M, K, DType::e4m3, DType::f32)) {
    SCOPED_TRACE("q: " + what);
    EXPECT_MOEKIT_ERROR_ARG(moekit::per_block_cast_to_fp8_into(x, t, sf, false), "q");
  }
  for (auto& [what, t] : bad.variants(1, 2, DType::f32, DType::bf16)) {
    SCOPED_TRACE("sf: " + what);
    EXPECT_MOEKIT_ERROR_ARG(moekit::per_block_cast_to_fp8_into(x, q, t, false), "sf");
  }
  EXPECT_MOEKIT_ERROR_ARG(moekit::per_block_cast_to_fp8_into(x, q, Tensor::zeros({4, 2}, DType::f32), false), "sf");
  EXPECT_MOEKIT_ERROR_ARG(moekit::per_block_cast_to_fp8_into(x, q, sf, false, 2, 128), "sf");  // needs [2, 2]
  EXPECT_MOEKIT_ERROR_ARG(moekit::per_block_cast_to_fp8_into(x, Tensor::zeros({K, M}, DType::e4m3), sf, false), "q");
  EXPECT_MOEKIT_ERROR_ARG(moekit::per_block_cast_to_fp8_into(x, q, sf, false, 0, 128), "block_m");
  EXPECT_MOEKIT_ERROR_ARG(moekit::per_block_cast_to_fp8_into(x, q, sf, false, 128, -1), "block_k");
}

// ------------------------------------------------------------------ per-channel fp8

TEST(Errors, PerChannelCastToFp8) {
  Bad bad;
  const Tensor x = filled({K, M}, 2.0f);  // [K, MN]
  EXPECT_NO_THROW(moekit::per_channel_cast_to_fp8(x, false));
  for (auto& [what, t] : bad.variants(K, M, DType::f32, DType::i64)) {
    SCOPED_TRACE(what);
    EXPECT_MOEKIT_ERROR_ARG(moekit::per_channel_cast_to_fp8(t, false), "x");
  }
  EXPECT_MOEKIT_ERROR_ARG(moekit::per_channel_cast_to_fp8(x, false, 0), "gran_k");
  EXPECT_MOEKIT_ERROR_ARG(moekit::per_channel_cast_to_fp8(x, true, -5), "gran_k");
}

TEST(Errors, PerChannelCastToFp8Into) {
  Bad bad;
  const Tensor x = filled({K, M}, 2.0f);
  const Tensor q = Tensor::zeros({K, M}, DType::e4m3);
  const Tensor sf = Tensor::zeros({2, M}, DType::f32);  // [ceil(K/128), MN]
  EXPECT_NO_THROW(moekit::per_channel_cast_to_fp8_into(x, q, sf, false));
  for (auto& [what, t] : bad.variants(K, M, DType::f32, DType::i8)) {
    SCOPED_TRACE("x: " + what);
    EXPECT_MOEKIT_ERROR_ARG(moekit::per_channel_cast_to_fp8_into(t, q, sf, false), "x");
  }
  for (auto& [what, t] : bad.variants(K, M, DType::e4m3, DType::e2m1x2)) {
    SCOPED_TRACE("q: " + what);
    EXPECT_MOEKIT_ERROR_ARG(moekit::per_channel_cast_to_fp8_into(x, t, sf, false), "q");
  }
  for (auto& [what, t] : bad.variants(2, M, DType::f32, DType::i32)) {
    SCOPED_TRACE("sf: " + what);
    EXPECT_MOEKIT_ERROR_ARG(moekit::per_channel_cast_to_fp8_into(x, q, t, false), "sf");
  }
  // The per-token sf shape [MN, ceil(K/128)] is the wrong orientation here.
  EXPECT_MOEKIT_ERROR_ARG(moekit::per_channel_cast_to_fp8_into(x, q, Tensor::zeros({M, 2}, DType::f32), false), "sf");
  EXPECT_MOEKIT_ERROR_ARG(moekit::per_channel_cast_to_fp8_into(x, Tensor::zeros({M, K}, DType::e4m3), sf, false), "q");
  EXPECT_MOEKIT_ERROR_ARG(moekit::per_channel_cast_to_fp8_into(x, q, sf, false, 0), "gran_k");
}

// ------------------------------------------------------------------ per-token fp4

TEST(Errors, PerTokenCastToFp4) {
  Bad bad;
  const Tensor x = filled({M, K}, 0.5f);
  EXPECT_NO_THROW(moekit::per_token_cast_to_fp4(x, true));
  for (auto& [what, t] : bad.variants(M, K, DType::f32, DType::e2m1x2)) {
    SCOPED_TRACE(what);
    EXPECT_MOEKIT_ERROR_ARG(moekit::per_token_cast_to_fp4(t, false), "x");
  }
  EXPECT_MOEKIT_ERROR_ARG(moekit::per_token_cast_to_fp4(x, false, 0), "gran_k");
  EXPECT_MOEKIT_ERROR_ARG(moekit::per_token_cast_to_fp4(x, false, -32), "gran_k");
  // Odd groups would split a packed byte between two scales.
  EXPECT_MOEKIT_ERROR_ARG(moekit::per_token_cast_to_fp4(x, false, 31), "gran_k");
}

TEST(Errors, PerTokenCastToFp4Into) {
  Bad bad;
  const Tensor x = filled({M, K}, 0.5f);
  const Tensor q = Tensor::zeros({M, K / 2}, DType::e2m1x2);
  const Tensor sf = Tensor::zeros({M, K / 32}, DType::f32);
  EXPECT_NO_THROW(moekit::per_token_cast_to_fp4_into(x, q, sf, false));
  for (auto& [what, t] : bad.variants(M, K, DType::bf16, DType::f16)) {
    SCOPED_TRACE("x: " + what);
    EXPECT_MOEKIT_ERROR_ARG(moekit::per_token_cast_to_fp4_into(t, q, sf, false), "x");
  }
  for (auto& [what, t] : bad.variants(M, K / 2, DType::e2m1x2, DType::e4m3)) {
    SCOPED_TRACE("q: " + what);
    EXPECT_MOEKIT_ERROR_ARG(moekit::per_token_cast_to_fp4_into(x, t, sf, false), "q");
  }
  for (auto& [what, t] : bad.variants(M, K / 32, DType::f32, DType::i32)) {
    SCOPED_TRACE("sf: " + what);
    EXPECT_MOEKIT_ERROR_ARG(moekit::per_token_cast_to_fp4_into(x, q, t, false), "sf");
  }
  // q with K (unpacked) columns instead of K/2 bytes.
  EXPECT_MOEKIT_ERROR_ARG(moekit::per_token_cast_to_fp4_into(x, Tensor::zeros({M, K}, DType::e2m1x2), sf, false), "q");
  EXPECT_MOEKIT_ERROR_ARG(moekit::per_token_cast_to_fp4_into(x, q, Tensor::zeros({M, 2}, DType::f32), false), "sf");
  EXPECT_MOEKIT_ERROR_ARG(moekit::per_token_cast_to_fp4_into(x, q, sf, false, 0), "gran_k");
  EXPECT_MOEKIT_ERROR_ARG(moekit::per_token_cast_to_fp4_into(x, q, sf, false, 7), "gran_k");
}

// ------------------------------------------------------------------ cast back

TEST(Errors, CastBackFromFp8) {
  Bad bad;
  const Tensor q = Tensor::zeros({M, K}, DType::e4m3);
  const Tensor sf = filled({M, 2}, 1.0f);
  EXPECT_NO_THROW(moekit::cast_back_from_fp8(q, sf));
  // (A GPU-labelled q allocates its output on q's device: see CastBackFromFp8MixedDevices.)
  for (auto& [what, t] : bad.variants(M, K, DType::e4m3, DType::e5m2)) {
    if (what == "cuda device") continue;
    SCOPED_TRACE("q: " + what);
    EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8(t, sf), "q");
  }
  for (auto& [what, t] : bad.variants(M, 2, DType::f32, DType::bf16)) {
    SCOPED_TRACE("sf: " + what);
    EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8(q, t), "sf");
  }
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8(q, Tensor::zeros({M, 3}, DType::f32)), "sf");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8(q, Tensor::zeros({M - 1, 2}, DType::f32)), "sf");
  // Packed ue8m0: [M, ceil(2/4)] = [M, 1]; [M, 2] words is wrong.
  EXPECT_NO_THROW(moekit::cast_back_from_fp8(q, Tensor::zeros({M, 1}, DType::i32)));
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8(q, Tensor::zeros({M, 2}, DType::i32)), "sf");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8(q, sf, DType::i32), "out");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8(q, sf, DType::e4m3), "out");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8(q, sf, DType::f32, 0, 128), "gran_m");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8(q, sf, DType::f32, -1, 128), "gran_m");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8(q, sf, DType::f32, 1, 0), "gran_k");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8(q, sf, DType::f32, 1, -128), "gran_k");
  // Block grid 128x128 needs sf [1, 2].
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8(q, sf, DType::f32, 128, 128), "sf");
}

TEST(Errors, CastBackFromFp8Into) {
  Bad bad;
  const Tensor q = Tensor::zeros({M, K}, DType::e4m3);
  const Tensor sf = filled({M, 2}, 1.0f);
  const Tensor out = Tensor::zeros({M, K}, DType::bf16);
  EXPECT_NO_THROW(moekit::cast_back_from_fp8_into(q, sf, out));
  for (auto& [what, t] : bad.variants(M, K, DType::f32, DType::i32)) {
    SCOPED_TRACE("out: " + what);
    EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8_into(q, sf, t), "out");
  }
  for (auto& [what, t] : bad.variants(M, 2, DType::f32, DType::u8)) {
    SCOPED_TRACE("sf: " + what);
    EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8_into(q, t, out), "sf");
  }
  // q variants other than the cuda label (which takes the GPU path, below).
  for (auto& [what, t] : bad.variants(M, K, DType::e4m3, DType::f32)) {
    if (what == "cuda device") continue;
    SCOPED_TRACE("q: " + what);
    EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8_into(t, sf, out), "q");
  }
  // q / out disagree in shape: one of the two is named.
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8_into(q, sf, Tensor::zeros({M, K + 1}, DType::f32)), "");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8_into(q, sf, Tensor::zeros({M + 1, K}, DType::f32)), "");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8_into(q, sf, out, 0, 128), "gran_m");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8_into(q, sf, out, 1, 0), "gran_k");
}

TEST(Errors, CastBackFromFp8MixedDevices) {
  // q labelled as GPU memory: every other tensor must be on the same device, with the
  // GPU path's own validation before anything is launched.
  Tensor qh = Tensor::zeros({M, K}, DType::e4m3), sfh = filled({M, 2}, 1.0f), outh = Tensor::zeros({M, K}, DType::f32);
  const Device gpu = Device::cuda(0);
  const Tensor qg = Tensor::from_blob(qh.data(), {M, K}, DType::e4m3, gpu);
  const Tensor sfg = Tensor::from_blob(sfh.data(), {M, 2}, DType::f32, gpu);
  const Tensor outg = Tensor::from_blob(outh.data(), {M, K}, DType::f32, gpu);
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8_into(qg, sfh, outg), "sf");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8_into(qg, sfg, outh), "out");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8_into(qg, sfg, Tensor()), "out");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8_into(qg, Tensor(), outg), "sf");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8_into(qg, sfg, Tensor::from_blob(outh.data(), {M, K}, DType::f32, Device::cuda(1))), "out");
  // GPU path validation: dtypes, shapes, granularities, strides.
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8_into(Tensor::from_blob(qh.data(), {M, K}, DType::e5m2, gpu), sfg, outg), "q");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8_into(qg, Tensor::from_blob(sfh.data(), {M, 2}, DType::i32, gpu), outg), "sf");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8_into(qg, sfg, Tensor::from_blob(outh.data(), {M, K / 2}, DType::bf16, gpu)), "out");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8_into(qg, sfg, Tensor::from_blob(outh.data(), {M * K}, DType::f32, gpu)), "out");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8_into(qg, sfg, Tensor::from_blob(outh.data(), {M, K / 2}, DType::f32, gpu)), "q");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8_into(qg, Tensor::from_blob(sfh.data(), {M, 1}, DType::f32, gpu), outg), "sf");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8_into(qg, sfg, outg, 0, 128), "gran_m");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8_into(qg, sfg, outg, 1, -1), "gran_k");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8_into(
                 Tensor::from_blob(qh.data(), {M, K / 2}, DType::e4m3, gpu, {K, 2}), sfg,
                 Tensor::from_blob(outh.data(), {M, K / 2}, DType::f32, gpu), 1, 64),
             "q");
  // A CPU q with GPU-labelled companions: the CPU path rejects them.
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8_into(qh, sfg, outh), "sf");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8_into(qh, sfh, outg), "out");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8(qh, sfg), "sf");
  // GPU q, but a bad dtype / rank: rejected before anything is allocated or launched.
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8(Tensor::from_blob(qh.data(), {M, K}, DType::u8, gpu), sfg), "q");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8(Tensor::from_blob(qh.data(), {M * K}, DType::e4m3, gpu), sfg), "q");
#ifndef MOEKIT_WITH_CUDA
  // Everything valid and on the GPU, but no CUDA backend: cast_back_from_fp8 names q (the
  // allocating form checks before it allocates the output there, which named Tensor::empty).
  for (const auto& [what, sf] : {std::pair<const char*, Tensor>{"gpu sf", sfg}, {"cpu sf", sfh}}) {
    SCOPED_TRACE(what);
    try {
      moekit::cast_back_from_fp8(qg, sf);
      ADD_FAILURE() << "no moekit::Error";
    } catch (const moekit::Error& e) {
      EXPECT_EQ(e.function(), "cast_back_from_fp8") << e.what();
      EXPECT_EQ(e.argument(), "q") << e.what();
    }
  }
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp8_into(qg, sfg, outg), "q");
#endif
}

TEST(Errors, CastBackFromFp4) {
  Bad bad;
  const Tensor q = Tensor::zeros({M, K / 2}, DType::e2m1x2);
  const Tensor sf = filled({M, K / 32}, 1.0f);
  EXPECT_NO_THROW(moekit::cast_back_from_fp4(q, sf));
  for (auto& [what, t] : bad.variants(M, K / 2, DType::e2m1x2, DType::u8)) {
    SCOPED_TRACE("q: " + what);
    EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp4(t, sf), "q");
  }
  for (auto& [what, t] : bad.variants(M, K / 32, DType::f32, DType::e4m3)) {
    SCOPED_TRACE("sf: " + what);
    EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp4(q, t), "sf");
  }
  // k must be 2*W or 2*W-1 for W packed bytes per row.
  EXPECT_NO_THROW(moekit::cast_back_from_fp4(q, sf, DType::f32, 1, 32, K - 1));
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp4(q, sf, DType::f32, 1, 32, K + 1), "k");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp4(q, sf, DType::f32, 1, 32, K - 2), "k");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp4(q, sf, DType::f32, 1, 32, 0), "k");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp4(q, sf, DType::e2m1x2), "out");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp4(q, sf, DType::f32, 0, 32), "gran_m");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp4(q, sf, DType::f32, 1, 0), "gran_k");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp4(q, sf, DType::f32, 1, -32), "gran_k");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp4(q, sf, DType::f32, 1, 31), "gran_k");  // odd group in packed data
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp4(q, Tensor::zeros({M, K / 16}, DType::f32)), "sf");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp4(q, Tensor::zeros({M, 3}, DType::i32)), "sf");  // needs ceil(8/4) = 2 words
  EXPECT_NO_THROW(moekit::cast_back_from_fp4(q, Tensor::zeros({M, 2}, DType::i32)));
}

TEST(Errors, CastBackFromFp4Into) {
  Bad bad;
  const Tensor q = Tensor::zeros({M, K / 2}, DType::e2m1x2);
  const Tensor sf = filled({M, K / 32}, 1.0f);
  const Tensor out = Tensor::zeros({M, K}, DType::f32);
  EXPECT_NO_THROW(moekit::cast_back_from_fp4_into(q, sf, out));
  for (auto& [what, t] : bad.variants(M, K, DType::bf16, DType::e2m1x2)) {
    SCOPED_TRACE("out: " + what);
    EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp4_into(q, sf, t), "out");
  }
  for (auto& [what, t] : bad.variants(M, K / 2, DType::e2m1x2, DType::e4m3)) {
    SCOPED_TRACE("q: " + what);
    EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp4_into(t, sf, out), "q");
  }
  for (auto& [what, t] : bad.variants(M, K / 32, DType::f32, DType::f16)) {
    SCOPED_TRACE("sf: " + what);
    EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp4_into(q, t, out), "sf");
  }
  // out given in packed bytes instead of values: q / out disagree.
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp4_into(q, sf, Tensor::zeros({M, K / 2}, DType::f32)), "");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp4_into(q, sf, out, 0, 32), "gran_m");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp4_into(q, sf, out, 1, 0), "gran_k");
}

// ------------------------------------------------------------------ scale helpers

TEST(Errors, CeilToUe8m0Scalar) {
  for (float bad : {0.0f, -0.0f, -1.0f, -0.25f, std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    SCOPED_TRACE(bad);
    EXPECT_MOEKIT_ERROR_ARG(moekit::ceil_to_ue8m0(bad), "sf");
  }
  EXPECT_EQ(moekit::ceil_to_ue8m0(0.3f), 0.5f);
  // Above 2^127 no ue8m0 value lies at or above the scale (2^128 is no f32): it used to give +inf.
  EXPECT_EQ(moekit::ceil_to_ue8m0(0x1p127f), 0x1p127f);
  for (float huge : {std::nextafter(0x1p127f, std::numeric_limits<float>::max()), 3e38f, std::numeric_limits<float>::max()}) {
    SCOPED_TRACE(huge);
    EXPECT_MOEKIT_ERROR_ARG(moekit::ceil_to_ue8m0(huge), "sf");
  }
}

TEST(Errors, CeilToUe8m0Tensor) {
  float buf[4] = {0.3f, 1.0f, 3.0f, 0.01f};
  EXPECT_MOEKIT_ERROR_ARG(moekit::ceil_to_ue8m0(Tensor()), "sf");
  EXPECT_MOEKIT_ERROR_ARG(moekit::ceil_to_ue8m0(Tensor::zeros({2, 2}, DType::bf16)), "sf");
  EXPECT_MOEKIT_ERROR_ARG(moekit::ceil_to_ue8m0(Tensor::zeros({2, 2}, DType::i32)), "sf");
  EXPECT_MOEKIT_ERROR_ARG(moekit::ceil_to_ue8m0(Tensor::from_blob(buf, {2, 2}, DType::f32, Device::cuda(0))), "sf");
  // Non-positive or non-finite entries are errors, not garbage exponents.
  float zero[3] = {1.0f, 0.0f, 2.0f};
  EXPECT_MOEKIT_ERROR_ARG(moekit::ceil_to_ue8m0(Tensor::from_blob(zero, {3}, DType::f32)), "sf");
  float neg[2] = {-1.0f, 2.0f};
  EXPECT_MOEKIT_ERROR_ARG(moekit::ceil_to_ue8m0(Tensor::from_blob(neg, {1, 2}, DType::f32)), "sf");
  float inf[2] = {1.0f, std::numeric_limits<float>::infinity()};
  EXPECT_MOEKIT_ERROR_ARG(moekit::ceil_to_ue8m0(Tensor::from_blob(inf, {2, 1}, DType::f32)), "sf");
  float huge[2] = {1.0f, 3e38f};  // (above 2^127)
  EXPECT_MOEKIT_ERROR_ARG(moekit::ceil_to_ue8m0(Tensor::from_blob(huge, {2}, DType::f32)), "sf");
  // Any rank and strided input are accepted (elementwise), with correct values.
  const Tensor strided = Tensor::from_blob(buf, {2, 2}, DType::f32).t();
  const Tensor r = moekit::ceil_to_ue8m0(strided);
  ASSERT_EQ(r.shape(), (Shape{2, 2}));
  // strided = [[0.3, 3.0], [1.0, 0.01]] -> [[0.5, 4], [1, 2^-6]]
  const float expected[4] = {0.5f, 4.0f, 1.0f, 0.015625f};
  const Tensor rc = r.contiguous();
  for (int i = 0; i < 4; ++i) EXPECT_EQ(rc.data_ptr<float>()[i], expected[i]) << i;
}

TEST(Errors, F32ToUe8m0Scalar) {
  for (float bad : {3.0f, 0.0f, -2.0f, 0.75f, std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    SCOPED_TRACE(bad);
    EXPECT_MOEKIT_ERROR_ARG(moekit::f32_to_ue8m0(bad), "power_of_two");
  }
  EXPECT_EQ(moekit::f32_to_ue8m0(1.0f), 127);
}

TEST(Errors, PackUe8m0ToInt) {
  Bad bad;
  float ok[8] = {1, 2, 4, 0.5f, 0.25f, 8, 16, 1};
  const Tensor sf = Tensor::from_blob(ok, {2, 4}, DType::f32);
  EXPECT_NO_THROW(moekit::pack_ue8m0_to_int(sf));
  for (auto& [what, t] : bad.variants(2, 4, DType::f32, DType::i32)) {
    SCOPED_TRACE(what);
    EXPECT_MOEKIT_ERROR_ARG(moekit::pack_ue8m0_to_int(t), "sf");
  }
  for (float v : {3.0f, 0.0f, -2.0f, 0.3f, std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN(), 1e-40f /* subnormal */}) {
    SCOPED_TRACE(v);
    float buf[4] = {1.0f, 2.0f, v, 4.0f};
    EXPECT_MOEKIT_ERROR_ARG(moekit::pack_ue8m0_to_int(Tensor::from_blob(buf, {1, 4}, DType::f32)), "sf");
  }
}

TEST(Errors, UnpackUe8m0FromInt) {
  Bad bad;
  const Tensor packed = Tensor::zeros({3, 2}, DType::i32);
  EXPECT_NO_THROW(moekit::unpack_ue8m0_from_int(packed));
  EXPECT_NO_THROW(moekit::unpack_ue8m0_from_int(packed, 5));
  for (auto& [what, t] : bad.variants(3, 2, DType::i32, DType::f32)) {
    SCOPED_TRACE(what);
    EXPECT_MOEKIT_ERROR_ARG(moekit::unpack_ue8m0_from_int(t), "packed");
  }
  EXPECT_MOEKIT_ERROR_ARG(moekit::unpack_ue8m0_from_int(packed, 9), "groups");   // needs 3 words
  EXPECT_MOEKIT_ERROR_ARG(moekit::unpack_ue8m0_from_int(packed, 4), "groups");   // fits in 1 word
  EXPECT_MOEKIT_ERROR_ARG(moekit::unpack_ue8m0_from_int(packed, 0), "groups");
}

TEST(Errors, NegativeCountsOtherThanDefaultRejected) {
  // -1 is the documented "default" for the k of cast_back_from_fp4 and the groups of
  // unpack_ue8m0_from_int; any other negative count is not a column count and must be
  // rejected rather than silently treated as the default.
  const Tensor q = Tensor::zeros({M, K / 2}, DType::e2m1x2);
  const Tensor sf = filled({M, K / 32}, 1.0f);
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp4(q, sf, DType::f32, 1, 32, -2), "k");
  EXPECT_MOEKIT_ERROR_ARG(moekit::cast_back_from_fp4(q, sf, DType::f32, 1, 32, -K), "k");
  const Tensor packed = Tensor::zeros({3, 2}, DType::i32);
  EXPECT_MOEKIT_ERROR_ARG(moekit::unpack_ue8m0_from_int(packed, -2), "groups");
  EXPECT_MOEKIT_ERROR_ARG(moekit::unpack_ue8m0_from_int(packed, -8), "groups");
}

// ------------------------------------------------------------------ convert

TEST(Errors, Convert) {
  Bad bad;
  const Tensor src = filled({M, 16}, 0.5f);
  const Tensor dst = Tensor::zeros({M, 16}, DType::e4m3);
  EXPECT_NO_THROW(moekit::convert(src, dst));
  EXPECT_MOEKIT_ERROR_ARG(moekit::convert(Tensor(), dst), "src");
  EXPECT_MOEKIT_ERROR_ARG(moekit::convert(src, Tensor()), "dst");
  EXPECT_MOEKIT_ERROR_ARG(moekit::convert(Tensor::from_blob(src.data(), {M, 16}, DType::f32, Device::cuda(0)), dst), "src");
  EXPECT_MOEKIT_ERROR_ARG(moekit::convert(src, Tensor::from_blob(dst.data(), {M, 16}, DType::e4m3, Device::cuda(0))), "dst");
  // Non-unit last stride / non-contiguous views.
  const Tensor wide = filled({M, 32}, 1.0f);
  EXPECT_MOEKIT_ERROR_ARG(moekit::convert(wide.slice(1, 0, 32, 2), dst), "src");
  const Tensor wide_dst = Tensor::zeros({M, 32}, DType::e4m3);
  EXPECT_MOEKIT_ERROR_ARG(moekit::convert(src, wide_dst.slice(1, 0, 32, 2)), "dst");
  EXPECT_MOEKIT_ERROR_ARG(moekit::convert(src.t(), Tensor::zeros({16, M}, DType::e4m3)), "src");
  // Rank.
  EXPECT_MOEKIT_ERROR_ARG(moekit::convert(src, Tensor::zeros({M * 16}, DType::e4m3)), "dst");
  EXPECT_MOEKIT_ERROR_ARG(moekit::convert(Tensor::zeros({}, DType::f32), Tensor::zeros({}, DType::e4m3)), "");
  // Shape.
  EXPECT_MOEKIT_ERROR_ARG(moekit::convert(src, Tensor::zeros({M, 15}, DType::e4m3)), "dst");
  EXPECT_MOEKIT_ERROR_ARG(moekit::convert(src, Tensor::zeros({M + 1, 16}, DType::bf16)), "dst");
  EXPECT_MOEKIT_ERROR_ARG(moekit::convert(src, Tensor::zeros({M, 16}, DType::e2m1x2)), "dst");  // needs [M, 8]
  EXPECT_NO_THROW(moekit::convert(src, Tensor::zeros({M, 8}, DType::e2m1x2)));
  EXPECT_MOEKIT_ERROR_ARG(moekit::convert(Tensor::zeros({M, 9}, DType::e2m1x2), src), "");  // 16 values need 8 bytes
  EXPECT_MOEKIT_ERROR_ARG(moekit::convert(Tensor::zeros({M, 16}, DType::e5m2), Tensor::zeros({M, 17}, DType::f32)), "");
  // Unsupported dtype pairs.
  EXPECT_MOEKIT_ERROR_ARG(moekit::convert(Tensor::zeros({M, 16}, DType::i32), dst), "");
  EXPECT_MOEKIT_ERROR_ARG(moekit::convert(dst, Tensor::zeros({M, 16}, DType::e5m2)), "");
  EXPECT_MOEKIT_ERROR_ARG(moekit::convert(src, Tensor::zeros({M, 16}, DType::i64)), "");
  EXPECT_MOEKIT_ERROR_ARG(moekit::convert(src, Tensor::zeros({M, 16}, DType::ue8m0)), "");
}

// ------------------------------------------------------------------ calc_diff

TEST(Errors, CalcDiff) {
  const Tensor x = filled({M, 8}, 1.0f);
  EXPECT_NO_THROW(moekit::calc_diff(x, x));
  EXPECT_MOEKIT_ERROR_ARG(moekit::calc_diff(Tensor(), x), "x");
  EXPECT_MOEKIT_ERROR_ARG(moekit::calc_diff(x, Tensor()), "y");
  EXPECT_MOEKIT_ERROR_ARG(moekit::calc_diff(Tensor::zeros({M, 8}, DType::i32), x), "x");
  EXPECT_MOEKIT_ERROR_ARG(moekit::calc_diff(x, Tensor::zeros({M, 8}, DType::e4m3)), "y");
  EXPECT_MOEKIT_ERROR_ARG(moekit::calc_diff(x, Tensor::zeros({M, 9}, DType::f32)), "y");
  EXPECT_MOEKIT_ERROR_ARG(moekit::calc_diff(x, Tensor::zeros({M * 8}, DType::f32)), "y");  // same numel, other shape
  EXPECT_MOEKIT_ERROR_ARG(moekit::calc_diff(Tensor::from_blob(x.data(), {M, 8}, DType::f32, Device::cuda(0)), x), "x");
  EXPECT_MOEKIT_ERROR_ARG(moekit::calc_diff(x, Tensor::from_blob(x.data(), {M, 8}, DType::f32, Device::cuda(0))), "y");
}

}  // namespace

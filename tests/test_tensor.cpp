// moekit::Tensor, Device, moekit::Error and the runtime controls (ISA dispatch, threads).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

// First and alone: a public header declares moekit::Error itself, so that a caller that
// includes only it can catch what it raises.
#include "moekit/tensor.h"
static_assert(sizeof(moekit::Error) > 0, "moekit/tensor.h must declare moekit::Error");

#include "moekit/error.h"
#include "moekit/runtime.h"
#include "test_util.h"

namespace {

using moekit::Device;
using moekit::DType;
using moekit::Isa;
using moekit::Shape;
using moekit::Tensor;


bool aligned64(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 64 == 0; }

// A 4x6 float matrix holding 0..23 in row-major order, wrapped without copying.
struct Grid {
  float buf[24];
  Tensor t;
  Grid() {
    std::iota(buf, buf + 24, 0.0f);
    t = Tensor::from_blob(buf, {4, 6}, DType::f32);
  }
};

float at2(const Tensor& t, int64_t r, int64_t c) {
  return t.data_ptr<float>()[r * t.stride(0) + c * t.stride(1)];
}

// ------------------------------------------------------------------ dtypes, empty, zeros

TEST(Tensor, ElementSizePerDtype) {
  EXPECT_EQ(moekit::element_size(DType::f32), 4u);
  EXPECT_EQ(moekit::element_size(DType::bf16), 2u);
  EXPECT_EQ(moekit::element_size(DType::f16), 2u);
  EXPECT_EQ(moekit::element_size(DType::e4m3), 1u);
  EXPECT_EQ(moekit::element_size(DType::e5m2), 1u);
  EXPECT_EQ(moekit::element_size(DType::e2m1x2), 1u);  // one stored byte = two fp4 values
  EXPECT_EQ(moekit::element_size(DType::ue8m0), 1u);
  EXPECT_EQ(moekit::element_size(DType::i8), 1u);
  EXPECT_EQ(moekit::element_size(DType::u8), 1u);
  EXPECT_EQ(moekit::element_size(DType::i32), 4u);
  EXPECT_EQ(moekit::element_size(DType::i64), 8u);
  EXPECT_EQ(moekit::element_size(DType::boolean), 1u);
  EXPECT_STREQ(moekit::dtype_name(DType::e2m1x2), "e2m1x2");
  EXPECT_STREQ(moekit::dtype_name(DType::bf16), "bf16");
  EXPECT_STREQ(moekit::dtype_name(DType::e4m3), "e4m3");
  // Tensor::element_size follows the dtype.
  EXPECT_EQ(Tensor::empty({3}, DType::i64).element_size(), 8u);
  EXPECT_EQ(Tensor::empty({3}, DType::e2m1x2).element_size(), 1u);
}

TEST(Tensor, EmptyShapeStridesNumelAlignment) {
  const Tensor t = Tensor::empty({2, 3, 5}, DType::bf16);
  EXPECT_TRUE(t.defined());
  EXPECT_EQ(t.dim(), 3);
  EXPECT_EQ(t.shape(), (Shape{2, 3, 5}));
  EXPECT_EQ(t.strides(), (Shape{15, 5, 1}));
  EXPECT_EQ(t.numel(), 30);
  EXPECT_EQ(t.size(-1), 5);
  EXPECT_EQ(t.size(0), 2);
  EXPECT_EQ(t.stride(-2), 5);
  EXPECT_EQ(t.dtype(), DType::bf16);
  EXPECT_TRUE(t.device().is_cpu());
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_TRUE(t.owns_memory());
  ASSERT_NE(t.data(), nullptr);
  EXPECT_TRUE(aligned64(t.data()));
  EXPECT_EQ(t.str(), "bf16[2, 3, 5] cpu");
  // Several odd sizes: every owned allocation is 64-byte aligned.
  for (int64_t n : {1, 3, 63, 65, 1000}) {
    for (DType d : {DType::f32, DType::e4m3, DType::e2m1x2, DType::i64}) {
      const Tensor u = Tensor::empty({n}, d);
      EXPECT_TRUE(aligned64(u.data())) << n << " " << moekit::dtype_name(d);
      const Tensor z = Tensor::zeros({n, 1}, d);
      EXPECT_TRUE(aligned64(z.data())) << n << " " << moekit::dtype_name(d);
    }
  }
}

TEST(Tensor, EmptyWritableWholeExtent) {
  // Every byte of the owned extent may be written (ASan checks the allocation size).
  Tensor t = Tensor::empty({7, 9}, DType::i64);
  auto* p = t.data_ptr<int64_t>();
  for (int64_t i = 0; i < 63; ++i) p[i] = i * 3;
  EXPECT_EQ(p[62], 186);
}

TEST(Tensor, ZerosReallyZero) {
  // Dirty the heap with a same-sized block first so a non-zeroing zeros() would likely be caught.
  for (int round = 0; round < 3; ++round) {
    {
      Tensor dirty = Tensor::empty({1024}, DType::f32);
      std::memset(dirty.data(), 0xAB, 1024 * 4);
    }
    const Tensor z = Tensor::zeros({32, 32}, DType::f32);
    const auto* bytes = static_cast<const unsigned char*>(z.data());
    int nonzero = 0;
    for (int i = 0; i < 1024 * 4; ++i) nonzero += bytes[i] != 0;
    EXPECT_EQ(nonzero, 0);
  }
  const Tensor zb = Tensor::zeros({3, 5}, DType::e2m1x2);
  const auto* b = static_cast<const unsigned char*>(zb.data());
  for (int i = 0; i < 15; ++i) EXPECT_EQ(b[i], 0) << i;
  const Tensor zi = Tensor::zeros({4}, DType::i64);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(zi.data_ptr<int64_t>()[i], 0);
}

// A strided source sharing memory with the destination (review finding, 2026-12-03):
// x.copy_from(x.t()) gave 0 3 6 3 4 7 6 7 8, reading values it had already overwritten.
TEST(Tensor, CopyFromAnOverlappingViewCopiesTheValues) {
  Tensor x = Tensor::empty({3, 3}, DType::f32);
  for (int i = 0; i < 9; ++i) x.data_ptr<float>()[i] = static_cast<float>(i);
  x.copy_from(x.t());
  const float want[9] = {0, 3, 6, 1, 4, 7, 2, 5, 8};
  for (int i = 0; i < 9; ++i) EXPECT_EQ(x.data_ptr<float>()[i], want[i]) << i;
  // Shifted by one row inside one buffer, strided: the values the source held before.
  Tensor y = Tensor::empty({4, 3}, DType::f32);
  for (int i = 0; i < 12; ++i) y.data_ptr<float>()[i] = static_cast<float>(i);
  y.slice(0, 1, 4).t().copy_from(y.slice(0, 0, 3).t());
  for (int i = 0; i < 12; ++i) EXPECT_EQ(y.data_ptr<float>()[i], static_cast<float>(i < 3 ? i : i - 3)) << i;
}

TEST(Tensor, ZeroSizedTensors) {
  const Tensor a = Tensor::empty({0, 5}, DType::f32);
  EXPECT_TRUE(a.defined());
  EXPECT_EQ(a.numel(), 0);
  EXPECT_EQ(a.shape(), (Shape{0, 5}));
  EXPECT_EQ(a.strides(), (Shape{5, 1}));
  EXPECT_TRUE(a.is_contiguous());
  const Tensor b = Tensor::zeros({4, 0, 3}, DType::bf16);
  EXPECT_EQ(b.numel(), 0);
  EXPECT_EQ(b.strides(), (Shape{0, 3, 1}));
  // Views and copies of empty tensors work.
  const Tensor c = b.reshape({0, 7});
  EXPECT_EQ(c.shape(), (Shape{0, 7}));
  Tensor d = Tensor::empty({0, 5}, DType::f32);
  d.copy_from(a);
  EXPECT_EQ(a.t().contiguous().shape(), (Shape{5, 0}));
  // from_blob of 0 elements may take a null pointer.
  const Tensor e = Tensor::from_blob(static_cast<void*>(nullptr), {0, 8}, DType::f32);
  EXPECT_TRUE(e.defined());
  EXPECT_EQ(e.numel(), 0);
}

TEST(Tensor, ZeroDimTensor) {
  Tensor s = Tensor::zeros({}, DType::f32);
  EXPECT_TRUE(s.defined());
  EXPECT_EQ(s.dim(), 0);
  EXPECT_EQ(s.numel(), 1);
  EXPECT_TRUE(s.strides().empty());
  EXPECT_TRUE(s.is_contiguous());
  EXPECT_EQ(*s.data_ptr<float>(), 0.0f);
  *s.data_ptr<float>() = 2.5f;
  EXPECT_EQ(s.reshape({1, 1}).data_ptr<float>()[0], 2.5f);
  EXPECT_EQ(s.str(), "f32[] cpu");
  // select on a 1-D tensor gives a 0-dim view.
  float v[3] = {1, 2, 3};
  const Tensor x = Tensor::from_blob(v, {3}, DType::f32);
  const Tensor e = x.select(0, 2);
  EXPECT_EQ(e.dim(), 0);
  EXPECT_EQ(e.data(), &v[2]);
  // Dimension arguments on a 0-dim tensor are out of range.
  EXPECT_MOEKIT_ERROR_ARG(s.size(0), "dim");
}

TEST(Tensor, BadShapesRejected) {
  EXPECT_MOEKIT_ERROR_ARG(Tensor::empty({2, -1}, DType::f32), "shape");
  EXPECT_MOEKIT_ERROR_ARG(Tensor::zeros({-3}, DType::f32), "shape");
  // More than 2^48 elements: rejected before allocating.
  EXPECT_MOEKIT_ERROR_ARG(Tensor::empty({int64_t{1} << 30, int64_t{1} << 30}, DType::u8), "shape");
  float v[1] = {0};
  EXPECT_MOEKIT_ERROR_ARG(Tensor::from_blob(v, {-1}, DType::f32), "shape");
}

// ------------------------------------------------------------------ from_blob

TEST(Tensor, FromBlobWrapsWithoutCopy) {
  float buf[6] = {1, 2, 3, 4, 5, 6};
  Tensor t = Tensor::from_blob(buf, {2, 3}, DType::f32);
  EXPECT_EQ(t.data(), static_cast<void*>(buf));
  EXPECT_FALSE(t.owns_memory());
  EXPECT_EQ(t.strides(), (Shape{3, 1}));
  EXPECT_TRUE(t.is_contiguous());
  // Writes are visible both ways.
  t.data_ptr<float>()[4] = 50.0f;
  EXPECT_EQ(buf[4], 50.0f);
  buf[0] = -7.0f;
  EXPECT_EQ(t.data_ptr<float>()[0], -7.0f);
  // The const overload wraps the same pointer.
  const float cbuf[2] = {1, 2};
  const Tensor c = Tensor::from_blob(cbuf, {2}, DType::f32);
  EXPECT_EQ(c.data(), static_cast<const void*>(cbuf));
  // Device labels are kept.
  const Tensor g = Tensor::from_blob(buf, {6}, DType::f32, Device::cuda(2));
  EXPECT_EQ(g.device(), Device::cuda(2));
  EXPECT_EQ(g.str(), "f32[6] cuda:2");
}

TEST(Tensor, FromBlobCustomStrides) {
  float buf[6] = {0, 1, 2, 3, 4, 5};
  // Column-major 2x3: element (r, c) at r + 2c.
  const Tensor t = Tensor::from_blob(buf, {2, 3}, DType::f32, Device::cpu(), {1, 2});
  EXPECT_EQ(t.strides(), (Shape{1, 2}));
  EXPECT_FALSE(t.is_contiguous());
  EXPECT_EQ(at2(t, 1, 2), 5.0f);
  EXPECT_EQ(at2(t, 0, 1), 2.0f);
  EXPECT_EQ(at2(t, 1, 0), 1.0f);
  const Tensor c = t.contiguous();
  ASSERT_TRUE(c.is_contiguous());
  // Row-major copy of [[0,2,4],[1,3,5]].
  const float expected[6] = {0, 2, 4, 1, 3, 5};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(c.data_ptr<float>()[i], expected[i]) << i;
  // A zero stride (broadcast) is allowed.
  const Tensor b = Tensor::from_blob(buf, {3, 2}, DType::f32, Device::cpu(), {0, 1});
  EXPECT_EQ(at2(b, 2, 1), 1.0f);
}

TEST(Tensor, FromBlobRejectsBadInput) {
  float buf[4] = {};
  EXPECT_MOEKIT_ERROR_ARG(Tensor::from_blob(static_cast<void*>(nullptr), {2, 2}, DType::f32), "data");
  EXPECT_MOEKIT_ERROR_ARG(Tensor::from_blob(buf, {2, 2}, DType::f32, Device::cpu(), {-2, 1}), "strides");
  EXPECT_MOEKIT_ERROR_ARG(Tensor::from_blob(buf, {2, 2}, DType::f32, Device::cpu(), {2, -1}), "strides");
  EXPECT_MOEKIT_ERROR_ARG(Tensor::from_blob(buf, {2, 2}, DType::f32, Device::cpu(), {1}), "strides");
  EXPECT_MOEKIT_ERROR_ARG(Tensor::from_blob(buf, {4}, DType::f32, Device::cpu(), {1, 1}), "strides");
}

// ------------------------------------------------------------------ views

TEST(Tensor, SliceSharesStorage) {
  Grid g;
  const Tensor s = g.t.slice(1, 1, 5, 2);  // columns 1, 3
  EXPECT_EQ(s.shape(), (Shape{4, 2}));
  EXPECT_EQ(s.strides(), (Shape{6, 2}));
  EXPECT_EQ(s.data(), static_cast<void*>(&g.buf[1]));
  EXPECT_FALSE(s.is_contiguous());
  EXPECT_FALSE(s.owns_memory());
  EXPECT_EQ(at2(s, 2, 1), 15.0f);  // row 2, column 3 -> 2*6+3
  s.data_ptr<float>()[s.stride(0) * 3 + s.stride(1) * 1] = -1.0f;  // (3, 3)
  EXPECT_EQ(g.buf[21], -1.0f);

  const Tensor rows = g.t.slice(0, 1, 3);  // rows 1..2: contiguous
  EXPECT_EQ(rows.shape(), (Shape{2, 6}));
  EXPECT_TRUE(rows.is_contiguous());
  EXPECT_EQ(rows.data(), static_cast<void*>(&g.buf[6]));

  // Step 3 from 0 over 6 columns: 0, 3.
  const Tensor s3 = g.t.slice(-1, 0, 6, 3);
  EXPECT_EQ(s3.shape(), (Shape{4, 2}));
  EXPECT_EQ(at2(s3, 1, 1), 9.0f);
  // Step that does not divide the extent: columns 1, 4 of [1, 6).
  EXPECT_EQ(g.t.slice(1, 1, 6, 3).size(1), 2);
}

TEST(Tensor, SliceNegativeAndClampedIndices) {
  Grid g;
  const Tensor s = g.t.slice(0, -3, -1);  // rows 1, 2
  EXPECT_EQ(s.shape(), (Shape{2, 6}));
  EXPECT_EQ(s.data(), static_cast<void*>(&g.buf[6]));
  const Tensor tail = g.t.slice(1, -2, 100);  // end past the extent is clamped
  EXPECT_EQ(tail.shape(), (Shape{4, 2}));
  EXPECT_EQ(at2(tail, 0, 0), 4.0f);
  const Tensor empty = g.t.slice(1, 2, 2);
  EXPECT_EQ(empty.shape(), (Shape{4, 0}));
  EXPECT_EQ(empty.numel(), 0);
  const Tensor at_end = g.t.slice(0, 4, 4);
  EXPECT_EQ(at_end.size(0), 0);
}

TEST(Tensor, SliceRejectsBadArguments) {
  Grid g;
  EXPECT_MOEKIT_ERROR_ARG(g.t.slice(2, 0, 1), "dim");
  EXPECT_MOEKIT_ERROR_ARG(g.t.slice(-3, 0, 1), "dim");
  EXPECT_MOEKIT_ERROR_ARG(g.t.slice(0, 0, 2, 0), "step");
  EXPECT_MOEKIT_ERROR_ARG(g.t.slice(0, 0, 2, -1), "step");
  EXPECT_MOEKIT_ERROR_ARG(g.t.slice(0, 3, 1), "start");
  EXPECT_MOEKIT_ERROR_ARG(g.t.slice(0, 5, 6), "start");
  EXPECT_MOEKIT_ERROR_ARG(g.t.slice(0, -9, 2), "start");
}

TEST(Tensor, SliceHugeStepDoesNotOverflow) {
  // A step larger than the extent selects just the start element: a legal request that
  // must give one row (or a moekit::Error), not a wrapped-around extent.
  Grid g;
  for (int64_t step : {int64_t{1} << 40, std::numeric_limits<int64_t>::max()}) {
    SCOPED_TRACE(step);
    try {
      const Tensor s = g.t.slice(0, 1, 4, step);
      EXPECT_EQ(s.shape(), (Shape{1, 6}));
      EXPECT_EQ(s.data(), static_cast<void*>(&g.buf[6]));
    } catch (const moekit::Error& e) {
      EXPECT_EQ(e.argument(), "step") << e.what();
    }
  }
}

// The end of a dimension, start · stride · element size, need not fit in int64: from_blob
// bounds the furthest element, and a dimension of size 1 may have any stride. An empty slice
// there reads nothing; it keeps the base pointer rather than forming the offset (review
// finding: 1 · 2^61 · 4 overflowed, UB that UBSan reports).
TEST(Tensor, EmptySliceAtAHugeEndDoesNotOverflow) {
  float x[2] = {};
  const Tensor one = Tensor::from_blob(x, {1}, DType::f32, Device::cpu(), {int64_t{1} << 61});
  const Tensor s = one.slice(0, 1, 1);
  EXPECT_EQ(s.numel(), 0);
  EXPECT_EQ(s.data(), one.data());
  // Size 2 with the largest stride from_blob takes: 2 · (2^61 - 2) · 4 > 2^63.
  const Tensor two = Tensor::from_blob(x, {2, 1}, DType::f32, Device::cpu(), {(int64_t{1} << 61) - 2, 1});
  EXPECT_EQ(two.slice(0, 2, 2).shape(), (Shape{0, 1}));
  EXPECT_EQ(two.slice(0, 2, 2).data(), two.data());
  // Where the offset fits, an empty slice at the end still points one past the last row.
  Grid g;
  EXPECT_EQ(g.t.slice(0, 4, 4).data(), static_cast<void*>(&g.buf[24]));
}

TEST(Tensor, SelectSharesStorage) {
  Grid g;
  const Tensor r = g.t.select(0, 2);
  EXPECT_EQ(r.shape(), (Shape{6}));
  EXPECT_EQ(r.strides(), (Shape{1}));
  EXPECT_TRUE(r.is_contiguous());
  EXPECT_EQ(r.data(), static_cast<void*>(&g.buf[12]));
  const Tensor c = g.t.select(1, -1);  // last column
  EXPECT_EQ(c.shape(), (Shape{4}));
  EXPECT_EQ(c.strides(), (Shape{6}));
  EXPECT_FALSE(c.is_contiguous());
  EXPECT_EQ(c.data_ptr<float>()[3 * 6], 23.0f);
  c.data_ptr<float>()[6] = 100.0f;  // element (1, 5)
  EXPECT_EQ(g.buf[11], 100.0f);
  EXPECT_MOEKIT_ERROR_ARG(g.t.select(0, 4), "index");
  EXPECT_MOEKIT_ERROR_ARG(g.t.select(1, -7), "index");
  EXPECT_MOEKIT_ERROR_ARG(g.t.select(2, 0), "dim");
}

TEST(Tensor, TransposeSharesStorage) {
  Grid g;
  const Tensor t = g.t.t();
  EXPECT_EQ(t.shape(), (Shape{6, 4}));
  EXPECT_EQ(t.strides(), (Shape{1, 6}));
  EXPECT_EQ(t.data(), static_cast<void*>(g.buf));
  EXPECT_FALSE(t.is_contiguous());
  EXPECT_EQ(at2(t, 5, 2), 17.0f);  // (2, 5) of the original
  const Tensor t2 = g.t.transpose(-1, -2);
  EXPECT_EQ(t2.shape(), t.shape());
  EXPECT_EQ(t2.strides(), t.strides());
  EXPECT_TRUE(t.t().is_contiguous());
  // 3-D transpose of the outer dims.
  const Tensor x = g.t.reshape({2, 2, 6}).transpose(0, 1);
  EXPECT_EQ(x.shape(), (Shape{2, 2, 6}));
  EXPECT_EQ(x.strides(), (Shape{6, 12, 1}));
  EXPECT_FALSE(x.is_contiguous());
  EXPECT_MOEKIT_ERROR_ARG(g.t.transpose(0, 2), "dim");
  EXPECT_MOEKIT_ERROR_ARG(g.t.transpose(-3, 1), "dim");
}

TEST(Tensor, ReshapeContiguous) {
  Grid g;
  const Tensor a = g.t.reshape({3, -1});
  EXPECT_EQ(a.shape(), (Shape{3, 8}));
  EXPECT_EQ(a.strides(), (Shape{8, 1}));
  EXPECT_EQ(a.data(), static_cast<void*>(g.buf));
  EXPECT_TRUE(a.is_contiguous());
  EXPECT_EQ(at2(a, 2, 7), 23.0f);
  EXPECT_EQ(g.t.reshape({-1}).shape(), (Shape{24}));
  EXPECT_EQ(g.t.reshape({2, -1, 3}).shape(), (Shape{2, 4, 3}));
  EXPECT_EQ(g.t.reshape({24, 1}).strides(), (Shape{1, 1}));
  // A contiguous slice of rows reshapes too, starting at its own offset.
  const Tensor r = g.t.slice(0, 2, 4).reshape({12});
  EXPECT_EQ(r.data(), static_cast<void*>(&g.buf[12]));
}

TEST(Tensor, ReshapeRejectsBadInput) {
  Grid g;
  EXPECT_MOEKIT_ERROR_ARG(g.t.t().reshape({24}), "self");
  EXPECT_MOEKIT_ERROR_ARG(g.t.slice(1, 0, 6, 2).reshape({12}), "self");
  EXPECT_MOEKIT_ERROR_ARG(g.t.reshape({5, 5}), "shape");
  EXPECT_MOEKIT_ERROR_ARG(g.t.reshape({5, -1}), "shape");  // 24 not divisible by 5
  EXPECT_MOEKIT_ERROR_ARG(g.t.reshape({-1, -1}), "shape");
  EXPECT_MOEKIT_ERROR_ARG(g.t.reshape({-2, -12}), "shape");
  EXPECT_MOEKIT_ERROR_ARG(g.t.reshape({25}), "shape");
}

TEST(Tensor, IsContiguousIgnoresUnitDims) {
  float buf[4] = {};
  // Extent-1 dims may carry any stride.
  EXPECT_TRUE(Tensor::from_blob(buf, {1, 4}, DType::f32, Device::cpu(), {99, 1}).is_contiguous());
  EXPECT_TRUE(Tensor::from_blob(buf, {4, 1}, DType::f32, Device::cpu(), {1, 7}).is_contiguous());
  EXPECT_FALSE(Tensor::from_blob(buf, {2, 2}, DType::f32, Device::cpu(), {1, 2}).is_contiguous());
  EXPECT_FALSE(Tensor::from_blob(buf, {2, 2}, DType::f32, Device::cpu(), {3, 1}).is_contiguous());
}

TEST(Tensor, ContiguousCopyOfTransposedView) {
  Grid g;
  const Tensor t = g.t.t();
  const Tensor c = t.contiguous();
  EXPECT_TRUE(c.is_contiguous());
  EXPECT_TRUE(c.owns_memory());
  EXPECT_NE(c.data(), static_cast<void*>(g.buf));
  EXPECT_EQ(c.shape(), (Shape{6, 4}));
  EXPECT_EQ(c.strides(), (Shape{4, 1}));
  for (int i = 0; i < 6; ++i)
    for (int j = 0; j < 4; ++j) EXPECT_EQ(c.data_ptr<float>()[i * 4 + j], static_cast<float>(j * 6 + i)) << i << "," << j;
  // A copy: later writes to the source are not seen.
  g.buf[1] = 1000.0f;
  EXPECT_EQ(c.data_ptr<float>()[4], 1.0f);
  // Already contiguous: the tensor itself.
  EXPECT_EQ(g.t.contiguous().data(), static_cast<void*>(g.buf));
  // A strided slice of bf16 (2-byte elements).
  uint16_t h[8] = {10, 11, 12, 13, 14, 15, 16, 17};
  const Tensor hb = Tensor::from_blob(h, {2, 4}, DType::bf16).slice(1, 1, 4, 2);  // columns 1, 3
  const Tensor hc = hb.contiguous();
  const uint16_t eh[4] = {11, 13, 15, 17};
  for (int i = 0; i < 4; ++i) EXPECT_EQ(hc.data_ptr<uint16_t>()[i], eh[i]) << i;
}

TEST(Tensor, CopyFromBetweenStridedViews) {
  Grid g;
  // Source: the transposed first 3 columns -> [3, 4], src(i, j) = j*6 + i.
  const Tensor src = g.t.t().slice(0, 0, 3);
  // Destination: every other column of an 8-wide buffer, viewed transposed -> [3, 4].
  float dbuf[4 * 8];
  std::fill(dbuf, dbuf + 32, -5.0f);
  const Tensor dst = Tensor::from_blob(dbuf, {4, 8}, DType::f32).slice(1, 0, 6, 2).t();
  ASSERT_EQ(dst.shape(), (Shape{3, 4}));
  dst.copy_from(src);
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < 8; ++c) {
      const float expected = (c % 2 == 0 && c < 6) ? static_cast<float>(r * 6 + c / 2) : -5.0f;
      EXPECT_EQ(dbuf[r * 8 + c], expected) << r << "," << c;
    }
  // Type and shape must agree.
  Tensor wrong_dtype = Tensor::zeros({3, 4}, DType::i32);
  EXPECT_MOEKIT_ERROR_ARG(dst.copy_from(wrong_dtype), "src");
  EXPECT_MOEKIT_ERROR_ARG(dst.copy_from(Tensor::zeros({4, 3}, DType::f32)), "src");
  EXPECT_MOEKIT_ERROR_ARG(dst.copy_from(Tensor()), "src");
  const Tensor on_gpu = Tensor::from_blob(g.buf, {3, 4}, DType::f32, Device::cuda(0));
  EXPECT_MOEKIT_ERROR_ARG(dst.copy_from(on_gpu), "src");
  EXPECT_MOEKIT_ERROR_ARG(on_gpu.copy_from(src), "self");
  EXPECT_MOEKIT_ERROR_ARG(Tensor().copy_from(src), "self");
}

TEST(Tensor, OutOfRangeDimArguments) {
  Grid g;
  EXPECT_MOEKIT_ERROR_ARG(g.t.size(2), "dim");
  EXPECT_MOEKIT_ERROR_ARG(g.t.size(-3), "dim");
  EXPECT_MOEKIT_ERROR_ARG(g.t.stride(5), "dim");
  EXPECT_EQ(g.t.size(-2), 4);
  EXPECT_EQ(g.t.stride(-2), 6);
  try {
    (void)g.t.size(7);
    ADD_FAILURE() << "no error";
  } catch (const moekit::Error& e) {
    EXPECT_NE(std::string(e.what()).find("7"), std::string::npos) << e.what();
  }
}

// ------------------------------------------------------------------ devices

TEST(Tensor, DeviceParse) {
  EXPECT_EQ(Device::parse("cpu"), Device::cpu());
  EXPECT_TRUE(Device::parse("cpu").is_cpu());
  EXPECT_EQ(Device::parse("cuda"), Device::cuda(0));
  const Device d = Device::parse("cuda:3");
  EXPECT_TRUE(d.is_cuda());
  EXPECT_EQ(d.index, 3);
  EXPECT_EQ(Device::parse("cuda:12").index, 12);
  EXPECT_NE(Device::cuda(1), Device::cuda(2));
  EXPECT_NE(Device::cpu(), Device::cuda(0));
  for (const char* bad : {"gpu", "cuda:", "cuda:x", "", "CPU", "cuda:-1", "cuda:1x", "cuda3", " cpu"})
    EXPECT_MOEKIT_ERROR_ARG(Device::parse(bad), "text");
}

TEST(Tensor, DeviceStr) {
  EXPECT_EQ(Device::cpu().str(), "cpu");
  EXPECT_EQ(Device::cuda().str(), "cuda:0");
  EXPECT_EQ(Device::cuda(3).str(), "cuda:3");
  EXPECT_EQ(Device::parse(Device::cuda(7).str()), Device::cuda(7));
}

TEST(Tensor, CudaAllocationRaisesErrorWithoutBackendOrDevice) {
#ifndef MOEKIT_WITH_CUDA
  // Built without CUDA: allocation on a GPU is a clear error, never a crash.
  EXPECT_MOEKIT_ERROR_ARG(Tensor::empty({4}, DType::f32, Device::cuda(0)), "device");
  EXPECT_MOEKIT_ERROR_ARG(Tensor::zeros({4}, DType::f32, Device::cuda(0)), "device");
  EXPECT_MOEKIT_ERROR_ARG(Tensor::empty({2, 2}, DType::bf16, Device::cuda(1)), "device");
#else
  // Built with CUDA: either a GPU is present (allocation succeeds) or cudaMalloc /
  // cudaSetDevice fails, which must surface as moekit::Error.
  try {
    const Tensor t = Tensor::zeros({4}, DType::f32, Device::cuda(0));
    EXPECT_TRUE(t.device().is_cuda());
    EXPECT_TRUE(t.owns_memory());
    EXPECT_EQ(t.numel(), 4);
  } catch (const moekit::Error& e) {
    EXPECT_EQ(e.argument(), "device") << e.what();
  }
#endif
  // No machine has a GPU with index 999: moekit::Error in both builds.
  EXPECT_MOEKIT_ERROR_ARG(Tensor::empty({4}, DType::f32, Device::cuda(999)), "device");
}

// ------------------------------------------------------------------ moekit::Error

TEST(Tensor, ErrorCarriesAllFields) {
  const moekit::Error e("my_function", "my_arg", "something expected", "something given");
  EXPECT_EQ(e.function(), "my_function");
  EXPECT_EQ(e.argument(), "my_arg");
  EXPECT_EQ(e.expected(), "something expected");
  EXPECT_EQ(e.actual(), "something given");
  const std::string what = e.what();
  for (const char* part : {"my_function", "my_arg", "something expected", "something given"})
    EXPECT_NE(what.find(part), std::string::npos) << what << " lacks " << part;
  // It is a std::runtime_error, catchable as such.
  const std::runtime_error& base = e;
  EXPECT_EQ(std::string(base.what()), what);
}

TEST(Tensor, ErrorFromALibraryCallNamesEverything) {
  try {
    moekit::set_num_threads(0);
    FAIL() << "no error";
  } catch (const moekit::Error& e) {
    EXPECT_EQ(e.function(), "set_num_threads");
    EXPECT_EQ(e.argument(), "n");
    EXPECT_FALSE(e.expected().empty());
    EXPECT_EQ(e.actual(), "0");
    const std::string what = e.what();
    EXPECT_NE(what.find("set_num_threads"), std::string::npos) << what;
    EXPECT_NE(what.find(e.expected()), std::string::npos) << what;
  }
  try {
    (void)Tensor::from_blob(static_cast<void*>(nullptr), {3}, DType::f32);
    FAIL() << "no error";
  } catch (const moekit::Error& e) {
    EXPECT_NE(e.function().find("from_blob"), std::string::npos) << e.what();
    EXPECT_EQ(e.argument(), "data");
    EXPECT_NE(std::string(e.what()).find("data"), std::string::npos);
  }
}

// ------------------------------------------------------------------ runtime

TEST(Runtime, CpuFeaturesConsistent) {
  const moekit::CpuFeatures& f = moekit::cpu_features();
  EXPECT_EQ(&f, &moekit::cpu_features());  // detected once
  // a => b, written as !a || b.
  EXPECT_TRUE(!f.avx512f || f.os_saves_zmm);
  EXPECT_TRUE(!(f.avx512bw || f.avx512vl || f.avx512dq || f.avx512bf16 || f.avx512vnni || f.avx512vbmi || f.gfni) ||
              f.os_saves_zmm);
  EXPECT_TRUE(!f.avx2 || f.os_saves_ymm);
  EXPECT_TRUE(!f.os_saves_zmm || f.os_saves_ymm);
  EXPECT_TRUE(!moekit::isa_supported(Isa::avx2) || (f.avx2 && f.fma && f.f16c));
  if (moekit::isa_supported(Isa::avx512)) {
    EXPECT_TRUE(f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq);
    EXPECT_TRUE(moekit::isa_supported(Isa::avx2));
  }
  EXPECT_TRUE(!f.amx_bf16 || f.os_saves_tiles);
  if (moekit::isa_supported(Isa::avx512_bf16)) {
    EXPECT_TRUE(f.avx512bf16);
    EXPECT_TRUE(moekit::isa_supported(Isa::avx512));
  }
  if (moekit::isa_supported(Isa::amx)) {
    EXPECT_TRUE(f.amx_bf16 && moekit::amx_permitted());
    EXPECT_TRUE(moekit::isa_supported(Isa::avx512));
  }
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  // Independent cross-check: the compiler runtime's own detection (which also checks
  // that the OS saves the wider registers).
  __builtin_cpu_init();
  EXPECT_EQ(f.avx2, static_cast<bool>(__builtin_cpu_supports("avx2")));
  EXPECT_EQ(f.avx512f, static_cast<bool>(__builtin_cpu_supports("avx512f")));
  EXPECT_EQ(f.avx512bw, static_cast<bool>(__builtin_cpu_supports("avx512bw")));
#endif
}

TEST(Runtime, IsaSupportAndNames) {
  EXPECT_TRUE(moekit::isa_supported(Isa::scalar));
  EXPECT_TRUE(moekit::isa_supported(moekit::best_supported_isa()));
  // best is the highest supported level.
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512, Isa::avx512_bf16, Isa::amx})
    if (moekit::isa_supported(isa)) {
      EXPECT_GE(static_cast<int>(moekit::best_supported_isa()), static_cast<int>(isa));
    }
  EXPECT_TRUE(moekit::isa_supported(moekit::active_isa()));
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512, Isa::avx512_bf16, Isa::amx}) EXPECT_EQ(moekit::parse_isa(moekit::isa_name(isa)), isa);
  EXPECT_STREQ(moekit::isa_name(Isa::avx512), "avx512");
  EXPECT_STREQ(moekit::isa_name(Isa::avx512_bf16), "avx512_bf16");
  EXPECT_STREQ(moekit::isa_name(Isa::amx), "amx");
  EXPECT_MOEKIT_ERROR_ARG(moekit::parse_isa("neon"), "name");
  EXPECT_MOEKIT_ERROR_ARG(moekit::parse_isa(""), "name");
  EXPECT_MOEKIT_ERROR_ARG(moekit::parse_isa("AVX2"), "name");
}

// MOEKIT_ISA is read once, by the process's first active_isa(): each value is tried in a
// fresh process (a "threadsafe" death test re-runs this binary up to its statement), which
// prints the Error's function and argument. An unknown name is the environment's fault, so
// it names MOEKIT_ISA, as an unsupported one does (it used to name parse_isa's 'name').
[[noreturn]] void first_active_isa_under(const char* value) {
  ::setenv("MOEKIT_ISA", value, 1);
  try {
    moekit::active_isa();
  } catch (const moekit::Error& e) {
    std::fprintf(stderr, "raised by %s on %s\n", e.function().c_str(), e.argument().c_str());
    std::exit(0);
  }
  std::exit(1);
}

TEST(RuntimeDeathTest, BadIsaEnvironmentNamesMoekitIsa) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  for (const char* value : {"bogus", "AVX2"}) {
    SCOPED_TRACE(value);
    EXPECT_EXIT(first_active_isa_under(value), ::testing::ExitedWithCode(0), "raised by active_isa on MOEKIT_ISA");
  }
}

TEST(Runtime, SetActiveIsaAndScopedIsaRestore) {
  const Isa original = moekit::active_isa();
  {
    moekit::ScopedIsa scoped(Isa::scalar);
    EXPECT_EQ(moekit::active_isa(), Isa::scalar);
    if (moekit::isa_supported(Isa::avx2)) {
      moekit::ScopedIsa inner(Isa::avx2);
      EXPECT_EQ(moekit::active_isa(), Isa::avx2);
    }
    EXPECT_EQ(moekit::active_isa(), Isa::scalar);
  }
  EXPECT_EQ(moekit::active_isa(), original);
  moekit::set_active_isa(Isa::scalar);
  EXPECT_EQ(moekit::active_isa(), Isa::scalar);
  moekit::set_active_isa(original);
  EXPECT_EQ(moekit::active_isa(), original);
}

TEST(Runtime, SetActiveIsaUnsupportedRaises) {
  Isa missing = Isa::scalar;
  for (Isa isa : {Isa::amx, Isa::avx512_bf16, Isa::avx512, Isa::avx2})
    if (!moekit::isa_supported(isa)) missing = isa;
  if (missing == Isa::scalar) GTEST_SKIP() << "every ISA level is supported here: no unsupported one to test";
  SCOPED_TRACE(moekit::isa_name(missing));
  const Isa original = moekit::active_isa();
  EXPECT_MOEKIT_ERROR_ARG(moekit::set_active_isa(missing), "isa");
  EXPECT_EQ(moekit::active_isa(), original);  // unchanged by the failed call
  EXPECT_THROW({ moekit::ScopedIsa s(missing); }, moekit::Error);
  EXPECT_EQ(moekit::active_isa(), original);
}

TEST(Runtime, NumThreads) {
  const int original = moekit::num_threads();
  EXPECT_GE(original, 1);
  EXPECT_MOEKIT_ERROR_ARG(moekit::set_num_threads(0), "n");
  EXPECT_MOEKIT_ERROR_ARG(moekit::set_num_threads(-4), "n");
  EXPECT_EQ(moekit::num_threads(), original);
  moekit::set_num_threads(3);
  EXPECT_EQ(moekit::num_threads(), 3);
  moekit::set_num_threads(1);
  EXPECT_EQ(moekit::num_threads(), 1);
  moekit::set_num_threads(original);
  EXPECT_EQ(moekit::num_threads(), original);
}

}  // namespace

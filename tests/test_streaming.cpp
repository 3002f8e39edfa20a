// The non-temporal store paths of the casts (taken for outputs above a size threshold: the
// quantize kernels' own streaming stores, and dequantisation through a per-thread stage in
// chunks of whole scale groups) must give exactly the bytes of the cached path and of the
// portable path.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "cpu/formats/format_kernels.h"
#include "moekit/formats.h"
#include "test_util.h"

namespace {

using namespace moekit;

Tensor random_bf16(int64_t rows, int64_t cols) {
  Tensor t = Tensor::empty({rows, cols}, DType::bf16);
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  for (int64_t i = 0; i < rows * cols; ++i) t.data_ptr<uint16_t>()[i] = f32_to_bf16(dist(rng));
  return t;
}

bool same(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && std::memcmp(a.data(), b.data(), a.numel() * a.element_size()) == 0;
}

struct StreamingThreshold {
  explicit StreamingThreshold(int64_t bytes) : previous(detail::set_streaming_threshold(bytes)) {}
  ~StreamingThreshold() { detail::set_streaming_threshold(previous); }
  int64_t previous;
};

TEST(Streaming, CastsMatchCachedPathOnEveryIsa) {
  // 130 columns: blocks of 32 plus a tail; rows offset so some rows start unaligned.
  const Tensor x = random_bf16(67, 1030);
  const Tensor xv = x.slice(1, 3, 1030);  // strided view, unaligned row starts
  for (const Tensor& in : {x, xv}) {
    Quantized fp8_cached, fp4_cached;
    Tensor back8_cached, back8_f32_cached, back4_cached;
    {
      ScopedIsa portable(Isa::scalar);
      fp8_cached = per_token_cast_to_fp8(in, false);
      fp4_cached = per_token_cast_to_fp4(in, true);
      back8_cached = cast_back_from_fp8(fp8_cached.values, fp8_cached.sf, DType::bf16);
      back8_f32_cached = cast_back_from_fp8(fp8_cached.values, fp8_cached.sf, DType::f32);
      back4_cached = cast_back_from_fp4(fp4_cached.values, fp4_cached.sf, DType::f32, 1, 32, in.size(1));
    }
    StreamingThreshold all_streaming(1);
    for (Isa isa : moekit::testing::supported_isas()) {
      ScopedIsa scoped(isa);
      SCOPED_TRACE(isa_name(isa));
      const Quantized fp8 = per_token_cast_to_fp8(in, false);
      const Quantized fp4 = per_token_cast_to_fp4(in, true);
      EXPECT_TRUE(same(fp8.values, fp8_cached.values));
      EXPECT_TRUE(same(fp8.sf, fp8_cached.sf));
      EXPECT_TRUE(same(fp4.values, fp4_cached.values));
      EXPECT_TRUE(same(cast_back_from_fp8(fp8.values, fp8.sf, DType::bf16), back8_cached));
      EXPECT_TRUE(same(cast_back_from_fp8(fp8.values, fp8.sf, DType::f32), back8_f32_cached));
      EXPECT_TRUE(same(cast_back_from_fp4(fp4.values, fp4.sf, DType::f32, 1, 32, in.size(1)), back4_cached));
    }
  }
}

// Rows longer than the 2048-column stage, so that they go out in several chunks: a partial
// last chunk, odd column counts (an FP4 row ending in half a byte), scale groups of 32 and 128,
// and groups longer than the stage (a chunk is then one group).
TEST(Streaming, StagedDequantisationMatchesCachedPathOnEveryIsa) {
  const Tensor x = random_bf16(5, 6999);
  const Quantized fp8 = per_token_cast_to_fp8(x, false);
  const Quantized fp8_long = per_token_cast_to_fp8(x, false, 3000);
  const Quantized fp4 = per_token_cast_to_fp4(x, false);
  Tensor codes8 = Tensor::empty(x.shape(), DType::e4m3), codes4 = Tensor::empty({5, 3500}, DType::e2m1x2);
  convert(x, codes8);
  convert(x, codes4);
  auto outputs = [&] {
    std::vector<Tensor> out;
    for (DType wide : {DType::bf16, DType::f32}) {
      out.push_back(cast_back_from_fp8(fp8.values, fp8.sf, wide));
      out.push_back(cast_back_from_fp8(fp8_long.values, fp8_long.sf, wide, 1, 3000));
      out.push_back(cast_back_from_fp4(fp4.values, fp4.sf, wide, 1, 32, x.size(1)));
      for (const Tensor* codes : {&codes8, &codes4}) {
        Tensor t = Tensor::empty(x.shape(), wide);
        convert(*codes, t);
        out.push_back(t);
      }
    }
    return out;
  };
  std::vector<Tensor> cached;
  {
    ScopedIsa portable(Isa::scalar);
    cached = outputs();
  }
  StreamingThreshold all_streaming(1);
  for (Isa isa : moekit::testing::supported_isas()) {
    ScopedIsa scoped(isa);
    SCOPED_TRACE(isa_name(isa));
    const std::vector<Tensor> streamed = outputs();
    ASSERT_EQ(streamed.size(), cached.size());
    for (size_t i = 0; i < cached.size(); ++i) EXPECT_TRUE(same(streamed[i], cached[i])) << "output " << i;
  }
}

// Zero columns or zero rows: nothing to write, on the staged path and off it.
TEST(Streaming, EmptyDequantisationsOnEveryIsa) {
  for (int64_t threshold : {int64_t{1}, int64_t{1} << 40}) {
    StreamingThreshold streaming(threshold);
    for (Isa isa : moekit::testing::supported_isas()) {
      ScopedIsa scoped(isa);
      for (const Shape& shape : {Shape{3, 0}, Shape{0, 5}}) {
        const Tensor q8 = Tensor::zeros(shape, DType::e4m3), q4 = Tensor::zeros({shape[0], (shape[1] + 1) / 2}, DType::e2m1x2);
        const Tensor sf8 = Tensor::zeros({shape[0], (shape[1] + 127) / 128}, DType::f32);
        const Tensor sf4 = Tensor::zeros({shape[0], (shape[1] + 31) / 32}, DType::f32);
        EXPECT_EQ(cast_back_from_fp8(q8, sf8, DType::bf16).shape(), shape);
        EXPECT_EQ(cast_back_from_fp4(q4, sf4, DType::f32, 1, 32, shape[1]).shape(), shape);
        Tensor out = Tensor::empty(shape, DType::f32);
        convert(q8, out);
      }
    }
  }
}

}  // namespace

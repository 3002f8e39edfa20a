// The CUDA backend on a real GPU: Tensor copies between host and device, and the first GPU
// kernel (fp8 dequantisation) against the CPU path, bit for bit. Where no GPU is visible
// (or moekit was built without MOEKIT_CUDA) the GPU tests report themselves skipped, and
// only the error behaviour is checked.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "moekit/formats.h"
#include "moekit/runtime.h"
#include "moekit/tensor.h"
#include "test_util.h"

namespace {

using moekit::Device;
using moekit::DType;
using moekit::Tensor;

#define REQUIRE_GPU()                                                                              \
  if (moekit::cuda_device_count() == 0)                                                            \
  GTEST_SKIP() << "no CUDA device visible here (the GPU path is run on a machine that has one; " \
                  "see docs/CUDA.md)"

Tensor byte_pattern(int64_t rows, int64_t cols) {
  Tensor t = Tensor::empty({rows, cols}, DType::u8);
  auto* p = t.data_ptr<uint8_t>();
  for (int64_t i = 0; i < rows * cols; ++i) p[i] = static_cast<uint8_t>((i * 37 + i / 11) & 0xff);
  return t;
}

TEST(Cuda, DeviceCountMatchesWhatAllocationFinds) {
#ifndef MOEKIT_WITH_CUDA
  EXPECT_EQ(moekit::cuda_device_count(), 0);
#endif
  const int count = moekit::cuda_device_count();
  ASSERT_GE(count, 0);
  if (count > 0) {
    EXPECT_NO_THROW(Tensor::zeros({1}, DType::f32, Device::cuda(count - 1)));
  } else {
    EXPECT_MOEKIT_ERROR_ARG(Tensor::zeros({1}, DType::f32, Device::cuda(0)), "device");
  }
  EXPECT_MOEKIT_ERROR_ARG(Tensor::zeros({1}, DType::f32, Device::cuda(count)), "device");
}

TEST(Cuda, ToOnTheSameDeviceIsTheTensorItself) {
  const Tensor t = byte_pattern(3, 5);
  const Tensor same = t.to(Device::cpu());
  EXPECT_EQ(same.data(), t.data());
  EXPECT_MOEKIT_ERROR_ARG(Tensor().to(Device::cpu()), "self");
}

TEST(Cuda, ToAGpuWithoutOneIsAnError) {
  if (moekit::cuda_device_count() > 0) GTEST_SKIP() << "a GPU is visible: the error path is not reachable";
  EXPECT_MOEKIT_ERROR_ARG(byte_pattern(2, 2).to(Device::cuda(0)), "device");
#ifndef MOEKIT_WITH_CUDA
  // Memory labelled as a GPU's, copied to the host by a build without the backend: the
  // tensor itself is what cannot be read.
  const Tensor host = byte_pattern(2, 2);
  EXPECT_MOEKIT_ERROR_ARG(Tensor::from_blob(host.data(), {2, 2}, DType::u8, Device::cuda(0)).to(Device::cpu()), "self");
#endif
}

TEST(Cuda, RoundTripThroughTheGpuIsBitExact) {
  REQUIRE_GPU();
  const Tensor src = byte_pattern(37, 129);
  const Tensor view = src.slice(1, 3, 120, 2);  // strided: packed on the host first
  const Tensor gpu = view.to(Device::cuda(0));
  EXPECT_TRUE(gpu.device().is_cuda());
  EXPECT_TRUE(gpu.is_contiguous());
  EXPECT_EQ(gpu.to(Device::cuda(0)).data(), gpu.data());
  const Tensor back = gpu.to(Device::cpu());
  ASSERT_EQ(back.shape(), view.shape());
  for (int64_t r = 0; r < view.size(0); ++r)
    for (int64_t c = 0; c < view.size(1); ++c)
      ASSERT_EQ(back.data_ptr<uint8_t>()[r * back.stride(0) + c],
                view.data_ptr<uint8_t>()[r * view.stride(0) + c * view.stride(1)])
          << r << "," << c;
  // A strided GPU tensor cannot be copied back in one piece; an empty one has nothing to copy.
  const Tensor wide = byte_pattern(4, 8).to(Device::cuda(0));
  EXPECT_MOEKIT_ERROR_ARG(wide.slice(1, 0, 8, 2).to(Device::cpu()), "self");
  EXPECT_EQ(wide.slice(1, 0, 0).to(Device::cpu()).numel(), 0);
  // Zero-size and packed-fp4 tensors travel too.
  EXPECT_EQ(Tensor::empty({0, 3}, DType::f32).to(Device::cuda(0)).to(Device::cpu()).numel(), 0);
  Tensor fp4 = Tensor::empty({3, 5}, DType::e2m1x2);
  for (int i = 0; i < 15; ++i) fp4.data_ptr<uint8_t>()[i] = static_cast<uint8_t>(i * 17);
  const Tensor fp4_back = fp4.to(Device::cuda(0)).to(Device::cpu());
  EXPECT_EQ(fp4_back.dtype(), DType::e2m1x2);
  EXPECT_EQ(std::memcmp(fp4_back.data(), fp4.data(), 15), 0);
}

// Scales that exercise every rounding regime of e4m3 × f32: exact powers of two, values
// with full mantissas, products that underflow into subnormals or to zero, overflow to
// infinity, zero and infinite scales (0 × inf = NaN), and negative scales.
std::vector<float> awkward_scales() {
  return {1.0f,     0.5f,   3.0f / 7.0f, -1.75f,  0x1p-100f, 1e-40f /* subnormal */, 0x1p100f, 0x1p127f,
          0.0f,     -0.0f,  std::numeric_limits<float>::infinity(), 1.1f, 123.456f, 0x1.fffffep-3f, -6e-39f, 7.0f};
}

void expect_same_bits(const Tensor& gpu_result, const Tensor& cpu_result) {
  ASSERT_EQ(gpu_result.shape(), cpu_result.shape());
  const auto* g = gpu_result.data_ptr<float>();
  const auto* c = cpu_result.data_ptr<float>();
  int64_t mismatches = 0;
  for (int64_t i = 0; i < cpu_result.numel(); ++i) {
    // NaN payloads are not part of the contract (formats.md): any NaN matches any NaN.
    const bool same = std::isnan(c[i]) ? std::isnan(g[i]) : std::bit_cast<uint32_t>(g[i]) == std::bit_cast<uint32_t>(c[i]);
    if (!same && ++mismatches <= 5)
      ADD_FAILURE() << "element " << i << ": gpu " << g[i] << " cpu " << c[i];
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(Cuda, CastBackFromFp8MatchesTheCpuBitForBit) {
  REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  // M above one block's rows and K not a multiple of the group: partial groups both ways.
  const int64_t M = 300, K = 1000;
  Tensor q = Tensor::empty({M, K}, DType::e4m3);
  for (int64_t i = 0; i < M * K; ++i) q.data_ptr<uint8_t>()[i] = static_cast<uint8_t>((i * 7 + i / 255) & 0xff);
  const std::vector<float> scales = awkward_scales();
  for (const auto& [gran_m, gran_k] : std::vector<std::pair<int64_t, int64_t>>{{1, 128}, {128, 128}, {1, 32}, {7, 1000}}) {
    SCOPED_TRACE("gran " + std::to_string(gran_m) + "x" + std::to_string(gran_k));
    const int64_t sm = (M + gran_m - 1) / gran_m, sk = (K + gran_k - 1) / gran_k;
    Tensor sf = Tensor::empty({sm, sk}, DType::f32);
    for (int64_t i = 0; i < sm * sk; ++i) sf.data_ptr<float>()[i] = scales[static_cast<size_t>(i * 5 + i / 3) % scales.size()];
    const Tensor want = moekit::cast_back_from_fp8(q, sf, DType::f32, gran_m, gran_k);
    const Tensor got = moekit::cast_back_from_fp8(q.to(gpu), sf.to(gpu), DType::f32, gran_m, gran_k);
    EXPECT_TRUE(got.device().is_cuda());
    // Against every CPU path this machine has (they agree bit for bit with each other).
    moekit::testing::for_each_isa([&](moekit::Isa) {
      expect_same_bits(got.to(Device::cpu()), moekit::cast_back_from_fp8(q, sf, DType::f32, gran_m, gran_k));
    });
    // Destination-first form into a GPU tensor that already holds data.
    Tensor out = Tensor::empty({M, K}, DType::f32);
    std::memset(out.data(), 0xab, static_cast<size_t>(M * K) * 4);
    const Tensor out_gpu = out.to(gpu);
    moekit::cast_back_from_fp8_into(q.to(gpu), sf.to(gpu), out_gpu, gran_m, gran_k);
    expect_same_bits(out_gpu.to(Device::cpu()), want);
  }
}

}  // namespace

// CUDA side of the formats component: the element decoders as device functions and the
// first GPU kernel (fp8 dequantisation), so the CUDA path exists and CI proves it builds.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "core/check.h"
#include "core/device_memory.h"
#include "moekit/tensor.h"

namespace moekit::cuda {

// e4m3fn → f32: the same bit construction as the CPU kernels (formats.md).
__device__ __forceinline__ float e4m3_to_f32(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80) << 24;
  const uint32_t mag = code & 0x7f;
  float v;
  if (mag == 0x7f) return __int_as_float(0x7fc00000 | sign);
  if (mag < 8) v = static_cast<float>(mag) * 0x1p-9f;  // subnormal: m/8 · 2^-6
  else v = __uint_as_float(mag << 20) * 0x1p120f;      // rebias 7 → 127
  return __uint_as_float(__float_as_uint(v) | sign);
}

__device__ __forceinline__ float e2m1_to_f32(uint8_t nibble) {
  constexpr float kMagnitudes[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float v = kMagnitudes[nibble & 7];
  return (nibble & 8) ? -v : v;
}

__global__ void cast_back_from_fp8_kernel(const uint8_t* __restrict__ q, int64_t q_stride,
                                          const float* __restrict__ sf, int64_t sf_stride,
                                          float* __restrict__ out, int64_t out_stride,
                                          int64_t m, int64_t k, int64_t gran_m, int64_t gran_k) {
  const int64_t r = blockIdx.y;
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < k;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[r * out_stride + c] = e4m3_to_f32(q[r * q_stride + c]) * sf[(r / gran_m) * sf_stride + c / gran_k];
  (void)m;
}

}  // namespace moekit::cuda

namespace moekit::detail {

void cuda_cast_back_from_fp8(const Tensor& q, const Tensor& sf, const Tensor& out, int64_t gran_m, int64_t gran_k) {
  const int64_t m = out.size(0), k = out.size(1);
  if (m == 0 || k == 0) return;
  if (m > 65535) fail("cast_back_from_fp8", "q", "at most 65535 rows on cuda", std::to_string(m));
  cudaSetDevice(out.device().index);
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((k + 255) / 256, 1024)), static_cast<unsigned>(m));
  moekit::cuda::cast_back_from_fp8_kernel<<<grid, 256>>>(q.data_ptr<uint8_t>(), q.stride(0), sf.data_ptr<float>(), sf.stride(0),
                                                         out.data_ptr<float>(), out.stride(0), m, k, gran_m, gran_k);
  const cudaError_t status = cudaDeviceSynchronize();
  if (status != cudaSuccess)
    fail("cast_back_from_fp8", "q", "a successful kernel launch", cudaGetErrorString(status));
}

}  // namespace moekit::detail

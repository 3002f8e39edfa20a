// CUDA device memory for moekit::Tensor (built only with MOEKIT_CUDA).
#include <cuda_runtime.h>

#include <string>

#include "core/check.h"
#include "core/device_memory.h"

namespace moekit::detail {

namespace {
void check_cuda(cudaError_t status, const char* fn, int device) {
  if (status != cudaSuccess)
    fail(fn, "device", "a working CUDA device", "cuda:" + std::to_string(device) + " (" + cudaGetErrorString(status) + ")");
}
}  // namespace

bool cuda_backend_built() { return true; }

void* cuda_alloc(size_t bytes, int device) {
  check_cuda(cudaSetDevice(device), "Tensor::empty", device);
  void* p = nullptr;
  check_cuda(cudaMalloc(&p, bytes), "Tensor::empty", device);
  return p;
}

void cuda_free(void* ptr, int device) noexcept {
  if (cudaSetDevice(device) == cudaSuccess) cudaFree(ptr);
}

void cuda_memset_zero(void* ptr, size_t bytes, int device) {
  check_cuda(cudaSetDevice(device), "Tensor::zeros", device);
  check_cuda(cudaMemset(ptr, 0, bytes), "Tensor::zeros", device);
}

void cuda_memcpy(void* dst, const void* src, size_t bytes, int device) {
  check_cuda(cudaSetDevice(device), "Tensor::to", device);
  check_cuda(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault), "Tensor::to", device);
}

int cuda_device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver / no device" status
    return 0;
  }
  return n;
}

}  // namespace moekit::detail

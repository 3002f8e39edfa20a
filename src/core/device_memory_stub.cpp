// Used when moekit is built without the CUDA backend.
#include "check.h"
#include "device_memory.h"
#include "moekit/tensor.h"

namespace moekit::detail {

bool cuda_backend_built() { return false; }

void* cuda_alloc(size_t, int device) {
  fail("Tensor::empty", "device", "cpu (this moekit was built without MOEKIT_CUDA)",
       "cuda:" + std::to_string(device));
}

void cuda_free(void*, int) noexcept {}

void cuda_memset_zero(void*, size_t, int device) {
  fail("Tensor::zeros", "device", "cpu (this moekit was built without MOEKIT_CUDA)",
       "cuda:" + std::to_string(device));
}

void cuda_memcpy(void*, const void*, size_t, int device) {
  fail("Tensor::to", "device", "cpu (this moekit was built without MOEKIT_CUDA)", "cuda:" + std::to_string(device));
}

int cuda_device_count() noexcept { return 0; }

}  // namespace moekit::detail

namespace moekit::detail {
void cuda_cast_back_from_fp8(const Tensor&, const Tensor&, const Tensor& out, int64_t, int64_t) {
  fail("cast_back_from_fp8", "q", "a cpu tensor (this moekit was built without MOEKIT_CUDA)", out.device().str());
}
}  // namespace moekit::detail

// Device memory hooks: implemented by src/cuda when the CUDA backend is built, and by a
// stub that raises moekit::Error otherwise, so the CPU build never depends on CUDA.
#pragma once

#include <cstddef>
#include <cstdint>

namespace moekit::detail {

bool cuda_backend_built();
void* cuda_alloc(size_t bytes, int device);  // zero-filled when zero is set
void cuda_free(void* ptr, int device) noexcept;
void cuda_memset_zero(void* ptr, size_t bytes, int device);
// Copies bytes between any two of host and device memory (unified addressing); `device`
// is the GPU involved, named in errors.
void cuda_memcpy(void* dst, const void* src, size_t bytes, int device);
int cuda_device_count() noexcept;  // 0 on any failure

}  // namespace moekit::detail

namespace moekit {
class Tensor;
}

namespace moekit::detail {
// out[r, c] = e4m3(q[r, c]) * sf[r / gran_m, c / gran_k] on the GPU (f32 sf, f32 out,
// row-major, already validated). Stub raises moekit::Error.
void cuda_cast_back_from_fp8(const Tensor& q, const Tensor& sf, const Tensor& out, int64_t gran_m, int64_t gran_k);
}  // namespace moekit::detail

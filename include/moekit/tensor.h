// moekit::Tensor: a typed, strided view of memory on one device.
//
// Only what the kernel APIs need: dtype, shape, strides (in elements), device, and either
// owned 64-byte-aligned storage or caller memory wrapped without copying (like
// torch::from_blob). Views (slice, select, transpose, reshape of contiguous data) share
// the storage. There is no arithmetic here; kernels live in the component headers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "moekit/error.h"

namespace moekit {

enum class DType : uint8_t {
  f32,
  bf16,
  f16,
  e4m3,    // fp8 e4m3fn
  e5m2,    // fp8 e5m2
  e2m1x2,  // fp4 e2m1, two per byte along the last dim, even index in the low nibble
  ue8m0,   // unsigned power-of-two exponent byte (scale factors)
  i8,
  u8,
  i32,
  i64,
  boolean,
};

// Bytes per stored element (e2m1x2: one byte holds two fp4 values).
size_t element_size(DType dtype);
const char* dtype_name(DType dtype);

struct Device {
  enum class Kind : uint8_t { cpu, cuda };
  Kind kind = Kind::cpu;
  int index = 0;

  static Device cpu() { return {}; }
  static Device cuda(int index = 0) { return {Kind::cuda, index}; }
  // Parses "cpu", "cuda", "cuda:N".
  static Device parse(const std::string& text);

  bool is_cpu() const { return kind == Kind::cpu; }
  bool is_cuda() const { return kind == Kind::cuda; }
  bool operator==(const Device& o) const { return kind == o.kind && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
  std::string str() const;
};

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& shape);

class Tensor {
 public:
  Tensor() = default;

  // Owned, 64-byte-aligned, uninitialised / zero-filled storage. Contiguous row-major.
  static Tensor empty(const Shape& shape, DType dtype, Device device = Device::cpu());
  static Tensor zeros(const Shape& shape, DType dtype, Device device = Device::cpu());
  // Wraps caller memory; the caller keeps it alive. Strides default to row-major; given
  // strides must be non-negative, with the furthest element ending within 2^63 bytes (every
  // extent counts, an empty tensor's others too), else moekit::Error on "strides". Shapes
  // (here and in empty / zeros) hold at most 2^48 elements, zero extents counted as 1.
  static Tensor from_blob(void* data, const Shape& shape, DType dtype, Device device = Device::cpu(),
                          const Shape& strides = {});
  static Tensor from_blob(const void* data, const Shape& shape, DType dtype,
                          Device device = Device::cpu(), const Shape& strides = {}) {
    return from_blob(const_cast<void*>(data), shape, dtype, device, strides);
  }

  // Wraps memory whose lifetime owner manages: the tensor (and every view of it) holds a
  // reference to owner, so the memory stays valid for as long as any of them lives.
  static Tensor from_blob_with_owner(void* data, const Shape& shape, DType dtype,
                                     std::shared_ptr<void> owner, Device device = Device::cpu());

  bool defined() const { return defined_; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int64_t size(int64_t d) const { return shape_[wrap_dim(d)]; }
  int64_t stride(int64_t d) const { return strides_[wrap_dim(d)]; }
  int64_t numel() const;
  size_t element_size() const { return moekit::element_size(dtype_); }
  bool is_contiguous() const;
  bool owns_memory() const { return storage_ != nullptr; }

  void* data() const { return data_; }
  template <typename T>
  T* data_ptr() const { return static_cast<T*>(data_); }

  // Views sharing storage. Negative dims count from the end.
  Tensor slice(int64_t d, int64_t start, int64_t end, int64_t step = 1) const;
  Tensor select(int64_t d, int64_t index) const;
  Tensor transpose(int64_t d0, int64_t d1) const;
  Tensor t() const { return transpose(0, 1); }
  // Contiguous data only (otherwise Error); one extent may be -1.
  Tensor reshape(const Shape& shape) const;
  // A contiguous copy (CPU only); the tensor itself when already contiguous.
  Tensor contiguous() const;
  // Element-wise copy from another CPU tensor of the same dtype and shape.
  void copy_from(const Tensor& src) const;
  // A contiguous copy on `device` (like torch's .to(device)); the tensor itself when it is
  // already there. Copies between the CPU and a GPU need the CUDA backend (Error
  // otherwise); a strided GPU source is an Error (make it contiguous on the GPU first).
  Tensor to(Device device) const;

  std::string str() const;  // "bf16[4, 128] cpu"

 private:
  int64_t wrap_dim(int64_t d) const;

  std::shared_ptr<void> storage_;  // null when wrapping caller memory
  void* data_ = nullptr;
  Shape shape_, strides_;
  DType dtype_ = DType::f32;
  Device device_;
  bool defined_ = false;
};

}  // namespace moekit

#include "moekit/tensor.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>

#include "check.h"
#include "device_memory.h"
#include "host_memory.h"

namespace moekit {

using detail::fail;

size_t element_size(DType dtype) {
  switch (dtype) {
    case DType::f32: case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::bf16: case DType::f16: return 2;
    case DType::e4m3: case DType::e5m2: case DType::e2m1x2: case DType::ue8m0:
    case DType::i8: case DType::u8: case DType::boolean: return 1;
  }
  return 1;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::e4m3: return "e4m3";
    case DType::e5m2: return "e5m2";
    case DType::e2m1x2: return "e2m1x2";
    case DType::ue8m0: return "ue8m0";
    case DType::i8: return "i8";
    case DType::u8: return "u8";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::boolean: return "bool";
  }
  return "?";
}

Device Device::parse(const std::string& text) {
  if (text == "cpu") return cpu();
  if (text == "cuda") return cuda(0);
  if (text.rfind("cuda:", 0) == 0 && text.size() > 5) {
    const std::string digits = text.substr(5);
    if (digits.find_first_not_of("0123456789") == std::string::npos && digits.size() < 6)
      return cuda(std::stoi(digits));
  }
  fail("Device::parse", "text", "\"cpu\", \"cuda\" or \"cuda:N\"", "\"" + text + "\"");
}

std::string Device::str() const {
  return is_cpu() ? "cpu" : "cuda:" + std::to_string(index);
}

std::string shape_str(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

namespace {

Shape row_major_strides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t running = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = running;
    running *= shape[i];
  }
  return strides;
}

// The element count, at most 2^48 also with an empty tensor's zero extents taken as 1: the
// row-major strides (products of the later extents) and every view's offsets then fit in
// int64 whatever the extents beside a zero.
int64_t checked_numel(const char* fn, const Shape& shape) {
  int64_t n = 1, spread = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0)
      fail(fn, "shape", "non-negative extents", shape_str(shape));
    if (shape[i] != 0 && spread > (int64_t{1} << 48) / shape[i])
      fail(fn, "shape", "at most 2^48 elements (zero extents counted as 1)", shape_str(shape));
    spread *= std::max<int64_t>(shape[i], 1);
    n *= shape[i];
  }
  return n;
}

}  // namespace

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int64_t s : shape_) n *= s;
  return n;
}

bool Tensor::is_contiguous() const {
  int64_t expected = 1;
  for (size_t i = shape_.size(); i-- > 0;) {
    if (shape_[i] != 1 && strides_[i] != expected) return false;
    expected *= shape_[i];
  }
  return true;
}

int64_t Tensor::wrap_dim(int64_t d) const {
  const int64_t n = dim();
  if (d < -n || d >= n)
    fail("Tensor", "dim", "a dimension in [" + std::to_string(-n) + ", " + std::to_string(n) + ")",
         std::to_string(d));
  return d < 0 ? d + n : d;
}

namespace detail {

// Large blocks on huge pages: kernels stream such tensors and buffers, and 4 KiB pages cost a
// fault per page on first touch (packing 117 MB of weights spent most of its time in the
// page-fault handler) and a TLB miss per 4 KiB when streamed. The GEMM's partial sums (one
// 4 KiB tile per page on 4 KiB pages) were 1-2 % slower without them (bf16 4096 x 2112 x
// 7168, Zen 4).
constexpr size_t kHugePage = size_t{2} << 20;
void* host_alloc(size_t bytes) {
  if (bytes < 2 * kHugePage) return std::aligned_alloc(64, bytes == 0 ? 64 : (bytes + 63) / 64 * 64);
  const size_t whole = (bytes + kHugePage - 1) / kHugePage * kHugePage;  // aligned_alloc needs a multiple
  void* p = std::aligned_alloc(kHugePage, whole);
#ifdef MADV_HUGEPAGE
  if (p) madvise(p, whole, MADV_HUGEPAGE);  // a hint: failure is harmless
#endif
  return p;
}

}  // namespace detail

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  const int64_t n = checked_numel("Tensor::empty", shape);
  // Round up to whole cache lines so vector kernels may touch the last line safely.
  const size_t bytes = ((static_cast<size_t>(n) * moekit::element_size(dtype) + 63) / 64) * 64;
  Tensor t;
  if (device.is_cpu()) {
    void* p = detail::host_alloc(bytes);
    if (!p) fail("Tensor::empty", "shape", "an allocatable size", std::to_string(bytes) + " bytes");
    t.storage_ = std::shared_ptr<void>(p, [](void* q) { std::free(q); });
  } else {
    void* p = detail::cuda_alloc(bytes == 0 ? 64 : bytes, device.index);
    const int index = device.index;
    t.storage_ = std::shared_ptr<void>(p, [index](void* q) { detail::cuda_free(q, index); });
  }
  t.data_ = t.storage_.get();
  t.shape_ = shape;
  t.strides_ = row_major_strides(shape);
  t.dtype_ = dtype;
  t.device_ = device;
  t.defined_ = true;
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  if (device.is_cpu())
    std::memset(t.data_, 0, bytes);
  else
    detail::cuda_memset_zero(t.data_, bytes, device.index);
  return t;
}

Tensor Tensor::from_blob(void* data, const Shape& shape, DType dtype, Device device,
                         const Shape& strides) {
  const int64_t n = checked_numel("Tensor::from_blob", shape);
  if (data == nullptr && n > 0) fail("Tensor::from_blob", "data", "non-null pointer", "nullptr");
  if (!strides.empty() && strides.size() != shape.size())
    fail("Tensor::from_blob", "strides", std::to_string(shape.size()) + " strides",
         std::to_string(strides.size()));
  for (int64_t s : strides)
    if (s < 0) fail("Tensor::from_blob", "strides", "non-negative strides", shape_str(strides));
  // Views (slice, select) and kernels form byte offsets index · stride · element size, and
  // views_overlap the end of the furthest element: they fit in int64 when that end does.
  const auto es = static_cast<int64_t>(moekit::element_size(dtype));
  int64_t span = es;
  for (size_t i = 0; i < strides.size(); ++i) {
    int64_t reach = 0;
    if (shape[i] > 0 && (__builtin_mul_overflow(shape[i] - 1, strides[i], &reach) ||
                         __builtin_mul_overflow(reach, es, &reach) ||
                         __builtin_add_overflow(span, reach, &span)))
      fail("Tensor::from_blob", "strides", "strides whose furthest element ends within 2^63 bytes",
           "shape " + shape_str(shape) + ", strides " + shape_str(strides));
  }
  Tensor t;
  t.data_ = data;
  t.shape_ = shape;
  t.strides_ = strides.empty() ? row_major_strides(shape) : strides;
  t.dtype_ = dtype;
  t.device_ = device;
  t.defined_ = true;
  return t;
}

Tensor Tensor::from_blob_with_owner(void* data, const Shape& shape, DType dtype,
                                    std::shared_ptr<void> owner, Device device) {
  Tensor t = from_blob(data, shape, dtype, device);
  t.storage_ = std::move(owner);
  return t;
}

namespace {

// The byte offset of a slice's start. A start inside the dimension gives one that fits in
// int64 (from_blob bounds the furthest element's end); the end of the dimension (start ==
// extent) need not, e.g. on a dimension of size 1, which may have any stride. A slice there
// is empty and reads nothing, so it keeps the base pointer when the offset would overflow.
int64_t start_offset(int64_t start, int64_t stride, size_t element_size) {
  int64_t offset = 0;
  if (__builtin_mul_overflow(start, stride, &offset) ||
      __builtin_mul_overflow(offset, static_cast<int64_t>(element_size), &offset))
    return 0;
  return offset;
}

}  // namespace

Tensor Tensor::slice(int64_t d, int64_t start, int64_t end, int64_t step) const {
  d = wrap_dim(d);
  const int64_t n = shape_[d];
  if (step <= 0) fail("Tensor::slice", "step", "a positive step", std::to_string(step));
  if (start < 0) start += n;
  if (end < 0) end += n;
  end = std::min(end, n);
  if (start < 0 || start > end)
    fail("Tensor::slice", "start", "0 <= start <= end <= " + std::to_string(n),
         "start " + std::to_string(start) + ", end " + std::to_string(end));
  Tensor t = *this;
  t.data_ = static_cast<char*>(data_) + start_offset(start, strides_[d], element_size());
  const int64_t count = start == end ? 0 : (end - start - 1) / step + 1;
  int64_t stride = strides_[d];
  if (count > 1 && __builtin_mul_overflow(strides_[d], step, &stride))
    fail("Tensor::slice", "step", "a step whose stride fits in int64", std::to_string(step));
  t.shape_[d] = count;
  t.strides_[d] = stride;
  return t;
}

Tensor Tensor::select(int64_t d, int64_t index) const {
  d = wrap_dim(d);
  if (index < 0) index += shape_[d];
  if (index < 0 || index >= shape_[d])
    fail("Tensor::select", "index", "an index in [0, " + std::to_string(shape_[d]) + ")",
         std::to_string(index));
  Tensor t = *this;  // (index < extent: the offset fits, as in slice)
  t.data_ = static_cast<char*>(data_) + index * strides_[d] * static_cast<int64_t>(element_size());
  t.shape_.erase(t.shape_.begin() + d);
  t.strides_.erase(t.strides_.begin() + d);
  return t;
}

Tensor Tensor::transpose(int64_t d0, int64_t d1) const {
  d0 = wrap_dim(d0);
  d1 = wrap_dim(d1);
  Tensor t = *this;
  std::swap(t.shape_[d0], t.shape_[d1]);
  std::swap(t.strides_[d0], t.strides_[d1]);
  return t;
}

Tensor Tensor::reshape(const Shape& shape) const {
  if (!is_contiguous())
    fail("Tensor::reshape", "self", "a contiguous tensor", "strides " + shape_str(strides_));
  Shape resolved = shape;
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < resolved.size(); ++i) {
    if (resolved[i] == -1 && infer < 0) {
      infer = static_cast<int64_t>(i);
    } else if (resolved[i] < 0) {
      fail("Tensor::reshape", "shape", "non-negative extents and at most one -1", shape_str(shape));
    } else if (__builtin_mul_overflow(known, resolved[i], &known)) {
      fail("Tensor::reshape", "shape", "extents whose product fits in int64", shape_str(shape));
    }
  }
  if (infer >= 0) resolved[infer] = known == 0 ? 0 : numel() / known;
  if (checked_numel("Tensor::reshape", resolved) != numel())
    fail("Tensor::reshape", "shape", shape_str(shape_) + " (" + std::to_string(numel()) + " elements)",
         shape_str(shape));
  Tensor t = *this;
  t.shape_ = resolved;
  t.strides_ = row_major_strides(resolved);
  return t;
}

void Tensor::copy_from(const Tensor& src) const {
  detail::check_cpu("Tensor::copy_from", "self", *this);
  detail::check_cpu("Tensor::copy_from", "src", src);
  if (src.dtype() != dtype_)
    fail("Tensor::copy_from", "src", std::string("dtype ") + dtype_name(dtype_),
         std::string("dtype ") + dtype_name(src.dtype()));
  detail::check_shape("Tensor::copy_from", "src", src, shape_);
  const int64_t n = numel();
  if (n == 0) return;
  const size_t es = element_size();
  if (is_contiguous() && src.is_contiguous()) {  // the common case: one block
    std::memmove(data_, src.data_, static_cast<size_t>(n) * es);
    return;
  }
  // A strided source that shares memory with this tensor (x.copy_from(x.t())): element by
  // element it would read values this copy already overwrote, so it goes through a copy.
  const bool same_view = src.data_ == data_ && src.strides_ == strides_;  // (a harmless self-copy)
  if (!same_view && detail::views_overlap(*this, src)) {
    Tensor staged = Tensor::empty(shape_, dtype_);
    staged.copy_from(src);
    copy_from(staged);
    return;
  }
  // Walk both index spaces in row-major order with an odometer over the shape.
  Shape index(shape_.size(), 0);
  for (int64_t i = 0; i < n; ++i) {
    int64_t so = 0, doff = 0;
    for (size_t k = 0; k < shape_.size(); ++k) {
      so += index[k] * src.strides_[k];
      doff += index[k] * strides_[k];
    }
    std::memcpy(static_cast<char*>(data_) + doff * es, static_cast<const char*>(src.data_) + so * es, es);
    for (size_t k = shape_.size(); k-- > 0;) {
      if (++index[k] < shape_[k]) break;
      index[k] = 0;
    }
  }
}

Tensor Tensor::contiguous() const {
  if (is_contiguous()) return *this;
  Tensor t = empty(shape_, dtype_, device_);
  t.copy_from(*this);
  return t;
}

Tensor Tensor::to(Device device) const {
  if (!defined_) fail("Tensor::to", "self", "a defined tensor", "an undefined tensor");
  if (device == device_) return *this;
  if (!detail::cuda_backend_built())  // every other copy involves a GPU
    fail("Tensor::to", device_.is_cuda() ? "self" : "device", "cpu (this moekit was built without MOEKIT_CUDA)",
         device_.is_cuda() ? device_.str() : device.str());
  if (device_.is_cuda() && numel() > 0 && !is_contiguous())
    fail("Tensor::to", "self", "a contiguous tensor when copying from a GPU", "strides " + shape_str(strides_));
  Tensor dst = empty(shape_, dtype_, device);
  if (numel() == 0) return dst;
  const Tensor src = contiguous();  // CPU sources are packed here first (GPU ones already are)
  detail::cuda_memcpy(dst.data_, src.data_, static_cast<size_t>(numel()) * element_size(),
                      device.is_cuda() ? device.index : device_.index);
  return dst;
}

std::string Tensor::str() const {
  return std::string(dtype_name(dtype_)) + shape_str(shape_) + " " + device_.str();
}

}  // namespace moekit

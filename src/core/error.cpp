#include "moekit/error.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "check.h"

namespace moekit {

Error::Error(std::string function, std::string argument, std::string expected, std::string actual)
    : std::runtime_error("moekit::" + function + ": argument '" + argument + "': expected " +
                         expected + ", got " + actual),
      function_(std::move(function)),
      argument_(std::move(argument)),
      expected_(std::move(expected)),
      actual_(std::move(actual)) {}

namespace detail {

void fail(const char* fn, const std::string& arg, const std::string& expected,
          const std::string& actual) {
  throw Error(fn, arg, expected, actual);
}

void check_defined(const char* fn, const char* arg, const Tensor& t) {
  if (!t.defined()) fail(fn, arg, "a defined tensor", "an undefined tensor");
  if (t.data() == nullptr && t.numel() > 0) fail(fn, arg, "non-null data", "a null pointer");
}

void check_cpu(const char* fn, const char* arg, const Tensor& t) {
  check_defined(fn, arg, t);
  if (!t.device().is_cpu()) fail(fn, arg, "a tensor on cpu", "device " + t.device().str());
}

void check_dtype(const char* fn, const char* arg, const Tensor& t,
                 std::initializer_list<DType> allowed) {
  std::string names;
  for (DType d : allowed) {
    if (t.dtype() == d) return;
    names += (names.empty() ? "" : " or ") + std::string(dtype_name(d));
  }
  fail(fn, arg, "dtype " + names, std::string("dtype ") + dtype_name(t.dtype()));
}

void check_rank(const char* fn, const char* arg, const Tensor& t, int64_t rank) {
  if (t.dim() != rank)
    fail(fn, arg, std::to_string(rank) + "-D tensor",
         std::to_string(t.dim()) + "-D tensor " + shape_str(t.shape()));
}

void check_shape(const char* fn, const char* arg, const Tensor& t, const Shape& expected) {
  if (t.shape() != expected) fail(fn, arg, "shape " + shape_str(expected), "shape " + shape_str(t.shape()));
}

void check_last_dim_contiguous(const char* fn, const char* arg, const Tensor& t) {
  if (t.dim() > 0 && t.size(-1) > 1 && t.stride(-1) != 1)
    fail(fn, arg, "unit stride in the last dimension",
         "stride " + std::to_string(t.stride(-1)) + " (strides " + shape_str(t.strides()) + ")");
}

void check_no_self_overlap(const char* fn, const char* arg, const Tensor& t) {
  if (t.numel() == 0) return;  // (no elements: nothing to overlap)
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of the dimensions with size > 1
  for (int64_t i = 0; i < t.dim(); ++i)
    if (t.size(i) > 1) dims.emplace_back(t.stride(i), t.size(i));
  std::sort(dims.begin(), dims.end());
  int64_t span = 1;  // elements the smaller dimensions reach (strides are non-negative)
  for (const auto& [stride, size] : dims) {
    if (stride < span)
      fail(fn, arg, "elements that do not overlap (each stride at least the span of the smaller dimensions)",
           "shape " + shape_str(t.shape()) + ", strides " + shape_str(t.strides()));
    span = stride * (size - 1) + span;  // (a view of real memory: no overflow)
  }
}

void check_positive(const char* fn, const char* arg, int64_t value) {
  if (value <= 0) fail(fn, arg, "a positive value", std::to_string(value));
}

bool views_overlap(const Tensor& x, const Tensor& y) {
  if (!x.defined() || !y.defined() || x.numel() == 0 || y.numel() == 0) return false;
  auto span = [](const Tensor& t, const char*& first) {  // [first, one past the last byte)
    int64_t low = 0, high = 0;
    for (int64_t i = 0; i < t.dim(); ++i) (t.stride(i) < 0 ? low : high) += (t.size(i) - 1) * t.stride(i);
    first = static_cast<const char*>(t.data()) + low * static_cast<int64_t>(t.element_size());
    return static_cast<const char*>(t.data()) + (high + 1) * static_cast<int64_t>(t.element_size());
  };
  const char *x0 = nullptr, *y0 = nullptr;
  const char* x1 = span(x, x0);
  const char* y1 = span(y, y0);
  return x0 < y1 && y0 < x1;
}

void check_apart(const char* fn, const char* arg, const Tensor& out,
                 std::initializer_list<std::pair<const char*, const Tensor*>> inputs) {
  for (const auto& [name, t] : inputs)
    if (views_overlap(out, *t)) fail(fn, arg, std::string("memory apart from ") + name, std::string("a view that overlaps ") + name);
}

void check_output_apart(const char* fn, const char* arg, const Tensor& out,
                        std::initializer_list<std::pair<const char*, const Tensor*>> inputs) {
  check_no_self_overlap(fn, arg, out);
  check_apart(fn, arg, out, inputs);
}

void check_cpu_matrix(const char* fn, const char* arg, const Tensor& t,
                      std::initializer_list<DType> allowed) {
  check_cpu(fn, arg, t);
  check_dtype(fn, arg, t, allowed);
  check_rank(fn, arg, t, 2);
  check_last_dim_contiguous(fn, arg, t);
}

}  // namespace detail
}  // namespace moekit

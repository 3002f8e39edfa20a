// A growable, 64-byte aligned float buffer, kept by its owner (typically thread_local) so
// that hot loops reuse one allocation. Contents are not preserved when it grows.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <memory>
#include <new>

#include "host_memory.h"

namespace moekit::detail {

class Scratch {
 public:
  float* get(size_t n) {
    if (n > size_) {
      buf_.reset(static_cast<float*>(host_alloc(n * sizeof(float))));
      if (!buf_) throw std::bad_alloc();
      size_ = n;
    }
    return buf_.get();
  }

 private:
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> buf_;
  size_t size_ = 0;
};

}  // namespace moekit::detail

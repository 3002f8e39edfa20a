// Helpers shared by the EP test files (test_ep.cpp: normal mode, test_ep_low_latency.cpp):
// MPI rank queries, collective skip-on-failure, deterministic data, a Buffer that is
// destroyed collectively, and the rank-encoded rows of ep.md's reference tests.
#pragma once

#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "moekit/ep.h"
#include "moekit/error.h"
#include "moekit/formats.h"
#include "moekit/tensor.h"

namespace moekit::ep::testing {

// ------------------------------------------------------------------ MPI helpers

inline int my_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

inline int num_ranks() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

// True when every rank of comm passes true.
inline bool all_ranks(bool ok, MPI_Comm comm = MPI_COMM_WORLD) {
  int mine = ok ? 1 : 0, all = 0;
  MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, comm);
  return all == 1;
}

// Runs a collective step; an exception is a failure on this rank. Returns whether every rank
// of comm succeeded (collective), so all ranks skip what depends on it together.
template <class F>
bool collective_step(const std::string& what, F&& f, MPI_Comm comm = MPI_COMM_WORLD) {
  bool ok = true;
  try {
    f();
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << " threw: " << e.what();
    ok = false;
  }
  return all_ranks(ok, comm);
}

// call() must raise a moekit::Error (not a TimeoutError, not another exception) that passes
// check(e); returns whether it raised one (this rank only).
template <class Call, class Check>
bool expect_ep_error_where(Call&& call, Check&& check) {
  try {
    call();
    ADD_FAILURE() << "no moekit::Error";
  } catch (const TimeoutError& e) {
    ADD_FAILURE() << "a TimeoutError, not an argument check: " << e.what();
  } catch (const moekit::Error& e) {
    check(e);
    return true;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
  }
  return false;
}
// ... on the argument arg.
template <class Call>
bool expect_ep_error_on(Call&& call, const std::string& arg) {
  return expect_ep_error_where(call, [&](const moekit::Error& e) { EXPECT_EQ(e.argument(), arg) << e.what(); });
}

// An argument check must raise moekit::Error — not a TimeoutError, not another exception.
#define EXPECT_EP_ERROR(stmt)                                                                        \
  do {                                                                                               \
    try {                                                                                            \
      stmt;                                                                                          \
      ADD_FAILURE() << "no moekit::Error from: " #stmt;                                              \
    } catch (const TimeoutError& e_) {                                                               \
      ADD_FAILURE() << "a TimeoutError (not an argument check) from: " #stmt << " -> " << e_.what(); \
    } catch (const moekit::Error&) {                                                                 \
    } catch (const std::exception& e_) {                                                             \
      ADD_FAILURE() << "wrong exception type from: " #stmt << " -> " << e_.what();                   \
    }                                                                                                \
  } while (0)

// ------------------------------------------------------------------ deterministic random

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

inline uint64_t hash4(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  return splitmix64(splitmix64(splitmix64(splitmix64(a) ^ b) ^ c) ^ d);
}

// Roughly N(0, 1): Irwin-Hall of four 16-bit uniforms, rescaled.
inline float normalish(uint64_t h) {
  float s = 0.0f;
  for (int i = 0; i < 4; ++i) s += static_cast<float>((h >> (16 * i)) & 0xffff) * (1.0f / 65536.0f);
  return (s - 2.0f) * 1.7320508f;
}

struct Rng {
  uint64_t state;
  uint64_t next() { return state = splitmix64(state); }
  uint64_t below(uint64_t n) { return next() % n; }
  double unit() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
};

inline uint64_t fnv1a(uint64_t h, const void* data, size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 0x100000001b3ULL;
  return h;
}

// Shape and bytes of a tensor (any strides); "undef" for an undefined one.
inline uint64_t fnv1a(uint64_t h, const Tensor& t) {
  if (!t.defined()) return fnv1a(h, "undef", 5);
  const Tensor c = t.contiguous();
  h = fnv1a(h, c.shape().data(), c.shape().size() * sizeof(int64_t));
  return fnv1a(h, c.data(), static_cast<size_t>(c.numel()) * c.element_size());
}

// ------------------------------------------------------------------ tensors

template <class T>
Tensor tensor_of(const std::vector<T>& v, const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype);
  if (!v.empty()) std::memcpy(t.data(), v.data(), v.size() * sizeof(T));
  return t;
}

template <class T>
std::vector<T> vector_of(const Tensor& t) {
  const Tensor c = t.contiguous();
  std::vector<T> v(static_cast<size_t>(c.numel()));
  if (!v.empty()) std::memcpy(v.data(), c.data(), v.size() * sizeof(T));
  return v;
}

// Sets an environment variable (or unsets it: value null) until the end of the scope, then
// restores what it was.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) saved_ = old;
    if (value != nullptr) ::setenv(name, value, 1);
    else ::unsetenv(name);
  }
  ~ScopedEnv() {
    if (saved_) ::setenv(name_, saved_->c_str(), 1);
    else ::unsetenv(name_);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> saved_;
};

// A Buffer on MPI_COMM_WORLD that is destroyed (collectively) at the end of its scope.
struct BufferGuard {
  std::unique_ptr<Buffer> buf;
  BufferGuard() = default;
  BufferGuard(BufferGuard&&) = default;
  Buffer* operator->() const { return buf.get(); }
  Buffer& operator*() const { return *buf; }
  ~BufferGuard() {
    if (!buf) return;
    try {
      if (buf->is_available()) buf->destroy();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "Buffer::destroy threw: " << e.what();
    }
  }
};

// ------------------------------------------------------------------ rows

enum class Data { rank_encoded, random };
constexpr int kIdColumns = 4;  // t / 256, t / 16 % 16, t % 16, 448

// Rank-encoded: src in every column but the last four, which hold the base-16 digits of t and
// a 448 marker (the last 128-column FP8 group then has scale 1 and the digits survive FP8;
// src <= 7 survives the other groups). Random: normalish values keyed by (seed, src, t, c).
inline void fill_row(Data d, uint64_t seed, int src, int64_t t, int64_t H, uint16_t* out) {
  if (d == Data::rank_encoded) {
    if (H < kIdColumns || t >= 4096 || src > 7) throw std::logic_error("rank-encoded rows need H >= 4, t < 4096, rank <= 7");
    const uint16_t v = f32_to_bf16(static_cast<float>(src));
    for (int64_t c = 0; c < H - kIdColumns; ++c) out[c] = v;
    out[H - 4] = f32_to_bf16(static_cast<float>(t / 256));
    out[H - 3] = f32_to_bf16(static_cast<float>(t / 16 % 16));
    out[H - 2] = f32_to_bf16(static_cast<float>(t % 16));
    out[H - 1] = f32_to_bf16(448.0f);
    return;
  }
  for (int64_t c = 0; c < H; ++c)
    out[c] = f32_to_bf16(normalish(hash4(seed, static_cast<uint64_t>(src), static_cast<uint64_t>(t), static_cast<uint64_t>(c))));
}

}  // namespace moekit::ep::testing

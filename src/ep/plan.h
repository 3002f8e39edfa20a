// Validation and planning shared by the one-node and the multi-node dispatch/combine.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "ep/buffer_impl.h"

namespace moekit::ep::detail {

// A dispatch's local inputs, validated.
struct DispatchPlan {
  int64_t tokens = 0, hidden = 0, topk = 0, experts = 0, scale_cols = 0;
  size_t row_bytes = 0;
  bool fp8 = false;
  std::shared_ptr<const HandleState> cached;
  std::vector<int32_t> per_expert;                  // fresh mode only
  std::vector<std::vector<int32_t>> send_tokens;    // per destination, ascending
  Tensor is_token_in_rank;                          // bool [T, R], contiguous
};

const HandleState& handle_state(const char* fn, const DispatchHandle& handle, uint64_t buffer_id, int num_ranks);
// Checks every local input of a dispatch (no communication).
DispatchPlan plan_dispatch(const DispatchArgs& a, int num_ranks, uint64_t buffer_id);

// Dispatch and combine when the buffer spans several nodes (internode.cpp).
DispatchResult dispatch_internode(Buffer::Impl& m, const DispatchArgs& a);
CombineResult combine_internode(Buffer::Impl& m, const CombineArgs& a);

// body(begin, end) over [0, n) split evenly into `threads` chunks (OpenMP).
template <class Body>
void parallel_chunks(int threads, int64_t n, Body&& body) {
  if (threads <= 1 || n < 2) {
    if (n > 0) body(int64_t{0}, n);
    return;
  }
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t c = 0; c < threads; ++c) {
    const int64_t begin = n * c / threads, end = n * (c + 1) / threads;
    if (begin < end) body(begin, end);
  }
}


}  // namespace moekit::ep::detail

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

// Round 2 of a dispatch: this rank's receive block, allocated and published to its node.
std::shared_ptr<Block> publish_recv_block(Buffer::Impl& m, const char* fn, const RecvLayout& layout);
// The result tensors (views of the block) and the handle of a dispatch.
void fill_dispatch_outputs(DispatchResult& out, const DispatchPlan& plan, DType x_dtype, const std::shared_ptr<HandleState>& hs,
                           const std::shared_ptr<Block>& block, const RecvLayout& layout);
// One received row into a receiver's block: the x row (streamed), its scales, its top-k ids
// rewritten to the receiver's local experts (others -1, weight 0) and the source token.
struct RecvRowWriter {
  char* base;
  RecvLayout layout;
  int dest;  // global rank of the receiver
  size_t row_bytes;
  int64_t scale_cols, topk, experts_per_rank;
  void put(int64_t row, const char* xrow, const float* sf, const int64_t* ids, const float* w, int32_t token) const;
};

// Worst-case padding rows of this rank's block: top-k -1, weight 0, source -1.
void pad_worst_rows(char* own, const RecvLayout& layout, const HandleState& hs, int64_t topk);

// A combine's local arguments, checked against its handle.
struct CombineShape {
  const HandleState* hs = nullptr;
  int64_t hidden = 0, topk = 0;
};
CombineShape check_combine(const char* fn, const CombineArgs& a, uint64_t buffer_id, int num_ranks);

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

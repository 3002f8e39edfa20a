// Pieces of the EP component shared by buffer.cpp and its tests: the dispatch layout and the
// argument checks that need no communication.
#pragma once

#include <cstdint>

#include "moekit/ep.h"

namespace moekit::ep::detail {

inline constexpr int kMaxExperts = 16384;  // bound on num_experts (the control block's size)

// get_dispatch_layout for num_ranks ranks in nodes of ranks_per_node.
DispatchLayout compute_dispatch_layout(const Tensor& topk_idx, int num_experts, int num_ranks,
                                       int ranks_per_node);

}  // namespace moekit::ep::detail

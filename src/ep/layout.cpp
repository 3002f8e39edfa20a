#include "ep/layout.h"

#include <algorithm>
#include <string>
#include <vector>

#include "core/check.h"

namespace moekit::ep::detail {

using moekit::detail::check_cpu_matrix;
using moekit::detail::fail;

DispatchLayout compute_dispatch_layout(const Tensor& topk_idx, int num_experts, int num_ranks,
                                       int ranks_per_node) {
  constexpr const char* fn = "ep::Buffer::get_dispatch_layout";
  check_cpu_matrix(fn, "topk_idx", topk_idx, {DType::i64});
  if (num_experts <= 0 || num_experts % num_ranks != 0 || num_experts > kMaxExperts)
    fail(fn, "num_experts",
         "a positive multiple of the rank count " + std::to_string(num_ranks) + ", at most " +
             std::to_string(kMaxExperts),
         std::to_string(num_experts));
  const int64_t tokens = topk_idx.size(0), k = topk_idx.size(1);
  const int experts_per_rank = num_experts / num_ranks;
  const int num_nodes = num_ranks / ranks_per_node;

  DispatchLayout out;
  out.num_tokens_per_rank = Tensor::zeros({num_ranks}, DType::i32);
  out.num_tokens_per_expert = Tensor::zeros({num_experts}, DType::i32);
  out.is_token_in_rank = Tensor::zeros({tokens, num_ranks}, DType::boolean);
  if (num_nodes > 1) out.num_tokens_per_rdma_rank = Tensor::zeros({num_nodes}, DType::i32);
  auto* per_rank = out.num_tokens_per_rank.data_ptr<int32_t>();
  auto* per_expert = out.num_tokens_per_expert.data_ptr<int32_t>();
  auto* in_rank = out.is_token_in_rank.data_ptr<bool>();
  std::vector<char> in_node(static_cast<size_t>(num_nodes));

  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t* row = topk_idx.data_ptr<int64_t>() + t * topk_idx.stride(0);
    bool* token_ranks = in_rank + t * num_ranks;
    std::fill(in_node.begin(), in_node.end(), 0);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = row[j];
      if (e == -1) continue;
      if (e < -1 || e >= num_experts)
        fail(fn, "topk_idx[" + std::to_string(t) + ", " + std::to_string(j) + "]",
             "an expert id in [0, " + std::to_string(num_experts) + ") or -1", std::to_string(e));
      ++per_expert[e];
      const int r = static_cast<int>(e / experts_per_rank);
      if (!token_ranks[r]) {
        token_ranks[r] = true;
        ++per_rank[r];
      }
      in_node[static_cast<size_t>(r / ranks_per_node)] = 1;
    }
    if (num_nodes > 1)
      for (int n = 0; n < num_nodes; ++n) out.num_tokens_per_rdma_rank.data_ptr<int32_t>()[n] += in_node[static_cast<size_t>(n)];
  }
  return out;
}

}  // namespace moekit::ep::detail

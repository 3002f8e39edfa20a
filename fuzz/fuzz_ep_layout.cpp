// Fuzz target: expert-parallel index handling that takes user input — the dispatch layout
// from topk_idx and the dispatch's argument planning (ids, counts, shapes, strides). Every
// input either raises moekit::Error or gives exactly the counts of a naive recount.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "ep/layout.h"
#include "ep/plan.h"
#include "moekit/error.h"
#include "smoke_driver.h"

using moekit::DType;
using moekit::Tensor;
using moekit::fuzzing::Reader;

namespace {

long g_accepted = 0, g_rejected = 0;

[[noreturn]] void mismatch(const char* what) {
  std::fprintf(stderr, "fuzz_ep_layout: %s differs from the recount\n", what);
  std::abort();
}

void run_one(Reader& in) {
  const int ranks = 1 + static_cast<int>(in.small(8));
  const int ranks_per_node = in.byte() % 2 ? ranks : 1 + static_cast<int>(in.small(ranks));
  // Usually a valid expert count; sometimes <= 0 or not a multiple of the rank count.
  const int experts = in.byte() % 8 ? ranks * (1 + static_cast<int>(in.small(6))) : static_cast<int>(in.small(40)) - 2;
  const int64_t tokens = in.small(24), k = 1 + in.small(6);
  const int64_t stride = k + in.small(3);  // row stride >= k: strided views are accepted
  std::vector<int64_t> ids(static_cast<size_t>(tokens * stride + 1));
  // Mostly valid ids and -1; now and then one past the end, below -1, or far out of range.
  const bool wild = in.byte() % 4 == 0;
  for (auto& v : ids) {
    const uint8_t b = in.byte();
    if (wild && b < 8) {
      v = b < 4 ? static_cast<int64_t>(b) * 1000003 - 2000000 : std::max(experts, 0) + b % 2;
    } else {
      v = static_cast<int64_t>(b % static_cast<uint8_t>(std::max(experts, 1) + 1)) - 1;
    }
  }
  const Tensor topk = Tensor::from_blob(ids.data(), {tokens, k}, DType::i64, moekit::Device::cpu(), {stride, 1});
  moekit::ep::DispatchLayout layout;
  try {
    layout = moekit::ep::detail::compute_dispatch_layout(topk, experts, ranks, ranks % ranks_per_node ? ranks : ranks_per_node);
  } catch (const moekit::Error&) {
    ++g_rejected;
    return;
  }
  // Recount naively.
  const int per_rank = experts / ranks;
  std::vector<int> per_expert(static_cast<size_t>(experts)), per_rank_count(static_cast<size_t>(ranks));
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<bool> in_rank(static_cast<size_t>(ranks));
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = ids[static_cast<size_t>(t * stride + j)];
      if (e < 0) continue;
      if (e >= experts) mismatch("an out-of-range id that was accepted");
      ++per_expert[static_cast<size_t>(e)];
      in_rank[static_cast<size_t>(e / per_rank)] = true;
    }
    for (int r = 0; r < ranks; ++r) {
      if (layout.is_token_in_rank.data_ptr<bool>()[t * ranks + r] != in_rank[static_cast<size_t>(r)]) mismatch("is_token_in_rank");
      per_rank_count[static_cast<size_t>(r)] += in_rank[static_cast<size_t>(r)];
    }
  }
  for (int e = 0; e < experts; ++e)
    if (layout.num_tokens_per_expert.data_ptr<int32_t>()[e] != per_expert[static_cast<size_t>(e)]) mismatch("num_tokens_per_expert");
  for (int r = 0; r < ranks; ++r)
    if (layout.num_tokens_per_rank.data_ptr<int32_t>()[r] != per_rank_count[static_cast<size_t>(r)]) mismatch("num_tokens_per_rank");

  // The dispatch's planning of the same routing: accepted, with one send list per rank that
  // matches the layout; then with corrupted counts, rejected.
  moekit::ep::DispatchArgs args;
  args.x = Tensor::zeros({tokens, 16}, DType::bf16);
  args.topk_idx = topk;
  args.topk_weights = Tensor::zeros({tokens, k}, DType::f32);
  args.num_tokens_per_rank = layout.num_tokens_per_rank;
  args.is_token_in_rank = layout.is_token_in_rank;
  args.num_tokens_per_expert = layout.num_tokens_per_expert;
  const auto plan = moekit::ep::detail::plan_dispatch(args, ranks, 1);
  for (int r = 0; r < ranks; ++r)
    if (static_cast<int>(plan.send_tokens[static_cast<size_t>(r)].size()) != per_rank_count[static_cast<size_t>(r)])
      mismatch("plan_dispatch send lists");
  if (ranks > 0 && tokens > 0) {
    Tensor wrong = Tensor::empty({ranks}, DType::i32);
    wrong.copy_from(layout.num_tokens_per_rank);
    wrong.data_ptr<int32_t>()[in.small(ranks)] += 1;
    args.num_tokens_per_rank = wrong;
    bool rejected = false;
    try {
      moekit::ep::detail::plan_dispatch(args, ranks, 1);
    } catch (const moekit::Error&) {
      rejected = true;
    }
    if (!rejected) mismatch("a wrong num_tokens_per_rank that was accepted");
  }
  ++g_accepted;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Reader in{data, size};
  run_one(in);
  return 0;
}

#ifndef MOEKIT_LIBFUZZER
int main(int argc, char** argv) {
  const long iterations = argc > 1 ? std::strtol(argv[1], nullptr, 10) : 2000;
  moekit::fuzzing::run_smoke(iterations, 0x9e3779b97f4a7c15ull, 16, 131, 400);
  std::printf("fuzz_ep_layout: %ld layouts recounted, %ld rejected with moekit::Error\n", g_accepted, g_rejected);
  return g_accepted * 4 >= iterations ? 0 : 1;
}
#endif

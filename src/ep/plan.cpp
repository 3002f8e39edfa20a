#include "ep/plan.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>

#include "core/check.h"

namespace moekit::ep::detail {

using moekit::detail::ceil_div;
using moekit::detail::check_cpu_matrix;
using moekit::detail::check_shape;

namespace {
constexpr const char* kDispatch = "ep::Buffer::dispatch";
}  // namespace

const HandleState& handle_state(const char* fn, const DispatchHandle& handle, uint64_t buffer_id, int num_ranks) {
  if (!handle.defined()) fail(fn, "handle", "a handle returned by dispatch", "an empty handle");
  const auto& hs = *static_cast<const HandleState*>(handle.internal.get());
  if (hs.buffer_id != buffer_id || hs.num_ranks != num_ranks)
    fail(fn, "handle", "a handle from a dispatch on this buffer", "a handle from another buffer");
  return hs;
}

DispatchPlan plan_dispatch(const DispatchArgs& a, int num_ranks, uint64_t buffer_id) {
  const char* fn = kDispatch;
  DispatchPlan p;
  check_cpu_matrix(fn, "x", a.x, {DType::bf16, DType::e4m3});
  p.tokens = a.x.size(0);
  p.hidden = a.x.size(1);
  p.fp8 = a.x.dtype() == DType::e4m3;
  p.row_bytes = static_cast<size_t>(p.hidden) * a.x.element_size();
  if (p.fp8) {
    p.scale_cols = ceil_div(p.hidden, 128);
    check_cpu_matrix(fn, "x_scales", a.x_scales, {DType::f32});
    check_shape(fn, "x_scales", a.x_scales, {p.tokens, p.scale_cols});
  } else if (a.x_scales.defined()) {
    fail(fn, "x_scales", "no scales with bf16 x", a.x_scales.str());
  }
  if (a.expert_alignment < 1) fail(fn, "expert_alignment", ">= 1", std::to_string(a.expert_alignment));
  // (received rows are indexed by i32, recv_src_idx and the handle's counts among them)
  if (a.num_worst_tokens < 0 || a.num_worst_tokens > std::numeric_limits<int32_t>::max())
    fail(fn, "num_worst_tokens", "in [0, 2^31)", std::to_string(a.num_worst_tokens));

  if (a.handle) {
    const HandleState& hs = handle_state(fn, *a.handle, buffer_id, num_ranks);
    p.cached = std::static_pointer_cast<const HandleState>(a.handle->internal);
    if (hs.tokens != p.tokens)
      fail(fn, "x", "the handle's token count " + std::to_string(hs.tokens), std::to_string(p.tokens));
    if (a.topk_idx.defined() || a.topk_weights.defined())
      fail(fn, "topk_idx", "no top-k inputs with a cached handle", "top-k tensors");
    p.send_tokens = hs.send_tokens;
    p.is_token_in_rank = hs.is_token_in_rank;
    return p;
  }

  check_cpu_matrix(fn, "is_token_in_rank", a.is_token_in_rank, {DType::boolean});
  check_shape(fn, "is_token_in_rank", a.is_token_in_rank, {p.tokens, num_ranks});
  check_cpu_matrix(fn, "num_tokens_per_expert", a.num_tokens_per_expert.dim() == 1
                       ? a.num_tokens_per_expert.reshape({1, -1}) : a.num_tokens_per_expert, {DType::i32});
  p.experts = a.num_tokens_per_expert.numel();
  if (a.num_tokens_per_expert.dim() != 1 || p.experts % num_ranks != 0 || p.experts == 0 || p.experts > kMaxExperts)
    fail(fn, "num_tokens_per_expert", "i32 [E] with E a positive multiple of " + std::to_string(num_ranks) +
             ", at most " + std::to_string(kMaxExperts), a.num_tokens_per_expert.str());
  if (!a.num_tokens_per_rank.defined() || a.num_tokens_per_rank.dtype() != DType::i32 ||
      a.num_tokens_per_rank.dim() != 1 || a.num_tokens_per_rank.size(0) != num_ranks)
    fail(fn, "num_tokens_per_rank", "i32 [" + std::to_string(num_ranks) + "]",
         a.num_tokens_per_rank.defined() ? a.num_tokens_per_rank.str() : "undefined");
  p.per_expert.resize(static_cast<size_t>(p.experts));
  for (int64_t e = 0; e < p.experts; ++e) {
    const int32_t n = a.num_tokens_per_expert.data_ptr<int32_t>()[e * a.num_tokens_per_expert.stride(0)];
    if (n < 0) fail(fn, "num_tokens_per_expert[" + std::to_string(e) + "]", ">= 0", std::to_string(n));
    p.per_expert[static_cast<size_t>(e)] = n;
  }

  if (a.topk_idx.defined()) {
    check_cpu_matrix(fn, "topk_idx", a.topk_idx, {DType::i64});
    if (a.topk_idx.size(0) != p.tokens)
      fail(fn, "topk_idx", std::to_string(p.tokens) + " rows (as x)", a.topk_idx.str());
    p.topk = a.topk_idx.size(1);
    check_cpu_matrix(fn, "topk_weights", a.topk_weights, {DType::f32});
    check_shape(fn, "topk_weights", a.topk_weights, {p.tokens, p.topk});
    for (int64_t t = 0; t < p.tokens; ++t)
      for (int64_t j = 0; j < p.topk; ++j) {
        const int64_t e = a.topk_idx.data_ptr<int64_t>()[t * a.topk_idx.stride(0) + j];
        if (e < -1 || e >= p.experts)
          fail(fn, "topk_idx[" + std::to_string(t) + ", " + std::to_string(j) + "]",
               "an expert id in [0, " + std::to_string(p.experts) + ") or -1", std::to_string(e));
      }
  } else if (a.topk_weights.defined()) {
    fail(fn, "topk_weights", "no weights without topk_idx", a.topk_weights.str());
  }

  // A copy of our own with every byte 0 or 1: a caller's bool tensor may hold other bytes
  // (from_blob over u8 data, say), which read as bool would be undefined behaviour.
  p.is_token_in_rank = Tensor::empty({p.tokens, num_ranks}, DType::boolean);
  p.is_token_in_rank.copy_from(a.is_token_in_rank);
  auto* in_rank = static_cast<uint8_t*>(p.is_token_in_rank.data());
  p.send_tokens.assign(static_cast<size_t>(num_ranks), {});
  for (int64_t t = 0; t < p.tokens; ++t)
    for (int d = 0; d < num_ranks; ++d) {
      uint8_t& flag = in_rank[t * num_ranks + d];
      flag = flag != 0;
      if (flag) p.send_tokens[static_cast<size_t>(d)].push_back(static_cast<int32_t>(t));
    }
  for (int d = 0; d < num_ranks; ++d) {
    const int64_t given = a.num_tokens_per_rank.data_ptr<int32_t>()[d * a.num_tokens_per_rank.stride(0)];
    const auto counted = static_cast<int64_t>(p.send_tokens[static_cast<size_t>(d)].size());
    if (given != counted)
      fail(fn, "num_tokens_per_rank[" + std::to_string(d) + "]",
           std::to_string(counted) + " (the tokens is_token_in_rank sends there)", std::to_string(given));
  }
  return p;
}

std::shared_ptr<Block> publish_recv_block(Buffer::Impl& m, const char* fn, const RecvLayout& layout) {
  std::shared_ptr<Block> block;
  try {
    block = m.allocate(layout.bytes);
  } catch (...) {
    m.abandon();
    throw;
  }
  uint64_t* meta = m.meta(m.local_rank);
  meta[kSeg] = static_cast<uint64_t>(block->seg);
  meta[kOff] = block->off;
  meta[kNumSegs] = static_cast<uint64_t>(m.heap->num_segments());
  m.publish(kPhaseAlloc);
  m.wait_ready(fn, kPhaseAlloc);
  m.check_peer_errors(fn);
  return block;
}

void fill_dispatch_outputs(DispatchResult& out, const DispatchPlan& plan, DType x_dtype, const std::shared_ptr<HandleState>& hs,
                           const std::shared_ptr<Block>& block, const RecvLayout& layout) {
  const int R = hs->num_ranks;
  char* base = block->data();
  out.recv_x = Tensor::from_blob_with_owner(base + layout.x, {hs->rows, plan.hidden}, x_dtype, block);
  if (plan.fp8)
    out.recv_x_scales = Tensor::from_blob_with_owner(base + layout.scales, {hs->rows, plan.scale_cols}, DType::f32, block);
  if (plan.topk > 0) {
    out.recv_topk_idx = Tensor::from_blob_with_owner(base + layout.topk_idx, {hs->rows, plan.topk}, DType::i64, block);
    out.recv_topk_weights = Tensor::from_blob_with_owner(base + layout.topk_weights, {hs->rows, plan.topk}, DType::f32, block);
  }
  DispatchHandle& h = out.handle;
  h.rank_prefix_matrix = Tensor::empty({R, R}, DType::i32);
  for (int d = 0; d < R; ++d)
    for (int s = 0, acc = 0; s < R; ++s) h.rank_prefix_matrix.data_ptr<int32_t>()[s * R + d] = acc += static_cast<int32_t>(hs->count(s, d));
  h.recv_src_idx = Tensor::empty({hs->rows}, DType::i32);
  // The handle keeps its own copy: the caller may reuse its is_token_in_rank.
  h.is_token_in_rank = Tensor::empty({plan.tokens, R}, DType::boolean);
  h.is_token_in_rank.copy_from(plan.is_token_in_rank);
  h.send_head = Tensor::empty({plan.tokens, R}, DType::i32);
  std::fill_n(h.send_head.data_ptr<int32_t>(), plan.tokens * R, -1);
  for (int d = 0; d < R; ++d) {
    const auto& list = hs->send_tokens[static_cast<size_t>(d)];
    for (size_t j = 0; j < list.size(); ++j) h.send_head.data_ptr<int32_t>()[list[j] * R + d] = static_cast<int32_t>(j);
  }
  h.num_recv_tokens = hs->recv_total(hs->rank);
  h.hidden = plan.hidden;
  hs->send_head = Tensor::empty({plan.tokens, R}, DType::i32);
  hs->send_head.copy_from(h.send_head);
  hs->is_token_in_rank = plan.is_token_in_rank;
  h.internal = hs;
}

void RecvRowWriter::put(int64_t row, const char* xrow, const float* sf, const int64_t* ids, const float* w,
                        int32_t token) const {
  detail::copy_stream(base + layout.x + static_cast<size_t>(row) * row_bytes, xrow, row_bytes);
  if (scale_cols > 0) std::memcpy(base + layout.scales + static_cast<size_t>(row * scale_cols) * 4, sf, static_cast<size_t>(scale_cols) * 4);
  for (int64_t q = 0; q < topk; ++q) {
    const int64_t e = ids[q];
    const bool local = e >= dest * experts_per_rank && e < (dest + 1) * experts_per_rank;
    reinterpret_cast<int64_t*>(base + layout.topk_idx)[row * topk + q] = local ? e - dest * experts_per_rank : -1;
    reinterpret_cast<float*>(base + layout.topk_weights)[row * topk + q] = local ? w[q] : 0.0f;
  }
  reinterpret_cast<int32_t*>(base + layout.src_idx)[row] = token;
}

void pad_worst_rows(char* own, const RecvLayout& layout, const HandleState& hs, int64_t topk) {
  for (int64_t row = hs.recv_total(hs.rank); row < hs.rows; ++row) {
    for (int64_t q = 0; q < topk; ++q) {
      reinterpret_cast<int64_t*>(own + layout.topk_idx)[row * topk + q] = -1;
      reinterpret_cast<float*>(own + layout.topk_weights)[row * topk + q] = 0.0f;
    }
    reinterpret_cast<int32_t*>(own + layout.src_idx)[row] = -1;
  }
}

CombineShape check_combine(const char* fn, const CombineArgs& a, uint64_t buffer_id, int num_ranks) {
  CombineShape c;
  c.hs = &handle_state(fn, a.handle, buffer_id, num_ranks);
  check_cpu_matrix(fn, "x", a.x, {DType::bf16});
  if (a.x.size(0) != c.hs->rows) fail(fn, "x", std::to_string(c.hs->rows) + " rows (the dispatch's received rows)", a.x.str());
  c.hidden = a.x.size(1);
  if (a.topk_weights.defined()) {
    check_cpu_matrix(fn, "topk_weights", a.topk_weights, {DType::f32});
    if (a.topk_weights.size(0) != c.hs->rows) fail(fn, "topk_weights", std::to_string(c.hs->rows) + " rows", a.topk_weights.str());
    c.topk = a.topk_weights.size(1);
  }
  for (const auto* bias : {&a.bias_0, &a.bias_1})
    if (bias->defined()) {
      const char* name = bias == &a.bias_0 ? "bias_0" : "bias_1";
      check_cpu_matrix(fn, name, *bias, {DType::bf16});
      check_shape(fn, name, *bias, {c.hs->tokens, c.hidden});
    }
  return c;
}

}  // namespace moekit::ep::detail

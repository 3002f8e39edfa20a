// Normal dispatch and combine between the ranks of one node (protocol: buffer.cpp).
#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstring>
#include <exception>

#include "ep/buffer_impl.h"
#include "ep/cma.h"
#include "ep/plan.h"

namespace moekit::ep {
namespace {

constexpr const char* kDispatch = "ep::Buffer::dispatch";
constexpr const char* kCombine = "ep::Buffer::combine";
// Bytes of peers' rows a combine thread reads through cma per block of tokens (a scratch that
// stays in L2 while the block is summed).
constexpr int64_t kPullBytes = int64_t{256} << 10;
constexpr uint64_t kCodeBf16 = 1, kCodeE4m3 = 2;

using moekit::detail::check_cpu_matrix;
using moekit::detail::check_shape;
using moekit::detail::ceil_div;

// Every rank compares every rank's published shape with rank 0's, so all reach the same verdict.
void check_same_everywhere(const Buffer::Impl& m, const char* fn, Meta field, const char* what) {
  for (int p = 1; p < m.num_ranks; ++p)
    if (m.meta(p)[field] != m.meta(0)[field])
      fail(fn, what, "the same value on every rank (" + std::to_string(m.meta(0)[field]) + " on rank 0)",
           std::to_string(m.meta(p)[field]) + " on rank " + std::to_string(p));
}

}  // namespace

DispatchResult Buffer::dispatch(const DispatchArgs& a) {
  Impl& m = *impl_;
  if (m.num_nodes() > 1) return detail::dispatch_internode(m, a);
  m.begin_op(kDispatch);
  const int R = m.num_ranks, me = m.rank;
  DispatchPlan plan;
  try {
    plan = plan_dispatch(a, R, m.id);
  } catch (...) {
    m.abandon();
    throw;
  }

  // Round 1: shapes and counts.
  uint64_t* mine = m.meta(me);
  mine[kHidden] = static_cast<uint64_t>(plan.hidden);
  mine[kDtype] = plan.fp8 ? kCodeE4m3 : kCodeBf16;
  mine[kTopk] = static_cast<uint64_t>(plan.topk);
  mine[kExperts] = static_cast<uint64_t>(plan.experts);
  mine[kWorst] = static_cast<uint64_t>(a.num_worst_tokens);
  for (int d = 0; d < R; ++d) m.counts_rank(me)[d] = static_cast<int32_t>(plan.send_tokens[static_cast<size_t>(d)].size());
  std::copy(plan.per_expert.begin(), plan.per_expert.end(), m.counts_expert(me));
  m.publish(kPhaseCounts);
  m.wait_ready(kDispatch, kPhaseCounts);
  m.check_peer_errors(kDispatch);
  check_same_everywhere(m, kDispatch, kHidden, "x (hidden size)");
  check_same_everywhere(m, kDispatch, kDtype, "x (dtype)");
  check_same_everywhere(m, kDispatch, kTopk, "topk_idx (top-k, 0 = none or cached)");
  check_same_everywhere(m, kDispatch, kExperts, "num_tokens_per_expert (experts, 0 = cached)");
  check_same_everywhere(m, kDispatch, kWorst, "num_worst_tokens");

  auto hs = std::make_shared<HandleState>();
  hs->buffer_id = m.id;
  hs->num_ranks = R;
  hs->rank = me;
  hs->tokens = plan.tokens;
  hs->dispatch_op = m.op;
  hs->counts.resize(static_cast<size_t>(R * R));
  for (int s = 0; s < R; ++s)
    for (int d = 0; d < R; ++d) hs->counts[static_cast<size_t>(s * R + d)] = m.counts_rank(s)[d];
  for (int d = 0; d < R; ++d)
    if (a.num_worst_tokens > 0 && hs->recv_total(d) > a.num_worst_tokens)
      fail(kDispatch, "num_worst_tokens", ">= the rows every rank receives",
           std::to_string(a.num_worst_tokens) + " < " + std::to_string(hs->recv_total(d)) + " rows for rank " + std::to_string(d));
  const int64_t num_recv = hs->recv_total(me);
  hs->rows = a.num_worst_tokens > 0 ? a.num_worst_tokens : num_recv;
  hs->send_tokens = std::move(plan.send_tokens);

  DispatchResult out;
  if (!plan.cached && a.num_worst_tokens == 0) {
    const int64_t per_rank = plan.experts / R;
    for (int64_t j = 0; j < per_rank; ++j) {
      int64_t n = 0;
      for (int s = 0; s < R; ++s) n += m.counts_expert(s)[me * per_rank + j];
      n = ceil_div(n, a.expert_alignment) * a.expert_alignment;
      out.num_recv_tokens_per_expert_list.push_back(static_cast<int>(n));
    }
  }

  // Round 2: the receive block, where senders write.
  const RecvLayout layout(hs->rows, plan.row_bytes, plan.scale_cols, plan.topk);
  const std::shared_ptr<Block> block = publish_recv_block(m, kDispatch, layout);
  fill_dispatch_outputs(out, plan, a.x.dtype(), hs, block, layout);
  DispatchHandle& h = out.handle;

  // Round 3 (on the event when async): every sender writes its rows into every receiver.
  const int threads = m.copy_threads(a.config);
  const int64_t worst = a.num_worst_tokens;
  Tensor x = a.x, x_scales = a.x_scales, topk_idx = a.topk_idx, topk_weights = a.topk_weights;
  Tensor recv_src_idx = h.recv_src_idx;
  out.event = m.run(a.async_finish, [&m, hs, block, layout, row_bytes = plan.row_bytes,
                                     scale_cols = plan.scale_cols, topk = plan.topk, experts = plan.experts, worst,
                                     threads, x, x_scales, topk_idx, topk_weights, recv_src_idx] {
    const int R = m.num_ranks, me = m.rank;
    for (int d = 0; d < R; ++d) m.map_new_segments(d);
    // Where each receiver's block is, and where this rank's rows start in it.
    const int64_t experts_per_rank = experts > 0 ? experts / R : 0;
    std::vector<RecvRowWriter> dests;
    std::vector<int64_t> start;
    for (int d = 0; d < R; ++d) {
      const uint64_t* dm = m.meta(d);
      dests.push_back({m.peer_data(d, dm[kSeg], dm[kOff]), RecvLayout(worst > 0 ? worst : hs->recv_total(d), row_bytes, scale_cols, topk),
                       d, row_bytes, scale_cols, topk, experts_per_rank});
      start.push_back(hs->recv_before(me, d));
    }
    const int32_t* head = hs->send_head.data_ptr<int32_t>();
    // Token-major: a token's row is read from memory once and written to each of its
    // receivers while it is still in cache.
    parallel_chunks(threads, hs->tokens, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const char* src = static_cast<const char*>(x.data()) + t * x.stride(0) * static_cast<int64_t>(x.element_size());
        for (int d = 0; d < R; ++d) {
          const int32_t j = head[t * R + d];
          if (j < 0) continue;
          dests[static_cast<size_t>(d)].put(start[static_cast<size_t>(d)] + j, src,
                                            scale_cols > 0 ? x_scales.data_ptr<float>() + t * x_scales.stride(0) : nullptr,
                                            topk > 0 ? topk_idx.data_ptr<int64_t>() + t * topk_idx.stride(0) : nullptr,
                                            topk > 0 ? topk_weights.data_ptr<float>() + t * topk_weights.stride(0) : nullptr,
                                            static_cast<int32_t>(t));
        }
      }
      detail::stream_fence();  // each thread orders its own non-temporal stores
    });
    char* own = block->data();
    pad_worst_rows(own, layout, *hs, topk);
    m.signal_all(kPhaseData);
    m.wait_done(kDispatch, kPhaseData);
    m.check_peer_errors(kDispatch);
    m.finish_op_segments();
    std::memcpy(recv_src_idx.data(), own + layout.src_idx, static_cast<size_t>(hs->rows) * 4);
  });
  return out;
}

namespace detail {
namespace {
std::atomic<double> g_test_cost_read{0}, g_test_cost_staged{0};
}  // namespace
void set_combine_costs_for_testing(double read, double staged) {
  g_test_cost_read.store(read);
  g_test_cost_staged.store(staged);
}
double combine_cost_for_testing(bool read) { return (read ? g_test_cost_read : g_test_cost_staged).load(); }
}  // namespace detail

CombineResult Buffer::combine(const CombineArgs& a) {
  Impl& m = *impl_;
  if (m.num_nodes() > 1) return detail::combine_internode(m, a);
  m.begin_op(kCombine);
  const int R = m.num_ranks, me = m.rank;
  CombineShape shape;
  try {
    shape = check_combine(kCombine, a, m.id, R);
  } catch (...) {
    m.abandon();
    throw;
  }
  const HandleState* hs_ptr = shape.hs;
  const int64_t hidden = shape.hidden, topk = shape.topk;
  const HandleState& hs = *hs_ptr;
  auto keep_handle = std::static_pointer_cast<const HandleState>(a.handle.internal);

  // Round 1: the owner's staging area (rows it sent, in the order it sent them) and, when x
  // already lives in this rank's shared memory, where owners may read it in place.
  int64_t sent_rows = 0;
  for (int d = 0; d < R; ++d) sent_rows += hs.count(me, d);
  const size_t row_bytes = static_cast<size_t>(hidden) * 2;
  const size_t weights_at = align_up(static_cast<size_t>(sent_rows) * row_bytes, 64);
  std::shared_ptr<Block> staging, output;
  // The output too comes from the heap: its pages are already mapped, where a fresh
  // allocation of this size would take a page fault per 4 KiB on every call.
  const size_t out_weights_at = align_up(static_cast<size_t>(hs.tokens) * row_bytes, 64);
  try {
    staging = m.allocate(weights_at + static_cast<size_t>(sent_rows * topk) * 4);
    output = m.allocate(out_weights_at + static_cast<size_t>(hs.tokens * topk) * 4);
  } catch (...) {
    m.abandon();
    throw;
  }
  uint64_t* mine = m.meta(me);
  mine[kHidden] = static_cast<uint64_t>(hidden);
  mine[kTopk] = static_cast<uint64_t>(topk);
  mine[kSeg] = static_cast<uint64_t>(staging->seg);
  mine[kOff] = staging->off;
  mine[kNumSegs] = static_cast<uint64_t>(m.heap->num_segments());
  mine[kXAddr] = reinterpret_cast<uint64_t>(a.x.data());
  mine[kXStride] = static_cast<uint64_t>(a.x.stride(0)) * 2;
  mine[kLayout] = layout_hash(hs);
  mine[kLastCost] = std::bit_cast<uint64_t>(m.combine_reads.my_cost);
  if (hs.rows > 0) {
    const size_t span = static_cast<size_t>((hs.rows - 1) * a.x.stride(0)) * 2 + row_bytes;
    size_t off = 0;
    const int seg = m.heap->find(a.x.data(), span, off);
    if (seg >= 0) {
      mine[kInPlace] = 1;
      mine[kXSeg] = static_cast<uint64_t>(seg);
      mine[kXOff] = off;
    }
  }
  m.publish(kPhaseCounts);
  m.wait_ready(kCombine, kPhaseCounts);
  m.check_peer_errors(kCombine);
  check_same_everywhere(m, kCombine, kHidden, "x (hidden size)");
  check_same_everywhere(m, kCombine, kTopk, "topk_weights (top-k, 0 = none)");
  check_same_everywhere(m, kCombine, kLayout, "handle (the same dispatch's handle on every rank; layout hash)");
  // Whether owners read private x through cma in this call (CombineReadChoice): the same
  // verdict on every rank, from what every rank published. A call counts when some rank
  // holds rows in private memory; a measured cost waits (published in every call) for the
  // next call that counts.
  bool private_x = false;
  double previous_cost = 0;
  for (int d = 0; d < R; ++d) {
    private_x |= m.meta(d)[kInPlace] == 0 && hs.recv_total(d) > 0;
    previous_cost += std::bit_cast<double>(m.meta(d)[kLastCost]);
  }
  const bool counted = m.cma && private_x && hidden > 0;
  bool read_x = false, measure = false;
  if (counted) {
    read_x = m.combine_reads.next(previous_cost);
    measure = m.combine_reads.measured();
    m.combine_reads.my_cost = 0;
  }

  CombineResult out;
  out.combined_x = Tensor::from_blob_with_owner(output->data(), {hs.tokens, hidden}, DType::bf16, output);
  if (topk > 0)
    out.combined_topk_weights =
        Tensor::from_blob_with_owner(output->data() + out_weights_at, {hs.tokens, topk}, DType::f32, output);
  const int threads = m.copy_threads(a.config);
  Tensor x = a.x, weights = a.topk_weights, bias_0 = a.bias_0, bias_1 = a.bias_1;
  Tensor combined = out.combined_x, combined_w = out.combined_topk_weights;
  const bool in_place = mine[kInPlace] != 0;

  out.event = m.run(a.async_finish, [&m, keep_handle, staging, x, weights, bias_0, bias_1, combined, combined_w,
                                     hidden, topk, row_bytes, weights_at, threads, in_place, read_x, measure] {
    const auto started = std::chrono::steady_clock::now();
    const HandleState& hs = *keep_handle;
    const int R = m.num_ranks, me = m.rank;
    for (int d = 0; d < R; ++d) m.map_new_segments(d);
    // (Segments on 2 MiB pages take the copy that streams faster into them: stream_copy.h.
    // The node's segments share one mount, so this rank's first tells.)
    const bool huge = m.heap && m.heap->num_segments() > 0 && m.heap->segment(0)->huge();
    const auto copy = huge ? moekit::detail::copy_stream_to_huge_pages : moekit::detail::copy_stream;
    // Round 2: send each owner back its rows (one contiguous run per owner).
    for (int s = 0; s < R; ++s) {
      const int64_t n = hs.count(s, me);
      if (n == 0) continue;
      const uint64_t* sm = m.meta(s);
      char* stage = m.peer_data(s, sm[kSeg], sm[kOff]);
      int64_t before = 0;  // rows owner s staged for ranks < me
      for (int q = 0; q < me; ++q) before += hs.count(s, q);
      const int64_t first = hs.recv_before(s, me);
      int64_t owner_rows = 0;  // the owner's staging holds all rows it sent; weights follow
      for (int q = 0; q < R; ++q) owner_rows += hs.count(s, q);
      const size_t owner_weights_at = align_up(static_cast<size_t>(owner_rows) * row_bytes, 64);
      // (This rank's own rows need no staging: its reduce below reads them from x itself;
      // when owners read x this call (read_x), neither do the others.)
      if (!in_place && s != me && !read_x) {
        const int64_t xs = x.stride(0) * 2;
        if (xs == static_cast<int64_t>(row_bytes)) {
          const auto* src = static_cast<const char*>(x.data()) + first * xs;
          char* dst = stage + static_cast<size_t>(before) * row_bytes;
          const size_t total = static_cast<size_t>(n) * row_bytes;
          parallel_chunks(threads, static_cast<int64_t>(total / 4096 + 1), [&](int64_t b, int64_t e) {
            const size_t lo = std::min(total, static_cast<size_t>(b) * 4096), hi = std::min(total, static_cast<size_t>(e) * 4096);
            if (hi > lo) copy(dst + lo, src + lo, hi - lo);
            detail::stream_fence();
          });
        } else {
          for (int64_t r = 0; r < n; ++r)
            copy(stage + static_cast<size_t>(before + r) * row_bytes, static_cast<const char*>(x.data()) + (first + r) * xs,
                 row_bytes);
        }
      }
      if (topk > 0)
        for (int64_t r = 0; r < n; ++r)
          std::memcpy(stage + owner_weights_at + static_cast<size_t>((before + r) * topk) * 4,
                    weights.data_ptr<float>() + (first + r) * weights.stride(0), static_cast<size_t>(topk) * 4);
    }
    m.signal_all(kPhaseData);
    m.wait_done(kCombine, kPhaseData);
    m.check_peer_errors(kCombine);

    // Reduce: for each token, the rows of every rank that received it, ascending rank, in f32.
    const char* stage = staging->data();
    std::vector<int64_t> stage_before(static_cast<size_t>(R) + 1, 0);
    for (int d = 0; d < R; ++d) stage_before[static_cast<size_t>(d) + 1] = stage_before[static_cast<size_t>(d)] + hs.count(me, d);
    std::vector<const char*> direct(static_cast<size_t>(R), nullptr);
    std::vector<int64_t> direct_stride(static_cast<size_t>(R), 0);
    for (int d = 0; d < R; ++d) {
      const uint64_t* dm = m.meta(d);
      if (dm[kInPlace]) {
        direct[static_cast<size_t>(d)] = m.peer_data(d, dm[kXSeg], dm[kXOff]) + hs.recv_before(me, d) * static_cast<int64_t>(dm[kXStride]);
        direct_stride[static_cast<size_t>(d)] = static_cast<int64_t>(dm[kXStride]);
      }
    }
    if (!in_place) {  // this rank's rows, from its own (private) x
      const int64_t xs = x.stride(0) * 2;
      direct[static_cast<size_t>(me)] = static_cast<const char*>(x.data()) + hs.recv_before(me, me) * xs;
      direct_stride[static_cast<size_t>(me)] = xs;
    }
    // Ranks whose private x this rank reads through cma, a block of tokens at a time, into a
    // scratch that stays in L2 while the block is summed: one kernel copy out of each peer's
    // x instead of the peer's copy into shared memory and this rank's read of it.
    std::vector<int> pulled;
    for (int d = 0; d < R; ++d)
      if (read_x && d != me && !direct[static_cast<size_t>(d)] && hs.count(me, d) > 0 && row_bytes > 0) pulled.push_back(d);
    const int64_t block = pulled.empty() ? std::max<int64_t>(hs.tokens, 1)
                                         : std::max<int64_t>(1, kPullBytes / (static_cast<int64_t>(pulled.size()) * static_cast<int64_t>(row_bytes)));
    // (No exception may leave the OpenMP region, a failed read among them: the first one is
    // kept and rethrown after round 3, so that no peer is left waiting for this rank.)
    std::exception_ptr thrown;
    std::atomic_flag caught = ATOMIC_FLAG_INIT;
    const int32_t* head = hs.send_head.data_ptr<int32_t>();
    parallel_chunks(threads, hs.tokens, [&](int64_t t0, int64_t t1) {
     try {
      // Rows [first[i], first[i] + rows[i]) of the run pulled[i] holds for this rank, in the
      // scratch from row offset at[i].
      static thread_local std::vector<char> scratch;
      std::vector<int64_t> first(pulled.size()), rows(pulled.size()), at(pulled.size());
      std::vector<int> slot(static_cast<size_t>(R), -1);
      for (size_t i = 0; i < pulled.size(); ++i) slot[static_cast<size_t>(pulled[i])] = static_cast<int>(i);
      auto pull = [&](int64_t b0, int64_t b1) {
        int64_t total = 0;
        for (size_t i = 0; i < pulled.size(); ++i) {
          const int d = pulled[i];
          int64_t lo = -1, hi = -1;  // (a run holds the owner's tokens in ascending order)
          for (int64_t t = b0; t < b1 && lo < 0; ++t) lo = head[t * R + d];
          for (int64_t t = b1 - 1; t >= b0 && hi < 0; --t) hi = head[t * R + d];
          first[i] = lo, rows[i] = lo < 0 ? 0 : hi - lo + 1, at[i] = total, total += rows[i];
        }
        if (scratch.size() < static_cast<size_t>(total) * row_bytes) scratch.resize(static_cast<size_t>(total) * row_bytes);
        for (size_t i = 0; i < pulled.size(); ++i) {
          if (rows[i] == 0) continue;
          const int d = pulled[i];
          const uint64_t* dm = m.meta(d);
          const int64_t stride = static_cast<int64_t>(dm[kXStride]);
          const uint64_t from = dm[kXAddr] + static_cast<uint64_t>((hs.recv_before(me, d) + first[i]) * stride);
          if (!read_peer_rows(m.peer_pids[static_cast<size_t>(d)], from, stride, rows[i], row_bytes,
                              scratch.data() + static_cast<size_t>(at[i]) * row_bytes)) {
            const int error = errno;
            fail(kCombine, "x", "rank " + std::to_string(d) + "'s x readable through process_vm_readv", std::strerror(error));
          }
        }
      };
      // Token t's rows, one per rank that received it, ascending rank, and each one's index in
      // its owner's staging (where its weights are, whether or not its values are there).
      struct Received {
        std::vector<const uint16_t*> rows;
        std::vector<size_t> staged;
        int n = 0;
      };
      auto gather = [&](int64_t t, Received& to) {
        to.n = 0;
        for (int d = 0; d < R; ++d) {
          const int32_t j = head[t * R + d];
          if (j < 0) continue;
          const size_t staged = static_cast<size_t>(stage_before[static_cast<size_t>(d)] + j);
          const int i = slot[static_cast<size_t>(d)];
          const char* row = i >= 0 ? scratch.data() + static_cast<size_t>(at[static_cast<size_t>(i)] + j - first[static_cast<size_t>(i)]) * row_bytes
                            : direct[static_cast<size_t>(d)] ? direct[static_cast<size_t>(d)] + j * direct_stride[static_cast<size_t>(d)]
                                                             : stage + staged * row_bytes;
          to.rows[static_cast<size_t>(to.n)] = reinterpret_cast<const uint16_t*>(row);
          to.staged[static_cast<size_t>(to.n++)] = staged;
        }
      };
      Received cur{std::vector<const uint16_t*>(static_cast<size_t>(R)), std::vector<size_t>(static_cast<size_t>(R))};
      Received next = cur;
      for (int64_t block_begin = t0; block_begin < t1; block_begin += block) {
        const int64_t block_end = std::min(t1, block_begin + block);
        if (!pulled.empty()) pull(block_begin, block_end);
        gather(block_begin, cur);
        for (int64_t t = block_begin; t < block_end; ++t) {
          if (topk > 0) {
            float* wout = combined_w.data_ptr<float>() + t * topk;
            std::fill_n(wout, topk, 0.0f);
            for (int i = 0; i < cur.n; ++i) {
              const float* w = reinterpret_cast<const float*>(stage + weights_at) + cur.staged[static_cast<size_t>(i)] * static_cast<size_t>(topk);
              for (int64_t q = 0; q < topk; ++q) wout[q] += w[q];
            }
          }
          // The next token's rows sit elsewhere (other ranks' areas): requesting them while this
          // token is summed hides the DRAM latency of each new row.
          next.n = 0;
          if (t + 1 < block_end) gather(t + 1, next);
          const uint16_t* b0 = bias_0.defined() ? bias_0.data_ptr<uint16_t>() + t * bias_0.stride(0) : nullptr;
          const uint16_t* b1 = bias_1.defined() ? bias_1.data_ptr<uint16_t>() + t * bias_1.stride(0) : nullptr;
          detail::reduce_rows_bf16(combined.data_ptr<uint16_t>() + t * hidden, cur.rows.data(), cur.n, b0, b1, hidden,
                                   detail::RowsAhead{next.rows.data(), next.n});
          std::swap(cur, next);
        }
      }
      detail::stream_fence();
     } catch (...) {
      if (!caught.test_and_set()) thrown = std::current_exception();
     }
    });
    if (measure && !thrown) {  // (per row offered plus token reduced: what this rank moved)
      const double injected = detail::combine_cost_for_testing(read_x);
      m.combine_reads.my_cost = injected > 0 ? injected
                                             : std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - started).count() /
                                                   static_cast<double>(std::max<int64_t>(1, hs.rows + hs.tokens));
    }
    // Round 3: owners are done reading; x offered in place (or read through cma) may be
    // released.
    m.signal_all(kPhaseRead);
    m.wait_done(kCombine, kPhaseRead);
    m.finish_op_segments();
    if (thrown) std::rethrow_exception(thrown);
  });
  return out;
}

}  // namespace moekit::ep

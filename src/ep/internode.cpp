// Normal dispatch and combine across nodes, hierarchically (DeepEP's internode mode):
//
//   dispatch  0. MPI all-gather of shapes and counts (every rank learns every receiver's rows)
//             A. over the "rail" (the ranks with this local index, one per node): each token
//                crosses the network once per destination node, with the mask of that
//                node's ranks it goes to                       (MPI_Ialltoallv)
//             B. within the node, through shared memory: each rank forwards its own tokens
//                and the ones it received on the rail into the receivers' blocks, at the
//                position the global order (source rank, source token) gives them
//   combine   B. expert ranks copy rows back to the forwarder of their source (shared memory);
//                the forwarder sums, per token, the rows of its node's receivers
//             A. partial sums (f32) go back over the rail
//                finally the owner sums, per token and in node order, its own node's rows and
//                the partials of the other nodes, plus biases
// Combine sums in f32 throughout (partials cross the network in f32) and rounds once: the
// result depends neither on thread counts nor on timing; with one node it is the one-node
// sum bit for bit, with several it may differ from it in the last f32 bit before rounding
// (partial sums are associated per node).
#include <sched.h>

#include <algorithm>
#include <bit>
#include <climits>
#include <cstring>
#include <chrono>
#include <exception>
#include <numeric>

#include "cpu/formats/format_kernels.h"
#include "ep/plan.h"

namespace moekit::ep {
namespace detail {
namespace {

constexpr const char* kDispatch = "ep::Buffer::dispatch";
constexpr const char* kCombine = "ep::Buffer::combine";

using moekit::detail::ceil_div;
using moekit::detail::check_cpu_matrix;
using moekit::detail::check_shape;

// One token on the rail: x row, scales, global top-k ids and weights, source token, mask.
struct RailRecord {
  size_t scales = 0, topk = 0, weights = 0, token = 0, mask = 0, bytes = 0;
  RailRecord(size_t row_bytes, int64_t scale_cols, int64_t k) {
    scales = align_up(row_bytes, 16);
    topk = align_up(scales + static_cast<size_t>(scale_cols) * 4, 8);
    weights = topk + static_cast<size_t>(k) * 8;
    token = weights + static_cast<size_t>(k) * 4;
    mask = token + 4;
    bytes = align_up(mask + 4, 64);
  }
};

// MPI counts are ints: a message above 2 GiB is refused with a clear error.
int mpi_count(const char* fn, size_t bytes) {
  if (bytes > static_cast<size_t>(INT_MAX))
    fail(fn, "tokens", "at most 2 GiB per node pair and operation", std::to_string(bytes) + " bytes");
  return static_cast<int>(bytes);
}

// Point-to-point exchange with a timeout: send_bytes[i] to peers[i], recv_bytes[i] from
// peers[i] (ranks of comm; global ranks for errors). Non-blocking collectives cannot tell
// which rank is missing, so this names the peers whose data never came (TimeoutError), and
// the buffer is then unusable (destroy it).
void exchange(Buffer::Impl& m, const char* fn, MPI_Comm comm, int tag, const std::vector<int>& comm_ranks,
              const std::vector<int>& global_ranks, const char* send, const std::vector<size_t>& send_bytes, char* recv,
              const std::vector<size_t>& recv_bytes) {
  const size_t n = comm_ranks.size();
  std::vector<MPI_Request> reqs(2 * n, MPI_REQUEST_NULL);
  size_t so = 0, ro = 0;
  for (size_t i = 0; i < n; ++i) {
    if (recv_bytes[i] > 0)
      MPI_Irecv(recv + ro, mpi_count(fn, recv_bytes[i]), MPI_BYTE, comm_ranks[i], tag, comm, &reqs[i]);
    if (send_bytes[i] > 0)
      MPI_Isend(send + so, mpi_count(fn, send_bytes[i]), MPI_BYTE, comm_ranks[i], tag, comm, &reqs[n + i]);
    so += send_bytes[i];
    ro += recv_bytes[i];
  }
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    int done = 0;
    MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &done, MPI_STATUSES_IGNORE);
    if (done) return;
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (waited > m.timeout) {
      std::vector<int> silent;
      for (size_t i = 0; i < n; ++i) {
        int flag = 1;
        if (reqs[i] != MPI_REQUEST_NULL) MPI_Test(&reqs[i], &flag, MPI_STATUS_IGNORE);
        if (!flag) {
          silent.push_back(global_ranks[i]);
          MPI_Cancel(&reqs[i]);
          MPI_Wait(&reqs[i], MPI_STATUS_IGNORE);
        }
      }
      for (size_t i = n; i < 2 * n; ++i)
        if (reqs[i] != MPI_REQUEST_NULL) MPI_Request_free(&reqs[i]);
      m.broken.store(true);
      if (silent.empty()) silent = global_ranks;  // only sends were pending: someone is not receiving
      throw TimeoutError(fn, silent, m.timeout);
    }
    // MPI progresses (TCP especially) only inside MPI calls: keep testing, only yielding the
    // core to other runnable ranks, never sleeping.
    sched_yield();
  }
}

// out = rows[0] + rows[1] + ... in f32, in that order (bf16 rows).
void sum_rows_f32(float* out, const uint16_t* const* rows, int n, int64_t hidden) {
  for (int64_t i = 0; i < hidden; ++i) out[i] = n > 0 ? std::bit_cast<float>(static_cast<uint32_t>(rows[0][i]) << 16) : 0.0f;
  for (int r = 1; r < n; ++r)
    for (int64_t i = 0; i < hidden; ++i) out[i] += std::bit_cast<float>(static_cast<uint32_t>(rows[r][i]) << 16);
}

constexpr int kTagRecords = 101, kTagRail = 102, kTagPartials = 103;

// Over the rail: to and from the rank with this local index on every other node.
void rail_exchange(Buffer::Impl& m, const char* fn, int tag, const char* send, const std::vector<size_t>& send_bytes,
                   char* recv, const std::vector<size_t>& recv_bytes) {
  const int N = m.num_nodes(), L = m.ranks_per_node;
  std::vector<int> comm_ranks, global_ranks;
  for (int n = 0; n < N; ++n) {
    comm_ranks.push_back(n);
    global_ranks.push_back(n * L + m.local_rank);
  }
  exchange(m, fn, m.rail_comm, tag, comm_ranks, global_ranks, send, send_bytes, recv, recv_bytes);
}

// Collective over all ranks: every rank's record; a rank with an error makes all raise it.
std::vector<int64_t> all_gather_records(Buffer::Impl& m, const char* fn, std::vector<int64_t> mine,
                                        const std::exception_ptr& local_error) {
  const size_t n = mine.size(), R = static_cast<size_t>(m.num_ranks);
  std::vector<int64_t> all(n * R);
  std::vector<int> ranks(R);
  std::iota(ranks.begin(), ranks.end(), 0);
  // Every rank sends its record to every rank (itself included): small, eager messages.
  std::vector<int64_t> send(n * R);
  for (size_t p = 0; p < R; ++p) std::copy(mine.begin(), mine.end(), send.begin() + static_cast<std::ptrdiff_t>(p * n));
  exchange(m, fn, m.comm, kTagRecords, ranks, ranks, reinterpret_cast<const char*>(send.data()),
           std::vector<size_t>(R, n * 8), reinterpret_cast<char*>(all.data()), std::vector<size_t>(R, n * 8));
  if (local_error) std::rethrow_exception(local_error);
  for (int p = 0; p < m.num_ranks; ++p)
    if (all[static_cast<size_t>(p) * n] != 0)
      fail(fn, "rank " + std::to_string(p), "valid arguments on every rank",
           "rank " + std::to_string(p) + " rejected its arguments (see its error)");
  return all;
}

void check_same_fields(const char* fn, const std::vector<int64_t>& all, size_t stride, int ranks,
                       std::initializer_list<std::pair<int, const char*>> fields) {
  for (const auto& [f, what] : fields)
    for (int p = 1; p < ranks; ++p)
      if (all[static_cast<size_t>(p) * stride + static_cast<size_t>(f)] != all[static_cast<size_t>(f)])
        fail(fn, what, "the same value on every rank (" + std::to_string(all[static_cast<size_t>(f)]) + " on rank 0)",
             std::to_string(all[static_cast<size_t>(p) * stride + static_cast<size_t>(f)]) + " on rank " + std::to_string(p));
}

}  // namespace

DispatchResult dispatch_internode(Buffer::Impl& m, const DispatchArgs& a) {
  const char* fn = kDispatch;
  m.begin_op(fn);
  const int R = m.num_ranks, me = m.rank, L = m.ranks_per_node, N = m.num_nodes(), node = me / L, lr = m.local_rank;
  DispatchPlan plan;
  std::exception_ptr local_error;
  try {
    plan = plan_dispatch(a, R, m.id);
  } catch (const Error&) {
    local_error = std::current_exception();
  }

  // Own tokens per remote node, and the mask of that node's ranks each one goes to.
  std::vector<std::vector<int32_t>> node_tokens(static_cast<size_t>(N));
  std::vector<int32_t> node_pos(static_cast<size_t>(plan.tokens * N), -1);
  if (!local_error) {
    const bool* in_rank = plan.is_token_in_rank.data_ptr<bool>();
    for (int64_t t = 0; t < plan.tokens; ++t)
      for (int n = 0; n < N; ++n) {
        if (n == node) continue;
        bool any = false;
        for (int d = 0; d < L; ++d) any |= in_rank[t * R + n * L + d];
        if (!any) continue;
        node_pos[static_cast<size_t>(t * N + n)] = static_cast<int32_t>(node_tokens[static_cast<size_t>(n)].size());
        node_tokens[static_cast<size_t>(n)].push_back(static_cast<int32_t>(t));
      }
  }

  // Round 0 (MPI): [error, hidden, dtype, topk, experts, worst, -, -, counts to R ranks, tokens to N nodes].
  const size_t rec = 8 + static_cast<size_t>(R + N);
  std::vector<int64_t> mine(rec, 0);
  mine[0] = local_error ? 1 : 0;
  mine[1] = plan.hidden;
  mine[2] = plan.fp8 ? 2 : 1;
  mine[3] = plan.topk;
  mine[4] = plan.experts;
  mine[5] = a.num_worst_tokens;
  if (!local_error) {
    for (int d = 0; d < R; ++d) mine[8 + static_cast<size_t>(d)] = static_cast<int64_t>(plan.send_tokens[static_cast<size_t>(d)].size());
    for (int n = 0; n < N; ++n) mine[8 + static_cast<size_t>(R + n)] = static_cast<int64_t>(node_tokens[static_cast<size_t>(n)].size());
  }
  const std::vector<int64_t> all = all_gather_records(m, fn, mine, local_error);
  check_same_fields(fn, all, rec, R,
                    {{1, "x (hidden size)"}, {2, "x (dtype)"}, {3, "topk_idx (top-k, 0 = none or cached)"},
                     {4, "num_tokens_per_expert (experts, 0 = cached)"}, {5, "num_worst_tokens"}});

  auto hs = std::make_shared<HandleState>();
  hs->buffer_id = m.id;
  hs->num_ranks = R;
  hs->rank = me;
  hs->tokens = plan.tokens;
  hs->dispatch_op = m.op;
  hs->num_nodes = N;
  hs->ranks_per_node = L;
  hs->counts.resize(static_cast<size_t>(R * R));
  for (int s = 0; s < R; ++s)
    for (int d = 0; d < R; ++d) hs->counts[static_cast<size_t>(s * R + d)] = all[static_cast<size_t>(s) * rec + 8 + static_cast<size_t>(d)];
  for (int d = 0; d < R; ++d)
    if (a.num_worst_tokens > 0 && hs->recv_total(d) > a.num_worst_tokens)
      fail(fn, "num_worst_tokens", ">= the rows every rank receives",
           std::to_string(a.num_worst_tokens) + " < " + std::to_string(hs->recv_total(d)) + " rows for rank " + std::to_string(d));
  const int64_t num_recv = hs->recv_total(me);
  hs->rows = a.num_worst_tokens > 0 ? a.num_worst_tokens : num_recv;
  hs->send_tokens = std::move(plan.send_tokens);
  hs->node_tokens = std::move(node_tokens);
  hs->node_pos = std::move(node_pos);

  DispatchResult out;
  if (!plan.cached && a.num_worst_tokens == 0) {
    // (on the heap: after a timeout MPI may still write it, mpi_wait keeps it)
    auto sums = std::make_shared<std::vector<int64_t>>(plan.per_expert.begin(), plan.per_expert.end());
    const std::vector<int64_t>& per_expert = *sums;
    MPI_Request req;
    MPI_Iallreduce(MPI_IN_PLACE, sums->data(), static_cast<int>(sums->size()), MPI_INT64_T, MPI_SUM, m.comm, &req);
    m.mpi_wait(req, fn, sums);
    const int64_t per_rank = plan.experts / R;
    for (int64_t j = 0; j < per_rank; ++j) {
      const int64_t n = per_expert[static_cast<size_t>(me * per_rank + j)];
      out.num_recv_tokens_per_expert_list.push_back(static_cast<int>(ceil_div(n, a.expert_alignment) * a.expert_alignment));
    }
  }

  // Stage A: each token once per destination node, over the rail.
  const RailRecord rr(plan.row_bytes, plan.scale_cols, plan.topk);
  std::vector<size_t> send_bytes(static_cast<size_t>(N)), recv_bytes(static_cast<size_t>(N));
  size_t send_total = 0, recv_total = 0;
  for (int n = 0; n < N; ++n) {
    send_bytes[static_cast<size_t>(n)] = hs->node_tokens[static_cast<size_t>(n)].size() * rr.bytes;
    const int peer = n * L + lr;  // my rail peer on node n: how many of its tokens come to my node
    recv_bytes[static_cast<size_t>(n)] =
        n == node ? 0 : static_cast<size_t>(all[static_cast<size_t>(peer) * rec + 8 + static_cast<size_t>(R + node)]) * rr.bytes;
    send_total += send_bytes[static_cast<size_t>(n)];
    recv_total += recv_bytes[static_cast<size_t>(n)];
  }
  // Rail buffers in the heap: their pages are mapped already (a fresh allocation would fault).
  std::shared_ptr<Block> rail_send, rail_recv;
  try {
    rail_send = m.allocate(send_total);
    rail_recv = m.allocate(recv_total);
  } catch (...) {
    m.abandon();
    throw;
  }
  {
    char* at = rail_send->data();
    for (int n = 0; n < N; ++n)
      for (int32_t t : hs->node_tokens[static_cast<size_t>(n)]) {
        std::memcpy(at, static_cast<const char*>(a.x.data()) + t * a.x.stride(0) * static_cast<int64_t>(a.x.element_size()), plan.row_bytes);
        if (plan.scale_cols > 0)
          std::memcpy(at + rr.scales, a.x_scales.data_ptr<float>() + t * a.x_scales.stride(0), static_cast<size_t>(plan.scale_cols) * 4);
        for (int64_t q = 0; q < plan.topk; ++q) {
          reinterpret_cast<int64_t*>(at + rr.topk)[q] = a.topk_idx.data_ptr<int64_t>()[t * a.topk_idx.stride(0) + q];
          reinterpret_cast<float*>(at + rr.weights)[q] = a.topk_weights.data_ptr<float>()[t * a.topk_weights.stride(0) + q];
        }
        uint32_t mask = 0;
        for (int d = 0; d < L; ++d) mask |= plan.is_token_in_rank.data_ptr<bool>()[t * R + n * L + d] ? 1u << d : 0u;
        std::memcpy(at + rr.token, &t, 4);
        std::memcpy(at + rr.mask, &mask, 4);
        at += rr.bytes;
      }
  }
  rail_exchange(m, fn, kTagRail, rail_send->data(), send_bytes, rail_recv->data(), recv_bytes);
  {
    const char* at = rail_recv->data();
    for (int n = 0; n < N; ++n) {
      if (n == node) continue;
      HandleState::Carried c;
      c.source = n * L + lr;
      for (size_t i = 0; i < recv_bytes[static_cast<size_t>(n)] / rr.bytes; ++i, at += rr.bytes) {
        int32_t t;
        uint32_t mask;
        std::memcpy(&t, at + rr.token, 4);
        std::memcpy(&mask, at + rr.mask, 4);
        c.token.push_back(t);
        c.mask.push_back(mask);
      }
      hs->carried.push_back(std::move(c));
    }
  }

  // Round 2 (shared memory): the receive block.
  const RecvLayout layout(hs->rows, plan.row_bytes, plan.scale_cols, plan.topk);
  const std::shared_ptr<Block> block = publish_recv_block(m, fn, layout);
  fill_dispatch_outputs(out, plan, a.x.dtype(), hs, block, layout);
  DispatchHandle& h = out.handle;

  // Round 3: forward own tokens and carried ones into this node's receivers.
  const int threads = m.copy_threads(a.config);
  const int64_t worst = a.num_worst_tokens;
  Tensor x = a.x, x_scales = a.x_scales, topk_idx = a.topk_idx, topk_weights = a.topk_weights, recv_src_idx = h.recv_src_idx;
  const size_t row_bytes = plan.row_bytes;
  const int64_t scale_cols = plan.scale_cols, topk = plan.topk, experts = plan.experts;
  out.event = m.run(a.async_finish, [&m, hs, block, layout, rail_recv, rr, row_bytes, scale_cols, topk, experts, worst, threads,
                                     x, x_scales, topk_idx, topk_weights, recv_src_idx] {
    const int R = m.num_ranks, me = m.rank, L = m.ranks_per_node, node = me / L;
    for (int d = 0; d < L; ++d) m.map_new_segments(d);
    const int64_t experts_per_rank = experts > 0 ? experts / R : 0;
    std::vector<RecvRowWriter> dests;
    std::vector<int64_t> own_start;  // where this rank's own rows start in each local receiver
    for (int d = 0; d < L; ++d) {
      const int g = node * L + d;
      const uint64_t* dm = m.meta(d);
      dests.push_back({m.peer_data(d, dm[kSeg], dm[kOff]), RecvLayout(worst > 0 ? worst : hs->recv_total(g), row_bytes, scale_cols, topk),
                       g, row_bytes, scale_cols, topk, experts_per_rank});
      own_start.push_back(hs->recv_before(me, g));
    }
    const int32_t* head = hs->send_head.data_ptr<int32_t>();
    parallel_chunks(threads, hs->tokens, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        for (int d = 0; d < L; ++d) {
          const int g = node * L + d;
          const int32_t j = head[t * R + g];
          if (j < 0) continue;
          dests[static_cast<size_t>(d)].put(own_start[static_cast<size_t>(d)] + j,
              static_cast<const char*>(x.data()) + t * x.stride(0) * static_cast<int64_t>(x.element_size()),
              scale_cols > 0 ? x_scales.data_ptr<float>() + t * x_scales.stride(0) : nullptr,
              topk > 0 ? topk_idx.data_ptr<int64_t>() + t * topk_idx.stride(0) : nullptr,
              topk > 0 ? topk_weights.data_ptr<float>() + t * topk_weights.stride(0) : nullptr, static_cast<int32_t>(t));
        }
      detail::stream_fence();
    });
    const char* record = rail_recv->data();
    for (const auto& c : hs->carried) {
      std::vector<int64_t> next(static_cast<size_t>(L));
      for (int d = 0; d < L; ++d) next[static_cast<size_t>(d)] = hs->recv_before(c.source, node * L + d);
      for (size_t i = 0; i < c.token.size(); ++i, record += rr.bytes)
        for (int d = 0; d < L; ++d)
          if (c.mask[i] >> d & 1u)
            dests[static_cast<size_t>(d)].put(next[static_cast<size_t>(d)]++, record, reinterpret_cast<const float*>(record + rr.scales),
                reinterpret_cast<const int64_t*>(record + rr.topk), reinterpret_cast<const float*>(record + rr.weights), c.token[i]);
    }
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

CombineResult combine_internode(Buffer::Impl& m, const CombineArgs& a) {
  const char* fn = kCombine;
  m.begin_op(fn);
  const int R = m.num_ranks, me = m.rank, L = m.ranks_per_node, N = m.num_nodes(), node = me / L, lr = m.local_rank;
  std::exception_ptr local_error;
  int64_t hidden = 0, topk = 0, layout = 0;
  try {
    const CombineShape shape = check_combine(fn, a, m.id, R);
    hidden = shape.hidden;
    topk = shape.topk;
    layout = static_cast<int64_t>(layout_hash(*shape.hs));
  } catch (const Error&) {
    local_error = std::current_exception();
  }
  const std::vector<int64_t> all = all_gather_records(m, fn, {local_error ? 1 : 0, hidden, topk, layout}, local_error);
  check_same_fields(fn, all, 4, R,
                    {{1, "x (hidden size)"},
                     {2, "topk_weights (top-k, 0 = none)"},
                     {3, "handle (the same dispatch's handle on every rank; layout hash)"}});
  auto hs = std::static_pointer_cast<const HandleState>(a.handle.internal);

  // Staging of this forwarder: for each source with its local index (node order), for each
  // local receiver d, the rows d returns for that source.
  const size_t row_bytes = static_cast<size_t>(hidden) * 2;
  auto stage_rows_before = [hs, L, node](int fwd_local, int src_node, int d) {  // rows before (src_node, d) in fwd's staging
    int64_t n = 0;
    for (int c = 0; c < src_node; ++c)
      for (int q = 0; q < L; ++q) n += hs->count(c * L + fwd_local, node * L + q);
    for (int q = 0; q < d; ++q) n += hs->count(src_node * L + fwd_local, node * L + q);
    return n;
  };
  const int64_t staged = stage_rows_before(lr, N, 0);
  const size_t weights_at = align_up(static_cast<size_t>(staged) * row_bytes, 64);
  // Partials travel in f32 (the spec sums in f32; the network carries 2x the bf16 bytes).
  const size_t partial_row = static_cast<size_t>(hidden) * 4;
  const size_t partial_bytes = align_up(partial_row + static_cast<size_t>(topk) * 4, 64);
  std::vector<size_t> send_bytes(static_cast<size_t>(N), 0), recv_bytes(static_cast<size_t>(N), 0);
  for (const auto& c : hs->carried) send_bytes[static_cast<size_t>(c.source / L)] = c.token.size() * partial_bytes;
  size_t send_total = 0, recv_total = 0;
  for (int n = 0; n < N; ++n) {
    recv_bytes[static_cast<size_t>(n)] = hs->node_tokens[static_cast<size_t>(n)].size() * partial_bytes;
    send_total += send_bytes[static_cast<size_t>(n)];
    recv_total += recv_bytes[static_cast<size_t>(n)];
  }
  // Every block is taken from the heap here, before the segment count is published: the
  // heap's pages are mapped already, and a segment the heap grows by is announced to peers.
  const size_t out_weights_at = align_up(static_cast<size_t>(hs->tokens) * row_bytes, 64);
  std::shared_ptr<Block> staging, rail_send, rail_recv, output;
  try {
    output = m.allocate(out_weights_at + static_cast<size_t>(hs->tokens * topk) * 4);
    staging = m.allocate(weights_at + static_cast<size_t>(staged * topk) * 4);
    rail_send = m.allocate(send_total);
    rail_recv = m.allocate(recv_total);
  } catch (...) {
    m.abandon();
    throw;
  }
  uint64_t* meta = m.meta(lr);
  meta[kHidden] = static_cast<uint64_t>(hidden);
  meta[kSeg] = static_cast<uint64_t>(staging->seg);
  meta[kOff] = staging->off;
  meta[kNumSegs] = static_cast<uint64_t>(m.heap->num_segments());
  m.publish(kPhaseCounts);
  m.wait_ready(fn, kPhaseCounts);
  m.check_peer_errors(fn);

  CombineResult out;
  out.combined_x = Tensor::from_blob_with_owner(output->data(), {hs->tokens, hidden}, DType::bf16, output);
  if (topk > 0) out.combined_topk_weights = Tensor::from_blob_with_owner(output->data() + out_weights_at, {hs->tokens, topk}, DType::f32, output);
  const int threads = m.copy_threads(a.config);
  Tensor x = a.x, weights = a.topk_weights, bias_0 = a.bias_0, bias_1 = a.bias_1, combined = out.combined_x, combined_w = out.combined_topk_weights;
  auto task = [&m, hs, staging, output, rail_send, rail_recv, send_bytes, recv_bytes, partial_row, partial_bytes, x, weights, bias_0,
               bias_1, combined, combined_w, hidden, topk, row_bytes, weights_at, threads, stage_rows_before, fn] {
    const int R = m.num_ranks, me = m.rank, L = m.ranks_per_node, N = m.num_nodes(), node = me / L, lr = m.local_rank;
    for (int d = 0; d < L; ++d) m.map_new_segments(d);
    // Stage B back: rows of every source go to that source's forwarder on this node.
    for (int s = 0; s < R; ++s) {
      const int64_t n = hs->count(s, me);
      if (n == 0) continue;
      const int f = s % L, src_node = s / L;
      const uint64_t* fm = m.meta(f);
      char* stage = m.peer_data(f, fm[kSeg], fm[kOff]);
      int64_t f_staged = 0;
      for (int c = 0; c < N; ++c)
        for (int q = 0; q < L; ++q) f_staged += hs->count(c * L + f, node * L + q);
      const size_t f_weights_at = align_up(static_cast<size_t>(f_staged) * row_bytes, 64);
      const int64_t at = stage_rows_before(f, src_node, lr), first = hs->recv_before(s, me);
      for (int64_t r = 0; r < n; ++r) {
        detail::copy_stream(stage + static_cast<size_t>(at + r) * row_bytes,
                            static_cast<const char*>(x.data()) + (first + r) * x.stride(0) * 2, row_bytes);
        if (topk > 0)
          std::memcpy(stage + f_weights_at + static_cast<size_t>((at + r) * topk) * 4, weights.data_ptr<float>() + (first + r) * weights.stride(0),
                      static_cast<size_t>(topk) * 4);
      }
    }
    m.signal_all(kPhaseData);
    m.wait_done(fn, kPhaseData);
    m.check_peer_errors(fn);

    // Partial sums of carried tokens (this node's receivers), back over the rail.
    const char* stage = staging->data();
    {
      char* at = rail_send->data();
      std::vector<const uint16_t*> rows(static_cast<size_t>(L));
      for (const auto& c : hs->carried) {
        const int src_node = c.source / L;
        std::vector<int64_t> next(static_cast<size_t>(L));
        for (int d = 0; d < L; ++d) next[static_cast<size_t>(d)] = stage_rows_before(lr, src_node, d);
        for (size_t i = 0; i < c.token.size(); ++i, at += partial_bytes) {
          int n = 0;
          auto* w = reinterpret_cast<float*>(at + partial_row);
          std::fill_n(w, topk, 0.0f);
          for (int d = 0; d < L; ++d) {
            if (!(c.mask[i] >> d & 1u)) continue;
            const int64_t row = next[static_cast<size_t>(d)]++;
            rows[static_cast<size_t>(n++)] = reinterpret_cast<const uint16_t*>(stage + static_cast<size_t>(row) * row_bytes);
            const float* sw = reinterpret_cast<const float*>(stage + weights_at) + row * topk;
            for (int64_t q = 0; q < topk; ++q) w[q] += sw[q];
          }
          sum_rows_f32(reinterpret_cast<float*>(at), rows.data(), n, hidden);
        }
      }
    }
    rail_exchange(m, fn, kTagPartials, rail_send->data(), send_bytes, rail_recv->data(), recv_bytes);

    // Final sum per own token: nodes in order; this node's receivers row by row, other nodes'
    // partials; then the biases.
    std::vector<const char*> partials(static_cast<size_t>(N), nullptr);
    {
      const char* at = rail_recv->data();
      for (int n = 0; n < N; ++n) {
        partials[static_cast<size_t>(n)] = at;
        at += recv_bytes[static_cast<size_t>(n)];
      }
    }
    std::vector<int64_t> own_before(static_cast<size_t>(L));
    for (int d = 0; d < L; ++d) own_before[static_cast<size_t>(d)] = stage_rows_before(lr, node, d);
    const int32_t* head = hs->send_head.data_ptr<int32_t>();
    const auto& fk = moekit::detail::format_kernels();
    parallel_chunks(threads, hs->tokens, [&](int64_t t0, int64_t t1) {
      std::vector<const uint16_t*> rows(static_cast<size_t>(L));
      std::vector<float> acc(static_cast<size_t>(hidden)), own(static_cast<size_t>(hidden)), tmp(static_cast<size_t>(hidden));
      for (int64_t t = t0; t < t1; ++t) {
        bool first = true;  // acc starts from the first partial (keeps -0 as the one-node sum does)
        auto add = [&](const float* p) {
          for (int64_t i = 0; i < hidden; ++i) acc[static_cast<size_t>(i)] = first ? p[i] : acc[static_cast<size_t>(i)] + p[i];
          first = false;
        };
        float* wout = topk > 0 ? combined_w.data_ptr<float>() + t * topk : nullptr;
        if (wout) std::fill_n(wout, topk, 0.0f);
        for (int nd = 0; nd < N; ++nd) {
          if (nd == node) {
            int n = 0;
            for (int d = 0; d < L; ++d) {
              const int32_t j = head[t * R + node * L + d];
              if (j < 0) continue;
              const int64_t row = own_before[static_cast<size_t>(d)] + j;
              rows[static_cast<size_t>(n++)] = reinterpret_cast<const uint16_t*>(stage + static_cast<size_t>(row) * row_bytes);
              if (wout)
                for (int64_t q = 0; q < topk; ++q) wout[q] += reinterpret_cast<const float*>(stage + weights_at)[row * topk + q];
            }
            if (n == 0) continue;
            sum_rows_f32(own.data(), rows.data(), n, hidden);
            add(own.data());
          } else {
            const int32_t p = hs->node_pos[static_cast<size_t>(t * N + nd)];
            if (p < 0) continue;
            const char* partial = partials[static_cast<size_t>(nd)] + static_cast<size_t>(p) * partial_bytes;
            add(reinterpret_cast<const float*>(partial));
            if (wout)
              for (int64_t q = 0; q < topk; ++q) wout[q] += reinterpret_cast<const float*>(partial + partial_row)[q];
          }
        }
        if (first) std::fill(acc.begin(), acc.end(), 0.0f);
        for (const Tensor* bias : {&bias_0, &bias_1})
          if (bias->defined()) {
            fk.bf16_to_f32(bias->data_ptr<uint16_t>() + t * bias->stride(0), tmp.data(), hidden);
            for (int64_t i = 0; i < hidden; ++i) acc[static_cast<size_t>(i)] += tmp[static_cast<size_t>(i)];
          }
        fk.f32_to_bf16(acc.data(), combined.data_ptr<uint16_t>() + t * hidden, hidden);
      }
    });
    m.signal_all(kPhaseRead);
    m.wait_done(fn, kPhaseRead);
    m.finish_op_segments();
  };
  out.event = m.run(a.async_finish && Buffer::Impl::can_run_mpi_async(), std::move(task));
  return out;
}

}  // namespace detail
}  // namespace moekit::ep

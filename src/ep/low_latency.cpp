// Low-latency dispatch and combine (decode).
//
// Within a node, pull, not push: a sender quantises its tokens once into its own shared send
// area and raises one flag; each receiver then gathers, from every sender, the rows of the
// tokens that chose its experts (source rank, then source token: the order is deterministic),
// and raises a "gathered" flag that frees the sender's area. Combine mirrors it: each expert
// rank offers its outputs (in place when they already live in shared memory), each token
// owner reads the rows it needs and sums them with the routing weights.
//
// Across nodes, push: the send step also posts one MPI message to every rank of another node
// (like DeepEP's low-latency mode, which writes straight to every rank over RDMA): dispatch
// sends the metadata, the top-k ids and the rows of the tokens that chose that rank's experts;
// combine sends each source rank its expert rows back. The receive step (in the call, on the
// async thread or in the hook) takes them as they come and treats each message exactly as it
// treats a same-node sender's area, so the order and the bits do not depend on the node count.
// Every message carries its call number: one left over from a call that failed or timed out
// is recognised and dropped.
//
// Every rank's low-latency segment has two halves used by alternating calls, so a call only
// ever waits for readers of the call before the previous one ("at most two results live").
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>

#include "ep/buffer_impl.h"
#include "ep/cma.h"
#include "moekit/formats.h"

namespace moekit::ep {
namespace {

constexpr const char* kLLDispatch = "ep::Buffer::low_latency_dispatch";
constexpr const char* kLLCombine = "ep::Buffer::low_latency_combine";
constexpr int64_t kMaxTopk = 32;

using moekit::detail::ceil_div;
using moekit::detail::check_cpu_matrix;
using moekit::detail::check_shape;

// Offsets inside one half of a rank's low-latency segment (same arithmetic on every rank).
struct LLLayout {
  int64_t max_tokens = 0, hidden = 0, local_experts = 0, slots = 0, scale_cols = 0;
  size_t send_x = 0, send_scales = 0, send_topk = 0;
  size_t recv_x = 0, recv_scales = 0, src_info = 0, layout_range = 0, recv_count = 0;
  size_t combine_x = 0, combine_out = 0, half_bytes = 0;

  LLLayout(int64_t max, int64_t h, int num_ranks, int num_experts)
      : max_tokens(max), hidden(h), local_experts(num_experts / num_ranks), slots(max * num_ranks),
        scale_cols(ceil_div(h, 128)) {
    const auto m = static_cast<size_t>(max), hb = static_cast<size_t>(h) * 2;
    const auto rows = static_cast<size_t>(local_experts * slots), sc = static_cast<size_t>(scale_cols) * 4;
    size_t at = 0;
    auto take = [&](size_t bytes) {
      const size_t here = at;
      at = align_up(at + bytes, 64);
      return here;
    };
    send_x = take(m * hb);  // bf16 rows, or e4m3 rows in the first half of each
    send_scales = take(m * sc);
    send_topk = take(m * kMaxTopk * 4);
    recv_x = take(rows * hb);
    recv_scales = take(rows * sc);
    src_info = take(rows * 4);
    layout_range = take(static_cast<size_t>(local_experts * num_ranks) * 8);
    recv_count = take(static_cast<size_t>(local_experts) * 4);
    combine_x = take(rows * hb);
    combine_out = take(m * hb);
    half_bytes = align_up(at, 4096);
  }
  // The regions a dispatch writes (from the start of a half) and a combine writes (placed at
  // the end of the half: see combine_at).
  size_t dispatch_bytes() const { return combine_x; }
  size_t combine_bytes() const { return half_bytes - combine_x; }
};

// Where a combine of layout L puts x (staged) and its output inside a half: the combine block
// ends where the half does, whatever L's dispatch part, so that a live result of another
// dispatch shape in the same half keeps its rows (an error where the two cannot both fit).
size_t combine_x_at(const Buffer::Impl& m, const LLLayout& L) { return m.ll_half_stride() - L.combine_bytes(); }
size_t combine_out_at(const Buffer::Impl& m, const LLLayout& L) { return combine_x_at(m, L) + (L.combine_out - L.combine_x); }

// The half the next dispatch (combine) will take must leave room for the live result of the
// last combine (dispatch) there. Same counters and shapes on every rank: the same verdict.
void check_half_fits(const Buffer::Impl& m, const char* fn, const char* arg, size_t dispatch_bytes, size_t combine_bytes) {
  if (dispatch_bytes + combine_bytes > m.ll_half_stride())
    fail(fn, arg, "shapes whose low-latency regions fit beside the live result of the other kind in the same half (" +
                      std::to_string(m.ll_half_stride()) + " bytes)",
         std::to_string(dispatch_bytes) + " dispatch bytes + " + std::to_string(combine_bytes) +
             " combine bytes (results of differently shaped dispatches live at once; a larger num_rdma_bytes makes room)");
}

enum LLMeta : int {
  kLLTokens,
  kLLTopk,
  kLLHidden,
  kLLExperts,
  kLLMax,
  kLLFp8,       // 0 bf16; 1 fp8 f32 scales; 2 fp8 packed ue8m0
  kLLXWhere,    // combine: 1 = own low-latency segment, 2 = heap segment, 3 = private (read
                // through cma; kLLXOff is then x's address in the sender's process)
  kLLXSeg,
  kLLXOff,
  kLLXStrideE,  // bytes between experts
  kLLXStrideR,  // bytes between rows
  kLLDispatchCall,  // combine: the call number of the dispatch whose result it combines
  kLLError,  // 1 when the rank rejected its arguments for this call
  kLLCall,   // messages across nodes: the sender's call number
  kLLRows,   // messages across nodes: the rows carried
  // kLLError of a combine in shared metadata. A half's metadata serves a dispatch and a
  // combine, and peers may still be receiving that dispatch when a combine on the half is
  // refused: its mark must not make them fail. (Messages carry kLLError: their tags differ.)
  kLLCombineError,
  kLLCombineHidden,  // kLLHidden of a combine (in its messages too), for the same reason
};
static_assert(static_cast<int>(kLLCombineHidden) < static_cast<int>(kMetaCount));

constexpr int kTagLLDispatch = 201, kTagLLCombine = 202;
// Bytes of peers' rows a low-latency receive reads through cma per block of tokens (docs/EP.md).
constexpr int64_t kLLPullBytes = int64_t{512} << 10;

// A message to a rank of another node: [metadata (the LLMeta record)][top-k ids, i32 T x k]
// [rows][f32 scales, a row each]. Combine messages carry rows only.
struct LLMessage {
  size_t topk = kMetaCount * 8, x = 0, scales = 0, bytes = 0;
  LLMessage(int64_t tokens, int64_t k, int64_t rows, size_t row_bytes, size_t scale_bytes) {
    x = align_up(topk + static_cast<size_t>(tokens * k) * 4, 64);
    scales = align_up(x + static_cast<size_t>(rows) * row_bytes, 64);
    bytes = scales + static_cast<size_t>(rows) * scale_bytes;
  }
};

// Posts msg (its metadata filled) to rank dest; it completes in the background.
void post_message(Buffer::Impl& m, const char* fn, int tag, int dest, std::unique_ptr<MessageBuffer> msg) {
  if (msg->size() > static_cast<size_t>(INT_MAX))
    fail(fn, "num_max_dispatch_tokens_per_rank", "messages of at most 2 GiB per rank pair", std::to_string(msg->size()) + " bytes");
  MPI_Request req = MPI_REQUEST_NULL;
  MPI_Isend(msg->data(), static_cast<int>(msg->size()), MPI_BYTE, dest, tag, m.comm, &req);
  m.keep_in_flight(req, std::move(msg));
}

// One call's messages from the ranks of other nodes, received as they come. Whatever is
// still being received when the call gives up is left to MPI (Impl::keep_in_flight).
class Inbox {
 public:
  Inbox(Buffer::Impl& m, int tag, uint64_t call) : m_(m), tag_(tag), call_(call), msgs_(static_cast<size_t>(m.num_ranks)),
                                                     reqs_(static_cast<size_t>(m.num_ranks), MPI_REQUEST_NULL),
                                                     done_(static_cast<size_t>(m.num_ranks), 0) {}
  Inbox(const Inbox&) = delete;
  Inbox& operator=(const Inbox&) = delete;
  ~Inbox() {
    for (size_t g = 0; g < msgs_.size(); ++g) {
      if (reqs_[g] != MPI_REQUEST_NULL) {
        m_.keep_in_flight(reqs_[g], std::move(msgs_[g]));
      } else {
        m_.recycle(std::move(msgs_[g]));
      }
    }
  }

  // One non-blocking step for rank g; true once its message for this call is in.
  bool poll(const char* fn, int g) {
    const auto i = static_cast<size_t>(g);
    while (!done_[i]) {
      if (reqs_[i] == MPI_REQUEST_NULL) {
        int found = 0;
        MPI_Message probe;
        MPI_Status status;
        MPI_Improbe(g, tag_, m_.comm, &found, &probe, &status);
        if (!found) return false;
        int bytes = 0;
        MPI_Get_count(&status, MPI_BYTE, &bytes);
        if (!msgs_[i]) msgs_[i] = m_.message_buffer(0);
        msgs_[i]->resize(static_cast<size_t>(bytes));
        MPI_Imrecv(msgs_[i]->data(), bytes, MPI_BYTE, &probe, &reqs_[i]);
      }
      int finished = 0;
      MPI_Test(&reqs_[i], &finished, MPI_STATUS_IGNORE);
      if (!finished) return false;
      if (msgs_[i]->size() < kMetaCount * 8)
        fail(fn, "rank " + std::to_string(g), "a low-latency message", std::to_string(msgs_[i]->size()) + " bytes");
      const uint64_t call = meta(g)[kLLCall];
      if (call > call_)
        fail(fn, "rank " + std::to_string(g), "low-latency calls in the same order on every rank",
             "its call " + std::to_string(call) + " while this rank is at call " + std::to_string(call_));
      done_[i] = call == call_;  // an older one is a leftover of a failed call here: dropped
    }
    return true;
  }
  const uint64_t* meta(int g) const { return reinterpret_cast<const uint64_t*>(msgs_[static_cast<size_t>(g)]->data()); }
  const char* data(int g) const { return msgs_[static_cast<size_t>(g)]->data(); }
  size_t size(int g) const { return msgs_[static_cast<size_t>(g)]->size(); }

 private:
  Buffer::Impl& m_;
  int tag_;
  uint64_t call_;
  std::vector<std::unique_ptr<MessageBuffer>> msgs_;  // by global rank
  std::vector<MPI_Request> reqs_;
  std::vector<char> done_;
};

// Until every unmasked rank of this node passes ready(local rank) and every unmasked rank of
// another node has sent its message for this call; TimeoutError naming all the others. Waits
// keep MPI progressing (this rank's own messages in flight too).
template <class Ready>
void wait_sources(Buffer::Impl& m, const char* fn, Ready&& ready, Inbox& in) {
  const bool remote = m.num_nodes() > 1;
  auto missing = [&](int g) {
    if (m.masked[static_cast<size_t>(g)]) return false;
    return m.on_node(g) ? !ready(m.local_of(g)) : !in.poll(fn, g);
  };
  const auto start = std::chrono::steady_clock::now();
  for (uint64_t iter = 0;; ++iter) {
    bool all = true;
    for (int g = 0; g < m.num_ranks; ++g) all = !missing(g) && all;  // polls every rank
    if (all) return;
    if (remote) m.sweep_in_flight();
    if (iter < 1024) {
      _mm_pause();
      continue;
    }
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (waited > m.timeout) {
      std::vector<int> silent;
      for (int g = 0; g < m.num_ranks; ++g)
        if (missing(g)) silent.push_back(g);
      if (silent.empty()) return;
      throw TimeoutError(fn, silent, m.timeout);
    }
    // MPI (TCP especially) progresses only inside MPI calls: never sleep while a message is due.
    if (remote || waited < 0.01) {
      sched_yield();
    } else {
      ::usleep(50);
    }
  }
}

// The metadata rank g published (same node) or sent (other node) for this call.
const uint64_t* source_meta(const Buffer::Impl& m, const Inbox& in, int g, int half) {
  return m.on_node(g) ? m.ll_meta(m.local_of(g), half) : in.meta(g);
}

// After wait_sources: a rank that rejected its arguments makes every rank raise.
void check_source_errors(const Buffer::Impl& m, const char* fn, const Inbox& in, int half, bool dispatch) {
  const int word = dispatch ? kLLError : kLLCombineError;
  auto error_of = [&](int g) { return m.on_node(g) ? m.ll_meta(m.local_of(g), half)[word] : in.meta(g)[kLLError]; };
  for (int g = 0; g < m.num_ranks; ++g)
    if (!m.masked[static_cast<size_t>(g)] && g != m.rank && error_of(g) != 0)
      fail(fn, "rank " + std::to_string(g), "valid arguments on every rank",
           "rank " + std::to_string(g) + " rejected its arguments (see its error)");
}

// The ranks low-latency messages go to: the unmasked ranks of other nodes.
std::vector<int> remote_targets(const Buffer::Impl& m) {
  std::vector<int> out;
  for (int g = 0; g < m.num_ranks; ++g)
    if (!m.on_node(g) && !m.masked[static_cast<size_t>(g)]) out.push_back(g);
  return out;
}

// The metadata-only message that tells the ranks of other nodes this rank gave up a call.
void post_error_messages(Buffer::Impl& m, const char* fn, int tag, uint64_t call) {
  for (int g : remote_targets(m)) {
    auto msg = m.message_buffer(kMetaCount * 8);
    auto* meta = reinterpret_cast<uint64_t*>(msg->data());
    std::fill_n(meta, kMetaCount, 0);
    meta[kLLError] = 1;
    meta[kLLCall] = call;
    post_message(m, fn, tag, g, std::move(msg));
  }
}

struct LLHandleState {
  uint64_t buffer_id = 0, call = 0;
  int half = 0, num_ranks = 0, rank = 0;
  int64_t tokens = 0, topk = 0;
  LLLayout layout{1, 128, 1, 1};
  std::vector<int32_t> recv_count;  // per local expert
  std::atomic<bool> received{false};  // the receive completed (its rows, counts and ranges are in place)
};

// The layout ranges that same-node rank `local` published for the dispatch of `state`:
// [local expert][source rank], begin << 32 | count of that source's rows in the expert.
const int64_t* layout_ranges(const Buffer::Impl& m, const LLHandleState& state, int local) {
  return reinterpret_cast<const int64_t*>(m.peers[static_cast<size_t>(local)].low_latency->data() +
                                          static_cast<size_t>(state.half) * m.ll_half_stride() + state.layout.layout_range);
}

struct LLHook {
  std::function<void()> body;
  bool done = false;
};

// Receive steps that call MPI run on the async thread only under MPI_THREAD_MULTIPLE.
bool ll_async(const Buffer::Impl& m, bool requested) {
  return requested && (m.num_nodes() == 1 || Buffer::Impl::can_run_mpi_async());
}

// Where a receive step runs. With async_finish, or with a hook, on the worker thread from the
// call on, so the transfer overlaps the caller's work (the hook then only waits for it, as
// upstream's hook waits for data that RDMA moved meanwhile). Where the worker may not call
// MPI: in the call, or (hook) deferred into the hook.
template <class Result>
void schedule_receive(Buffer::Impl& m, bool async_finish, bool hook, std::function<void()> receive, Result& out) {
  if (!hook) {
    out.event = m.run(ll_async(m, async_finish), std::move(receive));
  } else if (ll_async(m, true)) {
    const EventOverlap done = m.run(true, std::move(receive));
    out.hook = [done] { done.wait(); };
  } else {
    auto deferred = std::make_shared<LLHook>();
    deferred->body = std::move(receive);
    out.hook = [deferred, live = m.live] {
      if (deferred->done) return;
      // (The receive refers to the buffer, which destroy() or ~Buffer has taken down.)
      if (!live->load()) fail("ep::Buffer low-latency receive hook", "buffer", "a live buffer", "a destroyed buffer");
      deferred->done = true;
      deferred->body();
    };
  }
}

// The tokens (ascending) with at least one top-k entry among experts [first, first + n).
std::vector<int32_t> tokens_for_experts(const int32_t* topk, int64_t tokens, int64_t k, int64_t first, int64_t n) {
  std::vector<int32_t> out;
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = topk[t * k + j] - first;
      if (e >= 0 && e < n) {
        out.push_back(static_cast<int32_t>(t));
        break;
      }
    }
  return out;
}


// One sender's tokens as a receiver sees them: the sender's shared send half (same node), or
// the message it sent (other node: only the tokens that chose the receiver's experts, in order).
struct Source {
  int64_t tokens = 0, k = 0;
  const int32_t* topk = nullptr;
  const char* x = nullptr;
  const char* scales = nullptr;
  std::vector<int32_t> rows;  // other node: token -> row of the message (-1: not sent)
  int64_t row(int64_t t) const { return rows.empty() ? t : rows[static_cast<size_t>(t)]; }
};

Source source_view(const Buffer::Impl& m, const Inbox& in, int g, int half, const LLLayout& L, size_t row_bytes,
                   size_t sc_bytes) {
  constexpr const char* fn = kLLDispatch;
  const uint64_t* meta = source_meta(m, in, g, half);
  Source s;
  s.tokens = static_cast<int64_t>(meta[kLLTokens]);
  s.k = static_cast<int64_t>(meta[kLLTopk]);
  if (m.on_node(g)) {
    const char* theirs = m.peers[static_cast<size_t>(m.local_of(g))].low_latency->data() + static_cast<size_t>(half) * m.ll_half_stride();
    s.topk = reinterpret_cast<const int32_t*>(theirs + L.send_topk);
    s.x = theirs + L.send_x;
    s.scales = theirs + L.send_scales;
    return s;
  }
  const std::string who = "rank " + std::to_string(g);
  if (s.tokens > L.max_tokens || s.k > kMaxTopk)
    fail(fn, who, "at most " + std::to_string(L.max_tokens) + " tokens of top-" + std::to_string(kMaxTopk),
         std::to_string(s.tokens) + " tokens of top-" + std::to_string(s.k));
  const LLMessage layout(s.tokens, s.k, static_cast<int64_t>(meta[kLLRows]), row_bytes, sc_bytes);
  if (in.size(g) != layout.bytes)
    fail(fn, who, "a dispatch message of " + std::to_string(layout.bytes) + " bytes", std::to_string(in.size(g)) + " bytes");
  const char* data = in.data(g);
  s.topk = reinterpret_cast<const int32_t*>(data + layout.topk);
  s.x = data + layout.x;
  s.scales = data + layout.scales;
  const auto sent = tokens_for_experts(s.topk, s.tokens, s.k, m.rank * L.local_experts, L.local_experts);
  if (sent.size() != meta[kLLRows])
    fail(fn, who, std::to_string(sent.size()) + " rows for this rank's experts", std::to_string(meta[kLLRows]) + " rows");
  s.rows.assign(static_cast<size_t>(s.tokens), -1);
  for (size_t i = 0; i < sent.size(); ++i) s.rows[static_cast<size_t>(sent[i])] = static_cast<int32_t>(i);
  return s;
}

// To every unmasked rank of another node: the metadata, all top-k ids, and the rows (with
// their scales) of the tokens that chose that rank's experts.
void post_dispatch_messages(Buffer::Impl& m, const char* own, const LLLayout& L, const uint64_t* meta, uint64_t call,
                            size_t row_bytes, size_t sc_bytes) {
  const auto T = static_cast<int64_t>(meta[kLLTokens]), k = static_cast<int64_t>(meta[kLLTopk]);
  const auto* topk = reinterpret_cast<const int32_t*>(own + L.send_topk);
  for (int g : remote_targets(m)) {
    const auto sent = tokens_for_experts(topk, T, k, g * L.local_experts, L.local_experts);
    const auto rows = static_cast<int64_t>(sent.size());
    const LLMessage layout(T, k, rows, row_bytes, sc_bytes);
    auto msg = m.message_buffer(layout.bytes);
    char* p = msg->data();
    auto* head = reinterpret_cast<uint64_t*>(p);
    std::copy_n(meta, kMetaCount, head);
    head[kLLCall] = call;
    head[kLLRows] = static_cast<uint64_t>(rows);
    std::memcpy(p + layout.topk, topk, static_cast<size_t>(T * k) * 4);
    for (int64_t i = 0; i < rows; ++i) {
      const auto t = static_cast<size_t>(sent[static_cast<size_t>(i)]);
      std::memcpy(p + layout.x + static_cast<size_t>(i) * row_bytes, own + L.send_x + t * row_bytes, row_bytes);
      if (sc_bytes) std::memcpy(p + layout.scales + static_cast<size_t>(i) * sc_bytes, own + L.send_scales + t * sc_bytes, sc_bytes);
    }
    post_message(m, kLLDispatch, kTagLLDispatch, g, std::move(msg));
  }
}

// True when top-k entry j of token t repeats an earlier one (sent, and counted, once).
bool is_repeat(const Tensor& topk_idx, int64_t t, int64_t j) {
  const int64_t* row = topk_idx.data_ptr<int64_t>() + t * topk_idx.stride(0);
  for (int64_t q = 0; q < j; ++q)
    if (row[q] == row[j]) return true;
  return false;
}

// To every unmasked rank of another node: its rows of every local expert, expert by expert
// (the ranges dispatch recorded), from x wherever it lives.
void post_combine_messages(Buffer::Impl& m, const LLHandleState& st, const Tensor& x, uint64_t call) {
  const LLLayout& L = st.layout;
  const int R = m.num_ranks;
  const size_t row_bytes = static_cast<size_t>(L.hidden) * 2;
  const char* own = m.peers[static_cast<size_t>(m.local_rank)].low_latency->data() + static_cast<size_t>(st.half) * m.ll_half_stride();
  const auto* range = reinterpret_cast<const int64_t*>(own + L.layout_range);
  for (int g : remote_targets(m)) {
    int64_t rows = 0;
    for (int64_t e = 0; e < L.local_experts; ++e) rows += range[e * R + g] & 0xffffffff;
    const LLMessage layout(0, 0, rows, row_bytes, 0);
    auto msg = m.message_buffer(layout.bytes);
    auto* head = reinterpret_cast<uint64_t*>(msg->data());
    std::fill_n(head, kMetaCount, 0);
    head[kLLCombineHidden] = static_cast<uint64_t>(L.hidden);
    head[kLLCall] = call;
    head[kLLRows] = static_cast<uint64_t>(rows);
    head[kLLDispatchCall] = st.call;
    char* out = msg->data() + layout.x;
    for (int64_t e = 0; e < L.local_experts; ++e) {
      const int64_t begin = range[e * R + g] >> 32, n = range[e * R + g] & 0xffffffff;
      for (int64_t r = 0; r < n; ++r, out += row_bytes)
        std::memcpy(out, static_cast<const char*>(x.data()) + static_cast<size_t>(e * x.stride(0) + (begin + r) * x.stride(1)) * 2, row_bytes);
    }
    post_message(m, kLLCombine, kTagLLCombine, g, std::move(msg));
  }
}

// Per global expert on another node: the row of its message where this rank's rows of that
// expert begin (the rows come expert by expert, in token order). Checks each message holds
// exactly the rows this rank's top-k ids ask for.
std::vector<int64_t> message_rows(const Buffer::Impl& m, const Inbox& in, const Tensor& topk_idx, int64_t T, int64_t k,
                                  int64_t local_E, size_t row_bytes) {
  const int R = m.num_ranks;
  std::vector<int64_t> first(static_cast<size_t>(local_E * R), 0);
  if (m.num_nodes() == 1) return first;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = topk_idx.data_ptr<int64_t>()[t * topk_idx.stride(0) + j];
      if (e >= 0 && !is_repeat(topk_idx, t, j)) ++first[static_cast<size_t>(e)];
    }
  for (int d = 0; d < R; ++d) {
    int64_t at = 0;
    for (int64_t el = 0; el < local_E; ++el) {
      const int64_t n = first[static_cast<size_t>(d * local_E + el)];
      first[static_cast<size_t>(d * local_E + el)] = at;
      at += n;
    }
    if (m.on_node(d) || m.masked[static_cast<size_t>(d)]) continue;
    if (in.meta(d)[kLLRows] != static_cast<uint64_t>(at) || in.size(d) != LLMessage(0, 0, at, row_bytes, 0).bytes)
      fail(kLLCombine, "rank " + std::to_string(d), std::to_string(at) + " rows for this rank's tokens (its dispatch layout)",
           std::to_string(in.meta(d)[kLLRows]) + " rows (a low-latency result at most two dispatches old?)");
  }
  return first;
}

}  // namespace

int64_t get_low_latency_rdma_size_hint(int64_t num_max_dispatch_tokens_per_rank, int64_t hidden, int num_ranks,
                                       int num_experts) {
  constexpr const char* fn = "ep::get_low_latency_rdma_size_hint";
  if (num_max_dispatch_tokens_per_rank <= 0) fail(fn, "num_max_dispatch_tokens_per_rank", "> 0", std::to_string(num_max_dispatch_tokens_per_rank));
  if (hidden <= 0) fail(fn, "hidden", "> 0", std::to_string(hidden));
  if (num_ranks <= 0 || num_experts <= 0 || num_experts % num_ranks != 0)
    fail(fn, "num_experts", "a positive multiple of num_ranks", std::to_string(num_experts) + " for " + std::to_string(num_ranks) + " ranks");
  // An upper bound of LLLayout's arithmetic, in long double: sizes that would overflow it
  // (and wrap to a small hint) are refused instead.
  const long double rows = static_cast<long double>(num_max_dispatch_tokens_per_rank) * num_ranks;
  const long double row_bytes = 4.0L * hidden + 8.0L * ceil_div(hidden, 128) + 4.0L * kMaxTopk + 64;
  if (rows * (num_experts / num_ranks + 1) * row_bytes + 8.0L * num_experts > 0x1p60L)
    fail(fn, "num_max_dispatch_tokens_per_rank", "a size whose buffer is under 2^60 bytes",
         std::to_string(num_max_dispatch_tokens_per_rank) + " tokens of hidden " + std::to_string(hidden) + " for " +
             std::to_string(num_experts) + " experts on " + std::to_string(num_ranks) + " ranks");
  return static_cast<int64_t>(2 * LLLayout(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts).half_bytes);
}

void Buffer::low_latency_update_mask_buffer(int rank, bool mask) {
  Impl& m = *impl_;
  if (rank < 0 || rank >= m.num_ranks)
    fail("ep::Buffer::low_latency_update_mask_buffer", "rank", "in [0, " + std::to_string(m.num_ranks) + ")", std::to_string(rank));
  if (rank == m.rank && mask)
    fail("ep::Buffer::low_latency_update_mask_buffer", "rank", "another rank (a rank cannot mask itself)", std::to_string(rank));
  m.masked[static_cast<size_t>(rank)] = mask ? 1 : 0;
}

Tensor Buffer::low_latency_query_mask_buffer() const {
  Tensor t = Tensor::empty({impl_->num_ranks}, DType::i32);
  std::copy(impl_->masked.begin(), impl_->masked.end(), t.data_ptr<int32_t>());
  return t;
}

void Buffer::low_latency_clean_mask_buffer() { std::fill(impl_->masked.begin(), impl_->masked.end(), 0); }

// A rank that rejects its arguments still takes part in the call's flags and messages
// (marked as an error), so its peers raise an Error naming it instead of waiting for the timeout.
void ll_abandon(Buffer::Impl& m, uint64_t call, bool dispatch) {
  const char* fn = dispatch ? kLLDispatch : kLLCombine;
  const int half = static_cast<int>(call & 1), lr = m.local_rank;
  // As a real call would: the half's metadata is rewritten only after its last readers left.
  if (call > 2)
    m.wait_unmasked(fn, [&](int p) {
      return (dispatch ? m.ll_gathered(lr, p) : m.ll_read(lr, p)).load(std::memory_order_acquire) >= call - 2;
    });
  m.ll_meta(lr, half)[dispatch ? kLLError : kLLCombineError] = 1;
  for (int p = 0; p < m.ranks_per_node; ++p) {
    if (dispatch) {
      m.ll_gathered(p, lr).store(call, std::memory_order_release);
    } else {
      m.ll_read(p, lr).store(call, std::memory_order_release);
    }
  }
  (dispatch ? m.ll_sent(lr) : m.ll_offered(lr)).store(call, std::memory_order_release);
  post_error_messages(m, fn, dispatch ? kTagLLDispatch : kTagLLCombine, call);
}

// The entry of both low-latency operations: buffer checks, then the call; a rank that
// rejects its arguments before taking part still marks the call (ll_abandon) so that its
// peers raise instead of waiting.
template <class Body>
auto ll_call(Buffer::Impl& m, const char* fn, uint64_t& calls, bool dispatch, Body&& body) {
  if (!m.available) fail(fn, "buffer", "a live buffer", "a destroyed buffer");
  check_mpi_not_finalized(fn);
  if (m.pending.valid()) m.pending.wait();
  m.sweep_in_flight();
  const uint64_t before = calls;
  try {
    return body();
  } catch (const TimeoutError&) {
    throw;
  } catch (const Error&) {
    if (calls == before) ll_abandon(m, ++calls, dispatch);
    throw;
  }
}

LowLatencyDispatchResult Buffer::low_latency_dispatch(const LowLatencyDispatchArgs& a) {
  return ll_call(*impl_, kLLDispatch, impl_->ll_dispatches, true, [&] { return low_latency_dispatch_checked(a); });
}

LowLatencyDispatchResult Buffer::low_latency_dispatch_checked(const LowLatencyDispatchArgs& a) {
  Impl& m = *impl_;
  const char* fn = kLLDispatch;
  const int R = m.num_ranks, me = m.rank;
  check_cpu_matrix(fn, "x", a.x, {DType::bf16});
  check_cpu_matrix(fn, "topk_idx", a.topk_idx, {DType::i64});
  const int64_t T = a.x.size(0), H = a.x.size(1), k = a.topk_idx.size(1), E = a.num_experts;
  if (a.topk_idx.size(0) != T) fail(fn, "topk_idx", std::to_string(T) + " rows (as x)", a.topk_idx.str());
  if (k > kMaxTopk) fail(fn, "topk_idx", "at most " + std::to_string(kMaxTopk) + " columns", a.topk_idx.str());
  if (E <= 0 || E % R != 0 || E > detail::kMaxExperts)
    fail(fn, "num_experts", "a positive multiple of " + std::to_string(R), std::to_string(E));
  if (H <= 0) fail(fn, "x", "a hidden size > 0", a.x.str());
  if (a.num_max_dispatch_tokens_per_rank < std::max<int64_t>(T, 1))
    fail(fn, "num_max_dispatch_tokens_per_rank", ">= the token count " + std::to_string(T) + ", and > 0",
         std::to_string(a.num_max_dispatch_tokens_per_rank));
  if (a.use_ue8m0 && !(a.use_fp8 && a.round_scale))
    fail(fn, "use_ue8m0", "use_fp8 and round_scale with use_ue8m0", "use_fp8=" + std::to_string(a.use_fp8) + ", round_scale=" + std::to_string(a.round_scale));
  if (a.async_finish && a.return_recv_hook) fail(fn, "async_finish", "not together with return_recv_hook", "both set");
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = a.topk_idx.data_ptr<int64_t>()[t * a.topk_idx.stride(0) + j];
      if (e < -1 || e >= E)
        fail(fn, "topk_idx[" + std::to_string(t) + ", " + std::to_string(j) + "]",
             "an expert id in [0, " + std::to_string(E) + ") or -1", std::to_string(e));
    }
  const int64_t hint = get_low_latency_rdma_size_hint(a.num_max_dispatch_tokens_per_rank, H, R, static_cast<int>(E));
  const LLLayout L(a.num_max_dispatch_tokens_per_rank, H, R, static_cast<int>(E));
  if (m.num_rdma_bytes < hint)
    fail(fn, "num_rdma_bytes", ">= get_low_latency_rdma_size_hint(" + std::to_string(a.num_max_dispatch_tokens_per_rank) + ", " +
             std::to_string(H) + ", " + std::to_string(R) + ", " + std::to_string(E) + ") = " + std::to_string(hint),
         std::to_string(m.num_rdma_bytes));
  const int64_t local_E = E / R;
  if (const Tensor& stats = a.cumulative_local_expert_recv_stats; stats.defined()) {  // (any stride)
    moekit::detail::check_cpu(fn, "cumulative_local_expert_recv_stats", stats);
    moekit::detail::check_dtype(fn, "cumulative_local_expert_recv_stats", stats, {DType::i32});
    moekit::detail::check_rank(fn, "cumulative_local_expert_recv_stats", stats, 1);
    check_shape(fn, "cumulative_local_expert_recv_stats", stats, {local_E});
  }

  check_half_fits(m, fn, "x", L.dispatch_bytes(), m.ll_combine_bytes[(m.ll_dispatches + 1) & 1]);
  {  // x inside the half this call fills (an old result's rows, say) would be overwritten as it is read
    const char* next = m.peers[static_cast<size_t>(m.local_rank)].low_latency->data() +
                       static_cast<size_t>((m.ll_dispatches + 1) & 1) * m.ll_half_stride();
    const Tensor half_bytes = Tensor::from_blob(next, {static_cast<int64_t>(m.ll_half_stride())}, DType::u8);
    moekit::detail::check_apart(fn, "x", a.x, {{"the buffer half this dispatch fills", &half_bytes}});
  }

  // Send: wait until every reader of this half (two calls ago) is done, then fill it.
  const uint64_t call = ++m.ll_dispatches;
  const int half = static_cast<int>(call & 1), lr = m.local_rank;
  m.ll_dispatch_bytes[half] = L.dispatch_bytes();
  if (call > 2) m.wait_unmasked(fn, [&](int p) { return m.ll_gathered(lr, p).load(std::memory_order_acquire) >= call - 2; });
  char* own = m.peers[static_cast<size_t>(lr)].low_latency->data() + static_cast<size_t>(half) * m.ll_half_stride();
  const int fp8_mode = !a.use_fp8 ? 0 : a.use_ue8m0 ? 2 : 1;
  if (fp8_mode) {
    per_token_cast_to_fp8_into(a.x, Tensor::from_blob(own + L.send_x, {T, H}, DType::e4m3),
                               Tensor::from_blob(own + L.send_scales, {T, L.scale_cols}, DType::f32), a.round_scale);
  } else {
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(own + L.send_x + static_cast<size_t>(t * H) * 2, a.x.data_ptr<uint16_t>() + t * a.x.stride(0), static_cast<size_t>(H) * 2);
  }
  auto* send_topk = reinterpret_cast<int32_t*>(own + L.send_topk);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) send_topk[t * k + j] = static_cast<int32_t>(a.topk_idx.data_ptr<int64_t>()[t * a.topk_idx.stride(0) + j]);
  uint64_t* meta = m.ll_meta(lr, half);
  meta[kLLTokens] = static_cast<uint64_t>(T);
  meta[kLLTopk] = static_cast<uint64_t>(k);
  meta[kLLHidden] = static_cast<uint64_t>(H);
  meta[kLLExperts] = static_cast<uint64_t>(E);
  meta[kLLMax] = static_cast<uint64_t>(a.num_max_dispatch_tokens_per_rank);
  meta[kLLFp8] = static_cast<uint64_t>(fp8_mode);
  meta[kLLError] = 0;
  m.ll_sent(lr).store(call, std::memory_order_release);
  const size_t row_bytes = static_cast<size_t>(H) * (fp8_mode ? 1 : 2), sc_bytes = fp8_mode ? static_cast<size_t>(L.scale_cols) * 4 : 0;
  if (m.num_nodes() > 1) post_dispatch_messages(m, own, L, meta, call, row_bytes, sc_bytes);

  // The results: views of this rank's half.
  auto state = std::make_shared<LLHandleState>();
  state->buffer_id = m.id;
  state->call = call;
  state->half = half;
  state->num_ranks = R;
  state->rank = me;
  state->tokens = T;
  state->topk = k;
  state->layout = L;
  state->recv_count.assign(static_cast<size_t>(local_E), 0);
  auto seg = m.peers[static_cast<size_t>(lr)].low_latency;
  LowLatencyDispatchResult out;
  const int64_t slots = L.slots;
  out.recv_x = Tensor::from_blob_with_owner(own + L.recv_x, {local_E, slots, H}, fp8_mode ? DType::e4m3 : DType::bf16, seg);
  if (fp8_mode == 1)
    out.recv_x_scales = Tensor::from_blob_with_owner(own + L.recv_scales, {local_E, slots, L.scale_cols}, DType::f32, seg);
  if (fp8_mode == 2)
    out.recv_x_scales = Tensor::from_blob_with_owner(own + L.recv_scales, {local_E, slots, ceil_div(L.scale_cols, 4)}, DType::i32, seg);
  out.recv_count = Tensor::from_blob_with_owner(own + L.recv_count, {local_E}, DType::i32, seg);
  out.handle.src_info = Tensor::from_blob_with_owner(own + L.src_info, {local_E, slots}, DType::i32, seg);
  out.handle.layout_range = Tensor::from_blob_with_owner(own + L.layout_range, {local_E, R}, DType::i64, seg);
  out.handle.num_max_dispatch_tokens_per_rank = a.num_max_dispatch_tokens_per_rank;
  out.handle.hidden = H;
  out.handle.num_experts = static_cast<int>(E);
  out.handle.internal = state;

  // Receive: gather every unmasked sender's tokens for this rank's experts.
  Tensor stats = a.cumulative_local_expert_recv_stats;
  auto receive = [&m, state, own, stats, fn, call, half, fp8_mode, row_bytes, sc_bytes] {
    const int R = m.num_ranks, me = m.rank, lr = m.local_rank;
    const LLLayout& L = state->layout;
    const int64_t local_E = L.local_experts, first_expert = me * local_E;
    Inbox in(m, kTagLLDispatch, call);
    try {
      wait_sources(m, fn, [&](int p) { return m.ll_sent(p).load(std::memory_order_acquire) >= call; }, in);
      check_source_errors(m, fn, in, half, true);
      const uint64_t* mine = m.ll_meta(lr, half);
      for (int g = 0; g < R; ++g) {
        if (m.masked[static_cast<size_t>(g)]) continue;
        const uint64_t* sm = source_meta(m, in, g, half);
        for (LLMeta f : {kLLHidden, kLLExperts, kLLMax, kLLFp8})
          if (sm[f] != mine[f])
            fail(fn, "rank " + std::to_string(g), "the same hidden size, experts, token limit and format on every rank",
                 "a different value on rank " + std::to_string(g));
      }
    } catch (...) {
      // Release every sender's half anyway so no peer waits for this rank later.
      for (int p = 0; p < m.ranks_per_node; ++p) m.ll_gathered(p, lr).store(call, std::memory_order_release);
      throw;
    }
    auto* src_info = reinterpret_cast<int32_t*>(own + L.src_info);
    auto* range = reinterpret_cast<int64_t*>(own + L.layout_range);
    auto* count = reinterpret_cast<int32_t*>(own + L.recv_count);
    const int64_t packed_cols = ceil_div(L.scale_cols, 4);
    std::fill_n(count, local_E, 0);
    for (int s = 0; s < R; ++s) {
      std::vector<std::vector<int32_t>> chosen(static_cast<size_t>(local_E));
      if (!m.masked[static_cast<size_t>(s)]) {
        const Source src = source_view(m, in, s, half, L, row_bytes, sc_bytes);
        for (int64_t t = 0; t < src.tokens; ++t)
          for (int64_t j = 0; j < src.k; ++j) {
            const int64_t e = src.topk[t * src.k + j] - first_expert;
            if (e < 0 || e >= local_E) continue;
            auto& list = chosen[static_cast<size_t>(e)];
            if (list.empty() || list.back() != t) list.push_back(static_cast<int32_t>(t));  // once per (token, expert)
          }
        for (int64_t e = 0; e < local_E; ++e) {
          const auto& list = chosen[static_cast<size_t>(e)];
          for (size_t i = 0; i < list.size(); ++i) {
            const int64_t row = e * L.slots + count[e] + static_cast<int64_t>(i), t = list[i], from = src.row(t);
            detail::copy_stream(own + L.recv_x + static_cast<size_t>(row) * row_bytes, src.x + static_cast<size_t>(from) * row_bytes, row_bytes);
            if (fp8_mode == 1) {
              std::memcpy(own + L.recv_scales + static_cast<size_t>(row) * sc_bytes, src.scales + static_cast<size_t>(from) * sc_bytes, sc_bytes);
            } else if (fp8_mode == 2) {
              const auto* sf = reinterpret_cast<const float*>(src.scales + static_cast<size_t>(from) * sc_bytes);
              auto* packed = reinterpret_cast<int32_t*>(own + L.recv_scales) + row * packed_cols;
              for (int64_t c = 0; c < packed_cols; ++c) {
                uint32_t word = 0;
                for (int64_t b = 0; b < 4 && c * 4 + b < L.scale_cols; ++b)
                  word |= static_cast<uint32_t>(f32_to_ue8m0(sf[c * 4 + b])) << (8 * b);
                packed[c] = static_cast<int32_t>(word);
              }
            }
            src_info[row] = static_cast<int32_t>(t);
          }
        }
      }
      for (int64_t e = 0; e < local_E; ++e) {
        const auto n = static_cast<int64_t>(chosen[static_cast<size_t>(e)].size());
        range[e * R + s] = (static_cast<int64_t>(count[e]) << 32) | n;
        count[e] += static_cast<int32_t>(n);
      }
      if (!m.masked[static_cast<size_t>(s)] && m.on_node(s)) m.ll_gathered(m.local_of(s), lr).store(call, std::memory_order_release);
    }
    detail::stream_fence();  // the rows were streamed; whoever waits on this receive reads them
    std::copy_n(count, local_E, state->recv_count.begin());
    if (stats.defined())
      for (int64_t e = 0; e < local_E; ++e) stats.data_ptr<int32_t>()[e * stats.stride(0)] += count[e];
    state->received.store(true, std::memory_order_release);
  };
  schedule_receive(m, a.async_finish, a.return_recv_hook, std::move(receive), out);
  return out;
}

Tensor Buffer::get_next_low_latency_combine_buffer(const LowLatencyHandle& handle) {
  Impl& m = *impl_;
  constexpr const char* fn = "ep::Buffer::get_next_low_latency_combine_buffer";
  if (!m.available) fail(fn, "buffer", "a live buffer", "a destroyed buffer");
  if (!handle.defined()) fail(fn, "handle", "a handle from low_latency_dispatch", "an empty handle");
  const auto& st = *static_cast<const LLHandleState*>(handle.internal.get());
  if (st.buffer_id != m.id) fail(fn, "handle", "a handle from this buffer", "a handle from another buffer");
  const int half = static_cast<int>((m.ll_combines + 1) & 1);
  check_half_fits(m, fn, "handle", m.ll_dispatch_bytes[half], st.layout.combine_bytes());
  auto seg = m.peers[static_cast<size_t>(m.local_rank)].low_latency;
  char* base = seg->data() + static_cast<size_t>(half) * m.ll_half_stride() + combine_x_at(m, st.layout);
  return Tensor::from_blob_with_owner(base, {st.layout.local_experts, st.layout.slots, st.layout.hidden}, DType::bf16, seg);
}

LowLatencyCombineResult Buffer::low_latency_combine(const LowLatencyCombineArgs& a) {
  Impl& m = *impl_;
  // A dispatch whose receive has not run (a deferred hook not called, or a failed receive):
  // its counts and ranges are not in place yet. Refused before the call counts, without
  // ll_abandon: the call's metadata would overwrite what that receive has yet to read
  // (dispatch and combine share a half's). Peers that go on time out naming this rank.
  if (a.handle.defined()) {
    const auto& st = *static_cast<const LLHandleState*>(a.handle.internal.get());
    if (m.pending.valid()) m.pending.wait();  // (a receive on the worker thread finishes first)
    if (st.buffer_id == m.id && !st.received.load(std::memory_order_acquire))
      fail(kLLCombine, "handle", "a dispatch whose receive completed (call its hook first)",
           "a dispatch whose receive has not run, or failed");
  }
  return ll_call(m, kLLCombine, m.ll_combines, false, [&] { return low_latency_combine_checked(a); });
}

LowLatencyCombineResult Buffer::low_latency_combine_checked(const LowLatencyCombineArgs& a) {
  Impl& m = *impl_;
  const char* fn = kLLCombine;
  if (!a.handle.defined()) fail(fn, "handle", "a handle from low_latency_dispatch", "an empty handle");
  auto state = std::static_pointer_cast<const LLHandleState>(a.handle.internal);
  if (state->buffer_id != m.id) fail(fn, "handle", "a handle from this buffer", "a handle from another buffer");
  const LLLayout& L = state->layout;
  const int64_t T = state->tokens, H = L.hidden, local_E = L.local_experts;
  if (!a.x.defined() || a.x.dtype() != DType::bf16 || a.x.dim() != 3 || !a.x.device().is_cpu())
    fail(fn, "x", "bf16 [" + std::to_string(local_E) + ", " + std::to_string(L.slots) + ", " + std::to_string(H) + "] on cpu",
         a.x.defined() ? a.x.str() : "undefined");
  check_shape(fn, "x", a.x, {local_E, L.slots, H});
  if (a.x.stride(2) != 1) fail(fn, "x", "unit stride in the last dimension", shape_str(a.x.strides()));
  check_cpu_matrix(fn, "topk_idx", a.topk_idx, {DType::i64});
  check_shape(fn, "topk_idx", a.topk_idx, {T, state->topk});
  check_cpu_matrix(fn, "topk_weights", a.topk_weights, {DType::f32});
  check_shape(fn, "topk_weights", a.topk_weights, {T, state->topk});
  if (a.out.defined()) {
    check_cpu_matrix(fn, "out", a.out, {DType::bf16});
    check_shape(fn, "out", a.out, {T, H});
    // (peers may read x in place while this rank writes out; rows of out are written once each)
    moekit::detail::check_output_apart(fn, "out", a.out, {{"x", &a.x}, {"topk_idx", &a.topk_idx}, {"topk_weights", &a.topk_weights}});
  }
  if (a.async_finish && a.return_recv_hook) fail(fn, "async_finish", "not together with return_recv_hook", "both set");
  // (Dispatch checked its ids; these may be another tensor. Every id indexes per-expert state below.)
  const int64_t E = local_E * m.num_ranks;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < state->topk; ++j) {
      const int64_t e = a.topk_idx.data_ptr<int64_t>()[t * a.topk_idx.stride(0) + j];
      if (e < -1 || e >= E)
        fail(fn, "topk_idx[" + std::to_string(t) + ", " + std::to_string(j) + "]",
             "an expert id in [0, " + std::to_string(E) + ") or -1", std::to_string(e));
    }
  // A dispatch's results live until the second dispatch after it (its half is reused then):
  // an older handle's layout ranges are gone.
  if (m.ll_dispatches >= state->call + 2)
    fail(fn, "handle", "a low-latency result at most two dispatches old",
         "the result of dispatch " + std::to_string(state->call) + ", after dispatch " + std::to_string(m.ll_dispatches));
  auto seg = m.peers[static_cast<size_t>(m.local_rank)].low_latency;
  const size_t row_bytes = static_cast<size_t>(H) * 2;
  const auto xs_e = static_cast<size_t>(a.x.stride(0)) * 2, xs_r = static_cast<size_t>(a.x.stride(1)) * 2;
  const size_t span = static_cast<size_t>(local_E - 1) * xs_e + static_cast<size_t>(L.slots - 1) * xs_r + row_bytes;
  size_t heap_off = 0;
  const int heap_seg = m.heap->find(a.x.data(), span, heap_off);
  // (Refused before this call is counted: then the peers learn of it at once.)
  if (a.zero_copy && !seg->contains(a.x.data(), span) && heap_seg < 0)
    fail(fn, "x", "get_next_low_latency_combine_buffer(handle) with zero_copy", "a tensor outside the buffer");
  // In the low-latency segment, a zero-copy x must be this combine's buffer: one taken before
  // another combine is where that combine staged its rows (its contents are gone).
  if (a.zero_copy && seg->contains(a.x.data(), span)) {
    const char* next = seg->data() + static_cast<size_t>((m.ll_combines + 1) & 1) * m.ll_half_stride() + combine_x_at(m, L);
    if (a.x.data() != next)
      fail(fn, "x", "get_next_low_latency_combine_buffer(handle) taken since the last low-latency combine",
           "another place in the buffer (a combine buffer taken before another combine?)");
  }
  check_half_fits(m, fn, "handle", m.ll_dispatch_bytes[(m.ll_combines + 1) & 1], L.combine_bytes());

  const uint64_t call = ++m.ll_combines;
  const int half = static_cast<int>(call & 1), lr = m.local_rank;
  m.ll_combine_bytes[half] = L.combine_bytes();
  if (call > 2) m.wait_unmasked(fn, [&](int p) { return m.ll_read(lr, p).load(std::memory_order_acquire) >= call - 2; });
  char* own = seg->data() + static_cast<size_t>(half) * m.ll_half_stride();

  // Offer x: in place when it already is in shared memory, else its valid rows copied here.
  uint64_t* meta = m.ll_meta(lr, half);
  const bool own_rows_from_x = !a.return_recv_hook && !ll_async(m, a.async_finish);
  Tensor own_x;  // x in private memory, which the receive reads in place for this rank's own rows
  bool peers_read_x = false;  // private x that this node's owners read through cma
  if (seg->contains(a.x.data(), span)) {  // e.g. get_next_low_latency_combine_buffer
    meta[kLLXWhere] = 1;
    meta[kLLXOff] = static_cast<uint64_t>(static_cast<const char*>(a.x.data()) - seg->data());
    meta[kLLXStrideE] = xs_e;
    meta[kLLXStrideR] = xs_r;
  } else if (heap_seg >= 0) {  // e.g. Buffer::alloc_shared
    meta[kLLXWhere] = 2;
    meta[kLLXSeg] = static_cast<uint64_t>(heap_seg);
    meta[kLLXOff] = heap_off;
    meta[kLLXStrideE] = xs_e;
    meta[kLLXStrideR] = xs_r;
  } else {
    // This rank's own rows (its tokens' results from its own experts) are not copied when it
    // reads them before returning (no hook, not asynchronous): the receive takes them from x.
    // Then, where the node's ranks may read each other's memory, no row is copied: the owners
    // on this node read theirs from x too, before this call returns (its receive waits for
    // them), and other nodes get theirs in messages built from x.
    if (own_rows_from_x) own_x = a.x;
    peers_read_x = own_rows_from_x && m.cma;
    if (peers_read_x) {
      meta[kLLXWhere] = 3;
      meta[kLLXOff] = reinterpret_cast<uint64_t>(a.x.data());
      meta[kLLXStrideE] = xs_e;
      meta[kLLXStrideR] = xs_r;
    }
    const int64_t* own_range = own_rows_from_x ? layout_ranges(m, *state, lr) : nullptr;
    for (int64_t e = 0; e < (peers_read_x ? 0 : local_E); ++e) {
      const int64_t range = own_range ? own_range[e * m.num_ranks + m.rank] : 0;
      const int64_t skip_begin = range >> 32, skip_end = skip_begin + (range & 0xffffffff);
      for (int64_t r = 0; r < state->recv_count[static_cast<size_t>(e)]; ++r)
        if (r < skip_begin || r >= skip_end)
          detail::copy_stream(own + combine_x_at(m, L) + static_cast<size_t>(e * L.slots + r) * row_bytes,
                              static_cast<const char*>(a.x.data()) + static_cast<size_t>(e) * xs_e + static_cast<size_t>(r) * xs_r,
                              row_bytes);
    }
    if (!peers_read_x) {
      meta[kLLXWhere] = 1;
      meta[kLLXOff] = static_cast<uint64_t>(own + combine_x_at(m, L) - seg->data());
      meta[kLLXStrideE] = static_cast<uint64_t>(L.slots) * row_bytes;
      meta[kLLXStrideR] = row_bytes;
    }
  }
  meta[kLLCombineHidden] = static_cast<uint64_t>(H);
  meta[kLLDispatchCall] = state->call;
  meta[kLLCombineError] = 0;
  detail::stream_fence();
  m.ll_offered(lr).store(call, std::memory_order_release);
  // x read in place by this node's owners (peers_read_x) must outlive their reads, also when
  // this call fails after offering it: then wait for them (as long as the timeout allows)
  // before the error goes to the caller, who may free x.
  auto wait_for_readers = [&m, fn, call, lr] {
    try {
      m.wait_unmasked(fn, [&](int p) { return m.ll_read(lr, p).load(std::memory_order_acquire) >= call; });
    } catch (...) {
    }
  };
  if (m.num_nodes() > 1) {
    try {
      post_combine_messages(m, *state, a.x, call);
    } catch (...) {
      if (peers_read_x) wait_for_readers();
      throw;
    }
  }

  LowLatencyCombineResult out;
  out.combined_x = a.out.defined() ? a.out : Tensor::from_blob_with_owner(own + combine_out_at(m, L), {T, H}, DType::bf16, seg);
  Tensor result = out.combined_x, topk_idx = a.topk_idx, weights = a.topk_weights;
  auto receive = [&m, state, result, topk_idx, weights, fn, call, half, own_x, peers_read_x, wait_for_readers] {
    const int R = m.num_ranks, me = m.rank, lr = m.local_rank;
    const LLLayout& L = state->layout;
    const int64_t T = state->tokens, k = state->topk, H = L.hidden, local_E = L.local_experts;
    const size_t row_bytes = static_cast<size_t>(H) * 2;
    Inbox in(m, kTagLLCombine, call);
    auto release_readers = [&] {
      for (int p = 0; p < m.ranks_per_node; ++p) m.ll_read(p, lr).store(call, std::memory_order_release);
    };
    try {
      wait_sources(m, fn, [&](int p) { return m.ll_offered(p).load(std::memory_order_acquire) >= call; }, in);
      check_source_errors(m, fn, in, half, false);
      // Rows are found by this rank's layout in x shaped by each expert rank's handle: every
      // rank must combine the same dispatch's result (one of two live ones could be mixed),
      // checked before anything is read by that layout.
      for (int d = 0; d < R; ++d) {
        if (m.masked[static_cast<size_t>(d)]) continue;
        const uint64_t* dm = source_meta(m, in, d, half);
        if (dm[kLLDispatchCall] != state->call)
          fail(fn, "handle", "the same dispatch's result on every rank (dispatch " + std::to_string(state->call) + " here)",
               "dispatch " + std::to_string(dm[kLLDispatchCall]) + "'s on rank " + std::to_string(d));
        if (dm[kLLCombineHidden] != static_cast<uint64_t>(H))
          fail(fn, "x", "the same hidden size on every rank", std::to_string(dm[kLLCombineHidden]) + " on rank " + std::to_string(d));
      }
      // Where each expert rank's rows are: same node, its offer (and, below, where this rank's
      // rows begin in each expert, from its layout_range); other node, its message, which holds
      // this rank's rows expert by expert.
      std::vector<const char*> base(static_cast<size_t>(R), nullptr);
      std::vector<uint64_t> remote(static_cast<size_t>(R), 0);  // x's address in rank d (kLLXWhere 3)
      bool any_remote = false;
      std::vector<size_t> stride_e(static_cast<size_t>(R)), stride_r(static_cast<size_t>(R));
      const std::vector<int64_t> first_row = message_rows(m, in, topk_idx, T, k, local_E, row_bytes);
      for (int d = 0; d < R; ++d) {
        if (m.masked[static_cast<size_t>(d)]) continue;
        const uint64_t* dm = source_meta(m, in, d, half);
        if (!m.on_node(d)) {
          base[static_cast<size_t>(d)] = in.data(d) + LLMessage(0, 0, 0, 0, 0).x;
          continue;
        }
        const auto& peer = m.peers[static_cast<size_t>(m.local_of(d))];
        if (dm[kLLXWhere] == 3) {  // private: read through cma, a block at a time (below); own rows from own_x
          if (d != me) remote[static_cast<size_t>(d)] = dm[kLLXOff];
        } else {
          base[static_cast<size_t>(d)] = dm[kLLXWhere] == 2 ? peer.segments[static_cast<size_t>(dm[kLLXSeg])]->data() + dm[kLLXOff]
                                                              : peer.low_latency->data() + dm[kLLXOff];
        }
        stride_e[static_cast<size_t>(d)] = dm[kLLXStrideE];
        stride_r[static_cast<size_t>(d)] = dm[kLLXStrideR];
      }
      for (int d = 0; d < R; ++d) any_remote = any_remote || remote[static_cast<size_t>(d)] != 0;
      if (own_x.defined() && !m.masked[static_cast<size_t>(me)]) {
        base[static_cast<size_t>(me)] = static_cast<const char*>(own_x.data());
        stride_e[static_cast<size_t>(me)] = static_cast<size_t>(own_x.stride(0)) * 2;
        stride_r[static_cast<size_t>(me)] = static_cast<size_t>(own_x.stride(1)) * 2;
      }
      std::vector<int32_t> seen(static_cast<size_t>(local_E * R), 0);  // this rank's rows per expert so far
      // Rows of ranks whose x is read through cma: their addresses there and the pointer
      // each one's copy fills in, per block of tokens.
      struct Pending {
        int d;
        uint64_t from;
        const uint16_t** to;
      };
      std::vector<Pending> pending;
      // Token t's rows and weights, in top-k order; tokens must come in order (seen counts).
      auto gather = [&](int64_t t, std::vector<const uint16_t*>& rows, std::vector<float>& w) {
        int n = 0;
        for (int64_t j = 0; j < k; ++j) {
          const int64_t e = topk_idx.data_ptr<int64_t>()[t * topk_idx.stride(0) + j];
          if (e < 0 || is_repeat(topk_idx, t, j)) continue;  // a repeated expert was sent (and counts) once
          const int d = static_cast<int>(e / local_E);
          const int64_t el = e % local_E;
          const int32_t index = seen[static_cast<size_t>(e)]++;
          if (m.masked[static_cast<size_t>(d)]) continue;
          const char* row = nullptr;
          if (m.on_node(d)) {
            // begin of this rank's rows inside expert el on rank d: from d's layout_range.
            const int64_t range = layout_ranges(m, *state, m.local_of(d))[el * R + me];
            const int64_t begin = range >> 32;
            // A result this old may have been overwritten (more than two live): refuse, never read out of bounds.
            if (index >= (range & 0xffffffff) || begin + index >= L.slots)
              fail(fn, "handle",
                   "a low-latency result at most two dispatches old, laid out alike on every rank (ranks that mask "
                   "different ranks do not receive the same tokens)",
                   "rank " + std::to_string(d) + "'s layout for expert " + std::to_string(e) + " does not match");
            const size_t at = static_cast<size_t>(el) * stride_e[static_cast<size_t>(d)] +
                              static_cast<size_t>(begin + index) * stride_r[static_cast<size_t>(d)];
            if (remote[static_cast<size_t>(d)] != 0) pending.push_back({d, remote[static_cast<size_t>(d)] + at, &rows[static_cast<size_t>(n)]});
            else row = base[static_cast<size_t>(d)] + at;
          } else {
            row = base[static_cast<size_t>(d)] + static_cast<size_t>(first_row[static_cast<size_t>(e)] + index) * row_bytes;
          }
          rows[static_cast<size_t>(n)] = reinterpret_cast<const uint16_t*>(row);
          w[static_cast<size_t>(n)] = weights.data_ptr<float>()[t * weights.stride(0) + j];
          ++n;
        }
        return n;
      };
      // Tokens a block at a time: every token's rows gathered, the block's rows of private x
      // read through cma into a scratch that stays in L2 (one call per rank), then summed,
      // each token's successor's rows requested meanwhile (as in the normal combine). Without
      // such ranks, one block of all tokens.
      const int64_t block = any_remote ? std::max<int64_t>(1, kLLPullBytes / std::max<int64_t>(1, k * static_cast<int64_t>(row_bytes)))
                                       : std::max<int64_t>(T, 1);
      const int64_t block_cap = std::min(block, std::max<int64_t>(T, 1));
      std::vector<std::vector<const uint16_t*>> rows(static_cast<size_t>(block_cap), std::vector<const uint16_t*>(static_cast<size_t>(k)));
      std::vector<std::vector<float>> w(static_cast<size_t>(block_cap), std::vector<float>(static_cast<size_t>(k)));
      std::vector<int> n(static_cast<size_t>(block_cap));
      static thread_local std::vector<char> scratch;
      std::vector<uint64_t> from;
      for (int64_t b0 = 0; b0 < T; b0 += block) {
        const int64_t count = std::min(block, T - b0);
        pending.clear();
        for (int64_t i = 0; i < count; ++i)
          n[static_cast<size_t>(i)] = gather(b0 + i, rows[static_cast<size_t>(i)], w[static_cast<size_t>(i)]);
        if (scratch.size() < pending.size() * row_bytes) scratch.resize(pending.size() * row_bytes);
        size_t slot = 0;
        for (int d = 0; d < R && !pending.empty(); ++d) {
          from.clear();
          const size_t first = slot;
          for (const Pending& p : pending)
            if (p.d == d) *p.to = reinterpret_cast<const uint16_t*>(scratch.data() + slot++ * row_bytes), from.push_back(p.from);
          if (!from.empty() && !read_peer_rows_at(m.peer_pids[static_cast<size_t>(m.local_of(d))], from.data(),
                                                   static_cast<int64_t>(from.size()), row_bytes, scratch.data() + first * row_bytes)) {
            const int error = errno;
            fail(fn, "x", "rank " + std::to_string(d) + "'s x readable through process_vm_readv", std::strerror(error));
          }
        }
        for (int64_t i = 0; i < count; ++i) {
          const size_t c = static_cast<size_t>(i), nc = c + 1;
          const bool has_next = i + 1 < count;
          detail::reduce_weighted_rows_bf16(result.data_ptr<uint16_t>() + (b0 + i) * result.stride(0), rows[c].data(), w[c].data(),
                                            n[c], H, detail::RowsAhead{has_next ? rows[nc].data() : nullptr, has_next ? n[nc] : 0});
        }
      }
    } catch (...) {
      // Whatever went wrong here, no expert rank may wait for this one to finish reading,
      // and this rank's x, if read in place, must outlive the owners' reads.
      release_readers();
      if (peers_read_x) wait_for_readers();
      throw;
    }
    release_readers();
    // x offered in place stays untouched until every owner on this node has read it.
    m.wait_unmasked(fn, [&](int p) { return m.ll_read(lr, p).load(std::memory_order_acquire) >= call; });
  };
  schedule_receive(m, a.async_finish, a.return_recv_hook, std::move(receive), out);
  return out;
}

}  // namespace moekit::ep

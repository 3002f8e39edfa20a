// Internals of ep::Buffer shared by its translation units (buffer.cpp: construction and
// control; intranode.cpp: dispatch and combine). See buffer.cpp for the protocol.
#pragma once

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <future>
#include <map>
#include <mutex>
#include <numeric>
#include <sstream>
#include <thread>

#include <immintrin.h>

#include "core/check.h"
#include "cpu/formats/format_kernels.h"
#include "ep/copy.h"
#include "ep/layout.h"
#include "ep/read_choice.h"
#include "ep/shm.h"
#include "moekit/ep.h"
#include "moekit/runtime.h"

namespace moekit::ep {

using detail::Mapping;
using moekit::detail::fail;

namespace detail {

inline std::string join(const std::vector<int>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s;
}

inline std::string seconds_str(double s) {
  std::ostringstream o;
  o << s;
  return o.str();
}

constexpr size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

inline double env_double(const char* name, double fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const double d = std::strtod(v, &end);
  if (*end != '\0' || !(d > 0) || !std::isfinite(d)) fail("ep::Buffer", name, "a positive finite number", v);
  return d;
}

inline int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long d = std::strtol(v, &end, 10);
  if (*end != '\0' || d < 1 || d > 1 << 20) fail("ep::Buffer", name, "a positive integer", v);
  return static_cast<int>(d);
}

inline bool env_flag(const char* name, bool fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  if (std::strcmp(v, "0") != 0 && std::strcmp(v, "1") != 0) fail("ep::Buffer", name, "0 or 1", v);
  return v[0] == '1';
}

// ---- the per-rank heap of shared data segments ----

class Heap {
 public:
  explicit Heap(std::string prefix) : prefix_(std::move(prefix)) {}

  // Returns the segment index; the mapping is created (and touched) here.
  int add_segment(size_t bytes) {
    std::lock_guard lock(mu_);
    const int index = static_cast<int>(segments_.size());
    Segment s;
    s.map = Mapping::create(prefix_ + "-s" + std::to_string(index), bytes, true);
    s.free[0] = bytes;
    segments_.push_back(std::move(s));
    return index;
  }

  bool try_alloc(size_t bytes, int& seg, size_t& off) {
    std::lock_guard lock(mu_);
    for (size_t i = 0; i < segments_.size(); ++i) {
      auto& free = segments_[i].free;
      for (auto it = free.begin(); it != free.end(); ++it) {
        if (it->second < bytes) continue;
        seg = static_cast<int>(i);
        off = it->first;
        const size_t rest = it->second - bytes;
        free.erase(it);
        if (rest) free[off + bytes] = rest;
        return true;
      }
    }
    return false;
  }

  void release(int seg, size_t off, size_t bytes) {
    std::lock_guard lock(mu_);
    auto& free = segments_[static_cast<size_t>(seg)].free;
    auto next = free.lower_bound(off);
    if (next != free.end() && off + bytes == next->first) {
      bytes += next->second;
      next = free.erase(next);
    }
    if (next != free.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == off) {
        prev->second += bytes;
        return;
      }
    }
    free[off] = bytes;
  }

  std::shared_ptr<Mapping> segment(int i) {
    std::lock_guard lock(mu_);
    return segments_[static_cast<size_t>(i)].map;
  }
  int num_segments() {
    std::lock_guard lock(mu_);
    return static_cast<int>(segments_.size());
  }
  // Which segment holds [p, p + n), or -1.
  int find(const void* p, size_t n, size_t& off) {
    std::lock_guard lock(mu_);
    for (size_t i = 0; i < segments_.size(); ++i)
      if (segments_[i].map->contains(p, n)) {
        off = static_cast<size_t>(static_cast<const char*>(p) - segments_[i].map->data());
        return static_cast<int>(i);
      }
    return -1;
  }

 private:
  struct Segment {
    std::shared_ptr<Mapping> map;
    std::map<size_t, size_t> free;  // offset -> bytes
  };
  std::mutex mu_;
  std::string prefix_;
  std::vector<Segment> segments_;
};

// One allocation in a heap; returned tensors hold it (through shared_ptr) so the memory is
// reused only after the caller dropped every tensor in it.
struct Block {
  std::shared_ptr<Heap> heap;
  std::shared_ptr<Mapping> map;  // keeps the pages mapped even after Buffer::destroy
  int seg = 0;
  size_t off = 0, bytes = 0;
  char* data() const { return map->data() + off; }
  ~Block() { heap->release(seg, off, bytes); }
};

// Where the tensors of one received block sit (same arithmetic on sender and receiver).
struct RecvLayout {
  size_t x = 0, scales = 0, topk_idx = 0, topk_weights = 0, src_idx = 0, bytes = 0;
  RecvLayout(int64_t rows, size_t row_bytes, int64_t scale_cols, int64_t topk) {
    const size_t r = static_cast<size_t>(rows);
    size_t at = align_up(r * row_bytes, 64);
    scales = at, at = align_up(at + r * static_cast<size_t>(scale_cols) * 4, 64);
    topk_idx = at, at = align_up(at + r * static_cast<size_t>(topk) * 8, 64);
    topk_weights = at, at = align_up(at + r * static_cast<size_t>(topk) * 4, 64);
    src_idx = at, at = align_up(at + r * 4, 64);
    bytes = std::max<size_t>(at, 64);
  }
};

// Memory for one MPI message: grows, never shrinks, and is not zero-filled (unlike a vector).
class MessageBuffer {
 public:
  void resize(size_t bytes) {
    if (bytes > capacity_) {
      data_.reset(new char[bytes]);
      capacity_ = bytes;
    }
    size_ = bytes;
  }
  char* data() { return data_.get(); }
  const char* data() const { return data_.get(); }
  size_t size() const { return size_; }

 private:
  std::unique_ptr<char[]> data_;
  size_t capacity_ = 0, size_ = 0;
};

// ---- metadata published in the control segment ----
enum Meta : int {
  kError,      // 1 when the rank abandoned the operation (bad arguments)
  kHidden,
  kDtype,
  kTopk,
  kExperts,
  kTokens,
  kWorst,
  kSeg,        // where peers write (dispatch: receive block; combine: staging)
  kOff,
  kNumSegs,    // this rank's heap segment count (peers map new ones)
  kInPlace,    // combine: x offered in place
  kXSeg,
  kXOff,
  kXStride,
  kXAddr,      // combine: x's address in this process (read by owners through cma)
  kLayout,     // combine: a hash of the handle's counts (every rank must combine the same dispatch)
  kLastCost,   // combine: this rank's cost of its previous probed combine (CombineReadChoice), f64 bits
  kMetaCount = 17,
};

constexpr uint64_t kPhaseCounts = 1, kPhaseAlloc = 2, kPhaseData = 3, kPhaseRead = 4;

struct HandleState {
  uint64_t buffer_id = 0;
  int num_ranks = 0, rank = 0;
  int64_t tokens = 0, rows = 0;        // rows = allocated receive rows (worst case or exact)
  uint64_t dispatch_op = 0;            // the buffer's op number of the dispatch: equal on every rank
  // Private copies: the handle's public tensors are for inspection, and a caller that writes
  // into them must not steer a later combine or cached dispatch out of bounds.
  Tensor send_head;                    // i32 [T, R]
  Tensor is_token_in_rank;             // bool [T, R], contiguous, every byte 0 or 1
  std::vector<int64_t> counts;         // [s * R + d]: tokens rank s sends to rank d
  std::vector<std::vector<int32_t>> send_tokens;  // per destination, ascending
  int64_t count(int s, int d) const { return counts[static_cast<size_t>(s * num_ranks + d)]; }
  int64_t recv_before(int s, int d) const {  // rows of d's block that precede source s
    int64_t n = 0;
    for (int q = 0; q < s; ++q) n += count(q, d);
    return n;
  }
  int64_t recv_total(int d) const { return recv_before(num_ranks, d); }

  // Several nodes only. Rows this rank forwards within its node for the sources that share
  // its local index on other nodes (ascending source), and its own tokens per remote node.
  struct Carried {
    int source = 0;
    std::vector<int32_t> token;  // source token index per row, ascending
    std::vector<uint32_t> mask;  // bit d: the row goes to local rank d of this node
  };
  int num_nodes = 1, ranks_per_node = 0;
  std::vector<Carried> carried;
  std::vector<std::vector<int32_t>> node_tokens;  // per node (own node: empty)
  std::vector<int32_t> node_pos;                  // [t * N + n]: index of t in node_tokens[n] or -1
};

// FNV-1a over a handle's dispatch op number and token counts (source x destination): equal
// on every rank for the same dispatch. Combine compares it across ranks: handles of
// different dispatches would make the expert ranks write rows at offsets the owners did not
// lay out. The counts alone are not enough: two dispatches may send as many tokens between
// every pair of ranks but different ones (and, across nodes, carry different rows).
inline uint64_t layout_hash(const HandleState& hs) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) h = (h ^ ((v >> (8 * i)) & 0xff)) * 1099511628211ull;
  };
  mix(hs.dispatch_op);
  for (int64_t c : hs.counts) mix(static_cast<uint64_t>(c));
  return h;
}


}  // namespace detail
using namespace detail;

// ---- the implementation ----

struct EventOverlap::State {
  std::shared_future<void> done;
};

// Any MPI call after MPI_Finalize aborts the process, and MPI_Initialized stays true then:
// a buffer made, used or destroyed that late raises this instead.
inline void check_mpi_not_finalized(const char* fn) {
  int finalized = 0;
  MPI_Finalized(&finalized);  // (callable at any time)
  if (finalized) fail(fn, "MPI", "a call before MPI_Finalize", "MPI already finalized");
}

struct Buffer::Impl {
  MPI_Comm comm = MPI_COMM_NULL, node_comm = MPI_COMM_NULL;
  int rank = 0, num_ranks = 1, local_rank = 0, ranks_per_node = 1;
  double timeout = 100;
  uint64_t id = 0;
  MPI_Comm rail_comm = MPI_COMM_NULL;  // the ranks with this local index, one per node
  int num_nodes() const { return num_ranks / ranks_per_node; }
  int64_t num_nvl_bytes = 0;
  bool available = true;
  // False once destroyed: shared with receive hooks, which may outlive the buffer.
  std::shared_ptr<std::atomic<bool>> live = std::make_shared<std::atomic<bool>>(true);
  mutable std::atomic<bool> broken{false};  // (set by const waits: wait_ready, wait_done)
  uint64_t op = 0;
  std::shared_future<void> pending;

  std::shared_ptr<Heap> heap;
  std::shared_ptr<Mapping> own_ctrl;
  struct Peer {
    std::shared_ptr<Mapping> ctrl;
    std::shared_ptr<Mapping> low_latency;  // num_rdma_bytes: two halves
    std::vector<std::shared_ptr<Mapping>> segments;
  };
  std::vector<Peer> peers;  // by local rank; peers[local_rank] maps this rank's own memory
  std::string prefix;
  std::vector<int> unlink_after_op;  // own segments created during the current op
  int64_t num_rdma_bytes = 0;
  uint64_t ll_dispatches = 0, ll_combines = 0;
  // The two low-latency halves sit at fixed offsets (0 and this), whatever each call's shapes,
  // so a call with a larger hidden size never spills into the other half's live result.
  size_t ll_half_stride() const { return static_cast<size_t>(num_rdma_bytes / 2) / 4096 * 4096; }
  // Within a half, a dispatch lays out its regions from the start and a combine its own (x
  // staged, combined_x) from the end, each by its call's shapes; so that two live results of
  // different shapes never overlap, each half remembers the bytes its last dispatch and its
  // last combine took (low_latency.cpp).
  size_t ll_dispatch_bytes[2] = {0, 0}, ll_combine_bytes[2] = {0, 0};
  std::vector<int> masked;  // by rank, this rank's view
  // Whether every rank may read its node peers' private memory (process_vm_readv; probed at
  // construction, the same answer on every rank; MOEKIT_EP_CMA=0 turns it off), and their
  // process ids by local rank.
  bool cma = false;
  std::vector<pid_t> peer_pids;
  CombineReadChoice combine_reads;

  // Like wait_all, but masked ranks count as answered. Across nodes it keeps this rank's
  // low-latency messages moving while it waits: MPI moves a large (rendezvous) message only
  // while its sender is inside MPI, and the peer this rank waits for may itself be waiting
  // for that message.
  template <class Pred>
  void wait_unmasked(const char* fn, Pred&& pred) {
    const bool remote = num_nodes() > 1;
    wait_all(fn, [&](int p) { return masked[static_cast<size_t>(global(p))] != 0 || pred(p); },
             [&] {
               if (remote) sweep_in_flight();
             });
  }

  // Low-latency messages to and from other nodes. Sends complete in the background (their
  // memory is kept until MPI_Test says done: swept at every wait); so do receives a failed
  // call left behind. Finished buffers are reused, so no call pays fresh page faults.
  struct InFlight {
    MPI_Request req = MPI_REQUEST_NULL;
    std::unique_ptr<MessageBuffer> data;
  };
  std::mutex ll_mu;
  std::vector<InFlight> ll_in_flight;
  std::vector<std::unique_ptr<MessageBuffer>> ll_spare;
  void sweep_in_flight() {
    std::lock_guard lock(ll_mu);
    for (size_t i = 0; i < ll_in_flight.size();) {
      int done = 0;
      MPI_Test(&ll_in_flight[i].req, &done, MPI_STATUS_IGNORE);
      if (!done) {
        ++i;
        continue;
      }
      ll_spare.push_back(std::move(ll_in_flight[i].data));
      ll_in_flight[i] = std::move(ll_in_flight.back());
      ll_in_flight.pop_back();
    }
  }
  void keep_in_flight(MPI_Request req, std::unique_ptr<MessageBuffer> data) {
    std::lock_guard lock(ll_mu);
    ll_in_flight.push_back({req, std::move(data)});
  }
  std::unique_ptr<MessageBuffer> message_buffer(size_t bytes) {
    std::unique_ptr<MessageBuffer> b;
    {
      std::lock_guard lock(ll_mu);
      if (!ll_spare.empty()) {
        b = std::move(ll_spare.back());
        ll_spare.pop_back();
      }
    }
    if (!b) b = std::make_unique<MessageBuffer>();
    b->resize(bytes);
    return b;
  }
  void recycle(std::unique_ptr<MessageBuffer> b) {
    if (!b) return;
    std::lock_guard lock(ll_mu);
    ll_spare.push_back(std::move(b));
  }

  // Control segment layout.
  size_t pub_bytes = 0, counts_rank_at = 0, counts_expert_at = 0, ctrl_bytes = 0, ll_at = 0, pub_at = 0;

  // Control segment: [ready][done x R][low-latency flags and metadata][publication x 2].
  void layout_ctrl() {
    const size_t r = static_cast<size_t>(num_ranks);
    counts_rank_at = kMetaCount * 8;
    counts_expert_at = align_up(counts_rank_at + r * 4, 64);
    pub_bytes = align_up(counts_expert_at + detail::kMaxExperts * 4, 64);
    ll_at = 64 + r * 64;
    pub_at = align_up(ll_at + 128 + 2 * r * 64 + 2 * kMetaCount * 8, 64);
    ctrl_bytes = pub_at + 2 * pub_bytes;
  }
  std::atomic_ref<uint64_t> flag_at(int p, size_t off) const {
    return std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(peers[static_cast<size_t>(p)].ctrl->data() + off));
  }
  std::atomic_ref<uint64_t> ready(int p) const { return flag_at(p, 0); }
  // Set once rank p has come to destroy the buffer (so that a timeout there names the
  // ranks of this node that have not).
  std::atomic_ref<uint64_t> destroying(int p) const { return flag_at(p, 8); }
  // The flag rank s sets in rank p's control segment.
  std::atomic_ref<uint64_t> done(int p, int s) const { return flag_at(p, 64 + 64 * static_cast<size_t>(s)); }
  char* pub(int p) const { return peers[static_cast<size_t>(p)].ctrl->data() + pub_at + (op & 1) * pub_bytes; }

  // Low-latency flags (values are call numbers, starting at 1).
  std::atomic_ref<uint64_t> ll_sent(int p) const { return flag_at(p, ll_at); }          // send half ready
  std::atomic_ref<uint64_t> ll_offered(int p) const { return flag_at(p, ll_at + 64); }  // combine x ready
  // Set by receiver s in rank p's segment: s has gathered p's dispatch / read p's combine rows.
  std::atomic_ref<uint64_t> ll_gathered(int p, int s) const {
    return flag_at(p, ll_at + 128 + 64 * static_cast<size_t>(s));
  }
  std::atomic_ref<uint64_t> ll_read(int p, int s) const {
    return flag_at(p, ll_at + 128 + 64 * static_cast<size_t>(num_ranks + s));
  }
  uint64_t* ll_meta(int p, int half) const {
    return reinterpret_cast<uint64_t*>(peers[static_cast<size_t>(p)].ctrl->data() + ll_at + 128 +
                                       128 * static_cast<size_t>(num_ranks) + static_cast<size_t>(half) * kMetaCount * 8);
  }
  uint64_t* meta(int p) const { return reinterpret_cast<uint64_t*>(pub(p)); }
  int32_t* counts_rank(int p) const { return reinterpret_cast<int32_t*>(pub(p) + counts_rank_at); }
  int32_t* counts_expert(int p) const { return reinterpret_cast<int32_t*>(pub(p) + counts_expert_at); }
  uint64_t flag(uint64_t phase) const { return op * 8 + phase; }

  // The ranks of this node, by local index (peers[], flags); global rank = node_base + local.
  int node_base() const { return rank - local_rank; }
  int global(int local) const { return node_base() + local; }
  bool on_node(int g) const { return g / ranks_per_node == rank / ranks_per_node; }
  int local_of(int g) const { return g - node_base(); }  // for ranks on this node only

  // Spins, then yields, then sleeps (ranks may outnumber cores), until pred(p) holds for
  // every local rank p of this node; TimeoutError naming the others (global ranks) after
  // `timeout` seconds.
  // progress() runs once per unsuccessful round.
  template <class Pred, class Progress = void (*)()>
  void wait_all(const char* fn, Pred&& pred, Progress&& progress = [] {}) const {
    const auto start = std::chrono::steady_clock::now();
    for (uint64_t iter = 0;; ++iter) {
      bool all = true;
      for (int p = 0; p < ranks_per_node && all; ++p) all = pred(p);
      if (all) return;
      progress();
      if (iter < 1024) {
        _mm_pause();
        continue;
      }
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (waited > timeout) {
        std::vector<int> silent;
        for (int p = 0; p < ranks_per_node; ++p)
          if (!pred(p)) silent.push_back(global(p));
        if (silent.empty()) return;
        throw TimeoutError(fn, silent, timeout);
      }
      if (waited < 0.01) {
        sched_yield();
      } else {
        ::usleep(50);
      }
    }
  }
  // The normal ops' rounds. A timeout there leaves this rank's op count ahead of its silent
  // peers', so the buffer takes no further normal op (begin_op: "destroy it"), whichever
  // thread waited. (Low-latency ops have their own flags and go on with masked ranks.)
  void wait_ready(const char* fn, uint64_t phase) const {
    const uint64_t v = flag(phase);
    breaking_on_timeout([&] { wait_all(fn, [&](int p) { return ready(p).load(std::memory_order_acquire) >= v; }); });
  }
  void wait_done(const char* fn, uint64_t phase) const {
    const uint64_t v = flag(phase);
    breaking_on_timeout([&] { wait_all(fn, [&](int s) { return done(local_rank, s).load(std::memory_order_acquire) >= v; }); });
  }
  template <class Wait>
  void breaking_on_timeout(Wait&& wait) const {
    try {
      wait();
    } catch (const TimeoutError&) {
      broken.store(true);
      throw;
    }
  }
  void publish(uint64_t phase) { ready(local_rank).store(flag(phase), std::memory_order_release); }
  void signal_all(uint64_t phase) {
    stream_fence();  // non-temporal stores must be visible before the flag
    for (int p = 0; p < ranks_per_node; ++p) done(p, local_rank).store(flag(phase), std::memory_order_release);
  }
  static void stream_fence() { detail::stream_fence(); }

  // After a round: any rank that abandoned the op makes every rank raise the same Error.
  void check_peer_errors(const char* fn) const {
    for (int p = 0; p < ranks_per_node; ++p)
      if (meta(p)[kError] != 0 && p != local_rank)
        fail(fn, "rank " + std::to_string(global(p)), "valid arguments on every rank",
             "rank " + std::to_string(global(p)) + " rejected its arguments (see its error)");
  }

  void begin_op(const char* fn) {
    if (!available) fail(fn, "buffer", "a live buffer", "a destroyed buffer");
    check_mpi_not_finalized(fn);
    if (pending.valid()) {
      try {
        pending.wait();
      } catch (...) {
      }
      pending = {};
    }
    if (broken.load()) fail(fn, "buffer", "a buffer whose earlier operation completed", "a buffer that timed out; destroy it");
    ++op;
    unlink_after_op.clear();
    std::memset(meta(local_rank), 0, kMetaCount * 8);
  }
  // Publishes "this rank gives up" for the current round so no peer waits for it.
  void abandon() {
    meta(local_rank)[kError] = 1;
    publish(kPhaseRead);  // past every round of this op
    signal_all(kPhaseRead);  // releases peers waiting on data from this rank
  }

  char* peer_data(int p, uint64_t seg, uint64_t off) {
    Peer& peer = peers[static_cast<size_t>(p)];
    return peer.segments[static_cast<size_t>(seg)]->data() + off;
  }
  // Maps every segment rank p has announced (every rank maps them in the same op as they
  // appear, so their creator may remove the names once every peer has signalled).
  void map_new_segments(int p) {
    Peer& peer = peers[static_cast<size_t>(p)];
    const uint64_t n = meta(p)[kNumSegs];
    while (peer.segments.size() < n) {
      const size_t i = peer.segments.size();
      if (p == local_rank) {
        peer.segments.push_back(heap->segment(static_cast<int>(i)));
      } else {
        const std::string name = prefix + "-r" + std::to_string(p) + "-s" + std::to_string(i);
        peer.segments.push_back(Mapping::open(name));
      }
    }
  }

  // A block of this rank's heap. Only before the op publishes kNumSegs: a segment the heap
  // grows by must be announced (and mapped by every peer) in the op that created it.
  std::shared_ptr<Block> allocate(size_t bytes) {
    bytes = align_up(std::max<size_t>(bytes, 64), 4096);
    int seg = 0;
    size_t off = 0;
    if (!heap->try_alloc(bytes, seg, off)) {
      const size_t largest = heap->segment(heap->num_segments() - 1)->size();
      const int fresh = heap->add_segment(align_up(std::max(bytes, largest), 2 << 20));
      unlink_after_op.push_back(fresh);
      if (!heap->try_alloc(bytes, seg, off)) fail("ep::Buffer", "allocation", "room in a fresh segment", std::to_string(bytes));
    }
    auto block = std::make_shared<Block>();
    block->heap = heap;
    block->map = heap->segment(seg);
    block->seg = seg;
    block->off = off;
    block->bytes = bytes;
    return block;
  }
  void finish_op_segments() {
    for (int s : unlink_after_op) heap->segment(s)->unlink();
    unlink_after_op.clear();
  }

  int copy_threads(const std::optional<Config>& config) const {
    const int want = config ? config->num_sms : Buffer::get_dispatch_config(ranks_per_node).num_sms;
    return std::clamp(std::min(want, num_threads()), 1, 256);
  }

  EventOverlap run(bool async, std::function<void()> task) {
    auto guarded = [this, task = std::move(task)] {
      try {
        task();
      } catch (const TimeoutError&) {
        broken.store(true);
        throw;
      }
    };
    if (!async) {
      guarded();
      return {};
    }
    pending = std::async(std::launch::async, std::move(guarded)).share();
    auto state = std::make_shared<EventOverlap::State>();
    state->done = pending;
    return EventOverlap(std::move(state));
  }

  // Async work that calls MPI needs MPI_THREAD_MULTIPLE; otherwise it completes in the call.
  static bool can_run_mpi_async() {
    int provided = MPI_THREAD_SINGLE;
    MPI_Query_thread(&provided);
    return provided >= MPI_THREAD_MULTIPLE;
  }

  // MPI waits never block forever either. A nonblocking collective cannot be cancelled or
  // freed: on a timeout it stays pending, so the memory it writes (`keep`) stays allocated
  // and the communicators stay alive (destroy() does not free them: OpenMPI progresses a
  // pending collective of a freed communicator into a segfault), and the buffer is broken.
  void mpi_wait(MPI_Request& req, const char* what, std::shared_ptr<void> keep = nullptr) {
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      int flag = 0;
      MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
      if (flag) return;
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (waited > timeout) {
        collective_pending = true;
        if (keep) keep_until_exit(std::move(keep));
        broken.store(true);
        fail(what, "communicator", "every rank to join within " + seconds_str(timeout) + " s",
             "a rank that did not join (MPI request still pending)");
      }
      ::usleep(100);
    }
  }
  bool collective_pending = false;  // a timed-out collective MPI may still progress
  // Memory such a collective may still write: kept for the process's life (past the buffer's).
  static void keep_until_exit(std::shared_ptr<void> memory) {
    static std::mutex mu;
    static std::vector<std::shared_ptr<void>> kept;
    std::lock_guard lock(mu);
    kept.push_back(std::move(memory));
  }
};

}  // namespace moekit::ep

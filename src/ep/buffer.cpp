// ep::Buffer: normal dispatch/combine between the ranks of one node through shared memory.
//
// Every rank owns a small control segment (flags and published metadata) and a heap of data
// segments; every rank maps every peer's segments. A collective operation is a few
// publish-then-wait rounds on the control flags, with the bulk data written by the sender
// straight into the receiver's heap:
//   dispatch  1. publish shapes and counts      -> everyone knows every receiver's row count
//             2. receiver allocates its block    -> publishes where it is
//             3. senders copy rows, signal done  -> receiver waits for every sender
//   combine   1. token owner allocates staging (or the expert rank offers x in place)
//             2. expert ranks copy their rows back, signal done; owner reduces in f32
//             3. owner signals it has finished reading (x offered in place may be released)
// Flags only grow (op * 8 + phase), so a slow reader can never see a stale value as new.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <limits>

#include "ep/buffer_impl.h"
#include "ep/cma.h"

namespace moekit::ep {

namespace {
std::atomic<uint64_t> g_next_buffer_id{1};

// What the ranks agreed on after each checked a step on its own: the lowest rank that failed
// (-1: none), and that rank's argument and message.
struct Agreement {
  int failed_rank = -1;
  std::string argument, message;
};

// Collective over comm: one MPI_Allreduce of "the lowest failing rank" and, only when some
// rank failed, one MPI_Bcast of its argument and message. Every rank gets the same answer,
// so either all go on or all raise (raise_agreed): a rank that fails a check alone can never
// leave its peers waiting in a later collective.
Agreement agree(MPI_Comm comm, const std::exception_ptr& mine) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  const int failed = mine ? rank : std::numeric_limits<int>::max();
  int lowest = failed;
  MPI_Allreduce(&failed, &lowest, 1, MPI_INT, MPI_MIN, comm);
  Agreement a;
  if (lowest == std::numeric_limits<int>::max()) return a;
  a.failed_rank = lowest;
  constexpr size_t kArg = 128, kText = 1024;  // (truncated past these)
  char text[kText] = {};
  if (rank == lowest) {
    std::string argument = "arguments", message;
    try {
      std::rethrow_exception(mine);
    } catch (const Error& e) {
      argument = e.argument();
      message = e.what();
    } catch (const std::exception& e) {
      message = e.what();
    } catch (...) {
      message = "an unknown exception";
    }
    std::strncpy(text, argument.c_str(), kArg - 1);
    std::strncpy(text + kArg, message.c_str(), kText - kArg - 1);
  }
  MPI_Bcast(text, static_cast<int>(kText), MPI_CHAR, lowest, comm);
  a.argument = text;
  a.message = text + kArg;
  return a;
}

// After agree() found a failure: a rank that failed raises its own exception; the others an
// Error naming the lowest failing rank, its argument and its message.
[[noreturn]] void raise_agreed(const char* fn, const Agreement& a, const std::exception_ptr& mine,
                               const std::string& expected) {
  if (mine) std::rethrow_exception(mine);
  fail(fn, a.argument, expected, "rank " + std::to_string(a.failed_rank) + " failed: " + a.message);
}

// Whether every rank of every node can read its node peers' private memory with
// process_vm_readv (the same user, and a ptrace policy that allows it: Yama's ptrace_scope
// 0, or CAP_SYS_PTRACE), tried on a word each rank holds on its stack while the others read
// it. Every rank gets the same answer (all-reduced), so each knows whether its peers will
// read its x or expect it staged. Fills m.peer_pids.
bool probe_cross_memory_attach(Buffer::Impl& m, bool wanted) {
  volatile uint64_t word = 0x6d6f656b69740000ull | static_cast<uint64_t>(m.local_rank);
  const uint64_t mine[2] = {static_cast<uint64_t>(::getpid()), reinterpret_cast<uint64_t>(&word)};
  std::vector<uint64_t> all(static_cast<size_t>(2 * m.ranks_per_node));
  MPI_Allgather(mine, 2, MPI_UINT64_T, all.data(), 2, MPI_UINT64_T, m.node_comm);
  m.peer_pids.assign(static_cast<size_t>(m.ranks_per_node), 0);
  int ok = wanted;
  for (int p = 0; p < m.ranks_per_node; ++p) {
    m.peer_pids[static_cast<size_t>(p)] = static_cast<pid_t>(all[static_cast<size_t>(2 * p)]);
    if (!ok || p == m.local_rank) continue;
    uint64_t seen = 0;
    ok = read_peer_rows(m.peer_pids[static_cast<size_t>(p)], all[static_cast<size_t>(2 * p + 1)], 8, 1, 8,
                        reinterpret_cast<char*>(&seen)) &&
         seen == (0x6d6f656b69740000ull | static_cast<uint64_t>(p));
  }
  int all_ok = 0;
  MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, m.comm);  // (the peers' words live until here)
  return all_ok != 0;
}

// destroy()'s barrier, which also tells who is late. Each rank, as it comes, has set its
// flag in its control segment (read by the ranks of its node) and sends an empty message to
// every rank of the other nodes, whose messages it receives. Once every flag of this node is
// set and every message has come, every rank has come, as after a barrier. On a timeout the
// ranks missing are returned: those of this node and, since 2026-12-04, those of other nodes
// (an MPI barrier could not tell them). Their messages may still come, and this rank's sends
// may still wait for their receives: those requests go to MPI with their buffers kept, and
// the communicators are kept (collective_pending), as mpi_wait does.
std::vector<int> await_arrivals(Buffer::Impl& m, const char* fn) {
  constexpr int kTagArrived = 301;  // (101-103 internode, 201-202 low latency)
  struct Messages {
    std::vector<MPI_Request> recv, send;
    std::vector<char> in;
    char out = 1;
  };
  std::vector<int> others;
  for (int g = 0; g < m.num_ranks; ++g)
    if (!m.on_node(g)) others.push_back(g);
  auto msgs = std::make_shared<Messages>();
  msgs->recv.assign(others.size(), MPI_REQUEST_NULL);
  msgs->send.assign(others.size(), MPI_REQUEST_NULL);
  msgs->in.assign(others.size(), 0);
  // (receives first: a peer whose message came has posted the receive of ours)
  for (size_t i = 0; i < others.size(); ++i) MPI_Irecv(&msgs->in[i], 1, MPI_BYTE, others[i], kTagArrived, m.comm, &msgs->recv[i]);
  for (size_t i = 0; i < others.size(); ++i) MPI_Isend(&msgs->out, 1, MPI_BYTE, others[i], kTagArrived, m.comm, &msgs->send[i]);
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    bool all = true;
    for (MPI_Request& r : msgs->recv) {
      int flag = 1;
      if (r != MPI_REQUEST_NULL) MPI_Test(&r, &flag, MPI_STATUS_IGNORE);
      all = all && flag;
    }
    for (int p = 0; all && p < m.ranks_per_node; ++p) all = m.destroying(p).load(std::memory_order_acquire) != 0;
    if (all) break;
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > m.timeout) {
      std::vector<int> late;
      for (int p = 0; p < m.ranks_per_node; ++p)
        if (m.destroying(p).load(std::memory_order_acquire) == 0) late.push_back(m.global(p));
      for (size_t i = 0; i < others.size(); ++i) {
        int flag = 1;
        if (msgs->recv[i] != MPI_REQUEST_NULL) MPI_Test(&msgs->recv[i], &flag, MPI_STATUS_IGNORE);
        if (flag) continue;  // (came since the last look)
        late.push_back(others[i]);
        MPI_Cancel(&msgs->recv[i]);  // (as exchange() does: a cancelled receive completes at once)
        MPI_Wait(&msgs->recv[i], MPI_STATUS_IGNORE);
      }
      if (late.empty()) break;  // (everyone came just now)
      std::sort(late.begin(), late.end());
      for (MPI_Request& r : msgs->send)
        if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);
      Buffer::Impl::keep_until_exit(msgs);  // (a late rank's send may still complete into it)
      m.collective_pending = true;
      m.broken.store(true);
      return late;
    }
    ::usleep(100);
  }
  for (MPI_Request& r : msgs->send) m.mpi_wait(r, fn, msgs);
  return {};
}
}  // namespace

// ---- errors, events, config ----

TimeoutError::TimeoutError(std::string function, std::vector<int> silent_ranks, double waited_s)
    : Error(std::move(function), "ranks", "every rank to answer within " + seconds_str(waited_s) + " s",
            "no answer from rank(s) " + join(silent_ranks)),
      silent_ranks_(std::move(silent_ranks)) {}

void EventOverlap::wait() const {
  if (state_) state_->done.get();
}

bool EventOverlap::done() const {
  return !state_ || state_->done.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}

int64_t Config::get_nvl_buffer_size_hint(int64_t hidden_bytes, int num_ranks) const {
  constexpr const char* fn = "ep::Config::get_nvl_buffer_size_hint";
  if (hidden_bytes <= 0 || hidden_bytes > (int64_t{1} << 40)) fail(fn, "hidden_bytes", "in (0, 2^40]", std::to_string(hidden_bytes));
  if (num_ranks <= 0 || num_ranks > (1 << 20)) fail(fn, "num_ranks", "in [1, 2^20]", std::to_string(num_ranks));
  if (num_max_nvl_chunked_recv_tokens <= 0)
    fail(fn, "num_max_nvl_chunked_recv_tokens", "> 0", std::to_string(num_max_nvl_chunked_recv_tokens));
  // (in long double: the product of the bounds above overflows int64)
  const long double bytes = static_cast<long double>(hidden_bytes + 128) * num_ranks * num_max_nvl_chunked_recv_tokens;
  if (bytes > 0x1p60L)
    fail(fn, "num_max_nvl_chunked_recv_tokens", "a size whose buffer is under 2^60 bytes",
         std::to_string(num_max_nvl_chunked_recv_tokens) + " rows of " + std::to_string(hidden_bytes) + " bytes for " +
             std::to_string(num_ranks) + " ranks");
  const int64_t row = static_cast<int64_t>(align_up(static_cast<size_t>(hidden_bytes), 64)) + 64;
  return static_cast<int64_t>(align_up(static_cast<size_t>(num_ranks) *
                                           static_cast<size_t>(num_max_nvl_chunked_recv_tokens) *
                                           static_cast<size_t>(row),
                                       4096));
}

int64_t Config::get_rdma_buffer_size_hint(int64_t, int) const { return 0; }

Config Buffer::get_dispatch_config(int num_ranks) {
  Config c;
  c.num_sms = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / std::max(1, num_ranks));
  return c;
}
Config Buffer::get_combine_config(int num_ranks) { return get_dispatch_config(num_ranks); }

// ---- construction ----

Buffer::Buffer(MPI_Comm comm, int64_t num_nvl_bytes, int64_t num_rdma_bytes, BufferOptions options)
    : impl_(std::make_unique<Impl>()) {
  constexpr const char* fn = "ep::Buffer";
  Impl& m = *impl_;
  int initialised = 0;
  MPI_Initialized(&initialised);
  // Without MPI or a communicator there is no one to agree with: these raise at once.
  if (!initialised) fail(fn, "comm", "an initialised MPI (call MPI_Init_thread first)", "MPI not initialised");
  check_mpi_not_finalized(fn);
  if (comm == MPI_COMM_NULL) fail(fn, "comm", "a communicator", "MPI_COMM_NULL");
  // Every other check of this rank's arguments and environment, then one agreement on comm
  // before any other collective: a rank whose checks fail (and only it) would otherwise
  // raise while its peers wait forever in MPI_Comm_dup below.
  bool cma_wanted = true, cma_forced = false;
  int asked_ranks_per_node = 0;  // 0: the ranks that share a host
  std::exception_ptr rejected;
  try {
    if (num_nvl_bytes < 0) fail(fn, "num_nvl_bytes", ">= 0", std::to_string(num_nvl_bytes));
    if (num_rdma_bytes < 0) fail(fn, "num_rdma_bytes", ">= 0", std::to_string(num_rdma_bytes));
    // (No wait may last forever: an infinite or NaN timeout is refused like a bad size.)
    if (std::isnan(options.timeout_s) || std::isinf(options.timeout_s))
      fail(fn, "options.timeout_s", "a finite number of seconds (<= 0: the default)", std::to_string(options.timeout_s));
    if (options.ranks_per_node < 0)
      fail(fn, "options.ranks_per_node", ">= 0 (0: the ranks sharing a host)", std::to_string(options.ranks_per_node));
    m.timeout = options.timeout_s > 0 ? options.timeout_s : env_double("MOEKIT_EP_TIMEOUT_S", 100.0);
    cma_wanted = env_flag("MOEKIT_EP_CMA", true);
    const char* cma_env = std::getenv("MOEKIT_EP_CMA");
    cma_forced = cma_env != nullptr && cma_env[0] == '1';  // (no probing, if every rank says so)
    asked_ranks_per_node = options.ranks_per_node > 0 ? options.ranks_per_node : env_int("MOEKIT_EP_RANKS_PER_NODE", 0);
  } catch (...) {
    rejected = std::current_exception();
  }
  if (const Agreement a = agree(comm, rejected); a.failed_rank >= 0)
    raise_agreed(fn, a, rejected, "arguments (and MOEKIT_EP_* settings) that every rank accepts");
  MPI_Comm_dup(comm, &m.comm);
  MPI_Comm_rank(m.comm, &m.rank);
  MPI_Comm_size(m.comm, &m.num_ranks);

  // Nodes: ranks that share a host, unless told to pretend otherwise.
  MPI_Comm host_comm;
  MPI_Comm_split_type(m.comm, MPI_COMM_TYPE_SHARED, m.rank, MPI_INFO_NULL, &host_comm);
  int host_size = 1, host_leader = m.rank;
  MPI_Comm_size(host_comm, &host_size);
  MPI_Bcast(&host_leader, 1, MPI_INT, 0, host_comm);
  MPI_Comm_free(&host_comm);
  m.ranks_per_node = asked_ranks_per_node > 0 ? asked_ranks_per_node : host_size;
  // Every rank's host leader and ranks per node, on every rank: the node checks below run on
  // the same data everywhere, so every rank reaches the same verdict and they all raise (or
  // all go on) without another round.
  const int about_me[2] = {host_leader, m.ranks_per_node};
  std::vector<int> gathered(static_cast<size_t>(2 * m.num_ranks));
  MPI_Allgather(about_me, 2, MPI_INT, gathered.data(), 2, MPI_INT, m.comm);
  auto leader_of = [&](int r) { return gathered[static_cast<size_t>(2 * r)]; };
  auto ranks_per_node_of = [&](int r) { return gathered[static_cast<size_t>(2 * r + 1)]; };
  auto give_up = [&](const std::string& arg, const std::string& expected, const std::string& actual) {
    MPI_Comm_free(&m.comm);
    fail(fn, arg, expected, actual);
  };
  for (int r = 1; r < m.num_ranks; ++r)
    if (ranks_per_node_of(r) != ranks_per_node_of(0))
      give_up("ranks_per_node", "the same on every rank (BufferOptions::ranks_per_node, MOEKIT_EP_RANKS_PER_NODE)",
              std::to_string(ranks_per_node_of(0)) + " on rank 0, " + std::to_string(ranks_per_node_of(r)) + " on rank " +
                  std::to_string(r));
  // Each rank addresses its peers' low-latency halves by its own size (ll_half_stride).
  std::vector<int64_t> rdma_bytes(static_cast<size_t>(m.num_ranks));
  MPI_Allgather(&num_rdma_bytes, 1, MPI_INT64_T, rdma_bytes.data(), 1, MPI_INT64_T, m.comm);
  for (int r = 1; r < m.num_ranks; ++r)
    if (rdma_bytes[static_cast<size_t>(r)] != rdma_bytes[0])
      give_up("num_rdma_bytes", "the same on every rank",
              std::to_string(rdma_bytes[0]) + " on rank 0, " + std::to_string(rdma_bytes[static_cast<size_t>(r)]) +
                  " on rank " + std::to_string(r));
  if (m.num_ranks % m.ranks_per_node != 0)
    give_up("ranks_per_node", "a divisor of the rank count " + std::to_string(m.num_ranks), std::to_string(m.ranks_per_node));
  if (m.ranks_per_node > 32)
    give_up("ranks_per_node", "at most 32 ranks per node", std::to_string(m.ranks_per_node));
  for (int first = 0; first < m.num_ranks; first += m.ranks_per_node)
    for (int r = first + 1; r < first + m.ranks_per_node; ++r)
      if (leader_of(r) != leader_of(first))
        give_up("ranks_per_node", "consecutive ranks of one node on one host",
                "rank " + std::to_string(r) + " on another host than rank " + std::to_string(first));
  const int node = m.rank / m.ranks_per_node;
  m.local_rank = m.rank % m.ranks_per_node;
  MPI_Comm_split(m.comm, node, m.rank, &m.node_comm);
  MPI_Comm_split(m.comm, m.local_rank, m.rank, &m.rail_comm);
  m.id = g_next_buffer_id.fetch_add(1);

  // Shared segments: names unique per (node leader pid, buffer), created then mapped by all.
  uint64_t tag[2] = {static_cast<uint64_t>(::getpid()), m.id};
  MPI_Bcast(tag, 2, MPI_UINT64_T, 0, m.node_comm);
  m.prefix = "/moekit-ep-" + std::to_string(tag[0]) + "-" + std::to_string(tag[1]);
  m.num_nvl_bytes = num_nvl_bytes;
  m.num_rdma_bytes = num_rdma_bytes;
  m.masked.assign(static_cast<size_t>(m.num_ranks), 0);
  m.layout_ctrl();
  m.peers.resize(static_cast<size_t>(m.ranks_per_node));
  // Creating and mapping the segments can fail on some ranks only (/dev/shm too small, names
  // taken): each step ends in an agreement, so all ranks raise together.
  std::exception_ptr failure;
  try {
    const std::string mine = m.prefix + "-r" + std::to_string(m.local_rank);
    m.own_ctrl = Mapping::create(mine + "-ctrl", m.ctrl_bytes, true);
    m.heap = std::make_shared<Heap>(mine);
    m.heap->add_segment(align_up(static_cast<size_t>(std::max<int64_t>(num_nvl_bytes, 4096)), 4096));
    // Low-latency halves: pages reserved now (a /dev/shm too small is an Error here, not a
    // SIGBUS at the first dispatch) but written only when used.
    if (num_rdma_bytes > 0)
      m.peers[static_cast<size_t>(m.local_rank)].low_latency =
          Mapping::create(mine + "-ll", align_up(static_cast<size_t>(num_rdma_bytes), 4096), false);
  } catch (...) {
    failure = std::current_exception();
  }
  Agreement agreed = agree(m.comm, failure);
  if (agreed.failed_rank < 0) {
    try {
      for (int p = 0; p < m.ranks_per_node; ++p) {
        auto& peer = m.peers[static_cast<size_t>(p)];
        if (p == m.local_rank) {
          peer.ctrl = m.own_ctrl;
          peer.segments.push_back(m.heap->segment(0));
        } else {
          const std::string theirs = m.prefix + "-r" + std::to_string(p);
          peer.ctrl = Mapping::open(theirs + "-ctrl");
          peer.segments.push_back(Mapping::open(theirs + "-s0"));
          if (num_rdma_bytes > 0) peer.low_latency = Mapping::open(theirs + "-ll", false);
        }
      }
    } catch (...) {
      failure = std::current_exception();
    }
    agreed = agree(m.comm, failure);
  }
  // Everyone has mapped everything (or given up): the names can go.
  if (m.own_ctrl) m.own_ctrl->unlink();
  if (m.heap && m.heap->num_segments() > 0) m.heap->segment(0)->unlink();
  if (!m.peers.empty() && m.peers[static_cast<size_t>(m.local_rank)].low_latency)
    m.peers[static_cast<size_t>(m.local_rank)].low_latency->unlink();
  if (agreed.failed_rank >= 0) {
    m.peers.clear();
    MPI_Comm_free(&m.rail_comm);
    MPI_Comm_free(&m.node_comm);
    MPI_Comm_free(&m.comm);
    raise_agreed(fn, agreed, failure, "every rank to create and map its shared-memory segments");
  }
  m.cma = probe_cross_memory_attach(m, cma_wanted);
  // Forced reading only where every rank asks for it: a rank that probes while another
  // reads would leave its rows unstaged for a peer that expects them (CombineReadChoice).
  int forced_everywhere = cma_forced ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &forced_everywhere, 1, MPI_INT, MPI_MIN, m.comm);
  if (m.cma && forced_everywhere) m.combine_reads.decided = 1;
}

Buffer::~Buffer() {
  if (impl_ && impl_->available) {
    try {
      destroy();
    } catch (...) {
    }
  }
}

void Buffer::destroy() {
  Impl& m = *impl_;
  if (!m.available) fail("ep::Buffer::destroy", "buffer", "a live buffer", "a destroyed buffer");
  if (m.pending.valid()) {
    try {
      m.pending.wait();
    } catch (...) {
    }
  }
  m.available = false;
  m.live->store(false);
  // After MPI_Finalize any MPI call aborts the process: then nothing below calls MPI (no
  // synchronising, no MPI object freed) and this rank's mappings simply go.
  int finalized = 0;
  MPI_Finalized(&finalized);
  std::exception_ptr error;
  if (finalized) {
    error = std::make_exception_ptr(Error("ep::Buffer::destroy", "MPI", "a buffer destroyed before MPI_Finalize",
                                          "MPI already finalized"));
  } else {
    // No rank unmaps while another may still write into its memory.
    m.destroying(m.local_rank).store(1, std::memory_order_release);
    try {
      const std::vector<int> late = await_arrivals(m, "ep::Buffer::destroy");
      if (!late.empty()) error = std::make_exception_ptr(TimeoutError("ep::Buffer::destroy", late, m.timeout));
    } catch (const std::exception&) {  // (a send that never completed after every rank came)
      error = std::current_exception();
    }
    m.sweep_in_flight();
  }
  // Low-latency messages still in flight (to or from a masked or failed rank): MPI may still
  // use their memory, so it is handed to MPI for good (kept allocated).
  for (auto& f : m.ll_in_flight) {
    if (!finalized) MPI_Request_free(&f.req);
    (void)f.data.release();
  }
  m.ll_in_flight.clear();
  m.peers.clear();
  m.own_ctrl.reset();
  m.heap.reset();
  if (!finalized && !m.collective_pending) {  // (else kept: see mpi_wait)
    MPI_Comm_free(&m.rail_comm);
    MPI_Comm_free(&m.node_comm);
    MPI_Comm_free(&m.comm);
  }
  if (error) std::rethrow_exception(error);
}

int Buffer::get_rank() const { return impl_->rank; }
int Buffer::get_num_ranks() const { return impl_->num_ranks; }
int Buffer::get_local_rank() const { return impl_->local_rank; }
int Buffer::get_num_local_ranks() const { return impl_->ranks_per_node; }
double Buffer::timeout_s() const { return impl_->timeout; }
bool Buffer::reads_peer_memory() const { return impl_->cma; }
const char* Buffer::combine_private_x() const {
  const CombineReadChoice& c = impl_->combine_reads;
  if (!impl_->cma || impl_->num_nodes() > 1) return "staged";  // (across nodes rows go through MPI)
  return c.decided < 0 ? "probing" : c.decided == 1 ? "read" : "staged";
}
bool Buffer::is_available() const { return impl_->available; }

Tensor Buffer::get_local_buffer_tensor() const {
  if (!impl_->available) fail("ep::Buffer::get_local_buffer_tensor", "buffer", "a live buffer", "a destroyed buffer");
  auto seg = impl_->heap->segment(0);
  return Tensor::from_blob_with_owner(seg->data(), {static_cast<int64_t>(impl_->num_nvl_bytes)}, DType::u8, seg);
}

DispatchLayout Buffer::get_dispatch_layout(const Tensor& topk_idx, int num_experts) const {
  return detail::compute_dispatch_layout(topk_idx, num_experts, impl_->num_ranks, impl_->ranks_per_node);
}

Tensor Buffer::alloc_shared(const Shape& shape, DType dtype) {
  constexpr const char* fn = "ep::Buffer::alloc_shared";
  Impl& m = *impl_;
  if (!m.available) fail(fn, "buffer", "a live buffer", "a destroyed buffer");
  Tensor probe = Tensor::from_blob(reinterpret_cast<void*>(64), shape, dtype);  // validates shape
  const size_t bytes = static_cast<size_t>(probe.numel()) * element_size(dtype);
  // Only within this rank's existing segments: growing the heap needs every peer to map the
  // new segment, which only a collective operation can arrange.
  int seg = 0;
  size_t off = 0;
  const size_t rounded = align_up(std::max<size_t>(bytes, 64), 4096);
  if (!m.heap->try_alloc(rounded, seg, off))
    fail(fn, "shape", "a tensor that fits in the free shared memory (raise num_nvl_bytes)",
         shape_str(shape) + " = " + std::to_string(bytes) + " bytes");
  auto block = std::make_shared<Block>();
  block->heap = m.heap;
  block->map = m.heap->segment(seg);
  block->seg = seg;
  block->off = off;
  block->bytes = rounded;
  return Tensor::from_blob_with_owner(block->data(), shape, dtype, block);
}

}  // namespace moekit::ep

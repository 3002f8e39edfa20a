// Expert-parallel communication (DeepEP-compatible names and semantics) for ranks that are
// MPI processes. Contract: shared/spec/ep.md; moekit's choices: docs/EP.md.
//
// Ranks on one node exchange through POSIX shared memory that every rank of the node maps:
// a sender writes its rows straight into the receiver's memory (the analogue of DeepEP's
// NVLink buffers), so each dispatched byte is copied exactly once. The received tensors
// live in that shared memory and stay valid for as long as the caller holds them. Across
// nodes, normal mode sends each token over MPI once per destination node and forwards it
// within the node (DeepEP's internode scheme); low-latency mode sends one MPI message per
// rank of another node and direction (as DeepEP writes to every rank over RDMA).
//
// The caller initialises MPI (MPI_Init_thread, at least MPI_THREAD_FUNNELED) and calls every
// Buffer operation from the thread that initialised it, on every rank, in the same order.
#pragma once

// The C API only: OpenMPI's deprecated C++ bindings do not compile cleanly with -Wextra.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "moekit/error.h"
#include "moekit/tensor.h"

namespace moekit::ep {

// A wait that ran past the Buffer's timeout. silent_ranks() are the ranks (in the Buffer's
// communicator) that had not answered; what() names them too.
class TimeoutError : public Error {
 public:
  TimeoutError(std::string function, std::vector<int> silent_ranks, double waited_s);
  const std::vector<int>& silent_ranks() const noexcept { return silent_ranks_; }

 private:
  std::vector<int> silent_ranks_;
};

// DeepEP's performance knobs. On the CPU "SMs" are copy threads per rank; the chunk sizes
// bound how many rows a thread copies before it publishes progress.
struct Config {
  int num_sms = 1;
  int num_max_nvl_chunked_send_tokens = 8;
  int num_max_nvl_chunked_recv_tokens = 256;
  int num_max_rdma_chunked_send_tokens = 16;
  int num_max_rdma_chunked_recv_tokens = 128;

  // Bytes of Buffer::num_nvl_bytes that a normal dispatch/combine with rows of hidden_bytes
  // needs at least (the control block plus one receive chunk per peer). Received tensors
  // larger than the buffer make it grow on demand (docs/EP.md).
  int64_t get_nvl_buffer_size_hint(int64_t hidden_bytes, int num_ranks) const;
  // 0: normal mode needs no separate internode buffer (its MPI staging comes from the same
  // heap as num_nvl_bytes, grown on demand). num_rdma_bytes sizes the low-latency halves only.
  // (hidden_bytes and num_ranks are kept for DeepEP's signature.)
  int64_t get_rdma_buffer_size_hint(int64_t hidden_bytes, int num_ranks) const;
};

// Completion of asynchronous work (DeepEP's EventOverlap). A default-constructed event is
// already complete. wait() rethrows an error raised by the work (e.g. TimeoutError).
class EventOverlap {
 public:
  EventOverlap() = default;
  void wait() const;
  void current_stream_wait() const { wait(); }
  bool done() const;

  struct State;
  explicit EventOverlap(std::shared_ptr<State> state) : state_(std::move(state)) {}

 private:
  std::shared_ptr<State> state_;
};

// What combine (and a cached dispatch) needs from a dispatch. Tensors are for inspection and
// tests; the handle is opaque otherwise.
struct DispatchHandle {
  Tensor rank_prefix_matrix;  // i32 [R, R]: [s][d] = rows rank d received from ranks <= s
  Tensor recv_src_idx;        // i32 [N_recv]: source token index of each received row
  Tensor is_token_in_rank;    // bool [T, R]
  Tensor send_head;           // i32 [T, R]: row of token t in rank r's receive block from
                              //   this rank (counted from the block's start), -1 if not sent
  int64_t num_recv_tokens = 0;  // valid received rows (N_recv without worst-case padding)
  int64_t hidden = 0;
  std::shared_ptr<const void> internal;
  bool defined() const { return internal != nullptr; }
};

struct DispatchLayout {
  Tensor num_tokens_per_rank;       // i32 [R]
  Tensor num_tokens_per_rdma_rank;  // i32 [R / ranks_per_node], undefined on one node
  Tensor num_tokens_per_expert;     // i32 [E]
  Tensor is_token_in_rank;          // bool [T, R]
  EventOverlap event;
};

struct DispatchArgs {
  Tensor x;         // bf16 [T, H], or e4m3 [T, H] with x_scales
  Tensor x_scales;  // f32 [T, ceil(H/128)] for FP8 dispatch
  std::optional<DispatchHandle> handle;  // cached mode: repeat that routing
  Tensor num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert;
  Tensor topk_idx;      // i64 [T, k]
  Tensor topk_weights;  // f32 [T, k]
  int expert_alignment = 1;
  int64_t num_worst_tokens = 0;
  std::optional<Config> config;
  bool async_finish = false;
};

struct DispatchResult {
  Tensor recv_x;             // bf16 or e4m3 [N_recv, H]
  Tensor recv_x_scales;      // f32 [N_recv, ceil(H/128)] for FP8
  Tensor recv_topk_idx;      // i64 [N_recv, k], local expert ids or -1
  Tensor recv_topk_weights;  // f32 [N_recv, k]
  std::vector<int> num_recv_tokens_per_expert_list;  // per local expert, padded
  DispatchHandle handle;
  EventOverlap event;
};

struct CombineArgs {
  Tensor x;  // bf16 [N_recv, H]
  DispatchHandle handle;
  Tensor topk_weights;  // optional f32 [N_recv, k]
  Tensor bias_0, bias_1;  // optional bf16 [T, H]
  std::optional<Config> config;
  bool async_finish = false;
};

struct CombineResult {
  Tensor combined_x;             // bf16 [T, H]
  Tensor combined_topk_weights;  // f32 [T, k] when topk_weights was given
  EventOverlap event;
};

// ---- low-latency mode (decode) ----

// Bytes of num_rdma_bytes that low-latency dispatch/combine with these limits need.
int64_t get_low_latency_rdma_size_hint(int64_t num_max_dispatch_tokens_per_rank, int64_t hidden, int num_ranks,
                                       int num_experts);

struct LowLatencyHandle {
  Tensor src_info;      // i32 [local_E, max * R]: source token index of each received row
  Tensor layout_range;  // i64 [local_E, R]: begin << 32 | count of the rows from each rank
  int64_t num_max_dispatch_tokens_per_rank = 0, hidden = 0;
  int num_experts = 0;
  std::shared_ptr<const void> internal;
  bool defined() const { return internal != nullptr; }
};

struct LowLatencyDispatchArgs {
  Tensor x;         // bf16 [T, H], T <= num_max_dispatch_tokens_per_rank
  Tensor topk_idx;  // i64 [T, k], -1 = none
  int64_t num_max_dispatch_tokens_per_rank = 0;
  int num_experts = 0;
  Tensor cumulative_local_expert_recv_stats;  // optional i32 [local_E], incremented
  bool use_fp8 = true;
  bool round_scale = false;  // scales rounded up to powers of two
  bool use_ue8m0 = false;    // scales stored as packed ue8m0 (needs round_scale)
  bool async_finish = false;
  bool return_recv_hook = false;
};

struct LowLatencyDispatchResult {
  // Rows of expert e: the first recv_count[e] of recv_x[e] are valid, ordered by source rank
  // then source token. These tensors live in one of the buffer's two alternating low-latency
  // halves: they stay valid until the second low-latency dispatch after this one (a call
  // that raised counts too: it took its half, as its peers' calls did).
  Tensor recv_x;         // bf16 or e4m3 [local_E, max * R, H]
  Tensor recv_x_scales;  // f32 [local_E, max * R, H / 128], or i32 [..., H / 512] with use_ue8m0
  Tensor recv_count;     // i32 [local_E]
  LowLatencyHandle handle;
  EventOverlap event;
  std::function<void()> hook;  // set with return_recv_hook: completes the receive
};

struct LowLatencyCombineArgs {
  Tensor x;             // bf16 [local_E, max * R, H]: expert outputs in the dispatch's layout
  Tensor topk_idx;      // i64 [T, k], as given to the dispatch
  Tensor topk_weights;  // f32 [T, k]
  LowLatencyHandle handle;
  bool zero_copy = false;  // x is get_next_low_latency_combine_buffer(handle)
  bool async_finish = false;
  bool return_recv_hook = false;
  Tensor out;  // optional bf16 [T, H]
};

struct LowLatencyCombineResult {
  // out[t] = sum_k topk_weights[t, k] * y(t, topk_idx[t, k]) in f32, k ascending, -1 and
  // masked ranks skipped. Without `out`, a view of the buffer valid until the second
  // low-latency combine after this one.
  Tensor combined_x;
  EventOverlap event;
  std::function<void()> hook;
};

struct BufferOptions {
  bool low_latency_mode = false;  // informational; low-latency ops need num_rdma_bytes
  // Ranks per node; 0 = MOEKIT_EP_RANKS_PER_NODE if set, else the ranks sharing a host.
  int ranks_per_node = 0;
  // Every wait gives up after this long; <= 0 = MOEKIT_EP_TIMEOUT_S if set, else 100 s.
  double timeout_s = 0;
};

class Buffer {
 public:
  // Collective over comm (the communicator is duplicated; the caller keeps its own).
  Buffer(MPI_Comm comm, int64_t num_nvl_bytes, int64_t num_rdma_bytes = 0,
         BufferOptions options = {});
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  int get_rank() const;
  int get_num_ranks() const;
  int get_local_rank() const;      // index within the node
  int get_num_local_ranks() const; // ranks per node
  double timeout_s() const;
  bool is_available() const;       // false after destroy()
  // CPU extension: whether combine may read the expert ranks' private x straight from their
  // memory (process_vm_readv) rather than having them copy it into shared memory first.
  // Decided at construction, the same on every rank: MOEKIT_EP_CMA=0 turns it off, and so
  // does a kernel or ptrace policy that refuses it (docs/EP.md).
  bool reads_peer_memory() const;
  // CPU extension: how the normal combine moves a private x where reads_peer_memory():
  // "probing" while its first combines try both ways, then "read" or "staged", whichever
  // cost less (MOEKIT_EP_CMA=1 on every rank: always "read"); "staged" where reading is off
  // and on buffers spanning nodes. The same on every rank; both ways give the same bits
  // (docs/EP.md, "Combine from private memory").
  const char* combine_private_x() const;

  // This rank's shared receive memory (the first segment) as u8 [num_nvl_bytes].
  Tensor get_local_buffer_tensor() const;
  // Collective; later calls raise Error. The destructor calls it when still needed (but
  // cannot be collective then if other ranks already left, so call it explicitly). A rank
  // that does not come within the timeout is named by TimeoutError on every other rank.
  void destroy();

  static Config get_dispatch_config(int num_ranks);
  static Config get_combine_config(int num_ranks);

  // Local computation only (no communication).
  DispatchLayout get_dispatch_layout(const Tensor& topk_idx, int num_experts) const;

  // Collective. Results are in received order: source rank ascending, then source token.
  DispatchResult dispatch(const DispatchArgs& args);
  CombineResult combine(const CombineArgs& args);

  // Low-latency mode: one (token, expert) message each, no layout round, two alternating
  // buffer halves. Collective over the unmasked ranks.
  LowLatencyDispatchResult low_latency_dispatch(const LowLatencyDispatchArgs& args);
  LowLatencyCombineResult low_latency_combine(const LowLatencyCombineArgs& args);
  // Where the next low_latency_combine reads x from when zero_copy is set: bf16
  // [local_E, max * R, H] in this rank's shared memory; write expert outputs there.
  Tensor get_next_low_latency_combine_buffer(const LowLatencyHandle& handle);
  // Rank masking (local to this rank): masked ranks are skipped by later low-latency ops.
  void low_latency_update_mask_buffer(int rank, bool mask = true);
  Tensor low_latency_query_mask_buffer() const;  // i32 [R], 1 = masked
  void low_latency_clean_mask_buffer();

  // CPU extension: a tensor in this rank's shared memory. Passing such a tensor as
  // combine's x lets the owners read it in place (no copy on the expert side).
  Tensor alloc_shared(const Shape& shape, DType dtype);

  struct Impl;

 private:
  LowLatencyDispatchResult low_latency_dispatch_checked(const LowLatencyDispatchArgs& args);
  LowLatencyCombineResult low_latency_combine_checked(const LowLatencyCombineArgs& args);
  std::unique_ptr<Impl> impl_;
};

}  // namespace moekit::ep

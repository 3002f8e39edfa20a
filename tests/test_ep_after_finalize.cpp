// Buffers that outlive MPI_Finalize. Any MPI call after MPI_Finalize aborts the process, so a
// buffer used, destroyed or made that late must raise moekit::Error (argument "MPI") instead,
// and a buffer still alive then must be destructible. Its own binary because MPI cannot be
// initialised again in the process. Run under mpirun (any rank count); a rank exits 0 only when
// every check held on it.
#include <mpi.h>

#include <cstdio>
#include <functional>
#include <memory>
#include <string>

#include "moekit/ep.h"
#include "moekit/error.h"
#include "moekit/tensor.h"

namespace {

int g_rank = 0, g_failures = 0;

void expect_finalized_error(const char* what, const std::function<void()>& call) {
  try {
    call();
    std::fprintf(stderr, "[rank %d] %s after MPI_Finalize: no error\n", g_rank, what);
    ++g_failures;
  } catch (const moekit::Error& e) {
    if (e.argument() != "MPI" || e.actual() != "MPI already finalized") {
      std::fprintf(stderr, "[rank %d] %s after MPI_Finalize: unexpected error: %s\n", g_rank, what, e.what());
      ++g_failures;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank %d] %s after MPI_Finalize: not a moekit::Error: %s\n", g_rank, what, e.what());
    ++g_failures;
  }
}

}  // namespace

int main(int argc, char** argv) {
  using namespace moekit;
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  int ranks = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  const int experts = 2 * ranks;
  const int64_t ll_bytes = ep::get_low_latency_rdma_size_hint(8, 128, ranks, experts);
  {
    ep::Buffer used(MPI_COMM_WORLD, 1 << 20, ll_bytes), kept(MPI_COMM_WORLD, 1 << 20, 0);
    auto destroyed_late = std::make_unique<ep::Buffer>(MPI_COMM_WORLD, 1 << 20, 0);
    // The buffer works before: one low-latency dispatch of a token per rank to expert 0.
    ep::LowLatencyDispatchArgs ll;
    ll.x = Tensor::zeros({1, 128}, DType::bf16);
    ll.topk_idx = Tensor::zeros({1, 1}, DType::i64);
    ll.num_max_dispatch_tokens_per_rank = 8;
    ll.num_experts = experts;
    ep::LowLatencyDispatchResult before = used.low_latency_dispatch(ll);
    const int expected_rows = g_rank == 0 ? ranks : 0;
    if (before.recv_count.data_ptr<int32_t>()[0] != expected_rows) {
      std::fprintf(stderr, "[rank %d] dispatch before MPI_Finalize: %d rows for expert 0, expected %d\n", g_rank,
                   before.recv_count.data_ptr<int32_t>()[0], expected_rows);
      ++g_failures;
    }
    MPI_Barrier(MPI_COMM_WORLD);
    MPI_Finalize();

    expect_finalized_error("dispatch", [&] { (void)used.dispatch(ep::DispatchArgs{}); });
    expect_finalized_error("combine", [&] { (void)used.combine(ep::CombineArgs{}); });
    expect_finalized_error("low_latency_dispatch", [&] { (void)used.low_latency_dispatch(ll); });
    ep::LowLatencyCombineArgs llc;
    llc.handle = before.handle;
    expect_finalized_error("low_latency_combine", [&] { (void)used.low_latency_combine(llc); });
    expect_finalized_error("destroy", [&] { destroyed_late->destroy(); });
    if (destroyed_late->is_available()) {
      std::fprintf(stderr, "[rank %d] a buffer destroyed after MPI_Finalize still reports itself available\n", g_rank);
      ++g_failures;
    }
    destroyed_late.reset();
    expect_finalized_error("Buffer()", [&] { ep::Buffer late(MPI_COMM_WORLD, 1 << 20, 0); });
    // `used` and `kept` are destroyed here, after MPI_Finalize: their destructors must return.
  }
  if (g_failures == 0) std::printf("[rank %d] every call after MPI_Finalize raised on \"MPI\"\n", g_rank);
  return g_failures == 0 ? 0 : 1;
}

// main() of the expert-parallel tests: every MPI rank runs the same tests in the same order
// (they are collective). Rank 0 prints gtest's usual report; the other ranks print only their
// own failures, prefixed with their rank. All ranks exit nonzero when any rank failed.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

// Failures of a rank other than 0, one block per failed assertion and per failed test.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}

  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n[rank %d] %s\n", rank_,
                 result.file_name() ? result.file_name() : "(unknown file)", result.line_number(), rank_,
                 indent(result.message()).c_str());
    std::fflush(stderr);
  }
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (!info.result()->Failed()) return;
    std::fprintf(stderr, "[rank %d] [  FAILED  ] %s.%s\n", rank_, info.test_suite_name(), info.name());
    std::fflush(stderr);
  }

 private:
  std::string indent(const char* message) const {
    std::string out;
    for (const char* p = message; *p; ++p) {
      out += *p;
      if (*p == '\n' && p[1] != '\0') out += "[rank " + std::to_string(rank_) + "] ";
    }
    return out;
  }
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  // MOEKIT_EP_TEST_THREAD_MULTIPLE=1: with MPI_THREAD_MULTIPLE, async work that calls MPI
  // (combine and low-latency receives across nodes) runs on the worker thread; otherwise it
  // completes in the call. ctest runs both.
  const char* multiple = std::getenv("MOEKIT_EP_TEST_THREAD_MULTIPLE");
  const int required = multiple != nullptr && std::string(multiple) == "1" ? MPI_THREAD_MULTIPLE : MPI_THREAD_FUNNELED;
  int provided = 0;
  MPI_Init_thread(&argc, &argv, required, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (provided < required) {
    std::fprintf(stderr, "[rank %d] MPI provides thread level %d < the required %d\n", rank, provided, required);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }

  ::testing::InitGoogleTest(&argc, argv);
  if (rank != 0) {
    ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(rank));
  }

  const int local_failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  int any_failed = 0;
  MPI_Allreduce(&local_failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && any_failed && !local_failed)
    std::fprintf(stderr, "[rank 0] passed, but another rank failed (see its [rank N] lines)\n");
  MPI_Finalize();
  return any_failed ? 1 : 0;
}

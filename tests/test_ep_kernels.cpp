// The EP reduction kernels: every ISA path bit-identical to the portable one, and the
// portable one equal to the plain f32 expression it documents (NaN, ±inf, -0, ties). Also
// the Buffer's construction faults: arguments rejected on one rank only, and a /dev/shm too
// small for a segment.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <bit>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "ep/cma.h"
#include "ep/copy.h"
#include "ep/read_choice.h"
#include "ep/shm.h"
#include "ep_test_util.h"
#include "moekit/formats.h"
#include "moekit/runtime.h"

namespace {

using moekit::bf16_to_f32;
using moekit::f32_to_bf16;

std::vector<uint16_t> awkward_row(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  std::vector<uint16_t> row(static_cast<size_t>(n));
  for (auto& v : row) v = f32_to_bf16(dist(rng));
  // quiet and signalling NaNs (a lone row is not summed: its sNaN must still come out quiet)
  const uint16_t specials[] = {0x7fc0, 0xffc1, 0x7f81, 0x7f80, 0xff80, 0x8000, 0x0000, 0x0001, 0x7f7f, 0x3f81};
  for (int64_t i = 0; i < n; i += 37) row[static_cast<size_t>(i)] = specials[(i / 37) % 10];
  return row;
}

uint16_t expected_sum(const std::vector<const uint16_t*>& rows, const uint16_t* b0, const uint16_t* b1, int64_t i) {
  float acc = rows.empty() ? 0.0f : bf16_to_f32(rows[0][i]);
  for (size_t r = 1; r < rows.size(); ++r) acc = acc + bf16_to_f32(rows[r][i]);
  if (b0) acc = acc + bf16_to_f32(b0[i]);
  if (b1) acc = acc + bf16_to_f32(b1[i]);
  return f32_to_bf16(acc);
}

namespace ep = moekit::ep::detail;
using ReduceFn = void (*)(uint16_t*, const uint16_t* const*, int, const uint16_t*, const uint16_t*, int64_t, ep::RowsAhead);
using WeightedFn = void (*)(uint16_t*, const uint16_t* const*, const float*, int, int64_t, ep::RowsAhead);

// The SIMD paths this CPU can run, by name.
template <class Fn>
std::vector<std::pair<const char*, Fn>> simd_paths(Fn avx2, Fn avx512) {
  std::vector<std::pair<const char*, Fn>> paths;
  if (moekit::isa_supported(moekit::Isa::avx2)) paths.emplace_back("avx2", avx2);
  if (moekit::isa_supported(moekit::Isa::avx512)) paths.emplace_back("avx512", avx512);
  return paths;
}

constexpr uint16_t kGuard = 0xABCD;

TEST(EpKernels, ReduceRowsEveryPathMatchesTheF32Expression) {
  const auto paths = simd_paths<ReduceFn>(ep::reduce_rows_bf16_avx2, ep::reduce_rows_bf16_avx512);
  if (paths.empty()) GTEST_SKIP() << "this CPU has no SIMD path to compare";
  for (int64_t hidden : {1, 15, 16, 17, 31, 33, 200, 512, 1000, 7168}) {
    for (int n = 0; n <= 4; ++n) {
      std::vector<std::vector<uint16_t>> data;
      for (int r = 0; r < n + 2; ++r) data.push_back(awkward_row(hidden, static_cast<uint32_t>(hidden * 10 + r)));
      std::vector<const uint16_t*> rows;
      for (int r = 0; r < n; ++r) rows.push_back(data[static_cast<size_t>(r)].data());
      for (int bias = 0; bias < 4; ++bias) {
        const uint16_t* b0 = bias & 1 ? data[static_cast<size_t>(n)].data() : nullptr;
        const uint16_t* b1 = bias & 2 ? data[static_cast<size_t>(n) + 1].data() : nullptr;
        alignas(64) static uint16_t out_scalar[7168 + 64], out_simd[7168 + 64];
        ep::reduce_rows_bf16_scalar(out_scalar, rows.data(), n, b0, b1, 0, hidden);
        for (int64_t i = 0; i < hidden; ++i)
          ASSERT_EQ(out_scalar[i], expected_sum(rows, b0, b1, i)) << "hidden " << hidden << " n " << n << " i " << i;
        for (const auto& [name, fn] : paths) {
          for (int misalign : {0, 1}) {  // aligned (streamed) and unaligned outputs
            std::fill(std::begin(out_simd), std::end(out_simd), kGuard);
            // Requesting rows ahead (here: the same rows) changes nothing in the result.
            fn(out_simd + misalign, rows.data(), n, b0, b1, hidden, ep::RowsAhead{rows.data(), misalign ? n : 0});
            ep::stream_fence();
            for (int64_t i = 0; i < hidden; ++i)
              ASSERT_EQ(out_simd[misalign + i], out_scalar[i]) << name << " hidden " << hidden << " n " << n << " bias " << bias << " i " << i;
            ASSERT_EQ(out_simd[misalign + hidden], kGuard) << name << ": wrote past the row, hidden " << hidden;
            if (misalign) {
              ASSERT_EQ(out_simd[0], kGuard) << name << ": wrote before the row";
            }
          }
        }
      }
    }
  }
}

TEST(EpKernels, WeightedReduceEveryPathMatchesFmaInOrder) {
  const auto paths = simd_paths<WeightedFn>(ep::reduce_weighted_rows_bf16_avx2, ep::reduce_weighted_rows_bf16_avx512);
  if (paths.empty()) GTEST_SKIP() << "this CPU has no SIMD path to compare";
  for (int64_t hidden : {1, 16, 33, 7168}) {
    for (int n = 0; n <= 9; ++n) {
      std::vector<std::vector<uint16_t>> data;
      std::vector<const uint16_t*> rows;
      std::vector<float> w;
      for (int r = 0; r < n; ++r) {
        data.push_back(awkward_row(hidden, static_cast<uint32_t>(hidden + 100 * r)));
        w.push_back(0.1f + 0.37f * static_cast<float>(r));
      }
      for (auto& d : data) rows.push_back(d.data());
      std::vector<uint16_t> a(static_cast<size_t>(hidden));
      ep::reduce_weighted_rows_bf16_scalar(a.data(), rows.data(), w.data(), n, 0, hidden);
      for (int64_t i = 0; i < hidden; ++i) {
        float acc = 0.0f;
        for (int r = 0; r < n; ++r) acc = std::fma(w[static_cast<size_t>(r)], bf16_to_f32(rows[static_cast<size_t>(r)][i]), acc);
        ASSERT_EQ(a[static_cast<size_t>(i)], f32_to_bf16(acc)) << "i " << i;
      }
      for (const auto& [name, fn] : paths) {
        std::vector<uint16_t> b(static_cast<size_t>(hidden) + 1, kGuard);
        fn(b.data(), rows.data(), w.data(), n, hidden, ep::RowsAhead{rows.data(), n});
        for (int64_t i = 0; i < hidden; ++i)
          ASSERT_EQ(b[static_cast<size_t>(i)], a[static_cast<size_t>(i)]) << name << " hidden " << hidden << " n " << n << " i " << i;
        ASSERT_EQ(b[static_cast<size_t>(hidden)], kGuard) << name << ": wrote past the row";
      }
    }
  }
}

// The combine's choice between reading private x (cma) and staging it: calls 0 and 1 warm
// up (cma, staged) unmeasured, calls 2 to 5 alternate measured, and call 6 keeps the way
// whose two calls cost less (a tie stays staged); a forced choice never probes.
TEST(EpKernels, CombineReadChoiceProbesBothWaysThenKeepsTheCheaper) {
  using moekit::ep::detail::CombineReadChoice;
  struct Run {
    double cma, staged;  // the cost every measured call of that way reports
    bool want;           // the verdict
  };
  for (const Run run : {Run{10, 30, true}, Run{30, 10, false}, Run{20, 20, false}}) {
    SCOPED_TRACE("cma " + std::to_string(run.cma) + " staged " + std::to_string(run.staged));
    CombineReadChoice c;
    std::vector<bool> paths, measured;
    double previous = 0;
    for (int call = 0; call < 10; ++call) {
      const bool cma = c.next(previous);
      paths.push_back(cma);
      measured.push_back(c.measured());
      // The warm-up calls report a cost far out of line: it must not count.
      previous = call < 2 ? 1e9 : c.measured() ? (cma ? run.cma : run.staged) : 0;
    }
    const std::vector<bool> probe{true, false, true, false, true, false};
    for (int call = 0; call < 10; ++call) {
      SCOPED_TRACE("call " + std::to_string(call));
      EXPECT_EQ(paths[static_cast<size_t>(call)], call < 6 ? probe[static_cast<size_t>(call)] : run.want);
      EXPECT_EQ(measured[static_cast<size_t>(call)], call >= 2 && call < 6);
    }
    EXPECT_EQ(c.decided, run.want ? 1 : 0);
    EXPECT_EQ(c.calls, CombineReadChoice::kProbeCalls + 1);  // (no counting once decided)
  }
  CombineReadChoice forced;
  forced.decided = 1;
  for (int call = 0; call < 8; ++call) {
    EXPECT_TRUE(forced.next(1e9));
    EXPECT_FALSE(forced.measured());
  }
  EXPECT_EQ(forced.calls, 0);
}

TEST(EpKernels, StreamCopyCopiesEveryByte) {
  using CopyFn = void (*)(void*, const void*, size_t);
  auto paths = simd_paths<CopyFn>(moekit::detail::copy_stream_avx2, moekit::detail::copy_stream_avx512);
  if (paths.empty()) GTEST_SKIP() << "this CPU has no SIMD path to compare";
  if (moekit::isa_supported(moekit::Isa::avx512)) paths.push_back({"avx512_ahead", moekit::detail::copy_stream_avx512_ahead});
  paths.push_back({"to_huge_pages", moekit::detail::copy_stream_to_huge_pages});
  std::vector<unsigned char> src(70000), dst(70000 + 128);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 131 + 7);
  for (const auto& [name, copy] : paths)
    for (size_t n : {64ul, 65ul, 127ul, 255ul, 256ul, 2048ul, 4097ul, 70000ul - 3})
      for (size_t off : {0ul, 1ul, 31ul, 63ul}) {
        std::fill(dst.begin(), dst.end(), 0xAB);
        copy(dst.data() + off, src.data() + 3, n);
        moekit::ep::detail::stream_fence();
        ASSERT_EQ(std::memcmp(dst.data() + off, src.data() + 3, n), 0) << name << " " << n << " " << off;
        ASSERT_EQ(dst[off + n], 0xAB) << name;
        if (off) {
          ASSERT_EQ(dst[off - 1], 0xAB) << name;
        }
      }
}

// The cross-memory-attach reader, on this process's own memory (process_vm_readv may read
// its caller): contiguous and strided rows, rows by address in any order, and a fault
// (unmapped address) reported as false with errno set, never a crash. Skipped where the
// kernel refuses the call altogether (seccomp).
TEST(EpKernels, ReadPeerRowsCopiesRowsAndReportsFaults) {
  using moekit::ep::detail::read_peer_rows;
  using moekit::ep::detail::read_peer_rows_at;
  std::vector<char> src(64 * 1000);
  std::mt19937 gen(71);  // (no period: rows at any distance differ)
  for (char& c : src) c = static_cast<char>(gen());
  const pid_t me = ::getpid();
  const auto base = reinterpret_cast<uint64_t>(src.data());
  char probe = 0;
  if (!read_peer_rows(me, base, 1, 1, 1, &probe) && (errno == ENOSYS || errno == EPERM)) GTEST_SKIP() << "process_vm_readv refused";
  const size_t row = 100;
  for (const int64_t stride : {int64_t{100}, int64_t{160}, int64_t{6400}}) {
    const int64_t rows = static_cast<int64_t>((src.size() - row) / static_cast<size_t>(stride)) + 1;
    std::vector<char> got(static_cast<size_t>(rows) * row, 0);
    ASSERT_TRUE(read_peer_rows(me, base + 3, stride, rows - 1, row, got.data())) << "stride " << stride;
    for (int64_t r = 0; r + 1 < rows; ++r)
      ASSERT_EQ(std::memcmp(got.data() + r * static_cast<int64_t>(row), src.data() + 3 + r * stride, row), 0)
          << "stride " << stride << ", row " << r;
  }
  // More rows than one call's iovec limit, in reverse order.
  std::vector<uint64_t> from(1500);
  for (size_t r = 0; r < from.size(); ++r) from[r] = base + (from.size() - 1 - r) * 40;
  std::vector<char> got(from.size() * 8);
  ASSERT_TRUE(read_peer_rows_at(me, from.data(), static_cast<int64_t>(from.size()), 8, got.data()));
  for (size_t r = 0; r < from.size(); ++r) ASSERT_EQ(std::memcmp(got.data() + r * 8, src.data() + (from.size() - 1 - r) * 40, 8), 0) << r;
  // A row at an address nothing maps, after good ones: false and an errno, contiguous or not.
  errno = 0;
  EXPECT_FALSE(read_peer_rows(me, 8, 64, 1, 64, got.data()));
  EXPECT_NE(errno, 0);
  from[700] = 8;
  errno = 0;
  EXPECT_FALSE(read_peer_rows_at(me, from.data(), static_cast<int64_t>(from.size()), 8, got.data()));
  EXPECT_NE(errno, 0);
}

// ------------------------------------------------------------------ construction faults

// Ends the process (and with it the mpirun job) when a collective step takes longer than
// limit: a hung step then fails the suite with a message instead of waiting for ctest's
// TIMEOUT. Disarmed when it goes out of scope.
class HangWatchdog {
 public:
  HangWatchdog(std::string what, std::chrono::seconds limit) : what_(std::move(what)) {
    thread_ = std::thread([this, limit] {
      std::unique_lock lock(mu_);
      if (cv_.wait_for(lock, limit, [this] { return done_; })) return;
      std::fprintf(stderr, "[rank %d] HANG: %s did not finish within %lld s; ending the process\n",
                   moekit::ep::testing::my_rank(), what_.c_str(), static_cast<long long>(limit.count()));
      std::fflush(stderr);
      std::_Exit(3);
    });
  }
  ~HangWatchdog() {
    {
      std::lock_guard lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  HangWatchdog(const HangWatchdog&) = delete;
  HangWatchdog& operator=(const HangWatchdog&) = delete;

 private:
  std::string what_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

// Constructs a Buffer on comm with this rank's arguments; returns the Error it raised (an
// empty argument() and an ADD_FAILURE when it raised none or another exception).
moekit::Error construct_expecting_error(MPI_Comm comm, int64_t nvl_bytes, moekit::ep::BufferOptions o,
                                        int64_t rdma_bytes = 0) {
  try {
    moekit::ep::Buffer buf(comm, nvl_bytes, rdma_bytes, o);
    ADD_FAILURE() << "the Buffer was constructed although a rank's arguments were bad";
    buf.destroy();
  } catch (const moekit::ep::TimeoutError& e) {
    ADD_FAILURE() << "a TimeoutError (not an argument check): " << e.what();
  } catch (const moekit::Error& e) {
    return e;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
  }
  return moekit::Error("", "", "", "");
}

// Collective. Only rank 0 passes a bad num_nvl_bytes: every rank must raise moekit::Error at
// once (rank 0 its own, the others one naming rank 0 and the argument). Before the ranks
// agreed on their argument checks, rank 0 raised and the others waited forever in the
// constructor's first collective: a HANG line from the watchdog below means that regression
// (the ranks that raised wait for the others in the final all_ranks). The Buffer runs on a
// communicator of its own so a stuck rank cannot match a later collective of the suite.
TEST(EpBufferFaults, BadArgumentOnOneRankRaisesOnEveryRank) {
  using namespace moekit::ep::testing;
  const int me = my_rank();
  if (num_ranks() < 2) GTEST_SKIP() << "needs two ranks";
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  moekit::ep::BufferOptions o;
  o.timeout_s = 5;
  bool raised = false;
  {
    HangWatchdog dog("ep::Buffer construction with a bad num_nvl_bytes on rank 0 only", std::chrono::seconds(60));
    const auto start = std::chrono::steady_clock::now();
    const moekit::Error e = construct_expecting_error(comm, me == 0 ? -1 : int64_t{1} << 20, o);
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    raised = !e.function().empty();
    EXPECT_LT(waited, 10.0) << "an argument check must not wait for a timeout";
    if (raised) {
      EXPECT_EQ(e.argument(), "num_nvl_bytes") << e.what();
      if (me == 0) {
        EXPECT_NE(std::string(e.actual()).find("-1"), std::string::npos) << e.what();
      } else {
        EXPECT_NE(std::string(e.what()).find("rank 0"), std::string::npos) << "should name rank 0: " << e.what();
      }
    }
    EXPECT_TRUE(all_ranks(raised)) << "every rank must raise";
  }
  // Nothing was left half-built: a good Buffer on the same communicator works.
  {
    HangWatchdog dog("ep::Buffer construction after a rejected one", std::chrono::seconds(60));
    EXPECT_TRUE(collective_step("a good Buffer after a rejected one", [&] {
      moekit::ep::Buffer buf(comm, int64_t{1} << 20, 0, o);
      buf.destroy();
    }));
  }
  MPI_Comm_free(&comm);
}

// Collective, on a communicator of its own: constructing with these (per-rank) arguments must
// raise on every rank, naming `argument`, under a watchdog as above.
void expect_construction_raises_everywhere(const char* what, const std::string& argument, int64_t nvl_bytes,
                                           int64_t rdma_bytes, moekit::ep::BufferOptions o) {
  using namespace moekit::ep::testing;
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  {
    HangWatchdog dog(what, std::chrono::seconds(60));
    const moekit::Error e = construct_expecting_error(comm, nvl_bytes, o, rdma_bytes);
    const bool raised = !e.function().empty();
    if (raised) {
      EXPECT_EQ(e.argument(), argument) << e.what();
    }
    EXPECT_TRUE(all_ranks(raised)) << "every rank must raise";
  }
  MPI_Comm_free(&comm);
}

// The ranks ask for different ranks_per_node (rank 0: 1, the others: the rank count): every
// rank must raise the same Error naming ranks_per_node rather than build buffers that
// disagree on the node layout.
TEST(EpBufferFaults, RanksPerNodeThatDiffersAcrossRanksRaisesOnEveryRank) {
  using namespace moekit::ep::testing;
  const int me = my_rank(), R = num_ranks();
  if (R < 2) GTEST_SKIP() << "needs two ranks";
  moekit::ep::BufferOptions o;
  o.timeout_s = 5;
  o.ranks_per_node = me == 0 ? 1 : R;
  expect_construction_raises_everywhere("ep::Buffer construction with ranks_per_node differing across ranks",
                                        "ranks_per_node", int64_t{1} << 20, 0, o);
}

// Rank 0 asks for four times the low-latency bytes of the others (every size above the
// hint): every rank must raise naming num_rdma_bytes. Each rank finds its peers' halves at
// its own half size, so buffers built this way had given wrong receive counts from the
// second low-latency call on, read from past the end of a peer's mapping.
TEST(EpBufferFaults, RdmaBytesThatDifferAcrossRanksRaiseOnEveryRank) {
  using namespace moekit::ep::testing;
  const int me = my_rank(), R = num_ranks();
  if (R < 2) GTEST_SKIP() << "needs two ranks";
  moekit::ep::BufferOptions o;
  o.timeout_s = 5;
  const int64_t hint = moekit::ep::get_low_latency_rdma_size_hint(8, 128, R, R);
  expect_construction_raises_everywhere("ep::Buffer construction with num_rdma_bytes differing across ranks",
                                        "num_rdma_bytes", int64_t{1} << 20, me == 0 ? 4 * hint : hint, o);
}

// A segment larger than /dev/shm can hold raises moekit::Error (naming the size and
// /dev/shm) when it is created, touched or not, instead of a SIGBUS at the first write
// (ftruncate alone reserves nothing on tmpfs). It asks for more than the whole mount, which
// tmpfs refuses before reserving a page, so the test never fills /dev/shm for other tests
// running beside it. Per rank, no communication.
TEST(EpBufferFaults, SegmentLargerThanDevShmRaisesError) {
  struct statvfs st {};
  if (::statvfs("/dev/shm", &st) != 0) GTEST_SKIP() << "no /dev/shm to query: " << std::strerror(errno);
  if (st.f_blocks == 0) GTEST_SKIP() << "/dev/shm has no size limit (a tmpfs mounted with size=0): nothing to exceed";
  const uint64_t total = static_cast<uint64_t>(st.f_blocks) * st.f_frsize;
  const uint64_t gib = uint64_t{1} << 30;
  if (total > std::numeric_limits<uint64_t>::max() / 2 - gib) GTEST_SKIP() << "/dev/shm size " << total << " + 1 GiB overflows";
  const size_t bytes = static_cast<size_t>(total + gib);
  const std::string name = "/moekit-ep-test-too-large-" + std::to_string(::getpid());
  for (const bool touch : {false, true}) {
    try {
      auto m = moekit::ep::detail::Mapping::create(name, bytes, touch);
      ADD_FAILURE() << "created a " << bytes << "-byte segment on a " << total << "-byte /dev/shm (touch " << touch
                    << "): its pages are not reserved, the first write past the free space is a SIGBUS";
      return;  // (an untouched mapping: unmapped and unlinked here, never written)
    } catch (const moekit::Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(std::to_string(bytes)), std::string::npos) << "should quote the size needed: " << what;
      EXPECT_NE(what.find("/dev/shm"), std::string::npos) << what;
      EXPECT_NE(what.find("shm-size"), std::string::npos) << "should mention Docker's --shm-size: " << what;
    }
    // The name did not stay behind.
    const int fd = ::shm_open(name.c_str(), O_RDONLY, 0);
    EXPECT_LT(fd, 0) << name << " left in /dev/shm";
    if (fd >= 0) {
      ::close(fd);
      ::shm_unlink(name.c_str());
    }
  }
}

}  // namespace

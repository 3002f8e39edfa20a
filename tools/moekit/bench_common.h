// Benchmark rows and timing (shared/spec/benchmarks.md).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "moekit/tensor.h"

namespace moekit::tools {

struct Timing {
  double median_us = 0, min_us = 0;
  int runs = 0;
};

// Deterministic pseudo-normal bf16 data (parallel fill); row_spread scales row r by 1 + r % 7
// (a per-row magnitude spread, like activations).
Tensor random_bf16(int64_t rows, int64_t cols, uint64_t seed, bool row_spread = false);

// Warm-up runs, then `repeats` timed runs (median and min).
Timing time_it(const std::function<void()>& fn, int repeats = 10, int warmup = 1);

// The same, alternating two functions run by run, so that both see the same machine (this
// host is shared; back-to-back blocks of runs can land in different load phases).
std::pair<Timing, Timing> time_interleaved(const std::function<void()>& fn, const std::function<void()>& peer,
                                           int repeats, int warmup = 1);
// Any number of functions, run in turn within every repeat.
std::vector<Timing> time_round_robin(const std::vector<std::function<void()>>& fns, int repeats, int warmup = 1);

struct Row {
  std::string kernel, shape, dtype, backend = "cpu";
  int threads = 1;
  Timing time;
  double tflops = -1, gbps = -1;  // the one that applies is >= 0
  std::string ceiling;            // bf16_flops, read_bw, copy_bw
  double ceiling_value = 0;       // in the unit of tflops/gbps
  std::string peer;
  Timing peer_time;
  double calc_diff = -1;
  std::map<std::string, int64_t> sizes;       // m, n, k, ...
  std::map<std::string, std::string> notes;   // extra facts (bit_exact, checked_rows, ...)
  // Set (>= 0) for rows judged against the roofline max(bytes / read_bw, flops / bf16_flops):
  // RunCeilings::finish adds the notes "bound" and "pct_of_roofline".
  double roofline_bytes = -1, roofline_flops = -1;
};

// This host is shared, so a ceiling measured at a bad moment would flatter every row. Suites
// re-measure between problems; finish() judges every row against the best figures of the
// whole run (the header prints the same figures).
// The read bandwidth is always measured; the bf16 FLOP/s ceiling where with_flops.
struct RunCeilings {
  // with_copy: also the copy bandwidth, the ceiling of rows that write more than they read.
  RunCeilings(bool with_flops, bool quick, bool with_copy = false) : with_flops(with_flops), with_copy(with_copy), quick(quick) {}
  void remeasure();
  void finish(Row& row) const;
  std::map<std::string, double> header() const;
  double bf16_tflops = 0, read_gbps = 0, copy_gbps = 0;
  bool with_flops, with_copy, quick;
};

struct Reporter {
  bool json = false;
  void print(const Row& row);
  void header(const std::string& suite, const std::map<std::string, double>& ceilings);
};

struct BenchOptions {
  bool json = false;
  bool quick = false;  // smaller sizes, fewer repeats (smoke runs)
  int repeats = 10;
  std::vector<int64_t> gemm_m;   // bench gemm: only these M (empty: upstream's list)
  std::vector<int64_t> gemm_n;   // bench gemm: only shapes with these N
  std::string peer_isa = "scalar";  // bench formats: the moekit path measured as the peer
};

void bench_formats(const BenchOptions& options);
void bench_gemm(const BenchOptions& options);
void bench_grouped(const BenchOptions& options);
// Under mpirun (initialises MPI when the caller has not).
void bench_ep(const BenchOptions& options);

}  // namespace moekit::tools

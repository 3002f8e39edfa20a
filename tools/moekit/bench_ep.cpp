// moekit bench ep: expert-parallel dispatch/combine between MPI ranks (run under mpirun),
// next to the same exchange written with MPI_Alltoallv, and the copy ceiling measured in
// the same run with every rank copying at once.
//
// Timing (benchmarks.md): every run starts after a barrier; a run's time is the slowest
// rank's; median and min over the runs. Bytes per rank as DeepEP counts them: received rows
// x row bytes (bf16 2H, FP8 H + 4H/128), averaged over the ranks.
#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>

#include "bench_common.h"
#include "moekit/ep.h"
#include "moekit/formats.h"
#include "moekit/runtime.h"
#include "peak.h"

namespace moekit::tools {
namespace {

struct World {
  int rank = 0, size = 1;
};

// One synchronised run: barrier, the work, this rank's time; the slowest rank's time.
double timed_run(const std::function<void()>& fn) {
  MPI_Barrier(MPI_COMM_WORLD);
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  MPI_Allreduce(MPI_IN_PLACE, &us, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return us;
}

std::pair<Timing, Timing> time_pair(const std::function<void()>& fn, const std::function<void()>& peer, int repeats,
                                    int warmup = 1) {
  for (int i = 0; i < warmup; ++i) fn(), peer();  // first touch of every buffer (both halves)
  std::vector<double> a, b;
  for (int i = 0; i < repeats; ++i) a.push_back(timed_run(fn)), b.push_back(peer ? timed_run(peer) : 0.0);
  auto summarise = [&](std::vector<double>& v) {
    std::sort(v.begin(), v.end());
    return Timing{v[v.size() / 2], v.front(), repeats};
  };
  return {summarise(a), summarise(b)};
}

// The ceiling: each rank copies `bytes` (memcpy, and non-temporal stores with AVX2 and with
// AVX-512 where the CPU has them; the best of these) while every other rank does the same.
double concurrent_copy_gbps(size_t bytes, int repeats) {
  Tensor src = random_bf16(static_cast<int64_t>(bytes / 2 / 4096), 4096, 7);
  Tensor dst = Tensor::zeros({static_cast<int64_t>(bytes)}, DType::u8);
  const size_t n = static_cast<size_t>(src.numel()) * 2;
  double best = 0;
  for (int variant = 0; variant < 3; ++variant) {
    std::vector<double> us;
    for (int i = 0; i < repeats + 1; ++i)
      us.push_back(timed_run([&] {
        if (variant == 2 && isa_supported(Isa::avx512)) {
          kernels::copy_stream_avx512(src.data(), dst.data(), static_cast<int64_t>(n));
        } else if (variant == 1 && isa_supported(Isa::avx2)) {
          kernels::copy_stream_avx2(src.data(), dst.data(), static_cast<int64_t>(n));
        } else {
          std::memcpy(dst.data(), src.data(), n);
        }
      }));
    std::sort(us.begin(), us.end());
    best = std::max(best, static_cast<double>(n) / (us.front() * 1e3));
  }
  return best;
}

// Top-k of distinct experts per token, uniform (DeepSeek-like traffic with random routing).
Tensor random_topk(int64_t tokens, int topk, int experts, uint64_t seed) {
  Tensor idx = Tensor::empty({tokens, topk}, DType::i64);
  std::mt19937_64 rng(seed);
  std::vector<int64_t> pool(static_cast<size_t>(experts));
  for (int64_t t = 0; t < tokens; ++t) {
    std::iota(pool.begin(), pool.end(), 0);
    for (int j = 0; j < topk; ++j) {
      std::uniform_int_distribution<int64_t> pick(j, experts - 1);
      std::swap(pool[static_cast<size_t>(j)], pool[static_cast<size_t>(pick(rng))]);
      idx.data_ptr<int64_t>()[t * topk + j] = pool[static_cast<size_t>(j)];
    }
  }
  return idx;
}

// The peer a user would write: pack the rows per destination, MPI_Alltoallv, which already
// delivers them in (source rank, source token) order.
struct AlltoallvDispatch {
  int ranks = 1;
  int64_t row_bytes = 0;
  std::vector<int> send_counts, send_displs, recv_counts, recv_displs;  // in bytes
  std::vector<std::vector<int32_t>> tokens;  // per destination
  Tensor send, recv;

  AlltoallvDispatch(const Tensor& in_rank, int64_t row_bytes_) : ranks(static_cast<int>(in_rank.size(1))), row_bytes(row_bytes_) {
    tokens.resize(static_cast<size_t>(ranks));
    for (int64_t t = 0; t < in_rank.size(0); ++t)
      for (int d = 0; d < ranks; ++d)
        if (in_rank.data_ptr<bool>()[t * ranks + d]) tokens[static_cast<size_t>(d)].push_back(static_cast<int32_t>(t));
    std::vector<int> rows(static_cast<size_t>(ranks)), from(static_cast<size_t>(ranks));
    for (int d = 0; d < ranks; ++d) rows[static_cast<size_t>(d)] = static_cast<int>(tokens[static_cast<size_t>(d)].size());
    MPI_Alltoall(rows.data(), 1, MPI_INT, from.data(), 1, MPI_INT, MPI_COMM_WORLD);
    int64_t out = 0, in = 0;
    for (int d = 0; d < ranks; ++d) {
      send_counts.push_back(static_cast<int>(rows[static_cast<size_t>(d)] * row_bytes));
      send_displs.push_back(static_cast<int>(out));
      out += send_counts.back();
      recv_counts.push_back(static_cast<int>(from[static_cast<size_t>(d)] * row_bytes));
      recv_displs.push_back(static_cast<int>(in));
      in += recv_counts.back();
    }
    send = Tensor::zeros({std::max<int64_t>(out, 1)}, DType::u8);
    recv = Tensor::zeros({std::max<int64_t>(in, 1)}, DType::u8);
  }
  void dispatch(const Tensor& x) {
    auto* out = static_cast<char*>(send.data());
    for (int d = 0; d < ranks; ++d)
      for (int32_t t : tokens[static_cast<size_t>(d)]) {
        std::memcpy(out, static_cast<const char*>(x.data()) + t * row_bytes, static_cast<size_t>(row_bytes));
        out += row_bytes;
      }
    MPI_Alltoallv(send.data(), send_counts.data(), send_displs.data(), MPI_BYTE, recv.data(), recv_counts.data(),
                  recv_displs.data(), MPI_BYTE, MPI_COMM_WORLD);
  }
  // Combine: received rows go back (already grouped by source rank), then the owner sums
  // each token's rows in f32 (same order as moekit: ascending rank), one token at a time in
  // a row buffer that stays in cache (inline conversions, so the loops vectorise).
  void combine(const Tensor& y, const Tensor& out, int64_t hidden) {
    MPI_Alltoallv(y.data(), recv_counts.data(), recv_displs.data(), MPI_BYTE, send.data(), send_counts.data(),
                  send_displs.data(), MPI_BYTE, MPI_COMM_WORLD);
    const auto* back = static_cast<const uint16_t*>(send.data());
    std::vector<std::vector<const uint16_t*>> rows(static_cast<size_t>(out.size(0)));
    for (int d = 0; d < ranks; ++d)
      for (int32_t t : tokens[static_cast<size_t>(d)]) {
        rows[static_cast<size_t>(t)].push_back(back);
        back += hidden;
      }
    std::vector<float> acc(static_cast<size_t>(hidden));
    for (int64_t t = 0; t < out.size(0); ++t) {
      const auto& list = rows[static_cast<size_t>(t)];
      for (int64_t i = 0; i < hidden; ++i)
        acc[static_cast<size_t>(i)] = list.empty() ? 0.0f : std::bit_cast<float>(static_cast<uint32_t>(list[0][i]) << 16);
      for (size_t r = 1; r < list.size(); ++r)
        for (int64_t i = 0; i < hidden; ++i) acc[static_cast<size_t>(i)] += std::bit_cast<float>(static_cast<uint32_t>(list[r][i]) << 16);
      uint16_t* o = out.data_ptr<uint16_t>() + t * hidden;
      for (int64_t i = 0; i < hidden; ++i) {
        const uint32_t b = std::bit_cast<uint32_t>(acc[static_cast<size_t>(i)]);
        o[i] = (b & 0x7fffffffu) > 0x7f800000u ? static_cast<uint16_t>((b >> 16) | 0x40)
                                               : static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
      }
    }
  }
};

bool same_bytes(const void* a, const void* b, size_t n) {
  int same = n == 0 || std::memcmp(a, b, n) == 0;
  MPI_Allreduce(MPI_IN_PLACE, &same, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return same != 0;
}

double mean_over_ranks(double v, int ranks) {
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  return v / ranks;
}

bool print_rank(const World& w) { return w.rank == 0; }

double max_over_ranks(double v) {
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return v;
}

// Low-latency rows: FP8 dispatch and weighted combine of 128 tokens per rank, and the round
// trip next to the same exchange with MPI_Alltoallv (bf16 rows there, as a user would send).
void bench_low_latency(const BenchOptions& options, const World& w, Reporter& report, double ceiling) {
  const int64_t tokens = options.quick ? 32 : 128, hidden = options.quick ? 1024 : 7168;
  const int topk = 8, experts = std::max(256 / w.size * w.size, 8 * w.size);
  const int repeats = options.quick ? 2 : std::max(options.repeats, 20);
  const int64_t local_experts = experts / w.size, slots = tokens * w.size;
  ep::Buffer buffer(MPI_COMM_WORLD, 16 << 20, ep::get_low_latency_rdma_size_hint(tokens, hidden, w.size, experts));
  const int nodes = w.size / buffer.get_num_local_ranks();
  const Tensor x = random_bf16(tokens, hidden, 2000 + static_cast<uint64_t>(w.rank));
  const Tensor idx = random_topk(tokens, topk, experts, 99 + static_cast<uint64_t>(w.rank));
  Tensor weights = Tensor::empty({tokens, topk}, DType::f32);
  for (int64_t i = 0; i < tokens * topk; ++i) weights.data_ptr<float>()[i] = 0.5f + static_cast<float>(i % 5) * 0.125f;

  ep::LowLatencyDispatchArgs args;
  args.x = x;
  args.topk_idx = idx;
  args.num_max_dispatch_tokens_per_rank = tokens;
  args.num_experts = experts;
  ep::LowLatencyDispatchResult result = buffer.low_latency_dispatch(args);
  result.event.wait();
  // Expert outputs = the received rows, dequantised to bf16 (private memory).
  Tensor y = Tensor::zeros({local_experts, slots, hidden}, DType::bf16);
  for (int64_t e = 0; e < local_experts; ++e) {
    const int64_t n = result.recv_count.data_ptr<int32_t>()[e];
    if (n == 0) continue;
    Tensor back = cast_back_from_fp8(result.recv_x.select(0, e).slice(0, 0, n), result.recv_x_scales.select(0, e).slice(0, 0, n), DType::bf16);
    y.select(0, e).slice(0, 0, n).copy_from(back);
  }
  // Reference: each token's own quantise/dequantise round trip times its weight sum.
  const Quantized q = per_token_cast_to_fp8(x, false);
  const Tensor xq = cast_back_from_fp8(q.values, q.sf, DType::f32);
  Tensor expected = Tensor::empty({tokens, hidden}, DType::f32);
  for (int64_t t = 0; t < tokens; ++t) {
    float sum = 0;
    for (int j = 0; j < topk; ++j) sum += weights.data_ptr<float>()[t * topk + j];
    for (int64_t i = 0; i < hidden; ++i) expected.data_ptr<float>()[t * hidden + i] = sum * xq.data_ptr<float>()[t * hidden + i];
  }
  int64_t received = 0;
  for (int64_t e = 0; e < local_experts; ++e) received += result.recv_count.data_ptr<int32_t>()[e];
  const double row_bytes = static_cast<double>(hidden + 4 * ((hidden + 127) / 128));
  const double bytes = mean_over_ranks(static_cast<double>(received) * row_bytes, w.size);

  // Peer round trip: Alltoallv dispatch of bf16 rows (once per destination rank), then back.
  const ep::DispatchLayout layout = buffer.get_dispatch_layout(idx, experts);
  AlltoallvDispatch peer(layout.is_token_in_rank, hidden * 2);
  Tensor peer_out = Tensor::empty({tokens, hidden}, DType::bf16);
  auto peer_round_trip = [&] {
    peer.dispatch(x);
    peer.combine(Tensor::from_blob(peer.recv.data(), {std::max<int64_t>(1, peer.recv.numel() / (hidden * 2)), hidden}, DType::bf16), peer_out, hidden);
  };

  auto row = [&](const std::string& kernel, const std::string& dtype) {
    Row r;
    r.kernel = kernel;
    r.dtype = dtype;
    r.shape = nodes > 1 ? fmt::format("R{}={}x{} T{} H{} top{}/{}", w.size, nodes, w.size / nodes, tokens, hidden, topk, experts)
                        : fmt::format("R{} T{} H{} top{}/{}", w.size, tokens, hidden, topk, experts);
    r.threads = num_threads();
    r.ceiling = "copy_bw";
    r.ceiling_value = ceiling;
    r.peer = "MPI_Alltoallv round trip";
    r.sizes = {{"ranks", w.size}, {"nodes", nodes}, {"tokens", tokens}, {"hidden", hidden}, {"topk", topk}, {"experts", experts}};
    return r;
  };
  ep::LowLatencyCombineResult combined;
  {
    auto [t, tp] = time_pair([&] { result = buffer.low_latency_dispatch(args); result.event.wait(); }, peer_round_trip, repeats, 4);
    Row r = row("low_latency_dispatch", "fp8");
    r.time = t;
    r.peer_time = tp;
    r.gbps = bytes / (t.median_us * 1e3);
    r.calc_diff = 0;
    if (print_rank(w)) report.print(r);
  }
  for (const bool zero_copy : {false, true}) {
    ep::LowLatencyCombineArgs c;
    c.topk_idx = idx;
    c.topk_weights = weights;
    c.handle = result.handle;
    c.zero_copy = zero_copy;
    auto prepare = [&] {
      c.handle = result.handle;
      if (zero_copy) {
        c.x = buffer.get_next_low_latency_combine_buffer(result.handle);
        c.x.copy_from(y);  // stands for the expert GEMM writing its output there (not timed)
      } else {
        c.x = y;
      }
    };
    auto combine = [&] {
      combined = buffer.low_latency_combine(c);
      combined.event.wait();
    };
    // A zero-copy x is the buffer of the combine it is taken for (the next one uses the other
    // half): y is written into both halves' buffers first, and the timed calls take theirs
    // without filling it (the expert GEMM would write there); a last run is checked.
    for (int half = 0; half < 2; ++half) prepare(), combine();
    auto [t, tp] = time_pair([&] {
      if (zero_copy) c.x = buffer.get_next_low_latency_combine_buffer(result.handle);
      combine();
    }, peer_round_trip, repeats, 4);
    prepare();
    combine();
    Row r = row(zero_copy ? "low_latency_combine(zero_copy)" : "low_latency_combine", "bf16");
    r.time = t;
    r.peer_time = tp;
    r.gbps = mean_over_ranks(static_cast<double>(received) * 2.0 * static_cast<double>(hidden), w.size) / (t.median_us * 1e3);
    r.calc_diff = max_over_ranks(calc_diff(combined.combined_x, expected));
    if (print_rank(w)) report.print(r);
  }
  // Round trips. zero_copy: the expert GEMM would write straight into the combine buffer, so
  // the timed loop does not fill it; the checked run afterwards copies y there first.
  for (const bool zero_copy : {false, true}) {
    ep::LowLatencyCombineArgs c;
    c.topk_idx = idx;
    c.topk_weights = weights;
    c.zero_copy = zero_copy;
    auto round_trip = [&](bool fill) {
      result = buffer.low_latency_dispatch(args);
      result.event.wait();
      c.handle = result.handle;
      if (zero_copy) {
        c.x = buffer.get_next_low_latency_combine_buffer(result.handle);
        if (fill) c.x.copy_from(y);
      } else {
        c.x = y;
      }
      combined = buffer.low_latency_combine(c);
      combined.event.wait();
    };
    auto [t, tp] = time_pair([&] { round_trip(false); }, peer_round_trip, repeats, 4);
    round_trip(true);
    Row r = row(zero_copy ? "low_latency_dispatch+combine(zero_copy)" : "low_latency_dispatch+combine", "fp8/bf16");
    r.time = t;
    r.peer_time = tp;
    r.gbps = (bytes + mean_over_ranks(static_cast<double>(received) * 2.0 * static_cast<double>(hidden), w.size)) / (t.median_us * 1e3);
    r.calc_diff = max_over_ranks(calc_diff(combined.combined_x, expected));
    r.notes["round_trip_us"] = fmt::format("{:.1f}", t.median_us);
    if (print_rank(w)) report.print(r);
  }
  buffer.destroy();
}

}  // namespace

void bench_ep(const BenchOptions& options) {
  int initialised = 0;
  MPI_Initialized(&initialised);
  if (!initialised) {
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
  }
  World w;
  MPI_Comm_rank(MPI_COMM_WORLD, &w.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &w.size);
  Reporter report{options.json};
  const bool print = w.rank == 0;

  const int64_t tokens = options.quick ? 256 : 4096, hidden = options.quick ? 1024 : 7168;
  const int topk = 8, experts = std::max(256 / w.size * w.size, 8 * w.size);
  const int repeats = options.quick ? 2 : options.repeats;
  const double ceiling = concurrent_copy_gbps(options.quick ? (64u << 20) : (256u << 20), options.quick ? 1 : 3);
  if (print)
    report.header("ep", {{"copy_bw per rank, all ranks copying (GB/s)", ceiling}});

  ep::Buffer buffer(MPI_COMM_WORLD, 256 << 20);
  const Tensor x = random_bf16(tokens, hidden, 1000 + static_cast<uint64_t>(w.rank));
  const Tensor idx = random_topk(tokens, topk, experts, 77 + static_cast<uint64_t>(w.rank));
  Tensor weights = Tensor::empty({tokens, topk}, DType::f32);
  for (int64_t i = 0; i < tokens * topk; ++i) weights.data_ptr<float>()[i] = 1.0f / topk;
  const ep::DispatchLayout layout = buffer.get_dispatch_layout(idx, experts);
  ep::Config config = ep::Buffer::get_dispatch_config(w.size);
  config.num_sms = num_threads();

  const int nodes = w.size / buffer.get_num_local_ranks();
  // Internode ("RDMA") traffic as DeepEP counts it: each token once per other destination node.
  int64_t rail_tokens = 0;
  if (nodes > 1)
    for (int n = 0; n < nodes; ++n)
      if (n != w.rank / buffer.get_num_local_ranks()) rail_tokens += layout.num_tokens_per_rdma_rank.data_ptr<int32_t>()[n];
  auto base_row = [&](const std::string& kernel, const std::string& dtype) {
    Row r;
    r.kernel = kernel;
    r.dtype = dtype;
    r.shape = nodes > 1 ? fmt::format("R{}={}x{} T{} H{} top{}/{}", w.size, nodes, w.size / nodes, tokens, hidden, topk, experts)
                        : fmt::format("R{} T{} H{} top{}/{}", w.size, tokens, hidden, topk, experts);
    r.threads = num_threads();
    r.ceiling = "copy_bw";
    r.ceiling_value = ceiling;
    r.sizes = {{"ranks", w.size}, {"nodes", nodes}, {"tokens", tokens}, {"hidden", hidden}, {"topk", topk}, {"experts", experts}};
    return r;
  };
  auto note_rail = [&](Row& r, int64_t row_bytes, double us) {
    if (nodes > 1)
      r.notes["rdma_gbps"] = fmt::format("{:.3f}", mean_over_ranks(static_cast<double>(rail_tokens * row_bytes), w.size) / (us * 1e3));
  };

  // ---- dispatch, bf16 and FP8 ----
  for (const bool fp8 : {false, true}) {
    ep::DispatchArgs args;
    Quantized q;
    if (fp8) {
      q = per_token_cast_to_fp8(x, false);
      args.x = q.values;
      args.x_scales = q.sf;
    } else {
      args.x = x;
    }
    args.num_tokens_per_rank = layout.num_tokens_per_rank;
    args.is_token_in_rank = layout.is_token_in_rank;
    args.num_tokens_per_expert = layout.num_tokens_per_expert;
    args.topk_idx = idx;
    args.topk_weights = weights;
    args.config = config;
    const int64_t row_bytes = fp8 ? hidden + 4 * ((hidden + 127) / 128) : 2 * hidden;
    AlltoallvDispatch peer(layout.is_token_in_rank, hidden * static_cast<int64_t>(args.x.element_size()));
    ep::DispatchResult result;
    auto [t, tp] = time_pair([&] { result = buffer.dispatch(args); }, [&] { peer.dispatch(args.x); }, repeats);
    const int64_t recv_rows = result.handle.num_recv_tokens;
    const bool exact = same_bytes(result.recv_x.data(), peer.recv.data(),
                                  static_cast<size_t>(recv_rows * hidden) * args.x.element_size());
    Row r = base_row("dispatch", fp8 ? "fp8" : "bf16");
    r.time = t;
    r.peer = "MPI_Alltoallv+pack";
    r.peer_time = tp;
    r.gbps = mean_over_ranks(static_cast<double>(recv_rows * row_bytes), w.size) / (t.median_us * 1e3);
    r.calc_diff = exact ? 0.0 : 1.0;
    r.notes["bit_exact_vs_alltoallv"] = exact ? "yes" : "NO";
    note_rail(r, row_bytes, t.median_us);
    if (print) report.print(r);

    if (!fp8) {
      // Cached handle: same routing, no layout inputs.
      ep::DispatchArgs cached;
      cached.x = x;
      cached.handle = result.handle;
      cached.config = config;
      ep::DispatchResult again;
      auto [tc, tpc] = time_pair([&] { again = buffer.dispatch(cached); }, [&] { peer.dispatch(x); }, repeats);
      const bool same = same_bytes(again.recv_x.data(), result.recv_x.data(), static_cast<size_t>(recv_rows * hidden) * 2);
      Row rc = base_row("dispatch(cached)", "bf16");
      rc.time = tc;
      rc.peer = "MPI_Alltoallv+pack";
      rc.peer_time = tpc;
      rc.gbps = mean_over_ranks(static_cast<double>(recv_rows * row_bytes), w.size) / (tc.median_us * 1e3);
      rc.calc_diff = same ? 0.0 : 1.0;
      rc.notes["bit_exact_vs_fresh"] = same ? "yes" : "NO";
      if (print) report.print(rc);

      // ---- combine: x private (copied back) and x in the buffer's memory (read in place) ----
      Tensor y_private = Tensor::empty(result.recv_x.shape(), DType::bf16);
      y_private.copy_from(result.recv_x);
      Tensor expected = Tensor::empty({tokens, hidden}, DType::f32);
      for (int64_t tk = 0; tk < tokens; ++tk) {
        int n = 0;
        for (int d = 0; d < w.size; ++d) n += layout.is_token_in_rank.data_ptr<bool>()[tk * w.size + d];
        for (int64_t i = 0; i < hidden; ++i)
          expected.data_ptr<float>()[tk * hidden + i] = static_cast<float>(n) * bf16_to_f32(x.data_ptr<uint16_t>()[tk * hidden + i]);
      }
      Tensor peer_out = Tensor::empty({tokens, hidden}, DType::bf16);
      for (const bool in_place : {false, true}) {
        ep::CombineArgs c;
        c.x = in_place ? result.recv_x : y_private;
        c.handle = result.handle;
        c.config = config;
        ep::CombineResult combined;
        // (warm-up: past the buffer's first combines, which try both ways of moving a private x)
        auto [tcb, tpcb] = time_pair([&] { combined = buffer.combine(c); },
                                     [&] { peer.combine(y_private, peer_out, hidden); }, repeats, in_place ? 1 : 7);
        const bool same = same_bytes(combined.combined_x.data(), peer_out.data(), static_cast<size_t>(tokens * hidden) * 2);
        Row rb = base_row(in_place ? "combine(x in buffer)" : "combine", "bf16");
        rb.time = tcb;
        rb.peer = "MPI_Alltoallv+sum";
        rb.peer_time = tpcb;
        rb.gbps = mean_over_ranks(static_cast<double>(recv_rows * row_bytes), w.size) / (tcb.median_us * 1e3);
        rb.calc_diff = max_over_ranks(calc_diff(combined.combined_x, expected));
        // One node: the same f32 sum in the same order, so bit-identical; across nodes the
        // partials are associated per node (docs/EP.md), so only calc_diff is compared.
        rb.notes[nodes > 1 ? "same_as_alltoallv" : "bit_exact_vs_alltoallv"] = same ? "yes" : (nodes > 1 ? "no" : "NO");
        // (whether owners read private x from its rank's memory: Buffer::combine_private_x)
        if (nodes == 1 && !in_place) rb.notes["private_x"] = buffer.combine_private_x();
        note_rail(rb, 2 * hidden, tcb.median_us);
        if (print) report.print(rb);
      }
    }
  }
  buffer.destroy();
  bench_low_latency(options, w, report, ceiling);
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!initialised && !finalized) MPI_Finalize();
}

}  // namespace moekit::tools

#include "bench_common.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>

#include "moekit/formats.h"
#include "moekit/runtime.h"
#include "peak.h"
#include <nlohmann/json.hpp>

namespace moekit::tools {

Tensor random_bf16(int64_t rows, int64_t cols, uint64_t seed, bool row_spread) {
  Tensor t = Tensor::empty({rows, cols}, DType::bf16);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    std::mt19937_64 rng(seed * 1000003 + static_cast<uint64_t>(r));
    std::normal_distribution<float> dist(0.0f, row_spread ? 1.0f + static_cast<float>(r % 7) : 1.0f);
    auto* row = t.data_ptr<uint16_t>() + r * cols;
    for (int64_t c = 0; c < cols; ++c) row[c] = f32_to_bf16(dist(rng));
  }
  return t;
}

Timing time_it(const std::function<void()>& fn, int repeats, int warmup) {
  return time_round_robin({fn}, repeats, warmup)[0];
}

std::vector<Timing> time_round_robin(const std::vector<std::function<void()>>& fns, int repeats, int warmup) {
  for (int i = 0; i < warmup; ++i)
    for (const auto& f : fns) f();
  std::vector<std::vector<double>> us(fns.size());
  for (int i = 0; i < repeats; ++i)
    for (size_t j = 0; j < fns.size(); ++j) {
      const auto t0 = std::chrono::steady_clock::now();
      fns[j]();
      us[j].push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
  std::vector<Timing> out;
  for (auto& v : us) {
    std::sort(v.begin(), v.end());
    out.push_back(Timing{v[v.size() / 2], v.front(), repeats});
  }
  return out;
}

std::pair<Timing, Timing> time_interleaved(const std::function<void()>& fn, const std::function<void()>& peer,
                                           int repeats, int warmup) {
  const std::vector<Timing> t = time_round_robin({fn, peer}, repeats, warmup);
  return {t[0], t[1]};
}

void RunCeilings::remeasure() {
  if (with_flops) bf16_tflops = std::max(bf16_tflops, measure_bf16_flops(quick ? 1 : 2) / 1e12);
  read_gbps = std::max(read_gbps, measure_read_bandwidth(dram_working_set(int64_t{512} << 20), quick ? 1 : 2) / 1e9);
  if (with_copy) copy_gbps = std::max(copy_gbps, measure_copy_bandwidth(dram_working_set(int64_t{512} << 20), quick ? 1 : 2) / 1e9);
}

void RunCeilings::finish(Row& row) const {
  if (row.ceiling == "bf16_flops") row.ceiling_value = bf16_tflops;
  else if (row.ceiling == "read_bw") row.ceiling_value = read_gbps;
  else if (row.ceiling == "copy_bw") row.ceiling_value = copy_gbps;
  if (row.roofline_bytes < 0 || row.roofline_flops < 0 || read_gbps <= 0 || bf16_tflops <= 0) return;
  const double t_mem = row.roofline_bytes / (read_gbps * 1e9), t_flop = row.roofline_flops / (bf16_tflops * 1e12);
  row.notes["bound"] = t_mem >= t_flop ? "memory" : "compute";
  row.notes["pct_of_roofline"] = fmt::format("{:.1f}", 100.0 * std::max(t_mem, t_flop) / (row.time.median_us * 1e-6));
}

std::map<std::string, double> RunCeilings::header() const {
  std::map<std::string, double> out{{"read_bw_GBps", read_gbps}};
  if (with_flops) out["bf16_flops_TFLOPs"] = bf16_tflops;
  if (with_copy) out["copy_bw_GBps"] = copy_gbps;
  return out;
}

void Reporter::header(const std::string& suite, const std::map<std::string, double>& ceilings) {
  if (json) {
    // (the ISA says which kernels the rows ran: under amx the GEMMs run on AMX tiles)
    nlohmann::json j = {{"suite", suite}, {"isa", isa_name(active_isa())}};
    for (const auto& [name, value] : ceilings) j["ceilings"][name] = value;
    fmt::print("{}\n", j.dump());
    std::fflush(stdout);  // flushed line by line: a run cut short keeps every finished row
    return;
  }
  fmt::print("\n== moekit bench {} (isa {}) ==\n", suite, isa_name(active_isa()));
  for (const auto& [name, value] : ceilings) fmt::print("ceiling {} = {:.2f}\n", name, value);
  fmt::print("{:<26} {:<22} {:<7} {:>3} {:>11} {:>9} {:>6}  {:<18} {:>11} {:>7} {:>9}\n", "kernel", "shape", "dtype", "thr",
             "time_us", "value", "%ceil", "peer", "peer_us", "speedup", "calc_diff");
  std::fflush(stdout);
}

void Reporter::print(const Row& r) {
  const bool flops = r.tflops >= 0;
  const double value = flops ? r.tflops : r.gbps;
  const double pct = r.ceiling_value > 0 ? 100.0 * value / r.ceiling_value : 0.0;
  const double speedup = r.peer_time.median_us > 0 ? r.peer_time.median_us / r.time.median_us : 0.0;
  if (json) {
    nlohmann::json j = {{"kernel", r.kernel}, {"shape", r.shape}, {"dtype", r.dtype}, {"backend", r.backend},
                        {"threads", r.threads}, {"time_us", r.time.median_us}, {"min_time_us", r.time.min_us},
                        {"runs", r.time.runs}, {"ceiling", r.ceiling}, {"ceiling_value", r.ceiling_value},
                        {"pct_of_ceiling", pct}, {"peer", r.peer}, {"peer_time_us", r.peer_time.median_us},
                        {"speedup_vs_peer", speedup}, {"calc_diff", r.calc_diff}};
    j[flops ? "tflops" : "gbps"] = value;
    for (const auto& [k, v] : r.sizes) j[k] = v;
    for (const auto& [k, v] : r.notes) j[k] = v;
    fmt::print("{}\n", j.dump());
    std::fflush(stdout);  // a row is complete as soon as it is measured, even if a later one is cut short
    return;
  }
  std::string notes;
  for (const auto& [k, v] : r.notes) notes += fmt::format(" {}={}", k, v);
  fmt::print("{:<26} {:<22} {:<7} {:>3} {:>11.1f} {:>7.3f}{:<3} {:>5.1f}%  {:<18} {:>11.1f} {:>6.2f}x {:>9.2e}{}\n", r.kernel,
             r.shape, r.dtype, r.threads, r.time.median_us, value, flops ? " TF" : " GB", pct, r.peer,
             r.peer_time.median_us, speedup, r.calc_diff, notes);
  std::fflush(stdout);
}

}  // namespace moekit::tools

// The moekit command: machine ceilings (peak), benchmark suites (bench), machine info.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench_common.h"
#include "moekit/error.h"
#include "moekit/runtime.h"
#include "peak.h"

namespace {

using namespace moekit;

void print_info(bool json) {
  const CpuFeatures& f = cpu_features();
  const nlohmann::json j = {{"isa_best", isa_name(best_supported_isa())}, {"isa_active", isa_name(active_isa())},
                            {"threads", num_threads()}, {"avx2", f.avx2}, {"fma", f.fma}, {"avx512f", f.avx512f},
                            {"avx512bw", f.avx512bw}, {"avx512vl", f.avx512vl}, {"avx512bf16", f.avx512bf16},
                            {"avx512vnni", f.avx512vnni}, {"avx512vbmi", f.avx512vbmi}, {"gfni", f.gfni},
                            {"os_saves_zmm", f.os_saves_zmm}, {"amx_bf16", f.amx_bf16},
                            {"cuda_devices", cuda_device_count()}};
  if (json) fmt::print("{}\n", j.dump());
  else fmt::print("{}\n", j.dump(2));
}

void print_peak(const tools::PeakOptions& options, bool json) {
  const auto ceilings = tools::measure_peak(options);
  if (!json) {
    fmt::print("moekit peak (isa {}, {} threads; arrays of {} MiB)\n", isa_name(best_supported_isa()), num_threads(),
               options.bandwidth_bytes >> 20);
    fmt::print("{:<11} {:>7} {:>12}  {}\n", "ceiling", "threads", "value", "best way");
  }
  for (const auto& c : ceilings) {
    const bool flops = c.name.find("flops") != std::string::npos;
    const double v = c.value / 1e9;
    if (json) {
      fmt::print("{}\n", nlohmann::json({{"ceiling", c.name}, {"threads", c.threads}, {"value", v},
                                         {"unit", flops ? "GFLOP/s" : "GB/s"}, {"method", c.method}})
                             .dump());
    } else {
      fmt::print("{:<11} {:>7} {:>8.1f} {:<4} {}\n", c.name, c.threads, v, flops ? "GF/s" : "GB/s", c.method);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"moekit: MoE kernels and expert-parallel communication on the CPU"};
  app.require_subcommand(1);
  bool json = false;
  app.add_flag("--json", json, "one JSON object per line");

  auto* info = app.add_subcommand("info", "CPU features and the instruction set in use");
  tools::PeakOptions peak_options;
  int64_t peak_mib = 0;  // 0: max(1 GiB, 4x the last-level cache)
  auto* peak = app.add_subcommand("peak", "measure this machine's ceilings (FLOP/s, bandwidth)");
  peak->add_option("--mib", peak_mib, "bandwidth array size in MiB (default: max(1024, 4x the last-level cache))")->check(CLI::Range(0, 0) | CLI::Range(64, 1 << 16));
  peak->add_option("--repeats", peak_options.repeats, "timed repeats per way (best kept)")->check(CLI::Range(1, 100));

  tools::BenchOptions bench_options;
  std::vector<std::string> suites;
  auto* bench = app.add_subcommand("bench", "run benchmark suites (rows per shared/spec/benchmarks.md)");
  bench->add_option("suites", suites, "suites: formats, gemm, grouped, all; ep (under mpirun)")->required()->check(CLI::IsMember({"formats", "gemm", "grouped", "ep", "all"}));
  bench->add_option("--m", bench_options.gemm_m, "gemm: run only these M");
  bench->add_option("--n", bench_options.gemm_n, "gemm: run only the shapes with these N");
  bench->add_option("--peer-isa", bench_options.peer_isa, "formats: the moekit instruction set timed as the peer")
      ->check(CLI::IsMember({"scalar", "avx2", "avx512"}));
  bench->add_flag("--quick", bench_options.quick, "small sizes, few repeats (smoke run)");
  bench->add_option("--repeats", bench_options.repeats, "timed repeats (median reported)")->check(CLI::Range(1, 1000));

  CLI11_PARSE(app, argc, argv);
  try {
    if (*info) print_info(json);
    if (*peak) {
      peak_options.bandwidth_bytes = peak_mib > 0 ? peak_mib << 20 : tools::dram_working_set(int64_t{1} << 30);
      print_peak(peak_options, json);
    }
    if (*bench) {
      bench_options.json = json;
      for (const auto& s : suites) {
        if (s == "formats" || s == "all") tools::bench_formats(bench_options);
        if (s == "gemm" || s == "all") tools::bench_gemm(bench_options);
        if (s == "grouped" || s == "all") tools::bench_grouped(bench_options);
        if (s == "ep") tools::bench_ep(bench_options);
      }
    }
  } catch (const moekit::Error& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 2;
  }
  return 0;
}

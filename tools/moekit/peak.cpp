// Ceilings measured several ways; each keeps its best way (a ceiling that reads low would
// flatter every "% of ceiling" figure).
#include "peak.h"

#include <omp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <set>

#include "moekit/runtime.h"

namespace moekit::tools {

namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Runs body(thread, threads) on `threads` threads; returns the best wall time of `repeats`.
double best_time(int threads, int repeats, const std::function<void(int, int)>& body) {
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    double start = 0, stop = 0;
#pragma omp parallel num_threads(threads)
    {
#pragma omp barrier
#pragma omp single
      start = now_seconds();
      body(omp_get_thread_num(), threads);
#pragma omp barrier
#pragma omp single
      stop = now_seconds();
    }
    best = std::min(best, stop - start);
  }
  return best;
}

struct Buffer {
  std::unique_ptr<char, decltype(&std::free)> data{nullptr, &std::free};
  int64_t bytes = 0;
};

// First touch from the threads that will read it (page placement), 4 KiB aligned.
Buffer make_buffer(int64_t bytes, int threads) {
  Buffer b;
  b.bytes = bytes;
  constexpr int64_t kHuge = 2 << 20;
  bytes = (bytes + kHuge - 1) / kHuge * kHuge;
  b.bytes = bytes;
  b.data.reset(static_cast<char*>(std::aligned_alloc(kHuge, static_cast<size_t>(bytes))));
  // Transparent huge pages: fewer TLB misses, so the loop measures DRAM, not page walks.
  madvise(b.data.get(), static_cast<size_t>(bytes), MADV_HUGEPAGE);
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    const int64_t chunk = bytes / threads / 4096 * 4096;
    const int64_t begin = t * chunk, end = t == threads - 1 ? bytes : begin + chunk;
    std::memset(b.data.get() + begin, t + 1, static_cast<size_t>(end - begin));
  }
  return b;
}

// Thread t's 4 KiB-aligned share of [0, bytes).
std::pair<int64_t, int64_t> share(int64_t bytes, int t, int threads) {
  const int64_t chunk = bytes / threads / 4096 * 4096;
  return {t * chunk, t == threads - 1 ? bytes / 4096 * 4096 - t * chunk : chunk};
}

void keep_best(std::vector<Ceiling>& out, Ceiling c) {
  for (Ceiling& e : out)
    if (e.name == c.name && e.threads == c.threads) {
      if (c.value > e.value) e = c;
      return;
    }
  out.push_back(std::move(c));
}

void measure_compute(std::vector<Ceiling>& out, int threads, int repeats) {
  const CpuFeatures& f = cpu_features();
  const int64_t iterations = 20'000'000;
  auto flops = [&](double (*loop)(int64_t)) {
    const double ops = loop(1000);  // per-thread operations of one call at `iterations`
    const double per_call = ops / 1000 * static_cast<double>(iterations);
    const double t = best_time(threads, repeats, [&](int, int) { loop(iterations); });
    return per_call * threads / t;
  };
  if (isa_supported(Isa::avx2)) {
    const double v = flops(&kernels::fma_f32_avx2);
    keep_best(out, {"f32_flops", "avx2 vfmadd231ps ymm", threads, v});
    // bf16 values are exact in f32, so an f32 FMA on widened bf16 is a bf16 dot: the
    // ceiling for bf16 math on CPUs without AVX512_BF16.
    keep_best(out, {"bf16_flops", "f32 FMA on widened bf16 (avx2)", threads, v});
  }
  if (isa_supported(Isa::avx512)) {
    for (auto [loop, way] : {std::pair{&kernels::fma_f32_avx512, "12 chains"}, std::pair{&kernels::fma_f32_avx512_24, "24 chains"}}) {
      const double v = flops(loop);
      keep_best(out, {"f32_flops", std::string("avx512 vfmadd231ps zmm, ") + way, threads, v});
      keep_best(out, {"bf16_flops", std::string("f32 FMA on widened bf16 (avx512), ") + way, threads, v});
    }
    if (f.avx512bf16) {
      keep_best(out, {"bf16_flops", "avx512_bf16 vdpbf16ps zmm, 12 chains", threads, flops(&kernels::dot_bf16_avx512)});
      keep_best(out, {"bf16_flops", "avx512_bf16 vdpbf16ps zmm, 24 chains", threads, flops(&kernels::dot_bf16_avx512_24)});
    }
  }
  if (isa_supported(Isa::amx))
    keep_best(out, {"bf16_flops", "amx_bf16 tdpbf16ps tiles", threads, flops(&kernels::dot_bf16_amx)});
}

double read_bandwidth(const Buffer& b, int threads, int repeats, void (*loop)(const void*, int64_t, int64_t*)) {
  std::vector<int64_t> sinks(static_cast<size_t>(threads) * 8, 0);
  const double t = best_time(threads, repeats, [&](int id, int n) {
    const auto [begin, len] = share(b.bytes, id, n);
    loop(b.data.get() + begin, len, &sinks[static_cast<size_t>(id) * 8]);
  });
  return static_cast<double>(b.bytes / 4096 * 4096) / t;
}

// Copy bandwidth (read + write bytes, as STREAM counts) on `threads` threads, each way.
void copy_bandwidths(std::vector<Ceiling>& out, const Buffer& src, const Buffer& dst, int threads, int repeats) {
  const double copied = 2.0 * static_cast<double>(src.bytes / 4096 * 4096);
  const double t_memcpy = best_time(threads, repeats, [&](int id, int n) {
    const auto [begin, len] = share(src.bytes, id, n);
    std::memcpy(dst.data.get() + begin, src.data.get() + begin, static_cast<size_t>(len));
  });
  keep_best(out, {"copy_bw", "memcpy", threads, copied / t_memcpy});
  if (isa_supported(Isa::avx2)) {
    const double t_stream = best_time(threads, repeats, [&](int id, int n) {
      const auto [begin, len] = share(src.bytes, id, n);
      kernels::copy_stream_avx2(src.data.get() + begin, dst.data.get() + begin, len);
    });
    keep_best(out, {"copy_bw", "avx2 loads + non-temporal stores", threads, copied / t_stream});
  }
  if (isa_supported(Isa::avx512)) {
    const double t_stream = best_time(threads, repeats, [&](int id, int n) {
      const auto [begin, len] = share(src.bytes, id, n);
      kernels::copy_stream_avx512(src.data.get() + begin, dst.data.get() + begin, len);
    });
    keep_best(out, {"copy_bw", "avx512 loads + non-temporal stores", threads, copied / t_stream});
  }
}

}  // namespace

double measure_bf16_flops(int repeats) {
  std::vector<Ceiling> out;
  measure_compute(out, num_threads(), repeats);
  double best = 0;
  for (const Ceiling& c : out)
    if (c.name == "bf16_flops") best = std::max(best, c.value);
  return best;
}

double measure_read_bandwidth(int64_t bytes, int repeats) {
  const int threads = num_threads();
  const Buffer b = make_buffer(bytes, threads);
  double best = 0;
  if (isa_supported(Isa::avx2))
    for (auto* loop : {&kernels::read_avx2, &kernels::read_prefetch_avx2, &kernels::read_4streams_avx2})
      best = std::max(best, read_bandwidth(b, threads, repeats, loop));
  if (isa_supported(Isa::avx512)) best = std::max(best, read_bandwidth(b, threads, repeats, &kernels::read_avx512));
  return best;
}

// The data caches of the highest level, each counted once (by the CPUs sharing it), summed:
// on multi-die or multi-socket CPUs every die's L3 holds part of an all-thread working set.
int64_t scan_last_level_caches() {
  int best_level = 0;
  int64_t total = 0;
  std::set<std::string> seen;  // shared_cpu_list of the caches counted at best_level
  const long cpus = std::max(1L, sysconf(_SC_NPROCESSORS_CONF));
  for (long cpu = 0; cpu < cpus; ++cpu)
    for (int index = 0; index < 16; ++index) {
      const std::string dir = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/cache/index" + std::to_string(index) + "/";
      std::ifstream type_file(dir + "type"), size_file(dir + "size"), level_file(dir + "level"), shared_file(dir + "shared_cpu_list");
      std::string type, size, shared;
      int level = 0;
      if (!(type_file >> type) || !(size_file >> size) || !(level_file >> level) || type == "Instruction" || size.empty())
        continue;
      shared_file >> shared;
      if (level < best_level) continue;
      if (level > best_level) best_level = level, total = 0, seen.clear();
      if (!seen.insert(shared.empty() ? std::to_string(cpu) : shared).second) continue;
      const char unit = size.back();
      int64_t bytes = std::atoll(size.c_str());
      bytes *= unit == 'K' ? 1024 : unit == 'M' ? 1024 * 1024 : unit == 'G' ? int64_t{1} << 30 : 1;
      total += bytes;
    }
  if (total == 0) total = std::max<int64_t>(0, sysconf(_SC_LEVEL3_CACHE_SIZE));
  return total > 0 ? total : int64_t{32} << 20;
}

int64_t last_level_cache_bytes() {
  static const int64_t bytes = scan_last_level_caches();  // suites ask before every problem
  return bytes;
}

int64_t dram_working_set(int64_t floor) { return std::max(floor, 4 * last_level_cache_bytes()); }

std::vector<Ceiling> measure_peak(const PeakOptions& options) {
  std::vector<Ceiling> out;
  const int all = num_threads();
  std::vector<int> counts = {1};
  if (all > 1) counts.push_back(all);
  for (int t : counts) measure_compute(out, t, options.repeats);

  const Buffer src = make_buffer(options.bandwidth_bytes, all);
  for (int t : counts) {
    if (isa_supported(Isa::avx2)) {
      keep_best(out, {"read_bw", "avx2 loads, 4 xor chains", t, read_bandwidth(src, t, options.repeats, &kernels::read_avx2)});
      keep_best(out, {"read_bw", "avx2 loads + prefetch 1 KiB ahead", t, read_bandwidth(src, t, options.repeats, &kernels::read_prefetch_avx2)});
      keep_best(out, {"read_bw", "avx2 loads, 4 interleaved streams", t, read_bandwidth(src, t, options.repeats, &kernels::read_4streams_avx2)});
    }
    if (isa_supported(Isa::avx512))
      keep_best(out, {"read_bw", "avx512 loads, 4 xor chains", t, read_bandwidth(src, t, options.repeats, &kernels::read_avx512)});
  }
  const Buffer dst = make_buffer(options.bandwidth_bytes, all);
  for (int t : counts) copy_bandwidths(out, src, dst, t, options.repeats);
  return out;
}

double measure_copy_bandwidth(int64_t bytes, int repeats) {
  const int threads = num_threads();
  const Buffer src = make_buffer(bytes, threads), dst = make_buffer(bytes, threads);
  std::vector<Ceiling> out;
  copy_bandwidths(out, src, dst, threads, repeats);
  double best = 0;
  for (const Ceiling& c : out) best = std::max(best, c.value);
  return best;
}

}  // namespace moekit::tools

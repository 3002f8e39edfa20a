// `moekit peak`: this machine's measured ceilings (benchmarks.md "Ceilings").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moekit::tools {

struct Ceiling {
  std::string name;    // bf16_flops, f32_flops, read_bw, copy_bw
  std::string method;  // the way that gave the best figure
  int threads = 1;
  double value = 0;    // FLOP/s or bytes/s
};

struct PeakOptions {
  int64_t bandwidth_bytes = int64_t{1} << 30;  // per array; far above the last-level cache
  int repeats = 7;
};

std::vector<Ceiling> measure_peak(const PeakOptions& options);
// The last-level data caches of this machine, summed over dies and sockets (sysfs, else
// sysconf; 32 MiB when neither says).
int64_t last_level_cache_bytes();
// A working set that streams from DRAM: at least `floor` and at least 4x the last-level
// cache (hosts with hundreds of MiB of L3 would otherwise serve "DRAM" rows from cache).
int64_t dram_working_set(int64_t floor);
// The all-thread bf16 dot-product ceiling (FLOP/s): the best of AMX tiles, vdpbf16ps and f32
// FMA on widened bf16, as far as the CPU has them.
double measure_bf16_flops(int repeats);
// The best all-thread read bandwidth (bytes/s), measured quickly for benchmark suites.
double measure_read_bandwidth(int64_t bytes, int repeats);
// The best all-thread copy bandwidth (read + write bytes/s), likewise.
double measure_copy_bandwidth(int64_t bytes, int repeats);


// ISA-specific loops (peak_avx2.cpp / peak_avx512.cpp). Each returns the operations done.
namespace kernels {
double fma_f32_avx2(int64_t iterations);          // FLOPs
double fma_f32_avx512(int64_t iterations);
double fma_f32_avx512_24(int64_t iterations);     // (24 accumulator chains instead of 12)
double dot_bf16_avx512(int64_t iterations);       // FLOPs (vdpbf16ps)
double dot_bf16_avx512_24(int64_t iterations);    // (24 accumulator chains instead of 12)
double dot_bf16_amx(int64_t iterations);          // FLOPs (tdpbf16ps; only after amx_permitted)
void read_avx2(const void* data, int64_t bytes, int64_t* sink);
void read_prefetch_avx2(const void* data, int64_t bytes, int64_t* sink);
void read_4streams_avx2(const void* data, int64_t bytes, int64_t* sink);
void read_avx512(const void* data, int64_t bytes, int64_t* sink);
void copy_stream_avx2(const void* src, void* dst, int64_t bytes);
void copy_stream_avx512(const void* src, void* dst, int64_t bytes);
}  // namespace kernels

}  // namespace moekit::tools

// Quantisation casts, dequantisation, scale packing and calc_diff (formats.md).
// Rows are independent, so every cast parallelises over rows (or row blocks), handed out in
// chunks that threads claim as they go (core/work_split.h); each output element is computed
// the same way whatever the thread count or the thread that claims it.
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <vector>

#include "../../core/check.h"
#include "../../core/device_memory.h"
#include "../../core/stream_copy.h"
#include "../../core/work_split.h"
#include "format_kernels.h"
#include "moekit/formats.h"
#include "moekit/runtime.h"

namespace moekit {

using detail::ceil_div;
using detail::check_cpu_matrix;
using detail::check_shape;
using detail::fail;
using detail::Narrow;
using detail::Wide;

namespace {

constexpr float kAmaxFloor = 1e-4f;
constexpr float kE4m3Max = 448.0f;
constexpr float kE2m1Max = 6.0f;
// Below this many elements a cast runs on one thread: forking costs more than it saves.
constexpr int64_t kParallelThreshold = 1 << 15;

int threads_for(int64_t elements) { return elements >= kParallelThreshold ? num_threads() : 1; }
// Outputs beyond this size cannot stay in the last-level cache for a consumer anyway, so
// their block stores are non-temporal (no read-for-ownership of the destination lines).
std::atomic<int64_t> g_streaming_bytes{int64_t{64} << 20};
bool streaming(const Tensor& out) {
  return out.numel() * static_cast<int64_t>(out.element_size()) >= g_streaming_bytes.load(std::memory_order_relaxed);
}

// Dequantised rows far larger than the cache go out through a per-thread stage: the kernel
// writes a chunk of whole scale groups into it with ordinary stores (it stays in L1), and
// copy_stream streams the chunk out. Measured on a 2-vCPU Xeon (AMX host, 2026-12-01, FP8 ->
// bf16, 960 MiB in / 1.9 GiB out, 2 threads): non-temporal stores issued by the kernel itself,
// between its arithmetic, ran at 12 GB/s against 21 with ordinary stores and 23 staged (chunks
// of 1024-2048 columns; 4096 fell to 19), as a plain streaming loop with as many operations
// between its stores slowed from 42 to 9 GB/s.
class StreamedRows {
 public:
  // cols per row of out (esize bytes each), scale groups of gran columns.
  StreamedRows(bool stream, int64_t cols, int64_t esize, int64_t gran)
      : chunk_(chunk_columns(cols, std::max<int64_t>(1, gran))), esize_(esize) {
    if (stream) stage_.resize(static_cast<size_t>(chunk_ * esize_ + 64));
  }
  // row(dst, c0, n): the kernel call writing columns [c0, c0 + n) at dst (n is a multiple of
  // the scale groups unless it ends the row).
  template <class Row>
  void write(char* out_row, int64_t cols, Row row) {
    if (stage_.empty()) return row(out_row, 0, cols);
    char* stage = stage_.data() + (64 - reinterpret_cast<uintptr_t>(stage_.data()) % 64) % 64;
    for (int64_t c0 = 0; c0 < cols; c0 += chunk_) {
      const int64_t n = std::min(chunk_, cols - c0);
      row(stage, c0, n);
      detail::copy_stream(out_row + c0 * esize_, stage, static_cast<size_t>(n * esize_));
    }
  }
  ~StreamedRows() {
    if (!stage_.empty()) detail::stream_fence();
  }

 private:
  static constexpr int64_t kChunkColumns = 2048;
  // Whole groups of about kChunkColumns (one group if longer), at least 1, at most the row.
  static int64_t chunk_columns(int64_t cols, int64_t gran) {
    return std::max<int64_t>(1, std::min(cols, gran >= kChunkColumns ? gran : kChunkColumns / gran * gran));
  }
  int64_t chunk_, esize_;
  std::vector<char> stage_;
};

// Column strips of the per-block and per-channel casts (set_cast_strip_budget): a quarter of
// the core's L2, so that the strip being quantised and the next one, requested meanwhile,
// both stay there. Measured with bf16 128-row blocks of 8192 columns, 2 threads,
// DRAM-sized input:
// - Emerald Rapids class (2 MiB L2), strips of 4096 columns (half of L2, 8 KiB row segments):
//   1.15-1.2x faster than whole rows;
// - the 2-vCPU AMX Xeon (2 MiB L2, 2026-12-02), 2048 columns (a quarter, 4 KiB segments)
//   against 4096: per-channel f32 scales 17.6-18.0 -> 19.1-19.5 GB/s, ue8m0 19.0 -> 19.4,
//   per-block 19.4 -> 21.0;
// - Zen 3: strips of 2-4 KiB segments were 5-15 % slower than whole rows (the 128
//   interleaved short streams defeat its prefetcher). A quarter of its 512 KiB-1 MiB L2
//   gives segments of 1-2 KiB, under the floor, so there (and on Zen 4) rows stay whole.
constexpr int64_t kMinStripSegmentBytes = 4 << 10;
int64_t default_strip_budget() {
  const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
  return l2 > 0 ? l2 / 4 : 0;
}
std::atomic<int64_t> g_strip_budget{default_strip_budget()};

// Strip width for a scale group of `rows` rows of `cols` elements of esize bytes: a multiple
// of unit (the scale groups along the row), or cols for whole rows.
int64_t strip_columns(int64_t rows, int64_t cols, int64_t esize, int64_t unit) {
  const int64_t budget = g_strip_budget.load(std::memory_order_relaxed);
  const int64_t width = budget / std::max<int64_t>(1, rows * esize) / unit * unit;
  return width * esize < kMinStripSegmentBytes || width >= cols ? cols : width;
}

Wide wide_of(const Tensor& t) { return t.dtype() == DType::bf16 ? Wide::bf16 : Wide::f32; }

const char* row_ptr(const Tensor& t, int64_t r) {
  return static_cast<const char*>(t.data()) + r * t.stride(0) * static_cast<int64_t>(t.element_size());
}
char* row_ptr_mut(const Tensor& t, int64_t r) { return const_cast<char*>(row_ptr(t, r)); }

void finish_scales(float* sf, int64_t n, float max_code, bool use_ue8m0) {
  for (int64_t i = 0; i < n; ++i) sf[i] = std::max(sf[i], kAmaxFloor) / max_code;
  if (!use_ue8m0) return;
  // ceil_pow2 inline for positive normal scales (all of them, short of NaN or inf amaxes):
  // adding 2^23 - 1 carries a non-zero mantissa into the exponent, then the mantissa is dropped.
  // (Integer masks rather than branches, so that the loop vectorises.)
  uint32_t not_normal = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = std::bit_cast<uint32_t>(sf[i]);
    const uint32_t normal = 0u - static_cast<uint32_t>(bits - 0x00800000u < 0x7f000000u);
    not_normal |= ~normal;
    sf[i] = std::bit_cast<float>((((bits + 0x007fffffu) & 0x7f800000u) & normal) | (bits & ~normal));
  }
  if (not_normal != 0)
    for (int64_t i = 0; i < n; ++i) sf[i] = detail::ceil_pow2(sf[i]);  // the rest (powers of two stay)
}

// The quantize kernel's per-element reciprocals of sf, written to inv in its block order:
// none (values null) unless every sf is a positive normal number, as the kernel requires;
// exact when every sf is also a power of two (ue8m0 scales). lanes (2n floats; null unless
// x is bf16 and the target has bf16_lane_order): the reciprocals and sf in that order instead.
detail::Reciprocals reciprocals(const detail::FormatKernels& kern, const float* sf, int64_t n, float* inv, float* lanes) {
  uint32_t not_normal = 0, mantissas = 0;  // masks, not early exits: the loop vectorises
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = std::bit_cast<uint32_t>(sf[i]);
    not_normal |= static_cast<uint32_t>(bits - 0x00800000u >= 0x7f000000u);
    mantissas |= bits & 0x007fffffu;
    inv[i] = 1.0f / sf[i];
  }
  if (not_normal != 0) return {};
  if (lanes != nullptr) {
    kern.bf16_lane_order(inv, lanes, n);
    kern.bf16_lane_order(sf, lanes + n, n);
    return {lanes, mantissas == 0, lanes + n};
  }
  kern.block_order(inv, inv, n);
  return {inv, mantissas == 0};
}

// Per-column amaxes of rows [r0, r1) of x over columns [c0, c0 + n): col[c] = max |x[r, c0 + c]|
// as f32, or NaN where a column holds one. The maxima are taken on |x| bit patterns (integer
// order is float order for them, and NaN patterns sort above inf), so they are exact, NaN
// sticky and independent of the order of rows, like amax_groups; bf16 rows on 16-bit patterns
// where the target has that kernel (acc16: n words of scratch).
// The rows come from DRAM in short segments (column strips), which the hardware prefetcher
// follows poorly: each KiB read requests the same KiB of the next rows into L2. Measured on
// the 2-vCPU Xeon (AMX host, 2026-12-01, per-block cast, 2 GiB bf16, 2 threads): the amax pass
// alone 95 -> 81 ms, the cast 1.07-1.1x; prefetching into L1, or 1 or 4 rows ahead, less.
// bf16 rows go kAmaxRows at a time through one load and store of the accumulators, and the
// requests run one such group ahead (2026-12-02, same host: per-block cast 139-144 -> 129-136
// ms, per-channel 2-5 % faster; from L2 alone 18 -> 27 bytes per cycle).
void column_amax(const detail::FormatKernels& kern, const Tensor& x, int64_t r0, int64_t r1, int64_t c0, int64_t n,
                 std::vector<uint16_t>& acc16, float* col) {
  constexpr int64_t kChunkBytes = 1024;
  const int64_t esize = static_cast<int64_t>(x.element_size()), chunk = kChunkBytes / esize;
  const bool bf16 = x.dtype() == DType::bf16 && kern.amax_accumulate_bf16 != nullptr;
  const int64_t rows_ahead = bf16 ? detail::kAmaxRows : 2;  // one group ahead; row by row, two (measured)
  if (bf16) acc16.assign(static_cast<size_t>(n), uint16_t{0});
  else std::fill(col, col + n, 0.0f);
  const int64_t stride = x.stride(0);
  for (int64_t r = r0; r < r1;) {
    const int rows = bf16 ? static_cast<int>(std::min<int64_t>(detail::kAmaxRows, r1 - r)) : 1;
    const char* row = row_ptr(x, r) + c0 * esize;
    for (int64_t c = 0; c < n; c += chunk) {
      const int64_t len = std::min(chunk, n - c);
      for (int64_t ahead = r + rows_ahead; ahead < std::min(r1, r + rows_ahead + rows); ++ahead) {
        const char* p = row_ptr(x, ahead) + (c0 + c) * esize;
        for (int64_t b = 0; b < len * esize; b += 64) __builtin_prefetch(p + b, 0, 2);
      }
      if (bf16) kern.amax_accumulate_bf16(reinterpret_cast<const uint16_t*>(row + c * esize), stride, rows, len, acc16.data() + c);
      else kern.amax_accumulate[static_cast<int>(wide_of(x))](row + c * esize, len, col + c);
    }
    r += rows;
  }
  if (bf16)
    for (int64_t c = 0; c < n; ++c) col[c] = std::bit_cast<float>(static_cast<uint32_t>(acc16[static_cast<size_t>(c)]) << 16);
}

// shift[i] = table_shift(sf[i]) (quantize_e4m3_shifts); false, with shift unspecified, when
// some sf is not a power of two that is a table_scale.
bool power_of_two_shifts(const float* sf, int64_t n, int16_t* shift) {
  bool all = true;  // no early exit: the loop vectorises
  for (int64_t i = 0; i < n; ++i) {
    all &= (std::bit_cast<uint32_t>(sf[i]) & 0x007fffffu) == 0 && detail::table_scale(sf[i]);
    shift[i] = detail::table_shift(sf[i]);
  }
  return all;
}

void check_scales(const char* fn, const Tensor& sf, const Shape& shape) {
  check_cpu_matrix(fn, "sf", sf, {DType::f32});
  check_shape(fn, "sf", sf, shape);
}

// A cast's outputs hold distinct elements and lie apart from its input and from each other:
// the scales are written before the codes are made from x, and rows are written while later
// rows are read (a q laid over x, or sf over x, silently gave wrong codes before 2026-12-04).
void check_outputs_apart(const char* fn, const Tensor& in, const char* in_name, const Tensor& a, const char* a_name,
                         const Tensor& b, const char* b_name) {
  detail::check_output_apart(fn, a_name, a, {{in_name, &in}, {b_name, &b}});
  detail::check_output_apart(fn, b_name, b, {{in_name, &in}});
}

void per_token_cast(const char* fn, const Tensor& x, const Tensor& q, const Tensor& sf,
                    bool use_ue8m0, int64_t gran_k, Narrow fmt) {
  check_cpu_matrix(fn, "x", x, {DType::f32, DType::bf16});
  detail::check_positive(fn, "gran_k", gran_k);
  const int64_t m = x.size(0), k = x.size(1);
  const bool fp4 = fmt == Narrow::e2m1;
  if (fp4 && gran_k % 2 != 0) fail(fn, "gran_k", "an even group size (fp4 packs two per byte)", std::to_string(gran_k));
  check_cpu_matrix(fn, "q", q, {fp4 ? DType::e2m1x2 : DType::e4m3});
  check_shape(fn, "q", q, {m, fp4 ? ceil_div(k, 2) : k});
  check_scales(fn, sf, {m, ceil_div(k, gran_k)});
  check_outputs_apart(fn, x, "x", q, "q", sf, "sf");
  if (m == 0 || k == 0) return;  // (no elements, no scales: not a pass over M empty rows)
  const auto& kern = detail::format_kernels();
  const int wide = static_cast<int>(wide_of(x));
  const float max_code = fp4 ? kE2m1Max : kE4m3Max;
  const int64_t groups = ceil_div(k, gran_k);
  const bool stream = streaming(q);
  const int threads = threads_for(m * k);
  const int64_t chunk = detail::claim_chunk(m, threads);
#pragma omp parallel for schedule(dynamic, chunk) num_threads(threads)
  for (int64_t r = 0; r < m; ++r) {
    float* s = reinterpret_cast<float*>(row_ptr_mut(sf, r));
    kern.amax_groups[wide](row_ptr(x, r), k, gran_k, s);
    finish_scales(s, groups, max_code, use_ue8m0);
    kern.quantize[static_cast<int>(fmt)][wide](row_ptr(x, r), reinterpret_cast<uint8_t*>(row_ptr_mut(q, r)), k, s, gran_k, stream,
                                               r + 1 < m ? row_ptr(x, r + 1) : nullptr, true, detail::Reciprocals{});
  }
}

}  // namespace

int64_t detail::set_streaming_threshold(int64_t bytes) { return g_streaming_bytes.exchange(bytes); }
int64_t detail::set_cast_strip_budget(int64_t bytes) { return g_strip_budget.exchange(bytes); }

// ---------------------------------------------------------------- per token
void per_token_cast_to_fp8_into(const Tensor& x, const Tensor& q, const Tensor& sf, bool use_ue8m0,
                                int64_t gran_k) {
  per_token_cast("per_token_cast_to_fp8", x, q, sf, use_ue8m0, gran_k, Narrow::e4m3);
}

Quantized per_token_cast_to_fp8(const Tensor& x, bool use_ue8m0, int64_t gran_k) {
  check_cpu_matrix("per_token_cast_to_fp8", "x", x, {DType::f32, DType::bf16});
  detail::check_positive("per_token_cast_to_fp8", "gran_k", gran_k);
  Quantized out{Tensor::empty(x.shape(), DType::e4m3), Tensor::empty({x.size(0), ceil_div(x.size(1), gran_k)}, DType::f32)};
  per_token_cast_to_fp8_into(x, out.values, out.sf, use_ue8m0, gran_k);
  return out;
}

void per_token_cast_to_fp4_into(const Tensor& x, const Tensor& q, const Tensor& sf, bool use_ue8m0,
                                int64_t gran_k) {
  per_token_cast("per_token_cast_to_fp4", x, q, sf, use_ue8m0, gran_k, Narrow::e2m1);
}

Quantized per_token_cast_to_fp4(const Tensor& x, bool use_ue8m0, int64_t gran_k) {
  check_cpu_matrix("per_token_cast_to_fp4", "x", x, {DType::f32, DType::bf16});
  detail::check_positive("per_token_cast_to_fp4", "gran_k", gran_k);
  Quantized out{Tensor::empty({x.size(0), ceil_div(x.size(1), 2)}, DType::e2m1x2),
                Tensor::empty({x.size(0), ceil_div(x.size(1), gran_k)}, DType::f32)};
  per_token_cast_to_fp4_into(x, out.values, out.sf, use_ue8m0, gran_k);
  return out;
}

// ---------------------------------------------------------------- per block
void per_block_cast_to_fp8_into(const Tensor& x, const Tensor& q, const Tensor& sf, bool use_ue8m0,
                                int64_t block_m, int64_t block_k) {
  const char* fn = "per_block_cast_to_fp8";
  check_cpu_matrix(fn, "x", x, {DType::f32, DType::bf16});
  detail::check_positive(fn, "block_m", block_m);
  detail::check_positive(fn, "block_k", block_k);
  const int64_t m = x.size(0), k = x.size(1);
  check_cpu_matrix(fn, "q", q, {DType::e4m3});
  check_shape(fn, "q", q, {m, k});
  check_scales(fn, sf, {ceil_div(m, block_m), ceil_div(k, block_k)});
  check_outputs_apart(fn, x, "x", q, "q", sf, "sf");
  if (m == 0 || k == 0) return;  // (no elements, no scales)
  const auto& kern = detail::format_kernels();
  const int wide = static_cast<int>(wide_of(x));
  const int64_t block_rows = ceil_div(m, block_m);
  const bool stream = streaming(q);
  const int64_t groups = ceil_div(k, block_k), esize = static_cast<int64_t>(x.element_size());
  // Column strips of whole scale groups (strip_columns); a work item is one strip of one
  // block row, and quantising a row requests the thread's next item (the same row's next
  // strip, or the next block row) into L2.
  const int64_t strip_groups = ceil_div(strip_columns(std::min(block_m, m), k, esize, block_k), block_k);
  const int64_t strips = std::max<int64_t>(1, ceil_div(groups, std::max<int64_t>(1, strip_groups)));
  const int64_t per_strip = ceil_div(groups, strips);
  const int threads = threads_for(m * k);
  const int64_t chunk = detail::claim_chunk(block_rows * strips, threads);
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> col(static_cast<size_t>(std::min(k, per_strip * block_k)));
    std::vector<uint16_t> acc;
    // bf16 blocks of whole 64-element steps go through per-scale code tables where the target
    // has them (format_kernels.h), built once for the block's rows.
    const bool tables_fit = kern.e4m3_tables != nullptr && x.dtype() == DType::bf16 && block_k % 64 == 0;
    std::vector<int16_t> tables(tables_fit ? static_cast<size_t>(per_strip * detail::kE4m3TableWords) : 0);
#pragma omp for schedule(dynamic, chunk)
    for (int64_t item = 0; item < block_rows * strips; ++item) {
      const int64_t b = item / strips, strip = item % strips;
      const int64_t g0 = strip * per_strip, g1 = std::min(groups, g0 + per_strip);
      const int64_t c0 = g0 * block_k, c1 = g1 == groups ? k : g1 * block_k;
      const int64_t r0 = b * block_m, r1 = r0 + std::min(block_m, m - r0);  // no r0 + block_m: may overflow
      float* s = reinterpret_cast<float*>(row_ptr_mut(sf, b)) + g0;
      // Block amax = max of its columns' amaxes (bit patterns again: exact, NaN sticky).
      column_amax(kern, x, r0, r1, c0, c1 - c0, acc, col.data());
      for (int64_t g = 0; g < g1 - g0; ++g) {
        int32_t top = 0;
        for (int64_t c = g * block_k; c < std::min(c1 - c0, (g + 1) * block_k); ++c) top = std::max(top, std::bit_cast<int32_t>(col[c]));
        s[g] = std::bit_cast<float>(top);
      }
      finish_scales(s, g1 - g0, kE4m3Max, use_ue8m0);
      if (tables_fit) kern.e4m3_tables(s, g1 - g0, tables.data());
      for (int64_t r = r0; r < r1; ++r) {
        const char* next = strip + 1 < strips ? row_ptr(x, r) + c1 * esize
                           : block_m < m - r  ? row_ptr(x, r + block_m)
                                              : nullptr;
        const char* in = row_ptr(x, r) + c0 * esize;
        uint8_t* out = reinterpret_cast<uint8_t*>(row_ptr_mut(q, r)) + c0;
        if (tables_fit)
          kern.quantize_e4m3_tables(reinterpret_cast<const uint16_t*>(in), out, c1 - c0, s, block_k, tables.data(), stream,
                                    reinterpret_cast<const uint16_t*>(next));
        else
          kern.quantize[static_cast<int>(Narrow::e4m3)][wide](in, out, c1 - c0, s, block_k, stream, next, true, detail::Reciprocals{});
      }
    }
  }
}

Quantized per_block_cast_to_fp8(const Tensor& x, bool use_ue8m0, int64_t block_m, int64_t block_k) {
  const char* fn = "per_block_cast_to_fp8";
  check_cpu_matrix(fn, "x", x, {DType::f32, DType::bf16});
  detail::check_positive(fn, "block_m", block_m);
  detail::check_positive(fn, "block_k", block_k);
  Quantized out{Tensor::empty(x.shape(), DType::e4m3),
                Tensor::empty({ceil_div(x.size(0), block_m), ceil_div(x.size(1), block_k)}, DType::f32)};
  per_block_cast_to_fp8_into(x, out.values, out.sf, use_ue8m0, block_m, block_k);
  return out;
}

// ---------------------------------------------------------------- per channel
void per_channel_cast_to_fp8_into(const Tensor& x, const Tensor& q, const Tensor& sf, bool use_ue8m0,
                                  int64_t gran_k) {
  const char* fn = "per_channel_cast_to_fp8";
  check_cpu_matrix(fn, "x", x, {DType::f32, DType::bf16});
  detail::check_positive(fn, "gran_k", gran_k);
  const int64_t k = x.size(0), mn = x.size(1);
  check_cpu_matrix(fn, "q", q, {DType::e4m3});
  check_shape(fn, "q", q, {k, mn});
  check_scales(fn, sf, {ceil_div(k, gran_k), mn});
  check_outputs_apart(fn, x, "x", q, "q", sf, "sf");
  if (k == 0 || mn == 0) return;  // (no elements, no scales)
  const auto& kern = detail::format_kernels();
  const int wide = static_cast<int>(wide_of(x));
  const bool stream = streaming(q);
  const int64_t groups = ceil_div(k, gran_k), esize = static_cast<int64_t>(x.element_size());
  // Column strips (strip_columns), 64 columns apart so every strip but the last keeps whole
  // vector blocks; a work item is one strip of one group of rows, as in the per-block cast.
  const int64_t width = strip_columns(std::min(gran_k, k), mn, esize, 64);
  const int64_t strips = std::max<int64_t>(1, ceil_div(mn, std::max<int64_t>(1, width)));
  // bf16 under ue8m0 scales: per-element shifts and the unit scale's code table where the
  // target has them (format_kernels.h: quantize_e4m3_shifts).
  const bool shifts_fit = kern.quantize_e4m3_shifts != nullptr && x.dtype() == DType::bf16 && use_ue8m0;
  // bf16 under other scales: reciprocals and scales in the kernel's lane order where it has one.
  const bool by_lanes = kern.bf16_lane_order != nullptr && x.dtype() == DType::bf16;
  alignas(64) int16_t unit_table[detail::kE4m3TableWords];
  const float unit = 1.0f;
  if (shifts_fit) kern.e4m3_tables(&unit, 1, unit_table);
  const int threads = threads_for(k * mn);
  const int64_t chunk = detail::claim_chunk(groups * strips, threads);
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> inv(static_cast<size_t>(width));  // width <= mn
    std::vector<float> lanes(by_lanes ? 2 * inv.size() : 0);
    std::vector<uint16_t> acc;
    std::vector<int16_t> shift(shifts_fit ? inv.size() : 0);
#pragma omp for schedule(dynamic, chunk)
    for (int64_t item = 0; item < groups * strips; ++item) {
      const int64_t g = item / strips, strip = item % strips;
      const int64_t c0 = strip * width, n = std::min(width, mn - c0);
      const int64_t r0 = g * gran_k, r1 = r0 + std::min(gran_k, k - r0);
      float* s = reinterpret_cast<float*>(row_ptr_mut(sf, g)) + c0;
      auto at = [&](int64_t r) { return row_ptr(x, r) + c0 * esize; };
      column_amax(kern, x, r0, r1, c0, n, acc, s);
      finish_scales(s, n, kE4m3Max, use_ue8m0);
      // The group's rows share these scales: their reciprocals, once, spare the kernel a
      // division per element (and for ue8m0 scales, any check), in the kernel's block order
      // so that it loads them without shuffles.
      const bool by_shifts = shifts_fit && power_of_two_shifts(s, n, shift.data());
      const detail::Reciprocals recip =
          by_shifts ? detail::Reciprocals{} : reciprocals(kern, s, n, inv.data(), by_lanes ? lanes.data() : nullptr);
      for (int64_t r = r0; r < r1; ++r) {
        const char* next = strip + 1 < strips ? row_ptr(x, r) + (c0 + width) * esize
                           : gran_k < k - r   ? row_ptr(x, r + gran_k)
                                              : nullptr;
        uint8_t* out = reinterpret_cast<uint8_t*>(row_ptr_mut(q, r)) + c0;
        if (by_shifts)
          kern.quantize_e4m3_shifts(reinterpret_cast<const uint16_t*>(at(r)), out, n, s, shift.data(), unit_table, stream,
                                    reinterpret_cast<const uint16_t*>(next));
        else
          kern.quantize[static_cast<int>(Narrow::e4m3)][wide](at(r), out, n, s, 1, stream, next, true, recip);
      }
    }
  }
}

Quantized per_channel_cast_to_fp8(const Tensor& x, bool use_ue8m0, int64_t gran_k) {
  const char* fn = "per_channel_cast_to_fp8";
  check_cpu_matrix(fn, "x", x, {DType::f32, DType::bf16});
  detail::check_positive(fn, "gran_k", gran_k);
  Quantized out{Tensor::empty(x.shape(), DType::e4m3),
                Tensor::empty({ceil_div(x.size(0), gran_k), x.size(1)}, DType::f32)};
  per_channel_cast_to_fp8_into(x, out.values, out.sf, use_ue8m0, gran_k);
  return out;
}

// ---------------------------------------------------------------- cast back
namespace {

// Scale row r/gran_m as f32, unpacking ue8m0 words when sf is i32.
const float* scale_row(const Tensor& sf, int64_t sf_row, int64_t groups, std::vector<float>& scratch) {
  if (sf.dtype() == DType::f32) return reinterpret_cast<const float*>(row_ptr(sf, sf_row));
  const auto* words = reinterpret_cast<const uint8_t*>(row_ptr(sf, sf_row));
  scratch.resize(static_cast<size_t>(groups));
  for (int64_t g = 0; g < groups; ++g) scratch[g] = ue8m0_to_f32(words[g]);  // byte g = group g (little-endian)
  return scratch.data();
}

void cast_back(const char* fn, const Tensor& q, const Tensor& sf, const Tensor& out, int64_t gran_m,
               int64_t gran_k, Narrow fmt) {
  const bool fp4 = fmt == Narrow::e2m1;
  check_cpu_matrix(fn, "q", q, {fp4 ? DType::e2m1x2 : DType::e4m3});
  check_cpu_matrix(fn, "out", out, {DType::f32, DType::bf16});
  detail::check_positive(fn, "gran_m", gran_m);
  detail::check_positive(fn, "gran_k", gran_k);
  const int64_t m = out.size(0), k = out.size(1);
  check_shape(fn, "q", q, {m, fp4 ? ceil_div(k, 2) : k});
  if (fp4 && gran_k % 2 != 0 && gran_k < k) fail(fn, "gran_k", "an even group size for packed fp4", std::to_string(gran_k));
  const int64_t groups = ceil_div(k, gran_k);
  check_cpu_matrix(fn, "sf", sf, {DType::f32, DType::i32});
  check_shape(fn, "sf", sf, {ceil_div(m, gran_m), sf.dtype() == DType::f32 ? groups : ceil_div(groups, 4)});
  detail::check_output_apart(fn, "out", out, {{"q", &q}, {"sf", &sf}});
  if (m == 0 || k == 0) return;  // (nothing to write)
  const auto& kern = detail::format_kernels();
  const int wide = static_cast<int>(wide_of(out));
  const bool stream = streaming(out);
  const auto dequantize = kern.dequantize[static_cast<int>(fmt)][wide];
  const int threads = threads_for(m * k);
  const int64_t chunk = detail::claim_chunk(m, threads);
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scratch;
    StreamedRows rows(stream, k, static_cast<int64_t>(out.element_size()), std::min(gran_k, k));
#pragma omp for schedule(dynamic, chunk)
    for (int64_t r = 0; r < m; ++r) {
      const float* s = scale_row(sf, r / gran_m, groups, scratch);
      const auto* codes = reinterpret_cast<const uint8_t*>(row_ptr(q, r));
      rows.write(row_ptr_mut(out, r), k, [&](char* dst, int64_t c0, int64_t n) {
        dequantize(codes + (fp4 ? c0 / 2 : c0), dst, n, s + c0 / gran_k, gran_k);
      });
    }
  }
}

}  // namespace

void cast_back_from_fp8_into(const Tensor& q, const Tensor& sf, const Tensor& out, int64_t gran_m, int64_t gran_k) {
  if (q.defined() && q.device().is_cuda()) {
    // GPU path (CUDA backend): same contract, f32 scales and f32 output on the same device.
    const char* fn = "cast_back_from_fp8";
    for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"sf", &sf}, {"out", &out}}) {
      detail::check_defined(fn, name, *t);
      if (t->device() != q.device()) fail(fn, name, "device " + q.device().str() + " (as q)", t->device().str());
    }
    detail::check_dtype(fn, "q", q, {DType::e4m3});
    detail::check_dtype(fn, "sf", sf, {DType::f32});
    detail::check_dtype(fn, "out", out, {DType::f32});
    detail::check_rank(fn, "out", out, 2);
    detail::check_positive(fn, "gran_m", gran_m);
    detail::check_positive(fn, "gran_k", gran_k);
    check_shape(fn, "q", q, out.shape());
    check_shape(fn, "sf", sf, {ceil_div(out.size(0), gran_m), ceil_div(out.size(1), gran_k)});
    for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"q", &q}, {"sf", &sf}, {"out", &out}})
      detail::check_last_dim_contiguous(fn, name, *t);
    return detail::cuda_cast_back_from_fp8(q, sf, out, gran_m, gran_k);
  }
  cast_back("cast_back_from_fp8", q, sf, out, gran_m, gran_k, Narrow::e4m3);
}

void cast_back_from_fp4_into(const Tensor& q, const Tensor& sf, const Tensor& out, int64_t gran_m, int64_t gran_k) {
  cast_back("cast_back_from_fp4", q, sf, out, gran_m, gran_k, Narrow::e2m1);
}

Tensor cast_back_from_fp8(const Tensor& q, const Tensor& sf, DType out_dtype, int64_t gran_m, int64_t gran_k) {
  const char* fn = "cast_back_from_fp8";
  detail::check_defined(fn, "q", q);
  detail::check_dtype(fn, "q", q, {DType::e4m3});
  detail::check_rank(fn, "q", q, 2);
  if (q.device().is_cuda() && !detail::cuda_backend_built())  // (before allocating out there)
    fail(fn, "q", "a cpu tensor (this moekit was built without MOEKIT_CUDA)", q.device().str());
  Tensor out = Tensor::empty(q.shape(), out_dtype, q.device());
  cast_back_from_fp8_into(q, sf, out, gran_m, gran_k);
  return out;
}

Tensor cast_back_from_fp4(const Tensor& q, const Tensor& sf, DType out_dtype, int64_t gran_m, int64_t gran_k, int64_t k) {
  check_cpu_matrix("cast_back_from_fp4", "q", q, {DType::e2m1x2});
  if (k == -1) k = 2 * q.size(1);
  if (k < 0 || ceil_div(k, 2) != q.size(1))
    fail("cast_back_from_fp4", "k", "-1 (default), 2*q.size(1) or 2*q.size(1)-1 (" + std::to_string(2 * q.size(1)) + ")", std::to_string(k));
  Tensor out = Tensor::empty({q.size(0), k}, out_dtype);
  cast_back_from_fp4_into(q, sf, out, gran_m, gran_k);
  return out;
}

// ---------------------------------------------------------------- scale helpers
Tensor ceil_to_ue8m0(const Tensor& sf) {
  detail::check_cpu("ceil_to_ue8m0", "sf", sf);
  detail::check_dtype("ceil_to_ue8m0", "sf", sf, {DType::f32});
  const Tensor src = sf.contiguous();
  Tensor out = Tensor::empty(sf.shape(), DType::f32);
  const float* in = src.data_ptr<float>();
  for (int64_t i = 0; i < src.numel(); ++i) out.data_ptr<float>()[i] = ceil_to_ue8m0(in[i]);
  return out;
}

Tensor pack_ue8m0_to_int(const Tensor& sf) {
  const char* fn = "pack_ue8m0_to_int";
  check_cpu_matrix(fn, "sf", sf, {DType::f32});
  const int64_t rows = sf.size(0), groups = sf.size(1), words = ceil_div(groups, 4);
  Tensor out = Tensor::zeros({rows, words}, DType::i32);
  for (int64_t r = 0; r < rows; ++r) {
    const float* s = reinterpret_cast<const float*>(row_ptr(sf, r));
    auto* bytes = reinterpret_cast<uint8_t*>(out.data_ptr<int32_t>() + r * words);
    for (int64_t g = 0; g < groups; ++g) {
      const uint32_t bits = std::bit_cast<uint32_t>(s[g]);
      // Powers of two 2^-126..2^127 (exponent field, zero mantissa), and 2^-127 (code 0,
      // the one ue8m0 value that is an f32 subnormal).
      const bool normal = (bits & 0x807fffffu) == 0 && bits != 0 && (bits >> 23) != 0xff;
      if (!normal && bits != 0x00400000u)
        fail(fn, "sf", "positive powers of two in [2^-127, 2^127] (use ceil_to_ue8m0 first)",
             "sf[" + std::to_string(r) + ", " + std::to_string(g) + "] = " + std::to_string(s[g]));
      bytes[g] = static_cast<uint8_t>(bits >> 23);  // little-endian: byte g%4 of word g/4
    }
  }
  return out;
}

Tensor unpack_ue8m0_from_int(const Tensor& packed, int64_t groups) {
  const char* fn = "unpack_ue8m0_from_int";
  check_cpu_matrix(fn, "packed", packed, {DType::i32});
  const int64_t rows = packed.size(0), words = packed.size(1);
  if (groups == -1) groups = 4 * words;
  if (groups < 0 || ceil_div(groups, 4) != words)
    fail(fn, "groups", "a count with ceil(groups/4) == " + std::to_string(words), std::to_string(groups));
  Tensor out = Tensor::empty({rows, groups}, DType::f32);
  for (int64_t r = 0; r < rows; ++r) {
    const auto* bytes = reinterpret_cast<const uint8_t*>(row_ptr(packed, r));
    for (int64_t g = 0; g < groups; ++g) out.data_ptr<float>()[r * groups + g] = ue8m0_to_f32(bytes[g]);
  }
  return out;
}

// ---------------------------------------------------------------- convert
void convert(const Tensor& src, const Tensor& dst) {
  const char* fn = "convert";
  detail::check_cpu(fn, "src", src);
  detail::check_cpu(fn, "dst", dst);
  if (!src.is_contiguous()) fail(fn, "src", "a contiguous tensor", "strides " + shape_str(src.strides()));
  if (!dst.is_contiguous()) fail(fn, "dst", "a contiguous tensor", "strides " + shape_str(dst.strides()));
  if (src.dim() == 0 || src.dim() != dst.dim()) fail(fn, "dst", "the rank of src (" + std::to_string(src.dim()) + ", at least 1)", std::to_string(dst.dim()));
  auto is_wide = [](DType d) { return d == DType::f32 || d == DType::bf16; };
  auto narrow_of = [&](DType d) -> int {
    switch (d) {
      case DType::e4m3: return static_cast<int>(Narrow::e4m3);
      case DType::e5m2: return static_cast<int>(Narrow::e5m2);
      case DType::e2m1x2: return static_cast<int>(Narrow::e2m1);
      default: return -1;
    }
  };
  const bool to_narrow = is_wide(src.dtype()) && narrow_of(dst.dtype()) >= 0;
  const bool from_narrow = narrow_of(src.dtype()) >= 0 && is_wide(dst.dtype());
  const bool wide_pair = is_wide(src.dtype()) && is_wide(dst.dtype());
  if (!to_narrow && !from_narrow && !wide_pair)
    fail(fn, "dst", "a supported pair (f32/bf16 <-> f32/bf16/e4m3/e5m2/e2m1x2)",
         std::string(dtype_name(src.dtype())) + " -> " + dtype_name(dst.dtype()));
  const Tensor& wide = to_narrow || wide_pair ? src : dst;
  const Tensor& other = to_narrow || wide_pair ? dst : src;
  const int64_t cols = wide.size(-1), rows = cols == 0 ? 0 : wide.numel() / cols;
  Shape expected = wide.shape();
  if (other.dtype() == DType::e2m1x2) expected.back() = ceil_div(cols, 2);
  check_shape(fn, to_narrow || wide_pair ? "dst" : "src", other, expected);
  // (dst over src is a copy onto itself only when both are one view of one dtype; any other
  // overlap races between threads' rows or reads what was just written)
  if (src.data() == dst.data() && src.dtype() == dst.dtype()) return;  // one contiguous view: already its own copy
  detail::check_apart(fn, "dst", dst, {{"src", &src}});
  const auto& kern = detail::format_kernels();
  const float one = 1.0f;
  const int64_t other_row_bytes = expected.back() * static_cast<int64_t>(other.element_size());
  const int64_t wide_row_bytes = cols * static_cast<int64_t>(wide.element_size());
  const bool stream = streaming(dst);
  const int threads = threads_for(rows * cols);
  const int64_t chunk = detail::claim_chunk(rows, threads);
#pragma omp parallel num_threads(threads)
  {
    // (one unit scale: any chunk of a row is a whole group)
    StreamedRows staged(stream && from_narrow, cols, static_cast<int64_t>(dst.element_size()), 1);
#pragma omp for schedule(dynamic, chunk)
    for (int64_t r = 0; r < rows; ++r) {
      const char* w = static_cast<const char*>(wide.data()) + r * wide_row_bytes;
      char* o = static_cast<char*>(other.data()) + r * other_row_bytes;
      if (wide_pair) {
        if (src.dtype() == dst.dtype()) std::copy(w, w + wide_row_bytes, o);
        else if (src.dtype() == DType::f32) kern.f32_to_bf16(reinterpret_cast<const float*>(w), reinterpret_cast<uint16_t*>(o), cols);
        else kern.bf16_to_f32(reinterpret_cast<const uint16_t*>(w), reinterpret_cast<float*>(o), cols);
      } else if (to_narrow) {
        kern.quantize[narrow_of(dst.dtype())][static_cast<int>(wide_of(src))](w, reinterpret_cast<uint8_t*>(o), cols, &one, cols, stream, nullptr, false, detail::Reciprocals{});
      } else {
        const auto* codes = reinterpret_cast<const uint8_t*>(o);
        const auto dequantize = kern.dequantize[narrow_of(src.dtype())][static_cast<int>(wide_of(dst))];
        staged.write(const_cast<char*>(w), cols, [&](char* out, int64_t c0, int64_t n) {
          dequantize(codes + (src.dtype() == DType::e2m1x2 ? c0 / 2 : c0), out, n, &one, n);
        });
      }
    }
  }
}

// ---------------------------------------------------------------- calc_diff
double calc_diff(const Tensor& x, const Tensor& y) {
  const char* fn = "calc_diff";
  detail::check_cpu(fn, "x", x);
  detail::check_cpu(fn, "y", y);
  detail::check_dtype(fn, "x", x, {DType::f32, DType::bf16});
  detail::check_dtype(fn, "y", y, {DType::f32, DType::bf16});
  check_shape(fn, "y", y, x.shape());
  const Tensor a = x.contiguous(), b = y.contiguous();
  const int64_t n = a.numel();
  auto value = [](const Tensor& t, int64_t i) {
    return t.dtype() == DType::f32 ? static_cast<double>(t.data_ptr<float>()[i])
                                   : static_cast<double>(bf16_to_f32(t.data_ptr<uint16_t>()[i]));
  };
  // Fixed chunks summed in order: the same result for any thread count.
  constexpr int64_t kChunk = 1 << 16;
  const int64_t chunks = ceil_div(n, kChunk);
  std::vector<double> dot(static_cast<size_t>(chunks)), norm(static_cast<size_t>(chunks));
#pragma omp parallel for schedule(static) num_threads(threads_for(n))
  for (int64_t c = 0; c < chunks; ++c) {
    double d = 0.0, s = 0.0;
    for (int64_t i = c * kChunk; i < std::min(n, (c + 1) * kChunk); ++i) {
      const double u = value(a, i), v = value(b, i);
      d += u * v;
      s += u * u + v * v;
    }
    dot[c] = d;
    norm[c] = s;
  }
  double d = 0.0, s = 0.0;
  for (int64_t c = 0; c < chunks; ++c) d += dot[c], s += norm[c];
  if (s == 0.0) return 0.0;
  return 1.0 - 2.0 * d / s;
}

}  // namespace moekit

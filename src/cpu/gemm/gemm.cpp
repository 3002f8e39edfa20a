// Dense GEMM front end: argument validation, operand description, and the blocked,
// multi-threaded driver around the per-ISA pack + microkernel (gemm_kernels.h).
//
// Blocking (BLIS order): for each column block jc (kNc wide) and K block pc (kern.kc deep)
// the B block is packed once (decoded + scaled to f32); for each row block ic (mc tall)
// the A block is packed; then micro-panels of B (L1) sweep micro-panels of A (L2).
// Partial sums live in a per-thread f32 buffer of (rows of the item) x kNc, written to D
// (adding C, rounding to bf16 if asked) when a column block is complete, or, where the
// buffer is over 1 MiB, tile by tile as the last K block computes them (finish_tiles).
//
// Threads own disjoint rectangles of D ("items"), and every element is the same chain of
// FMAs over fixed K blocks whatever the item, so results do not depend on the split.
#include "moekit/gemm.h"

#include <omp.h>
#include <xmmintrin.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <string>
#include <utility>

#include "core/check.h"
#include "core/scratch.h"
#include "core/work_split.h"
#include "cpu/formats/format_kernels.h"
#include "cpu/gemm/gemm_kernels.h"
#include "moekit/error.h"
#include "moekit/runtime.h"

namespace moekit {
namespace {

using detail::ceil_div;
using detail::fail;
using detail::GemmOperand;

enum class Side : uint8_t { n, t };  // the layout letter of one operand

// Columns of B packed at a time: as many as possible up to kNcMax (fewer A re-packs),
// split evenly, and bounded so one thread's f32 partial sums stay within acc_bytes(): a
// quarter of the L3, at least 8 MiB. On a 32 MiB L3 that is 8 MiB rather than 32 (until
// 2026-12-04): two threads' sums and B blocks then stay in the L3. bf16 M = 4096 on 2 Zen 4
// cores (alternated, second calls): 4096 x 4096 x 7168 418 -> 428 GFLOP/s (first calls 338
// -> 375-399, fewer fresh pages), 7168 x 16384 420 -> 427, 2112 x 7168 within noise (416 ->
// 418-421), for an A re-packed once per column block. On the 2-vCPU AMX Xeon (480 MiB L3,
// session 39), 120 MiB instead of 8 lets a thread's 2048 rows take up to kNcMax columns, so
// A is packed once per K block rather than once per 1024 columns: bf16 4096 x 7168 x 2048
// 53.7-55.6 -> 50.2-50.5 ms, 2112 x 7168 68-71 -> 60 ms, 24576 x 1536 186 -> 176-177 ms,
// FP8 2112 x 7168 71.8-72.6 -> 68.4-68.9 ms (alternated medians; 576 and 4096 x 7168 even).
constexpr int64_t kNcMax = 4096;
int64_t acc_bytes() {
  static const int64_t bytes = [] {
    const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);  // (0 or -1 where unknown)
    return std::max<int64_t>(int64_t{8} << 20, l3 > 0 ? l3 / 4 : 0);
  }();
  return bytes;
}

struct Output {
  uint8_t* d = nullptr;
  DType dtype = DType::f32;
  int64_t ldd = 0;
  const uint8_t* c = nullptr;  // null: no C
  DType c_dtype = DType::f32;
  int64_t ldc = 0;
  bool stream_d = false;  // bf16 D without C, written past the cache (describe_output)
};

// ---------------------------------------------------------------- per-thread buffers

struct ThreadBuffers {
  detail::Scratch a, b, acc, column;  // (column: sweep_in_passes)
};
ThreadBuffers& thread_buffers() {
  static thread_local ThreadBuffers buffers;
  return buffers;
}

// ---------------------------------------------------------------- the driver

// Floats of `count` micro-panels (of width rows / columns) over K block depth kc.
int64_t panels_floats(const detail::GemmKernels& kern, int64_t count, int64_t kc, int width) {
  return count * kern.panel_floats(kc, width);
}

// B's micro-panels when the caller packed them once (PackedWeights):
// [K block][panel of nr columns][panel over the block's kc], every K block n_pad columns
// wide, exactly as the driver packs a block itself. Null data: B is packed in every call.
struct Prepacked {
  const float* data = nullptr;
  int64_t n_pad = 0;
  const float* at(const detail::GemmKernels& kern, int64_t jc, int64_t pc, int64_t kc) const {
    return data + panels_floats(kern, n_pad / kern.nr * (pc / kern.kc), kern.kc, kern.nr) +
           panels_floats(kern, jc / kern.nr, kc, kern.nr);
  }
};

// Partial sums of a block of D, stored panel by panel: element (i, j) of the block is at
// data[(j / width) * panel_stride + i * width + j % width]. width = the block's columns
// gives plain row-major storage.
struct AccBlock {
  const float* data;
  int64_t width, panel_stride;
};

// NaN results are written as the canonical quiet NaN (f32 0x7fc00000, bf16 0x7fc0) on every
// path: which NaN an FMA chain ends with (its sign and payload) depends on the order in which
// NaN operands meet, and on how a target's decoder makes an e4m3 NaN code, which the targets
// do not share (found 2026-12-04: code 0xff gave -NaN on the portable path and +NaN on
// AVX2; a NaN activation's payload survived on AVX2 only). One compare and blend per output
// element, so that every FMA-class target gives the same bits for any input.
inline float canonical(float v) { return v != v ? std::numeric_limits<float>::quiet_NaN() : v; }
void canonicalize(float* p, int64_t n) {
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) p[t] = canonical(p[t]);
}

// f32 D (and C): each panel's piece of a row straight from the sums, C added on the way, no
// staging row. K-grouped 4 x 4096 x 7168 x 512 accumulating into C = D, 2 threads: 139-145
// -> 123-124 ms (the staged version below had been a third of the call). (Requesting C's
// rows a few rows ahead here gained nothing; requesting them into L2 during the block's
// products made the call 15-20 % slower: the products read their tiles from L2.)
void write_block_f32(const Output& out, const AccBlock& acc, int64_t m0, int64_t m1, int64_t n0, int64_t nc) {
  for (int64_t i = m0; i < m1; ++i) {
    float* drow = reinterpret_cast<float*>(out.d) + i * out.ldd + n0;
    const float* crow = out.c ? reinterpret_cast<const float*>(out.c) + i * out.ldc + n0 : nullptr;
    for (int64_t j = 0; j < nc; j += acc.width) {  // (pieces start at panel starts: j % width == 0)
      const float* sums = acc.data + (j / acc.width) * acc.panel_stride + (i - m0) * acc.width;
      const int64_t len = std::min(acc.width, nc - j);
      if (crow) {
        const float* cv = crow + j;
        float* dv = drow + j;
#pragma omp simd
        for (int64_t t = 0; t < len; ++t) dv[t] = canonical(sums[t] + cv[t]);
      } else {
        float* dv = drow + j;
#pragma omp simd
        for (int64_t t = 0; t < len; ++t) dv[t] = canonical(sums[t]);
      }
    }
  }
}

// One panel of sums (a finished tile, a band of a block's panel, or a small-M block; rows
// acc.width floats apart) into bf16 D without C: canonicalised and rounded by one converter
// call, with streaming stores where out.stream_d. (A gather, a converter call and a memcpy
// per row of 32 had cost 10-13 % of bf16 4096 x 32768 x 512, whose tiles are 16 steps
// deep; 2 Zen 4 cores.)
void write_tile_bf16(const Output& out, const AccBlock& acc, int64_t m0, int64_t m1, int64_t n0, int64_t nc) {
  detail::format_kernels().f32_rows_to_bf16_canonical(acc.data, acc.width, m1 - m0, nc,
                                                      reinterpret_cast<uint16_t*>(out.d) + m0 * out.ldd + n0, out.ldd,
                                                      out.stream_d);
}

// D rows [m0, m1) x columns [n0, n0 + nc) = acc (+ C), rounded to D's dtype with the
// formats component's vector converters (f32 sum first, then one rounding): f32 D and bf16
// D without C panel piece by panel piece, bf16 D with C a row at a time.
void write_block(const Output& out, const AccBlock& acc, int64_t m0, int64_t m1, int64_t n0, int64_t nc) {
  if (out.dtype == DType::f32 && (!out.c || out.c_dtype == DType::f32)) return write_block_f32(out, acc, m0, m1, n0, nc);
  if (out.dtype == DType::bf16 && !out.c && nc <= acc.width) return write_tile_bf16(out, acc, m0, m1, n0, nc);
  if (out.dtype == DType::bf16 && !out.c) {
    // Bands of 16 rows, panel by panel: the converter reads each panel's rows where they
    // are, where gathering every row of 256 columns into a buffer first (below) took a
    // third of bf16 4096 x 32768 x 512 on AMX (2 threads, 86.7 -> 55.1 ms; bands of 4 or
    // 64 rows, or whole panels, were slower).
    constexpr int64_t kBand = 16;
    for (int64_t i0 = m0; i0 < m1; i0 += kBand) {
      const int64_t i1 = std::min(m1, i0 + kBand);
      for (int64_t j = 0; j < nc; j += acc.width)
        write_tile_bf16(out, {acc.data + (j / acc.width) * acc.panel_stride + (i0 - m0) * acc.width, acc.width, 0}, i0, i1,
                        n0 + j, std::min(acc.width, nc - j));
    }
    return;
  }
  const detail::FormatKernels& fk = detail::format_kernels();
  const size_t es = element_size(out.dtype), ces = element_size(out.c_dtype);
  constexpr int64_t kChunk = 256;
  alignas(64) float row[kChunk], c_row[kChunk];
  for (int64_t i = m0; i < m1; ++i) {
    uint8_t* drow = out.d + (i * out.ldd + n0) * static_cast<int64_t>(es);
    const uint8_t* crow = out.c ? out.c + (i * out.ldc + n0) * static_cast<int64_t>(ces) : nullptr;
    for (int64_t j = 0; j < nc; j += kChunk) {
      const int64_t len = std::min(kChunk, nc - j);
      for (int64_t t = 0; t < len;) {  // gather the row's pieces from their panels
        const int64_t col = j + t, in_panel = col % acc.width;
        const int64_t piece = std::min(len - t, acc.width - in_panel);
        std::memcpy(row + t, acc.data + (col / acc.width) * acc.panel_stride + (i - m0) * acc.width + in_panel,
                    static_cast<size_t>(piece) * sizeof(float));
        t += piece;
      }
      if (crow) {
        const float* cv = reinterpret_cast<const float*>(crow) + j;
        if (out.c_dtype == DType::bf16) {
          fk.bf16_to_f32(reinterpret_cast<const uint16_t*>(crow) + j, c_row, len);
          cv = c_row;
        }
        for (int64_t t = 0; t < len; ++t) row[t] += cv[t];
      }
      canonicalize(row, len);
      if (out.dtype == DType::f32) std::memcpy(reinterpret_cast<float*>(drow) + j, row, static_cast<size_t>(len) * 4);
      else fk.f32_to_bf16(row, reinterpret_cast<uint16_t*>(drow) + j, len);
    }
  }
}

// One thread's rectangle [m0, m1) x [n0, n1) of D.
int64_t column_block(int64_t rows, int64_t cols, int nr) {
  const int64_t cap = std::max<int64_t>(nr, std::min(kNcMax, acc_bytes() / (4 * std::max<int64_t>(rows, 1))) / nr * nr);
  return ceil_div(ceil_div(cols, ceil_div(cols, cap)), nr) * nr;
}

// Requests `rows` runs of `bytes` bytes, `ld` bytes apart from p, a line at a time
// (kWrite, kLocality: as __builtin_prefetch takes them; 0, 2 asks for L2).
template <int kWrite, int kLocality>
void request_rows(const uint8_t* p, int64_t ld, int64_t rows, int64_t bytes) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t byte = 0; byte < bytes; byte += 64) __builtin_prefetch(p + i * ld + byte, kWrite, kLocality);
}

// Requests D's rows [i0, i0 + rows), columns [j0, j0 + cols), for writing (and C's for
// reading), so that the lines are at hand when a tile's sums arrive: bf16 D 4096 x 7168 x
// 2048 on AMX, 5-7 % faster; without it the tiles' own stores queued behind D's misses.
// into_l2 (GemmKernels::d_requests_into_l2) asks for D's lines in L2 rather than L1: on 2
// Zen 4 cores (avx512_bf16) bf16 4096 x 32768 x 512 400 -> 407 GFLOP/s and 4096 x 2112 x
// 7168 409 -> 424 (alternated medians; without requests 391 at K = 512).
void request_d(const Output& out, int64_t i0, int64_t rows, int64_t j0, int64_t cols, bool into_l2) {
  const int64_t es = static_cast<int64_t>(element_size(out.dtype)), ces = static_cast<int64_t>(element_size(out.c_dtype));
  const uint8_t* d = out.d + (i0 * out.ldd + j0) * es;
  if (into_l2) request_rows<0, 2>(d, out.ldd * es, rows, cols * es);
  else request_rows<1, 3>(d, out.ldd * es, rows, cols * es);
  if (out.c && out.c != out.d) request_rows<0, 3>(out.c + (i0 * out.ldc + j0) * ces, out.ldc * ces, rows, cols * ces);
}

// Whether the last K block finishes its tiles into D (sweep) for a partial-sum buffer of
// `floats`: when the buffer is larger than L2, so that a second pass would read it from
// further out. From L2, write_block's pass over whole rows was the faster one: bf16 D
// 4096 x 32768 x 512 on AMX (acc 384 KiB per row block), 89 ms against 128 finishing tiles
// (session 17; write_block's bands of panels take that call to 55 ms since session 41).
constexpr int64_t kFinishTilesAbove = int64_t{1} << 20;  // bytes
bool finish_tiles(int64_t floats) { return floats * 4 > kFinishTilesAbove; }

// Where the last K block's tiles go: D's block at row i0, column j0.
struct LastBlock {
  const Output* out;
  int64_t i0, j0;
};
constexpr int64_t kMaxTileFloats = 32 * 32;  // the largest mr x nr of the targets

void sweep_in_passes(const detail::GemmKernels& kern, const float* pa, const float* pb, int64_t mc, int64_t nc,
                     int64_t kc, float* acc, int64_t panel_stride, bool accumulate, const LastBlock* last);

// The B panel after a column's (GemmKernels::request_during_tile), requested in equal
// shares before each of the column's `calls` tile calls.
class NextBPanelRequests {
 public:
  NextBPanelRequests(const detail::GemmKernels& kern, int64_t kc, int64_t calls)
      : kern_(kern), bytes_(panels_floats(kern, 1, kc, kern.nr) * 4), share_(ceil_div(bytes_, calls * 64) * 64) {}
  // Before the column at bp starts (last: no panel after it).
  void column(const float* bp, bool last) {
    next_ = reinterpret_cast<const uint8_t*>(bp) + bytes_;
    requested_ = last || !kern_.request_during_tile ? bytes_ : 0;
  }
  // Before a tile call covering k of K.
  void before_tile(int64_t k) {
    if (requested_ >= bytes_) return;
    kern_.request_during_tile(next_ + requested_, std::min(share_, bytes_ - requested_), k);
    requested_ += share_;
  }

 private:
  const detail::GemmKernels& kern_;
  int64_t bytes_, share_, requested_ = 0;
  const uint8_t* next_ = nullptr;
};

// Every tile of one row block x column block x K block: micro-panels of B (kept in L1)
// sweep micro-panels of A (L2). Partial sums live tile-contiguous (panel-major, row stride
// nr) so the sweep walks memory linearly; the buffer is larger than the caches, so the
// next tile's sums are requested while this one computes: into L2, one tile ahead. A tile
// streams its A and B panels through L1 and would evict them from there; requested two
// tiles ahead into L1 for writing (as before 2026-12-04), bf16 4096 x 2112 x 7168 on 2
// Zen 4 cores ran 1-2 % slower, and these requests took 1.3 % of a one-thread profile
// against 0.35 %.
//
// Given `last`, each tile is finished as it is computed: its sums, still in L1, go to D with
// C added and rounded, exactly as write_block would have done later (the same bits), and a
// tile that starts from zero sums into an L1 scratch rather than the buffer. Measured (AMX
// host, bf16 D 4096 x 7168 x 2048, 2 threads): 87 -> 75 ms; write_block's second pass over
// a buffer of 29 MB per thread had been 13 % of the call.
//
// Where the target takes requests during a tile (GemmKernels::request_during_tile), the next
// B panel is requested into L2 a share per tile of the current column, so that its first
// tile does not wait on the L3 (a packed block of B is far larger than L2). AMX host, 2
// threads, alternated minima: bf16 4096 x 7168 x 2048 53.8-54.7 -> 47.8-48.3 ms, 4096 x
// 2112 x 7168 57.2-58.5 -> 55.0-56.9; FP8 (1,128,128) f32 scales 4096 x 2112 x 7168
// 72.7-73.1 -> 68.8-69.9, ue8m0 4096 x 7168 x 2048 53.2-53.9 -> 49.1-49.6 (same bits).
void sweep(const detail::GemmKernels& kern, const float* pa, const float* pb, int64_t mc, int64_t nc, int64_t kc,
           float* acc, int64_t panel_stride, bool accumulate, const LastBlock* last = nullptr) {
  if (kern.begin_tiles) kern.begin_tiles(false);  // a new A panel per tile
  if (kern.tile_steps && kern.pass_k > 0 && kc > kern.pass_k && nc > 0 && mc > 0 &&
      (!kern.passes_take || kern.passes_take(pa, pb)))
    return sweep_in_passes(kern, pa, pb, mc, nc, kc, acc, panel_stride, accumulate, last);
  alignas(64) float scratch[kMaxTileFloats];
  const bool to_scratch = last && !accumulate && kern.mr * kern.nr <= kMaxTileFloats;
  NextBPanelRequests next_b(kern, kc, ceil_div(mc, kern.mr));
  for (int64_t jr = 0; jr < nc; jr += kern.nr) {
    const int cols = static_cast<int>(std::min<int64_t>(kern.nr, nc - jr));
    const float* bp = pb + panels_floats(kern, jr / kern.nr, kc, kern.nr);
    next_b.column(bp, jr + kern.nr >= nc);
    for (int64_t ir = 0; ir < mc; ir += kern.mr) {
      const int r = static_cast<int>(std::min<int64_t>(kern.mr, mc - ir));
      float* c_tile = to_scratch ? scratch : acc + (jr / kern.nr) * panel_stride + ir * kern.nr;
      if (!to_scratch)  // the next tile's sums, into L2 (see above)
        request_rows<0, 2>(reinterpret_cast<const uint8_t*>(c_tile + kern.mr * kern.nr), 0, 1, kern.mr * kern.nr * 4);
      // The next tile's part of D (this one's was requested a tile ago), unless D is streamed:
      // a line requested for writing is read first, which streaming stores skip (FP8 with f32
      // scales, 4096 x 7168 x 2048, 2 threads, alternated: 61.1 -> 54.0 ms; 7168 x 16384 even).
      if (last && !last->out->stream_d) {
        const bool down = ir + kern.mr < mc;
        const int64_t ni = down ? ir + kern.mr : 0, nj = down ? jr : jr + kern.nr;
        if (nj < nc)
          request_d(*last->out, last->i0 + ni, std::min<int64_t>(kern.mr, mc - ni), last->j0 + nj,
                    std::min<int64_t>(kern.nr, nc - nj), kern.d_requests_into_l2);
      }
      next_b.before_tile(kc);
      kern.tile(kc, pa + panels_floats(kern, ir / kern.mr, kc, kern.mr), bp, c_tile, kern.nr, r, cols, accumulate);
      if (last) write_block(*last->out, {c_tile, kern.nr, 0}, last->i0 + ir, last->i0 + ir + r, last->j0 + jr, cols);
    }
  }
}

// sweep for targets with passes (GemmKernels::pass_k): each column of tiles (one B panel)
// runs pass_k of K at a time over all of its tiles, so that the panel's pass is loaded from
// L1 by every tile but the first; the column's sums (mc x nr) go through L1/L2 between
// passes. A block's only K block that finishes into D sums into a scratch column, not the
// buffer. The bits are sweep's: a tile's sums leave the tiles as f32 and come back exactly.
// On 2 threads of the AMX Xeon, calls alternated in one process (minimum, median; B
// requests as above): bf16 4096 x 2112 x 7168 55.2, 57.0 -> 48.5, 51.4 ms; 4096 x 7168 x
// 2048 49.4, 50.3 -> 42.3, 43.4; FP8 ue8m0 4096 x 7168 x 2048 48.4, 50.3 -> 44.5, 45.6.
// Requesting the next tile's sums (first pass) and D (last pass) as sweep does measured
// even to 6 % slower (44.8 against 42.3 ms at 7168 x 2048), so they are not requested.
void sweep_in_passes(const detail::GemmKernels& kern, const float* pa, const float* pb, int64_t mc, int64_t nc,
                     int64_t kc, float* acc, int64_t panel_stride, bool accumulate, const LastBlock* last) {
  const int64_t tiles = ceil_div(mc, kern.mr);
  NextBPanelRequests next_b(kern, kc, tiles * ceil_div(kc, kern.pass_k));
  const bool to_scratch = last && !accumulate;
  float* column = to_scratch ? thread_buffers().column.get(static_cast<size_t>(tiles * kern.mr * kern.nr)) : nullptr;
  for (int64_t jr = 0; jr < nc; jr += kern.nr) {
    const int cols = static_cast<int>(std::min<int64_t>(kern.nr, nc - jr));
    const float* bp = pb + panels_floats(kern, jr / kern.nr, kc, kern.nr);
    next_b.column(bp, jr + kern.nr >= nc);
    float* c_column = to_scratch ? column : acc + (jr / kern.nr) * panel_stride;
    // Tile ir's last pass goes to D once the next tile's has run: its sums may be pending
    // until then (GemmKernels::settle_tiles).
    const auto write_tile = [&](int64_t ir) {
      const int r = static_cast<int>(std::min<int64_t>(kern.mr, mc - ir));
      write_block(*last->out, {c_column + ir * kern.nr, kern.nr, 0}, last->i0 + ir, last->i0 + ir + r, last->j0 + jr, cols);
    };
    for (int64_t k0 = 0; k0 < kc; k0 += kern.pass_k) {
      const int64_t k1 = std::min(kc, k0 + kern.pass_k);
      const bool first = k0 == 0, final = k1 == kc;
      for (int64_t ir = 0; ir < mc; ir += kern.mr) {
        const int r = static_cast<int>(std::min<int64_t>(kern.mr, mc - ir));
        float* c_tile = c_column + ir * kern.nr;
        next_b.before_tile(k1 - k0);
        kern.tile_steps(kc, pa + panels_floats(kern, ir / kern.mr, kc, kern.mr), bp, k0, k1, c_tile, kern.nr, r, cols,
                        accumulate || !first);
        if (final && last && ir > 0) write_tile(ir - kern.mr);
      }
    }
    if (kern.settle_tiles) kern.settle_tiles();
    if (last) write_tile((tiles - 1) * kern.mr);
  }
}

// The same tiles straight in D (tiles_write_d), rows ldd floats apart: each strip of mr rows
// sweeps the column block's B panels (from L2), so that every row of D is read and written
// front to back, which the hardware prefetchers follow. In sweep's order a tile in D touches
// mr rows a page apart; requesting them ahead (every line or one per row, one to four tiles
// ahead) was 5-15 % slower than this order without requests (AMX host, 2026-12-02). Where
// GemmKernels::d_requests_into_l2 is set, the next tile of the strip is requested into L2 as
// each tile starts: on 2 Zen 4 cores (avx512_bf16) k-grouped bf16 4 x 4096 x 7168 x 512
// accumulating in place ran 376 -> 384-398 GFLOP/s (5 alternated runs; two tiles ahead
// 377-395; into L1 377-389).
void sweep_into_d(const detail::GemmKernels& kern, const float* pa, const float* pb, int64_t mc, int64_t nc, int64_t kc,
                  float* d, int64_t ldd, bool accumulate) {
  if (kern.begin_tiles) kern.begin_tiles(true);  // a new B panel per tile
  for (int64_t ir = 0; ir < mc; ir += kern.mr) {
    const int rows = static_cast<int>(std::min<int64_t>(kern.mr, mc - ir));
    const float* ap = pa + panels_floats(kern, ir / kern.mr, kc, kern.mr);
    for (int64_t jr = 0; jr < nc; jr += kern.nr) {
      if (kern.d_requests_into_l2 && jr + kern.nr < nc)
        request_rows<0, 2>(reinterpret_cast<const uint8_t*>(d + ir * ldd + jr + kern.nr), ldd * 4, rows,
                           std::min<int64_t>(kern.nr, nc - jr - kern.nr) * 4);
      kern.tile(kc, ap, pb + panels_floats(kern, jr / kern.nr, kc, kern.nr), d + ir * ldd + jr, ldd, rows,
                static_cast<int>(std::min<int64_t>(kern.nr, nc - jr)), accumulate);
    }
    for (int i = 0; i < rows; ++i) canonicalize(d + (ir + i) * ldd, nc);  // (the strip's rows, still in L1/L2)
  }
}

// Whether a call's tiles (one K block) go straight to f32 D, skipping the partial-sum buffer
// and write_block:
// - without C: the tiles store their sums where write_block would have copied them: the
//   same bits;
// - with C = D (accumulating in place, as weight gradients do), on the AMX kernels, in the
//   tn layout (A and B MN-major): the tiles start from C, so D = C + products rounds as one
//   chain from C instead of C added to the chain's sum. Such calls never take the small-M
//   streaming path (it needs K-major B) and have no pre-packed form (packed calls take
//   K-major A), so every M still gives the same bits, and so does any thread count (AMX is
//   its own accuracy class; docs/GEMM.md).
// K-grouped 4 x 4096 x 7168 x 512 accumulating in place, 2 threads (AMX host, 2026-12-02):
// 119-127 -> 93-99 ms. Adding C to each tile's sums from an L1 scratch tile instead (the
// same bits as write_block) was 113-120 ms: its loads of C stall where the tiles' do not.
bool tiles_write_d(const detail::GemmKernels& kern, const GemmOperand& a, const GemmOperand& b, const Prepacked& pre,
                   const Output& out) {
  if (a.k <= 0 || a.k > kern.kc || out.dtype != DType::f32) return false;
  if (!out.c) return true;
  return kern.tiles_start_from_c && !a.k_major && !b.k_major && !pre.data && out.c == out.d &&
         out.c_dtype == DType::f32 && out.ldc == out.ldd;
}

// Items whose packed panels hold all of K, so that the partial sums of a row block (at most
// GemmKernels::mc rows) stay in L2 through every K block and go to D at once:
// - narrow items (at most mc rows: M = 5..96 on the FMA targets, or M = 128 split by columns): A is packed
//   once; each column block of B is packed a micro-panel at a time over all of K, reading
//   every B row front to back (a K-major weight read in 256-wide slices across thousands of
//   rows would touch a new page per row);
// - short-K items (K at most kShortKBlocks blocks of kGemmKc, as in weight gradients): each
//   column block of B, packed for all of K, is reused by every row block, and A is packed
//   per row block.
//   The general order below sweeps a rows x nc buffer, far larger than the caches, once per
//   K block; for K = 512 and f32 outputs of hundreds of MB that traffic outweighs the FMAs.
//   Measured (M = 4096, 2 threads): K = 512 20 % faster, K = 1536 6-8 %, K = 2048 even (A is
//   re-packed once per column block, and those shrink as K grows).
// Every element is the same FMA chain as in the general order.
constexpr int64_t kShortKBlocks = 6;
constexpr int64_t kAllKBBytes = int64_t{4} << 20;  // packed B per thread, for all of K
constexpr int64_t kPackAOnceBytes = int64_t{32} << 20;  // packed A per thread, all rows and all of K

void run_all_k_item(const detail::GemmKernels& kern, const GemmOperand& a, const GemmOperand& b, const Prepacked& pre,
                    const Output& out, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  const int64_t k = a.k, rows = m1 - m0, blocks = std::max<int64_t>(1, ceil_div(k, kern.kc));
  const int64_t mc_max = std::min(kern.mc, rows), mc_pad = ceil_div(mc_max, kern.mr) * kern.mr;
  const int64_t nc_cap = std::max<int64_t>(kern.nr, kAllKBBytes / (4 * blocks * kern.kc) / kern.nr * kern.nr);
  const int64_t nc_max = pre.data ? column_block(mc_max, n1 - n0, kern.nr)
                                  : std::min(column_block(mc_max, n1 - n0, kern.nr), nc_cap);
  const int64_t nc_pad = ceil_div(nc_max, kern.nr) * kern.nr;
  ThreadBuffers& buf = thread_buffers();
  // (every K block is laid out kern.kc deep, the last one included)
  const int64_t a_block = panels_floats(kern, mc_pad / kern.mr, kern.kc, kern.mr);
  const int64_t b_block = panels_floats(kern, nc_pad / kern.nr, kern.kc, kern.nr);
  // A is packed once for all of the item's rows (row block after row block, each with all
  // of K) where that fits kPackAOnceBytes or is one row block, rather than once per column
  // block (AMX, bf16 4096 x 24576 x 1536, 2 threads: 24 column blocks of 512, 143 -> 137 ms;
  // FP8 with f32 scales, whose A is decoded while packing, 174 -> 163).
  const int64_t row_blocks = ceil_div(rows, kern.mc);
  const bool a_once = row_blocks == 1 || a_block * blocks * row_blocks * 4 <= kPackAOnceBytes;
  float* pa = buf.a.get(static_cast<size_t>(a_block * blocks * (a_once ? row_blocks : 1)));
  auto a_at = [&](int64_t ic) { return a_once ? pa + (ic - m0) / kern.mc * blocks * a_block : pa; };
  float* pb = pre.data ? nullptr : buf.b.get(static_cast<size_t>(b_block * blocks));
  const bool direct = tiles_write_d(kern, a, b, pre, out);
  float* acc = direct ? nullptr : buf.acc.get(static_cast<size_t>(mc_max * nc_pad));
  auto pack_a = [&](int64_t ic) {
    for (int64_t pc = 0; pc < k; pc += kern.kc)
      kern.pack(a, ic, std::min(kern.mc, m1 - ic), pc, std::min(kern.kc, k - pc), kern.mr,
                a_at(ic) + (pc / kern.kc) * a_block, detail::PackNext::next_rows);
  };
  if (a_once)
    for (int64_t ic = m0; ic < m1; ic += kern.mc) pack_a(ic);
  for (int64_t jc = n0; jc < n1; jc += nc_max) {
    const int64_t nc = std::min(nc_max, n1 - jc);
    auto b_at = [&](int64_t pc) {
      return pre.data ? pre.at(kern, jc, pc, std::min(kern.kc, k - pc)) : pb + (pc / kern.kc) * b_block;
    };
    // (K-major B a micro-panel at a time over all of K, as above; MN-major B, whose stored
    // rows run along N, a whole K block at a time, so that each stored row is read front to
    // back across the block's columns.)
    const int64_t panel_cols = b.k_major ? kern.nr : nc;
    for (int64_t p0 = 0; p0 < (pre.data ? 0 : nc); p0 += panel_cols)
      for (int64_t pc = 0; pc < k; pc += kern.kc) {
        const int64_t kc = std::min(kern.kc, k - pc);
        kern.pack_b(b, jc + p0, std::min<int64_t>(panel_cols, nc - p0), pc, kc, kern.nr,
                    pb + (pc / kern.kc) * b_block + panels_floats(kern, p0 / kern.nr, kc, kern.nr),
                    detail::PackNext::next_k);
      }
    for (int64_t ic = m0; ic < m1; ic += kern.mc) {
      const int64_t mc = std::min(kern.mc, m1 - ic), panel_stride = mc * kern.nr;
      if (!a_once) pack_a(ic);
      const float* pa_ic = a_at(ic);
      if (direct) {
        sweep_into_d(kern, pa_ic, b_at(0), mc, nc, k, reinterpret_cast<float*>(out.d) + ic * out.ldd + jc, out.ldd,
                     out.c != nullptr);
        continue;
      }
      if (k == 0) std::fill(acc, acc + mc * nc_pad, 0.0f);
      const LastBlock last{&out, ic, jc};
      const bool finish = k > 0 && finish_tiles(mc * nc_pad);  // (else the block is written below)
      for (int64_t pc = 0; pc < k; pc += kern.kc)
        sweep(kern, pa_ic + (pc / kern.kc) * a_block, b_at(pc), mc, nc, std::min(kern.kc, k - pc), acc,
              panel_stride, pc > 0, finish && pc + kern.kc >= k ? &last : nullptr);
      if (!finish) write_block(out, {acc, kern.nr, panel_stride}, ic, ic + mc, jc, nc);
    }
  }
}

void run_item(const detail::GemmKernels& kern, const GemmOperand& a, const GemmOperand& b, const Prepacked& pre,
              const Output& out, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  const int64_t k = a.k;
  const int64_t rows = m1 - m0;
  if (rows <= 0 || n1 <= n0) return;
  // (Calls whose tiles write D directly take that driver at every size, so that the thread
  // split, which changes the rows per item, cannot change their bits.)
  if (rows <= kern.mc || k <= kShortKBlocks * detail::kGemmKc || tiles_write_d(kern, a, b, pre, out))
    return run_all_k_item(kern, a, b, pre, out, m0, m1, n0, n1);
  const int64_t nc_max = column_block(rows, n1 - n0, kern.nr);
  ThreadBuffers& buf = thread_buffers();
  const int64_t mc_max = std::min<int64_t>(kern.mc, ceil_div(rows, kern.mr) * kern.mr);
  float* pa = buf.a.get(static_cast<size_t>(panels_floats(kern, ceil_div(mc_max, kern.mr), kern.kc, kern.mr)));
  float* pb = pre.data ? nullptr : buf.b.get(static_cast<size_t>(panels_floats(kern, ceil_div(nc_max, kern.nr), kern.kc, kern.nr)));
  const int64_t panel_stride = rows * kern.nr;
  float* acc = buf.acc.get(static_cast<size_t>(rows * ceil_div(nc_max, kern.nr) * kern.nr));
  const bool finish = k > 0 && finish_tiles(rows * ceil_div(nc_max, kern.nr) * kern.nr);
  for (int64_t jc = n0; jc < n1; jc += nc_max) {
    const int64_t nc = std::min(nc_max, n1 - jc);
    if (k == 0) std::fill(acc, acc + rows * ceil_div(nc_max, kern.nr) * kern.nr, 0.0f);
    for (int64_t pc = 0; pc < k; pc += kern.kc) {
      const int64_t kc = std::min(kern.kc, k - pc);
      const float* bp = pb;
      if (pre.data) bp = pre.at(kern, jc, pc, kc);
      else kern.pack_b(b, jc, nc, pc, kc, kern.nr, pb, detail::PackNext::next_rows);
      for (int64_t ic = m0; ic < m1; ic += kern.mc) {
        const int64_t mc = std::min(kern.mc, m1 - ic);
        kern.pack(a, ic, mc, pc, kc, kern.mr, pa, detail::PackNext::next_rows);
        const LastBlock last{&out, ic, jc};
        sweep(kern, pa, bp, mc, nc, kc, acc + (ic - m0) * kern.nr, panel_stride, pc > 0,
              finish && pc + kern.kc >= k ? &last : nullptr);
      }
    }
    if (!finish) write_block(out, {acc, kern.nr, panel_stride}, m0, m1, jc, nc);
  }
}

// Small M: B streamed once, split by columns into chunks that threads claim as they go
// (core/work_split.h: memory-bound); each claimed chunk's columns are written by its thread.
std::atomic<uint64_t> g_small_m_calls{0};
thread_local uint64_t t_small_m_call = 0;

void run_small_m(const detail::GemmKernels& kern, const GemmOperand& a, const GemmOperand& b, const Output& out,
                 int threads) {
  const uint64_t call = ++g_small_m_calls;
  const int64_t m = a.mn, n = b.mn;
  const int64_t cols = kern.small_m_cols;  // columns per result block (bounds the f32 buffer)
  // Chunks of whole small_m_align columns, rounded up for the dot paths (up to kGemmSmallM
  // rows: 4 x 576 x 7168 FP8 on avx512_bf16 ran 216 us against 234 with chunks rounded
  // down, measured when they still laid A out for every chunk; since session 36 they keep it
  // per call and thread, as the streaming kernels do, and this was not measured again), and
  // down beyond, where a few more chunks balance the threads better (16 x 576 x 7168: 18
  // chunks of one strip instead of 9 of two for 2 threads, 489 -> 443 us).
  const int64_t claim = detail::claim_chunk(n, threads), align = kern.small_m_align;
  const int64_t chunk = m > detail::kGemmSmallM ? std::max(align, claim / align * align) : ceil_div(claim, align) * align;
  const int64_t chunks = ceil_div(n, chunk);
#pragma omp parallel num_threads(threads)
  {
    float* res = thread_buffers().acc.get(static_cast<size_t>(m * cols));
    const uint64_t outer = t_small_m_call;  // (a call made inside a kernel keeps its own id)
    t_small_m_call = call;
#pragma omp for schedule(dynamic, 1)
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t n0 = c * chunk, n1 = std::min(n, n0 + chunk);
      for (int64_t j = n0; j < n1; j += cols) {
        const int64_t nc = std::min(cols, n1 - j);
        kern.small_m(a, b, j, j + nc, res, cols);
        write_block(out, {res, cols, 0}, 0, m, j, nc);
      }
    }
    if (out.stream_d) _mm_sfence();  // (as in run_gemm)
    t_small_m_call = outer;
  }
}

// Medium M on targets with a medium-M kernel: like small M, B split by columns, each
// thread's finished columns written as they come (C added, rounded).
void run_medium_m(const detail::GemmKernels& kern, const GemmOperand& a, const GemmOperand& b, const Output& out,
                  int threads) {
  const int64_t m = a.mn, n = b.mn;
  const int64_t chunk = ceil_div(ceil_div(n, threads), kern.small_m_align) * kern.small_m_align;
  struct Sink {
    const Output* out;
    int64_t m;
    static void write(void* ctx, const float* res, int64_t ld_res, int64_t j0, int64_t cols) {
      const auto* s = static_cast<const Sink*>(ctx);
      write_block(*s->out, {res, ld_res, 0}, 0, s->m, j0, cols);
    }
  };
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num();
    const int64_t n0 = std::min(n, t * chunk), n1 = std::min(n, n0 + chunk);
    Sink sink{&out, m};
    if (n0 < n1) kern.medium_m(a, b, n0, n1, &Sink::write, &sink);
    if (out.stream_d) _mm_sfence();  // (as in run_gemm)
  }
}

// pre: B's pre-packed panels (then b only gives its extents), made by the kernels of `isa`
// for the call `fn`; A must be an operand those kernels take.
thread_local bool t_validation_only = false;  // (detail::DenseValidationOnly)

void run_gemm(const char* fn, GemmOperand a, GemmOperand b, const Output& out, const Prepacked& pre = {},
              Isa isa = active_isa()) {
  // (Unpacked calls have nothing left to refuse; gemm_prepare may scan every scale of B.)
  if (t_validation_only && !pre.data) return;
  const Isa runs_on = detail::gemm_prepare(isa, a, b);
  if (pre.data && runs_on != isa)
    fail(fn, "a", std::string("activations the ") + isa_name(isa) + " kernels that packed b take",
         std::string(dtype_name(a.dtype)) + " with scale groups of " + std::to_string(a.gran_k) +
             " (amx: a power of two from 32 to 2048, avx512_bf16: 32 to 1024, or power-of-two scales)");
  if (t_validation_only) return;
  const int64_t m = a.mn, n = b.mn, k = a.k;
  if (m == 0 || n == 0) return;
  const detail::GemmKernels& kern = detail::gemm_kernels(runs_on);
  // (B groups must be whole lanes: the per-group sums of the FMA small-M path are 8 lanes
  // wide; the bf16-pair ones take what their prepare() took.)
  const bool small_m = m <= kern.small_m_rows && b.k_major && k > 0 &&
                       (kern.small_m_any_a || (a.k_major && (!b.sf || b.gran_k % 8 == 0))) &&
                       (!kern.small_m_takes || kern.small_m_takes(a, b));
  if (!pre.data && small_m) {
    const double bytes = static_cast<double>(n) * static_cast<double>(k);
    run_small_m(kern, a, b, out, bytes < 1e6 ? 1 : std::max(1, num_threads()));
    return;
  }
  // Threads: enough work per thread to pay for the fork.
  const double flops = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(std::max<int64_t>(k, 1));
  const int threads = flops < 4e6 ? 1 : std::max(1, num_threads());
  if (!pre.data && kern.medium_m && kern.medium_m_takes(a, b) && k > 0) {
    run_medium_m(kern, a, b, out, threads);
    return;
  }
  // Split rows or columns, whichever repacks less: splitting rows packs all of B once per
  // thread; splitting columns repacks A once per column block of each thread.
  const int64_t tiles_m = ceil_div(m, kern.mr), tiles_n = ceil_div(n, kern.nr);
  const int64_t nc_m = column_block(ceil_div(m, threads), n, kern.nr), nc_n = column_block(m, ceil_div(n, threads), kern.nr);
  // (Pre-packed B is not packed again but read by every thread that uses it: 4 bytes per
  // weight from DRAM, the same cost model.)
  const double pack_split_m = static_cast<double>(n) * threads + static_cast<double>(m) * ceil_div(n, nc_m);
  const double pack_split_n =
      static_cast<double>(n) + static_cast<double>(m) * threads * ceil_div(ceil_div(n, threads), nc_n);
  const bool split_m = tiles_n < threads || (tiles_m >= threads && pack_split_m <= pack_split_n);
  const int64_t chunk_m = split_m ? ceil_div(tiles_m, threads) * kern.mr : m;
  const int64_t chunk_n = split_m ? n : ceil_div(tiles_n, threads) * kern.nr;
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num();
    const int64_t m0 = split_m ? std::min(m, t * chunk_m) : 0;
    const int64_t n0 = split_m ? 0 : std::min(n, t * chunk_n);
    run_item(kern, a, b, pre, out, m0, std::min(m, m0 + chunk_m), n0, std::min(n, n0 + chunk_n));
    if (out.stream_d) _mm_sfence();  // (the item's streamed stores, before the caller reads D)
  }
}

// ---------------------------------------------------------------- validation

std::string dims(int64_t a, int64_t b) { return shape_str({a, b}); }

// Logical (mn, k) of a stored operand, and its description without scales.
GemmOperand describe(const char* fn, const char* arg, const Tensor& t, bool k_major,
                     std::initializer_list<DType> allowed) {
  detail::check_cpu_matrix(fn, arg, t, allowed);
  GemmOperand op;
  op.data = static_cast<const uint8_t*>(t.data());
  op.dtype = t.dtype();
  op.k_major = k_major;
  op.ld = t.stride(0);
  const int64_t rows = t.size(0);
  const int64_t cols = t.dtype() == DType::e2m1x2 ? 2 * t.size(1) : t.size(1);  // FP4: even extent
  op.mn = k_major ? rows : cols;
  op.k = k_major ? cols : rows;
  return op;
}

void attach_scales(const char* fn, const char* arg, GemmOperand& op, const Tensor& sf, const OperandRecipe& r) {
  if (r.gran_mn <= 0 || r.gran_k <= 0)
    fail(fn, std::string("recipe for ") + arg, "positive granularities",
         "(" + std::to_string(r.gran_mn) + ", " + std::to_string(r.gran_k) + ")");
  detail::check_cpu(fn, arg, sf);
  detail::check_dtype(fn, arg, sf, {DType::f32, DType::i32});
  detail::check_rank(fn, arg, sf, 2);
  const int64_t groups = ceil_div(op.k, r.gran_k);
  const int64_t rows = ceil_div(op.mn, r.gran_mn);
  const int64_t cols = sf.dtype() == DType::f32 ? groups : ceil_div(groups, 4);
  if (sf.size(0) != rows || sf.size(1) != cols)
    fail(fn, arg,
         dims(rows, cols) + " (" + (sf.dtype() == DType::f32 ? "f32" : "packed ue8m0") + " scales for gran_mn " +
             std::to_string(r.gran_mn) + ", gran_k " + std::to_string(r.gran_k) + ")",
         shape_str(sf.shape()));
  op.sf = sf.data();
  op.sf_dtype = sf.dtype();
  op.sf_stride_mn = sf.stride(0);
  op.sf_stride_k = sf.stride(1);
  op.gran_mn = r.gran_mn;
  op.gran_k = r.gran_k;
}

// bf16 D of at least kStreamDBytes is written with stores that bypass the cache (where the
// sums are converted by f32_rows_to_bf16_canonical: finished tiles and blocks without C):
// the call does not read it back, and those stores skip reading every line first. Each
// thread fences once after its item. AMX, 2 threads, alternated minima, 4096 x N x K:
// bf16 7168 x 2048 (56 MiB of D) 42.2 -> 37.2 ms, 24576 x 1536 126.6 -> 112.1, 4096 x
// 7168 (32 MiB) 91.7 -> 84.5, 32768 x 512 53.2 -> 49.9; FP8 with ue8m0 scales 7168 x 2048
// 43.6 -> 38.8; FP8 with f32 scales (promoted tiles) 32768 x 512 82.6 -> 80.2, 24576 x
// 1536 and 4096 x 7168 even, 7168 x 2048 58.4 -> 61.5 while sweep still requested the
// finished tiles' D for writing (since it does not: 58.7 -> 55.4, and 4096 x 7168 127.7 ->
// 121.5, 32768 x 512 80.9 -> 76.2). 2112 x 7168 (17 MiB): within the noise, so smaller D
// keeps the cache. Keeping the partial sums to the end of the call instead of finishing
// tiles (kFinishTilesAbove) is even with either write.
constexpr int64_t kStreamDBytes = int64_t{32} << 20;

Output describe_output(const char* fn, const Tensor& d, const Tensor& c, int64_t m, int64_t n) {
  detail::check_cpu_matrix(fn, "d", d, {DType::bf16, DType::f32});
  detail::check_shape(fn, "d", d, {m, n});
  detail::check_no_self_overlap(fn, "d", d);
  Output out;
  out.d = static_cast<uint8_t*>(d.data());
  out.dtype = d.dtype();
  out.ldd = d.stride(0);
  if (c.defined()) {
    detail::check_cpu_matrix(fn, "c", c, {d.dtype()});
    detail::check_shape(fn, "c", c, {m, n});
    detail::check_c_apart_from_d(fn, d, c);
    out.c = static_cast<const uint8_t*>(c.data());
    out.c_dtype = c.dtype();
    out.ldc = c.stride(0);
  }
  out.stream_d = out.dtype == DType::bf16 && !out.c && m * n * 2 >= kStreamDBytes;
  return out;
}

void check_k(const char* fn, const GemmOperand& a, const GemmOperand& b) {
  if (a.k != b.k) fail(fn, "b", "K = " + std::to_string(a.k) + " (from a)", "K = " + std::to_string(b.k));
}

void bf16_gemm(const char* fn, Side sa, Side sb, const Tensor& a, const Tensor& b, const Tensor& d,
               const Tensor& c) {
  const GemmOperand ga = describe(fn, "a", a, sa == Side::n, {DType::bf16});
  const GemmOperand gb = describe(fn, "b", b, sb == Side::t, {DType::bf16});
  check_k(fn, ga, gb);
  const Output out = describe_output(fn, d, c, ga.mn, gb.mn);
  detail::check_apart(fn, "d", d, {{"a", &a}, {"b", &b}});
  run_gemm(fn, ga, gb, out);
}

OperandRecipe resolve(const GemmOptions& o, bool is_a, bool any_fp4) {
  if (is_a && o.recipe_a) return *o.recipe_a;
  if (!is_a && o.recipe_b) return *o.recipe_b;
  const Recipe r = o.recipe ? *o.recipe : (any_fp4 ? Recipe{1, 1, 32} : Recipe{1, 128, 128});
  return {is_a ? r.gran_m : r.gran_n, r.gran_k};
}

// FP4 values are packed along the stored last dimension, whose logical extent e is only
// known up to ceil(e / 2) = stored columns. It is taken from where it is unambiguous: K from
// the other operand when that one is not packed along K (else 2 x columns), MN from D.
void resolve_packed_extent(const char* fn, const char* arg, int64_t& extent, int64_t known, int64_t stored_cols) {
  if (ceil_div(known, 2) != stored_cols)
    fail(fn, arg, std::to_string(ceil_div(known, 2)) + " packed FP4 columns (extent " + std::to_string(known) + ")",
         std::to_string(stored_cols));
  extent = known;
}

void scaled_gemm(const char* fn, Side sa, Side sb, const Quantized& a, const Quantized& b, const Tensor& d,
                 const Tensor& c, const GemmOptions& options) {
  GemmOperand ga = describe(fn, "a.values", a.values, sa == Side::n, {DType::e4m3, DType::e2m1x2});
  GemmOperand gb = describe(fn, "b.values", b.values, sb == Side::t, {DType::e4m3, DType::e2m1x2});
  const bool a_fp4 = ga.dtype == DType::e2m1x2, b_fp4 = gb.dtype == DType::e2m1x2;
  if (a_fp4 && ga.k_major && !(b_fp4 && gb.k_major)) resolve_packed_extent(fn, "a.values", ga.k, gb.k, ga.k / 2);
  if (b_fp4 && gb.k_major && !(a_fp4 && ga.k_major)) resolve_packed_extent(fn, "b.values", gb.k, ga.k, gb.k / 2);
  detail::check_cpu_matrix(fn, "d", d, {DType::bf16, DType::f32});
  if (a_fp4 && !ga.k_major) resolve_packed_extent(fn, "a.values", ga.mn, d.size(0), ga.mn / 2);
  if (b_fp4 && !gb.k_major) resolve_packed_extent(fn, "b.values", gb.mn, d.size(1), gb.mn / 2);
  check_k(fn, ga, gb);
  const bool any_fp4 = a_fp4 || b_fp4;
  attach_scales(fn, "a.sf", ga, a.sf, resolve(options, true, any_fp4));
  attach_scales(fn, "b.sf", gb, b.sf, resolve(options, false, any_fp4));
  const Output out = describe_output(fn, d, c, ga.mn, gb.mn);
  detail::check_apart(fn, "d", d, {{"a.values", &a.values}, {"a.sf", &a.sf}, {"b.values", &b.values}, {"b.sf", &b.sf}});
  run_gemm(fn, ga, gb, out);
}

}  // namespace

// ---------------------------------------------------------------- pre-packed weights

struct PackedWeightsAccess {
  static PackedWeights make(Tensor panels, int64_t n, int64_t k, DType dtype, Isa isa) {
    PackedWeights w;
    w.panels_ = std::move(panels);
    w.n_ = n, w.k_ = k, w.dtype_ = dtype, w.isa_ = isa;
    return w;
  }
  static const float* data(const PackedWeights& w) { return static_cast<const float*>(w.panels_.data()); }
};

namespace {

// B packed panel by panel (panels are independent, so any thread split gives the same
// bytes), every panel over all of K, by the active ISA's pack (avx512's where the AMX
// kernels do not take B): the same bytes the driver would pack for any block.
PackedWeights pack_weights(GemmOperand b) {
  GemmOperand like_b = b;  // (the target decides per operand)
  const Isa isa = detail::gemm_prepare(active_isa(), like_b, b);
  const detail::GemmKernels& kern = detail::gemm_kernels(isa);
  const int64_t n_pad = ceil_div(b.mn, kern.nr) * kern.nr, panels = n_pad / kern.nr;
  const int64_t blocks = b.k / kern.kc, tail = b.k % kern.kc;
  Tensor out = Tensor::empty({panels * (blocks * kern.panel_floats(kern.kc, kern.nr) + kern.panel_floats(tail, kern.nr))},
                             DType::f32);
  float* data = static_cast<float*>(out.data());
  const double elements = static_cast<double>(n_pad) * static_cast<double>(b.k);
#pragma omp parallel for schedule(static) num_threads(elements < 1e6 ? 1 : std::max(1, num_threads()))
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t pc = 0; pc < b.k; pc += kern.kc) {
      const int64_t kc = std::min(kern.kc, b.k - pc);
      kern.pack_b(b, p * kern.nr, std::min<int64_t>(kern.nr, b.mn - p * kern.nr), pc, kc, kern.nr,
                  data + (pc / kern.kc) * panels * kern.panel_floats(kern.kc, kern.nr) + p * kern.panel_floats(kc, kern.nr),
                  detail::PackNext::next_k);
    }
  return PackedWeightsAccess::make(std::move(out), b.mn, b.k, b.dtype, isa);
}

// The packed B's panels for run_gemm, after checking the extents against A and D.
void run_packed(const char* fn, const GemmOperand& a, const PackedWeights& b, const Tensor& d, const Tensor& c) {
  if (!b.defined()) fail(fn, "b", "weights made by pack_bf16_weights / pack_fp8_fp4_weights", "an empty PackedWeights");
  if (a.k != b.k()) fail(fn, "b", "K = " + std::to_string(a.k) + " (from a)", "K = " + std::to_string(b.k()));
  GemmOperand gb;  // extents only: the values come from the panels
  gb.dtype = b.source_dtype();
  gb.mn = b.n();
  gb.k = b.k();
  const int64_t nr = detail::gemm_kernels(b.isa()).nr;
  run_gemm(fn, a, gb, describe_output(fn, d, c, a.mn, b.n()), Prepacked{PackedWeightsAccess::data(b), ceil_div(b.n(), nr) * nr},
           b.isa());
}

}  // namespace

namespace detail {
DenseValidationOnly::DenseValidationOnly() : previous_(t_validation_only) { t_validation_only = true; }
DenseValidationOnly::~DenseValidationOnly() { t_validation_only = previous_; }

uint64_t small_m_call_id() { return t_small_m_call; }

// C is D itself (accumulating in place) or lies apart from it: a C that partly overlaps D
// would be read after some of it was overwritten (and by other threads).
void check_c_apart_from_d(const char* fn, const Tensor& d, const Tensor& c) {
  if (!c.defined() || (c.data() == d.data() && c.shape() == d.shape() && c.strides() == d.strides())) return;
  if (views_overlap(c, d)) fail(fn, "c", "d itself (in place) or memory apart from d", "a view that partly overlaps d");
}
}  // namespace detail

PackedWeights pack_bf16_weights(const Tensor& b, bool k_major) {
  return pack_weights(describe("pack_bf16_weights", "b", b, k_major, {DType::bf16}));
}

PackedWeights pack_fp8_fp4_weights(const Quantized& b, bool k_major, const GemmOptions& options) {
  const char* fn = "pack_fp8_fp4_weights";
  GemmOperand gb = describe(fn, "b.values", b.values, k_major, {DType::e4m3, DType::e2m1x2});
  attach_scales(fn, "b.sf", gb, b.sf, resolve(options, false, gb.dtype == DType::e2m1x2));
  return pack_weights(gb);
}

void bf16_gemm_packed(const Tensor& a, const PackedWeights& b, const Tensor& d, const Tensor& c) {
  const GemmOperand ga = describe("bf16_gemm_packed", "a", a, true, {DType::bf16});
  detail::check_apart("bf16_gemm_packed", "d", d, {{"a", &a}});
  run_packed("bf16_gemm_packed", ga, b, d, c);
}

void fp8_fp4_gemm_packed(const Quantized& a, const PackedWeights& b, const Tensor& d, const Tensor& c,
                         const GemmOptions& options) {
  const char* fn = "fp8_fp4_gemm_packed";
  GemmOperand ga = describe(fn, "a.values", a.values, true, {DType::e4m3, DType::e2m1x2});
  const bool a_fp4 = ga.dtype == DType::e2m1x2;
  if (a_fp4 && b.defined()) resolve_packed_extent(fn, "a.values", ga.k, b.k(), ga.k / 2);
  attach_scales(fn, "a.sf", ga, a.sf, resolve(options, true, a_fp4 || b.source_dtype() == DType::e2m1x2));
  detail::check_apart(fn, "d", d, {{"a.values", &a.values}, {"a.sf", &a.sf}});
  run_packed(fn, ga, b, d, c);
}

void bf16_gemm_nt(const Tensor& a, const Tensor& b, const Tensor& d, const Tensor& c) {
  bf16_gemm("bf16_gemm_nt", Side::n, Side::t, a, b, d, c);
}
void bf16_gemm_nn(const Tensor& a, const Tensor& b, const Tensor& d, const Tensor& c) {
  bf16_gemm("bf16_gemm_nn", Side::n, Side::n, a, b, d, c);
}
void bf16_gemm_tn(const Tensor& a, const Tensor& b, const Tensor& d, const Tensor& c) {
  bf16_gemm("bf16_gemm_tn", Side::t, Side::n, a, b, d, c);
}
void bf16_gemm_tt(const Tensor& a, const Tensor& b, const Tensor& d, const Tensor& c) {
  bf16_gemm("bf16_gemm_tt", Side::t, Side::t, a, b, d, c);
}

void fp8_fp4_gemm_nt(const Quantized& a, const Quantized& b, const Tensor& d, const Tensor& c,
                     const GemmOptions& options) {
  scaled_gemm("fp8_fp4_gemm_nt", Side::n, Side::t, a, b, d, c, options);
}
void fp8_fp4_gemm_nn(const Quantized& a, const Quantized& b, const Tensor& d, const Tensor& c,
                     const GemmOptions& options) {
  scaled_gemm("fp8_fp4_gemm_nn", Side::n, Side::n, a, b, d, c, options);
}
void fp8_fp4_gemm_tn(const Quantized& a, const Quantized& b, const Tensor& d, const Tensor& c,
                     const GemmOptions& options) {
  scaled_gemm("fp8_fp4_gemm_tn", Side::t, Side::n, a, b, d, c, options);
}
void fp8_fp4_gemm_tt(const Quantized& a, const Quantized& b, const Tensor& d, const Tensor& c,
                     const GemmOptions& options) {
  scaled_gemm("fp8_fp4_gemm_tt", Side::t, Side::t, a, b, d, c, options);
}

int64_t get_tma_aligned_size(int64_t mn, int64_t element_size) {
  if (element_size <= 0 || 16 % element_size != 0)
    fail("get_tma_aligned_size", "element_size", "1, 2, 4, 8 or 16", std::to_string(element_size));
  if (mn < 0) fail("get_tma_aligned_size", "mn", "mn >= 0", std::to_string(mn));
  const int64_t align = 16 / element_size;
  if (mn > std::numeric_limits<int64_t>::max() / align * align)  // (rounds up past the last multiple)
    fail("get_tma_aligned_size", "mn", "a size whose alignment fits in int64", std::to_string(mn));
  return ceil_div(mn, align) * align;
}

Tensor transform_sf_into_required_layout(const Tensor& sf, int64_t mn, int64_t k, const Recipe& recipe,
                                         std::optional<int64_t> num_groups, bool is_sfa) {
  constexpr const char* fn = "transform_sf_into_required_layout";
  detail::check_cpu(fn, "sf", sf);
  detail::check_dtype(fn, "sf", sf, {DType::f32, DType::i32});
  if (mn < 0 || k < 0) fail(fn, "mn, k", "non-negative", std::to_string(mn) + ", " + std::to_string(k));
  const int64_t gran_mn = is_sfa ? recipe.gran_m : recipe.gran_n;
  if (gran_mn <= 0 || recipe.gran_k <= 0) fail(fn, "recipe", "positive granularities", "a non-positive one");
  const int64_t groups = ceil_div(k, recipe.gran_k);
  Shape expected{ceil_div(mn, gran_mn), sf.dtype() == DType::f32 ? groups : ceil_div(groups, 4)};
  if (num_groups) {
    if (*num_groups <= 0) fail(fn, "num_groups", "positive", std::to_string(*num_groups));
    expected.insert(expected.begin(), *num_groups);
  }
  detail::check_shape(fn, "sf", sf, expected);
  Tensor out;
  try {  // (a broadcast view, stride 0, may be too large to copy)
    out = Tensor::empty(expected, sf.dtype());
  } catch (const Error& e) {
    fail(fn, "sf", "scales whose contiguous copy can be allocated", e.actual());
  }
  out.copy_from(sf);
  return out;
}

}  // namespace moekit

// AVX512_BF16 target (Isa::avx512_bf16): vdpbf16ps on the bf16 panels of bf16_panels.h (the
// AMX target's format and packing), for CPUs that have AVX512_BF16 but no AMX (AMD Zen 4
// and 5). There vdpbf16ps multiplies 32 bf16 pairs per instruction, twice the f32 FMA's 16
// products, and the panels hold 2 bytes per value instead of 4.
//
// A 32 x 32 output tile is computed in three passes of rows (12, 12 and 8): a pass keeps its
// rows x 32 columns in 24 (16) zmm accumulators, loads the step's two B vectors (16 columns
// x one K pair each) once per K pair and multiplies them by each row's K pair, broadcast
// from the A panel. Tiles whose scales are promoted per K group take five passes (7, 7, 6,
// 6 and 6 rows), each holding its partial and running sums in registers.
//
// Accuracy class (as the AMX one): vdpbf16ps adds the two products of a pair to the
// accumulator inside the instruction (its own rounding; Intel documents denormal inputs
// and results as flushed), so the results are not the FMA paths' bits. They are the same
// on every run and for any thread count: fixed K blocks, pairs in K order within a block,
// scales promoted per K group in the same order as the AMX target's.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "bf16_panels.h"
#include "gemm_kernels.h"

namespace moekit::detail {
namespace {

using bf16_panels::kBlockBytes;
using bf16_panels::kStep;
using bf16_panels::kWidth;

constexpr int kMr = kWidth, kNr = kWidth;
// Blocking, measured on 2 cores of a Zen 5 EPYC (48 KiB L1d, 1 MiB L2, 32 MiB L3), bf16
// 4096 x 2112 x 7168: the tile alone reaches 95 % of the vdpbf16ps peak with its panels in
// L1 or L2, so what is left to choose is how often the partial sums go through memory (once
// per K block) and how many A panels share each B panel (rows per block). kc 256 / mc 192:
// 0.70-0.72 TFLOP/s; 512 / 384: 0.77; 1024 / 384: 0.78-0.81; 1024 / 768: 0.74-0.77; 2048 /
// 384: 0.74-0.76 (the A block, 768 KiB at 1024 / 384, then outgrows L2).
constexpr int64_t kKc = 1024;
constexpr int64_t kMc = 384;

inline __m512bh pair_of(const uint8_t* p) {
  int32_t word;
  std::memcpy(&word, p, 4);
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(word));
}
inline __m512bh pairs_at(const uint8_t* p) { return reinterpret_cast<__m512bh>(_mm512_load_si512(p)); }

// Where row r's K pairs of step s are: in the packed A panel, or (DirectA) in the rows
// themselves (PanelHeader::direct).
struct PackedA {
  const uint8_t* steps;
  const uint8_t* row(int r, int64_t s) const { return steps + s * 2 * kBlockBytes + (r / 16) * kBlockBytes + (r % 16) * 64; }
};
struct DirectA {
  const uint8_t* rows;
  int64_t row_bytes;
  const uint8_t* row(int r, int64_t s) const { return rows + r * row_bytes + s * kStep * 2; }
};

// acc[r][h] (row R0 + r, columns 16h..16h+15) += steps [s0, s1) of the panels.
template <int R0, int R, class A>
inline void dot_steps(const A& a, const uint8_t* b, int64_t s0, int64_t s1, __m512 (&acc)[R][2]) {
  for (int64_t s = s0; s < s1; ++s) {
    const uint8_t* bs = b + s * 2 * kBlockBytes;
#pragma GCC unroll 16
    for (int p = 0; p < kStep / 2; ++p) {
      const __m512bh b0 = pairs_at(bs + p * 64), b1 = pairs_at(bs + kBlockBytes + p * 64);
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        const __m512bh x = pair_of(a.row(R0 + r, s) + p * 4);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, b0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b1);
      }
    }
  }
}

// The A panel's pairs, wherever they are, to `body` (a generic lambda taking PackedA or
// DirectA).
template <class Body>
inline void with_a(const float* a, Body body) {
  const auto& h = bf16_panels::header(a);
  if (h.direct) return body(DirectA{h.rows, h.row_bytes});
  body(PackedA{bf16_panels::panel_steps(a)});
}

// Rows R0..R0+R-1 of a tile whose scales were folded into the values.
template <int R0, int R>
void plain_rows(int64_t kc, const float* a, const float* b, float* c, int64_t ldc, bool accumulate) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h)
      acc[r][h] = accumulate ? _mm512_loadu_ps(c + (R0 + r) * ldc + 16 * h) : _mm512_setzero_ps();
  with_a(a, [&](const auto& src) { dot_steps<R0, R>(src, bf16_panels::panel_steps(b), 0, bf16_panels::step_count(kc), acc); });
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm512_storeu_ps(c + (R0 + r) * ldc + 16 * h, acc[r][h]);
}

// Promoted: each K group (the finer of the two operands' groups) is summed from zero in
// registers, then acc = fma(partial, sa[i] · sb[j], acc) in f32 (an operand that is not
// promoted has scale 1): the AMX target's order. Passes of at most 7 rows, so that the
// partial sums and the running sums (2 x 14 zmm) both stay in registers: with passes of 12
// rows the running sums went through memory once per group.
template <int R0, int R>
void promoted_rows(int64_t kc, const float* a, const float* b, float* c, int64_t ldc, bool accumulate) {
  static_assert(R <= 7, "partial and running sums of the pass in registers");
  const auto& ha = bf16_panels::header(a);
  const auto& hb = bf16_panels::header(b);
  const int64_t steps = bf16_panels::step_count(kc);
  const int64_t ga = ha.promoted ? ha.group_steps : steps, gb = hb.promoted ? hb.group_steps : steps;
  const int64_t group = std::min(ga, gb);
  const float* sa = a + bf16_panels::scales_offset(kc);
  const float* sb = b + bf16_panels::scales_offset(kc);
  __m512 sums[R][2];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h)
      sums[r][h] = accumulate ? _mm512_loadu_ps(c + (R0 + r) * ldc + 16 * h) : _mm512_setzero_ps();
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t s0 = 0; s0 < steps; s0 += group) {
    __m512 part[R][2];
    for (int r = 0; r < R; ++r) part[r][0] = part[r][1] = _mm512_setzero_ps();
    with_a(a, [&](const auto& src) {
      dot_steps<R0, R>(src, bf16_panels::panel_steps(b), s0, std::min(steps, s0 + group), part);
    });
    const float* sa_g = ha.promoted ? sa + (s0 / ga) * kMr : nullptr;
    const float* sb_g = hb.promoted ? sb + (s0 / gb) * kNr : nullptr;
    const __m512 sb0 = sb_g ? _mm512_load_ps(sb_g) : one, sb1 = sb_g ? _mm512_load_ps(sb_g + 16) : one;
    for (int r = 0; r < R; ++r) {
      const __m512 ar = _mm512_set1_ps(sa_g ? sa_g[R0 + r] : 1.0f);
      sums[r][0] = _mm512_fmadd_ps(part[r][0], _mm512_mul_ps(ar, sb0), sums[r][0]);
      sums[r][1] = _mm512_fmadd_ps(part[r][1], _mm512_mul_ps(ar, sb1), sums[r][1]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm512_storeu_ps(c + (R0 + r) * ldc + 16 * h, sums[r][h]);
}

// Passes over the first `rows` rows only (padded panel rows are zero; a pass writes all its
// rows): 12 + 12 + 8 for a full panel, fewer and narrower ones for a short panel (16 rows of
// A, say: 8 + 8, not 12 + 12).
void plain_passes(int64_t kc, const float* a, const float* b, float* c, int64_t ldc, int rows, bool accumulate) {
  if (rows <= 8) return plain_rows<0, 8>(kc, a, b, c, ldc, accumulate);
  if (rows <= 16) {
    plain_rows<0, 8>(kc, a, b, c, ldc, accumulate);
    return plain_rows<8, 8>(kc, a, b, c, ldc, accumulate);
  }
  plain_rows<0, 12>(kc, a, b, c, ldc, accumulate);
  plain_rows<12, 12>(kc, a, b, c, ldc, accumulate);
  if (rows > 24) plain_rows<24, 8>(kc, a, b, c, ldc, accumulate);
}

// Promoted passes: 7, 7, 6, 6 and 6 rows for a full panel, as many as `rows` needs.
void promoted_passes(int64_t kc, const float* a, const float* b, float* c, int64_t ldc, int rows, bool accumulate) {
  promoted_rows<0, 7>(kc, a, b, c, ldc, accumulate);
  if (rows > 7) promoted_rows<7, 7>(kc, a, b, c, ldc, accumulate);
  if (rows > 14) promoted_rows<14, 6>(kc, a, b, c, ldc, accumulate);
  if (rows > 20) promoted_rows<20, 6>(kc, a, b, c, ldc, accumulate);
  if (rows > 26) promoted_rows<26, 6>(kc, a, b, c, ldc, accumulate);
}

void passes(int64_t kc, const float* a, const float* b, float* c, int64_t ldc, int rows, bool accumulate) {
  const bool promoted = bf16_panels::header(a).promoted || bf16_panels::header(b).promoted;
  if (promoted) return promoted_passes(kc, a, b, c, ldc, rows, accumulate);
  plain_passes(kc, a, b, c, ldc, rows, accumulate);
}

void tile(int64_t kc, const float* a, const float* b, float* c, int64_t ldc, int rows, int cols, bool accumulate) {
  if (rows == kMr && cols == kNr) return passes(kc, a, b, c, ldc, rows, accumulate);
  // Partial tile: its passes on a scratch copy (padded panel rows and columns are zero).
  alignas(64) float scratch[kMr * kNr];
  if (accumulate) {
    std::fill(scratch, scratch + kMr * kNr, 0.0f);  // (the padding the passes load is never read back)
    for (int i = 0; i < rows; ++i) std::memcpy(scratch + i * kNr, c + i * ldc, static_cast<size_t>(cols) * 4);
  }
  passes(kc, a, b, scratch, kNr, rows, accumulate);
  for (int i = 0; i < rows; ++i) std::memcpy(c + i * ldc, scratch + i * kNr, static_cast<size_t>(cols) * 4);
}

bool prepare(GemmOperand& a, GemmOperand& b) { return bf16_panels::prepare(a, b, kKc); }

// Whether a pass's rows, row_bytes apart, spread over enough L1 sets: a step reads a line
// of each row 16 times over, and lines 4 KiB apart share a set of the 8-way 32 KiB L1s of
// Zen 4 (and most x86 cores). Direct rows 4 or 32 KiB apart (K = 2048 or 16384) ran 5 %
// slower than packed ones (every row in one set); 14 KiB apart (K = 7168: six rows a set)
// 2 % faster.
bool rows_spread_over_sets(int64_t row_bytes) {
  constexpr int kSets = 64, kMaxRowsPerSet = 6, kPassRows = 12;
  int rows_in[kSets] = {};
  for (int r = 0; r < kPassRows; ++r)
    if (++rows_in[(r * row_bytes / 64) % kSets] > kMaxRowsPerSet) return false;
  return true;
}

// A's panels. K-major bf16 A without scales, whole steps, rows spread over the L1 sets:
// each full panel's header names its rows where they are stored, and the tiles broadcast
// pairs from there (DirectA) instead of from a copy (a partial panel is packed: the passes
// read whole passes of rows). Packing such A had been 2-3 % of bf16 M = 4096 calls on 2
// Zen 4 cores, A being packed again for every column block.
void pack_a(const GemmOperand& op, int64_t mn0, int64_t count, int64_t k0, int64_t kc, int width, float* out,
            PackNext next) {
  if (op.dtype != DType::bf16 || !op.k_major || op.sf || op.promote || kc % bf16_panels::kStep != 0 ||
      !rows_spread_over_sets(op.ld * 2))
    return bf16_panels::pack_a(op, mn0, count, k0, kc, width, out, next);
  const int64_t full = count / kMr * kMr, panel = bf16_panels::panel_floats(kc, kMr);
  for (int64_t p0 = 0; p0 < full; p0 += kMr) {
    auto* h = reinterpret_cast<bf16_panels::PanelHeader*>(out + (p0 / kMr) * panel);
    *h = bf16_panels::PanelHeader{};
    h->direct = 1;
    h->rows = op.data + ((mn0 + p0) * op.ld + k0) * 2;
    h->row_bytes = op.ld * 2;
  }
  if (full < count) bf16_panels::pack_a(op, mn0 + full, count - full, k0, kc, width, out + (full / kMr) * panel, next);
}

// Small M, B K-major. Up to 4 rows of K-major A: FP8 / FP4 weights take the bf16 dot
// products on weights decoded in registers, bf16 weights (1 to 4 rows of bf16 A, no scales)
// the same dot products on the weights as they are, the rest the FMA kernel (B streamed
// once).
// Other calls of up to 24 rows, and of up to 32 against FP4 weights, stream the weights
// through vdpbf16ps without packing them (stream_dp.inc). Measured on 2 cores of a Zen 4
// EPYC against the blocked path (which packs B first), N x K = 4096 x 7168, 2 threads,
// alternated: 16 rows FP8 with ue8m0 scales 1.1-1.7x, FP4 1.3-2.1x, FP8 with f32 scales and
// bf16 about even; 5 and 8 rows (256-bit products) FP8 ue8m0 1.2x, FP4 1.5x, bf16 and FP8
// f32 even; 20 rows (512 + 256-bit products) FP4 1.25x, the others even to 1.05x; 25 to 32
// rows FP4 1.2-1.4x, bf16 and FP8 even (there they keep the blocked path).
constexpr int64_t kStreamAnyRows = 24;

bool small_m_takes(const GemmOperand& a, const GemmOperand& b) {
  return a.mn <= kStreamAnyRows || b.dtype == DType::e2m1x2;
}

void small_m(const GemmOperand& a, const GemmOperand& b, int64_t n0, int64_t n1, float* out, int64_t ld_out) {
  if (a.mn <= kGemmSmallM && a.k_major && (!b.sf || b.gran_k % 8 == 0)) {
    const bf16_panels::SmallMFn fma = gemm_kernels_avx512().small_m;
    if (bf16_panels::dot_rows_take(a, b, kGemmSmallM)) return bf16_panels::dot_rows(a, b, n0, n1, out, ld_out, fma);
    return fma(a, b, n0, n1, out, ld_out);
  }
  bf16_panels::stream_small_m(a, b, n0, n1, out, ld_out);
}

}  // namespace

const GemmKernels& gemm_kernels_avx512_bf16() {
  static const GemmKernels k = [] {
    GemmKernels t = bf16_panels::panel_kernels(kKc, kMc);
    t.tile = &tile;
    t.prepare = &prepare;
    t.pack = &pack_a;
    t.small_m = &small_m;
    t.small_m_rows = bf16_panels::kStreamRows;
    t.small_m_cols = 4096;
    t.small_m_align = bf16_panels::kWidth;
    t.small_m_any_a = true;
    t.small_m_takes = &small_m_takes;
    t.d_requests_into_l2 = true;
    return t;
  }();
  return k;
}

}  // namespace moekit::detail

// The bf16 micro-panel format shared by the targets that multiply bf16 pairs (AMX tiles,
// AVX512_BF16 vdpbf16ps): 32 rows (A) or columns (B) per panel, K in 32-deep steps. The
// packing and the operand checks live in gemm_amx.cpp (AVX-512 code only; the AMX
// instructions there are in its tile functions), and both targets call them.
//
// A panel is a 64-byte header, then K in 32-deep steps, zero-padded, 2 KiB per step: two
// 1 KiB blocks for rows (or columns) 0-15 and 16-31, then the scales of a promoted operand:
// 32 f32 per K group of the block.
//  - A panel: block row r = operand row r, 32 bf16 along K (16 pairs).
//  - B panel: block row p = K pair p of the step, 16 columns x (k = 2p, 2p + 1) bf16 pairs.
// FP8/FP4 values are decoded to bf16 exactly; power-of-two scales are folded into them
// (exact); other scales stay beside the raw values and are promoted per K group.
#pragma once

#include <cstdint>

#include "gemm_kernels.h"

namespace moekit::detail::bf16_panels {

constexpr int kWidth = 32;        // rows (A) or columns (B) of a panel
constexpr int kStep = 32;         // K per step (16 pairs)
constexpr int kBlockBytes = 1024;  // 16 rows x 64 bytes
constexpr int64_t kHeaderFloats = 16;
constexpr int64_t kMaxKc = 2048;  // the deepest K block any target packs

struct alignas(64) PanelHeader {
  uint32_t promoted;     // 0: values carry their scales; 1: raw values, scales after the steps
  uint32_t group_steps;  // K group / 32, when promoted
  // 1: an A panel whose 32 rows are read where they are stored (no steps follow): row r's
  // bf16 at rows + r * row_bytes, from the block's first K on (avx512_bf16 only).
  uint32_t direct;
  uint32_t pad0;
  const uint8_t* rows;
  int64_t row_bytes;
  uint32_t pad[8];
};
static_assert(sizeof(PanelHeader) == 64);

inline int64_t step_count(int64_t kc) { return (kc + kStep - 1) / kStep; }
inline int64_t panel_floats(int64_t kc, int width) {
  // header + bf16 steps + room for a scale per row and step (groups are at least a step)
  return kHeaderFloats + step_count(kc) * (kStep * width / 2 + width);
}
inline const PanelHeader& header(const float* panel) { return *reinterpret_cast<const PanelHeader*>(panel); }
inline const uint8_t* panel_steps(const float* panel) { return reinterpret_cast<const uint8_t*>(panel + kHeaderFloats); }
inline int64_t scales_offset(int64_t kc) { return kHeaderFloats + step_count(kc) * kStep * kWidth / 2; }

// GemmKernels::pack / pack_b for these panels (width is always kWidth).
void pack_a(const GemmOperand& op, int64_t mn0, int64_t count, int64_t k0, int64_t kc, int width, float* out,
            PackNext next);
void pack_b(const GemmOperand& op, int64_t mn0, int64_t count, int64_t k0, int64_t kc, int width, float* out,
            PackNext next);

// The GemmKernels fields every bf16-panel target shares (mr = nr = kWidth, the packs, panel
// sizes, tiles that may start from C), on the avx512 table; the target sets its tile,
// prepare and small-M kernel.
GemmKernels panel_kernels(int64_t kc, int64_t mc);

// Whether both operands can be packed for a target whose K blocks are `kc` deep (bf16,
// e4m3 or e2m1 values; scales folded exactly or promoted per K group of 32 * 2^j up to kc,
// so that groups are whole steps and every block starts a group). Marks promoted operands.
bool prepare(GemmOperand& a, GemmOperand& b, int64_t kc);

// Up to max_rows (at most 4) K-major rows of A (prepared as above) against K-major e4m3
// weights, or e2m1 weights with folded scales: vdpbf16ps on weights decoded in registers
// (dot_row_amx.inc); or 1 to 4 rows of bf16 A against bf16 weights, without scales, on the weights as they
// are. Passes of FP4 weights whose scales do not fold go to `fallback`.
// GemmKernels::small_m's contract (dot_rows takes what dot_rows_take took); needs
// AVX512_BF16, and VBMI and GFNI for the FP8 and FP4 weights (dot_rows_take checks).
using SmallMFn = void (*)(const GemmOperand& a, const GemmOperand& b, int64_t n0, int64_t n1, float* out, int64_t ld_out);
bool dot_rows_take(const GemmOperand& a, const GemmOperand& b, int64_t max_rows);
void dot_rows(const GemmOperand& a, const GemmOperand& b, int64_t n0, int64_t n1, float* out, int64_t ld_out,
              SmallMFn fallback);

// Up to kStreamRows rows of A (prepared as above, either layout) against K-major weights:
// the weights streamed once, strip by strip, decoded (bf16: copied) into bf16 rows and
// multiplied with vdpbf16ps against A packed once per call (stream_dp.inc). The blocked
// avx512_bf16 path's bits. GemmKernels::small_m's contract; needs AVX512_BF16 (the
// decoders use VBMI and GFNI where the CPU has them, the general decoders elsewhere).
constexpr int64_t kStreamRows = 32;
void stream_small_m(const GemmOperand& a, const GemmOperand& b, int64_t n0, int64_t n1, float* out, int64_t ld_out);

}  // namespace moekit::detail::bf16_panels

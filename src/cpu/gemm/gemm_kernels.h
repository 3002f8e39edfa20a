// Per-ISA pieces of the dense GEMM: operand packing (decode + scale while packing) and the
// register-blocked microkernel. gemm_simd.inc holds one generic implementation; the
// gemm_{scalar,avx2,avx512}.cpp files instantiate it with their vector types and
// dispatch.cpp picks the table at run time.
#pragma once

#include <cstdint>

#include "moekit/runtime.h"
#include "moekit/tensor.h"

namespace moekit::detail {

// Decoders that yield value / pre (pre a power of two: e4m3 through f16 gives value / 256,
// e2m1 through its doubled table 2 x value) take scale x pre as one multiplier. That product
// must be exact: it is not for |scale| >= 2^120 with pre = 256 (it overflows) or for
// subnormal scales with pre = 1/2. Then {mul = pre, sc = scale}: raw x mul (exact) x sc gives
// value x scale rounded once, as the portable decoder does; else {1, scale x pre}.
struct SplitScale {
  float mul, sc;
};
inline SplitScale split_scale(float scale, float pre) {
  const float sp = scale * pre;
  if (sp / pre == scale || scale != scale) return {1.0f, sp};
  return {pre, scale};
}

// One GEMM operand seen as a logical [MN, K] matrix, whatever its storage.
struct GemmOperand {
  const uint8_t* data = nullptr;
  DType dtype = DType::bf16;  // f32, bf16, e4m3 or e2m1x2
  int64_t mn = 0, k = 0;
  // k_major: element (i, kk) is stored at row i, column kk (K contiguous); otherwise at
  // row kk, column i. ld = row stride in stored elements (for e2m1x2: in bytes; the two
  // nibbles of a byte are neighbours along the stored last dimension).
  bool k_major = true;
  int64_t ld = 0;
  // Scales: none (sf == nullptr), f32, or packed ue8m0 (i32 words of four exponents).
  const void* sf = nullptr;
  DType sf_dtype = DType::f32;
  int64_t sf_stride_mn = 0, sf_stride_k = 0;  // in f32 / i32 elements
  int64_t gran_mn = 1, gran_k = 128;
  // Set by a target's prepare(): pack the raw values and keep the scales beside them, for
  // the microkernel to promote per K group (the AMX target, for scales it cannot fold).
  bool promote = false;
};

enum class PackNext : uint8_t { next_rows, next_k };

// The largest K block of the blocked paths; each target picks its own (GemmKernels::kc) so
// that a B micro-panel (kc x nr f32) fills half of a 32 KiB L1. Partial sums are kept in f32
// between blocks and reloaded exactly, so the block size does not change results: every
// element is one FMA chain in K order on every path.
inline constexpr int64_t kGemmKc = 256;

// Up to this many rows of A (both operands K-major) take the FMA targets' small-M path;
// beyond it B is packed once and reused by enough rows to pay for the packing.
inline constexpr int64_t kGemmSmallM = 4;

struct GemmKernels {
  int mr = 0, nr = 0;  // register tile
  int64_t kc = kGemmKc;  // K block (≤ kGemmKc on the FMA targets)
  int64_t mc = 96;       // rows of A packed at a time (a multiple of mr)
  // Packs operand rows [mn0, mn0 + count) x columns [k0, k0 + kc) as f32 micro-panels of
  // `width` rows: panel p holds, for each kk, `width` consecutive values (zero-padded past
  // count). Values are decoded and multiplied by their scale. `next` says what the caller
  // packs next, so that K-major sources can be prefetched: the following rows at the same
  // K (next_rows) or the same rows further along K (next_k).
  using PackFn = void (*)(const GemmOperand& op, int64_t mn0, int64_t count, int64_t k0, int64_t kc, int width,
                         float* out, PackNext next);
  PackFn pack = nullptr;    // A (rows of the output)
  PackFn pack_b = nullptr;  // B (columns); the same function where both panels look alike
  // Floats one micro-panel of kc x width takes (kc * width for f32 panels; the AMX target
  // stores bf16 in 32-deep K steps). Panels of a block are this far apart.
  int64_t (*panel_floats)(int64_t kc, int width) = nullptr;
  // Whether this target takes these operands, and how (it may set their `promote`); null:
  // all, as they are. The driver runs the avx512 kernels for the others.
  bool (*prepare)(GemmOperand& a, GemmOperand& b) = nullptr;
  // Logical row i, K [k0, k0 + kc) of a K-major operand, decoded and scaled, as f32.
  void (*decode_row)(const GemmOperand& op, int64_t i, int64_t k0, int64_t kc, float* dst) = nullptr;
  // c[i, j] (+)= Σ_kk a[kk, i] · b[kk, j] for i < rows (≤ mr), j < cols (≤ nr), on
  // micro-panels a (stride mr) and b (stride nr); c has row stride ldc. accumulate = false
  // overwrites c. FMAs in kk order from the loaded (or zero) value of c.
  void (*tile)(int64_t kc, const float* a, const float* b, float* c, int64_t ldc, int rows, int cols,
               bool accumulate);
  // Called on the calling thread before a run of tile() calls (null: nothing to do).
  // b_streams: the run loads a new B panel for every tile and reuses A's, else the reverse.
  // The AMX target loads its tile configuration here (once per sweep rather than once per
  // tile) and hints the streamed operand's loads.
  void (*begin_tiles)(bool b_streams) = nullptr;
  // Asks for `bytes` bytes from p into L2, spread over the next tile() or tile_steps() call,
  // which covers k of K (null: the target takes no such requests).
  void (*request_during_tile)(const void* p, int64_t bytes, int64_t k) = nullptr;
  // Passes: where set, the driver runs a K block's tiles pass_k deep at a time, one column
  // of tiles (a B panel) after another, so that the B panel's pass is reused from L1 by
  // every tile of the column; the sums go through c between passes (f32, exact: the same
  // bits as whole tiles). tile_steps is tile() over K [k0, k1) of the block (k0 a multiple
  // of pass_k, which is a multiple of the target's K step); null: whole tiles. passes_take
  // says whether panels like these take passes (AMX: not those promoted in K groups longer
  // than a pass).
  void (*tile_steps)(int64_t kc, const float* a, const float* b, int64_t k0, int64_t k1, float* c, int64_t ldc,
                     int rows, int cols, bool accumulate) = nullptr;
  int64_t pass_k = 0;
  bool (*passes_take)(const float* a_panel, const float* b_panel) = nullptr;  // (null: all panels)
  // tile_steps may leave a tile's last sums pending (AMX: promoted tiles, whose promotion of
  // one K group overlaps the next group's products, the next tile's included): the driver
  // calls settle_tiles before it reads the sums of the latest tile_steps call (null: never
  // pending). Sums of earlier calls are settled.
  void (*settle_tiles)() = nullptr;
  // Medium M (small_m_rows < a.mn, where medium_m_takes the operands): the same sums as the
  // blocked path, for columns [n0, n1), handed to `sink` a block of columns at a time
  // (res[i * ld_res + j - j0] for rows i < a.mn, columns [j0, j0 + cols)). Null where the
  // target has none.
  using ColumnSink = void (*)(void* ctx, const float* res, int64_t ld_res, int64_t j0, int64_t cols);
  void (*medium_m)(const GemmOperand& a, const GemmOperand& b, int64_t n0, int64_t n1, ColumnSink sink, void* ctx) = nullptr;
  bool (*medium_m_takes)(const GemmOperand& a, const GemmOperand& b) = nullptr;  // (prepared operands)
  // Small M (a.mn ≤ small_m_rows), B K-major (and A too unless small_m_any_a):
  // out[m, j - n0] = Σ_k a·b for columns [n0, n1), f32, row stride ld_out. Streams B once,
  // decoding as it goes. The driver asks for at most small_m_cols columns per call, and
  // splits columns between threads in multiples of small_m_align.
  void (*small_m)(const GemmOperand& a, const GemmOperand& b, int64_t n0, int64_t n1, float* out, int64_t ld_out);
  int64_t small_m_rows = kGemmSmallM;
  int64_t small_m_cols = 256;
  int64_t small_m_align = 4;
  bool small_m_any_a = false;
  // Whether small_m takes these (prepared) operands of at most small_m_rows rows (null: all).
  bool (*small_m_takes)(const GemmOperand& a, const GemmOperand& b) = nullptr;
  // Whether tiles accumulating into D in place may start from C (gemm.cpp: tiles_write_d).
  bool tiles_start_from_c = false;
  // Whether D's next tile is requested into L2 as each tile starts: for tiles written
  // straight into f32 D (gemm.cpp: sweep_into_d), and for finished tiles (request_d, which
  // otherwise asks for L1) (measured on avx512_bf16; the AMX host had measured requests in
  // sweep_into_d 5-15 % slower).
  bool d_requests_into_l2 = false;
};

// The run_small_m call (one GEMM's small-M work) the calling thread is working for: a number
// no other call had, or 0 outside one. A small_m kernel may keep what it derived from A for
// the rest of the call (each thread is handed several column chunks).
uint64_t small_m_call_id();

const GemmKernels& gemm_kernels_scalar();
const GemmKernels& gemm_kernels_avx2();
const GemmKernels& gemm_kernels_avx512();  // only called when the CPU has AVX-512
const GemmKernels& gemm_kernels_avx512_bf16();  // only called when Isa::avx512_bf16 is supported
const GemmKernels& gemm_kernels_amx();     // only called when Isa::amx is supported
const GemmKernels& gemm_kernels(Isa isa);
// The ISA whose kernels run these operands: `isa` if its kernels take them (after their
// prepare(), which may mark operands for promotion), else avx512.
Isa gemm_prepare(Isa isa, GemmOperand& a, GemmOperand& b);

// While one is alive on this thread, the dense GEMM entry points check their arguments (with
// pre-packed weights also whether the packing ISA's kernels take the activations) and return
// without computing: the grouped GEMMs check every group's call before any group writes D.
// Error naming c unless c is undefined, d itself, or apart from d's memory.
void check_c_apart_from_d(const char* fn, const Tensor& d, const Tensor& c);

class DenseValidationOnly {
 public:
  DenseValidationOnly();
  ~DenseValidationOnly();
  DenseValidationOnly(const DenseValidationOnly&) = delete;
  DenseValidationOnly& operator=(const DenseValidationOnly&) = delete;

 private:
  bool previous_;
};

}  // namespace moekit::detail

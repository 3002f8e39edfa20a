// Dense GEMMs with DeepGEMM's names and semantics (shared/spec/gemm.md):
//
//   D = C + A · Bᵀ   (f32 accumulation; D row-major [M, N], bf16 or f32)
//
// The layout letters say how each operand is stored (first letter A: n = [M, K],
// t = [K, M]; second letter B: t = [N, K], n = [K, N]), so "nt" has both K-contiguous:
//   nt: A [M, K], B [N, K]     nn: A [M, K], B [K, N]
//   tn: A [K, M], B [K, N]     tt: A [K, M], B [N, K]
// (tn is the weight-gradient form of the k-grouped GEMMs: both operands [K, MN].)
// Every operand may be a strided view whose last dimension is unit-stride.
// C is optional (an undefined Tensor means none), same shape and dtype as D; C may be D
// itself (accumulate in place).
//
// Scaled (FP8/FP4) operands are (values, sf) pairs (moekit::Quantized). Element (mn, k)
// is worth values[mn, k] * sf[mn / gran_mn, k / gran_k]; sf is always given in the
// canonical [ceil(MN / gran_mn), ceil(K / gran_k)] orientation, f32 or packed ue8m0
// (i32 [ceil(MN / gran_mn), ceil(ceil(K / gran_k) / 4)], formats.md), any strides.
// FP4 (e2m1x2) values are packed two per byte along the operand's stored last dimension.
//
// Results are bit-identical for any thread count and any ISA path (docs/GEMM.md).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "moekit/error.h"
#include "moekit/formats.h"
#include "moekit/runtime.h"
#include "moekit/tensor.h"

namespace moekit {

// (gran_m, gran_n, gran_k) for both operands, or (gran_mn, gran_k) for one.
struct Recipe {
  int64_t gran_m = 1, gran_n = 128, gran_k = 128;
};
struct OperandRecipe {
  int64_t gran_mn = 1, gran_k = 128;
};

// ---- BF16 ----
void bf16_gemm_nt(const Tensor& a, const Tensor& b, const Tensor& d, const Tensor& c = Tensor());
void bf16_gemm_nn(const Tensor& a, const Tensor& b, const Tensor& d, const Tensor& c = Tensor());
void bf16_gemm_tn(const Tensor& a, const Tensor& b, const Tensor& d, const Tensor& c = Tensor());
void bf16_gemm_tt(const Tensor& a, const Tensor& b, const Tensor& d, const Tensor& c = Tensor());

// ---- FP8 / FP4 (block-scaled) ----
// Operands e4m3 or e2m1x2. Recipe defaults: (1, 128, 128) when both are e4m3, (1, 1, 32)
// when either is FP4. `recipe` sets both operands; recipe_a / recipe_b (if given) override
// it per operand, e.g. an FP8 A with gran_k 128 against an FP4 B with gran_k 32.
struct GemmOptions {
  std::optional<Recipe> recipe;
  std::optional<OperandRecipe> recipe_a, recipe_b;
};
void fp8_fp4_gemm_nt(const Quantized& a, const Quantized& b, const Tensor& d, const Tensor& c = Tensor(),
                     const GemmOptions& options = {});
void fp8_fp4_gemm_nn(const Quantized& a, const Quantized& b, const Tensor& d, const Tensor& c = Tensor(),
                     const GemmOptions& options = {});
void fp8_fp4_gemm_tn(const Quantized& a, const Quantized& b, const Tensor& d, const Tensor& c = Tensor(),
                     const GemmOptions& options = {});
void fp8_fp4_gemm_tt(const Quantized& a, const Quantized& b, const Tensor& d, const Tensor& c = Tensor(),
                     const GemmOptions& options = {});
// DeepGEMM's aliases.
inline void fp8_gemm_nt(const Quantized& a, const Quantized& b, const Tensor& d, const Tensor& c = Tensor(),
                        const GemmOptions& options = {}) { fp8_fp4_gemm_nt(a, b, d, c, options); }
inline void fp8_gemm_nn(const Quantized& a, const Quantized& b, const Tensor& d, const Tensor& c = Tensor(),
                        const GemmOptions& options = {}) { fp8_fp4_gemm_nn(a, b, d, c, options); }
inline void fp8_gemm_tn(const Quantized& a, const Quantized& b, const Tensor& d, const Tensor& c = Tensor(),
                        const GemmOptions& options = {}) { fp8_fp4_gemm_tn(a, b, d, c, options); }
inline void fp8_gemm_tt(const Quantized& a, const Quantized& b, const Tensor& d, const Tensor& c = Tensor(),
                        const GemmOptions& options = {}) { fp8_fp4_gemm_tt(a, b, d, c, options); }

// ---- Pre-packed weights (a CPU extension; DeepGEMM has no equivalent) ----
// Inference multiplies the same weights by new activations on every call. The blocked CPU
// GEMM decodes B (bf16 / e4m3 / e2m1 to f32), applies its scales and lays it out in the
// kernel's micro-panel order on every call; at medium M that is a large part of the time
// (docs/GEMM.md). Packing once removes it, at 4 bytes per weight (2 for AMX panels).
//
// pack_*_weights take B as the nt / nn calls do: k_major = true for B [N, K] (DeepGEMM's
// 't'), false for B [K, N] ('n'). FP8/FP4 scales as in fp8_fp4_gemm_*, with B's recipe
// from options.recipe_b, else options.recipe, else the default for B's own dtype
// ((1, 128, 128) for e4m3, (1, 1, 32) for e2m1). FP4 extents are 2 x the stored columns
// (the unpacked calls can resolve an odd extent from the other operand; packing cannot).
// The packed form belongs to the ISA active when it was made, whose kernels then run the
// calls (so it stays valid if the active ISA changes). Under Isa::amx and
// Isa::avx512_bf16 the weights are packed for those kernels wherever they take them (bf16
// panels, 2 bytes per weight; docs/GEMM.md), and activations whose scale groups the panels
// cannot promote (not 32 · 2^j, up to 2048 / 1024) are then refused, naming `a`. Results
// are bit-identical to the unpacked call whenever that one packs B as well (M > 4, or B
// not K-major), for any thread count and ISA; at M <= 4 the unpacked call streams B
// instead (the faster choice for decoding from DRAM), so the two may round differently.
class PackedWeights {
 public:
  PackedWeights() = default;
  bool defined() const { return panels_.defined(); }
  int64_t n() const { return n_; }
  int64_t k() const { return k_; }
  DType source_dtype() const { return dtype_; }  // bf16, e4m3 or e2m1x2
  Isa isa() const { return isa_; }
  int64_t bytes() const { return panels_.defined() ? panels_.numel() * 4 : 0; }

 private:
  friend struct PackedWeightsAccess;
  Tensor panels_;  // [K block][panel of nr columns][panel]: f32 (or AMX bf16); layout owned by gemm.cpp
  int64_t n_ = 0, k_ = 0;
  DType dtype_ = DType::bf16;
  Isa isa_ = Isa::scalar;
};
PackedWeights pack_bf16_weights(const Tensor& b, bool k_major = true);
PackedWeights pack_fp8_fp4_weights(const Quantized& b, bool k_major = true, const GemmOptions& options = {});
// D = C + A · Bᵀ with A [M, K] and B pre-packed (the nt / nn forms). D, C as above; A's
// recipe as in fp8_fp4_gemm_* (default (1, 1, 32) when A or the packed B is FP4).
void bf16_gemm_packed(const Tensor& a, const PackedWeights& b, const Tensor& d, const Tensor& c = Tensor());
void fp8_fp4_gemm_packed(const Quantized& a, const PackedWeights& b, const Tensor& d, const Tensor& c = Tensor(),
                         const GemmOptions& options = {});

// ---- compatibility helpers ----
// align(mn, 16 / element_size): upstream's TMA alignment of MN-major scale tensors.
int64_t get_tma_aligned_size(int64_t mn, int64_t element_size);
// Validates sf against (mn, k, recipe side) and returns it in the layout the CPU backend
// reads fastest: a contiguous row-major copy, same dtype, [ceil(mn/gran_mn), groups] (f32)
// or [.., ceil(groups/4)] (packed ue8m0); with num_groups, [num_groups, ...]. is_sfa picks
// (gran_m, gran_k) from the recipe, otherwise (gran_n, gran_k).
Tensor transform_sf_into_required_layout(const Tensor& sf, int64_t mn, int64_t k, const Recipe& recipe,
                                         std::optional<int64_t> num_groups, bool is_sfa);

}  // namespace moekit

// ---- MoE grouped GEMMs (gemm.md "MoE grouped GEMMs") ----
namespace moekit {

// Row alignment of each group's segment in the contiguous layouts. Default 128 (upstream's
// value, so layouts built for DeepGEMM work unchanged); any positive value may be set.
int64_t get_mk_alignment_for_contiguous_layout();
void set_mk_alignment_for_contiguous_layout(int64_t alignment);

// A [M_total, K] (rows of all experts back to back), B [G, N, K] (nt) or [G, K, N] (nn),
// D [M_total, N]. grouped_layout int32: per row the group index, -1 for padding rows (each
// group's segment starts at a multiple of the alignment); or, with use_psum_layout, [G]
// cumulative actual end rows, group j starting at align(psum[j-1]). Rows of no group are
// never computed: their D rows are left as they were.
void m_grouped_bf16_gemm_nt_contiguous(const Tensor& a, const Tensor& b, const Tensor& d, const Tensor& grouped_layout,
                                       bool use_psum_layout = false);
void m_grouped_bf16_gemm_nn_contiguous(const Tensor& a, const Tensor& b, const Tensor& d, const Tensor& grouped_layout,
                                       bool use_psum_layout = false);
// FP8 (or FP4 weights): a.sf [M_total, groups] (gran_m 1), b.sf [G, ...] per group as in
// the dense fp8_fp4_gemm_* (recipes likewise).
void m_grouped_fp8_gemm_nt_contiguous(const Quantized& a, const Quantized& b, const Tensor& d,
                                      const Tensor& grouped_layout, bool use_psum_layout = false,
                                      const GemmOptions& options = {});
void m_grouped_fp8_gemm_nn_contiguous(const Quantized& a, const Quantized& b, const Tensor& d,
                                      const Tensor& grouped_layout, bool use_psum_layout = false,
                                      const GemmOptions& options = {});

// A [G, max_m, K], B [G, N, K], D [G, max_m, N]: group g computes its first masked_m[g]
// rows (int32 [G], each in [0, max_m]); the other rows of D are left as they were.
// expected_m is upstream's scheduling hint (checked, otherwise unused on the CPU).
void m_grouped_bf16_gemm_nt_masked(const Tensor& a, const Tensor& b, const Tensor& d, const Tensor& masked_m,
                                   int64_t expected_m);
void m_grouped_fp8_gemm_nt_masked(const Quantized& a, const Quantized& b, const Tensor& d, const Tensor& masked_m,
                                  int64_t expected_m, const GemmOptions& options = {});

// The same with pre-packed weights (the CPU extension above): one PackedWeights per group,
// all of the same N and K (pack_*_weights_grouped pack a [G, N, K] / [G, K, N] tensor).
// Results are the unpacked calls' bits wherever those pack B (groups of more than 4 rows).
std::vector<PackedWeights> pack_bf16_weights_grouped(const Tensor& b, bool k_major = true);
std::vector<PackedWeights> pack_fp8_fp4_weights_grouped(const Quantized& b, bool k_major = true,
                                                        const GemmOptions& options = {});
void m_grouped_bf16_gemm_packed_contiguous(const Tensor& a, const std::vector<PackedWeights>& b, const Tensor& d,
                                           const Tensor& grouped_layout, bool use_psum_layout = false);
void m_grouped_fp8_fp4_gemm_packed_contiguous(const Quantized& a, const std::vector<PackedWeights>& b, const Tensor& d,
                                              const Tensor& grouped_layout, bool use_psum_layout = false,
                                              const GemmOptions& options = {});
void m_grouped_bf16_gemm_packed_masked(const Tensor& a, const std::vector<PackedWeights>& b, const Tensor& d,
                                       const Tensor& masked_m, int64_t expected_m);
void m_grouped_fp8_fp4_gemm_packed_masked(const Quantized& a, const std::vector<PackedWeights>& b, const Tensor& d,
                                          const Tensor& masked_m, int64_t expected_m, const GemmOptions& options = {});

// Weight gradients: A [ΣK, M], B [ΣK, N]; group g uses rows [Σ_{<g} ks, Σ_{≤g} ks) of both,
// D[g] = C[g] + A_gᵀ·B_g with D and C f32 [G, M, N] (C optional, may be D; a group with
// K = 0 gives D[g] = C[g], or zeros). FP8: recipe (1, 1, 128) along K, each group quantised
// on its own (per_channel_cast_to_fp8 of its [K_g, MN] slice): a.sf / b.sf are the groups'
// [ceil(K_g / 128), M] / [.., N] scale blocks stacked along the first dimension.
void k_grouped_bf16_gemm_tn_contiguous(const Tensor& a, const Tensor& b, const Tensor& d,
                                       const std::vector<int64_t>& ks, const Tensor& c = Tensor());
void k_grouped_fp8_gemm_tn_contiguous(const Quantized& a, const Quantized& b, const Tensor& d,
                                      const std::vector<int64_t>& ks, const Tensor& c = Tensor());

}  // namespace moekit

// MoE grouped GEMMs on top of the dense GEMM: each group's rows are one dense problem
// (a row-slice of A and D against that group's B), run with all threads, so the work is
// balanced by actual rows whatever the group sizes, and results are those of the dense GEMM
// (bit-identical for any thread count). Rows that belong to no group are never touched.
// Every argument is checked before any group runs (the dense calls first check alone,
// computing nothing), so a call that raises moekit::Error has written nothing.
#include <atomic>
#include <string>
#include <vector>

#include "core/check.h"
#include "cpu/gemm/gemm_kernels.h"
#include "moekit/error.h"
#include "moekit/gemm.h"

namespace moekit {
namespace {

using detail::ceil_div;
using detail::fail;

std::atomic<int64_t> g_alignment{128};

// One group's rows [r0, r1) of A / D (contiguous) or of group g's slab (masked).
struct Run {
  int64_t group, r0, r1;
};

// Re-raises an error of the dense call under the grouped function's name, with the group.
template <class Fn>
void call_dense(const char* fn, int64_t group, Fn&& dense) {
  try {
    dense();
  } catch (const Error& e) {
    fail(fn, e.argument() + " (group " + std::to_string(group) + ")", e.expected(), e.actual());
  }
}

// Checks the dense calls of every run without computing, then runs them: dense(group, r0, r1)
// makes the dense call of rows [r0, r1) of a group. Groups share every shape but their rows',
// so group 0's call with no rows checks what all groups' calls would (a call that computes
// no group still checks its arguments); each run's own call is checked too where the check
// depends on its data (pre-packed weights: whether the packing ISA's kernels take those
// activations' scales).
template <class Dense>
void run_groups(const char* fn, int64_t groups, const std::vector<Run>& runs, bool check_each_run, Dense dense) {
  {
    detail::DenseValidationOnly checks_only;
    if (groups > 0) call_dense(fn, 0, [&] { dense(0, 0, 0); });
    if (check_each_run)
      for (const Run& r : runs) call_dense(fn, r.group, [&] { dense(r.group, r.r0, r.r1); });
  }
  for (const Run& r : runs) call_dense(fn, r.group, [&] { dense(r.group, r.r0, r.r1); });
}

// A tensor of scales: on the CPU, one of the dtypes, of the rank; any strides (the dense
// calls take any, e.g. upstream's MN-major scales).
void check_scales(const char* fn, const char* arg, const Tensor& t, int64_t rank) {
  detail::check_cpu(fn, arg, t);
  detail::check_dtype(fn, arg, t, {DType::f32, DType::i32});
  detail::check_rank(fn, arg, t, rank);
}

void check_weights(const char* fn, const char* arg, const Tensor& b, std::initializer_list<DType> dtypes) {
  detail::check_cpu(fn, arg, b);
  detail::check_dtype(fn, arg, b, dtypes);
  detail::check_rank(fn, arg, b, 3);
  if (b.size(0) > 0) detail::check_last_dim_contiguous(fn, arg, b);  // (as the dense calls: any stride at size 1)
}

const int32_t* check_layout(const char* fn, const char* arg, const Tensor& t, int64_t size) {
  detail::check_cpu(fn, arg, t);
  detail::check_dtype(fn, arg, t, {DType::i32});
  detail::check_rank(fn, arg, t, 1);
  if (t.size(0) != size) fail(fn, arg, std::to_string(size) + " entries", std::to_string(t.size(0)));
  if (t.stride(0) != 1 && size > 1) fail(fn, arg, "a contiguous tensor", shape_str(t.strides()));
  return t.data_ptr<int32_t>();
}

// The groups' row runs of a contiguous layout, validated.
std::vector<Run> contiguous_runs(const char* fn, const Tensor& layout, int64_t m_total, int64_t groups, bool psum) {
  const int64_t align = g_alignment.load();
  std::vector<Run> runs;
  if (!psum) {
    const int32_t* g = check_layout(fn, "grouped_layout", layout, m_total);
    for (int64_t r = 0; r < m_total;) {
      const int64_t group = g[r];
      if (group < -1 || group >= groups)
        fail(fn, "grouped_layout", "group indices in [-1, " + std::to_string(groups) + ")",
             std::to_string(group) + " at row " + std::to_string(r));
      int64_t end = r + 1;
      while (end < m_total && g[end] == group) ++end;
      if (group >= 0) {
        if (r % align != 0)
          fail(fn, "grouped_layout",
               "each group's segment to start at a multiple of the alignment " + std::to_string(align),
               "group " + std::to_string(group) + " starting at row " + std::to_string(r));
        runs.push_back({group, r, end});
      }
      r = end;
    }
    return runs;
  }
  const int32_t* ends = check_layout(fn, "grouped_layout", layout, groups);
  int64_t previous = 0;
  for (int64_t j = 0; j < groups; ++j) {
    const int64_t end = ends[j];
    if (end < previous || end > m_total)
      fail(fn, "grouped_layout", "non-decreasing cumulative row ends within [0, " + std::to_string(m_total) + "]",
           std::to_string(end) + " for group " + std::to_string(j) + " after " + std::to_string(previous));
    const int64_t start = ceil_div(previous, align) * align;
    if (end > start) runs.push_back({j, start, end});
    previous = end;
  }
  return runs;
}

// An output (or C) of the given shape and dtypes with a unit-stride last dimension.
void check_output(const char* fn, const char* arg, const Tensor& d, const Shape& shape,
                  std::initializer_list<DType> dtypes = {DType::bf16, DType::f32}) {
  detail::check_cpu(fn, arg, d);
  detail::check_dtype(fn, arg, d, dtypes);
  detail::check_shape(fn, arg, d, shape);
  if (d.numel() > 0) detail::check_last_dim_contiguous(fn, arg, d);  // (as the dense calls: any stride at size 1)
  detail::check_no_self_overlap(fn, arg, d);
}

void check_gran_m(const char* fn, const GemmOptions& o) {
  const int64_t gran_m = o.recipe_a ? o.recipe_a->gran_mn : o.recipe ? o.recipe->gran_m : 1;
  if (gran_m != 1) fail(fn, "recipe", "gran_m = 1 (per-row activation scales)", std::to_string(gran_m));
}

using DenseBf16 = void (*)(const Tensor&, const Tensor&, const Tensor&, const Tensor&);
using DenseFp8 = void (*)(const Quantized&, const Quantized&, const Tensor&, const Tensor&, const GemmOptions&);

void bf16_contiguous(const char* fn, DenseBf16 dense, const Tensor& a, const Tensor& b, const Tensor& d,
                     const Tensor& layout, bool psum) {
  detail::check_cpu_matrix(fn, "a", a, {DType::bf16});
  check_weights(fn, "b", b, {DType::bf16});
  const int64_t m = a.size(0);
  const int64_t n = dense == &bf16_gemm_nt ? b.size(1) : b.size(2);
  check_output(fn, "d", d, {m, n});
  detail::check_apart(fn, "d", d, {{"a", &a}, {"b", &b}, {"grouped_layout", &layout}});
  run_groups(fn, b.size(0), contiguous_runs(fn, layout, m, b.size(0), psum), false, [&](int64_t g, int64_t r0, int64_t r1) {
    dense(a.slice(0, r0, r1), b.select(0, g), d.slice(0, r0, r1), Tensor());
  });
}

void fp8_contiguous(const char* fn, DenseFp8 dense, const Quantized& a, const Quantized& b, const Tensor& d,
                    const Tensor& layout, bool psum, const GemmOptions& o) {
  detail::check_cpu_matrix(fn, "a.values", a.values, {DType::e4m3, DType::e2m1x2});
  check_scales(fn, "a.sf", a.sf, 2);
  check_weights(fn, "b.values", b.values, {DType::e4m3, DType::e2m1x2});
  check_scales(fn, "b.sf", b.sf, 3);
  check_gran_m(fn, o);
  const int64_t m = a.values.size(0), groups = b.values.size(0);
  if (a.sf.size(0) != m) fail(fn, "a.sf", std::to_string(m) + " rows (one per row of a)", shape_str(a.sf.shape()));
  if (b.sf.size(0) != groups) fail(fn, "b.sf", std::to_string(groups) + " groups", shape_str(b.sf.shape()));
  const bool nt = dense == &fp8_fp4_gemm_nt;
  // (FP4 weights stored [K, N / 2] leave N odd or even: D says which, as in the dense call.)
  const bool n_from_d = !nt && b.values.dtype() == DType::e2m1x2 && d.defined() && d.dim() == 2;
  const int64_t n = nt ? b.values.size(1) : n_from_d ? d.size(1) : b.values.size(2);
  check_output(fn, "d", d, {m, n});
  detail::check_apart(fn, "d", d, {{"a.values", &a.values}, {"a.sf", &a.sf}, {"b.values", &b.values}, {"b.sf", &b.sf}, {"grouped_layout", &layout}});
  run_groups(fn, groups, contiguous_runs(fn, layout, m, groups, psum), false, [&](int64_t g, int64_t r0, int64_t r1) {
    dense({a.values.slice(0, r0, r1), a.sf.slice(0, r0, r1)}, {b.values.select(0, g), b.sf.select(0, g)},
          d.slice(0, r0, r1), Tensor(), o);
  });
}

// The masked runs: group g's first masked_m[g] rows.
std::vector<Run> masked_runs(const char* fn, const Tensor& masked_m, int64_t groups, int64_t max_m, int64_t expected_m) {
  if (expected_m < 0) fail(fn, "expected_m", ">= 0", std::to_string(expected_m));
  const int32_t* mm = check_layout(fn, "masked_m", masked_m, groups);
  std::vector<Run> runs;
  for (int64_t g = 0; g < groups; ++g) {
    if (mm[g] < 0 || mm[g] > max_m)
      fail(fn, "masked_m", "values in [0, max_m = " + std::to_string(max_m) + "]",
           std::to_string(mm[g]) + " for group " + std::to_string(g));
    if (mm[g] > 0) runs.push_back({g, 0, mm[g]});
  }
  return runs;
}

void check_slab(const char* fn, const char* arg, const Tensor& t, std::initializer_list<DType> dtypes, int64_t groups) {
  check_weights(fn, arg, t, dtypes);
  if (t.size(0) != groups) fail(fn, arg, std::to_string(groups) + " groups", shape_str(t.shape()));
}

// Masked activations' scales: [G, max_m, ...], one row per row of a (a view with fewer rows
// would be cut short by the groups' row slices).
void check_masked_scales(const char* fn, const Tensor& sf, int64_t groups, int64_t max_m) {
  check_scales(fn, "a.sf", sf, 3);
  if (sf.size(0) != groups || sf.size(1) != max_m)
    fail(fn, "a.sf", "[" + std::to_string(groups) + ", " + std::to_string(max_m) + ", ...] (a's groups and rows)",
         shape_str(sf.shape()));
}

// Row offsets of the K groups (prefix sums of ks), validated against the operands' rows.
std::vector<int64_t> k_offsets(const char* fn, const std::vector<int64_t>& ks, int64_t rows_a, int64_t rows_b) {
  std::vector<int64_t> offsets{0};
  for (size_t g = 0; g < ks.size(); ++g) {
    if (ks[g] < 0) fail(fn, "ks", "non-negative group sizes", std::to_string(ks[g]) + " for group " + std::to_string(g));
    if (ks[g] > rows_a - offsets.back())  // (also keeps the sum from overflowing)
      fail(fn, "ks", "group sizes summing to a's " + std::to_string(rows_a) + " rows",
           "more by group " + std::to_string(g) + " (" + std::to_string(ks[g]) + " after " + std::to_string(offsets.back()) + ")");
    offsets.push_back(offsets.back() + ks[g]);
  }
  if (offsets.back() != rows_a) fail(fn, "a", std::to_string(offsets.back()) + " rows (the sum of ks)", std::to_string(rows_a));
  if (offsets.back() != rows_b) fail(fn, "b", std::to_string(offsets.back()) + " rows (the sum of ks)", std::to_string(rows_b));
  return offsets;
}

void check_k_grouped_output(const char* fn, const Tensor& d, const Tensor& c, const Shape& shape) {
  check_output(fn, "d", d, shape, {DType::f32});
  if (c.defined()) check_output(fn, "c", c, shape, {DType::f32});
  detail::check_c_apart_from_d(fn, d, c);  // (group g + 1's C must not be group g's D)
}

// The k-grouped calls: every group with rows checked first, computing nothing (their K
// differ, so each is), then every group run: group(g) makes group g's dense call.
template <class Group>
void run_k_groups(const std::vector<int64_t>& off, Group group) {
  const auto groups = static_cast<int64_t>(off.size()) - 1;
  {
    detail::DenseValidationOnly checks_only;
    for (int64_t g = 0; g < groups; ++g)
      if (off[g + 1] > off[g]) group(g);
  }
  for (int64_t g = 0; g < groups; ++g) group(g);
}

// Group g of a k-grouped call: D[g] = C[g] + the dense product, or with K = 0 exactly C[g]
// (zeros without C): a dense call would add +0 and turn a C of -0 into +0.
template <class Dense>
void k_group(const Tensor& d, const Tensor& c, int64_t g, int64_t k, Dense dense) {
  const Tensor dg = d.select(0, g), cg = c.defined() ? c.select(0, g) : Tensor();
  if (k > 0) return dense(dg, cg);
  if (cg.defined() && cg.data() == dg.data()) return;
  dg.copy_from(cg.defined() ? cg : Tensor::zeros(dg.shape(), DType::f32));
}

// Every group's packed weights present and of one N x K (and `groups` of them, when given);
// returns N.
int64_t check_packed(const char* fn, const std::vector<PackedWeights>& b, int64_t groups = -1) {
  if (groups >= 0 && static_cast<int64_t>(b.size()) != groups)
    fail(fn, "b", std::to_string(groups) + " groups (as a)", std::to_string(b.size()));
  for (size_t g = 0; g < b.size(); ++g) {
    const std::string arg = "b[" + std::to_string(g) + "]";
    if (!b[g].defined()) fail(fn, arg, "weights made by pack_*_weights", "an empty PackedWeights");
    if (b[g].n() != b[0].n() || b[g].k() != b[0].k())
      fail(fn, arg, "N x K = " + std::to_string(b[0].n()) + " x " + std::to_string(b[0].k()) + " (as b[0])",
           std::to_string(b[g].n()) + " x " + std::to_string(b[g].k()));
    // (A's default recipe follows the weights' format, and which activations the kernels
    // take follows the packing ISA: one of each per call.)
    if (b[g].source_dtype() != b[0].source_dtype() || b[g].isa() != b[0].isa())
      fail(fn, arg, std::string("weights packed like b[0] (") + dtype_name(b[0].source_dtype()) + ", " + isa_name(b[0].isa()) + ")",
           std::string(dtype_name(b[g].source_dtype())) + ", " + isa_name(b[g].isa()));
  }
  return b.empty() ? 0 : b[0].n();
}

// N of a packed grouped call: the weights' (check_packed); with no groups there are no
// weights to take it from and no rows to compute, so D's last extent is taken as it is.
int64_t packed_n(const char* fn, const std::vector<PackedWeights>& b, const Tensor& d, int64_t groups = -1) {
  const int64_t n = check_packed(fn, b, groups);
  return b.empty() && d.defined() && d.dim() > 0 ? d.size(-1) : n;
}

}  // namespace

std::vector<PackedWeights> pack_bf16_weights_grouped(const Tensor& b, bool k_major) {
  constexpr const char* fn = "pack_bf16_weights_grouped";
  check_weights(fn, "b", b, {DType::bf16});
  std::vector<PackedWeights> out;
  for (int64_t g = 0; g < b.size(0); ++g) call_dense(fn, g, [&] { out.push_back(pack_bf16_weights(b.select(0, g), k_major)); });
  return out;
}

std::vector<PackedWeights> pack_fp8_fp4_weights_grouped(const Quantized& b, bool k_major, const GemmOptions& options) {
  constexpr const char* fn = "pack_fp8_fp4_weights_grouped";
  check_weights(fn, "b.values", b.values, {DType::e4m3, DType::e2m1x2});
  check_slab(fn, "b.sf", b.sf, {DType::f32, DType::i32}, b.values.size(0));
  std::vector<PackedWeights> out;
  for (int64_t g = 0; g < b.values.size(0); ++g)
    call_dense(fn, g, [&] { out.push_back(pack_fp8_fp4_weights({b.values.select(0, g), b.sf.select(0, g)}, k_major, options)); });
  return out;
}

void m_grouped_bf16_gemm_packed_contiguous(const Tensor& a, const std::vector<PackedWeights>& b, const Tensor& d,
                                           const Tensor& grouped_layout, bool use_psum_layout) {
  constexpr const char* fn = "m_grouped_bf16_gemm_packed_contiguous";
  detail::check_cpu_matrix(fn, "a", a, {DType::bf16});
  const int64_t m = a.size(0), groups = static_cast<int64_t>(b.size());
  check_output(fn, "d", d, {m, packed_n(fn, b, d)});
  detail::check_apart(fn, "d", d, {{"a", &a}, {"grouped_layout", &grouped_layout}});
  run_groups(fn, groups, contiguous_runs(fn, grouped_layout, m, groups, use_psum_layout), false,
             [&](int64_t g, int64_t r0, int64_t r1) { bf16_gemm_packed(a.slice(0, r0, r1), b[static_cast<size_t>(g)], d.slice(0, r0, r1)); });
}

void m_grouped_fp8_fp4_gemm_packed_contiguous(const Quantized& a, const std::vector<PackedWeights>& b, const Tensor& d,
                                              const Tensor& grouped_layout, bool use_psum_layout,
                                              const GemmOptions& options) {
  constexpr const char* fn = "m_grouped_fp8_fp4_gemm_packed_contiguous";
  detail::check_cpu_matrix(fn, "a.values", a.values, {DType::e4m3, DType::e2m1x2});
  check_scales(fn, "a.sf", a.sf, 2);
  check_gran_m(fn, options);
  const int64_t m = a.values.size(0), groups = static_cast<int64_t>(b.size());
  if (a.sf.size(0) != m) fail(fn, "a.sf", std::to_string(m) + " rows (one per row of a)", shape_str(a.sf.shape()));
  check_output(fn, "d", d, {m, packed_n(fn, b, d)});
  detail::check_apart(fn, "d", d, {{"a.values", &a.values}, {"a.sf", &a.sf}, {"grouped_layout", &grouped_layout}});
  run_groups(fn, groups, contiguous_runs(fn, grouped_layout, m, groups, use_psum_layout), true,
             [&](int64_t g, int64_t r0, int64_t r1) {
               fp8_fp4_gemm_packed({a.values.slice(0, r0, r1), a.sf.slice(0, r0, r1)}, b[static_cast<size_t>(g)],
                                   d.slice(0, r0, r1), Tensor(), options);
             });
}

void m_grouped_bf16_gemm_packed_masked(const Tensor& a, const std::vector<PackedWeights>& b, const Tensor& d,
                                       const Tensor& masked_m, int64_t expected_m) {
  constexpr const char* fn = "m_grouped_bf16_gemm_packed_masked";
  check_weights(fn, "a", a, {DType::bf16});
  const int64_t groups = a.size(0), max_m = a.size(1);
  check_output(fn, "d", d, {groups, max_m, packed_n(fn, b, d, groups)});
  detail::check_apart(fn, "d", d, {{"a", &a}, {"masked_m", &masked_m}});
  run_groups(fn, groups, masked_runs(fn, masked_m, groups, max_m, expected_m), false, [&](int64_t g, int64_t, int64_t r1) {
    bf16_gemm_packed(a.select(0, g).slice(0, 0, r1), b[static_cast<size_t>(g)], d.select(0, g).slice(0, 0, r1));
  });
}

void m_grouped_fp8_fp4_gemm_packed_masked(const Quantized& a, const std::vector<PackedWeights>& b, const Tensor& d,
                                          const Tensor& masked_m, int64_t expected_m, const GemmOptions& options) {
  constexpr const char* fn = "m_grouped_fp8_fp4_gemm_packed_masked";
  check_weights(fn, "a.values", a.values, {DType::e4m3, DType::e2m1x2});
  const int64_t groups = a.values.size(0), max_m = a.values.size(1);
  check_masked_scales(fn, a.sf, groups, max_m);
  check_gran_m(fn, options);
  check_output(fn, "d", d, {groups, max_m, packed_n(fn, b, d, groups)});
  detail::check_apart(fn, "d", d, {{"a.values", &a.values}, {"a.sf", &a.sf}, {"masked_m", &masked_m}});
  run_groups(fn, groups, masked_runs(fn, masked_m, groups, max_m, expected_m), true, [&](int64_t g, int64_t, int64_t r1) {
    fp8_fp4_gemm_packed({a.values.select(0, g).slice(0, 0, r1), a.sf.select(0, g).slice(0, 0, r1)}, b[static_cast<size_t>(g)],
                        d.select(0, g).slice(0, 0, r1), Tensor(), options);
  });
}

void k_grouped_bf16_gemm_tn_contiguous(const Tensor& a, const Tensor& b, const Tensor& d,
                                       const std::vector<int64_t>& ks, const Tensor& c) {
  constexpr const char* fn = "k_grouped_bf16_gemm_tn_contiguous";
  detail::check_cpu_matrix(fn, "a", a, {DType::bf16});
  detail::check_cpu_matrix(fn, "b", b, {DType::bf16});
  const int64_t groups = static_cast<int64_t>(ks.size());
  check_k_grouped_output(fn, d, c, {groups, a.size(1), b.size(1)});
  detail::check_apart(fn, "d", d, {{"a", &a}, {"b", &b}});
  const std::vector<int64_t> off = k_offsets(fn, ks, a.size(0), b.size(0));
  auto group = [&](int64_t g) {
    call_dense(fn, g, [&] {
      k_group(d, c, g, off[g + 1] - off[g], [&](const Tensor& dg, const Tensor& cg) {
        bf16_gemm_tn(a.slice(0, off[g], off[g + 1]), b.slice(0, off[g], off[g + 1]), dg, cg);
      });
    });
  };
  run_k_groups(off, group);
}

void k_grouped_fp8_gemm_tn_contiguous(const Quantized& a, const Quantized& b, const Tensor& d,
                                      const std::vector<int64_t>& ks, const Tensor& c) {
  constexpr const char* fn = "k_grouped_fp8_gemm_tn_contiguous";
  detail::check_cpu_matrix(fn, "a.values", a.values, {DType::e4m3});
  detail::check_cpu_matrix(fn, "b.values", b.values, {DType::e4m3});
  check_scales(fn, "a.sf", a.sf, 2);
  check_scales(fn, "b.sf", b.sf, 2);
  detail::check_dtype(fn, "a.sf", a.sf, {DType::f32});
  detail::check_dtype(fn, "b.sf", b.sf, {DType::f32});
  const int64_t groups = static_cast<int64_t>(ks.size());
  check_k_grouped_output(fn, d, c, {groups, a.values.size(1), b.values.size(1)});
  detail::check_apart(fn, "d", d, {{"a.values", &a.values}, {"a.sf", &a.sf}, {"b.values", &b.values}, {"b.sf", &b.sf}});
  const std::vector<int64_t> off = k_offsets(fn, ks, a.values.size(0), b.values.size(0));
  int64_t blocks = 0;  // scale rows used so far (ceil(K_g / 128) per group)
  for (int64_t g = 0; g < groups; ++g) blocks += ceil_div(ks[static_cast<size_t>(g)], 128);
  if (a.sf.size(0) != blocks) fail(fn, "a.sf", std::to_string(blocks) + " rows (ceil(K_g / 128) per group)", shape_str(a.sf.shape()));
  if (b.sf.size(0) != blocks) fail(fn, "b.sf", std::to_string(blocks) + " rows (ceil(K_g / 128) per group)", shape_str(b.sf.shape()));
  GemmOptions o;
  o.recipe = Recipe{1, 1, 128};
  std::vector<int64_t> s{0};  // the groups' first scale rows
  for (int64_t g = 0; g < groups; ++g) s.push_back(s.back() + ceil_div(ks[static_cast<size_t>(g)], 128));
  auto group = [&](int64_t g) {
    // The dense API takes scales in the canonical [MN, groups] orientation: a transposed view.
    call_dense(fn, g, [&] {
      k_group(d, c, g, off[g + 1] - off[g], [&](const Tensor& dg, const Tensor& cg) {
        fp8_fp4_gemm_tn({a.values.slice(0, off[g], off[g + 1]), a.sf.slice(0, s[g], s[g + 1]).t()},
                        {b.values.slice(0, off[g], off[g + 1]), b.sf.slice(0, s[g], s[g + 1]).t()}, dg, cg, o);
      });
    });
  };
  run_k_groups(off, group);
}

int64_t get_mk_alignment_for_contiguous_layout() { return g_alignment.load(); }

void set_mk_alignment_for_contiguous_layout(int64_t alignment) {
  if (alignment <= 0) fail("set_mk_alignment_for_contiguous_layout", "alignment", "> 0", std::to_string(alignment));
  g_alignment.store(alignment);
}

void m_grouped_bf16_gemm_nt_contiguous(const Tensor& a, const Tensor& b, const Tensor& d, const Tensor& grouped_layout,
                                       bool use_psum_layout) {
  bf16_contiguous("m_grouped_bf16_gemm_nt_contiguous", &bf16_gemm_nt, a, b, d, grouped_layout, use_psum_layout);
}
void m_grouped_bf16_gemm_nn_contiguous(const Tensor& a, const Tensor& b, const Tensor& d, const Tensor& grouped_layout,
                                       bool use_psum_layout) {
  bf16_contiguous("m_grouped_bf16_gemm_nn_contiguous", &bf16_gemm_nn, a, b, d, grouped_layout, use_psum_layout);
}
void m_grouped_fp8_gemm_nt_contiguous(const Quantized& a, const Quantized& b, const Tensor& d,
                                      const Tensor& grouped_layout, bool use_psum_layout, const GemmOptions& options) {
  fp8_contiguous("m_grouped_fp8_gemm_nt_contiguous", &fp8_fp4_gemm_nt, a, b, d, grouped_layout, use_psum_layout,
                 options);
}
void m_grouped_fp8_gemm_nn_contiguous(const Quantized& a, const Quantized& b, const Tensor& d,
                                      const Tensor& grouped_layout, bool use_psum_layout, const GemmOptions& options) {
  fp8_contiguous("m_grouped_fp8_gemm_nn_contiguous", &fp8_fp4_gemm_nn, a, b, d, grouped_layout, use_psum_layout,
                 options);
}

void m_grouped_bf16_gemm_nt_masked(const Tensor& a, const Tensor& b, const Tensor& d, const Tensor& masked_m,
                                   int64_t expected_m) {
  constexpr const char* fn = "m_grouped_bf16_gemm_nt_masked";
  check_weights(fn, "a", a, {DType::bf16});
  const int64_t groups = a.size(0), max_m = a.size(1);
  check_slab(fn, "b", b, {DType::bf16}, groups);
  check_output(fn, "d", d, {groups, max_m, b.size(1)});
  detail::check_apart(fn, "d", d, {{"a", &a}, {"b", &b}, {"masked_m", &masked_m}});
  run_groups(fn, groups, masked_runs(fn, masked_m, groups, max_m, expected_m), false, [&](int64_t g, int64_t, int64_t r1) {
    bf16_gemm_nt(a.select(0, g).slice(0, 0, r1), b.select(0, g), d.select(0, g).slice(0, 0, r1), Tensor());
  });
}

void m_grouped_fp8_gemm_nt_masked(const Quantized& a, const Quantized& b, const Tensor& d, const Tensor& masked_m,
                                  int64_t expected_m, const GemmOptions& options) {
  constexpr const char* fn = "m_grouped_fp8_gemm_nt_masked";
  check_weights(fn, "a.values", a.values, {DType::e4m3, DType::e2m1x2});
  const int64_t groups = a.values.size(0), max_m = a.values.size(1);
  check_masked_scales(fn, a.sf, groups, max_m);
  check_slab(fn, "b.values", b.values, {DType::e4m3, DType::e2m1x2}, groups);
  check_scales(fn, "b.sf", b.sf, 3);
  if (b.sf.size(0) != groups) fail(fn, "b.sf", std::to_string(groups) + " groups", shape_str(b.sf.shape()));
  check_gran_m(fn, options);
  check_output(fn, "d", d, {groups, max_m, b.values.size(1)});
  detail::check_apart(fn, "d", d, {{"a.values", &a.values}, {"a.sf", &a.sf}, {"b.values", &b.values}, {"b.sf", &b.sf}, {"masked_m", &masked_m}});
  run_groups(fn, groups, masked_runs(fn, masked_m, groups, max_m, expected_m), false, [&](int64_t g, int64_t, int64_t r1) {
    fp8_fp4_gemm_nt({a.values.select(0, g).slice(0, 0, r1), a.sf.select(0, g).slice(0, 0, r1)},
                    {b.values.select(0, g), b.sf.select(0, g)}, d.select(0, g).slice(0, 0, r1), Tensor(), options);
  });
}

}  // namespace moekit

// MoE grouped GEMMs (gemm.md "MoE grouped GEMMs"): contiguous (per-row and psum layouts)
// and masked, BF16 / FP8 / FP8 x FP4, against the f64 oracle group by group; rows of no
// group keep a sentinel; empty groups, a group holding all rows, segments of exactly the
// alignment, unaligned psum ends; thread-count determinism; bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "moekit/error.h"
#include "moekit/formats.h"
#include "moekit/gemm.h"
#include "moekit/runtime.h"
#include "moekit/tensor.h"
#include "reference.h"
#include "test_util.h"

namespace moekit {
namespace {

constexpr float kSentinel = -12288.0f;  // exact in bf16 and f32

Tensor random_bf16(const Shape& shape, uint64_t seed) {
  Tensor t = Tensor::empty(shape, DType::bf16);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t i = 0; i < t.numel(); ++i) t.data_ptr<uint16_t>()[i] = f32_to_bf16(normal(rng));
  return t;
}

Tensor filled(const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype);
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (dtype == DType::f32) t.data_ptr<float>()[i] = kSentinel;
    else t.data_ptr<uint16_t>()[i] = f32_to_bf16(kSentinel);
  }
  return t;
}

Tensor i32(const std::vector<int32_t>& v) {
  Tensor t = Tensor::empty({static_cast<int64_t>(v.size())}, DType::i32);
  if (!v.empty()) std::memcpy(t.data(), v.data(), v.size() * 4);
  return t;
}

enum class Kind { bf16, fp8, fp8xfp4 };

// Weights [G, N, K] as the kind's operand, with the oracle's view of group g.
struct Weights {
  Quantized q;  // values [G, N, K or K/2], sf [G, ...] (undefined for bf16)
  int64_t gran_n = 1, gran_k = 128;
  ref::Operand group(int64_t g) const {
    return {q.values.select(0, g), q.sf.defined() ? q.sf.select(0, g) : Tensor(), gran_n, gran_k};
  }
};

Weights make_weights(Kind kind, int64_t groups, int64_t n, int64_t k, uint64_t seed) {
  const Tensor x = random_bf16({groups, n, k}, seed);
  Weights w;
  if (kind == Kind::bf16) {
    w.q.values = x;
    return w;
  }
  std::vector<Quantized> per;
  for (int64_t g = 0; g < groups; ++g)
    per.push_back(kind == Kind::fp8 ? per_block_cast_to_fp8(x.select(0, g), false)
                                    : per_token_cast_to_fp4(x.select(0, g), true, 32));
  w.gran_n = kind == Kind::fp8 ? 128 : 1;
  w.gran_k = kind == Kind::fp8 ? 128 : 32;
  const Shape vs = per[0].values.shape(), ss = per[0].sf.shape();
  w.q.values = Tensor::empty({groups, vs[0], vs[1]}, per[0].values.dtype());
  w.q.sf = Tensor::empty({groups, ss[0], ss[1]}, DType::f32);
  for (int64_t g = 0; g < groups; ++g) {
    w.q.values.select(0, g).copy_from(per[static_cast<size_t>(g)].values);
    w.q.sf.select(0, g).copy_from(per[static_cast<size_t>(g)].sf);
  }
  return w;
}

struct Activations {
  Quantized q;
  int64_t gran_k = 128;
};

Activations make_activations(Kind kind, const Tensor& x) {
  Activations a;
  if (kind == Kind::bf16) a.q.values = x;
  else a.q = per_token_cast_to_fp8(x, kind == Kind::fp8xfp4, kind == Kind::fp8 ? 128 : 32);
  a.gran_k = kind == Kind::fp8 ? 128 : 32;
  return a;
}

// Expected D: oracle rows for the groups' rows, the sentinel elsewhere.
std::vector<double> expected_contiguous(const Activations& a, const Weights& w, const std::vector<int32_t>& row_group,
                                        int64_t n) {
  const int64_t m = static_cast<int64_t>(row_group.size());
  std::vector<double> out(static_cast<size_t>(m * n), kSentinel);
  for (int64_t r = 0; r < m; ++r) {
    if (row_group[static_cast<size_t>(r)] < 0) continue;
    ref::Operand ar{a.q.values.slice(0, r, r + 1), a.q.sf.defined() ? a.q.sf.slice(0, r, r + 1) : Tensor(), 1, a.gran_k};
    const std::vector<double> row = ref::gemm(ref::Layout::nt, ar, w.group(row_group[static_cast<size_t>(r)]));
    std::copy(row.begin(), row.end(), out.begin() + r * n);
  }
  return out;
}

void expect_matches(const Tensor& d, const std::vector<double>& want, const std::vector<int32_t>& row_group, int64_t n) {
  const std::vector<double> got = ref::to_f64(d);
  std::vector<double> gx, wx;
  for (size_t r = 0; r < row_group.size(); ++r)
    for (int64_t j = 0; j < n; ++j) {
      const size_t i = r * static_cast<size_t>(n) + static_cast<size_t>(j);
      if (row_group[r] < 0) {
        ASSERT_EQ(got[i], kSentinel) << "row " << r << " (no group) was written";
      } else {
        gx.push_back(got[i]);
        wx.push_back(want[i]);
      }
    }
  if (!gx.empty()) {
    EXPECT_LE(ref::calc_diff(gx, wx), 1e-5);
  }
}

// packed: the weights through pack_*_weights_grouped and the *_packed_contiguous calls.
void run_contiguous(Kind kind, const Activations& a, const Weights& w, const Tensor& d, const Tensor& layout, bool psum,
                    bool packed = false) {
  if (kind == Kind::bf16) {
    if (packed) m_grouped_bf16_gemm_packed_contiguous(a.q.values, pack_bf16_weights_grouped(w.q.values), d, layout, psum);
    else m_grouped_bf16_gemm_nt_contiguous(a.q.values, w.q.values, d, layout, psum);
    return;
  }
  GemmOptions o;
  o.recipe_a = OperandRecipe{1, a.gran_k};
  o.recipe_b = OperandRecipe{w.gran_n, w.gran_k};
  if (packed) m_grouped_fp8_fp4_gemm_packed_contiguous(a.q, pack_fp8_fp4_weights_grouped(w.q, true, o), d, layout, psum, o);
  else m_grouped_fp8_gemm_nt_contiguous(a.q, w.q, d, layout, psum, o);
}

// Row -> group of a psum layout (as gemm.md defines it), for the oracle.
std::vector<int32_t> rows_of_psum(const std::vector<int32_t>& psum, int64_t m, int64_t align) {
  std::vector<int32_t> rg(static_cast<size_t>(m), -1);
  int64_t previous = 0;
  for (size_t j = 0; j < psum.size(); ++j) {
    const int64_t start = (previous + align - 1) / align * align;
    for (int64_t r = start; r < psum[j]; ++r) rg[static_cast<size_t>(r)] = static_cast<int32_t>(j);
    previous = psum[j];
  }
  return rg;
}

struct AlignmentGuard {
  int64_t previous = get_mk_alignment_for_contiguous_layout();
  ~AlignmentGuard() { set_mk_alignment_for_contiguous_layout(previous); }
};

TEST(Grouped, DefaultAlignmentIsUpstreams) { EXPECT_EQ(get_mk_alignment_for_contiguous_layout(), 128); }

TEST(Grouped, ContiguousPerRowLayout) {
  AlignmentGuard guard;
  set_mk_alignment_for_contiguous_layout(8);
  const int64_t groups = 4, n = 40, k = 300;
  // group 2: exactly one alignment; group 1: empty; group 0: two segments' worth; padding
  // rows (-1) between; group 3 last, unpadded tail.
  std::vector<int32_t> rg;
  auto add = [&](int32_t g, int rows) { rg.insert(rg.end(), static_cast<size_t>(rows), g); };
  add(2, 8), add(0, 13), add(-1, 3), add(3, 5), add(-1, 3), add(0, 1);
  const int64_t m = static_cast<int64_t>(rg.size());
  for (Kind kind : {Kind::bf16, Kind::fp8, Kind::fp8xfp4}) {
    SCOPED_TRACE(static_cast<int>(kind));
    const Activations a = make_activations(kind, random_bf16({m, k}, 1));
    const Weights w = make_weights(kind, groups, n, k, 2);
    for (DType out : {DType::f32, DType::bf16})
      for (bool packed : {false, true}) {
        SCOPED_TRACE(packed ? "packed" : "unpacked");
        Tensor d = filled({m, n}, out);
        run_contiguous(kind, a, w, d, i32(rg), false, packed);
        expect_matches(d, expected_contiguous(a, w, rg, n), rg, n);
      }
  }
}

TEST(Grouped, ContiguousPsumLayout) {
  for (int64_t align : {1, 16, 128}) {
    AlignmentGuard guard;
    set_mk_alignment_for_contiguous_layout(align);
    SCOPED_TRACE("alignment " + std::to_string(align));
    const int64_t n = 24, k = 256;
    // Unaligned ends, an empty group (same end twice), a final group ending before M.
    const std::vector<int32_t> psum = {37, 37, 150, 201};
    const int64_t m = 260;
    const std::vector<int32_t> rg = rows_of_psum(psum, m, align);
    for (Kind kind : {Kind::bf16, Kind::fp8, Kind::fp8xfp4}) {
      SCOPED_TRACE(static_cast<int>(kind));
      const Activations a = make_activations(kind, random_bf16({m, k}, 3));
      const Weights w = make_weights(kind, 4, n, k, 4);
      Tensor d = filled({m, n}, DType::f32);
      run_contiguous(kind, a, w, d, i32(psum), true);
      expect_matches(d, expected_contiguous(a, w, rg, n), rg, n);
    }
  }
}

TEST(Grouped, OneGroupHoldsAllRowsAndThreadCountsAgree) {
  const int64_t m = 256, n = 64, k = 512;
  const std::vector<int32_t> rg(static_cast<size_t>(m), 1);
  const Activations a = make_activations(Kind::fp8, random_bf16({m, k}, 5));
  const Weights w = make_weights(Kind::fp8, 3, n, k, 6);
  const int previous = num_threads();
  std::vector<Tensor> results;
  for (int threads : {1, 2, 3}) {
    set_num_threads(threads);
    Tensor d = filled({m, n}, DType::f32);
    run_contiguous(Kind::fp8, a, w, d, i32(rg), false);
    results.push_back(d);
  }
  set_num_threads(previous);
  for (size_t i = 1; i < results.size(); ++i)
    EXPECT_EQ(0, std::memcmp(results[0].data(), results[i].data(), static_cast<size_t>(m * n) * 4));
  expect_matches(results[0], expected_contiguous(a, w, rg, n), rg, n);
}

TEST(Grouped, ContiguousNnLayout) {
  AlignmentGuard guard;
  set_mk_alignment_for_contiguous_layout(4);
  const int64_t n = 20, k = 100;
  const std::vector<int32_t> rg = {1, 1, 1, 1, 0, 0, -1, -1};
  const int64_t m = static_cast<int64_t>(rg.size());
  const Tensor x = random_bf16({m, k}, 7);
  const Weights w = make_weights(Kind::bf16, 2, n, k, 8);
  Tensor bt = Tensor::empty({2, k, n}, DType::bf16);  // [G, K, N]
  for (int64_t g = 0; g < 2; ++g) bt.select(0, g).copy_from(w.q.values.select(0, g).t());
  Tensor d = filled({m, n}, DType::f32);
  m_grouped_bf16_gemm_nn_contiguous(x, bt, d, i32(rg));
  Activations a;
  a.q.values = x;
  expect_matches(d, expected_contiguous(a, w, rg, n), rg, n);
}

TEST(Grouped, Masked) {
  const int64_t groups = 5, max_m = 24, n = 36, k = 256;
  const std::vector<int32_t> masked = {0, 24, 1, 17, 3};  // empty, full, one row, ...
  for (Kind kind : {Kind::bf16, Kind::fp8, Kind::fp8xfp4}) {
    SCOPED_TRACE(static_cast<int>(kind));
    const Tensor x = random_bf16({groups, max_m, k}, 9);
    const Weights w = make_weights(kind, groups, n, k, 10);
    std::vector<Activations> per;
    for (int64_t g = 0; g < groups; ++g) per.push_back(make_activations(kind, x.select(0, g)));
    Quantized a;
    if (kind == Kind::bf16) {
      a.values = x;
    } else {
      const Shape vs = per[0].q.values.shape(), ss = per[0].q.sf.shape();
      a.values = Tensor::empty({groups, vs[0], vs[1]}, per[0].q.values.dtype());
      a.sf = Tensor::empty({groups, ss[0], ss[1]}, DType::f32);
      for (int64_t g = 0; g < groups; ++g) {
        a.values.select(0, g).copy_from(per[static_cast<size_t>(g)].q.values);
        a.sf.select(0, g).copy_from(per[static_cast<size_t>(g)].q.sf);
      }
    }
    Tensor unpacked;
    for (bool packed : {false, true}) {
      SCOPED_TRACE(packed ? "packed" : "unpacked");
      Tensor d = filled({groups, max_m, n}, DType::f32);
      if (kind == Kind::bf16) {
        if (packed) m_grouped_bf16_gemm_packed_masked(a.values, pack_bf16_weights_grouped(w.q.values), d, i32(masked), 16);
        else m_grouped_bf16_gemm_nt_masked(a.values, w.q.values, d, i32(masked), 16);
      } else {
        GemmOptions o;
        o.recipe_a = OperandRecipe{1, per[0].gran_k};
        o.recipe_b = OperandRecipe{w.gran_n, w.gran_k};
        if (packed) m_grouped_fp8_fp4_gemm_packed_masked(a, pack_fp8_fp4_weights_grouped(w.q, true, o), d, i32(masked), 16, o);
        else m_grouped_fp8_gemm_nt_masked(a, w.q, d, i32(masked), 16, o);
      }
      for (int64_t g = 0; g < groups; ++g) {
        std::vector<int32_t> rg(static_cast<size_t>(max_m), -1);
        for (int32_t r = 0; r < masked[static_cast<size_t>(g)]; ++r) rg[static_cast<size_t>(r)] = static_cast<int32_t>(g);
        expect_matches(d.select(0, g), expected_contiguous(per[static_cast<size_t>(g)], w, rg, n), rg, n);
      }
      // Groups of more than 4 rows (1 and 3 take the unpacked call's streaming path) give
      // the unpacked call's bits.
      if (!packed) {
        unpacked = d;
        continue;
      }
      for (int64_t g : {1, 3})
        EXPECT_EQ(0, std::memcmp(unpacked.select(0, g).data(), d.select(0, g).data(),
                                 static_cast<size_t>(masked[static_cast<size_t>(g)] * n) * 4))
            << "group " << g;
    }
  }
}

// Weight-gradient GEMM: per group D[g] = C[g] + A_gᵀ B_g over its own K rows, including a
// group with K = 0 (D[g] = C[g]) and one with a partial last scale block; C in place too.
TEST(Grouped, KGrouped) {
  const int64_t m = 24, n = 40;
  const std::vector<int64_t> ks = {130, 0, 256, 7};
  int64_t total = 0;
  for (int64_t k : ks) total += k;
  const Tensor xa = random_bf16({total, m}, 21), xb = random_bf16({total, n}, 22);
  const int64_t groups = static_cast<int64_t>(ks.size());
  Tensor c = Tensor::empty({groups, m, n}, DType::f32);
  const Tensor cb = random_bf16({groups, m, n}, 23);
  convert(cb.reshape({groups * m, n}), c.reshape({groups * m, n}));
  // FP8 operands quantised group by group along K (recipe (1, 1, 128)).
  std::vector<Quantized> qa, qb;
  int64_t blocks = 0, k0 = 0;
  for (int64_t k : ks) {
    qa.push_back(per_channel_cast_to_fp8(xa.slice(0, k0, k0 + k), false));
    qb.push_back(per_channel_cast_to_fp8(xb.slice(0, k0, k0 + k), false));
    blocks += (k + 127) / 128, k0 += k;
  }
  Quantized a8{Tensor::empty({total, m}, DType::e4m3), Tensor::empty({blocks, m}, DType::f32)};
  Quantized b8{Tensor::empty({total, n}, DType::e4m3), Tensor::empty({blocks, n}, DType::f32)};
  k0 = 0;
  int64_t s0 = 0;
  for (size_t g = 0; g < ks.size(); ++g) {
    const int64_t k = ks[g], nb = (k + 127) / 128;
    a8.values.slice(0, k0, k0 + k).copy_from(qa[g].values);
    b8.values.slice(0, k0, k0 + k).copy_from(qb[g].values);
    a8.sf.slice(0, s0, s0 + nb).copy_from(qa[g].sf);
    b8.sf.slice(0, s0, s0 + nb).copy_from(qb[g].sf);
    k0 += k, s0 += nb;
  }
  for (bool fp8 : {false, true})
    for (int c_mode : {0, 1, 2}) {  // no C, separate C, C == D
      SCOPED_TRACE(std::string(fp8 ? "fp8" : "bf16") + " c_mode " + std::to_string(c_mode));
      Tensor d = Tensor::empty({groups, m, n}, DType::f32);
      if (c_mode == 2) d.copy_from(c);
      const Tensor cc = c_mode == 1 ? c : c_mode == 2 ? d : Tensor();
      if (fp8) k_grouped_fp8_gemm_tn_contiguous(a8, b8, d, ks, cc);
      else k_grouped_bf16_gemm_tn_contiguous(xa, xb, d, ks, cc);
      k0 = 0, s0 = 0;
      for (size_t g = 0; g < ks.size(); ++g) {
        const int64_t k = ks[g], nb = (k + 127) / 128;
        const ref::Operand ra = fp8 ? ref::Operand{a8.values.slice(0, k0, k0 + k), a8.sf.slice(0, s0, s0 + nb).t(), 1, 128}
                                    : ref::Operand{xa.slice(0, k0, k0 + k), Tensor(), 1, 128};
        const ref::Operand rb = fp8 ? ref::Operand{b8.values.slice(0, k0, k0 + k), b8.sf.slice(0, s0, s0 + nb).t(), 1, 128}
                                    : ref::Operand{xb.slice(0, k0, k0 + k), Tensor(), 1, 128};
        const Tensor cg = c_mode ? c.select(0, static_cast<int64_t>(g)) : Tensor();
        const std::vector<double> want = ref::gemm(ref::Layout::tn, ra, rb, cg);
        const std::vector<double> got = ref::to_f64(d.select(0, static_cast<int64_t>(g)));
        if (k == 0) {
          for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], want[i]) << "group " << g << " with K = 0";
        } else {
          EXPECT_LE(ref::calc_diff(got, want), 1e-5) << "group " << g;
        }
        k0 += k, s0 += nb;
      }
    }
  EXPECT_MOEKIT_ERROR_ARG(k_grouped_bf16_gemm_tn_contiguous(xa, xb, Tensor::empty({3, m, n}, DType::f32), {130, 0, 256}),
                          "a");  // ks do not add up to the rows
  EXPECT_MOEKIT_ERROR_ARG(k_grouped_bf16_gemm_tn_contiguous(xa, xb, Tensor::empty({groups, m, n}, DType::f32), {130, -1, 257, 7}),
                          "ks");
  EXPECT_MOEKIT_ERROR_ARG(k_grouped_bf16_gemm_tn_contiguous(xa, xb, Tensor::empty({groups, m, n}, DType::bf16), ks), "d");
  EXPECT_MOEKIT_ERROR_ARG(k_grouped_fp8_gemm_tn_contiguous(a8, {b8.values, b8.sf.slice(0, 0, blocks - 1)},
                                                           Tensor::empty({groups, m, n}, DType::f32), ks),
                          "b.sf");
}

// Review findings (2026-12-03): every argument is checked before any group runs, also when
// no group has rows, so a rejected call writes nothing.
bool all_sentinel(const Tensor& d) {
  for (int64_t i = 0; i < d.numel(); ++i)
    if (d.data_ptr<float>()[i] != kSentinel) return false;
  return true;
}

TEST(Grouped, ArgumentsCheckedBeforeAnyGroupRuns) {
  AlignmentGuard guard;
  set_mk_alignment_for_contiguous_layout(4);
  // K of a (64) against b (128), with no group holding a row.
  const Tensor a = random_bf16({8, 64}, 31), b = random_bf16({2, 16, 128}, 32);
  Tensor d = filled({8, 16}, DType::f32);
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_bf16_gemm_nt_contiguous(a, b, d, i32({-1, -1, -1, -1, -1, -1, -1, -1})), "b (group 0)");
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_bf16_gemm_nt_contiguous(a, b, d, i32({0, 0}), true), "b (group 0)");
  Tensor dm = filled({2, 4, 16}, DType::f32);
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_bf16_gemm_nt_masked(random_bf16({2, 4, 64}, 33), b, dm, i32({0, 0}), 0), "b (group 0)");
  const std::vector<PackedWeights> pw = pack_bf16_weights_grouped(b);
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_bf16_gemm_packed_masked(random_bf16({2, 4, 64}, 34), pw, dm, i32({0, 0}), 0), "b (group 0)");
  // FP8 weight scales of the wrong shape, no rows.
  const Quantized qa = per_token_cast_to_fp8(random_bf16({8, 128}, 35), false);
  const Weights w = make_weights(Kind::fp8, 2, 16, 128, 36);
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_fp8_gemm_nt_contiguous(qa, {w.q.values, Tensor::zeros({2, 5, 7}, DType::f32)}, d,
                                                           i32({-1, -1, -1, -1, -1, -1, -1, -1})),
                          "b.sf (group 0)");
  // Masked activation scales with fewer rows than a: group 0 (1 row) would have run first.
  const Quantized qm{qa.values.reshape({2, 4, 128}), Tensor::zeros({2, 2, 1}, DType::f32)};
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_fp8_gemm_nt_masked(qm, w.q, dm, i32({1, 3}), 1), "a.sf");
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_fp8_fp4_gemm_packed_masked(qm, pack_fp8_fp4_weights_grouped(w.q), dm, i32({1, 3}), 1), "a.sf");
  // Experts packed from different formats: A's recipe would change between groups.
  const std::vector<PackedWeights> mixed{pack_fp8_fp4_weights(per_block_cast_to_fp8(random_bf16({16, 128}, 37), false)),
                                         pack_fp8_fp4_weights(per_token_cast_to_fp4(random_bf16({16, 128}, 38), true, 32))};
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_fp8_fp4_gemm_packed_contiguous(qa, mixed, d, i32({0, 0, 0, 0, 1, 1, 1, 1})), "b[1]");
  // k-grouped: sizes whose sum overflows int64 and wraps to a's rows.
  const Tensor ka = random_bf16({4, 8}, 39), kb = random_bf16({4, 16}, 40);
  Tensor kd = filled({4, 8, 16}, DType::f32);
  EXPECT_MOEKIT_ERROR_ARG(k_grouped_bf16_gemm_tn_contiguous(ka, kb, kd, {2, INT64_MAX - 2, INT64_MAX, 6}), "ks");
  EXPECT_TRUE(all_sentinel(d));
  EXPECT_TRUE(all_sentinel(dm));
  EXPECT_TRUE(all_sentinel(kd));
}

TEST(Grouped, KGroupedCMustBeDOrApart) {
  const Tensor a = random_bf16({32, 4}, 41), b = random_bf16({32, 8}, 42);
  Tensor s = filled({3, 4, 8}, DType::f32);
  // D one group ahead of C: group 1 would read a C that group 0 had overwritten.
  EXPECT_MOEKIT_ERROR_ARG(k_grouped_bf16_gemm_tn_contiguous(a, b, s.slice(0, 1, 3), {16, 16}, s.slice(0, 0, 2)), "c");
  EXPECT_TRUE(all_sentinel(s));
  // The dense call too: C one row apart from D.
  Tensor m = filled({5, 8}, DType::f32);
  EXPECT_MOEKIT_ERROR_ARG(bf16_gemm_tn(random_bf16({16, 4}, 43), random_bf16({16, 8}, 44), m.slice(0, 1, 5), m.slice(0, 0, 4)), "c");
}

TEST(Grouped, KGroupOfZeroCopiesCExactly) {
  const Tensor a = random_bf16({16, 4}, 45), b = random_bf16({16, 8}, 46);
  Tensor c = filled({2, 4, 8}, DType::f32), d = filled({2, 4, 8}, DType::f32);
  for (int64_t i = 0; i < c.numel(); i += 3) c.data_ptr<float>()[i] = -0.0f;
  k_grouped_bf16_gemm_tn_contiguous(a, b, d, {0, 16}, c);
  EXPECT_EQ(std::memcmp(d.data(), c.data(), 4 * 32), 0);  // group 0: C's bits, -0.0 included
}

TEST(Grouped, ScalesOfAnyStrides) {
  // Upstream's MN-major scales: a.sf stored [K / 128, M] and passed transposed, as the dense call takes them.
  AlignmentGuard guard;
  set_mk_alignment_for_contiguous_layout(4);
  const Quantized qa = per_token_cast_to_fp8(random_bf16({8, 256}, 47), false);
  Tensor sf_t = Tensor::empty({2, 8}, DType::f32);
  sf_t.copy_from(qa.sf.t());
  const Weights w = make_weights(Kind::fp8, 2, 16, 256, 48);
  const Tensor layout = i32({0, 0, 0, 0, 1, 1, 1, 1});
  Tensor want = filled({8, 16}, DType::f32), got = filled({8, 16}, DType::f32);
  m_grouped_fp8_gemm_nt_contiguous(qa, w.q, want, layout);
  m_grouped_fp8_gemm_nt_contiguous({qa.values, sf_t.t()}, w.q, got, layout);
  EXPECT_EQ(std::memcmp(want.data(), got.data(), 4 * 128), 0);
}

// A last dimension of size 1 may have any stride, as in the dense calls (N = 1 outputs and
// K = 1 weights with stride 2 were refused): the same bits as through unit-stride tensors.
TEST(Grouped, SizeOneLastDimensionsOfAnyStride) {
  AlignmentGuard guard;
  set_mk_alignment_for_contiguous_layout(1);
  const Tensor layout = i32({0, 0, 1, -1});
  // N = 1: D [4, 1] with strides {2, 2}.
  const Tensor a = random_bf16({4, 64}, 51), b = random_bf16({2, 1, 64}, 52);
  Tensor want = filled({4, 1}, DType::f32);
  std::vector<float> dbuf(8, kSentinel);
  const Tensor d = Tensor::from_blob(dbuf.data(), {4, 1}, DType::f32, Device::cpu(), {2, 2});
  m_grouped_bf16_gemm_nt_contiguous(a, b, want, layout);
  m_grouped_bf16_gemm_nt_contiguous(a, b, d, layout);
  for (int64_t r = 0; r < 4; ++r) EXPECT_EQ(dbuf[static_cast<size_t>(2 * r)], want.data_ptr<float>()[r]) << r;
  // K = 1: B [2, 3, 1] with strides {6, 2, 2}.
  const Tensor a1 = random_bf16({4, 1}, 53), b1 = random_bf16({2, 3, 1}, 54);
  std::vector<uint16_t> bbuf(12);
  const Tensor b1_strided = Tensor::from_blob(bbuf.data(), {2, 3, 1}, DType::bf16, Device::cpu(), {6, 2, 2});
  b1_strided.copy_from(b1);
  Tensor want1 = filled({4, 3}, DType::f32), got1 = filled({4, 3}, DType::f32);
  m_grouped_bf16_gemm_nt_contiguous(a1, b1, want1, layout);
  m_grouped_bf16_gemm_nt_contiguous(a1, b1_strided, got1, layout);
  EXPECT_EQ(std::memcmp(want1.data(), got1.data(), 4 * 12), 0);
  // The masked form takes the same weights and outputs.
  Tensor want_m = filled({2, 2, 3}, DType::f32), got_m = filled({2, 2, 3}, DType::f32);
  m_grouped_bf16_gemm_nt_masked(a1.reshape({2, 2, 1}), b1, want_m, i32({2, 1}), 2);
  m_grouped_bf16_gemm_nt_masked(a1.reshape({2, 2, 1}), b1_strided, got_m, i32({2, 1}), 2);
  EXPECT_EQ(std::memcmp(want_m.data(), got_m.data(), 4 * 12), 0);
}

TEST(Grouped, BadInputRaisesNamedErrors) {
  AlignmentGuard guard;
  set_mk_alignment_for_contiguous_layout(4);
  const Tensor a = random_bf16({8, 64}, 11), b = random_bf16({2, 16, 64}, 12);
  Tensor d = filled({8, 16}, DType::f32);
  constexpr auto f = &m_grouped_bf16_gemm_nt_contiguous;
  EXPECT_MOEKIT_ERROR_ARG(f(a, b, d, i32({0, 0, 0, 0, 2, 2, 2, 2}), false), "grouped_layout");   // index >= G
  EXPECT_MOEKIT_ERROR_ARG(f(a, b, d, i32({0, 0, 0, 0, -2, 1, 1, 1}), false), "grouped_layout");  // < -1
  EXPECT_MOEKIT_ERROR_ARG(f(a, b, d, i32({0, 0, 0, 1, 1, 1, 1, 1}), false), "grouped_layout");   // misaligned
  EXPECT_MOEKIT_ERROR_ARG(f(a, b, d, i32({0, 0, 0, 0}), false), "grouped_layout");               // wrong length
  EXPECT_MOEKIT_ERROR_ARG(f(a, b, d, i32({6, 5}), true), "grouped_layout");                       // decreasing psum
  EXPECT_MOEKIT_ERROR_ARG(f(a, b, d, i32({4, 9}), true), "grouped_layout");                       // past M
  EXPECT_MOEKIT_ERROR_ARG(f(a, random_bf16({2, 16, 65}, 13), d, i32({4, 8}), true), "b (group 0)");  // K mismatch
  EXPECT_MOEKIT_ERROR_ARG(f(a, b, Tensor::empty({8, 17}, DType::f32), i32({4, 8}), true), "d");
  EXPECT_MOEKIT_ERROR_ARG(f(a, random_bf16({16, 64}, 14), d, i32({4, 8}), true), "b");             // not 3-D
  EXPECT_MOEKIT_ERROR_ARG(set_mk_alignment_for_contiguous_layout(0), "alignment");
  const Tensor am = random_bf16({2, 4, 64}, 15);
  Tensor dm = filled({2, 4, 16}, DType::f32);
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_bf16_gemm_nt_masked(am, b, dm, i32({1, 5}), 2), "masked_m");    // > max_m
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_bf16_gemm_nt_masked(am, b, dm, i32({1, -1}), 2), "masked_m");
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_bf16_gemm_nt_masked(am, b, dm, i32({1, 1}), -1), "expected_m");
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_bf16_gemm_nt_masked(am, random_bf16({3, 16, 64}, 16), dm, i32({1, 1}), 2), "b");
  // D overlapping itself: groups closer than max_m x N, rows closer than N.
  std::vector<float> dbuf(2 * 4 * 16, 0.0f);
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_bf16_gemm_nt_masked(am, b, Tensor::from_blob(dbuf.data(), {2, 4, 16}, DType::f32, Device::cpu(), {32, 16, 1}),
                                                        i32({1, 1}), 2), "d");
  EXPECT_MOEKIT_ERROR_ARG(f(a, b, Tensor::from_blob(dbuf.data(), {8, 16}, DType::f32, Device::cpu(), {8, 1}), i32({4, 8}), true), "d");
  // FP8 forms: scale tensors of the wrong group count or rows, per-block activation scales.
  const Tensor xa = random_bf16({8, 128}, 17);
  const Quantized qa = per_token_cast_to_fp8(xa, false);
  const Weights w = make_weights(Kind::fp8, 2, 16, 128, 18);
  const Tensor rg = i32({0, 0, 0, 0, 1, 1, 1, 1});
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_fp8_gemm_nt_contiguous({qa.values, qa.sf.slice(0, 0, 4)}, w.q, d, rg), "a.sf");
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_fp8_gemm_nt_contiguous(qa, {w.q.values, w.q.sf.slice(0, 0, 1)}, d, rg), "b.sf");
  GemmOptions per_block;
  per_block.recipe = Recipe{128, 128, 128};
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_fp8_gemm_nt_contiguous(qa, w.q, d, rg, false, per_block), "recipe");
  const Quantized qm{qa.values.reshape({2, 4, 128}), qa.sf.reshape({2, 4, 1})};
  Tensor d8 = filled({2, 4, 16}, DType::f32);
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_fp8_gemm_nt_masked(qm, w.q, d8, i32({1, 5}), 1), "masked_m");
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_fp8_gemm_nt_masked({qm.values, qa.sf}, w.q, d8, i32({1, 1}), 1), "a.sf");
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_fp8_gemm_nt_masked(qm, w.q, Tensor::empty({2, 4, 16}, DType::e4m3), i32({1, 1}), 1), "d");
  for (int64_t i = 0; i < d8.numel(); ++i) ASSERT_EQ(d8.data_ptr<float>()[i], kSentinel);
  // Packed weights: missing, of another shape, or of the wrong group count.
  const std::vector<PackedWeights> pw = pack_bf16_weights_grouped(b);
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_bf16_gemm_packed_contiguous(a, {pw[0], PackedWeights()}, d, i32({4, 8}), true), "b[1]");
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_bf16_gemm_packed_contiguous(a, {pw[0], pack_bf16_weights(random_bf16({17, 64}, 19))}, d,
                                                                i32({4, 8}), true),
                          "b[1]");
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_bf16_gemm_packed_contiguous(a, pw, d, i32({4, 8, 8}), true), "grouped_layout");
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_bf16_gemm_packed_masked(am, {pw[0]}, dm, i32({1, 1}), 2), "b");
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_bf16_gemm_packed_masked(am, pw, dm, i32({1, 5}), 2), "masked_m");
  EXPECT_MOEKIT_ERROR_ARG(pack_bf16_weights_grouped(random_bf16({16, 64}, 20)), "b");
  EXPECT_MOEKIT_ERROR_ARG(pack_fp8_fp4_weights_grouped({w.q.values, w.q.sf.slice(0, 0, 1)}), "b.sf");
  const std::vector<PackedWeights> pw8 = pack_fp8_fp4_weights_grouped(w.q);
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_fp8_fp4_gemm_packed_contiguous({qa.values, qa.sf.slice(0, 0, 4)}, pw8, d, rg), "a.sf");
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_fp8_fp4_gemm_packed_masked(qm, pw8, d8, i32({1, 5}), 1), "masked_m");
  for (int64_t i = 0; i < d8.numel(); ++i) ASSERT_EQ(d8.data_ptr<float>()[i], kSentinel);
  // Rejected calls wrote nothing.
  for (int64_t i = 0; i < d.numel(); ++i) ASSERT_EQ(d.data_ptr<float>()[i], kSentinel);
}

// A view over an input's bytes at another group's rows: each group's dense call sees a D apart
// from its own slices, so only a check of the whole call catches it (it once wrote group 0's
// rows into group 1's input). Every form raises on "d" and leaves the input as it was.
TEST(Grouped, DOverlappingAnInputRaises) {
  AlignmentGuard guard;
  set_mk_alignment_for_contiguous_layout(4);
  auto view_at = [](const Tensor& t, int64_t byte_offset, const Shape& shape, DType dtype) {
    return Tensor::from_blob(static_cast<char*>(t.data()) + byte_offset, shape, dtype);
  };
  auto unchanged = [](const Tensor& t, const std::vector<char>& before) {
    return std::memcmp(t.data(), before.data(), before.size()) == 0;
  };
  auto bytes = [](const Tensor& t) {
    const char* p = static_cast<const char*>(t.data());
    return std::vector<char>(p, p + t.numel() * static_cast<int64_t>(t.element_size()));
  };
  const Tensor a = random_bf16({8, 64}, 31), b = random_bf16({2, 16, 64}, 32);
  const Tensor rows = i32({4, 8});  // psum: group 0 rows 0..3, group 1 rows 4..7
  const std::vector<char> a0 = bytes(a), b0 = bytes(b);
  const Tensor d_on_a = view_at(a, 4 * 64 * 2, {8, 16}, DType::bf16);  // group 0's D rows = a's row 4
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_bf16_gemm_nt_contiguous(a, b, d_on_a, rows, true), "d");
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_bf16_gemm_nt_contiguous(a, b, view_at(b, 16 * 64 * 2, {8, 16}, DType::bf16), rows, true), "d");
  const std::vector<PackedWeights> pw = pack_bf16_weights_grouped(b);
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_bf16_gemm_packed_contiguous(a, pw, d_on_a, rows, true), "d");
  EXPECT_TRUE(unchanged(a, a0));
  EXPECT_TRUE(unchanged(b, b0));

  const Tensor am = random_bf16({2, 4, 64}, 33);
  const std::vector<char> am0 = bytes(am);
  const Tensor dm_on_a = view_at(am, 4 * 64 * 2, {2, 4, 16}, DType::bf16);  // group 0's D = a's group 1
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_bf16_gemm_nt_masked(am, b, dm_on_a, i32({4, 4}), 4), "d");
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_bf16_gemm_packed_masked(am, pw, dm_on_a, i32({4, 4}), 4), "d");
  EXPECT_TRUE(unchanged(am, am0));

  const Quantized qa = per_token_cast_to_fp8(random_bf16({8, 128}, 34), false);
  const Weights w = make_weights(Kind::fp8, 2, 16, 128, 35);
  const std::vector<char> qa0 = bytes(qa.values), wb0 = bytes(w.q.values);
  const Tensor d8_on_a = view_at(qa.values, 4 * 128, {8, 16}, DType::bf16);
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_fp8_gemm_nt_contiguous(qa, w.q, d8_on_a, rows, true), "d");
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_fp8_fp4_gemm_packed_contiguous(qa, pack_fp8_fp4_weights_grouped(w.q), d8_on_a, rows, true), "d");
  const Quantized qm{qa.values.reshape({2, 4, 128}), qa.sf.reshape({2, 4, 1})};
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_fp8_gemm_nt_masked(qm, w.q, view_at(w.q.values, 16 * 128, {2, 4, 16}, DType::bf16), i32({4, 4}), 4), "d");
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_fp8_fp4_gemm_packed_masked(qm, pack_fp8_fp4_weights_grouped(w.q), view_at(qa.values, 4 * 128, {2, 4, 16}, DType::bf16),
                                                               i32({4, 4}), 4),
                          "d");
  EXPECT_TRUE(unchanged(qa.values, qa0));
  EXPECT_TRUE(unchanged(w.q.values, wb0));

  // D over the layout / masked_m tensor (both views of one buffer here).
  std::vector<float> shared(1024, 0.0f);
  const Tensor layout = Tensor::from_blob(shared.data(), {2}, DType::i32);
  layout.data_ptr<int32_t>()[0] = 4, layout.data_ptr<int32_t>()[1] = 8;
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_bf16_gemm_nt_contiguous(a, b, Tensor::from_blob(shared.data(), {8, 16}, DType::f32), layout, true), "d");
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_bf16_gemm_nt_masked(am, b, Tensor::from_blob(shared.data(), {2, 4, 16}, DType::f32), layout, 4), "d");
  EXPECT_EQ(layout.data_ptr<int32_t>()[0], 4);
  EXPECT_EQ(layout.data_ptr<int32_t>()[1], 8);

  // k-grouped: group 0's D over the rows of b that group 1 reads.
  const Tensor ka = random_bf16({64, 4}, 36), kb = random_bf16({64, 32}, 37);
  const std::vector<char> kb0 = bytes(kb);
  EXPECT_MOEKIT_ERROR_ARG(k_grouped_bf16_gemm_tn_contiguous(ka, kb, view_at(kb, 32 * 32 * 2, {2, 4, 32}, DType::f32), {32, 32}, Tensor()), "d");
  EXPECT_TRUE(unchanged(kb, kb0));
  const Quantized ka8 = per_channel_cast_to_fp8(random_bf16({256, 4}, 38), false), kb8 = per_channel_cast_to_fp8(random_bf16({256, 32}, 39), false);
  const std::vector<char> kb80 = bytes(kb8.values);
  EXPECT_MOEKIT_ERROR_ARG(k_grouped_fp8_gemm_tn_contiguous(ka8, kb8, view_at(kb8.values, 128 * 32, {2, 4, 32}, DType::f32), {128, 128}, Tensor()), "d");
  EXPECT_TRUE(unchanged(kb8.values, kb80));
}

// Packed calls with no groups: no weights give N, and no row is computed, so D may have any
// width and is left as it was.
TEST(Grouped, PackedCallsWithNoGroupsTakeAnyWidth) {
  const Tensor a = random_bf16({4, 64}, 41);
  Tensor d = filled({4, 16}, DType::f32);
  m_grouped_bf16_gemm_packed_contiguous(a, {}, d, i32({-1, -1, -1, -1}), false);
  m_grouped_bf16_gemm_packed_contiguous(a, {}, d, i32({}), true);
  m_grouped_bf16_gemm_packed_masked(random_bf16({0, 4, 64}, 42), {}, filled({0, 4, 16}, DType::f32), i32({}), 1);
  for (int64_t i = 0; i < d.numel(); ++i) ASSERT_EQ(d.data_ptr<float>()[i], kSentinel);
  EXPECT_MOEKIT_ERROR_ARG(m_grouped_bf16_gemm_packed_contiguous(a, {}, d, i32({0, -1, -1, -1}), false), "grouped_layout");
}

}  // namespace
}  // namespace moekit

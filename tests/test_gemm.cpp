// Dense GEMMs (gemm.md): every layout x operand format x recipe x output dtype x C mode
// against the f64 oracle on the same (quantised) inputs, the unquantised-product tolerances
// of formats.md, awkward shapes and strided views, bit-identical results across thread
// counts and ISA paths, and argument validation.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

// First and alone: a public header declares moekit::Error itself, so that a caller that
// includes only it can catch what it raises.
#include "moekit/gemm.h"
static_assert(sizeof(moekit::Error) > 0, "moekit/gemm.h must declare moekit::Error");

#include "moekit/error.h"
#include "moekit/formats.h"
#include "moekit/runtime.h"
#include "moekit/tensor.h"
#include "reference.h"
#include "test_util.h"

namespace moekit {
namespace {

using moekit::testing::for_each_isa;
using ref::Layout;

struct ThreadGuard {
  int previous = num_threads();
  ~ThreadGuard() { set_num_threads(previous); }
};

// Random bf16 [rows, cols] with a spread of magnitudes (and exact zeros).
Tensor random_bf16(int64_t rows, int64_t cols, uint64_t seed, int spread_exp = 3) {
  Tensor t = Tensor::empty({rows, cols}, DType::bf16);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> spread(-spread_exp, spread_exp);
  auto* p = t.data_ptr<uint16_t>();
  for (int64_t i = 0; i < rows * cols; ++i) {
    const float v = (i % 97 == 5) ? 0.0f : std::ldexp(normal(rng), spread(rng));
    p[i] = f32_to_bf16(v);
  }
  return t;
}

bool a_k_major(Layout l) { return l == Layout::nt || l == Layout::nn; }
bool b_k_major(Layout l) { return l == Layout::nt || l == Layout::tt; }
const char* layout_name(Layout l) {
  switch (l) {
    case Layout::nt: return "nt";
    case Layout::nn: return "nn";
    case Layout::tn: return "tn";
    case Layout::tt: return "tt";
  }
  return "?";
}

// The stored form of a logical [MN, K] operand: itself (K-major) or a transposed copy
// [K, MN]. FP4 values are re-packed two per byte along the stored last dimension.
Tensor stored(const Tensor& logical, bool k_major, int64_t k) {
  if (k_major) return logical;
  const int64_t mn = logical.size(0);
  if (logical.dtype() != DType::e2m1x2) return logical.t().contiguous();
  Tensor out = Tensor::zeros({k, (mn + 1) / 2}, DType::e2m1x2);
  const auto* src = logical.data_ptr<uint8_t>();
  auto* dst = out.data_ptr<uint8_t>();
  for (int64_t i = 0; i < mn; ++i)
    for (int64_t kk = 0; kk < k; ++kk) {
      const uint8_t nib = (src[i * logical.stride(0) + kk / 2] >> ((kk & 1) * 4)) & 0xf;
      dst[kk * out.stride(0) + i / 2] |= static_cast<uint8_t>(nib << ((i & 1) * 4));
    }
  return out;
}

enum class Fmt { bf16, fp8_token, fp8_block, fp8_channel, fp4 };
const char* fmt_name(Fmt f) {
  switch (f) {
    case Fmt::bf16: return "bf16";
    case Fmt::fp8_token: return "fp8(1x128)";
    case Fmt::fp8_block: return "fp8(128x128)";
    case Fmt::fp8_channel: return "fp8(1x128,chan)";
    case Fmt::fp4: return "fp4(1x32)";
  }
  return "?";
}

struct Built {
  Quantized q;        // stored values + canonical sf
  ref::Operand ref;   // the same for the oracle
  OperandRecipe recipe;
};

// Quantises a logical [MN, K] bf16 operand with the chosen format and stores it.
Built build(const Tensor& x, Fmt fmt, bool k_major, bool ue8m0) {
  const int64_t k = x.size(1);
  Built b;
  Quantized q;
  switch (fmt) {
    case Fmt::fp8_token:
    case Fmt::fp8_channel: q = per_token_cast_to_fp8(x, ue8m0, 128); b.recipe = {1, 128}; break;
    case Fmt::fp8_block: q = per_block_cast_to_fp8(x, ue8m0); b.recipe = {128, 128}; break;
    case Fmt::fp4: q = per_token_cast_to_fp4(x, ue8m0, 32); b.recipe = {1, 32}; break;
    case Fmt::bf16: break;
  }
  if (fmt == Fmt::bf16) {
    b.q.values = stored(x, k_major, k);
    b.ref = {b.q.values, Tensor(), 1, 128};
    return b;
  }
  b.q.values = stored(q.values, k_major, k);
  b.q.sf = ue8m0 ? pack_ue8m0_to_int(q.sf) : q.sf;
  b.ref = {b.q.values, b.q.sf, b.recipe.gran_mn, b.recipe.gran_k};
  if (fmt == Fmt::fp4) b.ref.packed_extent = k_major ? k : x.size(0);
  return b;
}

// The same operand with every value replaced by its magnitude (sign bits cleared).
ref::Operand abs_operand(const ref::Operand& op) {
  ref::Operand out = op;
  out.values = op.values.contiguous();
  if (out.values.data() == op.values.data()) {
    out.values = Tensor::empty(op.values.shape(), op.values.dtype());
    out.values.copy_from(op.values);
  }
  auto* p = static_cast<uint8_t*>(out.values.data());
  const int64_t n = out.values.numel();
  switch (op.values.dtype()) {
    case DType::bf16: for (int64_t i = 0; i < n; ++i) p[2 * i + 1] &= 0x7f; break;
    case DType::e4m3: for (int64_t i = 0; i < n; ++i) p[i] &= 0x7f; break;
    case DType::e2m1x2: for (int64_t i = 0; i < n; ++i) p[i] &= 0x77; break;
    default: break;
  }
  return out;
}

enum class CMode { none, separate, in_place };

struct Case {
  Layout layout = Layout::nt;
  Fmt fa = Fmt::bf16, fb = Fmt::bf16;
  int64_t m = 1, n = 1, k = 1;
  DType out = DType::f32;
  CMode c = CMode::none;
  bool ue8m0 = false;
  bool packed = false;  // B through pack_*_weights and the *_gemm_packed calls (nt / nn only)
  std::string str() const {
    return std::string(layout_name(layout)) + " " + fmt_name(fa) + " x " + fmt_name(fb) + " m" + std::to_string(m) +
           " n" + std::to_string(n) + " k" + std::to_string(k) + " " + dtype_name(out) +
           (c == CMode::none ? "" : c == CMode::separate ? " +C" : " +C(in place)") + (ue8m0 ? " ue8m0" : "") +
           (packed ? " packed" : "");
  }
};

void call(const Case& cs, const Built& a, const Built& b, const Tensor& d, const Tensor& c) {
  if (cs.packed) {
    ASSERT_TRUE(cs.layout == Layout::nt || cs.layout == Layout::nn) << "packed calls take A [M, K]";
    const bool k_major = b_k_major(cs.layout);
    if (cs.fa == Fmt::bf16) return bf16_gemm_packed(a.q.values, pack_bf16_weights(b.q.values, k_major), d, c);
    GemmOptions o;
    o.recipe_b = b.recipe;
    const PackedWeights w = pack_fp8_fp4_weights(b.q, k_major, o);
    o.recipe_a = a.recipe;
    return fp8_fp4_gemm_packed(a.q, w, d, c, o);
  }
  if (cs.fa == Fmt::bf16) {
    switch (cs.layout) {
      case Layout::nt: bf16_gemm_nt(a.q.values, b.q.values, d, c); return;
      case Layout::nn: bf16_gemm_nn(a.q.values, b.q.values, d, c); return;
      case Layout::tn: bf16_gemm_tn(a.q.values, b.q.values, d, c); return;
      case Layout::tt: bf16_gemm_tt(a.q.values, b.q.values, d, c); return;
    }
  }
  GemmOptions o;
  o.recipe_a = a.recipe;
  o.recipe_b = b.recipe;
  switch (cs.layout) {
    case Layout::nt: fp8_gemm_nt(a.q, b.q, d, c, o); return;
    case Layout::nn: fp8_gemm_nn(a.q, b.q, d, c, o); return;
    case Layout::tn: fp8_gemm_tn(a.q, b.q, d, c, o); return;
    case Layout::tt: fp8_gemm_tt(a.q, b.q, d, c, o); return;
  }
}

// The operands, C and the GEMM's output of one case (under the active ISA).
struct CaseRun {
  Built a, b;
  Tensor c0;
  std::vector<double> got;
};
CaseRun run_case(const Case& cs, uint64_t seed) {
  const Tensor xa = random_bf16(cs.m, cs.k, seed), xb = random_bf16(cs.n, cs.k, seed + 1);
  CaseRun r{build(xa, cs.fa, a_k_major(cs.layout), cs.ue8m0), build(xb, cs.fb, b_k_major(cs.layout), cs.ue8m0), Tensor(), {}};
  Tensor d = Tensor::empty({cs.m, cs.n}, cs.out);
  if (cs.c != CMode::none) {
    const Tensor cb = random_bf16(cs.m, cs.n, seed + 2);
    r.c0 = Tensor::empty({cs.m, cs.n}, cs.out);
    convert(cb, r.c0);
    if (cs.c == CMode::in_place) d.copy_from(r.c0);
  }
  const Tensor c = cs.c == CMode::separate ? r.c0 : cs.c == CMode::in_place ? d : Tensor();
  call(cs, r.a, r.b, d, c);
  r.got = ref::to_f64(d);
  return r;
}

// Checks D of one run against the oracle on the same stored inputs (a, b, C of the run).
void check_against_oracle(const Case& cs, const CaseRun& run, const std::vector<double>& want,
                          const std::vector<double>& abs_dot) {
  const std::vector<double>& got = run.got;
  const double diff = ref::calc_diff(got, want);
  EXPECT_LE(diff, 1e-5);
  // Element-wise, against the classic bound for f32 accumulation of K terms:
  // |got - want| <= 2K·2^-24·(Σ|a·b| + |c|) (+ half a bf16 ulp when D is bf16).
  const std::vector<double> c_vals = run.c0.defined() ? ref::to_f64(run.c0) : std::vector<double>(got.size(), 0.0);
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double tol = (cs.out == DType::bf16 ? 0x1p-8 * std::fabs(want[i]) : 0x1p-24 * std::fabs(want[i])) +
                       2.0 * static_cast<double>(cs.k + 1) * 0x1p-24 * (abs_dot[i] + std::fabs(c_vals[i])) + 1e-30;
    worst = std::max(worst, std::fabs(got[i] - want[i]) / tol);
  }
  EXPECT_LE(worst, 1.0) << "largest element error / bound";
}

// Runs one case under each ISA of `isas` (the oracle once: the operands are the same bits
// under every ISA), checks every result against the oracle and returns them in that order.
std::vector<std::vector<double>> check_runs(const Case& cs, uint64_t seed, const std::vector<Isa>& isas) {
  SCOPED_TRACE(cs.str());
  std::vector<CaseRun> runs;
  for (Isa isa : isas) {
    ScopedIsa scoped(isa);
    runs.push_back(run_case(cs, seed));
  }
  const Built &a = runs[0].a, &b = runs[0].b;
  const std::vector<double> want = ref::gemm(cs.layout, a.ref, b.ref, runs[0].c0);
  const std::vector<double> abs_dot = ref::gemm(cs.layout, abs_operand(a.ref), abs_operand(b.ref));
  std::vector<std::vector<double>> out;
  for (size_t i = 0; i < runs.size(); ++i) {
    SCOPED_TRACE(std::string("isa=") + isa_name(isas[i]));
    check_against_oracle(cs, runs[i], want, abs_dot);
    out.push_back(std::move(runs[i].got));
  }
  return out;
}

// One case under the active ISA, checked against the oracle; returns D (as f64).
std::vector<double> check_case(const Case& cs, uint64_t seed) { return check_runs(cs, seed, {active_isa()})[0]; }

// check_case under every GEMM path of this CPU. The FMA-class paths (scalar, avx2, avx512)
// must give the same bits; the bf16-pair paths (avx512_bf16, amx), an accuracy class of
// their own, are held to the oracle (and to thread-count identity by the tests that vary
// the threads).
void check_case_on_every_isa(const Case& cs, uint64_t seed) {
  const std::vector<Isa> isas = moekit::testing::gemm_isas();
  const std::vector<std::vector<double>> got = check_runs(cs, seed, isas);
  for (size_t i = 1; i < isas.size(); ++i) {
    if (isas[i] == Isa::amx || isas[i] == Isa::avx512_bf16) continue;
    EXPECT_EQ(0, std::memcmp(got[0].data(), got[i].data(), got[i].size() * sizeof(double)))
        << cs.str() << ": " << isa_name(isas[i]) << " vs " << isa_name(isas[0]);
  }
}

const Layout kLayouts[] = {Layout::nt, Layout::nn, Layout::tn, Layout::tt};

struct FmtPair {
  Fmt a, b;
};
const FmtPair kPairs[] = {{Fmt::bf16, Fmt::bf16},      {Fmt::fp8_token, Fmt::fp8_block}, {Fmt::fp8_token, Fmt::fp8_channel},
                          {Fmt::fp4, Fmt::fp4},        {Fmt::fp8_token, Fmt::fp4},       {Fmt::fp4, Fmt::fp8_block}};

// Every layout x format pair x output dtype x C mode x scale dtype, small awkward shape
// (K spans two K blocks and ends in a partial scale group), on every ISA path; all paths
// must agree bit for bit.
TEST(Gemm, AllCombinationsMatchOracleAndAgreeAcrossIsas) {
  uint64_t seed = 1;
  for (Layout layout : kLayouts)
    for (const FmtPair& p : kPairs)
      for (DType out : {DType::f32, DType::bf16})
        for (CMode cm : {CMode::none, CMode::separate, CMode::in_place})
          for (bool ue8m0 : {false, true}) {
            if (p.a == Fmt::bf16 && ue8m0) continue;  // no scales to encode
            check_case_on_every_isa({layout, p.a, p.b, 7, 18, 300, out, cm, ue8m0}, seed++);
          }
}

// One to four rows take the targets' fused decode path (B decoded straight into registers):
// it must agree bit for bit with the portable path, over several K groups, partial groups
// and a K tail, for every B format.
// Scales at 2^120 and above on e4m3 operands (review finding, 2026-12-03): the SIMD decoders
// read e4m3 as value / 256 and multiplied the scale by 256, which overflowed to inf although
// every product is finite. Small M (the streaming and dot paths) and blocked M, the large
// scale on A or on B, every FMA-class ISA bit for bit and against the oracle. The
// AVX512_BF16 target at every M: its dot path for M <= 4 overflowed for A scales of 2^120
// and above until 2026-12-04 (weights times 2^8 against A; now A's group is scaled down
// first). AMX at M >= 8 only: its one- and two-row calls share that dot path, but its
// three- and four-row tiles have not run with such scales (no AMX host since).
// Also recipe (1, 1, 32) with K = 232 (scale groups of 32, two per 64-code block on the
// bf16-pair dot path, and a K tail).
TEST(Gemm, ExtremeScalesMatchOracleOnEveryIsa) {
  for (const bool fine : {false, true})
  for (const bool on_a : {true, false})
    for (const int64_t m : {int64_t{1}, int64_t{3}, int64_t{8}, int64_t{40}}) {
      SCOPED_TRACE(std::string(on_a ? "scale 2^121 on A" : "scale 2^121 on B") + ", M = " + std::to_string(m) +
                   (fine ? ", recipe (1, 1, 32)" : ", recipe (1, 128, 128)"));
      const int64_t n = 24, k = fine ? 232 : 256, gran_k = fine ? 32 : 128, gran_n = fine ? 1 : 128;
      const int64_t groups = (k + gran_k - 1) / gran_k;
      Quantized a{Tensor::empty({m, k}, DType::e4m3), Tensor::empty({m, groups}, DType::f32)};
      Quantized b{Tensor::empty({n, k}, DType::e4m3), Tensor::empty({(n + gran_n - 1) / gran_n, groups}, DType::f32)};
      std::mt19937 rng(77);
      for (Tensor* t : {&a.values, &b.values})
        for (int64_t i = 0; i < t->numel(); ++i) {
          uint8_t c = static_cast<uint8_t>(rng());
          if ((c & 0x7f) >= 0x70) c &= 0xbf;  // below 128 (times 2^121: finite), no NaN
          t->data_ptr<uint8_t>()[i] = c;
        }
      for (int64_t i = 0; i < a.sf.numel(); ++i) a.sf.data_ptr<float>()[i] = on_a ? 0x1p121f : 0x1p-40f;
      for (int64_t i = 0; i < b.sf.numel(); ++i) b.sf.data_ptr<float>()[i] = on_a ? 0x1p-40f : 0x1p121f;
      const std::vector<double> want = ref::gemm(ref::Layout::nt, {a.values, a.sf, 1, gran_k}, {b.values, b.sf, gran_n, gran_k});
      GemmOptions options;
      options.recipe = Recipe{1, gran_n, gran_k};
      Tensor fma_bits;
      for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512, Isa::avx512_bf16, Isa::amx}) {
        if (!isa_supported(isa) || (isa == Isa::amx && m < 8)) continue;
        SCOPED_TRACE(isa_name(isa));
        ScopedIsa scoped(isa);
        Tensor d = Tensor::empty({m, n}, DType::f32);
        fp8_gemm_nt(a, b, d, Tensor(), options);
        const std::vector<double> got = ref::to_f64(d);
        bool finite = true;
        for (double x : got) finite = finite && std::isfinite(x);
        EXPECT_TRUE(finite) << "non-finite results";
        if (!finite) continue;
        EXPECT_LE(ref::calc_diff(got, want), 1e-5);
        if (isa <= Isa::avx512) {
          if (!fma_bits.defined()) fma_bits = d;
          else EXPECT_EQ(std::memcmp(d.data(), fma_bits.data(), static_cast<size_t>(m * n) * 4), 0) << "FMA-class paths differ";
        }
      }
    }
}

// fp8_fp4_gemm_nt on every FMA-class ISA of this CPU: `check` judges each result (as f64),
// and all of them must have the same bits.
template <class Check>
void on_every_fma_isa(const Quantized& a, const Quantized& b, const GemmOptions& o, Check check) {
  const int64_t m = a.values.size(0), n = b.values.size(0);
  Tensor fma_bits;
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) {
    if (!isa_supported(isa)) continue;
    SCOPED_TRACE(isa_name(isa));
    ScopedIsa scoped(isa);
    Tensor d = Tensor::empty({m, n}, DType::f32);
    fp8_fp4_gemm_nt(a, b, d, Tensor(), o);
    check(ref::to_f64(d));
    if (!fma_bits.defined()) fma_bits = d;
    else EXPECT_EQ(std::memcmp(d.data(), fma_bits.data(), static_cast<size_t>(m * n) * 4), 0) << "FMA-class paths differ";
  }
}

// Small M scales A by 2^s before narrow B's raw values (value x 2^-120), s the largest that
// keeps every |a| x 2^s below 2^127 (gemm_simd.inc, small_m_a_shift). A's scales here span
// 2^-60 .. 2^40 across groups and rows, so s moves from 120 down to 79 between calls and a
// row mixes tiny and large products; FP8 (128 x 128) and FP4 (1 x 32) B, M = 1..4, K with
// whole 32-blocks, a partial group and a tail: every FMA-class ISA bit for bit and the oracle.
TEST(Gemm, SmallMWideActivationRangesMatchOracleOnEveryIsa) {
  for (const bool fp4 : {false, true})
    for (const int top : {0, 20, 40})
      for (const int64_t m : {int64_t{1}, int64_t{2}, int64_t{4}}) {
        SCOPED_TRACE(std::string(fp4 ? "fp4" : "fp8") + " B, largest A scale 2^" + std::to_string(top) +
                     ", M = " + std::to_string(m));
        const int64_t n = 13, k = 328, gran = fp4 ? 32 : 128, groups = (k + gran - 1) / gran;
        Quantized a{Tensor::empty({m, k}, DType::e4m3), Tensor::empty({m, groups}, DType::f32)};
        Quantized b = fp4 ? Quantized{Tensor::empty({n, k / 2}, DType::e2m1x2), Tensor::empty({n, groups}, DType::f32)}
                          : Quantized{Tensor::empty({n, k}, DType::e4m3), Tensor::empty({1, groups}, DType::f32)};
        std::mt19937 rng(static_cast<uint32_t>(31 * top + m + (fp4 ? 7 : 0)));
        for (Tensor* t : {&a.values, &b.values})
          for (int64_t i = 0; i < t->numel(); ++i) {
            uint8_t c = static_cast<uint8_t>(rng());
            if (t->dtype() == DType::e4m3 && (c & 0x7f) == 0x7f) c &= 0xfe;  // no NaN
            t->data_ptr<uint8_t>()[i] = c;
          }
        for (int64_t i = 0; i < a.sf.numel(); ++i)
          a.sf.data_ptr<float>()[i] = std::ldexp(1.0f, i % 3 == 0 ? top : -60 + static_cast<int>(rng() % 50));
        for (int64_t i = 0; i < b.sf.numel(); ++i) b.sf.data_ptr<float>()[i] = std::ldexp(1.0f, -10 + static_cast<int>(rng() % 20));
        GemmOptions options;
        options.recipe_a = OperandRecipe{1, gran};
        options.recipe_b = OperandRecipe{fp4 ? 1 : 128, gran};
        ref::Operand ra{a.values, a.sf, 1, gran}, rb{b.values, b.sf, fp4 ? 1 : 128, gran};
        if (fp4) rb.packed_extent = k;
        const std::vector<double> want = ref::gemm(ref::Layout::nt, ra, rb);
        const std::vector<double> abs_dot = ref::gemm(ref::Layout::nt, abs_operand(ra), abs_operand(rb));
        on_every_fma_isa(a, b, options, [&](const std::vector<double>& got) {
          double worst = 0.0;
          for (size_t i = 0; i < got.size(); ++i)
            worst = std::max(worst, std::fabs(got[i] - want[i]) /
                                        (0x1p-24 * std::fabs(want[i]) + 2.0 * (k + 1) * 0x1p-24 * abs_dot[i] + 1e-300));
          EXPECT_LE(worst, 1.0) << "largest element error / bound";
        });
      }
}

// Review findings on the small-M narrow path (2026-12-03), each against the oracle and for
// the same bits on every FMA-class ISA:
//  1. rows of one pass where only some scales split (sfb x 2^(120 - s) overflows for one
//     row of B only): the others were multiplied by an unset factor;
//  2. one K group of huge activations next to a group of tiny ones whose weights are tiny
//     and whose scale is huge: with one 2^s per call the small group's products vanished.
TEST(Gemm, SmallMMixedSplitScalesAndGroupRangesMatchOracle) {
  auto check = [](const Quantized& a, const Quantized& b, const GemmOptions& o, const ref::Operand& ra,
                  const ref::Operand& rb) {
    const std::vector<double> want = ref::gemm(ref::Layout::nt, ra, rb);
    on_every_fma_isa(a, b, o, [&](const std::vector<double>& got) {
      for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-5 * std::fabs(want[i])) << "element " << i;
    });
  };
  GemmOptions o;
  o.recipe_a = OperandRecipe{1, 128};
  o.recipe_b = OperandRecipe{1, 128};
  for (const int64_t m : {int64_t{1}, int64_t{2}, int64_t{4}}) {
    SCOPED_TRACE("M = " + std::to_string(m));
    const int64_t n = 4, k = 256;
    // 1. A scale 2^10 (s = 113, factor 2^7); B row 0's scale 2^123 splits, rows 1..3 do not.
    Quantized a{Tensor::empty({m, k}, DType::e4m3), Tensor::empty({m, 2}, DType::f32)};
    Quantized b{Tensor::empty({n, k}, DType::e4m3), Tensor::empty({n, 1}, DType::i32)};
    for (int64_t i = 0; i < m * k; ++i) a.values.data_ptr<uint8_t>()[i] = static_cast<uint8_t>(0x38 + (7 * i) % 30);
    for (int64_t i = 0; i < n * k; ++i) b.values.data_ptr<uint8_t>()[i] = static_cast<uint8_t>(0x30 + (5 * i) % 40);
    for (int64_t i = 0; i < k; ++i) b.values.data_ptr<uint8_t>()[i] = i == 5 ? 0x01 : 0;  // row 0: finite at 2^123
    for (int64_t i = 0; i < m * 2; ++i) a.sf.data_ptr<float>()[i] = 1024.0f;
    for (int64_t r = 0; r < n; ++r) b.sf.data_ptr<int32_t>()[r] = r == 0 ? 250 | 250 << 8 : 127 | 127 << 8;
    check(a, b, o, {a.values, a.sf, 1, 128}, {b.values, b.sf, 1, 128});
    // 2. A's group 0 holds 448 x 2^118 (at k = 0), group 1 values of 2^-30; B's group 0 is
    //    zero, group 1 the least subnormal (2^-9) under a scale of 2^127.
    for (int64_t i = 0; i < m * k; ++i) a.values.data_ptr<uint8_t>()[i] = (i % k) == 0 ? 0x7e : (i % k) < 128 ? 0 : 0x38;
    for (int64_t i = 0; i < m; ++i) a.sf.data_ptr<float>()[2 * i] = 0x1p118f, a.sf.data_ptr<float>()[2 * i + 1] = 0x1p-30f;
    for (int64_t i = 0; i < n * k; ++i) b.values.data_ptr<uint8_t>()[i] = (i % k) < 128 ? 0 : 0x01;
    for (int64_t r = 0; r < n; ++r) b.sf.data_ptr<int32_t>()[r] = 127 | 254 << 8;
    check(a, b, o, {a.values, a.sf, 1, 128}, {b.values, b.sf, 1, 128});
  }
}

// D overlapping itself (a row stride under N, a zero stride) would have threads write one
// element for several outputs; it is refused, and a padded row stride still works.
TEST(Gemm, DOverlappingItselfRaises) {
  const Tensor a = random_bf16(4, 64, 5), b = random_bf16(8, 64, 6);
  std::vector<float> buf(64, 0.0f);
  EXPECT_MOEKIT_ERROR_ARG(bf16_gemm_nt(a, b, Tensor::from_blob(buf.data(), {4, 8}, DType::f32, Device::cpu(), {4, 1})), "d");
  EXPECT_MOEKIT_ERROR_ARG(bf16_gemm_nt(a, b, Tensor::from_blob(buf.data(), {4, 8}, DType::f32, Device::cpu(), {0, 1})), "d");
  const Tensor padded = Tensor::from_blob(buf.data(), {4, 8}, DType::f32, Device::cpu(), {9, 1});
  EXPECT_NO_THROW(bf16_gemm_nt(a, b, padded));
  Tensor want = Tensor::empty({4, 8}, DType::f32);
  bf16_gemm_nt(a, b, want);
  for (int64_t i = 0; i < 4; ++i)
    for (int64_t j = 0; j < 8; ++j) EXPECT_EQ(buf[static_cast<size_t>(i * 9 + j)], want.data_ptr<float>()[i * 8 + j]);
  // One row (any row stride) and one column per row are not overlaps.
  EXPECT_NO_THROW(bf16_gemm_nt(a.slice(0, 0, 1), b, Tensor::from_blob(buf.data(), {1, 8}, DType::f32, Device::cpu(), {0, 1})));
}

// D sharing memory with an operand (review finding, 2026-12-03): bf16_gemm_nt(a, b, a) was
// accepted and half the outputs were wrong (the kernels read a after writing parts of d).
TEST(Gemm, DOverlappingAnOperandRaises) {
  Tensor a = Tensor::zeros({64, 64}, DType::bf16), b = Tensor::zeros({64, 64}, DType::bf16);
  EXPECT_MOEKIT_ERROR_ARG(bf16_gemm_nt(a, b, a), "d");
  EXPECT_MOEKIT_ERROR_ARG(bf16_gemm_nt(a, b, b), "d");
  Tensor big = Tensor::zeros({128, 64}, DType::bf16);
  EXPECT_NO_THROW(bf16_gemm_nt(big.slice(0, 0, 64), b, big.slice(0, 64, 128)));  // apart: fine
  const Quantized q = per_token_cast_to_fp8(Tensor::zeros({64, 128}, DType::bf16), false);
  const Quantized w = per_block_cast_to_fp8(Tensor::zeros({32, 128}, DType::bf16), false);
  Tensor d = Tensor::zeros({64, 32}, DType::f32);
  EXPECT_MOEKIT_ERROR_ARG(fp8_gemm_nt(q, w, Tensor::from_blob(q.sf.data(), {1, 1}, DType::f32)), "d");
  EXPECT_NO_THROW(fp8_gemm_nt(q, w, d));
  EXPECT_MOEKIT_ERROR_ARG(bf16_gemm_packed(a, pack_bf16_weights(b), a), "d");
}

TEST(Gemm, SmallMFusedPathAgreesAcrossIsas) {
  uint64_t seed = 500;
  for (int64_t m : {1, 2, 3, 4})
    for (const FmtPair& p : kPairs)
      for (int64_t k : {40, 300, 1000}) {
        check_case_on_every_isa({Layout::nt, p.a, p.b, m, 23, k, DType::f32, CMode::none, p.a != Fmt::bf16 && (k & 1) == 0},
                                seed++);
      }
}

// Awkward shapes per layout: M in {1, 2, 7, 129}, N not a multiple of 16 or 128, K not a
// multiple of 128.
TEST(Gemm, AwkwardShapes) {
  uint64_t seed = 1000;
  for (Layout layout : kLayouts)
    for (int64_t m : {1, 2, 7, 129})
      for (auto [n, k] : {std::pair<int64_t, int64_t>{1, 33}, {130, 200}, {257, 130}}) {
        check_case({layout, Fmt::bf16, Fmt::bf16, m, n, k, DType::f32, CMode::none, false}, seed++);
        check_case({layout, Fmt::fp8_token, Fmt::fp8_block, m, n, k, DType::bf16, CMode::separate, false}, seed++);
        check_case({layout, Fmt::fp8_token, Fmt::fp4, m, n, k, DType::f32, CMode::none, true}, seed++);
        check_case({layout, Fmt::fp4, Fmt::fp8_channel, m, n, k + (k & 1), DType::bf16, CMode::in_place, true}, seed++);
      }
}

// The last register panel of rows holding 13, 25 and 31 rows: the avx512_bf16 tile runs a
// 32-row panel in passes of 12, 12 and 8 rows and skips the passes past the panel's rows,
// so every pass boundary is crossed; plain and promoted scales.
TEST(Gemm, PartialRowPanelsMatchOracle) {
  uint64_t seed = 2000;
  for (int64_t m : {45, 57, 63}) {
    check_case_on_every_isa({Layout::nt, Fmt::bf16, Fmt::bf16, m, 40, 300, DType::f32, CMode::separate, false}, seed++);
    check_case_on_every_isa({Layout::nt, Fmt::fp8_token, Fmt::fp8_block, m, 40, 300, DType::bf16, CMode::none, false},
                            seed++);
  }
}

// Row blocks of more than one register panel per thread take the blocked drivers: the
// short-K order (K up to 6 blocks: partial sums kept per row block through all of K) and
// the general one (more K blocks). Both, for every layout, several formats and C modes,
// with one and two threads (two items of 150 rows: more than one register panel each; 300
// rows, since up to 256 rows against K-major weights take medium_m on AMX);
// N = 40 ends in a partial register panel; one wider case has several column blocks in the
// short-K driver (A re-packed per column block). Every ISA path must give the same bits.
TEST(Gemm, BlockedDriversMatchOracle) {
  ThreadGuard guard;
  uint64_t seed = 3000;
  for (int threads : {1, 2}) {
    set_num_threads(threads);
    for (Layout layout : kLayouts)
      for (int64_t k : {300, 1700}) {  // 2 K blocks (short K), 7 (general)
        check_case_on_every_isa({layout, Fmt::bf16, Fmt::bf16, 300, 40, k, DType::f32, CMode::in_place, false}, seed++);
        check_case_on_every_isa({layout, Fmt::fp8_token, Fmt::fp8_block, 300, 40, k, DType::bf16, CMode::separate, false}, seed++);
        check_case_on_every_isa({layout, Fmt::fp8_token, Fmt::fp4, 300, 40, k, DType::f32, CMode::none, true}, seed++);
      }
  }
  set_num_threads(1);  // 3 K blocks: packed B of 4 MiB holds 1360 columns, so 1400 are two column blocks
  check_case_on_every_isa({Layout::nt, Fmt::bf16, Fmt::bf16, 300, 1400, 600, DType::bf16, CMode::separate, false}, seed++);
}

// FP4 weights with an odd K end each stored row in a byte whose high nibble lies past K:
// whatever it holds must not change the result, on every ISA path, raw (f32 scales,
// promoted on AMX) and folded (ue8m0), through the blocked path (70 rows: B is packed).
TEST(Gemm, Fp4PaddingNibbleIgnored) {
  const int64_t m = 70, n = 40;
  for (const bool ue8m0 : {false, true})
    for (const int64_t k : {33, 301}) {
      const Quantized qa = per_token_cast_to_fp8(random_bf16(m, k, 71), ue8m0, 32);
      const Quantized qb = per_token_cast_to_fp4(random_bf16(n, k, 72), ue8m0, 32);
      Tensor dirty = Tensor::empty(qb.values.shape(), qb.values.dtype());
      dirty.copy_from(qb.values);
      const int64_t bytes = dirty.size(1);
      for (int64_t r = 0; r < n; ++r) dirty.data_ptr<uint8_t>()[r * bytes + bytes - 1] |= 0x70;  // code 7: 6.0
      GemmOptions o;
      o.recipe = Recipe{1, 1, 32};
      for (const Isa isa : moekit::testing::gemm_isas()) {
        ScopedIsa scoped(isa);
        Tensor clean_d = Tensor::empty({m, n}, DType::f32), dirty_d = Tensor::empty({m, n}, DType::f32);
        fp8_fp4_gemm_nt(qa, qb, clean_d, Tensor(), o);
        fp8_fp4_gemm_nt(qa, {dirty, qb.sf}, dirty_d, Tensor(), o);
        EXPECT_EQ(0, std::memcmp(clean_d.data(), dirty_d.data(), static_cast<size_t>(m * n) * 4))
            << isa_name(isa) << ", k " << k << (ue8m0 ? ", ue8m0" : ", f32 scales");
      }
    }
}

// Partial sums over 1 MiB (here 420 x 704 f32) go to D tile by tile during the last K block
// (gemm.cpp: finish_tiles), C added and rounded as the whole-block write does. Several row
// blocks (420 rows), K blocks (2100: two on AMX, nine on the FMA targets), a partial column
// panel (N = 700), bf16 D with a separate bf16 C and f32 D accumulating in place.
TEST(Gemm, TilesFinishedIntoDMatchOracle) {
  ThreadGuard guard;
  set_num_threads(1);
  check_case_on_every_isa({Layout::nt, Fmt::bf16, Fmt::bf16, 420, 700, 2100, DType::bf16, CMode::separate, false}, 3100);
  check_case_on_every_isa({Layout::nn, Fmt::fp8_token, Fmt::fp8_block, 420, 700, 2100, DType::f32, CMode::in_place, true},
                          3101);
}

// A large-enough problem to take the multi-threaded, multi-block paths (several K blocks,
// row and column blocks; short and long K); results must not depend on the thread count.
// 150 x 16 x 1800 takes the general driver on one thread (150 rows) and the all-K driver on
// two or three (items of at most 78 rows; N = 16 is one panel, so rows are split): the two
// drivers must give the same bits.
TEST(Gemm, BitIdenticalAcrossThreadCounts) {
  ThreadGuard guard;
  // (250 x 100 x 4500: three K blocks of the AMX kernels, which take 2048 at a time.)
  for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{200, 1100, 600}, {230, 300, 1800}, {150, 16, 1800}, {3, 700, 1000},
                         {250, 100, 4500}}) {
    const Tensor xa = random_bf16(m, k, 7), xb = random_bf16(n, k, 8);
    const Quantized qa = per_token_cast_to_fp8(xa, false), qb = per_block_cast_to_fp8(xb, false);
    // Power-of-two scales: the AMX kernels take these (f32 scales run the FMA kernels).
    const Quantized qa2 = per_token_cast_to_fp8(xa, true), qb2 = per_block_cast_to_fp8(xb, true);
    std::vector<std::vector<float>> results;
    for (int threads : {1, 2, 3}) {
      set_num_threads(threads);
      Tensor d = Tensor::empty({m, n}, DType::f32), d8 = Tensor::empty({m, n}, DType::f32);
      Tensor d2 = Tensor::empty({m, n}, DType::f32);
      bf16_gemm_nt(xa, xb, d);
      fp8_gemm_nt(qa, qb, d8);
      fp8_gemm_nt(qa2, qb2, d2);
      std::vector<float> r(static_cast<size_t>(3 * m * n));
      std::memcpy(r.data(), d.data(), static_cast<size_t>(m * n) * 4);
      std::memcpy(r.data() + m * n, d8.data(), static_cast<size_t>(m * n) * 4);
      std::memcpy(r.data() + 2 * m * n, d2.data(), static_cast<size_t>(m * n) * 4);
      results.push_back(r);
    }
    for (size_t i = 1; i < results.size(); ++i)
      EXPECT_EQ(0, std::memcmp(results[0].data(), results[i].data(), results[0].size() * 4)) << "threads #" << i;
    // And once against the oracle.
    const std::vector<double> want = ref::gemm(Layout::nt, {xa, Tensor(), 1, 128}, {xb, Tensor(), 1, 128});
    std::vector<double> got(results[0].begin(), results[0].begin() + m * n);
    EXPECT_LE(ref::calc_diff(got, want), 1e-5);
  }
}

// Small M with enough weights to run on several threads, which claim column chunks as they
// go (core/work_split.h): N = 1001 is no multiple of any chunk, every column must be written
// once (D starts as NaN), and the bits must not depend on the thread count or on which
// thread claimed which chunk (two-thread runs repeated), on every ISA.
TEST(Gemm, SmallMClaimedColumnChunksMatchOracleAndEachOther) {
  ThreadGuard guard;
  const int64_t n = 1001, k = 1152;  // n·k above the small-M path's one-thread limit (1e6)
  const Tensor xb = random_bf16(n, k, 31);
  const Quantized qb = per_block_cast_to_fp8(xb, false);
  for (const int64_t m : {int64_t{1}, int64_t{3}}) {
    SCOPED_TRACE("m=" + std::to_string(m));
    const Tensor xa = random_bf16(m, k, 32 + static_cast<uint64_t>(m));
    const Quantized qa = per_token_cast_to_fp8(xa, false);
    const std::vector<double> want_bf16 = ref::gemm(Layout::nt, {xa, Tensor(), 1, 128}, {xb, Tensor(), 1, 128});
    const std::vector<double> want_fp8 = ref::gemm(Layout::nt, {qa.values, qa.sf, 1, 128}, {qb.values, qb.sf, 128, 128});
    for_each_isa([&](Isa) {
      std::vector<std::vector<float>> results;
      for (int threads : {1, 2, 2, 2, 3}) {
        set_num_threads(threads);
        Tensor d = Tensor::empty({m, n}, DType::f32), d8 = Tensor::empty({m, n}, DType::f32);
        std::fill_n(d.data_ptr<float>(), m * n, std::numeric_limits<float>::quiet_NaN());
        std::fill_n(d8.data_ptr<float>(), m * n, std::numeric_limits<float>::quiet_NaN());
        bf16_gemm_nt(xa, xb, d);
        fp8_gemm_nt(qa, qb, d8);
        EXPECT_LE(ref::calc_diff(ref::to_f64(d), want_bf16), 1e-5) << "bf16, threads=" << threads;
        EXPECT_LE(ref::calc_diff(ref::to_f64(d8), want_fp8), 1e-5) << "fp8, threads=" << threads;
        std::vector<float> r(static_cast<size_t>(2 * m * n));
        std::memcpy(r.data(), d.data(), static_cast<size_t>(m * n) * 4);
        std::memcpy(r.data() + m * n, d8.data(), static_cast<size_t>(m * n) * 4);
        results.push_back(r);
      }
      for (size_t i = 1; i < results.size(); ++i)
        EXPECT_EQ(0, std::memcmp(results[0].data(), results[i].data(), results[0].size() * 4)) << "run #" << i;
    });
  }
}

// formats.md's tolerances against the product of the unquantised inputs.
TEST(Gemm, QuantisedAgainstUnquantisedProduct) {
  const int64_t m = 64, n = 96, k = 512;
  // Plain normal data, as upstream's tests (no extra spread of magnitudes within a group).
  const Tensor xa = random_bf16(m, k, 21, 0), xb = random_bf16(n, k, 22, 0);
  const std::vector<double> exact = ref::gemm(Layout::nt, {xa, Tensor(), 1, 128}, {xb, Tensor(), 1, 128});
  struct Row {
    Fmt a, b;
    double limit;
  };
  for (const Row& r : {Row{Fmt::fp8_token, Fmt::fp8_block, 1e-3}, Row{Fmt::fp8_token, Fmt::fp8_channel, 1e-3},
                       Row{Fmt::fp8_token, Fmt::fp4, 1e-2}, Row{Fmt::fp4, Fmt::fp4, 2e-2}})
    for (bool ue8m0 : {false, true}) {
      SCOPED_TRACE(std::string(fmt_name(r.a)) + " x " + fmt_name(r.b) + (ue8m0 ? " ue8m0" : ""));
      const Built a = build(xa, r.a, true, ue8m0), b = build(xb, r.b, true, ue8m0);
      Tensor d = Tensor::empty({m, n}, DType::f32);
      GemmOptions o;
      o.recipe_a = a.recipe;
      o.recipe_b = b.recipe;
      fp8_fp4_gemm_nt(a.q, b.q, d, Tensor(), o);
      EXPECT_LE(ref::calc_diff(ref::to_f64(d), exact), r.limit);
    }
}

// Default recipes: (1,128,128) for FP8 x FP8, (1,1,32) with an FP4 operand.
TEST(Gemm, DefaultRecipes) {
  const int64_t m = 5, n = 140, k = 256;
  const Tensor xa = random_bf16(m, k, 31), xb = random_bf16(n, k, 32);
  const Quantized qa = per_token_cast_to_fp8(xa, false), qb = per_block_cast_to_fp8(xb, false);
  Tensor d = Tensor::empty({m, n}, DType::f32);
  fp8_gemm_nt(qa, qb, d);
  EXPECT_LE(ref::calc_diff(ref::to_f64(d), ref::gemm(Layout::nt, {qa.values, qa.sf, 1, 128}, {qb.values, qb.sf, 128, 128})), 1e-5);
  const Quantized fa = per_token_cast_to_fp4(xa, true), fb = per_token_cast_to_fp4(xb, true);
  fp8_fp4_gemm_nt(fa, fb, d);
  EXPECT_LE(ref::calc_diff(ref::to_f64(d), ref::gemm(Layout::nt, {fa.values, fa.sf, 1, 32}, {fb.values, fb.sf, 1, 32})), 1e-5);
  // One recipe for both operands.
  const Quantized ca = per_token_cast_to_fp8(xb, false);
  GemmOptions o;
  o.recipe = Recipe{1, 1, 128};
  fp8_gemm_nt(qa, ca, d, Tensor(), o);
  EXPECT_LE(ref::calc_diff(ref::to_f64(d), ref::gemm(Layout::nt, {qa.values, qa.sf, 1, 128}, {ca.values, ca.sf, 1, 128})), 1e-5);
}

// Strided views: operands and outputs that are slices of larger buffers; K = 0; M or N 0.
TEST(Gemm, StridedViewsAndEmptyDims) {
  const Tensor big_a = random_bf16(40, 300, 41), big_b = random_bf16(50, 300, 42);
  const Tensor a = big_a.slice(0, 3, 20).slice(1, 10, 270), b = big_b.slice(0, 1, 34).slice(1, 10, 270);
  Tensor big_d = Tensor::zeros({30, 64}, DType::f32);
  const Tensor d = big_d.slice(0, 2, 19).slice(1, 5, 38);
  bf16_gemm_nt(a, b, d);
  EXPECT_LE(ref::calc_diff(ref::to_f64(d), ref::gemm(Layout::nt, {a, Tensor(), 1, 128}, {b, Tensor(), 1, 128})), 1e-5);
  // Outside the view nothing was written.
  EXPECT_EQ(big_d.data_ptr<float>()[0], 0.0f);
  EXPECT_EQ(big_d.data_ptr<float>()[2 * 64 + 4], 0.0f);
  EXPECT_EQ(big_d.data_ptr<float>()[2 * 64 + 38], 0.0f);
  // Transposed views give the other layouts without copies.
  const Tensor at = a.contiguous().t(), bt = b.contiguous().t();  // [K, M], [K, N] views
  Tensor d2 = Tensor::empty({17, 33}, DType::f32);
  bf16_gemm_tn(at.contiguous(), bt.contiguous(), d2);
  EXPECT_LE(ref::calc_diff(ref::to_f64(d2), ref::to_f64(d)), 1e-12);
  // K = 0: D = C (or zeros).
  const Tensor a0 = Tensor::empty({4, 0}, DType::bf16), b0 = Tensor::empty({6, 0}, DType::bf16);
  Tensor c = Tensor::empty({4, 6}, DType::f32);
  for (int i = 0; i < 24; ++i) c.data_ptr<float>()[i] = static_cast<float>(i);
  Tensor d0 = Tensor::empty({4, 6}, DType::f32);
  bf16_gemm_nt(a0, b0, d0, c);
  EXPECT_EQ(0, std::memcmp(d0.data(), c.data(), 24 * 4));
  bf16_gemm_nt(a0, b0, d0);
  for (int i = 0; i < 24; ++i) EXPECT_EQ(d0.data_ptr<float>()[i], 0.0f);
  // M = 0 or N = 0: nothing to do, no error.
  bf16_gemm_nt(Tensor::empty({0, 8}, DType::bf16), Tensor::empty({3, 8}, DType::bf16), Tensor::empty({0, 3}, DType::f32));
  bf16_gemm_nt(Tensor::empty({2, 8}, DType::bf16), Tensor::empty({0, 8}, DType::bf16), Tensor::empty({2, 0}, DType::f32));
}

// NaN in an FP8 operand (code 0x7f) or a NaN ue8m0 scale (255) poisons exactly the
// outputs that use it.
TEST(Gemm, NaNPropagation) {
  for (int64_t m : {1, 2, 3, 40}) {
  SCOPED_TRACE("m=" + std::to_string(m));
  const int64_t n = 20, k = 256;
  const Tensor xa = random_bf16(m, k, 51), xb = random_bf16(n, k, 52);
  Quantized qa = per_token_cast_to_fp8(xa, false), qb = per_block_cast_to_fp8(xb, false);
  qb.values.data_ptr<uint8_t>()[5 * k + 17] = 0x7f;  // b[5, 17] = NaN
  Tensor d = Tensor::empty({m, n}, DType::f32);
  fp8_gemm_nt(qa, qb, d);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) EXPECT_EQ(std::isnan(d.data_ptr<float>()[i * n + j]), j == 5) << i << "," << j;
  }
}

// NaN results are the canonical quiet NaN (f32 0x7fc00000, bf16 0x7fc0) on every path, so
// every FMA-class ISA gives the same bits: e4m3 codes 0x7f and 0xff in B, an A code 0xff, a
// NaN bf16 activation with a payload and its sign set, and a NaN in C with a payload, at
// M = 1 and 3 (small M), 20 (narrow items; K = 256 with f32 D and no C writes the tiles
// straight into D) and 40, f32 and bf16 D, with and without C. (The portable path had ended
// with -NaN for code 0xff where AVX2 had +NaN, and AVX2 kept an activation's payload.)
// The bf16-pair targets (AVX512_BF16, AMX) where the CPU has them: the same NaN bits, their
// own bits for the finite outputs.
TEST(Gemm, NaNResultsAreTheCanonicalQuietNaNOnEveryIsa) {
  const int64_t n = 20, k = 256;
  auto bits_of = [](const Tensor& d) {
    std::vector<uint32_t> v(static_cast<size_t>(d.numel()));
    for (int64_t i = 0; i < d.numel(); ++i)
      v[static_cast<size_t>(i)] = d.dtype() == DType::f32 ? std::bit_cast<uint32_t>(d.data_ptr<float>()[i]) : d.data_ptr<uint16_t>()[i];
    return v;
  };
  for (const int64_t m : {1, 3, 20, 40})
    for (const bool fp8 : {true, false})
      for (const DType out : {DType::f32, DType::bf16})
        for (const bool with_c : {false, true}) {
          SCOPED_TRACE("m " + std::to_string(m) + (fp8 ? ", fp8" : ", bf16") + ", D " + dtype_name(out) + (with_c ? ", C" : ""));
          Tensor xa = random_bf16(m, k, 61), xb = random_bf16(n, k, 62);
          Quantized qa = per_token_cast_to_fp8(xa, false), qb = per_block_cast_to_fp8(xb, false);
          if (fp8) {
            qa.values.data_ptr<uint8_t>()[0 * k + 9] = 0xff;    // row 0
            qb.values.data_ptr<uint8_t>()[3 * k + 17] = 0xff;   // column 3
            qb.values.data_ptr<uint8_t>()[5 * k + 200] = 0x7f;  // column 5
          } else {  // NaNs with payloads, of either sign
            xa.data_ptr<uint16_t>()[0 * k + 9] = 0xffc5;
            xb.data_ptr<uint16_t>()[3 * k + 17] = 0xff83;
            xb.data_ptr<uint16_t>()[5 * k + 200] = 0x7fc3;
          }
          Tensor c = Tensor::empty({m, n}, out);
          for (int64_t i = 0; i < m * n; ++i) {
            const float v = i == m * n - 1 ? std::bit_cast<float>(0xffa00001u) : 0.5f;  // the last element: C is NaN
            if (out == DType::f32) c.data_ptr<float>()[i] = v;
            else c.data_ptr<uint16_t>()[i] = i == m * n - 1 ? 0xffa1 : f32_to_bf16(v);
          }
          std::vector<uint32_t> first;
          for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512, Isa::avx512_bf16, Isa::amx}) {
            if (!isa_supported(isa)) continue;
            SCOPED_TRACE(isa_name(isa));
            ScopedIsa scoped(isa);
            Tensor d = Tensor::empty({m, n}, out);
            if (fp8) fp8_gemm_nt(qa, qb, d, with_c ? c : Tensor());
            else bf16_gemm_nt(xa, xb, d, with_c ? c : Tensor());
            const std::vector<uint32_t> got = bits_of(d);
            const uint32_t qnan = out == DType::f32 ? 0x7fc00000u : 0x7fc0u;
            for (int64_t i = 0; i < m; ++i)
              for (int64_t j = 0; j < n; ++j) {
                const bool nan = i == 0 || j == 3 || j == 5 || (with_c && i == m - 1 && j == n - 1);
                const uint32_t b = got[static_cast<size_t>(i * n + j)];
                if (nan) EXPECT_EQ(b, qnan) << "element " << i << ", " << j;
                else EXPECT_NE(b & (out == DType::f32 ? 0x7f800000u : 0x7f80u), out == DType::f32 ? 0x7f800000u : 0x7f80u)
                    << "element " << i << ", " << j << " should be finite";
              }
            if (isa > Isa::avx512) continue;  // (the bf16-pair targets: canonical NaNs, their own bits elsewhere)
            if (first.empty()) first = got;
            else EXPECT_EQ(got, first) << "FMA-class paths differ";
          }
        }
}

// ---------------------------------------------------------------- bad input

TEST(Gemm, BadInputRaisesNamedErrors) {
  const Tensor a = random_bf16(4, 64, 1), b = random_bf16(8, 64, 2);
  Tensor d = Tensor::empty({4, 8}, DType::f32);
  EXPECT_MOEKIT_ERROR_ARG(bf16_gemm_nt(Tensor(), b, d), "a");
  EXPECT_MOEKIT_ERROR_ARG(bf16_gemm_nt(Tensor::empty({4, 64}, DType::f32), b, d), "a");
  EXPECT_MOEKIT_ERROR_ARG(bf16_gemm_nt(a, random_bf16(8, 65, 3), d), "b");       // K mismatch
  EXPECT_MOEKIT_ERROR_ARG(bf16_gemm_nt(a, b, Tensor::empty({4, 9}, DType::f32)), "d");
  EXPECT_MOEKIT_ERROR_ARG(bf16_gemm_nt(a, b, Tensor::empty({4, 8}, DType::e4m3)), "d");
  EXPECT_MOEKIT_ERROR_ARG(bf16_gemm_nt(a, b, d, Tensor::empty({4, 8}, DType::bf16)), "c");  // dtype != d
  EXPECT_MOEKIT_ERROR_ARG(bf16_gemm_nt(a, b, d, Tensor::empty({8, 4}, DType::f32)), "c");
  EXPECT_MOEKIT_ERROR_ARG(bf16_gemm_nt(a.t(), b, d), "a");                          // last dim not unit-stride
  EXPECT_MOEKIT_ERROR_ARG(bf16_gemm_nt(a.reshape({4, 8, 8}), b, d), "a");           // rank
  EXPECT_MOEKIT_ERROR_ARG(bf16_gemm_nn(a, b, d), "b");                              // [K, N] expected: K mismatch
  Quantized qa = per_token_cast_to_fp8(a, false), qb = per_block_cast_to_fp8(b, false);
  EXPECT_MOEKIT_ERROR_ARG(fp8_gemm_nt({a, qa.sf}, qb, d), "a.values");
  EXPECT_MOEKIT_ERROR_ARG(fp8_gemm_nt(qa, {qb.values, qa.sf}, d), "b.sf");          // sf shape
  EXPECT_MOEKIT_ERROR_ARG(fp8_gemm_nt({qa.values, Tensor()}, qb, d), "a.sf");
  EXPECT_MOEKIT_ERROR_ARG(fp8_gemm_nt({qa.values, Tensor::empty({4, 1}, DType::bf16)}, qb, d), "a.sf");
  GemmOptions o;
  o.recipe = Recipe{1, 1, 128};  // per-channel sf expected for b: [8, 1]
  EXPECT_MOEKIT_ERROR_ARG(fp8_gemm_nt(qa, qb, d, Tensor(), o), "b.sf");
  o.recipe = Recipe{1, 0, 128};
  EXPECT_MOEKIT_ERROR_ARG(fp8_gemm_nt(qa, qb, d, Tensor(), o), "recipe for b.sf");
  // Packed ue8m0 sf with the f32 shape.
  EXPECT_MOEKIT_ERROR_ARG(fp8_gemm_nt({qa.values, Tensor::zeros({4, 5}, DType::i32)}, qb, d), "a.sf");
}

TEST(Gemm, CompatibilityHelpers) {
  EXPECT_EQ(get_tma_aligned_size(5, 4), 8);
  EXPECT_EQ(get_tma_aligned_size(8, 4), 8);
  EXPECT_EQ(get_tma_aligned_size(17, 1), 32);
  EXPECT_MOEKIT_ERROR_ARG(get_tma_aligned_size(INT64_MAX, 1), "mn");  // (aligning would overflow)
  // Results up to the largest multiple of the alignment in int64 are given (they used to be
  // refused from INT64_MAX - alignment on).
  EXPECT_EQ(get_tma_aligned_size(INT64_MAX, 16), INT64_MAX);           // alignment 1
  EXPECT_EQ(get_tma_aligned_size(INT64_MAX - 15, 1), INT64_MAX - 15);  // 2^63 - 16
  EXPECT_EQ(get_tma_aligned_size(INT64_MAX - 30, 1), INT64_MAX - 15);
  EXPECT_MOEKIT_ERROR_ARG(get_tma_aligned_size(INT64_MAX - 14, 1), "mn");  // 2^63 does not fit
  EXPECT_EQ(get_tma_aligned_size(0, 2), 0);
  EXPECT_MOEKIT_ERROR_ARG(get_tma_aligned_size(5, 3), "element_size");
  const Tensor x = random_bf16(300, 200, 61);
  const Quantized q = per_block_cast_to_fp8(x, false);
  const Tensor view = q.sf.t().contiguous().t();  // same values, column-major
  const Tensor sf = transform_sf_into_required_layout(view, 300, 200, Recipe{1, 128, 128}, std::nullopt, false);
  ASSERT_TRUE(sf.is_contiguous());
  EXPECT_EQ(0, std::memcmp(sf.data(), q.sf.data(), static_cast<size_t>(q.sf.numel()) * 4));
  EXPECT_MOEKIT_ERROR_ARG(transform_sf_into_required_layout(q.sf, 300, 200, Recipe{1, 128, 128}, std::nullopt, true),
                          "sf");  // is_sfa: [300, 2] expected
  const Tensor g = transform_sf_into_required_layout(Tensor::zeros({3, 300, 2}, DType::f32), 300, 200,
                                                     Recipe{1, 128, 128}, 3, true);
  EXPECT_EQ(g.shape(), (Shape{3, 300, 2}));
#ifndef __SANITIZE_ADDRESS__  // (ASan aborts on an allocation it cannot make rather than return null)
  // A stride-0 sf whose contiguous copy (2^48 scales, 1 PiB) cannot be allocated is refused
  // on 'sf' by this function, not by Tensor::empty on 'shape'.
  float one = 1.0f;
  const int64_t side = int64_t{1} << 24;
  const Tensor broadcast = Tensor::from_blob(&one, {side, side}, DType::f32, Device::cpu(), {0, 0});
  try {
    transform_sf_into_required_layout(broadcast, side, side * 128, Recipe{1, 1, 128}, std::nullopt, false);
    ADD_FAILURE() << "no moekit::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.function(), "transform_sf_into_required_layout") << e.what();
    EXPECT_EQ(e.argument(), "sf") << e.what();
  }
#endif
}

// ---------------------------------------------------------------- pre-packed weights

// Packed B must give the unpacked call's bits wherever that one packs B too (M > 4), for
// every format pair, both B layouts, outputs, C modes, scale dtypes, drivers (short and
// long K, narrow and wide items), thread counts and ISA paths; and match the oracle.
TEST(GemmPacked, BitIdenticalToUnpackedCall) {
  ThreadGuard guard;
  uint64_t seed = 9000;
  for (int threads : {1, 2}) {
    set_num_threads(threads);
    for (Layout layout : {Layout::nt, Layout::nn})
      for (const FmtPair& pair : kPairs)
        // (5 x 2100: columns split between threads, K ends in a partial block; 8 x 9000:
        // several column blocks per thread. Under AMX, unpacked calls of up to 32 rows stream
        // B through the tiles while packed ones take the blocked kernel: 20 x 70 x 4500 (three
        // K blocks, both C tile columns, a partial last strip) and 32 x 34 x 2100 must agree;
        // 16 x 200 x 256 and 12 x 130 x 512 decode each strip's one or two chunks while the
        // strip before computes. Unpacked calls of 33 to 256 rows against K-major bf16, FP8 or FP4
        // B swap the tiles' operands (medium_m): 70 x 100 x 4500 has three K blocks and a
        // partial panel of A; 40 x 1060 x 2112 (whole steps: bf16 weight rows loaded where
        // they are; two K blocks) hands the columns out in two blocks of up to 1024 on one
        // thread.)
        for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{5, 40, 300}, {37, 70, 1700}, {230, 40, 1700},
                               {5, 2100, 300}, {8, 9000, 260}, {20, 70, 4500}, {32, 34, 2100}, {16, 200, 256},
                               {12, 130, 512}, {70, 100, 4500}, {40, 1060, 2112}}) {
          Case cs{layout, pair.a, pair.b, m, n, k, (seed & 1) ? DType::bf16 : DType::f32,
                  (seed % 3 == 0) ? CMode::in_place : (seed % 3 == 1) ? CMode::separate : CMode::none, (seed & 2) != 0};
          const std::vector<double> unpacked = run_case(cs, seed).got;
          cs.packed = true;
          const std::vector<double> packed = check_case(cs, seed);  // also against the oracle
          EXPECT_EQ(0, std::memcmp(unpacked.data(), packed.data(), packed.size() * sizeof(double))) << cs.str();
          ++seed;
        }
  }
}

// Promoted tiles run in passes of K over several tiles under AMX (at 33 to 256 rows against
// K-major weights, medium_m, at least a chunk of K; on the blocked path, which packed weights
// take, 512), each K group's sums promoted during the next group's steps, which may be
// another tile's: promotion groups of 1, 4, 16 and 32 steps (the last two longer than
// medium_m's pass, the last longer than the blocked path's), scales on the weights, on A or
// on both, K with two blocks and a partial chunk, a partial strip of weights and a partial
// panel of A; and 200 x 1500 x 1100 with bf16 D, whose blocked tiles go to D as they finish
// (a partial-sum block over 1 MiB), each once the next tile has run. The unpacked call must give the packed
// (blocked) call's bits, and the oracle's values; and the first 16 rows of D must be the
// bits of a 16-row call, which takes neither pipe under AMX (the streaming path promotes
// each group of a strip in turn).
TEST(GemmPacked, PromotedMediumRowsSameBitsAsPacked) {
  ThreadGuard guard;
  uint64_t seed = 9400;
  for (int threads : {1, 2}) {
    set_num_threads(threads);
    for (const int64_t gran_k : {32, 128, 512, 1024})
      for (const int scaled : {0, 1, 2})  // 0: both operands' scales promoted; 1: A's only; 2: the weights' only
        for (const auto& [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{40, 100, 2600}, {130, 100, 2600}, {200, 1500, 1100}}) {
          if (n == 1500 && (gran_k != 128 || scaled != 0)) continue;
          SCOPED_TRACE("threads " + std::to_string(threads) + ", gran_k " + std::to_string(gran_k) + ", scaled " +
                       std::to_string(scaled) + ", " + std::to_string(m) + " x " + std::to_string(n) + " x " + std::to_string(k));
          Quantized qa = per_token_cast_to_fp8(random_bf16(m, k, seed++), false, gran_k);
          Quantized qb = per_token_cast_to_fp8(random_bf16(n, k, seed++), false, gran_k);
          // (Scales of 1 are exact: that operand's scales fold, and only the other's are promoted.)
          if (scaled == 2) std::fill_n(qa.sf.data_ptr<float>(), qa.sf.numel(), 1.0f);
          if (scaled == 1) std::fill_n(qb.sf.data_ptr<float>(), qb.sf.numel(), 1.0f);
          GemmOptions o;
          o.recipe = Recipe{1, 1, gran_k};
          // (bf16 D for the large case: the blocked path writes f32 D of one K block straight from the tiles.)
          const DType d_dtype = n == 1500 ? DType::bf16 : DType::f32;
          Tensor unpacked = Tensor::empty({m, n}, d_dtype), packed = Tensor::empty({m, n}, d_dtype);
          fp8_fp4_gemm_nt(qa, qb, unpacked, Tensor(), o);
          fp8_fp4_gemm_packed(qa, pack_fp8_fp4_weights(qb, true, o), packed, Tensor(), o);
          EXPECT_EQ(0, std::memcmp(unpacked.data(), packed.data(), static_cast<size_t>(m * n) * element_size(d_dtype)));
          const Quantized first_rows{qa.values.slice(0, 0, 16), qa.sf.slice(0, 0, 16)};
          Tensor few = Tensor::empty({16, n}, d_dtype);
          fp8_fp4_gemm_nt(first_rows, qb, few, Tensor(), o);
          EXPECT_EQ(0, std::memcmp(few.data(), unpacked.data(), static_cast<size_t>(16 * n) * element_size(d_dtype))) << "16 rows";
          const std::vector<double> want = ref::gemm(Layout::nt, {qa.values, qa.sf, 1, gran_k}, {qb.values, qb.sf, 1, gran_k});
          EXPECT_LE(ref::calc_diff(ref::to_f64(unpacked), want), 1e-5);
        }
  }
}

// Weights packed under one ISA keep working (with that ISA's kernels) after the active ISA
// changes; every ISA's packing gives the same results.
TEST(GemmPacked, PackedUnderEveryIsa) {
  const Tensor xa = random_bf16(40, 300, 71), xb = random_bf16(50, 300, 72);
  const Quantized qa = per_token_cast_to_fp8(xa, false), qb = per_block_cast_to_fp8(xb, false);
  // The unpacked call's bits under the packing ISA (the FMA paths all give the same).
  auto unpacked_under = [&](Isa isa) {
    ScopedIsa scoped(isa);
    Tensor want = Tensor::empty({40, 50}, DType::f32);
    fp8_gemm_nt(qa, qb, want);
    return want;
  };
  const std::vector<Isa> isas = moekit::testing::gemm_isas();
  for (Isa isa : isas) {
    SCOPED_TRACE(std::string("packed under ") + isa_name(isa));
    const Tensor want = unpacked_under(isa);
    ScopedIsa pack_under(isa);
    const PackedWeights w = pack_fp8_fp4_weights(qb);
    EXPECT_EQ(w.isa(), isa);
    EXPECT_EQ(w.n(), 50);
    EXPECT_EQ(w.k(), 300);
    EXPECT_EQ(w.source_dtype(), DType::e4m3);
    EXPECT_GE(w.bytes(), 50 * 300 * (isa == Isa::amx || isa == Isa::avx512_bf16 ? 2 : 4));
    for (Isa other : isas) {
      ScopedIsa run_under(other);
      Tensor d = Tensor::empty({40, 50}, DType::f32);
      fp8_fp4_gemm_packed(qa, w, d);
      EXPECT_EQ(0, std::memcmp(want.data(), d.data(), 40 * 50 * 4)) << "run under " << isa_name(other);
    }
  }
}

// M <= 4 (where the unpacked call streams B instead) and edge extents, against the oracle.
TEST(GemmPacked, SmallMAndEdgeShapesMatchOracle) {
  uint64_t seed = 9500;
  for (int64_t m : {1, 2, 4})
    for (const FmtPair& pair : kPairs) check_case_on_every_isa({Layout::nt, pair.a, pair.b, m, 33, 260, DType::bf16, CMode::separate, false, true}, seed++);
  check_case_on_every_isa({Layout::nt, Fmt::bf16, Fmt::bf16, 7, 1, 1, DType::f32, CMode::none, false, true}, seed++);
  check_case_on_every_isa({Layout::nn, Fmt::fp8_token, Fmt::fp8_block, 9, 17, 129, DType::f32, CMode::in_place, true, true}, seed++);
  // K = 0: D = C (or zeros); N = 0: nothing to do.
  const PackedWeights w0 = pack_bf16_weights(Tensor::empty({8, 0}, DType::bf16));
  Tensor d = Tensor::empty({3, 8}, DType::f32);
  std::fill(d.data_ptr<float>(), d.data_ptr<float>() + 24, 5.0f);
  bf16_gemm_packed(Tensor::empty({3, 0}, DType::bf16), w0, d);
  for (int64_t i = 0; i < 24; ++i) EXPECT_EQ(d.data_ptr<float>()[i], 0.0f);
  const PackedWeights wn = pack_bf16_weights(Tensor::empty({0, 16}, DType::bf16));
  bf16_gemm_packed(random_bf16(3, 16, 1), wn, Tensor::empty({3, 0}, DType::f32));
}

// Either packed call takes weights packed by either function: bf16 activations against
// packed FP8 weights is D = A · dequant(B)ᵀ.
TEST(GemmPacked, Bf16ActivationsWithPackedFp8Weights) {
  const Tensor xa = random_bf16(20, 384, 81), xb = random_bf16(48, 384, 82);
  const Quantized qb = per_block_cast_to_fp8(xb, false);
  Tensor d = Tensor::empty({20, 48}, DType::f32);
  bf16_gemm_packed(xa, pack_fp8_fp4_weights(qb), d);
  const std::vector<double> want = ref::gemm(Layout::nt, {xa, Tensor(), 1, 128}, {qb.values, qb.sf, 128, 128});
  EXPECT_LE(ref::calc_diff(ref::to_f64(d), want), 1e-6);
}

// ---------------------------------------------------------------- the AMX path

// The bf16-pair targets of this CPU (their own accuracy class: avx512_bf16, amx).
std::vector<Isa> bf16_pair_isas() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::avx512_bf16, Isa::amx})
    if (isa_supported(isa)) out.push_back(isa);
  return out;
}

// The streaming small-M paths of the bf16-pair targets (AMX tiles; on avx512_bf16 vdpbf16ps,
// stream_dp.inc) against packed weights, which take the blocked path, on each target: 5 to
// 32 rows of A (on avx512_bf16 256-bit, 512-bit and 512 + 256-bit lanes; 25 to 32 rows only
// FP4 weights stream there), short and long K (from K = 1024 bf16 weight rows are read in
// place, 8 a call: 7, 16 and 22 rows), and 9000 columns, so that each of two threads
// streams several column chunks with A prepared once for all of them.
TEST(GemmBf16Pairs, StreamedSmallMSameBitsAsPackedWeights) {
  if (bf16_pair_isas().empty()) GTEST_SKIP() << "no AVX512_BF16 or AMX-BF16 on this CPU";
  ThreadGuard guard;
  set_num_threads(2);
  uint64_t seed = 9800;
  for (const Isa pair_isa : bf16_pair_isas()) {
    ScopedIsa scoped(pair_isa);
    for (const FmtPair& pair : kPairs)
      for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{5, 9000, 260}, {12, 130, 800}, {20, 9000, 260},
                             {24, 70, 800}, {28, 70, 800}, {32, 9000, 260}, {7, 70, 1100}, {16, 70, 2048},
                             {22, 40, 1536}}) {
        Case cs{Layout::nt, pair.a, pair.b, m, n, k, (seed & 1) ? DType::bf16 : DType::f32,
                (seed % 3 == 0) ? CMode::in_place : (seed % 3 == 1) ? CMode::separate : CMode::none, (seed & 2) != 0};
        const std::vector<double> unpacked = run_case(cs, seed).got;
        cs.packed = true;
        const std::vector<double> packed = check_case(cs, seed);  // also against the oracle
        EXPECT_EQ(0, std::memcmp(unpacked.data(), packed.data(), packed.size() * sizeof(double)))
            << cs.str() << " on " << isa_name(pair_isa);
        ++seed;
      }
  }
}

// A stored [K, M] (tt) streams as well (A is packed from either layout): the same bits as
// the nt call on the same values stored [M, K], at each lane count of the vdpbf16ps path.
TEST(GemmBf16Pairs, StreamedSmallMEitherLayoutOfA) {
  if (bf16_pair_isas().empty()) GTEST_SKIP() << "no AVX512_BF16 or AMX-BF16 on this CPU";
  uint64_t seed = 9900;
  for (const Isa pair_isa : bf16_pair_isas()) {
    ScopedIsa scoped(pair_isa);
    for (const FmtPair& pair : kPairs)
      for (const int64_t m : {5, 16, 24, 28}) {
        Case nt{Layout::nt, pair.a, pair.b, m, 70, 800, DType::f32, CMode::none, (seed & 1) != 0};
        Case tt = nt;
        tt.layout = Layout::tt;
        const std::vector<double> want = run_case(nt, seed).got, got = run_case(tt, seed).got;
        EXPECT_EQ(0, std::memcmp(want.data(), got.data(), got.size() * sizeof(double))) << tt.str() << " on " << isa_name(pair_isa);
        ++seed;
      }
  }
}

// What the bf16-pair kernels (AMX tiles, vdpbf16ps) take and leave. FP8 with f32 scales
// runs there with the scales promoted per K group; scale groups that are not 32 · 2^j (here
// 96) run the avx512 kernels and give their bits; bf16 weights packed for these kernels take
// FP8 activations of either kind but refuse ones whose groups they cannot promote, naming
// `a`. (Every check_case_on_every_isa case holds their results to the oracle.)
TEST(GemmBf16Pairs, TakesWhatItCanPromoteAndLeavesTheRestToAvx512) {
  if (bf16_pair_isas().empty()) GTEST_SKIP() << "no AVX512_BF16 or AMX-BF16 on this CPU";
  for (const Isa pair_isa : bf16_pair_isas()) {
    SCOPED_TRACE(isa_name(pair_isa));
    const Tensor xa = random_bf16(70, 300, 61), xb = random_bf16(50, 300, 62);
    const Quantized qa96 = per_token_cast_to_fp8(xa, false, 96), qb96 = per_token_cast_to_fp8(xb, false, 96);
    GemmOptions o96;
    o96.recipe = Recipe{1, 1, 96};
    Tensor on_pairs = Tensor::empty({70, 50}, DType::f32), on_avx512 = Tensor::empty({70, 50}, DType::f32);
    {
      ScopedIsa scoped(pair_isa);
      fp8_gemm_nt(qa96, qb96, on_pairs, Tensor(), o96);
    }
    {
      ScopedIsa avx512(Isa::avx512);
      fp8_gemm_nt(qa96, qb96, on_avx512, Tensor(), o96);
    }
    EXPECT_EQ(0, std::memcmp(on_pairs.data(), on_avx512.data(), 70 * 50 * 4));
    ScopedIsa scoped(pair_isa);
    const PackedWeights w = pack_bf16_weights(xb);
    EXPECT_EQ(w.isa(), pair_isa);
    Tensor d = Tensor::empty({70, 50}, DType::f32);
    EXPECT_MOEKIT_ERROR_ARG(fp8_fp4_gemm_packed(qa96, w, d, Tensor(), o96), "a");
    for (bool ue8m0 : {false, true}) {
      const Quantized qa = per_token_cast_to_fp8(xa, ue8m0);
      fp8_fp4_gemm_packed(qa, w, d);
      const std::vector<double> want = ref::gemm(Layout::nt, {qa.values, qa.sf, 1, 128}, {xb, Tensor(), 1, 128});
      EXPECT_LE(ref::calc_diff(ref::to_f64(d), want), 1e-5) << "ue8m0 " << ue8m0;
    }
    EXPECT_EQ(pack_fp8_fp4_weights(per_block_cast_to_fp8(xb, false)).isa(), pair_isa);
    EXPECT_EQ(pack_fp8_fp4_weights(qb96, true, o96).isa(), Isa::avx512);
  }
}

// Whether a call folds the weights' scales or promotes them is decided from every scale of
// the call (AMX: rows of scales stored back to back are checked as one run, split between
// the threads past 65536 scales), and the two give different bits on some targets. FP4
// weights of 2100 x 1024 with 1 x 32 scales (67200 of them), every scale a power of two but
// one, placed in the first or the last part of the run or at the parts' border, f32 or packed ue8m0: the 100 columns
// of D whose weight rows hold that scale (the last 100 where there is none) must have the
// bits of a call on those 100 weight rows alone (3200 scales, one part, the same decision),
// and D the oracle's values. On each bf16-pair target (AMX's own bits agree either way on
// these weights; avx512_bf16's do not), else on the active one.
TEST(GemmBf16Pairs, ScaleCheckSeesEveryScale) {
  ThreadGuard guard;
  set_num_threads(2);
  std::vector<Isa> isas = bf16_pair_isas();
  if (isas.empty()) isas.push_back(active_isa());
  for (const Isa isa : isas) {
  ScopedIsa scoped(isa);
  SCOPED_TRACE(isa_name(isa));
  const int64_t m = 16, n = 2100, k = 1024, gran = 32, groups = k / gran, part = 100;
  const Quantized qa = per_token_cast_to_fp8(random_bf16(m, k, 61), true, gran);
  for (const bool packed : {false, true})
    // (-1: every scale a power of two; 65535 and 65536: the last of the first part and the
    // first of the second)
    for (const int64_t odd : {int64_t{-1}, int64_t{5}, int64_t{65535}, int64_t{65536}, n * groups - 1}) {
      SCOPED_TRACE(std::string(packed ? "packed ue8m0" : "f32") + " scales, odd scale at " + std::to_string(odd));
      Quantized qb = per_token_cast_to_fp4(random_bf16(n, k, 62), true, gran);
      // A scale that does not fold: 1.5 x a power of two, or, packed, the exponent byte 0 (2^-127).
      if (odd >= 0) qb.sf.data_ptr<float>()[odd] = packed ? 0x1p-127f : 1.5f * qb.sf.data_ptr<float>()[odd];
      const Tensor sf = packed ? pack_ue8m0_to_int(qb.sf) : qb.sf;
      const int64_t j0 = odd == 5 ? 0 : n - part;  // the weight rows compared
      const Quantized rows{qb.values.slice(0, j0, j0 + part), sf.slice(0, j0, j0 + part)};
      GemmOptions o;
      o.recipe = Recipe{1, 1, gran};
      Tensor d = Tensor::empty({m, n}, DType::f32), d_rows = Tensor::empty({m, part}, DType::f32);
      fp8_fp4_gemm_nt(qa, {qb.values, sf}, d, Tensor(), o);
      fp8_fp4_gemm_nt(qa, rows, d_rows, Tensor(), o);
      for (int64_t i = 0; i < m; ++i)
        EXPECT_EQ(0, std::memcmp(d.data_ptr<float>() + i * n + j0, d_rows.data_ptr<float>() + i * part, part * 4))
            << "row " << i;
      const std::vector<double> want = ref::gemm(Layout::nt, {qa.values, qa.sf, 1, gran}, {qb.values, qb.sf, 1, gran});
      EXPECT_LE(ref::calc_diff(ref::to_f64(d), want), 1e-5);
    }
  }
}

// Up to 32 rows of A stream B through the tiles (B decoded a chunk of up to 32 rows x 256 K
// at a time). FP4 and FP8 weights with power-of-two scales are folded there by adding the
// scale's exponent to the code's bf16 bits, which the streaming decoders do only for
// exponents from 2^-100 to 2^120 (FP4) or 2^119 (FP8: 448 · 2^119 is the largest finite
// product); a chunk with any other scale is decoded the general way. Scales at and around
// both edges, in some chunks only, and a negative scale, must give the blocked path's bits
// (packed weights), and
// the oracle's values where the weights stay finite; K = 800 ends in a partial chunk, N = 70
// in a partial strip. Past the edges (2^126: an exponent add would turn inf into NaN), and
// with NaN codes among the FP8 weights, only the bits are compared.
// On avx512_bf16 the same decoders feed vdpbf16ps (stream_dp.inc: 5 to 24 rows of A, and up
// to 32 against FP4 weights; 256-bit products up to 8 rows), and must give that target's
// blocked bits likewise.
TEST(GemmBf16Pairs, StreamedWeightsScalesAtTheFoldingEdges) {
  if (bf16_pair_isas().empty()) GTEST_SKIP() << "no AVX512_BF16 or AMX-BF16 on this CPU";
  for (const Isa pair_isa : bf16_pair_isas()) {
  ScopedIsa scoped(pair_isa);
  SCOPED_TRACE(isa_name(pair_isa));
  const int64_t n = 70, k = 800;
  // Positive operands: weights scaled past the finite range are +inf, and every product and
  // sum with them is +inf, so a NaN where the blocked path has inf shows in the bits.
  auto positive = [](Tensor t) {
    for (uint16_t* p = t.data_ptr<uint16_t>(); p < t.data_ptr<uint16_t>() + t.numel(); ++p) *p &= 0x7fff;
    return t;
  };
  struct Config {
    bool fp4;
    int64_t gran;
    int fast_hi, over, largest;  // the fast path's largest exponent, one past it (or not), any
  };
  int oracle_checks = 0;
  // (One row of A: FP4 weights stream through the tiles too; FP8 ones take dot products.
  // 40 rows: the medium-M kernel, whose weight rows take the same decoders. avx512_bf16: 5
  // and 8 rows 256-bit products, 16 rows 512-bit ones, 20 rows 512 + 256-bit ones.)
  for (const int64_t m : {8, 1, 40, 5, 16, 20})
    for (const Config cf : {Config{true, 32, 120, 121, 124}, Config{true, 32, 120, 121, 126}, Config{false, 32, 119, 119, 119},
                            Config{false, 128, 119, 120, 120}, Config{false, 128, 119, 120, 126}}) {
      // (avx512_bf16 gives one row the dot path's own order: GemmBf16Pairs.FewRows*.)
      if (m == 1 && (!cf.fp4 || pair_isa == Isa::avx512_bf16)) continue;
      SCOPED_TRACE(std::string(cf.fp4 ? "fp4" : "fp8") + ", gran " + std::to_string(cf.gran) + ", largest scale 2^" +
                   std::to_string(cf.largest) + ", m " + std::to_string(m));
      const int64_t gran = cf.gran, groups = (k + gran - 1) / gran;
      const Quantized qa = per_token_cast_to_fp8(positive(random_bf16(m, k, 81)), true, gran);
      for (float* s = qa.sf.data_ptr<float>(); s < qa.sf.data_ptr<float>() + m * groups; ++s) *s = std::ldexp(*s, -60);
      const Tensor xb = positive(random_bf16(n, k, 82));
      Quantized qb = cf.fp4 ? per_token_cast_to_fp4(xb, true, gran) : per_token_cast_to_fp8(xb, true, gran);
      const int exponents[] = {-100, -99, 0, 7, cf.fast_hi - 1, cf.fast_hi, cf.over, cf.largest};
      float* sf = qb.sf.data_ptr<float>();
      const int64_t per_chunk = 256 / gran;
      for (int64_t r = 0; r < n; ++r)
        for (int64_t g = 0; g < groups; ++g) {
          // Chunks 0 and 2 keep exponents within the fast range; chunk 1 and the partial chunk
          // 3 take any of them, in some rows only.
          const bool any = (g / per_chunk == 1 || g / per_chunk == 3) && r % 3 == 0;
          sf[r * groups + g] = std::ldexp(1.0f, exponents[(r + 3 * g) % (any ? 8 : 6)]);
        }
      // A negative power of two: folded, but not by an exponent add. (Row 4 keeps unit scales
      // elsewhere, so that its first group's sign shows in its sums.)
      for (int64_t g = 0; g < groups; ++g) sf[4 * groups + g] = g == 0 ? -1.0f : 1.0f;
      if (!cf.fp4 && cf.largest == 126) {
        // NaN codes of either sign and a negative zero in a fast chunk, in both halves of a
        // 64-code block.
        uint8_t* codes = qb.values.data_ptr<uint8_t>();
        for (const int64_t at : {int64_t{10}, int64_t{40}}) {
          const int64_t row = at == 10 ? 5 : 8;  // (other rows: one NaN per dot product)
          codes[row * k + at] = 0x7f, codes[(row + 1) * k + at + 1] = 0xff, codes[(row + 2) * k + at + 2] = 0x80;
        }
      }
      GemmOptions o;
      o.recipe = Recipe{1, 1, gran};
      Tensor streamed = Tensor::empty({m, n}, DType::f32), blocked = Tensor::empty({m, n}, DType::f32);
      fp8_fp4_gemm_nt(qa, qb, streamed, Tensor(), o);
      fp8_fp4_gemm_packed(qa, pack_fp8_fp4_weights(qb, true, o), blocked, Tensor(), o);
      EXPECT_EQ(0, std::memcmp(streamed.data(), blocked.data(), m * n * 4));
      const float* got = streamed.data_ptr<float>();
      if (!std::all_of(got, got + m * n, [](float v) { return std::isfinite(v); })) continue;
      ++oracle_checks;
      const std::vector<double> want = ref::gemm(Layout::nt, {qa.values, qa.sf, 1, gran}, {qb.values, qb.sf, 1, gran});
      EXPECT_LE(ref::calc_diff(ref::to_f64(streamed), want), 1e-5);
    }
  EXPECT_GE(oracle_checks, 3);  // FP4 up to 2^124 (m 8 and 1) and FP8 up to 2^119 stay finite
  }
}

// 33 to 256 rows of A against K-major weights swap the tiles' operands (medium_m): weight
// rows are read a chunk at a time (in place, or decoded with their scales folded) where
// neither operand is promoted, and packed with their scales for the promoted tiles
// otherwise. Activations with f32 scales (promoted) against weights with power-of-two
// scales (folded), and the reverse, must give the blocked path's bits (packed weights) and
// the oracle's values.
TEST(GemmAmx, MediumMOneOperandPromoted) {
  if (!isa_supported(Isa::amx)) GTEST_SKIP() << "no AMX-BF16 (or not granted) on this CPU";
  ScopedIsa amx(Isa::amx);
  const int64_t m = 70, n = 100, k = 600;
  const Tensor xa = random_bf16(m, k, 91), xb = random_bf16(n, k, 92);
  for (const bool a_folds : {false, true}) {
    SCOPED_TRACE(a_folds ? "weights promoted" : "activations promoted");
    const Quantized qa = per_token_cast_to_fp8(xa, a_folds), qb = per_block_cast_to_fp8(xb, !a_folds);
    Tensor unpacked = Tensor::empty({m, n}, DType::f32), packed = Tensor::empty({m, n}, DType::f32);
    fp8_gemm_nt(qa, qb, unpacked);
    fp8_fp4_gemm_packed(qa, pack_fp8_fp4_weights(qb), packed);
    EXPECT_EQ(0, std::memcmp(unpacked.data(), packed.data(), m * n * 4));
    const std::vector<double> want = ref::gemm(Layout::nt, {qa.values, qa.sf, 1, 128}, {qb.values, qb.sf, 128, 128});
    EXPECT_LE(ref::calc_diff(ref::to_f64(unpacked), want), 1e-5);
  }
}

// The blocked path's tiles run in passes of 512 K on AMX (gemm.cpp: sweep_in_passes), their
// sums leaving the tiles between passes; the bits must be those of whole tiles, which the
// streaming (up to 32 rows) and medium-M (33 to 256) paths keep: the first rows of a 300-row
// call (blocked) against 32- and 100-row calls, bf16 D (f32 D without C would take
// sweep_into_d's whole tiles), on one and two threads. K = 1500 and 2000: one K block with a
// partial last pass; 2600: a second block of 552 (its last pass 40 deep, mid-step). N = 200
// ends mid-panel; with N = 1000 one thread's partial sums (300 x 1024 f32) pass 1 MiB, so
// the last K block finishes its tiles into D after the final pass: from a scratch column
// (K = 2000) or from the sums (2600). bf16 and FP8 with folded (ue8m0) scales; the N = 200
// cases also against the oracle.
TEST(GemmAmx, BlockedPassesSameBitsAsFewerRows) {
  if (!isa_supported(Isa::amx)) GTEST_SKIP() << "no AMX-BF16 (or not granted) on this CPU";
  ScopedIsa amx(Isa::amx);
  ThreadGuard guard;
  uint64_t seed = 9400;
  for (const auto& [k, n] : {std::pair<int64_t, int64_t>{1500, 200}, {2600, 200}, {2000, 1000}, {2600, 1000}})
    for (const bool fp8 : {false, true}) {
      SCOPED_TRACE("k " + std::to_string(k) + ", n " + std::to_string(n) + (fp8 ? ", fp8 ue8m0" : ", bf16"));
      const Tensor xa = random_bf16(300, k, seed++), xb = random_bf16(n, k, seed++);
      const Quantized qa = per_token_cast_to_fp8(xa, true), qb = per_block_cast_to_fp8(xb, true);
      auto rows = [&](int64_t m) {  // D for the first m rows of A, the same on one and two threads
        Tensor d[2] = {Tensor::empty({m, n}, DType::bf16), Tensor::empty({m, n}, DType::bf16)};
        for (int threads : {1, 2}) {
          set_num_threads(threads);
          if (fp8) fp8_gemm_nt(Quantized{qa.values.slice(0, 0, m), qa.sf.slice(0, 0, m)}, qb, d[threads - 1]);
          else bf16_gemm_nt(xa.slice(0, 0, m), xb, d[threads - 1]);
        }
        EXPECT_EQ(0, std::memcmp(d[0].data(), d[1].data(), static_cast<size_t>(m * n) * 2)) << m << " rows, 1 vs 2 threads";
        return d[0];
      };
      const Tensor all = rows(300);
      for (const int64_t m : {32, 100})
        EXPECT_EQ(0, std::memcmp(all.data(), rows(m).data(), static_cast<size_t>(m * n) * 2)) << m << " rows";
      if (n > 200) continue;
      const std::vector<double> want = fp8 ? ref::gemm(Layout::nt, {qa.values, qa.sf, 1, 128}, {qb.values, qb.sf, 128, 128})
                                           : ref::gemm(Layout::nt, {xa, Tensor(), 1, 128}, {xb, Tensor(), 1, 128});
      EXPECT_LE(ref::calc_diff(ref::to_f64(all), want), 1e-5);
    }
}

// bf16 D of 32 MiB or more is written with streaming stores (gemm.cpp: kStreamDBytes), its
// slices of fewer rows (4 MiB) with ordinary ones: 4096 x 4160 x 64 (33 MiB of D) must give
// the bits of its first and last 512 rows computed alone, on every vector ISA (AVX-512
// ones stream: AMX through write_block's bands, the others through finished tiles) and on
// one and two threads.
TEST(Gemm, StreamedBf16OutputSameBitsAsSmallerCalls) {
  ThreadGuard guard;
  const int64_t m = 4096, n = 4160, k = 64, part = 512;
  const Tensor a = random_bf16(m, k, 9501), b = random_bf16(n, k, 9502);
  for (const Isa isa : moekit::testing::gemm_isas()) {
    if (isa == Isa::scalar) continue;  // (4096 x 4160 x 64 is slow there; the converter's test covers it)
    ScopedIsa scoped(isa);
    for (int threads : {1, 2}) {
      SCOPED_TRACE(std::string(isa_name(isa)) + ", " + std::to_string(threads) + " threads");
      set_num_threads(threads);
      Tensor big = Tensor::empty({m, n}, DType::bf16);
      bf16_gemm_nt(a, b, big);
      Tensor wide = Tensor::empty({part, n + 3}, DType::bf16);
      for (const int64_t first : {int64_t{0}, m - part}) {
        Tensor d = wide.slice(1, 3, n + 3);
        bf16_gemm_nt(a.slice(0, first, first + part), b, d);
        const auto* got = static_cast<const uint16_t*>(d.data());
        const auto* want = static_cast<const uint16_t*>(big.data()) + first * n;
        int64_t mismatches = 0;
        for (int64_t i = 0; i < part; ++i)
          mismatches += std::memcmp(got + i * (n + 3), want + i * n, static_cast<size_t>(n) * 2) != 0;
        EXPECT_EQ(mismatches, 0) << "rows from " << first;
      }
    }
  }
}

// Streamed e4m3 weights take two decoders: rows of normal codes a bit rearrangement
// (GFNI, where the CPU has it), rows holding a zero, subnormal or NaN code the tables. Every
// one of the 256 codes, in rows of each kind, raw (f32 scales, promoted) and with folded
// ue8m0 scales (128 x 128 blocks, and 1 x 32 groups: a shift per 32 codes), must give the
// blocked path's bits (packed weights) and, with the NaN codes left out, the oracle's
// values; 8 and 20 rows of A take the two tile shapes, 40 the medium-M kernel (weight rows
// decoded by the same row decoders). A NaN code in a row of normal codes
// sends that row to the tables too.
// On avx512_bf16, 8, 16, 20 and 24 rows of A take the vdpbf16ps streaming path (256- and
// 512-bit products, 512 + 256 bits for 17 to 24 rows), 40 the blocked one.
TEST(GemmBf16Pairs, StreamedE4m3WeightsEveryCode) {
  if (bf16_pair_isas().empty()) GTEST_SKIP() << "no AVX512_BF16 or AMX-BF16 on this CPU";
  for (const Isa pair_isa : bf16_pair_isas()) {
  ScopedIsa scoped(pair_isa);
  SCOPED_TRACE(isa_name(pair_isa));
  const int64_t n = 64, k = 512;
  struct Config {
    bool ue8m0;
    int64_t gran_mn, gran_k;
  };
  for (const bool with_nan : {false, true})
    for (const Config cf : {Config{false, 128, 128}, Config{true, 128, 128}, Config{true, 1, 32}, Config{false, 1, 32}})
      for (const int64_t m : {8, 20, 40, 16, 24}) {
        SCOPED_TRACE(std::string(cf.ue8m0 ? "ue8m0" : "f32") + " scales, gran " + std::to_string(cf.gran_mn) + " x " +
                     std::to_string(cf.gran_k) + ", m " + std::to_string(m) + (with_nan ? ", NaN codes" : ""));
        const Quantized qa = per_token_cast_to_fp8(random_bf16(m, k, 91), cf.ue8m0, cf.gran_k);
        const Tensor xb = random_bf16(n, k, 92);
        Quantized qb = cf.gran_mn == 1 ? per_token_cast_to_fp8(xb, cf.ue8m0, cf.gran_k) : per_block_cast_to_fp8(xb, cf.ue8m0);
        uint8_t* codes = qb.values.data_ptr<uint8_t>();
        std::mt19937 gen(93);
        for (int64_t r = 0; r < n; ++r)
          for (int64_t j = 0; j < k; ++j) {
            uint8_t c = static_cast<uint8_t>((j * 37 + r * 11) % 256);
            if (r % 2 == 1) {  // odd rows: normal codes only (exponent field 1..15, not NaN)
              do c = static_cast<uint8_t>(gen()); while ((c & 0x78) == 0 || (c & 0x7f) == 0x7f);
            } else if ((c & 0x7f) == 0x7f) {
              c = with_nan && r == 0 ? c : c ^ 1;  // NaN codes in row 0 only; else the largest finite
            }
            codes[r * k + j] = c;
          }
        if (with_nan) codes[1 * k + 300] = 0xff;  // one NaN among normal codes
        GemmOptions o;
        o.recipe = Recipe{1, cf.gran_mn, cf.gran_k};
        Tensor streamed = Tensor::empty({m, n}, DType::f32), blocked = Tensor::empty({m, n}, DType::f32);
        fp8_fp4_gemm_nt(qa, qb, streamed, Tensor(), o);
        fp8_fp4_gemm_packed(qa, pack_fp8_fp4_weights(qb, true, o), blocked, Tensor(), o);
        EXPECT_EQ(0, std::memcmp(streamed.data(), blocked.data(), m * n * 4));
        const float* got = streamed.data_ptr<float>();
        if (with_nan) {
          for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < 4; ++j) EXPECT_EQ(std::isnan(got[i * n + j]), j < 2) << "row " << i << ", column " << j;
          continue;
        }
        const std::vector<double> want =
            ref::gemm(Layout::nt, {qa.values, qa.sf, 1, cf.gran_k}, {qb.values, qb.sf, cf.gran_mn, cf.gran_k});
        EXPECT_LE(ref::calc_diff(ref::to_f64(streamed), want), 1e-5);
      }
  }
}

// One to four rows of A against e4m3 weights take bf16 dot products with the weights decoded
// in registers (one or two rows on amx, whose tiles take more; up to four on avx512_bf16;
// the path's own order). Against the oracle: every code in rows of each decoder's kind (as
// above: for one and two rows of A, whole blocks are decoded by the bit rearrangement and a
// (row, group) holding a special code is done again by the tables); a row of subnormals
// alone, with no zero among them, a row of zeros of both signs among normal codes (a zero
// read as a normal code is 2^-7), and a row of the least normal code with one largest
// subnormal, checked element by element, since next to larger codes they are too small to
// show; K with a partial last 64-code block and partial last scale group; N ending mid-pass
// (8, 4, 5 or 4 weight rows per pass for 1 to 4 rows of A); f32 and ue8m0 scales in 128 x
// 128 blocks and 1 x 32 groups (two groups per block). The same bits on one and two threads (1100 x 1000 weights are enough
// for two), and a NaN code poisons its own column only, in the last block (probed where
// partial) and in the first (whole: marked for one and two rows of A).
// An f32 D of `shape` from `call` on one thread, checked bit for bit against the same call
// on two threads (the thread count is left at two).
Tensor on_one_and_two_threads(const std::vector<int64_t>& shape, const std::function<void(const Tensor&)>& call) {
  Tensor one = Tensor::empty(shape, DType::f32), two = Tensor::empty(shape, DType::f32);
  set_num_threads(1);
  call(one);
  set_num_threads(2);
  call(two);
  EXPECT_EQ(0, std::memcmp(one.data(), two.data(), static_cast<size_t>(one.numel()) * 4)) << "1 vs 2 threads";
  return one;
}

// Every element of the m x n f32 result `got` within the bound for f32 sums of k terms of
// the oracle's `want`, 2k · 2^-24 · Σ|a·b| (calc_diff alone lets one element hide behind a
// large column).
void expect_each_within_sum_bound(const Tensor& got, const std::vector<double>& want, const ref::Operand& ra,
                                  const ref::Operand& rb, int64_t k) {
  const std::vector<double> abs_dot = ref::gemm(Layout::nt, abs_operand(ra), abs_operand(rb));
  for (size_t e = 0; e < want.size(); ++e)
    EXPECT_NEAR(got.data_ptr<float>()[e], want[e], 2.0 * static_cast<double>(k) * 0x1p-24 * abs_dot[e] + 1e-30)
        << "element " << e;
}

// NaN in column `column` of every row of the m x n f32 result, and nowhere else.
void expect_nan_in_column_only(const Tensor& got, int64_t m, int64_t n, int64_t column) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j)
      EXPECT_EQ(std::isnan(got.data_ptr<float>()[i * n + j]), j == column) << "row " << i << ", column " << j;
}

TEST(GemmBf16Pairs, FewRowsOfE4m3WeightsMatchOracle) {
  if (bf16_pair_isas().empty()) GTEST_SKIP() << "no AVX512_BF16 or AMX-BF16 on this CPU";
  ThreadGuard guard;
  for (const Isa pair_isa : bf16_pair_isas()) {
  ScopedIsa scoped(pair_isa);
  SCOPED_TRACE(isa_name(pair_isa));
  struct Config {
    bool ue8m0;
    int64_t gran_mn, gran_k;
  };
  uint64_t seed = 9700;
  for (const int64_t m : {1, 2, 3, 4})
    for (const int64_t k : {64, 80, 100, 1000, 1100})  // (80: a last block of one group of 32; 1100: one row of A past the short rows)
      for (const int64_t n : {1, 13, 1100})
        for (const Config cf : {Config{false, 128, 128}, Config{true, 128, 128}, Config{true, 1, 32}, Config{false, 1, 32}}) {
          SCOPED_TRACE(std::string(cf.ue8m0 ? "ue8m0" : "f32") + " scales, gran " + std::to_string(cf.gran_mn) + " x " +
                       std::to_string(cf.gran_k) + ", m " + std::to_string(m) + ", k " + std::to_string(k) + ", n " +
                       std::to_string(n));
          const Quantized qa = per_token_cast_to_fp8(random_bf16(m, k, seed++), cf.ue8m0, cf.gran_k);
          const Tensor xb = random_bf16(n, k, seed++);
          Quantized qb = cf.gran_mn == 1 ? per_token_cast_to_fp8(xb, cf.ue8m0, cf.gran_k) : per_block_cast_to_fp8(xb, cf.ue8m0);
          uint8_t* codes = qb.values.data_ptr<uint8_t>();
          for (int64_t r = 0; r < n; r += 3)  // every third row: every finite code in turn
            for (int64_t j = 0; j < k; ++j) {
              const auto c = static_cast<uint8_t>((j * 37 + r * 11) % 256);
              codes[r * k + j] = (c & 0x7f) == 0x7f ? c ^ 1 : c;
            }
          if (n > 2)  // row 1: subnormals 1..7 of both signs; row 2: the least normal, and one largest subnormal
            for (int64_t j = 0; j < k; ++j) {
              codes[k + j] = static_cast<uint8_t>((j % 16 < 8 ? 0 : 0x80) | (1 + j * 5 % 7));
              codes[2 * k + j] = static_cast<uint8_t>(j == k / 2 ? 0x07 : j % 3 ? 0x08 : 0x88);
            }
          if (n > 4)  // row 4: zeros of both signs among normal codes (a zero the affine decode misread would be 2^-7)
            for (int64_t j = 0; j < k; ++j)
              codes[4 * k + j] = static_cast<uint8_t>(j % 4 == 0 ? (j % 8 ? 0x80 : 0x00) : ((j % 3 ? 0 : 0x80) | (0x28 + j % 40)));
          GemmOptions o;
          o.recipe = Recipe{1, cf.gran_mn, cf.gran_k};
          Tensor one = on_one_and_two_threads({m, n}, [&](const Tensor& d) { fp8_fp4_gemm_nt(qa, qb, d, Tensor(), o); });
          const std::vector<double> want =
              ref::gemm(Layout::nt, {qa.values, qa.sf, 1, cf.gran_k}, {qb.values, qb.sf, cf.gran_mn, cf.gran_k});
          EXPECT_LE(ref::calc_diff(ref::to_f64(one), want), 1e-5);
          // The subnormal rows element-wise, within the bound for f32 sums of k terms,
          // 2k · 2^-24 · Σ|a·b| (their sums cancel: a relative bound on the result is not one).
          const ref::Operand ra{qa.values, qa.sf, 1, cf.gran_k}, rb{qb.values, qb.sf, cf.gran_mn, cf.gran_k};
          const std::vector<double> abs_dot = ref::gemm(Layout::nt, abs_operand(ra), abs_operand(rb));
          for (int64_t i = 0; i < m; ++i)
            for (const int64_t j : {1, 2, 4}) {
              if (j >= n) continue;
              const auto e = static_cast<size_t>(i * n + j);
              EXPECT_NEAR(one.data_ptr<float>()[i * n + j], want[e], 2.0 * static_cast<double>(k) * 0x1p-24 * abs_dot[e])
                  << "subnormal or zero codes, row " << i << ", column " << j;
            }
          if (n < 13) continue;
          // A NaN code among normal codes: in the last block (partial where K is not a whole
          // number of blocks: probed), then in the first (whole: marked, for one and two rows of A).
          const uint8_t last = codes[5 * k + k - 1];
          codes[5 * k + k - 1] = 0xff;
          fp8_fp4_gemm_nt(qa, qb, one, Tensor(), o);
          expect_nan_in_column_only(one, m, n, 5);
          codes[5 * k + k - 1] = last;
          codes[5 * k + 3] = 0xff;
          fp8_fp4_gemm_nt(qa, qb, one, Tensor(), o);
          expect_nan_in_column_only(one, m, n, 5);
        }
  }
}

// One row of A against short e4m3 weight rows (K up to 1024, promotion groups of whole
// 64-code blocks) reads two weight rows at a time with several groups' sums in flight
// (dot_row_amx.inc: dot_few_rows); two rows of A (and on avx512_bf16 up to four; AMX's tiles
// take three and more) take eight or more sums a pass (dot_rows). Both keep one chain of products
// per group, promoted in group order, so a row of D must have the same bits whether A has
// one row or more: checked against the first rows of the same call on two (and three and
// four) rows, for K with whole and partial windows, groups and blocks, N ending mid-pass,
// weight scales in 128 x 128 blocks (f32, ue8m0) and per row (1 x 128, and 1 x 32: two
// groups a block), on one and two threads (N = 1100 is large enough for two); and against
// the oracle.
TEST(GemmBf16Pairs, OneRowOfE4m3WeightsSameBitsAsMoreRows) {
  if (bf16_pair_isas().empty()) GTEST_SKIP() << "no AVX512_BF16 or AMX-BF16 on this CPU";
  ThreadGuard guard;
  for (const Isa pair_isa : bf16_pair_isas()) {
    ScopedIsa scoped(pair_isa);
    SCOPED_TRACE(isa_name(pair_isa));
    uint64_t seed = 9900;
    for (const int64_t k : {64, 200, 512, 640, 1000, 1024, 1536})
      for (const int64_t n : {1, 7, 301, 1100})
        for (const auto& [ue8m0, gran_mn, gran_k] :
             {std::tuple{false, int64_t{128}, int64_t{128}}, std::tuple{true, int64_t{128}, int64_t{128}},
              std::tuple{false, int64_t{1}, int64_t{128}}, std::tuple{false, int64_t{1}, int64_t{32}}}) {
          if (n == 1100 && (k < 512 || ue8m0)) continue;  // (two threads: a few shapes suffice)
          SCOPED_TRACE("k " + std::to_string(k) + ", n " + std::to_string(n) + (ue8m0 ? ", ue8m0" : ", f32") +
                       " scales, gran_mn " + std::to_string(gran_mn) + ", gran_k " + std::to_string(gran_k));
          const Tensor xa = random_bf16(4, k, seed++);
          const Tensor xb = random_bf16(n, k, seed++);
          const Quantized qb = gran_mn == 1 ? per_token_cast_to_fp8(xb, ue8m0, gran_k) : per_block_cast_to_fp8(xb, ue8m0);
          GemmOptions o;
          o.recipe = Recipe{1, gran_mn, gran_k};
          std::vector<Tensor> rows_of;  // D for the first rows of A, one per entry of ms
          Quantized qa_most;  // A's most rows, for the oracle
          // (Three and four rows take five and four weight rows a pass on avx512_bf16, whose
          // passes start where the threads' column chunks do.)
          const std::vector<int64_t> ms = pair_isa == Isa::avx512_bf16 ? std::vector<int64_t>{1, 2, 3, 4} : std::vector<int64_t>{1, 2};
          for (const int64_t m : ms) {
            const Quantized qa = per_token_cast_to_fp8(xa.slice(0, 0, m), ue8m0, gran_k);
            rows_of.push_back(on_one_and_two_threads({m, n}, [&](const Tensor& d) { fp8_fp4_gemm_nt(qa, qb, d, Tensor(), o); }));
            if (m == ms.back()) qa_most = qa;
          }
          for (size_t i = 1; i < rows_of.size(); ++i)
            EXPECT_EQ(0, std::memcmp(rows_of[0].data(), rows_of[i].data(), static_cast<size_t>(n) * 4)) << "1 row vs " << rows_of[i].size(0);
          const std::vector<double> want =
              ref::gemm(Layout::nt, {qa_most.values, qa_most.sf, 1, gran_k}, {qb.values, qb.sf, gran_mn, gran_k});
          EXPECT_LE(ref::calc_diff(ref::to_f64(rows_of.back()), want), 1e-5);
        }
  }
}

// One to four rows of bf16 A against bf16 weights take bf16 dot products on the weights as
// they are, on avx512_bf16 (amx: the FMA kernel or the tiles, held to the oracle the same
// way). Against the oracle element by element, within the bound for f32 sums of k terms;
// K with partial 32- and 64-value blocks (the masked loads), N ending mid-pass (8, 5 or 4
// weight rows per pass); the same bits on one and two threads; both operands as views with
// NaN past K in each row (never read); a NaN weight poisons its own column only.
TEST(GemmBf16Pairs, FewRowsOfBf16WeightsMatchOracle) {
  if (bf16_pair_isas().empty()) GTEST_SKIP() << "no AVX512_BF16 or AMX-BF16 on this CPU";
  ThreadGuard guard;
  for (const Isa pair_isa : bf16_pair_isas()) {
    ScopedIsa scoped(pair_isa);
    SCOPED_TRACE(isa_name(pair_isa));
    uint64_t seed = 9950;
    for (const int64_t m : {1, 2, 3, 4})
      for (const int64_t k : {20, 64, 84, 96, 100, 1000})  // (84, 96: a whole block, then 20 or 32 values)
        for (const int64_t n : {1, 13, 1100}) {
          SCOPED_TRACE("m " + std::to_string(m) + ", k " + std::to_string(k) + ", n " + std::to_string(n));
          // Both operands are views whose rows are k + 8 apart, the 8 values past K NaN: a read
          // past the end of a row (a mask one value too long) turns its column into NaN.
          const auto nan_padded = [&](int64_t rows, uint64_t sd) {
            Tensor wide = random_bf16(rows, k + 8, sd);
            for (int64_t r = 0; r < rows; ++r)
              for (int64_t j = k; j < k + 8; ++j) wide.data_ptr<uint16_t>()[r * (k + 8) + j] = 0x7fc0;
            return wide;
          };
          const Tensor wide_a = nan_padded(m, seed++), wide_b = nan_padded(n, seed++);
          const Tensor a = wide_a.slice(1, 0, k), b = wide_b.slice(1, 0, k);
          Tensor one = on_one_and_two_threads({m, n}, [&](const Tensor& d) { bf16_gemm_nt(a, b, d); });
          const Tensor a_copy = Tensor::empty({m, k}, DType::bf16), b_copy = Tensor::empty({n, k}, DType::bf16);
          a_copy.copy_from(a);
          b_copy.copy_from(b);
          const ref::Operand ra{a_copy, Tensor(), 1, 128}, rb{b_copy, Tensor(), 1, 128};
          const std::vector<double> want = ref::gemm(Layout::nt, ra, rb);
          EXPECT_LE(ref::calc_diff(ref::to_f64(one), want), 1e-5);
          expect_each_within_sum_bound(one, want, ra, rb, k);
          if (n < 13) continue;
          wide_b.data_ptr<uint16_t>()[7 * (k + 8) + k - 1] = 0x7fc0;  // a NaN in the last K place of weight row 7
          bf16_gemm_nt(a, b, one);
          expect_nan_in_column_only(one, m, n, 7);
        }
  }
}

// On avx512_bf16 one row of bf16 A takes the same dot products as two to four (session
// 38; before, one row took the f32 FMA kernel), so a row of D has the same bits whatever
// the number of rows: checked against the first row of 2, 3 and 4 rows for K with partial
// blocks, short rows (passes a few KiB, requested several passes ahead) and long ones, and N
// ending mid-pass, on one and two threads.
TEST(GemmBf16Pairs, OneRowOfBf16WeightsSameBitsAsMoreRows) {
  if (!isa_supported(Isa::avx512_bf16)) GTEST_SKIP() << "no AVX512_BF16 on this CPU";
  ThreadGuard guard;
  ScopedIsa scoped(Isa::avx512_bf16);
  uint64_t seed = 9970;
  for (const int64_t k : {20, 100, 512, 1100, 4096})
    for (const int64_t n : {7, 1100}) {
      SCOPED_TRACE("k " + std::to_string(k) + ", n " + std::to_string(n));
      const Tensor xa = random_bf16(4, k, seed++), b = random_bf16(n, k, seed++);
      std::vector<Tensor> rows_of;
      for (const int64_t m : {1, 2, 3, 4})
        rows_of.push_back(on_one_and_two_threads({m, n}, [&](const Tensor& d) { bf16_gemm_nt(xa.slice(0, 0, m), b, d); }));
      for (size_t i = 1; i < rows_of.size(); ++i)
        EXPECT_EQ(0, std::memcmp(rows_of[0].data(), rows_of[i].data(), static_cast<size_t>(n) * 4)) << "1 row vs " << i + 1;
      const std::vector<double> want = ref::gemm(Layout::nt, {xa.slice(0, 0, 1), Tensor(), 1, 128}, {b, Tensor(), 1, 128});
      EXPECT_LE(ref::calc_diff(ref::to_f64(rows_of[0]), want), 1e-5);
    }
}

// One or two rows of A (up to four on avx512_bf16) against FP4 weights with foldable
// (power-of-two) scales take the FP4 dot path (dot_row_amx.inc): every pair of codes, f32 and packed ue8m0 scales, K
// tails, rows before and after a pass boundary, and passes holding a scale the table cannot
// take (2^121, zero, NaN), which go to the tiles (amx) or the FMA kernel (avx512_bf16); 1
// and 2 threads bit for bit.
TEST(GemmBf16Pairs, FewRowsOfE2m1WeightsMatchOracle) {
  if (bf16_pair_isas().empty()) GTEST_SKIP() << "no AVX512_BF16 or AMX-BF16 on this CPU";
  ThreadGuard guard;
  for (const Isa pair_isa : bf16_pair_isas()) {
  ScopedIsa scoped(pair_isa);
  SCOPED_TRACE(isa_name(pair_isa));
  uint64_t seed = 9900;
  for (const int64_t m : {1, 2, 3, 4})
    for (const int64_t k : {64, 100, 1000, 2400})
      for (const int64_t n : {1, 13, 1100})
        for (const bool packed : {false, true}) {
          SCOPED_TRACE(std::string(packed ? "packed ue8m0" : "f32") + " scales, m " + std::to_string(m) + ", k " +
                       std::to_string(k) + ", n " + std::to_string(n));
          const Quantized qa = per_token_cast_to_fp8(random_bf16(m, k, seed++), true, 32);
          Quantized qb = per_token_cast_to_fp4(random_bf16(n, k, seed++), true, 32);
          uint8_t* codes = qb.values.data_ptr<uint8_t>();
          const int64_t row_bytes = qb.values.size(1), groups = qb.sf.size(1);
          for (int64_t r = 0; r < n; r += 2)  // every other row: every pair of codes in turn
            for (int64_t j = 0; j < row_bytes; ++j) codes[r * row_bytes + j] = static_cast<uint8_t>((j * 37 + r * 11) % 256);
          float* sf = qb.sf.data_ptr<float>();
          GemmOptions o;
          o.recipe = Recipe{1, 1, 32};
          // Rows with a scale the dot path's table cannot take (2^121 to 2^127) go
          // to the fallback alone: every other column keeps the dot path's bits, checked
          // against the same call with those rows' scales left as they were (row 201: past
          // the first column chunk of either thread count, where the passes' bounds differ).
          // (A zero scale, or one below 2^-100, sends the whole call to the promoting paths.)
          const auto call_b = [&] { return packed ? Quantized{qb.values, pack_ue8m0_to_int(qb.sf)} : qb; };
          Tensor one;
          if (n > 12) {
            const Quantized as_cast = call_b();
            const Tensor folded =
                on_one_and_two_threads({m, n}, [&](const Tensor& d) { fp8_fp4_gemm_nt(qa, as_cast, d, Tensor(), o); });
            std::vector<int64_t> unfolded_rows{9};
            sf[9 * groups + groups - 1] = 0x1p121f;  // beyond the table's shifts: the row goes elsewhere
            if (n > 201) sf[201 * groups + groups - 1] = 0x1p121f, unfolded_rows.push_back(201);
            const Quantized b = call_b();
            one = on_one_and_two_threads({m, n}, [&](const Tensor& d) { fp8_fp4_gemm_nt(qa, b, d, Tensor(), o); });
            for (int64_t i = 0; i < m; ++i)
              for (int64_t j = 0; j < n; ++j) {
                if (std::find(unfolded_rows.begin(), unfolded_rows.end(), j) != unfolded_rows.end()) continue;
                ASSERT_EQ(std::bit_cast<uint32_t>(one.data_ptr<float>()[i * n + j]),
                          std::bit_cast<uint32_t>(folded.data_ptr<float>()[i * n + j]))
                    << "row " << i << ", column " << j << " (next to rows whose scales do not fold)";
              }
            if (!packed) sf[3 * groups] = 0.0f;  // a zero scale (packed ue8m0 has none): checked below
          }
          const Quantized b = call_b();
          one = on_one_and_two_threads({m, n}, [&](const Tensor& d) { fp8_fp4_gemm_nt(qa, b, d, Tensor(), o); });
          const ref::Operand ra{qa.values, qa.sf, 1, 32}, rb{qb.values, qb.sf, 1, 32};
          const std::vector<double> want = ref::gemm(Layout::nt, ra, rb);
          EXPECT_LE(ref::calc_diff(ref::to_f64(one), want), 1e-5);
          expect_each_within_sum_bound(one, want, ra, rb, k);  // (calc_diff is dominated by the 2^121 column)
          if (n < 13) continue;
          // A NaN scale (ue8m0 255): NaN in that column alone.
          if (packed) b.sf.data_ptr<uint8_t>()[7 * b.sf.size(1) * 4] = 0xff;
          else sf[7 * groups] = std::numeric_limits<float>::quiet_NaN();
          fp8_fp4_gemm_nt(qa, b, one, Tensor(), o);
          expect_nan_in_column_only(one, m, n, 7);
        }
  }
}

// tn calls accumulating into D in place (weight gradients) with one K block: on the
// bf16-pair targets the tiles start from C (gemm.cpp: tiles_write_d). Against the oracle; 1 and 2 threads bit for
// bit; a call on the first few rows gives those rows' bits; two K blocks take the
// partial-sum path and agree with the oracle too.
TEST(GemmBf16Pairs, TnAccumulatingInPlaceSameBitsForAnyThreadsAndM) {
  if (bf16_pair_isas().empty()) GTEST_SKIP() << "no AVX512_BF16 or AMX-BF16 on this CPU";
  ThreadGuard guard;
  for (const Isa pair_isa : bf16_pair_isas()) {
    ScopedIsa scoped(pair_isa);
    uint64_t seed = 9900;
    for (const int64_t k : {100, 512, 1024, 1100, 2048, 2100})
    for (const int64_t m : {40, 200})
      for (const int64_t n : {70, 600}) {
        SCOPED_TRACE(isa_name(pair_isa));
        SCOPED_TRACE("m " + std::to_string(m) + " n " + std::to_string(n) + " k " + std::to_string(k));
        const Tensor xa = random_bf16(k, m, seed), xb = random_bf16(k, n, seed + 1);  // tn: [K, M], [K, N]
        Tensor c = Tensor::empty({m, n}, DType::f32);
        convert(random_bf16(m, n, seed + 2), c);
        seed += 3;
        const Tensor one = on_one_and_two_threads({m, n}, [&](const Tensor& d) {
          d.copy_from(c);
          bf16_gemm_tn(xa, xb, d, d);
        });
        const std::vector<double> want = ref::gemm(Layout::tn, {xa, Tensor(), 1, 128}, {xb, Tensor(), 1, 128}, c);
        EXPECT_LE(ref::calc_diff(ref::to_f64(one), want), 1e-5);
        constexpr int64_t kFew = 5;
        Tensor few = Tensor::empty({kFew, n}, DType::f32);
        few.copy_from(c.slice(0, 0, kFew));
        bf16_gemm_tn(xa.slice(1, 0, kFew), xb, few, few);
        EXPECT_EQ(0, std::memcmp(few.data(), one.data(), static_cast<size_t>(kFew * n) * 4)) << "the first rows alone";
      }
  }
}

TEST(GemmPacked, BadInputRaisesNamedErrors) {
  const Tensor a = random_bf16(6, 64, 1), b = random_bf16(8, 64, 2);
  Tensor d = Tensor::empty({6, 8}, DType::f32);
  const PackedWeights w = pack_bf16_weights(b);
  EXPECT_MOEKIT_ERROR_ARG(bf16_gemm_packed(a, PackedWeights(), d), "b");
  EXPECT_MOEKIT_ERROR_ARG(bf16_gemm_packed(random_bf16(6, 65, 3), w, d), "b");  // K mismatch
  EXPECT_MOEKIT_ERROR_ARG(bf16_gemm_packed(a, pack_bf16_weights(b, false), d), "b");  // [K, N] read: K = 8
  EXPECT_MOEKIT_ERROR_ARG(bf16_gemm_packed(Tensor::empty({6, 64}, DType::f32), w, d), "a");
  EXPECT_MOEKIT_ERROR_ARG(bf16_gemm_packed(a.t(), w, d), "a");
  EXPECT_MOEKIT_ERROR_ARG(bf16_gemm_packed(a, w, Tensor::empty({6, 9}, DType::f32)), "d");
  EXPECT_MOEKIT_ERROR_ARG(bf16_gemm_packed(a, w, d, Tensor::empty({6, 8}, DType::bf16)), "c");
  EXPECT_MOEKIT_ERROR_ARG(pack_bf16_weights(Tensor::empty({8, 64}, DType::e4m3)), "b");
  EXPECT_MOEKIT_ERROR_ARG(pack_bf16_weights(Tensor()), "b");
  const Quantized qa = per_token_cast_to_fp8(a, false), qb = per_block_cast_to_fp8(b, false);
  EXPECT_MOEKIT_ERROR_ARG(pack_fp8_fp4_weights({b, qb.sf}), "b.values");
  EXPECT_MOEKIT_ERROR_ARG(pack_fp8_fp4_weights({qb.values, qa.sf}), "b.sf");  // sf shape
  EXPECT_MOEKIT_ERROR_ARG(pack_fp8_fp4_weights({qb.values, Tensor()}), "b.sf");
  const PackedWeights w8 = pack_fp8_fp4_weights(qb);
  EXPECT_MOEKIT_ERROR_ARG(fp8_fp4_gemm_packed({a, qa.sf}, w8, d), "a.values");
  EXPECT_MOEKIT_ERROR_ARG(fp8_fp4_gemm_packed({qa.values, Tensor()}, w8, d), "a.sf");
  EXPECT_MOEKIT_ERROR_ARG(fp8_fp4_gemm_packed(qa, PackedWeights(), d), "b");
  // FP4 activations whose packed columns do not match the packed weights' K.
  const Quantized qa4 = per_token_cast_to_fp4(random_bf16(6, 66, 4), false, 32);
  EXPECT_MOEKIT_ERROR_ARG(fp8_fp4_gemm_packed(qa4, w8, d), "a.values");
}

}  // namespace
}  // namespace moekit

// Fuzz target for the MoE grouped GEMMs' index handling: the per-row group layout, the psum
// layout, masked_m, expected_m and the k-grouped ks list come from the input (valid most of
// the time, broken in every way the contract names some of the time), with random alignments,
// shapes, bf16 / FP8 payloads and scale kinds. The payload values come from a generator seeded
// by the input, so short inputs still compute on rich data.
//
// Every call must succeed exactly when the layout obeys the contract as docs/GEMM.md states
// it (this file's own model of the rules, written from the docs, not from grouped.cpp), and
// otherwise throw moekit::Error, on every ISA path and for the pre-packed variants alike.
// After a successful call: rows of no group keep their sentinel bits; the FMA-class ISA paths
// agree bit for bit; every path, and the pre-packed calls, match the f64 oracle group by group
// (calc_diff <= 1e-5 over the computed rows); one thread and all threads agree bit for bit.
//
// libFuzzer with -DMOEKIT_FUZZ=ON (clang); otherwise a pseudo-random smoke driver
// (ctest: fuzz_grouped_smoke).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include "moekit/moekit.h"
#include "reference.h"
#include "smoke_driver.h"

namespace {

using namespace moekit;
using moekit::fuzzing::Reader;

long g_accepted = 0, g_rejected = 0;  // smoke driver statistics

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "fuzz_grouped: %s\n", what);
  std::abort();
}

// The payload generator (seeded from the input).
struct Rng {
  uint64_t s;
  uint32_t next() {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<uint32_t>(s >> 33);
  }
};

uint16_t bf16_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

// bf16 values in ±[0.25, 4), or e4m3 codes without NaN, row-major over the tensor.
void fill_values(Tensor& t, Rng& rng) {
  if (t.dtype() == DType::bf16) {
    auto* v = t.data_ptr<uint16_t>();
    for (int64_t i = 0; i < t.numel(); ++i) {
      const uint32_t r = rng.next();
      v[i] = bf16_of(std::ldexp(1.0f + static_cast<float>(r & 127) / 128.0f, static_cast<int>((r >> 7) % 4) - 2) * ((r >> 10) & 1 ? -1.0f : 1.0f));
    }
  } else {  // e4m3
    auto* v = t.data_ptr<uint8_t>();
    for (int64_t i = 0; i < t.numel(); ++i) {
      uint8_t c = static_cast<uint8_t>(rng.next());
      if ((c & 0x7f) == 0x7f) c = static_cast<uint8_t>(c - 1);
      v[i] = c;
    }
  }
}

// f32 scales: powers of two near 1 (the AMX target folds those) or any value near 1.
void fill_scales(Tensor& t, Rng& rng, bool pow2) {
  auto* v = t.data_ptr<float>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    const uint32_t r = rng.next();
    const int e = static_cast<int>(r % 5) - 2;
    v[i] = pow2 ? std::ldexp(1.0f, e) : std::ldexp(1.0f + static_cast<float>((r >> 3) % 1024) / 1024.0f, e);
  }
}

int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

Tensor i32_tensor(const std::vector<int32_t>& v) {
  Tensor t = Tensor::empty({static_cast<int64_t>(v.size())}, DType::i32);
  if (!v.empty()) std::memcpy(t.data(), v.data(), v.size() * sizeof(int32_t));
  return t;
}

// ---- the layouts and this file's model of their rules (docs/GEMM.md "MoE grouped GEMMs") ----

// Per-row layout: runs of one group (aligned most of the time), -1 padding, and now and then
// a value out of range or a run that starts off the alignment.
std::vector<int32_t> per_row_layout(Reader& in, int64_t groups, int64_t align, int64_t m_total) {
  std::vector<int32_t> rows;
  while (static_cast<int64_t>(rows.size()) < m_total) {
    const int64_t r = static_cast<int64_t>(rows.size());
    const int64_t kind = in.small(10);
    if (kind == 0) {  // one arbitrary value, often out of range
      rows.push_back(static_cast<int32_t>(in.small(groups + 4)) - 2);
    } else if (kind <= 2) {
      for (int64_t j = 1 + in.small(5); j > 0; --j) rows.push_back(-1);
    } else {
      if (r % align != 0 && in.small(8) != 0)  // pad to the alignment, as a layout builder would
        while (static_cast<int64_t>(rows.size()) % align != 0) rows.push_back(-1);
      const int32_t g = static_cast<int32_t>(in.small(groups));
      for (int64_t j = 1 + in.small(2 * align + 3); j > 0; --j) rows.push_back(g);
    }
  }
  rows.resize(static_cast<size_t>(m_total));
  return rows;
}

// Valid when every value lies in [-1, G) and every maximal run of one group starts at a
// multiple of the alignment. rows_of[g] lists group g's rows.
bool per_row_valid(const std::vector<int32_t>& rows, int64_t groups, int64_t align, std::vector<std::vector<int64_t>>& rows_of) {
  rows_of.assign(static_cast<size_t>(groups), {});
  for (size_t r = 0; r < rows.size(); ++r) {
    const int32_t g = rows[r];
    if (g < -1 || g >= groups) return false;
    if (g == -1) continue;
    const bool starts_run = r == 0 || rows[r - 1] != g;
    if (starts_run && static_cast<int64_t>(r) % align != 0) return false;
    rows_of[static_cast<size_t>(g)].push_back(static_cast<int64_t>(r));
  }
  return true;
}

// PSUM layout: cumulative actual end rows, now and then decreasing, negative or past M.
std::vector<int32_t> psum_layout(Reader& in, int64_t groups, int64_t align, int64_t& m_total) {
  std::vector<int32_t> psum;
  int64_t end = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t kind = in.small(12);
    if (kind == 0) end = end - 1 - in.small(3);  // decreasing (or negative)
    else if (kind >= 2) end = align_up(end, align) + in.small(2 * align + 4) - (kind == 2 ? align : 0);
    // (kind 1: the same end, an empty group)
    psum.push_back(static_cast<int32_t>(end));
  }
  const int64_t last = psum.empty() ? 0 : std::max<int64_t>(0, psum.back());
  m_total = in.small(6) == 0 ? std::max<int64_t>(0, last - 1 - in.small(4)) : last + in.small(align + 3);
  return psum;
}

// Valid when non-decreasing from 0 and at most M_total; group j covers [align(psum[j-1]), psum[j]).
bool psum_valid(const std::vector<int32_t>& psum, int64_t align, int64_t m_total, std::vector<std::vector<int64_t>>& rows_of) {
  rows_of.assign(psum.size(), {});
  int64_t prev = 0;
  for (size_t g = 0; g < psum.size(); ++g) {
    if (psum[g] < prev || psum[g] > m_total) return false;
    for (int64_t r = align_up(prev, align); r < psum[g]; ++r) rows_of[g].push_back(r);
    prev = psum[g];
  }
  return true;
}

// ---- the operands ----

struct Problem {
  bool fp8 = false, nn = false;
  int64_t groups = 1, n = 1, k = 1;
  int64_t k_b = 1;  // the weights' K: k, or (now and then) another, which every call must refuse
  Quantized a, b;  // contiguous: a [M, K]; masked: a [G, max_m, K]; b [G, N, K] or [G, K, N] (nn)
  GemmOptions options;
};

Quantized make_a(const Shape& shape, bool fp8, bool pow2, Rng& rng) {
  Quantized q;
  q.values = Tensor::empty(shape, fp8 ? DType::e4m3 : DType::bf16);
  fill_values(q.values, rng);
  if (fp8) {
    Shape s = shape;
    s.back() = (s.back() + 127) / 128;
    q.sf = Tensor::empty(s, DType::f32);
    fill_scales(q.sf, rng, pow2);
  }
  return q;
}

Quantized make_b(const Problem& p, bool pow2, Rng& rng) {
  Quantized q;
  q.values = Tensor::empty(p.nn ? Shape{p.groups, p.k_b, p.n} : Shape{p.groups, p.n, p.k_b}, p.fp8 ? DType::e4m3 : DType::bf16);
  fill_values(q.values, rng);
  if (p.fp8) {
    q.sf = Tensor::empty({p.groups, (p.n + 127) / 128, (p.k_b + 127) / 128}, DType::f32);
    fill_scales(q.sf, rng, pow2);
  }
  return q;
}

// The oracle's row r of a [rows, K] activation operand (values and scales) times group g's weights.
std::vector<double> oracle_row(const Problem& p, const Tensor& a_values, const Tensor& a_sf, int64_t r, int64_t g) {
  ref::Operand ra{a_values.slice(0, r, r + 1), p.fp8 ? a_sf.slice(0, r, r + 1) : Tensor(), 1, 128};
  ref::Operand rb{p.b.values.select(0, g), p.fp8 ? p.b.sf.select(0, g) : Tensor(), 128, 128};
  return ref::gemm(p.nn ? ref::Layout::nn : ref::Layout::nt, ra, rb);
}

// ---- running every path ----

// A call of one path into d (prefilled with the sentinel); false when it threw moekit::Error.
using Call = std::function<void(const Tensor& d)>;

bool accepted(const Call& call, const Tensor& d) {
  try {
    call(d);
    return true;
  } catch (const moekit::Error&) {
    return false;
  }
}

bool same_bits(const Tensor& x, const Tensor& y) { return std::memcmp(x.data(), y.data(), static_cast<size_t>(x.numel()) * x.element_size()) == 0; }

// Checks one accepted result: sentinel rows untouched, computed rows against the oracle.
// d is [rows, N] bf16 (a view of the whole output), computed[r] says whether row r is a group's.
void check_result(const Tensor& d, const Tensor& sentinel, const std::vector<char>& computed,
                  const std::vector<std::vector<double>>& oracle, const char* path) {
  const int64_t n = d.size(1);
  std::vector<double> got, want;
  for (int64_t r = 0; r < d.size(0); ++r) {
    const auto* row = d.data_ptr<uint16_t>() + r * n;
    if (!computed[static_cast<size_t>(r)]) {
      if (std::memcmp(row, sentinel.data_ptr<uint16_t>() + r * n, static_cast<size_t>(n) * 2) != 0) {
        std::fprintf(stderr, "path %s, row %ld\n", path, static_cast<long>(r));
        fail("a row of no group was written");
      }
      continue;
    }
    for (int64_t j = 0; j < n; ++j) {
      const double x = ref::bf16_value(row[j]);
      if (std::isnan(x)) fail("NaN in a computed row (no NaN in the inputs)");
      got.push_back(x);
      want.push_back(oracle[static_cast<size_t>(r)][static_cast<size_t>(j)]);
    }
  }
  if (ref::calc_diff(got, want) > 1e-5) {
    std::fprintf(stderr, "path %s: calc_diff %g\n", path, ref::calc_diff(got, want));
    fail("a grouped result differs from the oracle");
  }
}

// Runs `call` on every ISA path, one thread and all, and `packed` (if set) on the default
// path; checks acceptance against `valid` and every accepted result.
void run_paths(const Call& call, const Call& packed, bool valid, const Tensor& sentinel, const std::vector<char>& computed,
               const std::vector<std::vector<double>>& oracle) {
  const int64_t rows = sentinel.size(0), n = sentinel.size(1);
  auto fresh = [&] {
    Tensor d = Tensor::empty({rows, n}, DType::bf16);
    d.copy_from(sentinel);
    return d;
  };
  Tensor fma_bits;  // the first FMA-class result
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512, Isa::avx512_bf16, Isa::amx}) {
    if (!isa_supported(isa)) continue;
    ScopedIsa scoped(isa);
    Tensor d = fresh();
    if (accepted(call, d) != valid) {
      std::fprintf(stderr, "path %s: %s\n", isa_name(isa), valid ? "rejected a valid layout" : "accepted an invalid layout");
      fail(valid ? "a valid call was rejected" : "an invalid call was accepted");
    }
    if (!valid) continue;
    check_result(d, sentinel, computed, oracle, isa_name(isa));
    if (isa <= Isa::avx512) {
      if (!fma_bits.defined()) fma_bits = d;
      else if (!same_bits(d, fma_bits)) fail("FMA-class ISA paths differ");
    }
    // One thread against the default count, bit for bit.
    const int threads = num_threads();
    if (threads > 1 && isa == active_isa()) {
      set_num_threads(1);
      Tensor one = fresh();
      call(one);
      set_num_threads(threads);
      if (!same_bits(one, d)) fail("one thread and all threads differ");
    }
  }
  if (packed) {
    Tensor d = fresh();
    if (accepted(packed, d) != valid) fail(valid ? "a packed call rejected a valid layout" : "a packed call accepted an invalid layout");
    if (valid) check_result(d, sentinel, computed, oracle, "packed");
  }
  ++(valid ? g_accepted : g_rejected);
}

void run_contiguous(Reader& in, Problem& p, Rng& rng, bool psum_mode) {
  const int64_t align = int64_t{1} << in.small(5);  // 1 .. 16
  int64_t m_total = in.small(48);
  std::vector<int32_t> layout;
  std::vector<std::vector<int64_t>> rows_of;
  bool valid;
  if (psum_mode) {
    layout = psum_layout(in, p.groups, align, m_total);
    valid = psum_valid(layout, align, m_total, rows_of);
  } else {
    layout = per_row_layout(in, p.groups, align, m_total);
    valid = per_row_valid(layout, p.groups, align, rows_of);
  }
  valid = valid && p.k_b == p.k;  // (refused also when no group has a row)
  const bool pow2 = in.small(2);
  p.a = make_a({m_total, p.k}, p.fp8, pow2, rng);
  Tensor sentinel = Tensor::empty({m_total, p.n}, DType::bf16);
  fill_values(sentinel, rng);

  std::vector<char> computed(static_cast<size_t>(m_total), 0);
  std::vector<std::vector<double>> oracle(static_cast<size_t>(m_total));
  if (valid)
    for (int64_t g = 0; g < p.groups; ++g)
      for (int64_t r : rows_of[static_cast<size_t>(g)]) {
        computed[static_cast<size_t>(r)] = 1;
        oracle[static_cast<size_t>(r)] = oracle_row(p, p.a.values, p.a.sf, r, g);
      }

  const Tensor gl = i32_tensor(layout);
  const int64_t saved = get_mk_alignment_for_contiguous_layout();
  set_mk_alignment_for_contiguous_layout(align);
  Call call = [&](const Tensor& d) {
    if (p.fp8) {
      if (p.nn) m_grouped_fp8_gemm_nn_contiguous(p.a, p.b, d, gl, psum_mode, p.options);
      else m_grouped_fp8_gemm_nt_contiguous(p.a, p.b, d, gl, psum_mode, p.options);
    } else {
      if (p.nn) m_grouped_bf16_gemm_nn_contiguous(p.a.values, p.b.values, d, gl, psum_mode);
      else m_grouped_bf16_gemm_nt_contiguous(p.a.values, p.b.values, d, gl, psum_mode);
    }
  };
  std::vector<PackedWeights> weights = p.fp8 ? pack_fp8_fp4_weights_grouped(p.b, !p.nn, p.options) : pack_bf16_weights_grouped(p.b.values, !p.nn);
  Call packed = [&](const Tensor& d) {
    if (p.fp8) m_grouped_fp8_fp4_gemm_packed_contiguous(p.a, weights, d, gl, psum_mode, p.options);
    else m_grouped_bf16_gemm_packed_contiguous(p.a.values, weights, d, gl, psum_mode);
  };
  try {
    run_paths(call, packed, valid, sentinel, computed, oracle);
  } catch (...) {
    set_mk_alignment_for_contiguous_layout(saved);
    throw;
  }
  set_mk_alignment_for_contiguous_layout(saved);
}

void run_masked(Reader& in, Problem& p, Rng& rng) {
  const int64_t max_m = in.small(12);
  std::vector<int32_t> masked(static_cast<size_t>(p.groups));
  bool valid = true;
  for (auto& m : masked) {
    m = in.small(10) == 0 ? static_cast<int32_t>(in.small(3)) - 2 + (in.small(2) ? 0 : static_cast<int32_t>(max_m) + 3)
                          : static_cast<int32_t>(in.small(max_m + 1));
    if (m < 0 || m > max_m) valid = false;
  }
  const int64_t expected_m = in.small(8) == 0 ? -1 : in.small(24);
  if (expected_m < 0 || p.k_b != p.k) valid = false;
  const bool pow2 = in.small(2);
  p.a = make_a({p.groups, max_m, p.k}, p.fp8, pow2, rng);
  const int64_t rows = p.groups * max_m;
  Tensor sentinel = Tensor::empty({rows, p.n}, DType::bf16);
  fill_values(sentinel, rng);

  std::vector<char> computed(static_cast<size_t>(rows), 0);
  std::vector<std::vector<double>> oracle(static_cast<size_t>(rows));
  if (valid)
    for (int64_t g = 0; g < p.groups; ++g)
      for (int64_t r = 0; r < masked[static_cast<size_t>(g)]; ++r) {
        const Tensor av = p.a.values.select(0, g), as = p.fp8 ? p.a.sf.select(0, g) : Tensor();
        computed[static_cast<size_t>(g * max_m + r)] = 1;
        oracle[static_cast<size_t>(g * max_m + r)] = oracle_row(p, av, as, r, g);
      }
  const Tensor mm = i32_tensor(masked);
  auto as_3d = [&](const Tensor& d) { return d.reshape({p.groups, max_m, p.n}); };
  Call call = [&](const Tensor& d) {
    if (p.fp8) m_grouped_fp8_gemm_nt_masked(p.a, p.b, as_3d(d), mm, expected_m, p.options);
    else m_grouped_bf16_gemm_nt_masked(p.a.values, p.b.values, as_3d(d), mm, expected_m);
  };
  std::vector<PackedWeights> weights = p.fp8 ? pack_fp8_fp4_weights_grouped(p.b, true, p.options) : pack_bf16_weights_grouped(p.b.values, true);
  Call packed = [&](const Tensor& d) {
    if (p.fp8) m_grouped_fp8_fp4_gemm_packed_masked(p.a, weights, as_3d(d), mm, expected_m, p.options);
    else m_grouped_bf16_gemm_packed_masked(p.a.values, weights, as_3d(d), mm, expected_m);
  };
  run_paths(call, packed, valid, sentinel, computed, oracle);
}

// k-grouped (weight gradients): A [ΣK, M], B [ΣK, N], D and C f32 [G, M, N]. The operands hold
// the groups of `ks`; the call gets `ks` or a list broken in one of the ways the contract names
// (a negative K, a wrong count, a sum that is not A's rows; for FP8, per-group scale blocks
// that do not add up to the scale rows). Valid when the list has G entries, none negative,
// summing to A's rows, and (FP8) their ceil(K / 128) summing to the scale rows.
void run_k_grouped(Reader& in, bool fp8, int64_t groups, Rng& rng) {
  const int64_t m = 1 + in.small(12), n = 1 + in.small(12);
  std::vector<int64_t> ks(static_cast<size_t>(groups));
  for (auto& k : ks) k = in.small(4) == 0 ? 0 : in.small(6) * 32 + in.small(33);
  int64_t total = 0, blocks = 0;
  for (int64_t k : ks) total += k, blocks += (k + 127) / 128;
  std::vector<int64_t> passed = ks;
  switch (in.small(12)) {
    case 0: passed[static_cast<size_t>(in.small(groups))] = -1 - in.small(3); break;
    case 1: passed.push_back(in.small(3)); break;
    case 2: passed.pop_back(); break;
    case 3: passed[static_cast<size_t>(in.small(groups))] += 1 + in.small(130); break;
    case 4:  // K moved between two groups: the same sum, maybe other scale blocks, maybe a negative K
      if (groups > 1) {
        const int64_t d = 1 + in.small(passed[0] + 3);
        passed[0] -= d, passed[1] += d;
      }
      break;
    default: break;
  }
  bool valid = static_cast<int64_t>(passed.size()) == groups;
  int64_t sum = 0, sum_blocks = 0;
  for (int64_t k : passed) {
    if (k < 0) valid = false;
    sum += k, sum_blocks += (std::max<int64_t>(k, 0) + 127) / 128;
  }
  if (sum != total || (fp8 && sum_blocks != blocks)) valid = false;

  Quantized a, b;
  a.values = Tensor::empty({total, m}, fp8 ? DType::e4m3 : DType::bf16);
  b.values = Tensor::empty({total, n}, fp8 ? DType::e4m3 : DType::bf16);
  fill_values(a.values, rng);
  fill_values(b.values, rng);
  if (fp8) {
    const bool pow2 = in.small(2);
    a.sf = Tensor::empty({blocks, m}, DType::f32);
    b.sf = Tensor::empty({blocks, n}, DType::f32);
    fill_scales(a.sf, rng, pow2);
    fill_scales(b.sf, rng, pow2);
  }
  const int64_t c_mode = in.small(3);  // none, separate, in place
  Tensor c = Tensor::empty({groups, m, n}, DType::f32);
  {
    auto* v = c.data_ptr<float>();
    for (int64_t i = 0; i < c.numel(); ++i) v[i] = static_cast<float>(static_cast<int32_t>(rng.next() % 2001) - 1000) / 64.0f;
  }
  std::vector<double> oracle;
  if (valid) {
    int64_t k0 = 0, s0 = 0;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t k = passed[static_cast<size_t>(g)], nb = (k + 127) / 128;
      const ref::Operand ra{a.values.slice(0, k0, k0 + k), fp8 ? a.sf.slice(0, s0, s0 + nb).t() : Tensor(), 1, 128};
      const ref::Operand rb{b.values.slice(0, k0, k0 + k), fp8 ? b.sf.slice(0, s0, s0 + nb).t() : Tensor(), 1, 128};
      const std::vector<double> part = ref::gemm(ref::Layout::tn, ra, rb, c_mode ? c.select(0, g) : Tensor());
      oracle.insert(oracle.end(), part.begin(), part.end());
      k0 += k, s0 += nb;
    }
  }
  auto fresh = [&] {
    Tensor d = Tensor::empty({groups, m, n}, DType::f32);
    if (c_mode == 2) d.copy_from(c);
    else std::memset(d.data(), 0x7f, static_cast<size_t>(d.numel()) * 4);  // any bits: D is written whole
    return d;
  };
  auto call = [&](const Tensor& d) {
    const Tensor cc = c_mode == 1 ? c : c_mode == 2 ? d : Tensor();
    if (fp8) k_grouped_fp8_gemm_tn_contiguous(a, b, d, passed, cc);
    else k_grouped_bf16_gemm_tn_contiguous(a.values, b.values, d, passed, cc);
  };
  Tensor fma_bits;
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512, Isa::avx512_bf16, Isa::amx}) {
    if (!isa_supported(isa)) continue;
    ScopedIsa scoped(isa);
    Tensor d = fresh();
    if (accepted(call, d) != valid) {
      std::fprintf(stderr, "path %s: %s\n", isa_name(isa), valid ? "rejected a valid ks" : "accepted an invalid ks");
      fail(valid ? "a valid k-grouped call was rejected" : "an invalid k-grouped call was accepted");
    }
    if (!valid) continue;
    const std::vector<double> got = ref::to_f64(d.reshape({groups * m, n}));
    for (double x : got)
      if (std::isnan(x)) fail("NaN in a k-grouped result (no NaN in the inputs)");
    if (ref::calc_diff(got, oracle) > 1e-5) {
      std::fprintf(stderr, "path %s: calc_diff %g\n", isa_name(isa), ref::calc_diff(got, oracle));
      fail("a k-grouped result differs from the oracle");
    }
    if (isa <= Isa::avx512) {
      if (!fma_bits.defined()) fma_bits = d;
      else if (!same_bits(d, fma_bits)) fail("FMA-class ISA paths differ (k-grouped)");
    }
    const int threads = num_threads();
    if (threads > 1 && isa == active_isa()) {
      set_num_threads(1);
      Tensor one = fresh();
      call(one);
      set_num_threads(threads);
      if (!same_bits(one, d)) fail("one thread and all threads differ (k-grouped)");
    }
  }
  ++(valid ? g_accepted : g_rejected);
}

void run_one(Reader& in) {
  Problem p;
  const uint64_t seed_hi = in.byte(), seed_lo = in.byte();
  Rng rng{0x9e3779b97f4a7c15ull ^ (seed_hi << 8 | seed_lo)};
  const int64_t mode = in.small(4);  // per-row contiguous, psum contiguous, masked, k-grouped
  p.fp8 = in.small(2);
  p.nn = mode != 2 && in.small(3) == 0;  // (masked GEMMs are nt only)
  p.groups = 1 + in.small(4);
  p.n = 1 + in.small(24);
  p.k = 1 + in.small(8) * 40 + in.small(40);  // up to 320: several K groups
  if (mode == 3) return run_k_grouped(in, p.fp8, p.groups, rng);
  p.k_b = in.small(12) == 0 ? p.k + 1 + in.small(3) : p.k;
  p.b = make_b(p, in.small(2), rng);
  if (mode == 2) run_masked(in, p, rng);
  else run_contiguous(in, p, rng, mode == 1);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Reader in{data, size};
  run_one(in);
  return 0;
}

#ifndef MOEKIT_LIBFUZZER
// Smoke driver: deterministic pseudo-random inputs (argv[1] = iterations).
int main(int argc, char** argv) {
  const long iterations = argc > 1 ? std::strtol(argv[1], nullptr, 10) : 300;
  moekit::fuzzing::run_smoke(iterations, 0x6a09e667f3bcc908ull, 16, 13, 200);
  std::printf("fuzz_grouped: %ld inputs computed and checked, %ld rejected with moekit::Error\n", g_accepted, g_rejected);
  // Both outcomes must occur often: a smoke run of only one kind would test half the contract.
  return g_accepted * 4 >= iterations && g_rejected * 10 >= iterations ? 0 : 1;
}
#endif

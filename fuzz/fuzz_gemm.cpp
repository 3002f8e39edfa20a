// Fuzz target for the dense GEMMs: arbitrary layouts, operand formats, shapes (including
// wrong ones), granularities, scale dtypes and shapes, strides, payload bytes (every e4m3 /
// e2m1 code, NaN and ue8m0 255 included) and C / in-place C go through the public API.
// Every call must either succeed or throw moekit::Error (never crash or write out of
// bounds: run with sanitizers); successful calls must agree bit for bit across the FMA-class
// ISA paths (scalar, avx2, avx512) and match the f64 oracle on the same inputs (NaN where the
// oracle has NaN). The avx512_bf16 and amx paths, an accuracy class of their own
// (docs/GEMM.md), must accept and reject the same calls and match the oracle likewise, also
// with pre-packed weights.
//
// libFuzzer with -DMOEKIT_FUZZ=ON (clang); otherwise a pseudo-random smoke driver
// (ctest: fuzz_gemm_smoke).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "moekit/moekit.h"
#include "reference.h"
#include "smoke_driver.h"

namespace {

using namespace moekit;

long g_accepted = 0, g_rejected = 0;  // smoke driver statistics

using moekit::fuzzing::Reader;

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "fuzz_gemm: %s\n", what);
  std::abort();
}

// A [rows, cols] tensor of `dtype` whose row stride may exceed cols (a view of a wider
// buffer), filled from the input; the owner is kept in `keep`.
Tensor make(Reader& in, int64_t rows, int64_t cols, DType dtype, std::vector<Tensor>& keep) {
  const int64_t pad = in.small(3);
  Tensor base = Tensor::zeros({rows, cols + pad}, dtype);
  auto* bytes = static_cast<uint8_t*>(base.data());
  const size_t n = static_cast<size_t>(base.numel()) * base.element_size();
  for (size_t i = 0; i < n; ++i) bytes[i] = in.byte();
  if (dtype == DType::bf16) {  // keep values finite and moderate: the oracle's sums stay meaningful
    auto* v = base.data_ptr<uint16_t>();
    for (int64_t i = 0; i < base.numel(); ++i) v[i] = static_cast<uint16_t>((v[i] & 0x80ff) | 0x3c00 | ((v[i] & 0x0300) >> 1));
  }
  if (dtype == DType::f32) {  // scales: positive powers of two near 1, sometimes NaN
    auto* v = base.data_ptr<float>();
    for (int64_t i = 0; i < base.numel(); ++i) {
      const uint32_t r = static_cast<uint32_t>(bytes[4 * i]);
      v[i] = r == 255 ? NAN : std::ldexp(1.0f + static_cast<float>(r % 7) / 8.0f, static_cast<int>(r % 9) - 4);
    }
  }
  keep.push_back(base);
  return base.slice(1, 0, cols);
}

void run_one(Reader& in) {
  const int layout = static_cast<int>(in.small(4));  // nt, nn, tn, tt
  const bool a_k = layout <= 1, b_k = layout == 0 || layout == 3;
  const int kind = static_cast<int>(in.small(4));  // bf16, fp8, fp8 x fp4, fp4 x fp4
  int64_t m = in.small(10), n = in.small(40), k = in.small(300);
  if (in.small(8) == 0) m = 1 + in.small(200);  // sometimes the multi-block paths
  const DType out = in.small(2) ? DType::f32 : DType::bf16;
  const int c_mode = static_cast<int>(in.small(3));  // none, separate, in place
  std::vector<Tensor> keep;

  const DType da = kind == 0 ? DType::bf16 : kind == 3 ? DType::e2m1x2 : DType::e4m3;
  const DType db = kind == 0 ? DType::bf16 : kind >= 2 ? DType::e2m1x2 : DType::e4m3;
  // Stored shapes (FP4 packs its stored last dimension); occasionally a wrong K.
  auto stored_cols = [](DType d, int64_t e) { return d == DType::e2m1x2 ? (e + 1) / 2 : e; };
  const int64_t kb = in.small(16) == 0 ? k + 1 : k;
  const Tensor av = a_k ? make(in, m, stored_cols(da, k), da, keep) : make(in, k, stored_cols(da, m), da, keep);
  const Tensor bv = b_k ? make(in, n, stored_cols(db, kb), db, keep) : make(in, kb, stored_cols(db, n), db, keep);
  Tensor d = Tensor::zeros({m, n}, out);
  Tensor c0;
  if (c_mode) {
    c0 = make(in, m, n, DType::bf16, keep);
    if (out == DType::f32) {
      Tensor f = Tensor::empty({m, n}, DType::f32);
      convert(c0.contiguous(), f);
      c0 = f;
    }
    if (c_mode == 2) d.copy_from(c0);
  }
  const Tensor c = c_mode == 1 ? c0 : c_mode == 2 ? d : Tensor();

  // Recipes and scales (sometimes of the wrong shape).
  const int64_t gk_a = kind >= 2 ? 32 : 128, gk_b = kind >= 2 ? 32 : 128;
  const int64_t gmn_b = kind == 1 && in.small(2) ? 128 : 1;
  const bool ue8m0 = in.small(2) == 0;
  auto scales = [&](int64_t mn, int64_t gmn, int64_t gk) {
    const int64_t groups = (k + gk - 1) / gk, rows = (mn + gmn - 1) / gmn + (in.small(20) == 0 ? 1 : 0);
    if (!ue8m0) return make(in, rows, groups, DType::f32, keep);
    Tensor t = make(in, rows, (groups + 3) / 4, DType::i32, keep);  // exponent bytes 2^-7..2^7, 255 = NaN
    for (int64_t r = 0; r < t.size(0); ++r) {
      auto* row = reinterpret_cast<uint8_t*>(t.data_ptr<int32_t>() + r * t.stride(0));
      for (int64_t j = 0; j < 4 * t.size(1); ++j) row[j] = row[j] == 255 ? 255 : static_cast<uint8_t>(120 + row[j] % 15);
    }
    return t;
  };
  Quantized qa{av, kind ? scales(m, 1, gk_a) : Tensor()}, qb{bv, kind ? scales(n, gmn_b, gk_b) : Tensor()};
  GemmOptions o;
  o.recipe_a = OperandRecipe{1, gk_a};
  o.recipe_b = OperandRecipe{gmn_b, gk_b};

  auto call = [&](const Tensor& dd, const Tensor& cc) {
    using Fn8 = void (*)(const Quantized&, const Quantized&, const Tensor&, const Tensor&, const GemmOptions&);
    using Fn16 = void (*)(const Tensor&, const Tensor&, const Tensor&, const Tensor&);
    static const Fn8 f8[4] = {&fp8_fp4_gemm_nt, &fp8_fp4_gemm_nn, &fp8_fp4_gemm_tn, &fp8_fp4_gemm_tt};
    static const Fn16 f16[4] = {&bf16_gemm_nt, &bf16_gemm_nn, &bf16_gemm_tn, &bf16_gemm_tt};
    if (kind == 0) f16[layout](av, bv, dd, cc);
    else f8[layout](qa, qb, dd, cc, o);
  };

  // Portable path first (its result is the reference for the other paths).
  Tensor want = Tensor::empty({m, n}, out);
  want.copy_from(d);
  const Tensor c_for_want = c_mode == 2 ? want : c;
  try {
    ScopedIsa portable(Isa::scalar);
    call(want, c_for_want);
  } catch (const moekit::Error&) {
    // Rejected input: every other path must reject it too.
    for (Isa isa : {Isa::avx2, Isa::avx512, Isa::avx512_bf16, Isa::amx}) {
      if (!isa_supported(isa)) continue;
      ScopedIsa scoped(isa);
      bool threw = false;
      try {
        call(d, c);
      } catch (const moekit::Error&) {
        threw = true;
      }
      if (!threw) fail("an ISA path accepted what the portable path rejected");
    }
    ++g_rejected;
    return;
  }
  for (Isa isa : {Isa::avx2, Isa::avx512}) {
    if (!isa_supported(isa)) continue;
    ScopedIsa scoped(isa);
    Tensor got = Tensor::empty({m, n}, out);
    if (c_mode == 2) got.copy_from(c0);
    call(got, c_mode == 2 ? got : c);
    // NaN payloads are unspecified: compare NaN-ness, other values exactly.
    const std::vector<double> x = ref::to_f64(got), y = ref::to_f64(want);
    for (size_t i = 0; i < x.size(); ++i) {
      if (std::isnan(x[i]) != std::isnan(y[i])) fail("NaN positions differ between ISA paths");
      if (!std::isnan(x[i]) && std::memcmp(&x[i], &y[i], sizeof(double)) != 0) fail("an ISA path differs from the portable path");
    }
  }
  // The paths of their own accuracy class: checked against the oracle below.
  std::vector<std::pair<const char*, std::vector<double>>> own_class;
  for (Isa isa : {Isa::avx512_bf16, Isa::amx}) {
    if (!isa_supported(isa)) continue;
    ScopedIsa scoped(isa);
    Tensor got = Tensor::empty({m, n}, out);
    if (c_mode == 2) got.copy_from(c0);
    call(got, c_mode == 2 ? got : c);
    own_class.emplace_back(isa_name(isa), ref::to_f64(got));
  }
  // Pre-packed weights (A [M, K] layouts): the unpacked call's bits wherever that one packs
  // B too (not its small-M streaming path); NaN positions always agree with it. A packed call
  // may refuse only an odd FP4 extent (packing takes 2 x the stored columns).
  if (a_k) {
    const bool unpacked_streams = m <= 4 && b_k && k > 0 && (kind == 0 || gk_b % 8 == 0);
    // (The unpacked call accepted, so its resolved K is A's k.)
    const bool odd_fp4 = (da == DType::e2m1x2 && k % 2) || (db == DType::e2m1x2 && (b_k ? k : n) % 2);
    for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) {
      if (!isa_supported(isa)) continue;
      ScopedIsa scoped(isa);
      Tensor got = Tensor::empty({m, n}, out);
      if (c_mode == 2) got.copy_from(c0);
      try {
        if (kind == 0) bf16_gemm_packed(av, pack_bf16_weights(bv, b_k), got, c_mode == 2 ? got : c);
        else fp8_fp4_gemm_packed(qa, pack_fp8_fp4_weights(qb, b_k, o), got, c_mode == 2 ? got : c, o);
      } catch (const moekit::Error&) {
        if (!odd_fp4) fail("a packed call rejected what the unpacked call accepted");
        break;
      }
      const std::vector<double> x = ref::to_f64(got), y = ref::to_f64(want);
      for (size_t i = 0; i < x.size(); ++i) {
        if (std::isnan(x[i]) != std::isnan(y[i])) fail("NaN positions differ between packed and unpacked calls");
        if (!unpacked_streams && !std::isnan(x[i]) && std::memcmp(&x[i], &y[i], sizeof(double)) != 0)
          fail("a packed call differs from the unpacked call");
      }
      if (unpacked_streams) {
        std::vector<double> px, py;
        for (size_t i = 0; i < x.size(); ++i)
          if (!std::isnan(x[i])) px.push_back(x[i]), py.push_back(y[i]);
        if (ref::calc_diff(px, py) > 1e-5) fail("a packed call differs from the unpacked call (calc_diff > 1e-5)");
      }
    }
    for (Isa isa : {Isa::avx512_bf16, Isa::amx}) {
      if (!isa_supported(isa)) continue;
      ScopedIsa scoped(isa);
      Tensor got = Tensor::empty({m, n}, out);
      if (c_mode == 2) got.copy_from(c0);
      try {
        if (kind == 0) bf16_gemm_packed(av, pack_bf16_weights(bv, b_k), got, c_mode == 2 ? got : c);
        else fp8_fp4_gemm_packed(qa, pack_fp8_fp4_weights(qb, b_k, o), got, c_mode == 2 ? got : c, o);
      } catch (const moekit::Error&) {
        if (!odd_fp4) fail("a packed call rejected what the unpacked call accepted");
        continue;
      }
      own_class.emplace_back(isa == Isa::amx ? "amx packed" : "avx512_bf16 packed", ref::to_f64(got));
    }
  }
  // The oracle on the same stored inputs.
  ref::Operand ra{av, qa.sf, 1, gk_a}, rb{bv, qb.sf, gmn_b, gk_b};
  // The API's rule for packed FP4 extents (docs/GEMM.md): K from the other operand unless
  // it is also packed along K, MN from D.
  const bool a_pk = da == DType::e2m1x2 && a_k, b_pk = db == DType::e2m1x2 && b_k;
  if (da == DType::e2m1x2) ra.packed_extent = a_k ? (b_pk ? -1 : kb) : m;
  if (db == DType::e2m1x2) rb.packed_extent = b_k ? (a_pk ? -1 : k) : n;
  const std::vector<double> oracle = ref::gemm(static_cast<ref::Layout>(layout), ra, rb, c0);
  const std::vector<double> got = ref::to_f64(want);
  std::vector<double> gx, ox;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(oracle[i]) != std::isnan(got[i])) fail("NaN positions differ from the oracle");
    if (!std::isnan(oracle[i])) gx.push_back(got[i]), ox.push_back(oracle[i]);
  }
  if (ref::calc_diff(gx, ox) > 1e-5) fail("result differs from the oracle (calc_diff > 1e-5)");
  for (const auto& [path, x] : own_class) {
    std::vector<double> px, po;
    for (size_t i = 0; i < x.size(); ++i) {
      if (std::isnan(oracle[i]) != std::isnan(x[i])) {
        std::fprintf(stderr, "path %s, element %zu\n", path, i);
        fail("NaN positions differ from the oracle");
      }
      if (!std::isnan(oracle[i])) px.push_back(x[i]), po.push_back(oracle[i]);
    }
    if (ref::calc_diff(px, po) > 1e-5) {
      std::fprintf(stderr, "path %s: calc_diff %g\n", path, ref::calc_diff(px, po));
      fail("result differs from the oracle (calc_diff > 1e-5)");
    }
  }
  ++g_accepted;
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
  const long iterations = argc > 1 ? std::strtol(argv[1], nullptr, 10) : 500;
  moekit::fuzzing::run_smoke(iterations, 0x2545f4914f6cdd1dull, 64, 7919, 60000);
  std::printf("fuzz_gemm: %ld inputs computed and checked, %ld rejected with moekit::Error\n", g_accepted, g_rejected);
  // A smoke run that only ever exercised the argument checks would test nothing.
  return g_accepted * 4 >= iterations ? 0 : 1;
}
#endif

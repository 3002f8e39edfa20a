// `moekit bench grouped`: MoE grouped GEMMs on shapes scaled from upstream (gemm.md), per
// the issue: contiguous (G, M per group) in {(4, 1024), (8, 512)}, each group's M drawn from
// expected x U(0.7, 1.3), (N, K) in {(4096, 7168), (7168, 2048)}; masked (G, m) in
// {(32, 20), (6, 20), (32, 192)} on (4096, 7168) FP8 weights; k-grouped (4, 4096, 7168, 512).
// Peer: a loop of per-group oneDNN sgemm calls on f32 copies (dequantisation of each active
// group timed for FP8); the contiguous rows also give the dense GEMM of the same total M
// (note dense_us, timed in the same rotation) for throughput parity. Masked rows report
// weight GB/s of the active groups.
#include <fmt/format.h>
#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <tuple>

#include "bench_common.h"
#include "moekit/formats.h"
#include "moekit/gemm.h"
#include "moekit/runtime.h"
#include "peak.h"
#include "reference.h"

namespace moekit::tools {

namespace {

Tensor i32(const std::vector<int32_t>& v) {
  Tensor t = Tensor::empty({static_cast<int64_t>(v.size())}, DType::i32);
  std::copy(v.begin(), v.end(), t.data_ptr<int32_t>());
  return t;
}

void sgemm_nt(const float* a, const float* b, float* d, int64_t m, int64_t n, int64_t k) {
  if (m > 0) dnnl_sgemm('N', 'T', m, n, k, 1.0f, a, k, b, k, 0.0f, d, n);
}

// Deterministic random bytes (one LCG stream per 4 KiB, so threads split the work freely);
// code(bits) maps 64 random bits (use the high ones) to the byte stored.
template <class Code>
void fill_random_bits(const Tensor& t, uint64_t seed, Code code) {
  auto* v = t.data_ptr<uint8_t>();
  const int64_t total = t.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < total; i += 4096) {
    uint64_t s = seed * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(i);
    for (int64_t j = i; j < std::min(total, i + 4096); ++j) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      v[j] = code(s);
    }
  }
}

// The e4m3 codes of Gaussian weights cast per 128 x 128 block (as upstream's tests make
// them), as a table from 16 random bits to a code: a real cast of 128 x 8192 values, its
// codes counted and laid out over the 65536 entries in code order. Zeros and subnormals
// come out as rarely as in cast weights (uniformly random bytes would make 1 code in 16 one
// of them, and a decoder that handles them apart then runs its slow path in every block).
const std::vector<uint8_t>& gaussian_e4m3_codes() {
  static const std::vector<uint8_t> table = [] {
    const Quantized q = per_block_cast_to_fp8(random_bf16(128, 8192, 11), false);
    std::vector<double> count(256, 0.0);
    const auto* codes = q.values.data_ptr<uint8_t>();
    for (int64_t i = 0; i < q.values.numel(); ++i) count[codes[i]] += 1.0;
    std::vector<uint8_t> t(65536);
    double below = 0.0;  // values counted before code c
    for (int c = 0; c < 256; ++c) {
      const auto first = static_cast<size_t>(std::llround(below / static_cast<double>(q.values.numel()) * 65536.0));
      below += count[static_cast<size_t>(c)];
      const auto last = static_cast<size_t>(std::llround(below / static_cast<double>(q.values.numel()) * 65536.0));
      std::fill(t.begin() + static_cast<std::ptrdiff_t>(first), t.begin() + static_cast<std::ptrdiff_t>(last), static_cast<uint8_t>(c));
    }
    return t;
  }();
  return table;
}

// Random FP8 weights [G, N, K] with 128x128 block scales, made directly (no quantisation
// pass: these sizes run to gigabytes): codes drawn as Gaussian weights cast give them
// (gaussian_e4m3_codes), so never NaN.
Quantized random_fp8_weights(int64_t groups, int64_t n, int64_t k, uint64_t seed) {
  Quantized q{Tensor::empty({groups, n, k}, DType::e4m3), Tensor::empty({groups, (n + 127) / 128, (k + 127) / 128}, DType::f32)};
  const std::vector<uint8_t>& codes = gaussian_e4m3_codes();
  fill_random_bits(q.values, seed, [&](uint64_t bits) { return codes[bits >> 48]; });
  for (int64_t i = 0; i < q.sf.numel(); ++i) q.sf.data_ptr<float>()[i] = 1.0f / 256.0f;
  return q;
}

// Random FP4 weights [G, N, K] (packed e2m1, every code is a number) with power-of-two
// (ue8m0-representable) scales per 32 columns, the (1, 1, 32) recipe.
Quantized random_fp4_weights(int64_t groups, int64_t n, int64_t k, uint64_t seed) {
  Quantized q{Tensor::empty({groups, n, k / 2}, DType::e2m1x2), Tensor::empty({groups, n, (k + 31) / 32}, DType::f32)};
  fill_random_bits(q.values, seed, [](uint64_t bits) { return static_cast<uint8_t>(bits >> 56); });
  for (int64_t i = 0; i < q.sf.numel(); ++i) q.sf.data_ptr<float>()[i] = i % 3 == 0 ? 1.0f / 64.0f : 1.0f / 32.0f;
  return q;
}

}  // namespace

void bench_grouped(const BenchOptions& o) {
  RunCeilings ceilings(true, o.quick);  // re-measured before every problem
  std::vector<Row> rows_out;
  const int repeats = o.quick ? 2 : std::min(o.repeats, 5);
  std::mt19937_64 rng(7);

  // ---- contiguous ----
  std::vector<std::pair<int64_t, int64_t>> gm = {{4, 1024}, {8, 512}}, nk = {{4096, 7168}, {7168, 2048}};
  if (o.quick) gm = {{4, 64}}, nk = {{256, 512}};
  const int64_t align = get_mk_alignment_for_contiguous_layout();
  for (const auto& [groups, expected] : gm)
    for (const auto& [n, k] : nk) {
      ceilings.remeasure();
      std::uniform_real_distribution<double> u(0.7, 1.3);
      std::vector<int64_t> rows(static_cast<size_t>(groups));
      std::vector<int32_t> layout;
      int64_t valid = 0;
      for (auto& r : rows) {
        r = static_cast<int64_t>(std::llround(static_cast<double>(expected) * u(rng)));
        valid += r;
        layout.insert(layout.end(), static_cast<size_t>(r), static_cast<int32_t>(&r - rows.data()));
        layout.insert(layout.end(), static_cast<size_t>((r + align - 1) / align * align - r), -1);
      }
      const int64_t m_total = static_cast<int64_t>(layout.size());
      const Tensor x = random_bf16(m_total, k, 1);
      const Quantized qa = per_token_cast_to_fp8(x, false);
      const Quantized qb = random_fp8_weights(groups, n, k, 2);
      const Tensor d = Tensor::zeros({m_total, n}, DType::bf16);
      const Tensor dense_d = Tensor::zeros({valid, n}, DType::bf16);
      const Quantized qa_dense{qa.values.slice(0, 0, valid), qa.sf.slice(0, 0, valid)};
      const Quantized qb0{qb.values.select(0, 0), qb.sf.select(0, 0)};
      const Tensor layout_t = i32(layout);
      // Peer: per group, dequantise that group's weights and activations, then oneDNN sgemm.
      Tensor fa = Tensor::empty({m_total, k}, DType::f32), fb = Tensor::empty({n, k}, DType::f32);
      Tensor fd = Tensor::empty({m_total, n}, DType::f32);
      auto run = [&] { m_grouped_fp8_gemm_nt_contiguous(qa, qb, d, layout_t); };
      auto peer = [&] {
        int64_t r0 = 0;
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t r = rows[static_cast<size_t>(g)];
          cast_back_from_fp8_into(qb.values.select(0, g), qb.sf.select(0, g), fb, 128, 128);
          cast_back_from_fp8_into(qa.values.slice(0, r0, r0 + r), qa.sf.slice(0, r0, r0 + r), fa.slice(0, r0, r0 + r), 1, 128);
          sgemm_nt(fa.data_ptr<float>() + r0 * k, fb.data_ptr<float>(), fd.data_ptr<float>() + r0 * n, r, n, k);
          r0 += (r + align - 1) / align * align;
        }
      };
      Row row;
      row.kernel = "m_grouped_fp8_gemm_nt_contiguous";
      // The dense GEMM of the same rows runs in the same rotation (the parity target is a
      // ratio of the two, and this host's load moves between blocks of runs), and each of
      // the two runs after the peer, whose f32 copies push the operands out of the cache: a
      // dense call right after the grouped one found A, D and group 0's weights in the L3
      // (480 MiB on the AMX Xeon): 4 x 1024 x 7168 x 2048 had read 0.72-0.76x, and reads
      // 0.89-0.96x in this rotation.
      const auto dense_call = [&] { fp8_gemm_nt(qa_dense, qb0, dense_d); };
      const std::vector<Timing> t = time_round_robin({run, peer, dense_call, peer}, repeats);
      row.time = t[0], row.peer_time = t[1];
      const Timing& dense = t[2];
      // Oracle on the first rows of group 0.
      const int64_t check = std::min<int64_t>(rows[0], 4), check_n = std::min<int64_t>(n, 64);
      ref::Operand ra{qa.values.slice(0, 0, check), qa.sf.slice(0, 0, check), 1, 128};
      ref::Operand rb{qb.values.select(0, 0).slice(0, 0, check_n), qb.sf.select(0, 0).slice(0, 0, (check_n + 127) / 128), 128, 128};
      row.calc_diff = ref::calc_diff(ref::to_f64(d.slice(0, 0, check).slice(1, 0, check_n)), ref::gemm(ref::Layout::nt, ra, rb));
      const double flops = 2.0 * static_cast<double>(valid * n) * static_cast<double>(k);
      row.shape = fmt::format("{}x{}x{}x{}", groups, expected, n, k);
      row.dtype = "fp8";
      row.threads = num_threads();
      row.tflops = flops / (row.time.median_us * 1e6);
      row.ceiling = "bf16_flops";
      row.peer = "per-group dequant+onednn sgemm";
      row.sizes = {{"groups", groups}, {"m", valid}, {"n", n}, {"k", k}};
      row.notes = {{"dense_us", fmt::format("{:.0f}", dense.median_us)},
                   {"vs_dense_same_m", fmt::format("{:.2f}", dense.median_us / row.time.median_us)},
                   {"ok_vs_oracle", row.calc_diff <= 1e-5 ? "yes" : "NO"}};
      rows_out.push_back(row);
    }

  // ---- masked (decode: memory-bound for m <= 20) ----
  std::vector<std::pair<int64_t, int64_t>> masked = {{32, 20}, {6, 20}, {32, 192}};
  int64_t mn = 4096, mk = 7168;
  if (o.quick) masked = {{4, 8}}, mn = 256, mk = 512;
  // FP8 weights (128x128 blocks) for every shape; FP4 weights (1x32 ue8m0, with FP8
  // activations at the same granularity) for the decode shapes, where bytes are what count.
  for (const bool fp4 : {false, true})
  for (const auto& [groups, m] : masked) {
    if (fp4 && m > 20) continue;
    ceilings.remeasure();
    const int64_t max_m = std::max<int64_t>(m, 32), gran = fp4 ? 32 : 128;
    const Quantized qb = fp4 ? random_fp4_weights(groups, mn, mk, 3) : random_fp8_weights(groups, mn, mk, 3);
    const Tensor x = random_bf16(groups * max_m, mk, 4);
    const Quantized q2 = per_token_cast_to_fp8(x, fp4, gran);
    const Quantized qa{q2.values.reshape({groups, max_m, mk}), q2.sf.reshape({groups, max_m, (mk + gran - 1) / gran})};
    std::vector<int32_t> mm(static_cast<size_t>(groups), static_cast<int32_t>(m));
    const Tensor masked_m = i32(mm);
    const Tensor d = Tensor::zeros({groups, max_m, mn}, DType::bf16);
    Tensor fa = Tensor::empty({m, mk}, DType::f32), fb = Tensor::empty({mn, mk}, DType::f32), fd = Tensor::empty({m, mn}, DType::f32);
    auto run = [&] { m_grouped_fp8_gemm_nt_masked(qa, qb, d, masked_m, m); };
    auto peer = [&] {
      for (int64_t g = 0; g < groups; ++g) {
        if (fp4) {
          cast_back_from_fp4_into(qb.values.select(0, g), qb.sf.select(0, g), fb, 1, 32);
        } else {
          cast_back_from_fp8_into(qb.values.select(0, g), qb.sf.select(0, g), fb, 128, 128);
        }
        cast_back_from_fp8_into(qa.values.select(0, g).slice(0, 0, m), qa.sf.select(0, g).slice(0, 0, m), fa, 1, gran);
        sgemm_nt(fa.data_ptr<float>(), fb.data_ptr<float>(), fd.data_ptr<float>(), m, mn, mk);
      }
    };
    Row row;
    row.kernel = fp4 ? "m_grouped_fp8_fp4_gemm_nt_masked" : "m_grouped_fp8_gemm_nt_masked";
    std::tie(row.time, row.peer_time) = time_interleaved(run, peer, repeats);
    const int64_t check = std::min<int64_t>(m, 4), check_n = 64;
    ref::Operand ra{qa.values.select(0, 1).slice(0, 0, check), qa.sf.select(0, 1).slice(0, 0, check), 1, gran};
    ref::Operand rb = fp4 ? ref::Operand{qb.values.select(0, 1).slice(0, 0, check_n), qb.sf.select(0, 1).slice(0, 0, check_n), 1, 32}
                          : ref::Operand{qb.values.select(0, 1).slice(0, 0, check_n), qb.sf.select(0, 1).slice(0, 0, 1), 128, 128};
    row.calc_diff = ref::calc_diff(ref::to_f64(d.select(0, 1).slice(0, 0, check).slice(1, 0, check_n)), ref::gemm(ref::Layout::nt, ra, rb));
    // Weight bytes per element: e4m3 1 + a 128x128 block's f32 scale; e2m1 1/2 + an f32 scale per 32.
    const double per_weight = fp4 ? 0.5 + 4.0 / 32.0 : 1.0 + 4.0 / (128.0 * 128.0);
    const double weight_bytes = static_cast<double>(groups * mn * mk) * per_weight;
    const double flops = 2.0 * static_cast<double>(groups * m * mn) * static_cast<double>(mk);
    row.shape = fmt::format("{}x{}x{}x{}", groups, m, mn, mk);
    row.dtype = fp4 ? "fp8xfp4" : "fp8";
    row.threads = num_threads();
    row.gbps = weight_bytes / (row.time.median_us * 1e3);
    row.ceiling = "read_bw";
    row.peer = "per-group dequant+onednn sgemm";
    row.sizes = {{"groups", groups}, {"m", m}, {"n", mn}, {"k", mk}};
    row.roofline_bytes = weight_bytes, row.roofline_flops = flops;
    row.notes = {{"tflops", fmt::format("{:.4f}", flops / (row.time.median_us * 1e6))},
                 {"ok_vs_oracle", row.calc_diff <= 1e-5 ? "yes" : "NO"}};
    if (fp4) row.notes["recipe"] = "1,1,32 ue8m0";
    rows_out.push_back(row);

    // Pre-packed weights (docs/GEMM.md), FP8 shapes: the same call without the per-call
    // decoding and packing of B, timed alternately against the unpacked call. The bytes
    // counted are the packed form's (4 per weight as f32, about 2 as AMX bf16 panels).
    if (fp4) continue;
    std::vector<PackedWeights> packed;
    const Timing pack_time = time_it([&] { packed = pack_fp8_fp4_weights_grouped(qb); }, 1, 0);  // once: the one-off cost
    auto run_packed = [&] { m_grouped_fp8_fp4_gemm_packed_masked(qa, packed, d, masked_m, m); };
    Row prow = row;
    prow.kernel = "m_grouped_fp8_fp4_gemm_packed_masked";
    std::tie(prow.time, prow.peer_time) = time_interleaved(run_packed, run, repeats);
    prow.peer = "moekit " + row.kernel + " (unpacked)";
    run_packed();  // the interleaved timing may have ended on the unpacked call: check the packed one's D
    prow.calc_diff = ref::calc_diff(ref::to_f64(d.select(0, 1).slice(0, 0, check).slice(1, 0, check_n)), ref::gemm(ref::Layout::nt, ra, rb));
    double packed_bytes = 0;
    for (const PackedWeights& w : packed) packed_bytes += static_cast<double>(w.bytes());
    prow.gbps = packed_bytes / (prow.time.median_us * 1e3);
    prow.roofline_bytes = packed_bytes;
    prow.notes = {{"tflops", fmt::format("{:.4f}", flops / (prow.time.median_us * 1e6))},
                  {"ok_vs_oracle", prow.calc_diff <= 1e-5 ? "yes" : "NO"},
                  {"pack_ms", fmt::format("{:.0f}", pack_time.median_us / 1e3)},
                  {"packed_MiB", fmt::format("{:.0f}", packed_bytes / (1 << 20))}};
    rows_out.push_back(prow);
  }

  // ---- k-grouped (weight gradient), bf16 ----
  ceilings.remeasure();
  {
    const int64_t groups = 4, m = o.quick ? 128 : 4096, n = o.quick ? 256 : 7168, k = o.quick ? 64 : 512;
    const Tensor a = random_bf16(groups * k, m, 5), b = random_bf16(groups * k, n, 6);
    const std::vector<int64_t> ks(static_cast<size_t>(groups), k);
    const Tensor d = Tensor::zeros({groups, m, n}, DType::f32);
    Tensor fa = Tensor::empty({groups * k, m}, DType::f32), fb = Tensor::empty({groups * k, n}, DType::f32);
    convert(a, fa);
    convert(b, fb);
    auto run = [&] { k_grouped_bf16_gemm_tn_contiguous(a, b, d, ks, d); };  // accumulate into C = D
    auto peer = [&] {
      for (int64_t g = 0; g < groups; ++g)
        dnnl_sgemm('T', 'N', m, n, k, 1.0f, fa.data_ptr<float>() + g * k * m, m, fb.data_ptr<float>() + g * k * n, n, 1.0f,
                   d.data_ptr<float>() + g * m * n, n);
    };
    Row row;
    row.kernel = "k_grouped_bf16_gemm_tn_contiguous";
    std::tie(row.time, row.peer_time) = time_interleaved(run, peer, repeats);
    // Oracle: one fresh run into zeros, group 3, first rows.
    Tensor d1 = Tensor::zeros({groups, m, n}, DType::f32);
    k_grouped_bf16_gemm_tn_contiguous(a, b, d1, ks);
    const int64_t cm = 4, cn = 64;
    ref::Operand ra{a.slice(0, 3 * k, 4 * k).slice(1, 0, cm), Tensor(), 1, 128};
    ref::Operand rb{b.slice(0, 3 * k, 4 * k).slice(1, 0, cn), Tensor(), 1, 128};
    row.calc_diff = ref::calc_diff(ref::to_f64(d1.select(0, 3).slice(0, 0, cm).slice(1, 0, cn)), ref::gemm(ref::Layout::tn, ra, rb));
    const double flops = 2.0 * static_cast<double>(groups * m * n) * static_cast<double>(k);
    row.shape = fmt::format("{}x{}x{}x{}", groups, m, n, k);
    row.dtype = "bf16";
    row.threads = num_threads();
    row.tflops = flops / (row.time.median_us * 1e6);
    row.ceiling = "bf16_flops";
    row.peer = "per-group onednn sgemm(f32)";
    row.sizes = {{"groups", groups}, {"m", m}, {"n", n}, {"k", k}};
    row.notes = {{"ok_vs_oracle", row.calc_diff <= 1e-5 ? "yes" : "NO"}, {"c", "accumulate in place"}};
    rows_out.push_back(row);
  }

  ceilings.remeasure();
  Reporter rep{o.json};
  rep.header("grouped", ceilings.header());
  for (Row& row : rows_out) {
    ceilings.finish(row);
    rep.print(row);
  }
}

}  // namespace moekit::tools

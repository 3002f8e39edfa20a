// `moekit bench gemm`: dense GEMMs on upstream's shapes (gemm.md), TFLOPS against the
// measured bf16 ceiling, and memory-bound decode rows (M ≤ 16, weights far above L3) in
// GB/s against the measured read bandwidth.
//
// Peers, measured in the same run on the same data:
//  - oneDNN's bf16 matmul where this oneDNN/CPU has one; otherwise (oneDNN 2.6 implements
//    bf16 matmul only on AVX-512 CPUs) oneDNN's sgemm on f32 copies of the bf16 operands,
//    copies made outside the timing - the best oneDNN path a user has on such a machine.
//  - FP8/FP4 rows: the naive path - dequantise both operands (moekit's vectorised
//    cast_back, timed) then the oneDNN GEMM above. FP8 rows come with f32 scales and, at
//    M <= 16, with ue8m0 (power-of-two) scales as well ("fp8,ue8m0").
// Correctness: a corner of every result (first rows x first columns) against the f64 oracle.
#include <fmt/format.h>
#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
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

Tensor to_f32(const Tensor& x) {
  Tensor out = Tensor::empty(x.shape(), DType::f32);
  convert(x, out);
  return out;
}

// oneDNN: bf16 matmul when available, else sgemm on f32 inputs. D = A[M,K] · B[N,K]ᵀ, f32.
class OneDnnGemm {
 public:
  OneDnnGemm() : engine_(dnnl::engine::kind::cpu, 0), stream_(engine_) {}

  // True when oneDNN has a bf16 matmul for this CPU.
  bool bf16_available(int64_t m, int64_t n, int64_t k) {
    try {
      make(m, n, k);
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  }
  void bf16(const Tensor& a, const Tensor& b, const Tensor& d) {
    const int64_t m = a.size(0), k = a.size(1), n = b.size(0);
    if (!prim_ || m != m_ || n != n_ || k != k_) make(m, n, k);
    dnnl::memory ma(pd_.src_desc(), engine_, a.data()), mb(pd_.weights_desc(), engine_, b.data()),
        md(pd_.dst_desc(), engine_, d.data());
    prim_->execute(stream_, {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, md}});
    stream_.wait();
  }
  static void sgemm(const Tensor& a, const Tensor& b, const Tensor& d) {
    const int64_t m = a.size(0), k = a.size(1), n = b.size(0);
    dnnl_sgemm('N', 'T', m, n, k, 1.0f, a.data_ptr<float>(), k, b.data_ptr<float>(), k, 0.0f, d.data_ptr<float>(), n);
  }

 private:
  void make(int64_t m, int64_t n, int64_t k) {
    using dt = dnnl::memory::data_type;
    using tag = dnnl::memory::format_tag;
    dnnl::memory::desc ad({m, k}, dt::bf16, tag::ab), bd({k, n}, dt::bf16, tag::ba), dd({m, n}, dt::f32, tag::ab);
    pd_ = dnnl::matmul::primitive_desc(dnnl::matmul::desc(ad, bd, dd), engine_);
    prim_ = std::make_unique<dnnl::matmul>(pd_);
    m_ = m, n_ = n, k_ = k;
  }
  dnnl::engine engine_;
  dnnl::stream stream_;
  dnnl::matmul::primitive_desc pd_;
  std::unique_ptr<dnnl::matmul> prim_;
  int64_t m_ = 0, n_ = 0, k_ = 0;
};

struct Shape3 {
  int64_t m, n, k;
};

// calc_diff of D's top-left corner against the oracle on the same operands.
double corner_diff(const Tensor& d, const ref::Operand& a, const ref::Operand& b, int64_t rows, int64_t cols) {
  ref::Operand ac = a, bc = b;
  ac.values = a.values.slice(0, 0, rows);
  bc.values = b.values.slice(0, 0, cols);
  if (a.sf.defined()) ac.sf = a.sf.slice(0, 0, (rows + a.gran_mn - 1) / a.gran_mn);
  if (b.sf.defined()) bc.sf = b.sf.slice(0, 0, (cols + b.gran_mn - 1) / b.gran_mn);
  return ref::calc_diff(ref::to_f64(d.slice(0, 0, rows).slice(1, 0, cols)), ref::gemm(ref::Layout::nt, ac, bc));
}

}  // namespace

void bench_gemm(const BenchOptions& o) {
  RunCeilings ceilings(true, o.quick);
  OneDnnGemm onednn;
  const bool dnnl_bf16 = onednn.bf16_available(16, 16, 16);
  const std::string peer_name = dnnl_bf16 ? "onednn bf16 matmul" : "onednn sgemm(f32)";
  std::vector<Row> rows_out;

  std::vector<std::pair<int64_t, int64_t>> nk = {{2112, 7168}, {576, 7168},  {24576, 1536}, {32768, 512},
                                                  {7168, 16384}, {4096, 7168}, {7168, 2048}};
  std::vector<int64_t> ms = {1, 128, 4096};
  if (o.quick) nk = {{576, 1024}, {1024, 512}}, ms = {1, 128, 256};
  if (!o.gemm_m.empty()) ms = o.gemm_m;
  if (!o.gemm_n.empty())
    std::erase_if(nk, [&](const auto& s) { return std::find(o.gemm_n.begin(), o.gemm_n.end(), s.first) == o.gemm_n.end(); });

  // Decode rows: M in {4, 16} on the largest weight (7168 x 16384: 117 M elements, far above
  // L3); M = 1 is in the upstream list already.
  std::vector<Shape3> problems;
  for (const int64_t m : ms)
    for (const auto& [n, k] : nk) problems.push_back({m, n, k});
  if (!o.quick && o.gemm_m.empty() && o.gemm_n.empty())
    for (const int64_t m : {4, 16}) problems.push_back({m, 7168, 16384});

  // fp8_ue8m0: FP8 (1,128,128) under power-of-two scales (DeepGEMM's SM100 recipe), which the
  // AMX decode path folds into the weights; decode rows only (M <= 16).
  enum class Kind { bf16, fp8, fp8_ue8m0, fp4 };
  for (const auto& [m, n, k] : problems) {
      ceilings.remeasure();
      const Tensor xa = random_bf16(m, k, 1), xb = random_bf16(n, k, 2);
      const Tensor fa = dnnl_bf16 ? Tensor() : to_f32(xa), fb = dnnl_bf16 ? Tensor() : to_f32(xb);
      const Tensor d = Tensor::zeros({m, n}, DType::bf16), dpeer = Tensor::zeros({m, n}, DType::f32);
      // Fewer runs for the multi-second M = 4096 problems (stated in the row).
      const int repeats = m >= 4096 ? std::min(o.repeats, 3) : o.quick ? 3 : o.repeats;
      const double flops = 2.0 * static_cast<double>(m * n) * static_cast<double>(k);
      const int64_t check_rows = std::min<int64_t>(m, 8), check_cols = std::min<int64_t>(n, 128);

      for (Kind kind : {Kind::bf16, Kind::fp8, Kind::fp8_ue8m0, Kind::fp4}) {
        if (kind == Kind::fp8_ue8m0 && m > 16) continue;
        const bool fp8 = kind == Kind::fp8 || kind == Kind::fp8_ue8m0;
        Quantized qa, qb;
        ref::Operand ra{xa, Tensor(), 1, 128}, rb{xb, Tensor(), 1, 128};
        if (fp8) {
          const bool ue8m0 = kind == Kind::fp8_ue8m0;
          qa = per_token_cast_to_fp8(xa, ue8m0), qb = per_block_cast_to_fp8(xb, ue8m0);
          ra = {qa.values, qa.sf, 1, 128}, rb = {qb.values, qb.sf, 128, 128};
        } else if (kind == Kind::fp4) {  // FP8 activations x FP4 weights, ue8m0, gran_k 32
          qa = per_token_cast_to_fp8(xa, true, 32), qb = per_token_cast_to_fp4(xb, true, 32);
          qa.sf = pack_ue8m0_to_int(qa.sf), qb.sf = pack_ue8m0_to_int(qb.sf);
          ra = {qa.values, qa.sf, 1, 32}, rb = {qb.values, qb.sf, 1, 32};
        }
        // Memory-bound rows (M <= 16) cycle through enough copies of the weights that the
        // working set is >= max(128 MiB, 4x the last-level cache), for kernel and peer alike:
        // every run streams its weights from DRAM as in decoding, even when one copy would
        // fit in cache.
        const double w_bytes = static_cast<double>(n * k) * (kind == Kind::bf16 ? 2.0 : fp8 ? 1.0 : 0.5);
        const double working_set = static_cast<double>(dram_working_set(int64_t{128} << 20));
        const int copies = m <= 16 ? static_cast<int>(std::clamp(std::ceil(working_set / w_bytes), 1.0, 1024.0)) : 1;
        auto copy_of = [](const Tensor& t) {
          Tensor c = Tensor::empty(t.shape(), t.dtype());
          c.copy_from(t);
          return c;
        };
        std::vector<Tensor> bs{kind == Kind::bf16 ? xb : qb.values}, peer_bs;
        for (int c = 1; c < copies; ++c) bs.push_back(copy_of(bs[0]));
        int turn = 0, peer_turn = 0;
        auto run = [&] {
          const Tensor& b = bs[static_cast<size_t>(turn++ % copies)];
          if (kind == Kind::bf16) bf16_gemm_nt(xa, b, d);
          else fp8_fp4_gemm_nt(qa, {b, qb.sf}, d);
        };
        // Peer operands: bf16 (or f32) copies of the dequantised inputs, refreshed in the timing.
        Tensor pa = kind == Kind::bf16 ? (dnnl_bf16 ? xa : fa) : Tensor::empty({m, k}, dnnl_bf16 ? DType::bf16 : DType::f32);
        Tensor pb = kind == Kind::bf16 ? (dnnl_bf16 ? xb : fb) : Tensor::empty({n, k}, dnnl_bf16 ? DType::bf16 : DType::f32);
        if (kind == Kind::bf16)
          for (int c = 0; c < copies; ++c) peer_bs.push_back(c == 0 ? pb : copy_of(pb));
        auto peer = [&] {
          const int c = peer_turn++ % copies;
          if (fp8) {
            cast_back_from_fp8_into(qa.values, qa.sf, pa, 1, 128);
            cast_back_from_fp8_into(bs[static_cast<size_t>(c)], qb.sf, pb, 128, 128);
          } else if (kind == Kind::fp4) {
            cast_back_from_fp8_into(qa.values, qa.sf, pa, 1, 32);
            cast_back_from_fp4_into(bs[static_cast<size_t>(c)], qb.sf, pb, 1, 32);
          }
          const Tensor& b = kind == Kind::bf16 ? peer_bs[static_cast<size_t>(c)] : pb;
          if (dnnl_bf16) onednn.bf16(pa, b, dpeer);
          else OneDnnGemm::sgemm(pa, b, dpeer);
        };
        Row row;
        row.kernel = kind == Kind::bf16 ? "bf16_gemm_nt" : fp8 ? "fp8_gemm_nt" : "fp8_fp4_gemm_nt";
        row.dtype = kind == Kind::bf16 ? "bf16" : kind == Kind::fp8 ? "fp8" : fp8 ? "fp8,ue8m0" : "fp8xfp4";
        std::tie(row.time, row.peer_time) = time_interleaved(run, peer, repeats);
        row.peer = kind == Kind::bf16 ? peer_name : "dequant+" + peer_name;
        run();  // the last run used copy (turn - 1); checked below against the same data
        row.calc_diff = corner_diff(d, ra, rb, check_rows, check_cols);
        // bf16 output rounding alone gives ~1e-6 here; formats.md's bar for the same inputs is 1e-5.
        const bool ok = row.calc_diff <= 1e-5;
        row.shape = fmt::format("{}x{}x{}", m, n, k);
        row.threads = num_threads();
        row.sizes = {{"m", m}, {"n", n}, {"k", k}};
        row.notes = {{"ok_vs_oracle", ok ? "yes" : "NO"}, {"out", "bf16"}, {"recipe", kind == Kind::bf16 ? "-" : kind == Kind::fp8 ? "1,128,128" : fp8 ? "1,128,128 ue8m0" : "1,1,32 ue8m0"}};
        // Small M is memory-bound: report GB/s of what must be read (B + scales + A) and
        // written (D) against the read bandwidth; otherwise TFLOPS against bf16 dot peak.
        auto throughput = [&](Row& r, double b_bytes, int weight_copies) {
          if (m <= 16) {
            r.notes["weight_copies"] = std::to_string(weight_copies);
            const double bytes = b_bytes + static_cast<double>(m * k) * 2.0 + static_cast<double>(m * n) * 2.0;
            r.gbps = bytes / (r.time.median_us * 1e3);
            r.ceiling = "read_bw";
            r.notes["tflops"] = fmt::format("{:.4f}", flops / (r.time.median_us * 1e6));
            // Which ceiling binds (on AVX2, M = 16 and even M = 4 are compute-bound), and the
            // time against the roofline max(bytes / read_bw, flops / bf16_flops).
            r.roofline_bytes = bytes, r.roofline_flops = flops;
          } else {
            r.tflops = flops / (r.time.median_us * 1e6);
            r.ceiling = "bf16_flops";
          }
        };
        throughput(row, w_bytes, copies);
        rows_out.push_back(row);

        // Pre-packed weights (moekit's CPU extension, docs/GEMM.md) at medium M, where packing
        // B is a large part of the call, timed alternately against the unpacked call. The
        // packed form is f32 (4 bytes per weight; AMX panels: bf16, 2): memory-bound rows
        // count its bytes and cycle through enough packed copies to stream them from DRAM.
        if (m > 4 && m <= 256 && kind != Kind::fp8_ue8m0) {  // (its packed form is the fp8 row's)
          auto pack = [&] { return kind == Kind::bf16 ? pack_bf16_weights(xb) : pack_fp8_fp4_weights({qb.values, qb.sf}); };
          std::vector<PackedWeights> packed;
          const Timing pack_time = time_it([&] { packed.push_back(pack()); }, 1, 0);  // once: the one-off cost
          const double p_bytes = static_cast<double>(packed[0].bytes());
          const int p_copies = m <= 16 ? static_cast<int>(std::clamp(std::ceil(working_set / p_bytes), 1.0, 1024.0)) : 1;
          while (static_cast<int>(packed.size()) < p_copies) packed.push_back(pack());
          int p_turn = 0;
          auto run_packed = [&] {
            const PackedWeights& w = packed[static_cast<size_t>(p_turn++ % p_copies)];
            if (kind == Kind::bf16) bf16_gemm_packed(xa, w, d);
            else fp8_fp4_gemm_packed(qa, w, d);
          };
          Row prow = row;
          prow.kernel = kind == Kind::bf16 ? "bf16_gemm_packed" : "fp8_fp4_gemm_packed";
          std::tie(prow.time, prow.peer_time) = time_interleaved(run_packed, run, repeats);
          prow.peer = "moekit " + row.kernel + " (unpacked)";
          run_packed();
          prow.calc_diff = corner_diff(d, ra, rb, check_rows, check_cols);
          prow.notes["ok_vs_oracle"] = prow.calc_diff <= 1e-5 ? "yes" : "NO";
          prow.notes["pack_ms"] = fmt::format("{:.1f}", pack_time.median_us / 1e3);
          prow.notes["packed_MiB"] = fmt::format("{:.0f}", p_bytes / (1 << 20));
          throughput(prow, p_bytes, p_copies);
          rows_out.push_back(prow);
        }
      }
    }
  ceilings.remeasure();
  Reporter rep{o.json};
  rep.header("gemm", ceilings.header());
  for (Row& row : rows_out) {
    ceilings.finish(row);
    rep.print(row);
  }
}

}  // namespace moekit::tools

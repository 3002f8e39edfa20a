// `moekit bench formats`: quantisation casts in GB/s against the measured read bandwidth.
// Inputs are max(256 MiB, 4x the last-level cache) (8x the 32 MiB L3 here), so every run
// streams from DRAM.
// Peer: the same call on another moekit path, timed alternately with it: by default the
// portable (scalar-ISA) path, what the code compiles to without the AVX2/AVX-512 kernels;
// --peer-isa avx2 compares the two vector targets on AVX-512 CPUs. Correctness: the first
// rows are re-done by the f64 oracle (src/reference) and compared bit for bit and by calc_diff.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <random>
#include <tuple>

#include "bench_common.h"
#include "moekit/error.h"
#include "moekit/formats.h"
#include "moekit/runtime.h"
#include "peak.h"
#include "reference.h"

namespace moekit::tools {

namespace {

Tensor prefaulted(const Shape& shape, DType dtype) { return Tensor::zeros(shape, dtype); }

bool same_bytes(const Tensor& a, const Tensor& b, int64_t rows) {
  const size_t bytes = static_cast<size_t>(rows * a.stride(0)) * a.element_size();
  return std::memcmp(a.data(), b.data(), bytes) == 0;
}

int64_t bytes_of(const Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

struct CastCase {
  std::string kernel;
  bool fp4 = false;
  bool use_ue8m0 = false;
  int64_t check_rows = 128;  // rows re-done by the oracle (one full scale block)
};

}  // namespace

void bench_formats(const BenchOptions& o) {
  // bf16 input of max(256 MiB, 4x the last-level cache) (quick: 16 MiB), whole scale blocks.
  const int64_t cols = 8192;
  const int64_t block_bytes = cols * 2 * 128;
  const int64_t rows = o.quick ? 1024 : (dram_working_set(int64_t{256} << 20) + block_bytes - 1) / block_bytes * 128;
  const int repeats = o.quick ? 3 : o.repeats;
  // The read- and copy-bandwidth ceilings are re-measured before every row (RunCeilings);
  // rows are printed once the run is over.
  RunCeilings ceilings(false, o.quick, true);
  // The peer: the same call on another of moekit's paths (scalar by default: what the code
  // compiles to without the vector kernels), run alternately with the active one.
  const Isa peer_isa = parse_isa(o.peer_isa);
  if (!isa_supported(peer_isa)) throw Error("bench formats", "--peer-isa", "an instruction set this CPU supports", o.peer_isa);
  const std::string peer_name = fmt::format("moekit {}-ISA", isa_name(peer_isa));
  auto on_peer_isa = [peer_isa](const std::function<void()>& fn) {
    return [peer_isa, fn] {
      ScopedIsa scoped(peer_isa);
      fn();
    };
  };
  std::vector<Row> rows_out;

  const Tensor x = random_bf16(rows, cols, 1, true);
  const CastCase cases[] = {{"per_token_cast_to_fp8", false, false, 128},
                            {"per_token_cast_to_fp8", false, true, 128},
                            {"per_block_cast_to_fp8", false, false, 128},
                            {"per_block_cast_to_fp8", false, true, 128},
                            {"per_channel_cast_to_fp8", false, false, 128},
                            {"per_channel_cast_to_fp8", false, true, 128},
                            {"per_token_cast_to_fp4", true, false, 128},
                            {"per_token_cast_to_fp4", true, true, 128}};  // the MX recipe (ue8m0 scales)
  for (const CastCase& c : cases) {
    const bool block = c.kernel == "per_block_cast_to_fp8", channel = c.kernel == "per_channel_cast_to_fp8";
    const int64_t gran = c.fp4 ? 32 : 128;
    const Tensor q = prefaulted({rows, c.fp4 ? cols / 2 : cols}, c.fp4 ? DType::e2m1x2 : DType::e4m3);
    const Tensor sf = prefaulted(block ? Shape{rows / 128, cols / 128} : channel ? Shape{rows / gran, cols} : Shape{rows, cols / gran}, DType::f32);
    auto run = [&] {
      if (block) per_block_cast_to_fp8_into(x, q, sf, c.use_ue8m0);
      else if (channel) per_channel_cast_to_fp8_into(x, q, sf, c.use_ue8m0, gran);
      else if (c.fp4) per_token_cast_to_fp4_into(x, q, sf, c.use_ue8m0, gran);
      else per_token_cast_to_fp8_into(x, q, sf, c.use_ue8m0, gran);
    };
    ceilings.remeasure();
    Row row;
    row.kernel = c.kernel;
    std::tie(row.time, row.peer_time) = time_interleaved(run, on_peer_isa(run), repeats);
    run();  // leave the fast path's output for the check
    // Oracle on the first check_rows rows (a whole 128-row block / channel group).
    const Tensor xs = x.slice(0, 0, c.check_rows);
    const Quantized want = block ? ref::per_block_cast_to_fp8(xs, c.use_ue8m0)
                           : channel ? ref::per_channel_cast_to_fp8(xs, c.use_ue8m0, gran)
                           : c.fp4 ? ref::per_token_cast_to_fp4(xs, c.use_ue8m0, gran)
                                   : ref::per_token_cast_to_fp8(xs, c.use_ue8m0, gran);
    const int64_t sf_rows = want.sf.size(0);
    const bool exact = same_bytes(q, want.values, c.check_rows) && same_bytes(sf, want.sf, sf_rows);
    const int64_t gm = block ? 128 : channel ? gran : 1, gk = block ? 128 : channel ? 1 : gran;
    row.calc_diff = ref::calc_diff(ref::dequantize(q.slice(0, 0, c.check_rows), sf.slice(0, 0, sf_rows), gm, gk, cols),
                                   ref::dequantize(want.values, want.sf, gm, gk, cols));
    row.shape = fmt::format("{}x{}", rows, cols);
    row.dtype = c.fp4 ? "bf16->fp4" : "bf16->fp8";
    if (c.use_ue8m0) row.dtype += ",ue8m0";
    row.threads = num_threads();
    row.gbps = static_cast<double>(bytes_of(x) + bytes_of(q) + bytes_of(sf)) / (row.time.median_us * 1e3);
    row.ceiling = "read_bw";
    row.peer = peer_name;
    row.sizes = {{"m", rows}, {"k", cols}};
    row.notes = {{"bit_exact_vs_oracle", exact ? "yes" : "NO"}, {"checked_rows", std::to_string(c.check_rows)}};
    rows_out.push_back(row);
  }

  // Dequantisation: fp8 / fp4 values (+ scales) to bf16, and fp4 to f32 (half the columns:
  // the same 4 bytes of output per element pair).
  struct Dequant {
    bool fp4;
    DType out;
  };
  for (const Dequant d : {Dequant{false, DType::bf16}, Dequant{true, DType::bf16}, Dequant{true, DType::f32}}) {
    const bool fp4 = d.fp4;
    const int64_t k = d.out == DType::f32 ? cols : 2 * cols, gran = fp4 ? 32 : 128;
    const Quantized qz = fp4 ? per_token_cast_to_fp4(random_bf16(rows, k, 2, true), false, gran)
                             : per_token_cast_to_fp8(random_bf16(rows, k, 2, true), false, gran);
    const Tensor out = prefaulted({rows, k}, d.out);
    auto run = [&] {
      if (fp4) cast_back_from_fp4_into(qz.values, qz.sf, out, 1, gran);
      else cast_back_from_fp8_into(qz.values, qz.sf, out, 1, gran);
    };
    ceilings.remeasure();
    Row row;
    row.kernel = fp4 ? "cast_back_from_fp4" : "cast_back_from_fp8";
    std::tie(row.time, row.peer_time) = time_interleaved(run, on_peer_isa(run), repeats);
    run();
    const int64_t check = 128;
    const Tensor want = ref::to_tensor(ref::dequantize(qz.values.slice(0, 0, check), qz.sf.slice(0, 0, check), 1, gran, k), check, k, d.out);
    row.calc_diff = calc_diff(out.slice(0, 0, check), want);
    row.shape = fmt::format("{}x{}", rows, k);
    row.dtype = std::string(fp4 ? "fp4" : "fp8") + "->" + dtype_name(d.out);
    row.threads = num_threads();
    row.gbps = static_cast<double>(bytes_of(qz.values) + bytes_of(qz.sf) + bytes_of(out)) / (row.time.median_us * 1e3);
    // (bf16 out is 2-4x the bytes in: the copy bandwidth bounds it, not the read bandwidth)
    row.ceiling = "copy_bw";
    row.peer = peer_name;
    row.sizes = {{"m", rows}, {"k", k}};
    row.notes = {{"bit_exact_vs_oracle", same_bytes(out, want, check) ? "yes" : "NO"}, {"checked_rows", std::to_string(check)}};
    rows_out.push_back(row);
  }
  ceilings.remeasure();
  Reporter rep{o.json};
  rep.header("formats", ceilings.header());
  for (Row& row : rows_out) {
    ceilings.finish(row);
    rep.print(row);
  }
}

}  // namespace moekit::tools

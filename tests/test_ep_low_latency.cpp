// Expert-parallel low-latency mode (ep.md "Low-latency mode", docs/EP.md "Low-latency dispatch /
// combine"), mirroring DeepEP's test_low_latency: every rank runs every test, in the same order
// (they are collective).
//
// Each test builds a "world": every rank's token count, top-k routing (with -1 entries, tokens
// that route nowhere and experts listed twice by one token), routing weights and activations
// are pure functions of (seed, rank). So every rank computes, without any communication, what
// each of its local experts must receive (source rank ascending, then source token, once per
// (token, expert)), the exact bytes of every received row (bf16 as sent, or
// per_token_cast_to_fp8 of it), and the exact bf16 bits combine must return when every expert
// returns its received rows times a per-expert factor (f32 FMAs in k order, rounded once).
// On top of that the checks of ep.md "How the reference tests check it" are made as written
// there (rank-encoded rows, src_info vs the token ids in the data, calc_diff of the combined
// rows against x times the summed valid weights, 20-run hashes).
//
// Rank-encoded rows: the row of token t of rank r holds r in every column but the last four,
// which hold the base-16 digits of t and a 448 marker (so the last 128-column group of an FP8
// row has scale exactly 1 and the digits survive FP8 exactly; r <= 7 survives the other groups).
//
// A collective that throws on one rank makes all ranks skip the rest of that case (an
// MPI_Allreduce of an "ok" flag), so a failure costs at most one timeout, never a hang.
// Combine's expected sum follows docs/EP.md: a token that lists an expert twice got one row
// from it, and only the first of those entries (its weight) counts; -1 entries and experts on
// masked ranks count nothing. With simulated nodes (MOEKIT_EP_RANKS_PER_NODE) the same tests
// run across nodes, where the expectations are identical (docs/EP.md).
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <thread>
#include <vector>

#include "moekit/ep.h"
#include "moekit/error.h"
#include "moekit/formats.h"
#include "moekit/tensor.h"
#include "ep_test_util.h"

namespace moekit::ep {
namespace {

using namespace testing;

// ------------------------------------------------------------------ MPI helpers

// A barrier that sleeps while it waits (a rank idling through other ranks' work must not take
// their CPU: 8 ranks share 2 cores).
void polite_barrier(MPI_Comm comm = MPI_COMM_WORLD) {
  MPI_Request req;
  MPI_Ibarrier(comm, &req);
  for (;;) {
    int flag = 0;
    MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
    if (flag) return;
    ::usleep(1000);
  }
}

// ------------------------------------------------------------------ deterministic random

// ------------------------------------------------------------------ tensors

std::string shape_of(const Tensor& t) { return t.defined() ? t.str() : std::string("(undefined)"); }

// Address of element [a, b] of a 2-D tensor, or of [a, b, 0] of a 3-D one.
const char* at3(const Tensor& t, int64_t a, int64_t b) {
  const int64_t off = a * t.stride(0) + b * t.stride(1);
  return static_cast<const char*>(t.data()) + off * static_cast<int64_t>(t.element_size());
}
const char* at2(const Tensor& t, int64_t r) { return static_cast<const char*>(t.data()) + r * t.stride(0) * static_cast<int64_t>(t.element_size()); }

uint16_t bf16_bits(const Tensor& t, int64_t r, int64_t c) { return reinterpret_cast<const uint16_t*>(at2(t, r))[c]; }

constexpr uint16_t kBf16NaN = 0x7fc0;

// ------------------------------------------------------------------ buffers

BufferGuard make_ll_buffer(int64_t rdma_bytes, BufferOptions options = {}, int64_t nvl_bytes = 1 << 20) {
  options.low_latency_mode = true;
  BufferGuard g;
  g.buf = std::make_unique<Buffer>(MPI_COMM_WORLD, nvl_bytes, rdma_bytes, options);
  return g;
}



// ------------------------------------------------------------------ formats and completion modes

enum class Fmt { bf16, fp8, fp8_round, fp8_ue8m0 };
enum class Completion { sync, async, hook };

constexpr Fmt kFmts[] = {Fmt::bf16, Fmt::fp8, Fmt::fp8_round, Fmt::fp8_ue8m0};
constexpr Completion kCompletions[] = {Completion::sync, Completion::async, Completion::hook};

bool is_fp8(Fmt f) { return f != Fmt::bf16; }
bool rounds_scale(Fmt f) { return f == Fmt::fp8_round || f == Fmt::fp8_ue8m0; }
bool is_ue8m0(Fmt f) { return f == Fmt::fp8_ue8m0; }

const char* fmt_name(Fmt f) {
  switch (f) {
    case Fmt::bf16: return "bf16";
    case Fmt::fp8: return "fp8";
    case Fmt::fp8_round: return "fp8+round_scale";
    case Fmt::fp8_ue8m0: return "fp8+round_scale+use_ue8m0";
  }
  return "?";
}

const char* completion_name(Completion c) {
  switch (c) {
    case Completion::sync: return "sync";
    case Completion::async: return "async_finish";
    case Completion::hook: return "return_recv_hook";
  }
  return "?";
}

// ------------------------------------------------------------------ the world

// Rewrites the top-k row [k] (and its weights) of token t of rank `rank` after the random
// routing drew them.
using Router = std::function<void(int rank, int64_t t, int64_t* row, float* weights)>;

struct LLSpec {
  int64_t hidden = 384;
  int experts_per_rank = 3;
  int topk = 6;
  int64_t max_tokens = 12;
  std::vector<int64_t> tokens;  // per rank, <= max_tokens
  uint64_t seed = 1;
  Data data = Data::random;
  double p_drop_entry = 0.15;  // an entry becomes -1
  double p_drop_token = 0.05;  // a token routes nowhere (all -1)
  double p_repeat = 0.12;      // an entry repeats an earlier entry of the same token
  Router router;               // overrides the random routing when set
};

struct LLWorld {
  LLSpec spec;
  int R = 0, El = 0, E = 0, k = 0;
  int64_t H = 0, max = 0;
  std::vector<std::vector<int64_t>> topk;   // [rank][t * k + j]
  std::vector<std::vector<float>> weights;  // [rank][t * k + j]
  std::vector<Tensor> x;                    // [rank] bf16 [T, H]

  int64_t T(int i) const { return spec.tokens[static_cast<size_t>(i)]; }
  int64_t expert_of(int i, int64_t t, int j) const { return topk[static_cast<size_t>(i)][static_cast<size_t>(t * k + j)]; }
  float weight_of(int i, int64_t t, int j) const { return weights[static_cast<size_t>(i)][static_cast<size_t>(t * k + j)]; }
  // Entry j of token t is the first occurrence of its (valid) expert in the token's list.
  bool first_occurrence(int i, int64_t t, int j) const {
    const int64_t e = expert_of(i, t, j);
    if (e < 0) return false;
    for (int q = 0; q < j; ++q)
      if (expert_of(i, t, q) == e) return false;
    return true;
  }
  Tensor topk_tensor() const { return tensor_of(topk[static_cast<size_t>(my_rank())], {T(my_rank()), k}, DType::i64); }
  Tensor weights_tensor() const { return tensor_of(weights[static_cast<size_t>(my_rank())], {T(my_rank()), k}, DType::f32); }
  int64_t slots() const { return max * R; }
  int64_t hint() const { return get_low_latency_rdma_size_hint(max, H, R, E); }
};

LLWorld make_ll_world(LLSpec spec) {
  LLWorld w;
  w.R = num_ranks();
  if (spec.tokens.size() != static_cast<size_t>(w.R)) throw std::logic_error("LLSpec.tokens needs one entry per rank");
  w.El = spec.experts_per_rank;
  w.E = w.El * w.R;
  w.k = spec.topk;
  w.H = spec.hidden;
  w.max = spec.max_tokens;
  if (w.k > w.E && !spec.router) throw std::logic_error("top-k larger than the expert count");
  for (int i = 0; i < w.R; ++i) {
    const int64_t T = spec.tokens[static_cast<size_t>(i)];
    if (T > w.max) throw std::logic_error("a rank has more tokens than max_tokens");
    Rng rng{hash4(spec.seed, 0x11a7, static_cast<uint64_t>(i), 0)};
    std::vector<int64_t> idx(static_cast<size_t>(T * w.k), -1);
    std::vector<float> wt(static_cast<size_t>(T * w.k));
    for (int64_t t = 0; t < T; ++t) {
      int64_t* row = idx.data() + t * w.k;
      const bool nowhere = rng.unit() < spec.p_drop_token;
      std::vector<int64_t> pool(static_cast<size_t>(w.E));
      std::iota(pool.begin(), pool.end(), 0);
      for (int j = 0; j < w.k && j < w.E; ++j) {
        const size_t pick = static_cast<size_t>(j) + static_cast<size_t>(rng.below(pool.size() - static_cast<size_t>(j)));
        std::swap(pool[static_cast<size_t>(j)], pool[pick]);
        int64_t e = pool[static_cast<size_t>(j)];
        if (j > 0 && rng.unit() < spec.p_repeat) e = row[rng.below(static_cast<uint64_t>(j))];
        if (nowhere || rng.unit() < spec.p_drop_entry) e = -1;
        row[j] = e;
        // Full 24-bit mantissas (so w * y is inexact in f32 and one FMA differs from a
        // multiply then an add); nonzero even for -1 entries (combine must skip those).
        wt[static_cast<size_t>(t * w.k + j)] = 0.25f + static_cast<float>(rng.unit());
      }
      if (spec.router) spec.router(i, t, row, wt.data() + t * w.k);
    }
    Tensor x = Tensor::empty({T, w.H}, DType::bf16);
    for (int64_t t = 0; t < T; ++t) fill_row(spec.data, spec.seed, i, t, w.H, x.data_ptr<uint16_t>() + t * w.H);
    w.topk.push_back(std::move(idx));
    w.weights.push_back(std::move(wt));
    w.x.push_back(std::move(x));
  }
  w.spec = std::move(spec);
  return w;
}

std::vector<int64_t> tokens_per_rank(const std::function<int64_t(int)>& f) {
  std::vector<int64_t> t;
  for (int i = 0; i < num_ranks(); ++i) t.push_back(f(i));
  return t;
}

// T = 0 on rank 0 (and every fourth), T = max on rank 1 (and every fourth), others between.
std::vector<int64_t> mixed_tokens(int64_t max) {
  return tokens_per_rank([max](int i) -> int64_t {
    if (i % 4 == 0) return 0;
    if (i % 4 == 1) return max;
    return 1 + (5 * i + 3) % max;
  });
}

// The fields every test sets; the routing probabilities and router keep their defaults.
LLSpec ll_spec(int64_t hidden, int experts_per_rank, int topk, int64_t max_tokens, std::vector<int64_t> tokens, uint64_t seed,
               Data data = Data::random) {
  LLSpec s;
  s.hidden = hidden;
  s.experts_per_rank = experts_per_rank;
  s.topk = topk;
  s.max_tokens = max_tokens;
  s.tokens = std::move(tokens);
  s.seed = seed;
  s.data = data;
  return s;
}

std::vector<int> no_mask() { return std::vector<int>(static_cast<size_t>(num_ranks()), 0); }

// What rank `me` must receive, per local expert: (source rank, source token), source rank
// ascending then token ascending, once per (token, expert); nothing from masked ranks.
struct LLExpected {
  std::vector<std::vector<std::pair<int, int64_t>>> rows;  // [El]
  std::vector<std::vector<int64_t>> from;                  // [El][R] rows from each rank
  std::vector<int32_t> counts;                             // [El]
};

LLExpected expect_recv(const LLWorld& w, int me, const std::vector<int>& masked) {
  LLExpected ex;
  ex.rows.resize(static_cast<size_t>(w.El));
  ex.from.assign(static_cast<size_t>(w.El), std::vector<int64_t>(static_cast<size_t>(w.R), 0));
  for (int el = 0; el < w.El; ++el) {
    const int64_t e = static_cast<int64_t>(me) * w.El + el;
    for (int s = 0; s < w.R; ++s) {
      if (masked[static_cast<size_t>(s)]) continue;
      for (int64_t t = 0; t < w.T(s); ++t) {
        bool chosen = false;
        for (int j = 0; j < w.k; ++j) chosen |= w.expert_of(s, t, j) == e;
        if (!chosen) continue;
        ex.rows[static_cast<size_t>(el)].emplace_back(s, t);
        ++ex.from[static_cast<size_t>(el)][static_cast<size_t>(s)];
      }
    }
    ex.counts.push_back(static_cast<int32_t>(ex.rows[static_cast<size_t>(el)].size()));
  }
  return ex;
}

// What every source rank sends, in the call's format.
struct SourceForms {
  std::vector<Quantized> q;    // [rank] e4m3 [T, H] + f32 sf [T, G] (powers of two with round_scale)
  std::vector<Tensor> packed;  // [rank] i32 [T, ceil(G / 4)] with use_ue8m0
};

SourceForms source_forms(const LLWorld& w, Fmt f) {
  SourceForms sf;
  sf.q.resize(static_cast<size_t>(w.R));
  sf.packed.resize(static_cast<size_t>(w.R));
  if (!is_fp8(f)) return sf;
  for (int s = 0; s < w.R; ++s) {
    if (w.T(s) == 0) continue;
    sf.q[static_cast<size_t>(s)] = per_token_cast_to_fp8(w.x[static_cast<size_t>(s)], rounds_scale(f), 128);
    if (is_ue8m0(f)) sf.packed[static_cast<size_t>(s)] = pack_ue8m0_to_int(sf.q[static_cast<size_t>(s)].sf);
  }
  return sf;
}

// ------------------------------------------------------------------ dispatch

LowLatencyDispatchArgs dispatch_args(const LLWorld& w, Fmt f, Completion c, Tensor stats = Tensor()) {
  LowLatencyDispatchArgs a;
  a.x = w.x[static_cast<size_t>(my_rank())];
  a.topk_idx = w.topk_tensor();
  a.num_max_dispatch_tokens_per_rank = w.max;
  a.num_experts = w.E;
  a.cumulative_local_expert_recv_stats = std::move(stats);
  a.use_fp8 = is_fp8(f);
  a.round_scale = rounds_scale(f);
  a.use_ue8m0 = is_ue8m0(f);
  a.async_finish = c == Completion::async;
  a.return_recv_hook = c == Completion::hook;
  return a;
}

// Completes a dispatch or combine result the way its mode says.
template <class Result>
void complete(Result& r, Completion c) {
  if (c == Completion::hook) {
    ASSERT_TRUE(static_cast<bool>(r.hook)) << "return_recv_hook gave no hook";
    r.hook();
  } else {
    if (c == Completion::sync) {
      EXPECT_FALSE(static_cast<bool>(r.hook)) << "a hook without return_recv_hook";
    }
    r.event.wait();
    EXPECT_TRUE(r.event.done());
  }
}

LowLatencyDispatchResult run_dispatch(Buffer& buf, const LowLatencyDispatchArgs& a, Completion c) {
  LowLatencyDispatchResult r = buf.low_latency_dispatch(a);
  complete(r, c);
  return r;
}

// Every check of one dispatch result against the world (masked: ranks this rank masks).
void check_ll_dispatch(const LowLatencyDispatchResult& r, const LLWorld& w, Fmt f, const std::vector<int>& masked) {
  const int me = my_rank(), R = w.R, El = w.El;
  const int64_t H = w.H, slots = w.slots(), G = (H + 127) / 128, W = (G + 3) / 4;
  ASSERT_TRUE(r.recv_x.defined());
  ASSERT_EQ(r.recv_x.dtype(), is_fp8(f) ? DType::e4m3 : DType::bf16) << shape_of(r.recv_x);
  ASSERT_EQ(r.recv_x.shape(), (Shape{El, slots, H})) << shape_of(r.recv_x);
  ASSERT_EQ(r.recv_x.stride(2), 1);
  if (!is_fp8(f)) {
    EXPECT_FALSE(r.recv_x_scales.defined()) << shape_of(r.recv_x_scales);
  } else {
    ASSERT_TRUE(r.recv_x_scales.defined());
    ASSERT_EQ(r.recv_x_scales.dtype(), is_ue8m0(f) ? DType::i32 : DType::f32) << shape_of(r.recv_x_scales);
    ASSERT_EQ(r.recv_x_scales.shape(), (Shape{El, slots, is_ue8m0(f) ? W : G})) << shape_of(r.recv_x_scales);
    ASSERT_EQ(r.recv_x_scales.stride(2), 1);
  }
  ASSERT_TRUE(r.recv_count.defined());
  ASSERT_EQ(r.recv_count.dtype(), DType::i32);
  ASSERT_EQ(r.recv_count.shape(), (Shape{El}));
  const LowLatencyHandle& h = r.handle;
  ASSERT_TRUE(h.defined());
  EXPECT_EQ(h.num_max_dispatch_tokens_per_rank, w.max);
  EXPECT_EQ(h.hidden, H);
  EXPECT_EQ(h.num_experts, w.E);
  ASSERT_TRUE(h.src_info.defined());
  ASSERT_EQ(h.src_info.dtype(), DType::i32);
  ASSERT_EQ(h.src_info.shape(), (Shape{El, slots})) << shape_of(h.src_info);
  ASSERT_TRUE(h.layout_range.defined());
  ASSERT_EQ(h.layout_range.dtype(), DType::i64);
  ASSERT_EQ(h.layout_range.shape(), (Shape{El, R})) << shape_of(h.layout_range);

  const LLExpected ex = expect_recv(w, me, masked);
  const std::vector<int32_t> counts = vector_of<int32_t>(r.recv_count);
  EXPECT_EQ(counts, ex.counts) << "recv_count (per local expert)";

  // layout_range: begin << 32 | count per (local expert, source rank), begins = prefix sums.
  const std::vector<int64_t> range = vector_of<int64_t>(h.layout_range);
  for (int el = 0; el < El; ++el) {
    int64_t begin = 0;
    for (int s = 0; s < R; ++s) {
      const int64_t v = range[static_cast<size_t>(el * R + s)];
      const int64_t want = ex.from[static_cast<size_t>(el)][static_cast<size_t>(s)];
      EXPECT_EQ(v & 0xffffffffLL, want) << "layout_range count of local expert " << el << " from rank " << s;
      if (want > 0) {
        EXPECT_EQ(v >> 32, begin) << "layout_range begin of local expert " << el << " from rank " << s;
      } else {
        EXPECT_GE(v >> 32, 0) << "layout_range begin of local expert " << el << " from rank " << s;
        EXPECT_LE(v >> 32, ex.counts[static_cast<size_t>(el)]) << "layout_range begin of local expert " << el << " from rank " << s;
      }
      begin += want;
    }
  }

  // Rows: src_info, and the bytes (and scales) each source sent.
  const SourceForms forms = source_forms(w, f);
  const std::vector<int32_t> src_info = vector_of<int32_t>(h.src_info);
  const size_t row_bytes = static_cast<size_t>(H) * (is_fp8(f) ? 1 : 2);
  int64_t bad_src = 0, bad_row = 0, bad_scale = 0;
  std::string first_src, first_row, first_scale;
  for (int el = 0; el < El; ++el) {
    const auto& rows = ex.rows[static_cast<size_t>(el)];
    if (counts[static_cast<size_t>(el)] != static_cast<int32_t>(rows.size())) continue;  // reported above
    for (size_t i = 0; i < rows.size(); ++i) {
      const auto [s, t] = rows[i];
      std::ostringstream where;
      where << "local expert " << el << " row " << i << " (source rank " << s << ", token " << t << ")";
      if (src_info[static_cast<size_t>(el * slots) + i] != t && bad_src++ == 0)
        first_src = where.str() + ": src_info " + std::to_string(src_info[static_cast<size_t>(el * slots) + i]);
      const auto ri = static_cast<int64_t>(i);
      const char* got = at3(r.recv_x, el, ri);
      const char* want = is_fp8(f) ? at2(forms.q[static_cast<size_t>(s)].values, t) : at2(w.x[static_cast<size_t>(s)], t);
      if (std::memcmp(got, want, row_bytes) != 0 && bad_row++ == 0) first_row = where.str();
      if (is_fp8(f)) {
        const Tensor& want_sf = is_ue8m0(f) ? forms.packed[static_cast<size_t>(s)] : forms.q[static_cast<size_t>(s)].sf;
        const size_t sf_bytes = static_cast<size_t>(is_ue8m0(f) ? W : G) * 4;
        if (std::memcmp(at3(r.recv_x_scales, el, ri), at2(want_sf, t), sf_bytes) != 0 && bad_scale++ == 0)
          first_scale = where.str();
      }
    }
  }
  EXPECT_EQ(bad_src, 0) << "received rows whose src_info is not the source token; first: " << first_src;
  EXPECT_EQ(bad_row, 0) << "received rows that differ from what the source sent ("
                        << (is_fp8(f) ? "per_token_cast_to_fp8 of its row" : "its bf16 row") << "); first: " << first_row;
  if (is_fp8(f)) {
    EXPECT_EQ(bad_scale, 0) << "received scales that differ from "
                            << (is_ue8m0(f) ? "pack_ue8m0_to_int of the power-of-two scales" : "per_token_cast_to_fp8's scales")
                            << "; first: " << first_scale;
  }

  // ep.md "Rank-encoded data": segment s (layout_range) holds value s; the id columns hold the
  // source token ids, ascending, equal to src_info. Read through the received data only.
  if (w.spec.data != Data::rank_encoded) return;
  for (int el = 0; el < El; ++el) {
    const int32_t n = std::min<int32_t>(counts[static_cast<size_t>(el)], static_cast<int32_t>(slots));
    if (n <= 0) continue;
    Tensor seen = r.recv_x.select(0, el).slice(0, 0, n);
    if (is_fp8(f)) seen = cast_back_from_fp8(seen, r.recv_x_scales.select(0, el).slice(0, 0, n), DType::bf16);
    int64_t next = 0;
    for (int s = 0; s < R; ++s) {
      const int64_t v = range[static_cast<size_t>(el * R + s)], begin = v >> 32, count = v & 0xffffffffLL;
      if (count == 0) continue;
      ASSERT_EQ(begin, next) << "local expert " << el << ": segments of layout_range do not tile the rows in rank order";
      ASSERT_LE(begin + count, n);
      int64_t previous = -1;
      for (int64_t row = begin; row < begin + count; ++row) {
        for (int64_t c = 0; c < H - kIdColumns; ++c)
          if (bf16_to_f32(bf16_bits(seen, row, c)) != static_cast<float>(s)) {
            ADD_FAILURE() << "local expert " << el << " row " << row << " of source segment " << s << ", column " << c << ": "
                          << bf16_to_f32(bf16_bits(seen, row, c)) << ", expected " << s;
            return;
          }
        ASSERT_EQ(bf16_to_f32(bf16_bits(seen, row, H - 1)), 448.0f) << "local expert " << el << " row " << row;
        const int64_t id = static_cast<int64_t>(bf16_to_f32(bf16_bits(seen, row, H - 4))) * 256 +
                           static_cast<int64_t>(bf16_to_f32(bf16_bits(seen, row, H - 3))) * 16 +
                           static_cast<int64_t>(bf16_to_f32(bf16_bits(seen, row, H - 2)));
        ASSERT_EQ(id, src_info[static_cast<size_t>(el * slots + row)])
            << "local expert " << el << " row " << row << " (segment " << s << "): token id in the data vs src_info";
        ASSERT_GT(id, previous) << "local expert " << el << " row " << row << " (segment " << s << "): source tokens not ascending";
        previous = id;
      }
      next = begin + count;
    }
    EXPECT_EQ(next, n) << "local expert " << el << ": layout_range segments do not cover recv_count rows";
  }
}

// Hash of everything valid in a dispatch result (rows past recv_count are unspecified).
uint64_t dispatch_fingerprint(const LowLatencyDispatchResult& r, uint64_t h = 0xcbf29ce484222325ULL) {
  const std::vector<int32_t> counts = vector_of<int32_t>(r.recv_count);
  h = fnv1a(h, counts.data(), counts.size() * 4);
  const std::vector<int64_t> range = vector_of<int64_t>(r.handle.layout_range);
  h = fnv1a(h, range.data(), range.size() * 8);
  for (size_t el = 0; el < counts.size(); ++el) {
    const int64_t n = std::clamp<int64_t>(counts[el], 0, r.recv_x.size(1));
    const auto e = static_cast<int64_t>(el);
    for (int64_t i = 0; i < n; ++i) {
      h = fnv1a(h, at3(r.recv_x, e, i), static_cast<size_t>(r.recv_x.size(2)) * r.recv_x.element_size());
      if (r.recv_x_scales.defined())
        h = fnv1a(h, at3(r.recv_x_scales, e, i), static_cast<size_t>(r.recv_x_scales.size(2)) * r.recv_x_scales.element_size());
      h = fnv1a(h, at3(r.handle.src_info, e, i), 4);
    }
  }
  return h;
}

// ------------------------------------------------------------------ combine

// What the experts return: their received rows unchanged, times a per-expert factor, or
// times factors of equal size and opposite signs for experts 2p and 2p + 1 (a token that
// chose both gets (w - w') * y: a sum that cancels, so its bf16 result shows every f32
// rounding of the terms and their order).
enum class Expert { identity, scaled, cancelling };

// Expert e returns its received rows times this factor (exact in f32).
float expert_factor(int64_t e, Expert kind) {
  switch (kind) {
    case Expert::identity: return 1.0f;
    case Expert::scaled: return 0.5f + 0.125f * static_cast<float>((e * 5 + 3) % 11);
    case Expert::cancelling: return (e % 2 ? -1.0f : 1.0f) * (0.5f + 0.125f * static_cast<float>((e / 2 * 5 + 3) % 11));
  }
  return 0.0f;
}

uint16_t expert_output(float factor, uint16_t seen) { return f32_to_bf16(factor * bf16_to_f32(seen)); }

// The expert side: y[el, row] = factor(e) * (the received row, FP8 cast back to bf16) for the
// valid rows of dst (bf16 [El, slots, H]); every other row NaN (combine must never read them).
void write_expert_outputs(const Tensor& dst, const LowLatencyDispatchResult& r, const LLWorld& w, Fmt f, Expert kind) {
  const int me = my_rank();
  ASSERT_EQ(dst.dtype(), DType::bf16);
  ASSERT_EQ(dst.shape(), (Shape{w.El, w.slots(), w.H})) << shape_of(dst);
  ASSERT_EQ(dst.stride(2), 1);
  for (int64_t el = 0; el < w.El; ++el)
    for (int64_t i = 0; i < w.slots(); ++i) {
      auto* row = reinterpret_cast<uint16_t*>(const_cast<char*>(at3(dst, el, i)));
      std::fill_n(row, w.H, kBf16NaN);
    }
  const std::vector<int32_t> counts = vector_of<int32_t>(r.recv_count);
  for (int64_t el = 0; el < w.El; ++el) {
    const int64_t n = std::clamp<int64_t>(counts[static_cast<size_t>(el)], 0, w.slots());
    if (n == 0) continue;
    Tensor seen = r.recv_x.select(0, el).slice(0, 0, n);
    if (is_fp8(f)) seen = cast_back_from_fp8(seen, r.recv_x_scales.select(0, el).slice(0, 0, n), DType::bf16);
    const float factor = expert_factor(static_cast<int64_t>(me) * w.El + el, kind);
    for (int64_t i = 0; i < n; ++i) {
      auto* out = reinterpret_cast<uint16_t*>(const_cast<char*>(at3(dst, el, i)));
      for (int64_t c = 0; c < w.H; ++c) out[c] = expert_output(factor, bf16_bits(seen, i, c));
    }
  }
}

// What an expert receives from this rank, as bf16: x, or its FP8 quantisation cast back.
Tensor owner_seen(const LLWorld& w, Fmt f) {
  const Tensor& x = w.x[static_cast<size_t>(my_rank())];
  if (!is_fp8(f) || x.size(0) == 0) return x;
  const Quantized q = per_token_cast_to_fp8(x, rounds_scale(f), 128);
  return cast_back_from_fp8(q.values, q.sf, DType::bf16);
}

// out[t] = bf16(sum_k w[t, k] * y(t, e_k)) with one f32 FMA per term, k ascending, skipping -1,
// repeated experts and experts on masked ranks (docs/EP.md).
std::vector<uint16_t> expected_combined(const LLWorld& w, Fmt f, Expert kind, const std::vector<int>& masked) {
  const int me = my_rank();
  const int64_t T = w.T(me), H = w.H;
  const Tensor seen = owner_seen(w, f);
  std::vector<uint16_t> out(static_cast<size_t>(T * H));
  std::vector<std::pair<float, float>> terms;  // (weight, factor)
  for (int64_t t = 0; t < T; ++t) {
    terms.clear();
    for (int j = 0; j < w.k; ++j) {
      if (!w.first_occurrence(me, t, j)) continue;
      const int64_t e = w.expert_of(me, t, j);
      if (masked[static_cast<size_t>(e / w.El)]) continue;
      terms.emplace_back(w.weight_of(me, t, j), expert_factor(e, kind));
    }
    for (int64_t c = 0; c < H; ++c) {
      const uint16_t v = bf16_bits(seen, t, c);
      float acc = 0.0f;
      for (const auto& [wt, factor] : terms) acc = std::fma(wt, bf16_to_f32(expert_output(factor, v)), acc);
      out[static_cast<size_t>(t * H + c)] = f32_to_bf16(acc);
    }
  }
  return out;
}

void expect_combined(const Tensor& out, const std::vector<uint16_t>& want, const LLWorld& w, const std::string& what) {
  const int64_t T = w.T(my_rank()), H = w.H;
  ASSERT_TRUE(out.defined()) << what;
  ASSERT_EQ(out.dtype(), DType::bf16) << what;
  ASSERT_EQ(out.shape(), (Shape{T, H})) << what << ": " << shape_of(out);
  ASSERT_EQ(out.stride(1), 1) << what;
  int64_t bad = 0, ft = -1, fc = -1;
  uint16_t fg = 0, fw = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < H; ++c) {
      const uint16_t g = bf16_bits(out, t, c), x = want[static_cast<size_t>(t * H + c)];
      if (g != x && bad++ == 0) ft = t, fc = c, fg = g, fw = x;
    }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << T * H << " combined elements differ from the f32 FMA sum (k order, one bf16 rounding); first: token "
                    << ft << " column " << fc << ": got " << bf16_to_f32(fg) << " (0x" << std::hex << fg << "), expected " << std::dec
                    << bf16_to_f32(fw) << " (0x" << std::hex << fw << std::dec << ")";
}

// ep.md: calc_diff(x * sum of valid weights, out) < 1e-5 when every expert returns its rows
// unchanged (bf16 dispatch).
void expect_spec_calc_diff(const Tensor& out, const LLWorld& w, const std::vector<int>& masked) {
  const int me = my_rank();
  const int64_t T = w.T(me), H = w.H;
  if (T == 0 || !out.defined() || out.shape() != Shape{T, H}) return;
  std::vector<float> ref(static_cast<size_t>(T * H)), got(static_cast<size_t>(T * H));
  const Tensor& x = w.x[static_cast<size_t>(me)];
  for (int64_t t = 0; t < T; ++t) {
    float sum = 0.0f;
    for (int j = 0; j < w.k; ++j)
      if (w.first_occurrence(me, t, j) && !masked[static_cast<size_t>(w.expert_of(me, t, j) / w.El)]) sum += w.weight_of(me, t, j);
    for (int64_t c = 0; c < H; ++c) {
      ref[static_cast<size_t>(t * H + c)] = bf16_to_f32(bf16_bits(x, t, c)) * sum;
      got[static_cast<size_t>(t * H + c)] = bf16_to_f32(bf16_bits(out, t, c));
    }
  }
  const double diff = calc_diff(Tensor::from_blob(ref.data(), {T, H}, DType::f32), Tensor::from_blob(got.data(), {T, H}, DType::f32));
  EXPECT_LT(diff, 1e-5) << "calc_diff(x * sum of valid weights, combined_x)";
}

LowLatencyCombineArgs combine_args(const LLWorld& w, const LowLatencyDispatchResult& r, const Tensor& x, Completion c) {
  LowLatencyCombineArgs a;
  a.x = x;
  a.topk_idx = w.topk_tensor();
  a.topk_weights = w.weights_tensor();
  a.handle = r.handle;
  a.async_finish = c == Completion::async;
  a.return_recv_hook = c == Completion::hook;
  return a;
}

LowLatencyCombineResult run_combine(Buffer& buf, const LowLatencyCombineArgs& a, Completion c) {
  LowLatencyCombineResult r = buf.low_latency_combine(a);
  complete(r, c);
  return r;
}

// Expert outputs in private memory, then combine (the most common path).
LowLatencyCombineResult combine_private(Buffer& buf, const LLWorld& w, const LowLatencyDispatchResult& r, Fmt f, Expert kind,
                                        Completion c) {
  Tensor y = Tensor::empty({w.El, w.slots(), w.H}, DType::bf16);
  write_expert_outputs(y, r, w, f, kind);
  return run_combine(buf, combine_args(w, r, y, c), c);
}

// Expert outputs written into get_next_low_latency_combine_buffer, combine with zero_copy.
LowLatencyCombineResult combine_zero_copy(Buffer& buf, const LLWorld& w, const LowLatencyDispatchResult& r, Fmt f, Expert kind,
                                          Completion c) {
  Tensor y = buf.get_next_low_latency_combine_buffer(r.handle);
  write_expert_outputs(y, r, w, f, kind);
  LowLatencyCombineArgs a = combine_args(w, r, y, c);
  a.zero_copy = true;
  return run_combine(buf, a, c);
}

std::vector<uint16_t> bits_of(const Tensor& out) {
  std::vector<uint16_t> v;
  if (!out.defined() || out.dim() != 2) return v;
  for (int64_t t = 0; t < out.size(0); ++t)
    for (int64_t c = 0; c < out.size(1); ++c) v.push_back(bf16_bits(out, t, c));
  return v;
}

// ------------------------------------------------------------------ one dispatch + combine case

struct CaseResult {
  LowLatencyDispatchResult dispatch;
  bool ok = false;  // every collective step completed on every rank
};

// Dispatch (checked), then combine with per-expert factors from private memory (checked
// exactly); for bf16 also the spec's identity combine straight from recv_x (in place).
CaseResult run_case(Buffer& buf, const LLWorld& w, Fmt f, Completion c, const std::vector<int>& masked, Tensor stats = Tensor(),
                    MPI_Comm comm = MPI_COMM_WORLD) {
  CaseResult out;
  if (!collective_step(std::string("low_latency_dispatch (") + fmt_name(f) + ", " + completion_name(c) + ")",
                       [&] { out.dispatch = run_dispatch(buf, dispatch_args(w, f, c, stats), c); }, comm))
    return out;
  {
    SCOPED_TRACE("dispatch");
    check_ll_dispatch(out.dispatch, w, f, masked);
  }
  LowLatencyCombineResult comb;
  if (!collective_step("low_latency_combine", [&] { comb = combine_private(buf, w, out.dispatch, f, Expert::scaled, c); }, comm)) return out;
  {
    SCOPED_TRACE("combine (per-expert factors, private x)");
    expect_combined(comb.combined_x, expected_combined(w, f, Expert::scaled, masked), w, "combined_x");
  }
  if (f == Fmt::bf16) {
    LowLatencyCombineResult ident;
    if (!collective_step("low_latency_combine (identity, x = recv_x)",
                         [&] { ident = run_combine(buf, combine_args(w, out.dispatch, out.dispatch.recv_x, c), c); }, comm))
      return out;
    SCOPED_TRACE("combine (experts return recv_x unchanged, in place)");
    expect_combined(ident.combined_x, expected_combined(w, f, Expert::identity, masked), w, "combined_x");
    expect_spec_calc_diff(ident.combined_x, w, masked);
  }
  out.ok = true;
  return out;
}

// ------------------------------------------------------------------ tests: hint and masks (local)

TEST(EpLowLatency, SizeHintAndMaskBuffer) {
  const int R = num_ranks(), me = my_rank();
  const int64_t hint = get_low_latency_rdma_size_hint(16, 384, R, 4 * R);
  EXPECT_GT(hint, 0);
  EXPECT_GE(get_low_latency_rdma_size_hint(16, 7168, R, 4 * R), hint);
  EXPECT_GE(get_low_latency_rdma_size_hint(32, 384, R, 4 * R), hint);
  EXPECT_EQ(get_low_latency_rdma_size_hint(16, 384, R, 4 * R), hint) << "not a pure function of its arguments";
  EXPECT_EP_ERROR(get_low_latency_rdma_size_hint(0, 384, R, 4 * R));
  EXPECT_EP_ERROR(get_low_latency_rdma_size_hint(16, 0, R, 4 * R));
  EXPECT_EP_ERROR(get_low_latency_rdma_size_hint(16, 384, R, 0));
  // Sizes whose layout arithmetic would overflow (and wrap to a small hint).
  EXPECT_EP_ERROR(get_low_latency_rdma_size_hint(int64_t{1} << 61, 128, R, 4 * R));
  EXPECT_EP_ERROR(get_low_latency_rdma_size_hint(16, int64_t{1} << 58, R, 4 * R));
  if (R > 1) EXPECT_EP_ERROR(get_low_latency_rdma_size_hint(16, 384, R, 4 * R + 1));

  BufferGuard buf = make_ll_buffer(hint);
  const std::vector<int32_t> zeros(static_cast<size_t>(R), 0);
  Tensor q = buf->low_latency_query_mask_buffer();
  ASSERT_TRUE(q.defined());
  EXPECT_EQ(q.dtype(), DType::i32);
  EXPECT_EQ(q.shape(), (Shape{R}));
  EXPECT_EQ(vector_of<int32_t>(q), zeros) << "a fresh buffer masks nobody";
  EXPECT_EP_ERROR(buf->low_latency_update_mask_buffer(me));  // a rank cannot mask itself
  EXPECT_EP_ERROR(buf->low_latency_update_mask_buffer(-1));
  EXPECT_EP_ERROR(buf->low_latency_update_mask_buffer(R));
  EXPECT_EQ(vector_of<int32_t>(buf->low_latency_query_mask_buffer()), zeros) << "failed updates changed the mask";
  if (R > 1) {
    const int other = (me + 1) % R;
    buf->low_latency_update_mask_buffer(other);
    std::vector<int32_t> want = zeros;
    want[static_cast<size_t>(other)] = 1;
    EXPECT_EQ(vector_of<int32_t>(buf->low_latency_query_mask_buffer()), want);
    EXPECT_EQ(vector_of<int32_t>(q), zeros) << "an earlier query result is a snapshot";
    buf->low_latency_update_mask_buffer(other, false);
    EXPECT_EQ(vector_of<int32_t>(buf->low_latency_query_mask_buffer()), zeros) << "update_mask_buffer(rank, false) unmasks";
    buf->low_latency_update_mask_buffer(other);
    if (R > 2) buf->low_latency_update_mask_buffer((me + 2) % R);
    buf->low_latency_clean_mask_buffer();
    EXPECT_EQ(vector_of<int32_t>(buf->low_latency_query_mask_buffer()), zeros) << "clean_mask_buffer unmasks everyone";
  }
  // After all that (local) traffic a low-latency round still works on every rank.
  const LLWorld w = make_ll_world(ll_spec(384, 4, std::min(4, 4 * R), 16, mixed_tokens(16), 11));
  SCOPED_TRACE("a round after mask updates");
  run_case(*buf, w, Fmt::fp8, Completion::sync, no_mask());
}

// ------------------------------------------------------------------ tests: dispatch + combine

// Every format x every completion mode, for three hidden sizes (one 128-column group; a
// partial last group and a row length that is not a multiple of 16, i.e. vector kernels with
// a scalar tail; three groups, i.e. a partial ue8m0 word), rank-encoded and random rows, with
// a cumulative stats tensor accumulated over all calls.
TEST(EpLowLatency, DispatchCombineEveryMode) {
  const int R = num_ranks();
  for (int64_t H : {int64_t{128}, int64_t{200}, int64_t{384}}) {
    SCOPED_TRACE("H=" + std::to_string(H));
    LLSpec s = ll_spec(H, 3, std::min(6, 3 * R), 12, mixed_tokens(12), 100 + static_cast<uint64_t>(H));
    // Besides the random -1 entries, repeats and empty tokens: token 2 of every rank routes
    // nowhere, token 3 lists one expert first and last, token 4 has a -1 entry.
    s.router = [](int i, int64_t t, int64_t* row, float*) {
      const int k = std::min(6, 3 * num_ranks()), E = 3 * num_ranks();
      if (t == 2) std::fill_n(row, k, int64_t{-1});
      if (t == 3) row[0] = row[k - 1] = (7 * i + 1) % E;
      if (t == 4) row[1] = -1;
    };
    LLSpec s2 = s;
    s2.data = Data::rank_encoded;
    s2.seed += 1;
    const LLWorld worlds[2] = {make_ll_world(s), make_ll_world(s2)};
    // The worlds must hold what the test is about (a check of this test itself).
    for (const LLWorld& w : worlds) {
      int64_t minus_one = 0, repeats = 0, nowhere = 0;
      for (int i = 0; i < w.R; ++i)
        for (int64_t t = 0; t < w.T(i); ++t) {
          int valid = 0;
          for (int j = 0; j < w.k; ++j) {
            minus_one += w.expert_of(i, t, j) < 0;
            repeats += w.expert_of(i, t, j) >= 0 && !w.first_occurrence(i, t, j);
            valid += w.expert_of(i, t, j) >= 0;
          }
          nowhere += valid == 0;
        }
      EXPECT_GT(minus_one, 0) << "no -1 entries in the world";
      EXPECT_GT(repeats, 0) << "no token lists an expert twice";
      EXPECT_GT(nowhere, 0) << "no token routes nowhere";
    }
    BufferGuard buf = make_ll_buffer(std::max(worlds[0].hint(), worlds[1].hint()));
    Tensor stats = Tensor::zeros({worlds[0].El}, DType::i32);
    std::vector<int64_t> want_stats(static_cast<size_t>(worlds[0].El), 0);
    int index = 0;
    for (Fmt f : kFmts)
      for (Completion c : kCompletions) {
        const LLWorld& w = worlds[index++ % 2];
        SCOPED_TRACE(std::string(fmt_name(f)) + ", " + completion_name(c) + ", " +
                     (w.spec.data == Data::rank_encoded ? "rank-encoded" : "random") + " rows");
        const CaseResult res = run_case(*buf, w, f, c, no_mask(), stats);
        if (!res.ok) return;
        const LLExpected ex = expect_recv(w, my_rank(), no_mask());
        for (int el = 0; el < w.El; ++el) want_stats[static_cast<size_t>(el)] += ex.counts[static_cast<size_t>(el)];
        const std::vector<int32_t> got = vector_of<int32_t>(stats);
        EXPECT_EQ(std::vector<int64_t>(got.begin(), got.end()), want_stats) << "cumulative_local_expert_recv_stats after " << index << " calls";
      }
  }
}

// Worlds at the edges: every token of every rank on expert 0 twice and on the last expert
// (two experts filled to capacity, max * R rows), every entry -1, no tokens anywhere; x given
// as a view with padded rows.
TEST(EpLowLatency, EdgeWorlds) {
  const int R = num_ranks(), me = my_rank();
  struct Edge {
    const char* name;
    Router router;
    std::function<int64_t(int)> tokens;
  };
  const int k = 4;
  const int64_t max = 8;
  const Edge edges[] = {
      {"two experts at capacity",
       [R](int, int64_t, int64_t* row, float*) {
         row[0] = 0;
         row[1] = 0;
         row[2] = -1;
         row[3] = 2 * R - 1;
       },
       [max](int) { return max; }},
      {"every entry -1", [k](int, int64_t, int64_t* row, float*) { std::fill_n(row, k, int64_t{-1}); }, [max](int i) { return 1 + i % max; }},
      {"no tokens anywhere", Router(), [](int) { return int64_t{0}; }},
      {"one rank sends everything", Router(), [max](int i) { return i == 0 ? max : int64_t{0}; }},
  };
  int index = 0, edge_index = 0;
  for (const Edge& edge : edges) {
    const int this_edge = edge_index++;
    LLSpec s = ll_spec(256, 2, k, max, tokens_per_rank(edge.tokens), 300 + static_cast<uint64_t>(this_edge), this_edge % 2 ? Data::random : Data::rank_encoded);
    s.router = edge.router;
    const LLWorld w = make_ll_world(s);
    BufferGuard buf = make_ll_buffer(w.hint());
    for (Fmt f : {Fmt::bf16, Fmt::fp8_ue8m0}) {
      SCOPED_TRACE(std::string(edge.name) + ", " + fmt_name(f));
      const Completion c = kCompletions[index++ % 3];
      if (!run_case(*buf, w, f, c, no_mask()).ok) return;
    }
    // x with padded rows (row stride H + 64).
    SCOPED_TRACE(std::string(edge.name) + ", x with padded rows");
    const Tensor& x = w.x[static_cast<size_t>(me)];
    Tensor wide = Tensor::empty({w.T(me), w.H + 64}, DType::bf16);
    Tensor view = wide.slice(1, 0, w.H);
    if (w.T(me) > 0) view.copy_from(x);
    for (Fmt f : {Fmt::bf16, Fmt::fp8}) {
      LowLatencyDispatchResult r;
      if (!collective_step("low_latency_dispatch (strided x)", [&] {
            LowLatencyDispatchArgs a = dispatch_args(w, f, Completion::sync);
            a.x = view;
            r = run_dispatch(*buf, a, Completion::sync);
          }))
        return;
      check_ll_dispatch(r, w, f, no_mask());
      LowLatencyCombineResult comb;
      if (!collective_step("low_latency_combine", [&] { comb = combine_private(*buf, w, r, f, Expert::scaled, Completion::sync); })) return;
      expect_combined(comb.combined_x, expected_combined(w, f, Expert::scaled, no_mask()), w, "combined_x");
    }
  }
}

// The combine paths must agree bit for bit: x in private memory, in
// get_next_low_latency_combine_buffer with zero_copy, in Buffer::alloc_shared memory, with a
// caller-provided `out` (padded rows), each sync / async / hook.
TEST(EpLowLatency, CombinePathsAreBitIdentical) {
  const int R = num_ranks(), me = my_rank();
  LLSpec s = ll_spec(512, 3, std::min(5, 3 * R), 10, mixed_tokens(10), 400);
  const LLWorld w = make_ll_world(s);
  const int64_t y_bytes = static_cast<int64_t>(w.El) * w.slots() * w.H * 2;
  BufferGuard buf = make_ll_buffer(w.hint(), {}, 2 * y_bytes + (1 << 16));
  for (Fmt f : {Fmt::bf16, Fmt::fp8_ue8m0}) {
    SCOPED_TRACE(fmt_name(f));
    LowLatencyDispatchResult r;
    if (!collective_step("low_latency_dispatch", [&] { r = run_dispatch(*buf, dispatch_args(w, f, Completion::sync), Completion::sync); }))
      return;
    check_ll_dispatch(r, w, f, no_mask());
    const std::vector<uint16_t> want = expected_combined(w, f, Expert::scaled, no_mask());
    const uint64_t before = dispatch_fingerprint(r);
    int index = 0;
    for (Completion c : kCompletions) {
      const std::string mode = completion_name(c);
      {
        SCOPED_TRACE("private x, " + mode);
        LowLatencyCombineResult comb;
        if (!collective_step("combine (private x)", [&] { comb = combine_private(*buf, w, r, f, Expert::scaled, c); })) return;
        expect_combined(comb.combined_x, want, w, "combined_x");
      }
      {
        SCOPED_TRACE("zero_copy, " + mode);
        LowLatencyCombineResult comb;
        if (!collective_step("combine (zero_copy)", [&] { comb = combine_zero_copy(*buf, w, r, f, Expert::scaled, c); })) return;
        expect_combined(comb.combined_x, want, w, "combined_x");
      }
      {
        SCOPED_TRACE("x in Buffer::alloc_shared memory, " + mode);
        LowLatencyCombineResult comb;
        if (!collective_step("combine (alloc_shared x)", [&] {
              Tensor y = buf->alloc_shared({w.El, w.slots(), w.H}, DType::bf16);
              write_expert_outputs(y, r, w, f, Expert::scaled);
              comb = run_combine(*buf, combine_args(w, r, y, c), c);
            }))
          return;
        expect_combined(comb.combined_x, want, w, "combined_x");
      }
      {
        SCOPED_TRACE("caller-provided out with padded rows, " + mode + (index % 2 ? ", zero_copy" : ", private x"));
        const int64_t T = w.T(me);
        Tensor wide = Tensor::empty({T, w.H + 32}, DType::bf16);
        std::fill_n(wide.data_ptr<uint16_t>(), T * (w.H + 32), kBf16NaN);
        const Tensor out = wide.slice(1, 0, w.H);
        LowLatencyCombineResult comb;
        if (!collective_step("combine (out)", [&] {
              Tensor y = index % 2 ? buf->get_next_low_latency_combine_buffer(r.handle) : Tensor::empty({w.El, w.slots(), w.H}, DType::bf16);
              write_expert_outputs(y, r, w, f, Expert::scaled);
              LowLatencyCombineArgs a = combine_args(w, r, y, c);
              a.zero_copy = index % 2 == 1;
              a.out = out;
              comb = run_combine(*buf, a, c);
            }))
          return;
        ASSERT_TRUE(comb.combined_x.defined());
        EXPECT_EQ(comb.combined_x.data(), out.data()) << "combined_x is not the caller's out";
        expect_combined(out, want, w, "out");
        int64_t touched = 0;
        for (int64_t t = 0; t < T; ++t)
          for (int64_t cc = w.H; cc < w.H + 32; ++cc) touched += wide.data_ptr<uint16_t>()[t * (w.H + 32) + cc] != kBf16NaN;
        EXPECT_EQ(touched, 0) << "combine wrote outside `out` (into the padding of its rows)";
      }
      ++index;
    }
    EXPECT_EQ(dispatch_fingerprint(r), before) << "combines changed the dispatch result they combined";
  }
}

// docs/EP.md: out[t] = sum_k w[t, k] * y in f32 with one FMA per term, k ascending, rounded
// once to bf16. Tokens choose pairs of experts whose outputs cancel (y and -y, weights w and
// w (1 + small)), so the bf16 result depends on every f32 rounding: a multiply then an add
// instead of an FMA, another order of the terms or an extra rounding all show. Two hidden
// sizes: 512 (vector kernels only) and 200 (a scalar tail of 8 columns).
TEST(EpLowLatency, CombineRoundingIsExact) {
  const int R = num_ranks();
  for (int64_t H : {int64_t{512}, int64_t{200}}) {
    LLSpec s = ll_spec(H, 4, 6, 16, tokens_per_rank([](int i) { return int64_t{10} + (3 * i) % 7; }), 450 + static_cast<uint64_t>(H));
    s.router = [R](int i, int64_t t, int64_t* row, float* weights) {
      const int pairs = 2 * R;  // experts 2p and 2p + 1
      Rng rng{hash4(450, static_cast<uint64_t>(i), static_cast<uint64_t>(t), 1)};
      for (int j = 0; j < 6; j += 2) {
        const auto p = static_cast<int64_t>(rng.below(static_cast<uint64_t>(pairs)));
        const bool flip = rng.below(2) != 0;
        row[j] = 2 * p + (flip ? 1 : 0);
        row[j + 1] = 2 * p + (flip ? 0 : 1);
        weights[j + 1] = weights[j] * (1.0f + std::ldexp(1.0f + static_cast<float>(rng.below(64)), -14));
      }
      if (t % 5 == 4) row[rng.below(6)] = -1;  // an unpaired term now and then
    };
    const LLWorld w = make_ll_world(s);
    BufferGuard buf = make_ll_buffer(w.hint());
    for (Fmt f : {Fmt::bf16, Fmt::fp8}) {
      SCOPED_TRACE("H=" + std::to_string(H) + ", " + fmt_name(f));
      LowLatencyDispatchResult r;
      if (!collective_step("dispatch", [&] { r = run_dispatch(*buf, dispatch_args(w, f, Completion::sync), Completion::sync); })) return;
      check_ll_dispatch(r, w, f, no_mask());
      const std::vector<uint16_t> want = expected_combined(w, f, Expert::cancelling, no_mask());
      LowLatencyCombineResult a, b;
      if (!collective_step("combine (private x)", [&] { a = combine_private(*buf, w, r, f, Expert::cancelling, Completion::sync); })) return;
      expect_combined(a.combined_x, want, w, "combined_x (private x)");
      if (!collective_step("combine (zero_copy)", [&] { b = combine_zero_copy(*buf, w, r, f, Expert::cancelling, Completion::async); })) return;
      expect_combined(b.combined_x, want, w, "combined_x (zero_copy)");
    }
  }
}

// Two results live (ep.md "at most two low-latency results are live at once"): dispatch A,
// dispatch B; A must still be intact and B correct; combine B then A (the reverse order),
// each combine's view must survive the other combine.
TEST(EpLowLatency, TwoResultsLive) {
  const int R = num_ranks();
  LLSpec sa = ll_spec(384, 3, std::min(6, 3 * R), 12, mixed_tokens(12), 500, Data::rank_encoded);
  LLSpec sb = sa;
  sb.seed = 501;
  sb.data = Data::random;
  sb.tokens = tokens_per_rank([](int i) { return int64_t{12} - (i % 3) * 5; });
  const LLWorld wa = make_ll_world(sa), wb = make_ll_world(sb);
  BufferGuard buf = make_ll_buffer(wa.hint());
  const Fmt fa = Fmt::fp8_round, fb = Fmt::bf16;

  LowLatencyDispatchResult a, b;
  if (!collective_step("dispatch A", [&] { a = run_dispatch(*buf, dispatch_args(wa, fa, Completion::sync), Completion::sync); })) return;
  {
    SCOPED_TRACE("A right after its dispatch");
    check_ll_dispatch(a, wa, fa, no_mask());
  }
  const uint64_t fa_before = dispatch_fingerprint(a);
  if (!collective_step("dispatch B", [&] { b = run_dispatch(*buf, dispatch_args(wb, fb, Completion::async), Completion::async); })) return;
  EXPECT_EQ(dispatch_fingerprint(a), fa_before) << "dispatch B changed A's result (two results may be live)";
  {
    SCOPED_TRACE("A after dispatch B");
    check_ll_dispatch(a, wa, fa, no_mask());
  }
  {
    SCOPED_TRACE("B");
    check_ll_dispatch(b, wb, fb, no_mask());
  }
  const uint64_t fb_before = dispatch_fingerprint(b);
  LowLatencyCombineResult cb, ca;
  if (!collective_step("combine B", [&] { cb = combine_private(*buf, wb, b, fb, Expert::scaled, Completion::sync); })) return;
  const std::vector<uint16_t> want_a = expected_combined(wa, fa, Expert::scaled, no_mask()), want_b = expected_combined(wb, fb, Expert::scaled, no_mask());
  expect_combined(cb.combined_x, want_b, wb, "B combined_x");
  EXPECT_EQ(dispatch_fingerprint(a), fa_before) << "combine B changed A's dispatch result";
  if (!collective_step("combine A", [&] { ca = combine_zero_copy(*buf, wa, a, fa, Expert::scaled, Completion::hook); })) return;
  expect_combined(ca.combined_x, want_a, wa, "A combined_x");
  expect_combined(cb.combined_x, want_b, wb, "B combined_x after combine A (its view must stay valid)");
  EXPECT_EQ(dispatch_fingerprint(a), fa_before) << "combines changed A's dispatch result";
  EXPECT_EQ(dispatch_fingerprint(b), fb_before) << "combines changed B's dispatch result";
  {
    SCOPED_TRACE("B after both combines");
    check_ll_dispatch(b, wb, fb, no_mask());
  }
  // Held views survive Buffer::destroy() (ep.h: received tensors stay valid while held).
  const std::vector<uint16_t> cb_bits = bits_of(cb.combined_x);
  EXPECT_NO_THROW(buf->destroy());
  EXPECT_EQ(dispatch_fingerprint(b), fb_before) << "B's dispatch result changed across Buffer::destroy()";
  EXPECT_EQ(bits_of(cb.combined_x), cb_bits) << "B's combined_x changed across Buffer::destroy()";
}

// DeepEP's two-micro-batch overlap: both dispatches issued with return_recv_hook before either
// receive completes, hooks called afterwards (in order), then the same for the combines.
TEST(EpLowLatency, TwoMicroBatchesWithHooks) {
  const int R = num_ranks();
  LLSpec sa = ll_spec(256, 2, std::min(4, 2 * R), 16, mixed_tokens(16), 550);
  LLSpec sb = sa;
  sb.seed = 551;
  sb.data = Data::rank_encoded;
  sb.tokens = tokens_per_rank([](int i) { return int64_t{16} - i % 5; });
  const LLWorld wa = make_ll_world(sa), wb = make_ll_world(sb);
  BufferGuard buf = make_ll_buffer(wa.hint());
  Tensor stats = Tensor::zeros({wa.El}, DType::i32);
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    const Fmt fa = round == 0 ? Fmt::fp8_ue8m0 : Fmt::bf16, fb = round == 0 ? Fmt::bf16 : Fmt::fp8;
    LowLatencyDispatchResult a, b;
    if (!collective_step("dispatch A, dispatch B, hook A, hook B", [&] {
          a = buf->low_latency_dispatch(dispatch_args(wa, fa, Completion::hook, stats));
          b = buf->low_latency_dispatch(dispatch_args(wb, fb, Completion::hook, stats));
          ASSERT_TRUE(static_cast<bool>(a.hook));
          ASSERT_TRUE(static_cast<bool>(b.hook));
          a.hook();
          b.hook();
          a.hook();  // a second call is harmless
        }))
      return;
    {
      SCOPED_TRACE("A");
      check_ll_dispatch(a, wa, fa, no_mask());
    }
    {
      SCOPED_TRACE("B");
      check_ll_dispatch(b, wb, fb, no_mask());
    }
    LowLatencyCombineResult ca, cb;
    if (!collective_step("combine A, combine B, hook A, hook B", [&] {
          Tensor ya = Tensor::empty({wa.El, wa.slots(), wa.H}, DType::bf16), yb = Tensor::empty({wb.El, wb.slots(), wb.H}, DType::bf16);
          write_expert_outputs(ya, a, wa, fa, Expert::scaled);
          write_expert_outputs(yb, b, wb, fb, Expert::scaled);
          ca = buf->low_latency_combine(combine_args(wa, a, ya, Completion::hook));
          cb = buf->low_latency_combine(combine_args(wb, b, yb, Completion::hook));
          ASSERT_TRUE(static_cast<bool>(ca.hook));
          ASSERT_TRUE(static_cast<bool>(cb.hook));
          ca.hook();
          cb.hook();
        }))
      return;
    expect_combined(ca.combined_x, expected_combined(wa, fa, Expert::scaled, no_mask()), wa, "A combined_x");
    expect_combined(cb.combined_x, expected_combined(wb, fb, Expert::scaled, no_mask()), wb, "B combined_x");
  }
  std::vector<int32_t> want(static_cast<size_t>(wa.El), 0);
  for (const LLWorld* w : {&wa, &wb}) {
    const LLExpected ex = expect_recv(*w, my_rank(), no_mask());
    for (int el = 0; el < w->El; ++el) want[static_cast<size_t>(el)] += 2 * ex.counts[static_cast<size_t>(el)];
  }
  EXPECT_EQ(vector_of<int32_t>(stats), want) << "cumulative_local_expert_recv_stats after four hooked dispatches";
}

// A result more than two dispatches old has had its half rewritten: combining with its handle
// must raise an Error on every rank that has tokens to combine (same node: the expert rank's
// layout no longer matches; other node: its message holds the wrong number of rows), never
// read out of bounds or return garbage. Every token of A routes somewhere; C routes nothing,
// so C's layout differs from A's for every token.
TEST(EpLowLatency, CombineWithStaleHandleRaises) {
  const int R = num_ranks();
  LLSpec sa = ll_spec(256, 2, std::min(4, 2 * R), 8, tokens_per_rank([](int) { return int64_t{8}; }), 570);
  sa.p_drop_entry = 0;
  sa.p_drop_token = 0;
  LLSpec sc = sa;
  sc.seed = 571;
  sc.router = [](int, int64_t, int64_t* row, float*) { std::fill_n(row, 4, int64_t{-1}); };
  sc.topk = 4;
  LLSpec sb = sa;
  sb.seed = 572;
  const LLWorld wa = make_ll_world(sa), wb = make_ll_world(sb), wc = make_ll_world(sc);
  BufferOptions o;
  o.timeout_s = 20;
  BufferGuard buf = make_ll_buffer(std::max(wa.hint(), wc.hint()), o);
  LowLatencyDispatchResult a, b, c;
  if (!collective_step("dispatch A, B, C (C reuses A's half)", [&] {
        a = run_dispatch(*buf, dispatch_args(wa, Fmt::bf16, Completion::sync), Completion::sync);
        b = run_dispatch(*buf, dispatch_args(wb, Fmt::bf16, Completion::sync), Completion::sync);
        c = run_dispatch(*buf, dispatch_args(wc, Fmt::bf16, Completion::sync), Completion::sync);
      }))
    return;
  Tensor y = Tensor::zeros({wa.El, wa.slots(), wa.H}, DType::bf16);
  try {
    (void)run_combine(*buf, combine_args(wa, a, y, Completion::sync), Completion::sync);
    ADD_FAILURE() << "combine with a handle three dispatches old returned";
  } catch (const TimeoutError& e) {
    ADD_FAILURE() << "a TimeoutError, not the stale-handle Error: " << e.what();
  } catch (const moekit::Error& e) {
    EXPECT_NE(std::string(e.what()).find("two dispatches old"), std::string::npos) << e.what();
  }
  polite_barrier();
}

// A hook only waits: the receive runs in the background from the dispatch on (upstream's
// data arrives by RDMA whether or not the hook was called). So three dispatches in a row
// complete with no hook called in between: the third reuses the first's half, which needs
// every receiver to have gathered the first already. (Across nodes this needs
// MPI_THREAD_MULTIPLE; otherwise hooks defer their receive, docs/EP.md.)
TEST(EpLowLatency, HookReceivesInTheBackground) {
  const int R = num_ranks();
  LLSpec s = ll_spec(256, 2, std::min(4, 2 * R), 16, mixed_tokens(16), 560, Data::rank_encoded);
  const LLWorld w = make_ll_world(s);
  BufferOptions o;
  o.timeout_s = 10;  // a receive that never ran shows up as a TimeoutError, not a hang
  BufferGuard buf = make_ll_buffer(w.hint(), o);
  int thread_level = MPI_THREAD_SINGLE;
  MPI_Query_thread(&thread_level);
  if (buf->get_num_local_ranks() < R && thread_level < MPI_THREAD_MULTIPLE)
    GTEST_SKIP() << "across nodes without MPI_THREAD_MULTIPLE hooks defer their receive (docs/EP.md)";
  std::vector<LowLatencyDispatchResult> results(3);
  if (!collective_step("three dispatches, then the hooks", [&] {
        for (auto& r : results) r = buf->low_latency_dispatch(dispatch_args(w, Fmt::fp8, Completion::hook));
        for (auto& r : results) {
          ASSERT_TRUE(static_cast<bool>(r.hook));
          r.hook();
        }
      }))
    return;
  check_ll_dispatch(results[2], w, Fmt::fp8, no_mask());
  LowLatencyCombineResult comb;
  if (!collective_step("combine", [&] { comb = combine_private(*buf, w, results[2], Fmt::fp8, Expert::scaled, Completion::hook); })) return;
  expect_combined(comb.combined_x, expected_combined(w, Fmt::fp8, Expert::scaled, no_mask()), w, "combined_x");
}

// A combine of a hooked dispatch whose hook was not called, where hooks defer their receive
// (across nodes without MPI_THREAD_MULTIPLE, docs/EP.md): every rank raises on "handle"
// (before, it combined by another call's counts: wrong sums, no error); after the hooks the
// same combine is right. (Where the receive runs in the background the combine waits for it,
// but the expert outputs it combines come from the received rows: the hook comes first.)
TEST(EpLowLatency, CombineBeforeADeferredHookRaises) {
  const int R = num_ranks();
  const LLWorld w = make_ll_world(ll_spec(256, 2, std::min(4, 2 * R), 16, mixed_tokens(16), 570, Data::rank_encoded));
  BufferOptions o;
  o.timeout_s = 10;
  BufferGuard buf = make_ll_buffer(w.hint(), o);
  int thread_level = MPI_THREAD_SINGLE;
  MPI_Query_thread(&thread_level);
  if (buf->get_num_local_ranks() == R || thread_level >= MPI_THREAD_MULTIPLE)
    GTEST_SKIP() << "hooks defer their receive only across nodes without MPI_THREAD_MULTIPLE (ctest's ep_two_nodes runs)";
  LowLatencyDispatchResult r;
  if (!collective_step("dispatch with a hook", [&] { r = buf->low_latency_dispatch(dispatch_args(w, Fmt::bf16, Completion::hook)); }))
    return;
  ASSERT_TRUE(static_cast<bool>(r.hook));
  Tensor y = Tensor::zeros({w.El, w.slots(), w.H}, DType::bf16);
  EXPECT_TRUE(all_ranks(expect_ep_error_on([&] { (void)run_combine(*buf, combine_args(w, r, y, Completion::sync), Completion::sync); }, "handle")));
  if (!collective_step("the hook", [&] { r.hook(); })) return;
  LowLatencyCombineResult comb;
  if (!collective_step("combine", [&] { comb = combine_private(*buf, w, r, Fmt::bf16, Expert::scaled, Completion::sync); })) return;
  expect_combined(comb.combined_x, expected_combined(w, Fmt::bf16, Expert::scaled, no_mask()), w, "combined_x");
}

// Rank 0 refuses its own combine (topk_weights of the wrong shape) while rank 1 has yet to
// receive the dispatch of the same buffer half (its hook, called after rank 0 refused). Rank
// 1's receive must succeed: the refused combine's mark is the combine's own. It had shared
// the dispatch's error word, and rank 1 raised "rank 0 rejected its arguments" for a valid
// dispatch (deterministic where hooks defer their receive: across nodes without
// MPI_THREAD_MULTIPLE; elsewhere the receive may have finished already). The other ranks'
// combines raise naming rank 0, and then a dispatch and combine are right everywhere.
TEST(EpLowLatency, RefusedCombineLeavesPeersPendingDispatchAlone) {
  const int me = my_rank(), R = num_ranks();
  if (R < 2) GTEST_SKIP() << "needs two ranks";
  const LLWorld w = make_ll_world(ll_spec(256, 2, 2 * R, 16, mixed_tokens(16), 580, Data::rank_encoded));
  BufferOptions o;
  o.timeout_s = 10;
  BufferGuard buf = make_ll_buffer(w.hint(), o);
  const Completion c = me == 1 ? Completion::hook : Completion::sync;
  LowLatencyDispatchResult r;
  if (!collective_step("dispatch (rank 1 with a hook)", [&] { r = buf->low_latency_dispatch(dispatch_args(w, Fmt::bf16, c)); })) return;
  if (me == 0) {
    Tensor y = Tensor::zeros({w.El, w.slots(), w.H}, DType::bf16);
    LowLatencyCombineArgs bad = combine_args(w, r, y, Completion::sync);
    bad.topk_weights = Tensor::zeros({w.T(me), w.k + 1}, DType::f32);
    EXPECT_TRUE(expect_ep_error_on([&] { (void)buf->low_latency_combine(bad); }, "topk_weights"));
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (me == 1) {
    try {
      r.hook();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "rank 1's receive of a valid dispatch failed: " << e.what();
    }
  }
  if (me != 0) {
    EXPECT_TRUE(expect_ep_error_where([&] { (void)combine_private(*buf, w, r, Fmt::bf16, Expert::scaled, Completion::sync); },
                                      [](const moekit::Error& e) {
                                        EXPECT_NE(std::string(e.what()).find("rank 0"), std::string::npos) << e.what();
                                      }));
  }
  LowLatencyDispatchResult again;
  LowLatencyCombineResult comb;
  if (!collective_step("dispatch and combine again", [&] {
        again = run_dispatch(*buf, dispatch_args(w, Fmt::bf16, Completion::sync), Completion::sync);
        comb = combine_private(*buf, w, again, Fmt::bf16, Expert::scaled, Completion::sync);
      }))
    return;
  check_ll_dispatch(again, w, Fmt::bf16, no_mask());
  expect_combined(comb.combined_x, expected_combined(w, Fmt::bf16, Expert::scaled, no_mask()), w, "combined_x");
}

// A zero-copy combine buffer taken before another combine is where that combine staged its
// rows: combining from it is refused on "x" (it had given wrong sums without an error).
TEST(EpLowLatency, ZeroCopyBufferTakenBeforeAnotherCombineRaises) {
  const LLWorld w = make_ll_world(ll_spec(256, 2, 2 * num_ranks(), 16, mixed_tokens(16), 590, Data::rank_encoded));
  BufferOptions o;
  o.timeout_s = 10;
  BufferGuard buf = make_ll_buffer(w.hint(), o);
  LowLatencyDispatchResult r1, r2;
  if (!collective_step("two dispatches", [&] {
        r1 = run_dispatch(*buf, dispatch_args(w, Fmt::bf16, Completion::sync), Completion::sync);
        r2 = run_dispatch(*buf, dispatch_args(w, Fmt::bf16, Completion::sync), Completion::sync);
      }))
    return;
  const Tensor stale = buf->get_next_low_latency_combine_buffer(r2.handle);
  if (!collective_step("combine r1 from private memory", [&] { (void)combine_private(*buf, w, r1, Fmt::bf16, Expert::scaled, Completion::sync); }))
    return;
  write_expert_outputs(stale, r2, w, Fmt::bf16, Expert::scaled);
  LowLatencyCombineArgs a = combine_args(w, r2, stale, Completion::sync);
  a.zero_copy = true;
  EXPECT_TRUE(all_ranks(expect_ep_error_on([&] { (void)buf->low_latency_combine(a); }, "x")));
  LowLatencyCombineResult comb;
  if (!collective_step("zero-copy combine from a fresh buffer", [&] { comb = combine_zero_copy(*buf, w, r2, Fmt::bf16, Expert::scaled, Completion::sync); }))
    return;
  expect_combined(comb.combined_x, expected_combined(w, Fmt::bf16, Expert::scaled, no_mask()), w, "combined_x");
}

// Two live results of different hidden sizes on one buffer sized for both (docs/EP.md: a
// result stays valid until the second low-latency dispatch after it; nothing there restricts
// the shapes of the calls in between). A: H = 128, B: H = 7168, every rank at the token limit.
TEST(EpLowLatency, TwoResultsLiveOfDifferentHiddenSizes) {
  const int R = num_ranks();
  if (R < 2) GTEST_SKIP() << "needs two ranks";
  LLSpec sa = ll_spec(128, 1, 2, 8, tokens_per_rank([](int) { return int64_t{8}; }), 600, Data::rank_encoded);
  LLSpec sb = sa;
  sb.hidden = 7168;
  sb.seed = 601;
  sb.data = Data::random;
  const LLWorld wa = make_ll_world(sa), wb = make_ll_world(sb);
  BufferGuard buf = make_ll_buffer(std::max(wa.hint(), wb.hint()));
  LowLatencyDispatchResult a, b;
  if (!collective_step("dispatch A (H=128)", [&] { a = run_dispatch(*buf, dispatch_args(wa, Fmt::bf16, Completion::sync), Completion::sync); }))
    return;
  check_ll_dispatch(a, wa, Fmt::bf16, no_mask());
  const uint64_t before = dispatch_fingerprint(a);
  if (!collective_step("dispatch B (H=7168)", [&] { b = run_dispatch(*buf, dispatch_args(wb, Fmt::bf16, Completion::sync), Completion::sync); }))
    return;
  {
    SCOPED_TRACE("B");
    check_ll_dispatch(b, wb, Fmt::bf16, no_mask());
  }
  const bool intact = dispatch_fingerprint(a) == before;
  EXPECT_TRUE(intact) << "dispatch B (another hidden size) changed A's live result";
  if (!intact) {
    SCOPED_TRACE("A after dispatch B");
    check_ll_dispatch(a, wa, Fmt::bf16, no_mask());
  }
  LowLatencyCombineResult ca, cb;
  // Combining a corrupted A would make combine follow garbage layout_range entries (it may
  // crash the whole binary), so every rank skips it when A changed anywhere.
  if (all_ranks(intact)) {
    if (!collective_step("combine A", [&] { ca = combine_private(*buf, wa, a, Fmt::bf16, Expert::scaled, Completion::sync); })) return;
    expect_combined(ca.combined_x, expected_combined(wa, Fmt::bf16, Expert::scaled, no_mask()), wa, "A combined_x");
  }
  if (!collective_step("combine B", [&] { cb = combine_private(*buf, wb, b, Fmt::bf16, Expert::scaled, Completion::sync); })) return;
  expect_combined(cb.combined_x, expected_combined(wb, Fmt::bf16, Expert::scaled, no_mask()), wb, "B combined_x");
}

// The other order (review finding, 2026-12-03): A (H = 1024, 8 tokens at most), then B
// (H = 128, 32 at most), and B combined first. Its combine takes A's half, where B's own layout
// put the staged rows and the output inside A's received rows (B's dispatch regions end about
// 27 KiB into the half, A's received rows span about 17 to 49 KiB); the combine block now ends
// where the half does.
TEST(EpLowLatency, CombineOfASmallerResultKeepsTheLargerLive) {
  const int R = num_ranks();
  if (R < 2) GTEST_SKIP() << "needs two ranks";
  // Every token to every expert (one per rank), so that every received row of A is valid.
  LLSpec sa = ll_spec(1024, 1, R, 8, tokens_per_rank([](int) { return int64_t{8}; }), 610, Data::random);
  sa.p_drop_entry = sa.p_drop_token = sa.p_repeat = 0;
  sa.router = [R](int, int64_t, int64_t* row, float*) {
    for (int j = 0; j < R; ++j) row[j] = j;
  };
  LLSpec sb = sa;
  sb.hidden = 128;
  sb.max_tokens = 32;
  sb.seed = 611;
  sb.data = Data::rank_encoded;
  const LLWorld wa = make_ll_world(sa), wb = make_ll_world(sb);
  BufferGuard buf = make_ll_buffer(std::max(wa.hint(), wb.hint()));
  LowLatencyDispatchResult a, b;
  if (!collective_step("dispatch A (H=7168), then B (H=128)", [&] {
        a = run_dispatch(*buf, dispatch_args(wa, Fmt::bf16, Completion::sync), Completion::sync);
        b = run_dispatch(*buf, dispatch_args(wb, Fmt::bf16, Completion::sync), Completion::sync);
      }))
    return;
  const uint64_t before = dispatch_fingerprint(a);
  LowLatencyCombineResult cb, ca;
  if (!collective_step("combine B", [&] { cb = combine_private(*buf, wb, b, Fmt::bf16, Expert::scaled, Completion::sync); })) return;
  expect_combined(cb.combined_x, expected_combined(wb, Fmt::bf16, Expert::scaled, no_mask()), wb, "B combined_x");
  const bool intact = dispatch_fingerprint(a) == before;
  EXPECT_TRUE(intact) << "combine B (another hidden size) changed A's live result";
  if (!all_ranks(intact)) return;  // (combining a corrupted A may follow garbage ranges)
  check_ll_dispatch(a, wa, Fmt::bf16, no_mask());
  if (!collective_step("combine A", [&] { ca = combine_private(*buf, wa, a, Fmt::bf16, Expert::scaled, Completion::sync); })) return;
  expect_combined(ca.combined_x, expected_combined(wa, Fmt::bf16, Expert::scaled, no_mask()), wa, "A combined_x");
}

// Two live results of different sizes (A: 16 tokens at most, B: 4); rank 0 combines B, the
// others A, every x in the buffer's shared heap (read in place). Every rank must raise on
// "handle": an owner finds its rows by its own handle's layout in x shaped by the expert
// rank's, and before the combine compared the dispatches this read rows of A's layout past
// the end of rank 0's smaller x, without an error. Then A combines on every rank.
TEST(EpLowLatency, CombineOfDifferentLiveResultsAcrossRanksRaises) {
  const int me = my_rank(), R = num_ranks();
  if (R < 2) GTEST_SKIP() << "needs two ranks";
  const int64_t H = 128, E = R;
  BufferOptions o;
  o.timeout_s = 10;
  BufferGuard buf = make_ll_buffer(get_low_latency_rdma_size_hint(16, H, R, static_cast<int>(E)), o, 8 << 20);
  auto routing = [](int64_t T) {  // every token to expert 0 (rank 0)
    Tensor idx = Tensor::zeros({T, 1}, DType::i64);
    return idx;
  };
  auto ones = [](const Shape& shape, DType dtype) {
    Tensor t = Tensor::empty(shape, dtype);
    for (int64_t i = 0; i < t.numel(); ++i) {
      if (dtype == DType::f32) t.data_ptr<float>()[i] = 1.0f;
      else t.data_ptr<uint16_t>()[i] = 0x3f80;  // bf16 1.0
    }
    return t;
  };
  auto dispatch = [&](int64_t max_tokens) {
    LowLatencyDispatchArgs a;
    a.x = ones({max_tokens, H}, DType::bf16);
    a.topk_idx = routing(max_tokens);
    a.num_max_dispatch_tokens_per_rank = max_tokens;
    a.num_experts = static_cast<int>(E);
    a.use_fp8 = false;
    return buf->low_latency_dispatch(a);
  };
  LowLatencyDispatchResult ra, rb;
  if (!collective_step("dispatch A (16 tokens), then B (4)", [&] {
        ra = dispatch(16);
        rb = dispatch(4);
      }))
    return;
  auto combine = [&](const LowLatencyDispatchResult& r, int64_t T) {
    LowLatencyCombineArgs c;
    c.x = buf->alloc_shared({1, T * R, H}, DType::bf16);
    c.x.copy_from(ones({1, T * R, H}, DType::bf16));
    c.topk_idx = routing(T);
    c.topk_weights = ones({T, 1}, DType::f32);
    c.handle = r.handle;
    return buf->low_latency_combine(c);
  };
  const bool raised = expect_ep_error_on([&] { (void)(me == 0 ? combine(rb, 4) : combine(ra, 16)); }, "handle");
  EXPECT_TRUE(all_ranks(raised)) << "every rank must raise";
  LowLatencyCombineResult back;
  if (!collective_step("combine A on every rank", [&] { back = combine(ra, 16); })) return;
  for (int64_t i = 0; i < back.combined_x.numel(); ++i)
    ASSERT_EQ(back.combined_x.data_ptr<uint16_t>()[i], 0x3f80) << "element " << i;
}

// A dispatch (combine) whose regions cannot fit beside the live result of the last combine
// (dispatch) in the half it takes raises on every rank before it moves anything, and the
// buffer goes on (the refused call is counted, as every refused call is: ll_call).
// X (1024 tokens at most, H = 128) has the larger dispatch part, Y (8 tokens, H = 16896) the
// larger combine part: each fits a half of the size hint of the larger, but X's dispatch
// beside Y's combine does not (for any rank count up to 16: the dispatch part grows by a row
// of 2H + 4 bytes per received row, the combine part by 2H).
TEST(EpLowLatency, RegionsThatCannotFitBesideTheLiveResultRaise) {
  const int R = num_ranks();
  const auto four = tokens_per_rank([](int) { return int64_t{4}; });
  const LLWorld wx = make_ll_world(ll_spec(128, 1, 1, 1024, four, 620, Data::rank_encoded));
  const LLWorld wy = make_ll_world(ll_spec(16896, 1, 1, 8, four, 621, Data::random));
  ASSERT_LE(R, 16);
  BufferOptions o;
  o.timeout_s = 10;  // a check that does not fire makes the others wait this long, not forever
  BufferGuard buf = make_ll_buffer(std::max(wx.hint(), wy.hint()), o);
  auto expect_half_error = [](const std::function<void()>& call, const char* what) {
    SCOPED_TRACE(what);
    return all_ranks(expect_ep_error_where(call, [](const moekit::Error& e) {
      EXPECT_NE(std::string(e.what()).find("fit beside the live result"), std::string::npos) << e.what();
    }));
  };
  // Dispatch side: Y dispatched and combined in half 1, X dispatched in half 0, then X again
  // in half 1, beside Y's combined output.
  LowLatencyDispatchResult y, x1, x2;
  LowLatencyCombineResult cy, cx;
  if (!collective_step("dispatch Y, combine Y, dispatch X", [&] {
        y = run_dispatch(*buf, dispatch_args(wy, Fmt::bf16, Completion::sync), Completion::sync);
        cy = combine_private(*buf, wy, y, Fmt::bf16, Expert::scaled, Completion::sync);
        x1 = run_dispatch(*buf, dispatch_args(wx, Fmt::bf16, Completion::sync), Completion::sync);
      }))
    return;
  if (!expect_half_error([&] { x2 = run_dispatch(*buf, dispatch_args(wx, Fmt::bf16, Completion::sync), Completion::sync); },
                         "dispatch X beside Y's combined output"))
    return;
  expect_combined(cy.combined_x, expected_combined(wy, Fmt::bf16, Expert::scaled, no_mask()), wy, "Y combined_x after the refusal");
  // (The refused call took dispatch number 3.) X's first result combines (half 0) as usual.
  if (!collective_step("combine X", [&] { cx = combine_private(*buf, wx, x1, Fmt::bf16, Expert::scaled, Completion::sync); })) return;
  expect_combined(cx.combined_x, expected_combined(wx, Fmt::bf16, Expert::scaled, no_mask()), wx, "X combined_x");

  // Combine side, on a fresh buffer: X dispatched into half 1, Y into half 0; Y's combine (the
  // first) takes half 1, beside X's live dispatch.
  BufferGuard fresh = make_ll_buffer(std::max(wx.hint(), wy.hint()), o);
  if (!collective_step("dispatch X, dispatch Y", [&] {
        x2 = run_dispatch(*fresh, dispatch_args(wx, Fmt::bf16, Completion::sync), Completion::sync);
        y = run_dispatch(*fresh, dispatch_args(wy, Fmt::bf16, Completion::sync), Completion::sync);
      }))
    return;
  if (!expect_half_error([&] { cy = combine_private(*fresh, wy, y, Fmt::bf16, Expert::scaled, Completion::sync); },
                         "combine Y beside X's live dispatch"))
    return;
  check_ll_dispatch(x2, wx, Fmt::bf16, no_mask());
  if (!collective_step("combine X", [&] { cx = combine_private(*fresh, wx, x2, Fmt::bf16, Expert::scaled, Completion::sync); })) return;
  expect_combined(cx.combined_x, expected_combined(wx, Fmt::bf16, Expert::scaled, no_mask()), wx, "X combined_x (second)");
}

// x inside the buffer half a dispatch fills (here the rows of the result two dispatches old,
// whose half the call takes) would be overwritten while it is read: every rank raises on "x"
// before anything moves, and the buffer goes on.
TEST(EpLowLatency, DispatchOfXInsideTheHalfItFillsRaises) {
  const int R = num_ranks(), me = my_rank();
  const LLWorld w = make_ll_world(ll_spec(256, 2, std::min(4, 2 * R), 8, tokens_per_rank([](int i) { return int64_t{3} + i % 6; }), 905));
  BufferOptions o;
  o.timeout_s = 10;
  BufferGuard buf = make_ll_buffer(w.hint(), o);
  LowLatencyDispatchResult r1, r2, r3;
  if (!collective_step("two dispatches", [&] {
        r1 = run_dispatch(*buf, dispatch_args(w, Fmt::bf16, Completion::sync), Completion::sync);
        r2 = run_dispatch(*buf, dispatch_args(w, Fmt::bf16, Completion::sync), Completion::sync);
      }))
    return;
  LowLatencyDispatchArgs a = dispatch_args(w, Fmt::bf16, Completion::sync);
  a.x = Tensor::from_blob(r1.recv_x.data(), {w.T(me), w.H}, DType::bf16);
  if (!all_ranks(expect_ep_error_on([&] { (void)buf->low_latency_dispatch(a); }, "x"))) return;
  check_ll_dispatch(r2, w, Fmt::bf16, no_mask());  // the live result is intact
  if (!collective_step("dispatch after the refusal", [&] { r3 = run_dispatch(*buf, dispatch_args(w, Fmt::bf16, Completion::sync), Completion::sync); })) return;
  check_ll_dispatch(r3, w, Fmt::bf16, no_mask());
  LowLatencyCombineResult c;
  if (!collective_step("combine", [&] { c = combine_private(*buf, w, r3, Fmt::bf16, Expert::scaled, Completion::sync); })) return;
  expect_combined(c.combined_x, expected_combined(w, Fmt::bf16, Expert::scaled, no_mask()), w, "combined_x");
}

// H = 7168 (DeepSeek's hidden size) on a buffer of exactly the size hint.
TEST(EpLowLatency, Hidden7168OnExactSizeHint) {
  const int R = num_ranks();
  LLSpec s = ll_spec(7168, 2, std::min(4, 2 * R), 6, mixed_tokens(6), 700);
  const LLWorld w = make_ll_world(s);
  BufferGuard buf = make_ll_buffer(w.hint());
  {
    SCOPED_TRACE("fp8+round_scale+use_ue8m0, sync");
    if (!run_case(*buf, w, Fmt::fp8_ue8m0, Completion::sync, no_mask()).ok) return;
  }
  {
    SCOPED_TRACE("bf16, hook");
    if (!run_case(*buf, w, Fmt::bf16, Completion::hook, no_mask()).ok) return;
  }
  SCOPED_TRACE("fp8, async, zero_copy combine");
  LowLatencyDispatchResult r;
  if (!collective_step("dispatch", [&] { r = run_dispatch(*buf, dispatch_args(w, Fmt::fp8, Completion::async), Completion::async); })) return;
  check_ll_dispatch(r, w, Fmt::fp8, no_mask());
  LowLatencyCombineResult comb;
  if (!collective_step("combine", [&] { comb = combine_zero_copy(*buf, w, r, Fmt::fp8, Expert::scaled, Completion::async); })) return;
  expect_combined(comb.combined_x, expected_combined(w, Fmt::fp8, Expert::scaled, no_mask()), w, "combined_x");
}

// Across nodes, messages this large (about 0.5-1 MB) exceed MPI's eager limit: MPI moves
// them only while their sender is inside MPI. Round trips with ranks arriving at different
// times must not end up waiting on each other in a cycle (every wait keeps MPI moving).
TEST(EpLowLatency, LargeMessagesStaggeredRoundTrips) {
  const int R = num_ranks(), me = my_rank();
  LLSpec s = ll_spec(7168, 2, std::min(8, 2 * R), 64, tokens_per_rank([](int) { return int64_t{64}; }), 1200);
  const LLWorld w = make_ll_world(s);
  BufferOptions o;
  o.timeout_s = 30;
  BufferGuard buf = make_ll_buffer(w.hint(), o);
  for (int round = 0; round < 4; ++round) {
    const Fmt f = round % 2 ? Fmt::bf16 : Fmt::fp8;
    const Completion c = kCompletions[round % 3];
    SCOPED_TRACE("round " + std::to_string(round) + ", " + fmt_name(f) + ", " + completion_name(c));
    std::this_thread::sleep_for(std::chrono::milliseconds((me * 7 + round * 3) % 11));
    if (!run_case(*buf, w, f, c, no_mask()).ok) return;
  }
  // As a benchmark does: many combines of one dispatch, back to back, from private memory.
  LowLatencyDispatchResult r;
  if (!collective_step("dispatch", [&] { r = run_dispatch(*buf, dispatch_args(w, Fmt::fp8, Completion::sync), Completion::sync); })) return;
  Tensor y = Tensor::empty({w.El, w.slots(), w.H}, DType::bf16);
  write_expert_outputs(y, r, w, Fmt::fp8, Expert::scaled);
  const std::vector<uint16_t> want = expected_combined(w, Fmt::fp8, Expert::scaled, no_mask());
  for (int i = 0; i < 12; ++i) {
    SCOPED_TRACE("combine " + std::to_string(i) + " of one dispatch");
    if ((me + i) % 3 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    LowLatencyCombineResult comb;
    if (!collective_step("combine", [&] { comb = run_combine(*buf, combine_args(w, r, y, Completion::sync), Completion::sync); })) return;
    expect_combined(comb.combined_x, want, w, "combined_x");
  }
}

// ep.md "a pressure mode reruns 20 times and compares hashes (determinism)".
TEST(EpLowLatency, DeterministicOver20Runs) {
  const int R = num_ranks();
  LLSpec s = ll_spec(512, 3, std::min(6, 3 * R), 16, tokens_per_rank([](int i) { return int64_t{9} + (7 * i) % 8; }), 800);
  const LLWorld w = make_ll_world(s);
  BufferGuard buf = make_ll_buffer(w.hint());
  for (Fmt f : {Fmt::fp8_round, Fmt::bf16}) {
    SCOPED_TRACE(fmt_name(f));
    std::vector<uint64_t> hashes;
    for (int run = 0; run < 20; ++run) {
      const Completion cd = kCompletions[run % 3], cc = kCompletions[(run + 1) % 3];
      LowLatencyDispatchResult r;
      LowLatencyCombineResult comb;
      if (!collective_step("dispatch + combine, run " + std::to_string(run), [&] {
            r = run_dispatch(*buf, dispatch_args(w, f, cd), cd);
            comb = run % 2 ? combine_zero_copy(*buf, w, r, f, Expert::scaled, cc) : combine_private(*buf, w, r, f, Expert::scaled, cc);
          }))
        return;
      uint64_t h = dispatch_fingerprint(r);
      const std::vector<uint16_t> bits = bits_of(comb.combined_x);
      h = fnv1a(h, bits.data(), bits.size() * 2);
      hashes.push_back(h);
    }
    int64_t differing = 0;
    for (uint64_t h : hashes) differing += h != hashes.front();
    EXPECT_EQ(differing, 0) << "runs whose output hash differs from the first run's";
  }
}

// ------------------------------------------------------------------ tests: bad input

// Bad arguments on every rank: every rank raises before communicating (no hang), and the
// buffer still works afterwards.
TEST(EpLowLatency, BadArgumentsRaiseOnEveryRank) {
  const int R = num_ranks(), me = my_rank();
  LLSpec s = ll_spec(256, 2, std::min(4, 2 * R), 8, tokens_per_rank([](int i) { return int64_t{3} + i % 6; }), 900);  // every rank has tokens
  const LLWorld w = make_ll_world(s);
  const int64_t T = w.T(me), H = w.H;
  BufferOptions o;
  o.timeout_s = 10;  // a check that does not fire makes the others wait this long, not forever

  {
    SCOPED_TRACE("num_rdma_bytes = hint - 1");
    const int64_t hint = w.hint();
    BufferGuard small = make_ll_buffer(hint - 1, o);
    try {
      (void)small->low_latency_dispatch(dispatch_args(w, Fmt::fp8, Completion::sync));
      ADD_FAILURE() << "no Error with num_rdma_bytes one below the hint";
    } catch (const TimeoutError& e) {
      ADD_FAILURE() << "a TimeoutError, not an argument check: " << e.what();
    } catch (const moekit::Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::to_string(hint)), std::string::npos) << "the error should quote the hint " << hint << ": " << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "wrong exception type: " << e.what();
    }
  }
  {
    SCOPED_TRACE("num_rdma_bytes = 0");
    BufferGuard none = make_ll_buffer(0, o);
    EXPECT_EP_ERROR(none->low_latency_dispatch(dispatch_args(w, Fmt::bf16, Completion::sync)));
    none->destroy();
    SCOPED_TRACE("a destroyed buffer");
    EXPECT_EP_ERROR(none->low_latency_dispatch(dispatch_args(w, Fmt::bf16, Completion::sync)));
  }

  BufferGuard buf = make_ll_buffer(w.hint(), o);
  auto good = [&](Fmt f = Fmt::fp8) { return dispatch_args(w, f, Completion::sync); };
  {
    SCOPED_TRACE("T > num_max_dispatch_tokens_per_rank");
    LowLatencyDispatchArgs a = good();
    Tensor x = Tensor::zeros({w.max + 1, H}, DType::bf16);
    std::vector<int64_t> idx(static_cast<size_t>((w.max + 1) * w.k), 0);
    a.x = x;
    a.topk_idx = tensor_of(idx, {w.max + 1, w.k}, DType::i64);
    EXPECT_EP_ERROR(buf->low_latency_dispatch(a));
  }
  {
    SCOPED_TRACE("no tokens and num_max_dispatch_tokens_per_rank = 0: named, not the size hint's error");
    LowLatencyDispatchArgs a = good();
    a.x = Tensor::zeros({0, H}, DType::bf16);
    a.topk_idx = Tensor::zeros({0, w.k}, DType::i64);
    a.num_max_dispatch_tokens_per_rank = 0;
    EXPECT_TRUE(expect_ep_error_where([&] { (void)buf->low_latency_dispatch(a); }, [](const moekit::Error& e) {
      EXPECT_EQ(e.argument(), "num_max_dispatch_tokens_per_rank") << e.what();
      EXPECT_EQ(e.function(), "ep::Buffer::low_latency_dispatch") << e.what();
    }));
  }
  {
    SCOPED_TRACE("hidden size 0");
    LowLatencyDispatchArgs a = good(Fmt::bf16);
    a.x = Tensor::zeros({a.x.size(0), 0}, DType::bf16);
    EXPECT_TRUE(expect_ep_error_where([&] { (void)buf->low_latency_dispatch(a); }, [](const moekit::Error& e) {
      EXPECT_EQ(e.argument(), "x") << e.what();
      EXPECT_EQ(e.function(), "ep::Buffer::low_latency_dispatch") << e.what();
    }));
  }
  {
    SCOPED_TRACE("use_ue8m0 without round_scale");
    LowLatencyDispatchArgs a = good();
    a.use_ue8m0 = true;
    a.round_scale = false;
    EXPECT_EP_ERROR(buf->low_latency_dispatch(a));
  }
  {
    SCOPED_TRACE("use_ue8m0 without use_fp8");
    LowLatencyDispatchArgs a = good(Fmt::bf16);
    a.use_ue8m0 = true;
    a.round_scale = true;
    EXPECT_EP_ERROR(buf->low_latency_dispatch(a));
  }
  for (int64_t bad : {int64_t{w.E}, int64_t{-2}, int64_t{1} << 40}) {
    SCOPED_TRACE("expert id " + std::to_string(bad) + " in topk_idx");
    LowLatencyDispatchArgs a = good();
    std::vector<int64_t> idx = w.topk[static_cast<size_t>(me)];
    idx[idx.size() / 2] = bad;
    a.topk_idx = tensor_of(idx, {T, w.k}, DType::i64);
    EXPECT_EP_ERROR(buf->low_latency_dispatch(a));
  }
  {
    SCOPED_TRACE("async_finish together with return_recv_hook");
    LowLatencyDispatchArgs a = good();
    a.async_finish = true;
    a.return_recv_hook = true;
    EXPECT_EP_ERROR(buf->low_latency_dispatch(a));
  }
  {
    SCOPED_TRACE("num_experts not a multiple of the rank count");
    LowLatencyDispatchArgs a = good();
    a.num_experts = w.E + 1;
    if (R > 1) EXPECT_EP_ERROR(buf->low_latency_dispatch(a));
  }
  {
    SCOPED_TRACE("topk_idx rows != x rows");
    LowLatencyDispatchArgs a = good();
    std::vector<int64_t> idx = w.topk[static_cast<size_t>(me)];
    idx.resize(static_cast<size_t>((T + 1) * w.k), -1);
    a.topk_idx = tensor_of(idx, {T + 1, w.k}, DType::i64);
    EXPECT_EP_ERROR(buf->low_latency_dispatch(a));
  }
  {
    SCOPED_TRACE("x dtype f32");
    LowLatencyDispatchArgs a = good();
    a.x = Tensor::zeros({T, H}, DType::f32);
    EXPECT_EP_ERROR(buf->low_latency_dispatch(a));
  }
  {
    SCOPED_TRACE("cumulative_local_expert_recv_stats of the wrong size");
    LowLatencyDispatchArgs a = good();
    a.cumulative_local_expert_recv_stats = Tensor::zeros({w.El + 1}, DType::i32);
    EXPECT_EP_ERROR(buf->low_latency_dispatch(a));
    // [1, local_E] holds local_E elements, but its experts lie a row apart (written out of
    // bounds before 2026-12-03).
    a.cumulative_local_expert_recv_stats = Tensor::zeros({1, w.El}, DType::i32);
    EXPECT_EP_ERROR(buf->low_latency_dispatch(a));
  }

  // A good dispatch, then bad combines.
  LowLatencyDispatchResult r;
  if (!collective_step("dispatch after bad input", [&] { r = run_dispatch(*buf, good(), Completion::sync); })) return;
  check_ll_dispatch(r, w, Fmt::fp8, no_mask());
  Tensor y = Tensor::empty({w.El, w.slots(), w.H}, DType::bf16);
  write_expert_outputs(y, r, w, Fmt::fp8, Expert::scaled);
  {
    SCOPED_TRACE("combine: x of the wrong shape");
    LowLatencyCombineArgs a = combine_args(w, r, Tensor::zeros({w.El, w.slots() + 1, H}, DType::bf16), Completion::sync);
    EXPECT_EP_ERROR(buf->low_latency_combine(a));
  }
  {
    SCOPED_TRACE("combine: topk_weights of the wrong shape");
    LowLatencyCombineArgs a = combine_args(w, r, y, Completion::sync);
    a.topk_weights = Tensor::zeros({T + 1, w.k}, DType::f32);
    EXPECT_EP_ERROR(buf->low_latency_combine(a));
  }
  {
    SCOPED_TRACE("combine: async_finish together with return_recv_hook");
    LowLatencyCombineArgs a = combine_args(w, r, y, Completion::sync);
    a.async_finish = true;
    a.return_recv_hook = true;
    EXPECT_EP_ERROR(buf->low_latency_combine(a));
  }
  {
    SCOPED_TRACE("combine: zero_copy with x in private memory");
    LowLatencyCombineArgs a = combine_args(w, r, y, Completion::sync);
    a.zero_copy = true;
    EXPECT_EP_ERROR(buf->low_latency_combine(a));
  }
  {
    SCOPED_TRACE("combine: out over x (the expert outputs peers read), and out overlapping itself");
    LowLatencyCombineArgs a = combine_args(w, r, y, Completion::sync);
    a.out = Tensor::from_blob(y.data(), {T, H}, DType::bf16);
    expect_ep_error_on([&] { (void)buf->low_latency_combine(a); }, "out");
    const Tensor one_row = Tensor::empty({1, H}, DType::bf16);  // (every rank has 3 tokens or more)
    a.out = Tensor::from_blob(one_row.data(), {T, H}, DType::bf16, moekit::Device::cpu(), {0, 1});
    expect_ep_error_on([&] { (void)buf->low_latency_combine(a); }, "out");
  }
  for (int64_t bad : {int64_t{w.E}, int64_t{-2}, int64_t{1} << 40}) {
    SCOPED_TRACE("combine: expert id " + std::to_string(bad) + " in topk_idx");
    LowLatencyCombineArgs a = combine_args(w, r, y, Completion::sync);
    std::vector<int64_t> idx = w.topk[static_cast<size_t>(me)];
    idx[idx.size() / 2] = bad;
    a.topk_idx = tensor_of(idx, {T, w.k}, DType::i64);
    EXPECT_EP_ERROR(buf->low_latency_combine(a));
  }
  {
    SCOPED_TRACE("combine: empty handle");
    LowLatencyCombineArgs a = combine_args(w, r, y, Completion::sync);
    a.handle = LowLatencyHandle{};
    EXPECT_EP_ERROR(buf->low_latency_combine(a));
    EXPECT_EP_ERROR(buf->get_next_low_latency_combine_buffer(LowLatencyHandle{}));
  }
  {
    SCOPED_TRACE("combine: a handle from another buffer");
    BufferGuard other = make_ll_buffer(w.hint(), o);
    EXPECT_EP_ERROR(other->low_latency_combine(combine_args(w, r, y, Completion::sync)));
    EXPECT_EP_ERROR(other->get_next_low_latency_combine_buffer(r.handle));
  }
  {
    SCOPED_TRACE("the next combine buffer and a receive hook after destroy()");
    BufferGuard gone = make_ll_buffer(w.hint(), o);
    LowLatencyDispatchArgs a = good();
    a.return_recv_hook = true;
    LowLatencyDispatchResult h;
    if (!collective_step("dispatch with a hook", [&] { h = gone->low_latency_dispatch(a); })) return;
    gone->destroy();
    EXPECT_EP_ERROR(gone->get_next_low_latency_combine_buffer(h.handle));
    try {  // an Error or nothing (a receive that already ran); never a crash
      if (h.hook) h.hook();
    } catch (const moekit::Error&) {
    }
  }
  // The buffer still works, for more rounds than its two halves.
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE("good round " + std::to_string(round) + " after bad input");
    if (!run_case(*buf, w, round == 1 ? Fmt::bf16 : Fmt::fp8_ue8m0, kCompletions[round], no_mask()).ok) return;
  }
}

// Bad input on one rank only (docs/EP.md "Faults"): that rank raises at once, its peers raise
// an Error naming it instead of waiting for the timeout, and the buffer stays usable. Then a
// format, token limit or hidden size that differs across ranks (what must agree): every rank
// raises.
TEST(EpLowLatency, BadInputOnOneRankRaisesOnEveryRank) {
  const int R = num_ranks(), me = my_rank();
  if (R < 2) GTEST_SKIP() << "needs two ranks";
  LLSpec s = ll_spec(256, 2, 4, 8, tokens_per_rank([](int i) { return int64_t{2} + i % 7; }), 950);
  const LLWorld w = make_ll_world(s);
  BufferOptions o;
  o.timeout_s = 10;
  BufferGuard buf = make_ll_buffer(w.hint(), o);
  // Runs f on every rank: `bad` is the rank with bad input. Every rank must raise a
  // moekit::Error that is not a TimeoutError; the others' must name `bad` (bad < 0: every
  // rank is at fault).
  auto expect_all_raise = [&](const char* what, int bad, const std::function<void()>& f) {
    SCOPED_TRACE(what);
    const auto start = std::chrono::steady_clock::now();
    try {
      f();
      ADD_FAILURE() << "no Error on rank " << me;
    } catch (const TimeoutError& e) {
      ADD_FAILURE() << "a TimeoutError instead of an Error naming the rank at fault: " << e.what();
    } catch (const moekit::Error& e) {
      if (bad >= 0 && me != bad) {
        EXPECT_NE(std::string(e.what()).find("rank " + std::to_string(bad)), std::string::npos)
            << "the error should name rank " << bad << ": " << e.what();
      }
    } catch (const std::exception& e) {
      ADD_FAILURE() << "wrong exception type: " << e.what();
    }
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(waited, 5.0) << "raised only after about the buffer's 10 s timeout";
    polite_barrier();
  };
  const int bad_rank = R - 1;
  expect_all_raise("dispatch: an expert id out of range on one rank", bad_rank, [&] {
    LowLatencyDispatchArgs a = dispatch_args(w, Fmt::fp8, Completion::sync);
    if (me == bad_rank) {
      std::vector<int64_t> idx = w.topk[static_cast<size_t>(me)];
      idx[0] = w.E;
      a.topk_idx = tensor_of(idx, {w.T(me), w.k}, DType::i64);
    }
    (void)run_dispatch(*buf, a, Completion::sync);
  });
  LowLatencyDispatchResult r;
  if (!collective_step("good dispatch", [&] { r = run_dispatch(*buf, dispatch_args(w, Fmt::fp8, Completion::sync), Completion::sync); }))
    return;
  check_ll_dispatch(r, w, Fmt::fp8, no_mask());
  expect_all_raise("combine: topk_weights of the wrong shape on one rank", 0, [&] {
    Tensor y = Tensor::empty({w.El, w.slots(), w.H}, DType::bf16);
    write_expert_outputs(y, r, w, Fmt::fp8, Expert::scaled);
    LowLatencyCombineArgs a = combine_args(w, r, y, Completion::sync);
    if (me == 0) a.topk_weights = Tensor::zeros({w.T(me), w.k + 1}, DType::f32);
    (void)run_combine(*buf, a, Completion::sync);
  });
  expect_all_raise("combine: an expert id out of range on one rank", 0, [&] {
    Tensor y = Tensor::empty({w.El, w.slots(), w.H}, DType::bf16);
    write_expert_outputs(y, r, w, Fmt::fp8, Expert::scaled);
    LowLatencyCombineArgs a = combine_args(w, r, y, Completion::sync);
    if (me == 0) {
      std::vector<int64_t> idx = w.topk[0];
      idx[0] = w.E + 100000;
      a.topk_idx = tensor_of(idx, {w.T(0), w.k}, DType::i64);
    }
    (void)run_combine(*buf, a, Completion::sync);
  });
  expect_all_raise("combine: zero_copy with x in private memory on one rank", 0, [&] {
    Tensor y = me == 0 ? Tensor::empty({w.El, w.slots(), w.H}, DType::bf16) : buf->get_next_low_latency_combine_buffer(r.handle);
    write_expert_outputs(y, r, w, Fmt::fp8, Expert::scaled);
    LowLatencyCombineArgs a = combine_args(w, r, y, Completion::sync);
    a.zero_copy = true;
    (void)run_combine(*buf, a, Completion::sync);
  });
  expect_all_raise("dispatch: use_fp8 on rank 0 only", -1, [&] {
    (void)run_dispatch(*buf, dispatch_args(w, me == 0 ? Fmt::fp8 : Fmt::bf16, Completion::sync), Completion::sync);
  });
  expect_all_raise("dispatch: num_max_dispatch_tokens_per_rank one less on rank 0", -1, [&] {
    LowLatencyDispatchArgs a = dispatch_args(w, Fmt::bf16, Completion::sync);
    if (me == 0) a.num_max_dispatch_tokens_per_rank = w.max - 1;  // rank 0 has 2 tokens
    (void)run_dispatch(*buf, a, Completion::sync);
  });
  expect_all_raise("dispatch: another hidden size on rank 0", -1, [&] {
    LowLatencyDispatchArgs a = dispatch_args(w, Fmt::bf16, Completion::sync);
    if (me == 0) a.x = w.x[0].slice(1, 0, w.H - 128);
    (void)run_dispatch(*buf, a, Completion::sync);
  });
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE("good round " + std::to_string(round) + " after bad input on one rank");
    if (!run_case(*buf, w, round == 1 ? Fmt::bf16 : Fmt::fp8_round, kCompletions[round], no_mask()).ok) return;
  }
}

// ------------------------------------------------------------------ tests: masking (last)

// Rank m never takes part: the others' first dispatch times out naming m; they mask m and go
// on without it (nothing received from m, experts on m contribute nothing to combine); masks
// can be queried, lifted and cleaned. Afterwards every rank (m too) works on a fresh buffer.
TEST(EpLowLatency, MaskedRankIsSkipped) {
  const int R = num_ranks(), me = my_rank();
  if (R < 2) GTEST_SKIP() << "needs two ranks";
  const int m = R - 1;
  LLSpec s = ll_spec(256, 2, std::min(4, 2 * R), 10, tokens_per_rank([](int i) { return int64_t{4} + (3 * i) % 7; }), 1000, Data::rank_encoded);
  const LLWorld w = make_ll_world(s);
  std::vector<int> masked = no_mask();
  masked[static_cast<size_t>(m)] = 1;
  MPI_Comm others = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, me == m ? 1 : 0, me, &others);
  {
    BufferOptions o;
    o.timeout_s = 4;  // short, but long enough for the masked rounds on a loaded machine
    BufferGuard buf = make_ll_buffer(w.hint(), o);
    if (me != m) {
      // 1. m is silent: TimeoutError naming m, after about the buffer's timeout.
      const auto start = std::chrono::steady_clock::now();
      try {
        (void)buf->low_latency_dispatch(dispatch_args(w, Fmt::fp8, Completion::sync));
        ADD_FAILURE() << "low_latency_dispatch returned although rank " << m << " never called it";
      } catch (const TimeoutError& e) {
        const std::vector<int>& silent = e.silent_ranks();
        EXPECT_NE(std::find(silent.begin(), silent.end(), m), silent.end()) << "silent_ranks() lacks rank " << m << ": " << e.what();
        EXPECT_EQ(std::find(silent.begin(), silent.end(), me), silent.end()) << "silent_ranks() names the caller: " << e.what();
      } catch (const std::exception& e) {
        ADD_FAILURE() << "expected moekit::ep::TimeoutError, got: " << e.what();
      }
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      EXPECT_GE(waited, 3.5) << "gave up before the 4 s timeout";
      EXPECT_LT(waited, 30.0) << "took far longer than the 4 s timeout";

      // 2. Mask m (this rank's view) and go on without it, for more rounds than two halves.
      buf->low_latency_update_mask_buffer(m);
      EXPECT_EQ(vector_of<int32_t>(buf->low_latency_query_mask_buffer()), std::vector<int32_t>(masked.begin(), masked.end()));
      const Fmt fmts[] = {Fmt::bf16, Fmt::fp8_ue8m0, Fmt::fp8, Fmt::bf16};
      for (int round = 0; round < 4; ++round) {
        SCOPED_TRACE(std::string("rank ") + std::to_string(m) + " masked, round " + std::to_string(round) + ", " + fmt_name(fmts[round]) +
                     ", " + completion_name(kCompletions[round % 3]));
        if (!run_case(*buf, w, fmts[round], kCompletions[round % 3], masked, Tensor(), others).ok) break;
      }

      // 3. Lift and clean.
      buf->low_latency_update_mask_buffer(m, false);
      EXPECT_EQ(vector_of<int32_t>(buf->low_latency_query_mask_buffer()), std::vector<int32_t>(static_cast<size_t>(R), 0));
      buf->low_latency_update_mask_buffer(m);
      buf->low_latency_clean_mask_buffer();
      EXPECT_EQ(vector_of<int32_t>(buf->low_latency_query_mask_buffer()), std::vector<int32_t>(static_cast<size_t>(R), 0));
    } else {
      // m masks nobody and cannot mask itself.
      EXPECT_EP_ERROR(buf->low_latency_update_mask_buffer(m));
      EXPECT_EQ(vector_of<int32_t>(buf->low_latency_query_mask_buffer()), std::vector<int32_t>(static_cast<size_t>(R), 0));
    }
    polite_barrier();  // then destroy, collectively
  }
  MPI_Comm_free(&others);
  // Everyone agrees again on a fresh buffer.
  const LLWorld w2 = make_ll_world([&] {
    LLSpec s2 = s;
    s2.seed = 1001;
    s2.tokens = mixed_tokens(10);
    return s2;
  }());
  BufferGuard fresh = make_ll_buffer(w2.hint());
  SCOPED_TRACE("fresh buffer after masking");
  for (Fmt f : {Fmt::fp8, Fmt::bf16})
    if (!run_case(*fresh, w2, f, Completion::sync, no_mask()).ok) return;
}

}  // namespace
}  // namespace moekit::ep

// Expert-parallel normal mode (ep.md), mirroring DeepEP's test_intranode: every rank runs
// every test, in the same order (they are collective).
//
// Each test builds a "world": every rank's inputs (token counts, top-k routing, weights,
// activations) are pure functions of (seed, rank), so every rank can compute, without any
// communication, exactly what it must receive and what combine must return. On top of that
// the checks of ep.md "How the reference tests check it" are made as written there
// (all-reduced counts, rank-encoded rows, calc_diff of the combined rows, an MPI_Alltoallv
// cross-check, 20-run hashes).
//
// Rank-encoded rows: the row of token t of rank r holds r in every column but the last four,
// which hold the base-16 digits of t and a 448 marker (so the last 128-column group of an FP8
// row has scale exactly 1 and the digits survive FP8 exactly).
//
// A collective that throws on one rank makes all ranks skip the rest of that case (an
// MPI_Allreduce of an "ok" flag), so a failure costs at most one timeout, never a hang.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "moekit/ep.h"
#include "moekit/error.h"
#include "moekit/formats.h"
#include "moekit/tensor.h"
#include "ep/read_choice.h"
#include "ep_test_util.h"

namespace moekit::ep {
namespace {

using namespace testing;

// ------------------------------------------------------------------ MPI helpers

std::vector<int64_t> allreduce_sum(std::vector<int64_t> v) {
  MPI_Allreduce(MPI_IN_PLACE, v.data(), static_cast<int>(v.size()), MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  return v;
}

// ------------------------------------------------------------------ tensors

const char* row_bytes(const Tensor& t, int64_t r) {
  return static_cast<const char*>(t.data()) + r * t.stride(0) * static_cast<int64_t>(t.element_size());
}

float bf16_at(const Tensor& t, int64_t r, int64_t c) {
  return bf16_to_f32(reinterpret_cast<const uint16_t*>(row_bytes(t, r))[c * t.stride(1)]);
}

Tensor to_bf16_values(const Tensor& x, const Tensor& scales) {
  return x.dtype() == DType::e4m3 ? cast_back_from_fp8(x, scales, DType::bf16) : x;
}

std::string shape_of(const Tensor& t) { return t.defined() ? t.str() : std::string("(undefined)"); }

// ------------------------------------------------------------------ the world

struct WorldSpec {
  int64_t hidden = 256;
  int experts_per_rank = 8;
  int topk = 8;
  std::vector<int64_t> tokens;  // per rank
  uint64_t seed = 1;
  double p_drop_entry = 0.1;   // a top-k entry becomes -1
  double p_drop_token = 0.03;  // a token routes nowhere (all -1)
  std::vector<int> target_ranks;  // experts are chosen only on these ranks; empty = all

  WorldSpec drop(double entry, double token) const {
    WorldSpec s = *this;
    s.p_drop_entry = entry;
    s.p_drop_token = token;
    return s;
  }
  WorldSpec targets(std::vector<int> ranks) const {
    WorldSpec s = *this;
    s.target_ranks = std::move(ranks);
    return s;
  }
};

WorldSpec spec(int64_t hidden, int experts_per_rank, int topk, std::vector<int64_t> tokens, uint64_t seed) {
  WorldSpec s;
  s.hidden = hidden;
  s.experts_per_rank = experts_per_rank;
  s.topk = topk;
  s.tokens = std::move(tokens);
  s.seed = seed;
  return s;
}

struct World {
  WorldSpec spec;
  int R = 0, E = 0, El = 0, k = 0;
  int64_t H = 0;
  std::vector<std::vector<int64_t>> topk;     // [rank][t * k + j]
  std::vector<std::vector<float>> weights;    // [rank][t * k + j]
  std::vector<std::vector<uint8_t>> in_rank;  // [rank][t * R + r]

  int64_t T(int i) const { return spec.tokens[static_cast<size_t>(i)]; }
  bool sends(int i, int64_t t, int r) const { return in_rank[static_cast<size_t>(i)][static_cast<size_t>(t * R + r)] != 0; }
  int64_t expert_of(int i, int64_t t, int j) const { return topk[static_cast<size_t>(i)][static_cast<size_t>(t * k + j)]; }
};

World make_world(WorldSpec spec) {
  World w;
  w.R = num_ranks();
  if (spec.tokens.size() != static_cast<size_t>(w.R)) throw std::logic_error("WorldSpec.tokens needs one entry per rank");
  w.El = spec.experts_per_rank;
  w.E = w.El * w.R;
  w.k = spec.topk;
  w.H = spec.hidden;
  std::vector<int64_t> allowed;
  for (int r = 0; r < w.R; ++r) {
    if (!spec.target_ranks.empty() && std::find(spec.target_ranks.begin(), spec.target_ranks.end(), r) == spec.target_ranks.end())
      continue;
    for (int e = 0; e < w.El; ++e) allowed.push_back(static_cast<int64_t>(r) * w.El + e);
  }
  if (static_cast<int>(allowed.size()) < w.k) throw std::logic_error("fewer allowed experts than top-k");
  for (int i = 0; i < w.R; ++i) {
    const int64_t T = spec.tokens[static_cast<size_t>(i)];
    Rng rng{hash4(spec.seed, 0x7019, static_cast<uint64_t>(i), 0)};
    std::vector<int64_t> idx(static_cast<size_t>(T * w.k), -1);
    std::vector<float> wt(static_cast<size_t>(T * w.k));
    std::vector<uint8_t> inr(static_cast<size_t>(T * w.R), 0);
    for (int64_t t = 0; t < T; ++t) {
      const bool nowhere = rng.unit() < spec.p_drop_token;
      std::vector<int64_t> pool = allowed;
      for (int j = 0; j < w.k; ++j) {
        const size_t pick = j + static_cast<size_t>(rng.below(pool.size() - static_cast<size_t>(j)));
        std::swap(pool[static_cast<size_t>(j)], pool[pick]);
        int64_t e = pool[static_cast<size_t>(j)];
        if (nowhere || rng.unit() < spec.p_drop_entry) e = -1;
        idx[static_cast<size_t>(t * w.k + j)] = e;
        // Exact in f32; nonzero even for -1 entries (dispatch must zero those).
        wt[static_cast<size_t>(t * w.k + j)] = 0.25f + static_cast<float>(rng.below(1024)) / 1024.0f;
        if (e >= 0) inr[static_cast<size_t>(t * w.R + e / w.El)] = 1;
      }
    }
    w.topk.push_back(std::move(idx));
    w.weights.push_back(std::move(wt));
    w.in_rank.push_back(std::move(inr));
  }
  w.spec = std::move(spec);
  return w;
}

// What rank `me` sends and receives in `w`, derived without any communication, plus the
// all-reduced counts of ep.md's checks (collective).
struct Expected {
  std::vector<int> src_rank;        // received rows, in order
  std::vector<int64_t> src_token;
  std::vector<int64_t> topk;        // [n * k], local ids or -1
  std::vector<float> weights;       // [n * k], 0 where topk is -1
  std::vector<int64_t> expert_count;     // [El] (token, local expert) pairs received, unpadded
  std::vector<int32_t> prefix;           // [R * R] rank_prefix_matrix
  std::vector<int32_t> send_head;        // [T * R]
  std::vector<int32_t> tokens_per_rank;  // [R] of my tokens
  std::vector<int32_t> tokens_per_expert;  // [E] of my tokens
  std::vector<uint8_t> is_token_in_rank;   // [T * R]
  std::vector<int32_t> coverage;           // [T] ranks my token goes to
  // all-reduced from every rank's own counts (ep.md "Counts")
  int64_t gbl_tokens_to_me = 0;
  std::vector<int64_t> gbl_local_expert_count;  // [El]
  int64_t gbl_total_tokens = 0;                 // sum of T over ranks
  int64_t n() const { return static_cast<int64_t>(src_rank.size()); }
};

Expected expect_for(const World& w) {
  const int me = my_rank();
  const int R = w.R, k = w.k;
  Expected ex;
  for (int i = 0; i < R; ++i)
    for (int64_t t = 0; t < w.T(i); ++t)
      if (w.sends(i, t, me)) {
        ex.src_rank.push_back(i);
        ex.src_token.push_back(t);
        for (int j = 0; j < k; ++j) {
          const int64_t e = w.expert_of(i, t, j);
          const bool local = e >= 0 && e / w.El == me;
          ex.topk.push_back(local ? e - static_cast<int64_t>(me) * w.El : -1);
          ex.weights.push_back(local ? w.weights[static_cast<size_t>(i)][static_cast<size_t>(t * k + j)] : 0.0f);
        }
      }
  ex.expert_count.assign(static_cast<size_t>(w.El), 0);
  for (int64_t e : ex.topk)
    if (e >= 0) ++ex.expert_count[static_cast<size_t>(e)];
  ex.prefix.assign(static_cast<size_t>(R * R), 0);
  for (int d = 0; d < R; ++d) {
    int32_t sum = 0;
    for (int s = 0; s < R; ++s) {
      for (int64_t t = 0; t < w.T(s); ++t) sum += w.sends(s, t, d) ? 1 : 0;
      ex.prefix[static_cast<size_t>(s * R + d)] = sum;
    }
  }
  const int64_t T = w.T(me);
  ex.send_head.assign(static_cast<size_t>(T * R), -1);
  ex.tokens_per_rank.assign(static_cast<size_t>(R), 0);
  ex.tokens_per_expert.assign(static_cast<size_t>(w.E), 0);
  ex.is_token_in_rank = w.in_rank[static_cast<size_t>(me)];
  ex.coverage.assign(static_cast<size_t>(T), 0);
  for (int64_t t = 0; t < T; ++t) {
    for (int r = 0; r < R; ++r)
      if (w.sends(me, t, r)) {
        ex.send_head[static_cast<size_t>(t * R + r)] = ex.tokens_per_rank[static_cast<size_t>(r)]++;
        ++ex.coverage[static_cast<size_t>(t)];
      }
    for (int j = 0; j < k; ++j) {
      const int64_t e = w.expert_of(me, t, j);
      if (e >= 0) ++ex.tokens_per_expert[static_cast<size_t>(e)];
    }
  }
  // ep.md "Counts": all-reduce every rank's own counts.
  std::vector<int64_t> mine(static_cast<size_t>(R + w.E + 1));
  for (int r = 0; r < R; ++r) mine[static_cast<size_t>(r)] = ex.tokens_per_rank[static_cast<size_t>(r)];
  for (int e = 0; e < w.E; ++e) mine[static_cast<size_t>(R + e)] = ex.tokens_per_expert[static_cast<size_t>(e)];
  mine[static_cast<size_t>(R + w.E)] = T;
  const std::vector<int64_t> gbl = allreduce_sum(mine);
  ex.gbl_tokens_to_me = gbl[static_cast<size_t>(me)];
  for (int e = 0; e < w.El; ++e) ex.gbl_local_expert_count.push_back(gbl[static_cast<size_t>(R + me * w.El + e)]);
  ex.gbl_total_tokens = gbl[static_cast<size_t>(R + w.E)];
  // The world simulation must agree with the all-reduce (a check of this test itself).
  EXPECT_EQ(ex.gbl_tokens_to_me, ex.n());
  for (int e = 0; e < w.El; ++e) EXPECT_EQ(ex.gbl_local_expert_count[static_cast<size_t>(e)], ex.expert_count[static_cast<size_t>(e)]);
  return ex;
}

// The routing inputs of this rank, as dispatch takes them.
struct RoutingTensors {
  Tensor topk_idx, topk_weights, num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank;
};

RoutingTensors routing_of(const World& w, const Expected& ex) {
  const int me = my_rank();
  const int64_t T = w.T(me);
  RoutingTensors rt;
  rt.topk_idx = tensor_of(w.topk[static_cast<size_t>(me)], {T, w.k}, DType::i64);
  rt.topk_weights = tensor_of(w.weights[static_cast<size_t>(me)], {T, w.k}, DType::f32);
  rt.num_tokens_per_rank = tensor_of(ex.tokens_per_rank, {w.R}, DType::i32);
  rt.num_tokens_per_expert = tensor_of(ex.tokens_per_expert, {w.E}, DType::i32);
  rt.is_token_in_rank = tensor_of(ex.is_token_in_rank, {T, w.R}, DType::boolean);
  return rt;
}

// ------------------------------------------------------------------ activations

const char* data_name(Data d) { return d == Data::rank_encoded ? "rank-encoded" : "random"; }

// bf16 [n, H]: rows (src[i], tok[i]).
Tensor make_rows(Data d, uint64_t seed, const std::vector<int>& src, const std::vector<int64_t>& tok, int64_t H) {
  const int64_t n = static_cast<int64_t>(src.size());
  Tensor t = Tensor::empty({n, H}, DType::bf16);
  for (int64_t i = 0; i < n; ++i) fill_row(d, seed, src[static_cast<size_t>(i)], tok[static_cast<size_t>(i)], H, t.data_ptr<uint16_t>() + i * H);
  return t;
}

Tensor make_x(Data d, uint64_t seed, int src, int64_t T, int64_t H) {
  std::vector<int> s(static_cast<size_t>(T), src);
  std::vector<int64_t> tok(static_cast<size_t>(T));
  std::iota(tok.begin(), tok.end(), 0);
  return make_rows(d, seed, s, tok, H);
}

Tensor random_bf16(const Shape& shape, uint64_t seed) {
  Tensor t = Tensor::empty(shape, DType::bf16);
  for (int64_t i = 0; i < t.numel(); ++i) t.data_ptr<uint16_t>()[i] = f32_to_bf16(normalish(hash4(seed, 0xb1a5, static_cast<uint64_t>(i), 0)));
  return t;
}

// What one rank sends: the bf16 original, the dispatched form, and the bf16 values that a
// receiver gets back from it (x itself, or the FP8 cast back).
struct Payload {
  Tensor original;  // bf16 [T, H]
  Tensor x, scales;  // bf16, or e4m3 + f32 [T, ceil(H/128)]
  Tensor seen;       // bf16 [T, H]
};

Payload make_payload(const Tensor& original, bool fp8) {
  Payload p;
  p.original = original;
  if (fp8) {
    Quantized q = per_token_cast_to_fp8(original, false, 128);
    p.x = q.values;
    p.scales = q.sf;
    p.seen = cast_back_from_fp8(p.x, p.scales, DType::bf16);
  } else {
    p.x = original;
    p.seen = original;
  }
  return p;
}

// ------------------------------------------------------------------ buffers

constexpr int64_t kMaxHidden = 7168;

Config small_chunk_config() {
  Config c;
  c.num_sms = 2;
  c.num_max_nvl_chunked_send_tokens = 3;
  c.num_max_nvl_chunked_recv_tokens = 8;
  return c;
}

int64_t nvl_bytes_for(int64_t hidden_bytes) {
  const int R = num_ranks();
  int64_t b = 0;
  for (const Config& c : {Buffer::get_dispatch_config(R), Buffer::get_combine_config(R), Config{}, small_chunk_config()})
    b = std::max(b, c.get_nvl_buffer_size_hint(hidden_bytes, R));
  return b;
}

BufferGuard make_buffer(BufferOptions options = {}, int64_t max_hidden = kMaxHidden) {
  BufferGuard g;
  g.buf = std::make_unique<Buffer>(MPI_COMM_WORLD, nvl_bytes_for(max_hidden * 2), 0, options);
  return g;
}

// ------------------------------------------------------------------ checks

int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

struct DispatchExpectation {
  const World* world = nullptr;
  const Expected* ex = nullptr;
  Data data = Data::random;
  bool fp8 = false;
  bool with_topk = false;  // top-k outputs expected
  bool cached = false;     // result of a cached dispatch (its handle is not checked)
  int alignment = 1;
  int64_t num_worst = 0;
  Tensor rows;    // expected bf16 rows [n, H]
  Quantized q;    // expected e4m3 rows and scales (fp8)
};

// Compares the first n rows of got ([>= n, cols]) with want ([n, cols]) byte for byte.
void expect_rows_identical(const char* what, const Tensor& got, const Tensor& want, const Expected& ex) {
  const int64_t n = want.size(0);
  const size_t bytes = static_cast<size_t>(want.size(1)) * want.element_size();
  int64_t bad = 0, first = -1;
  for (int64_t r = 0; r < n; ++r)
    if (std::memcmp(row_bytes(got, r), row_bytes(want, r), bytes) != 0) {
      if (first < 0) first = r;
      ++bad;
    }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << n << " received rows differ from what the source sent; first: row "
                    << first << " (source rank " << (first >= 0 ? ex.src_rank[static_cast<size_t>(first)] : -1)
                    << ", token " << (first >= 0 ? ex.src_token[static_cast<size_t>(first)] : -1) << ")";
}

// ep.md "Rank-encoded data": segment i (rank_prefix_matrix) holds value i; the id columns
// hold the source token ids, ascending, equal to recv_src_idx.
void check_rank_encoded(const Tensor& seen, const DispatchHandle& h, int64_t n, int R, int me) {
  const int64_t H = seen.size(1);
  ASSERT_TRUE(h.rank_prefix_matrix.defined());
  ASSERT_TRUE(h.recv_src_idx.defined());
  const std::vector<int32_t> prefix = vector_of<int32_t>(h.rank_prefix_matrix);
  const std::vector<int32_t> src_idx = vector_of<int32_t>(h.recv_src_idx);
  ASSERT_EQ(prefix.size(), static_cast<size_t>(R * R));
  ASSERT_GE(static_cast<int64_t>(src_idx.size()), n);
  int64_t start = 0;
  for (int i = 0; i < R; ++i) {
    const int64_t end = prefix[static_cast<size_t>(i * R + me)];
    ASSERT_LE(start, end) << "rank_prefix_matrix column " << me << " decreases at row " << i;
    ASSERT_LE(end, n);
    int64_t previous = -1;
    for (int64_t r = start; r < end; ++r) {
      for (int64_t c = 0; c < H - kIdColumns; ++c)
        if (bf16_at(seen, r, c) != static_cast<float>(i)) {
          ADD_FAILURE() << "row " << r << " of source segment " << i << ", column " << c << ": " << bf16_at(seen, r, c)
                        << ", expected " << i;
          return;
        }
      const float d2 = bf16_at(seen, r, H - 4), d1 = bf16_at(seen, r, H - 3), d0 = bf16_at(seen, r, H - 2);
      ASSERT_EQ(bf16_at(seen, r, H - 1), 448.0f) << "row " << r;
      const int64_t id = static_cast<int64_t>(d2) * 256 + static_cast<int64_t>(d1) * 16 + static_cast<int64_t>(d0);
      ASSERT_EQ(id, src_idx[static_cast<size_t>(r)]) << "row " << r << " (segment " << i << "): token id in the data vs recv_src_idx";
      ASSERT_GT(id, previous) << "row " << r << " (segment " << i << "): source tokens not ascending";
      previous = id;
    }
    start = end;
  }
  EXPECT_EQ(start, n);
}

void check_dispatch(const DispatchResult& res, const DispatchHandle& routing, const DispatchExpectation& x) {
  const World& w = *x.world;
  const Expected& ex = *x.ex;
  const int me = my_rank();
  const int64_t n = ex.n(), H = w.H, T = w.T(me);
  const int64_t rows = x.num_worst > 0 ? x.num_worst : n;
  const int64_t groups = (H + 127) / 128;

  // ep.md "Counts": rows == allreduce(num_tokens_per_rank)[rank].
  EXPECT_EQ(n, ex.gbl_tokens_to_me);
  ASSERT_TRUE(res.recv_x.defined());
  ASSERT_EQ(res.recv_x.dtype(), x.fp8 ? DType::e4m3 : DType::bf16) << shape_of(res.recv_x);
  ASSERT_EQ(res.recv_x.shape(), (Shape{rows, H})) << "recv_x " << shape_of(res.recv_x) << ", expected " << rows << " rows";
  ASSERT_EQ(res.recv_x.stride(1), 1);
  if (x.fp8) {
    ASSERT_TRUE(res.recv_x_scales.defined());
    ASSERT_EQ(res.recv_x_scales.dtype(), DType::f32);
    ASSERT_EQ(res.recv_x_scales.shape(), (Shape{rows, groups})) << shape_of(res.recv_x_scales);
    ASSERT_EQ(res.recv_x_scales.stride(1), 1);
    expect_rows_identical("recv_x (e4m3)", res.recv_x, x.q.values, ex);
    expect_rows_identical("recv_x_scales", res.recv_x_scales, x.q.sf, ex);
  } else {
    EXPECT_FALSE(res.recv_x_scales.defined()) << shape_of(res.recv_x_scales);
    expect_rows_identical("recv_x (bf16)", res.recv_x, x.rows, ex);
  }

  // The routing handle: for a fresh dispatch the one it returned.
  const DispatchHandle& h = routing;
  ASSERT_TRUE(h.defined());
  EXPECT_EQ(h.num_recv_tokens, n);
  EXPECT_EQ(h.hidden, H);
  ASSERT_TRUE(h.rank_prefix_matrix.defined());
  EXPECT_EQ(h.rank_prefix_matrix.dtype(), DType::i32);
  EXPECT_EQ(h.rank_prefix_matrix.shape(), (Shape{w.R, w.R}));
  EXPECT_EQ(vector_of<int32_t>(h.rank_prefix_matrix), ex.prefix) << "rank_prefix_matrix";
  ASSERT_TRUE(h.recv_src_idx.defined());
  EXPECT_EQ(h.recv_src_idx.dtype(), DType::i32);
  ASSERT_EQ(h.recv_src_idx.dim(), 1);
  EXPECT_TRUE(h.recv_src_idx.size(0) == n || h.recv_src_idx.size(0) == rows) << shape_of(h.recv_src_idx);
  {
    std::vector<int32_t> got = vector_of<int32_t>(h.recv_src_idx);
    got.resize(static_cast<size_t>(std::min<int64_t>(n, static_cast<int64_t>(got.size()))));
    std::vector<int32_t> want(ex.src_token.begin(), ex.src_token.end());
    EXPECT_EQ(got, want) << "recv_src_idx";
  }
  ASSERT_TRUE(h.is_token_in_rank.defined());
  EXPECT_EQ(h.is_token_in_rank.dtype(), DType::boolean);
  EXPECT_EQ(h.is_token_in_rank.shape(), (Shape{T, w.R}));
  EXPECT_EQ(vector_of<uint8_t>(h.is_token_in_rank), ex.is_token_in_rank) << "handle.is_token_in_rank";
  ASSERT_TRUE(h.send_head.defined());
  EXPECT_EQ(h.send_head.dtype(), DType::i32);
  EXPECT_EQ(h.send_head.shape(), (Shape{T, w.R}));
  EXPECT_EQ(vector_of<int32_t>(h.send_head), ex.send_head) << "handle.send_head";

  // Top-k outputs.
  if (x.with_topk) {
    ASSERT_TRUE(res.recv_topk_idx.defined());
    ASSERT_TRUE(res.recv_topk_weights.defined());
    ASSERT_EQ(res.recv_topk_idx.dtype(), DType::i64);
    ASSERT_EQ(res.recv_topk_weights.dtype(), DType::f32);
    ASSERT_EQ(res.recv_topk_idx.shape(), (Shape{rows, w.k})) << shape_of(res.recv_topk_idx);
    ASSERT_EQ(res.recv_topk_weights.shape(), (Shape{rows, w.k})) << shape_of(res.recv_topk_weights);
    const std::vector<int64_t> idx = vector_of<int64_t>(res.recv_topk_idx);
    const std::vector<float> wt = vector_of<float>(res.recv_topk_weights);
    int64_t out_of_range = 0;
    for (int64_t v : idx) out_of_range += (v < -1 || v >= w.El) ? 1 : 0;
    EXPECT_EQ(out_of_range, 0) << "recv_topk_idx entries outside [-1, " << w.El << ")";
    const std::vector<int64_t> valid_idx(idx.begin(), idx.begin() + n * w.k);
    EXPECT_EQ(valid_idx, ex.topk) << "recv_topk_idx (rewritten to local ids)";
    const std::vector<float> valid_wt(wt.begin(), wt.begin() + n * w.k);
    EXPECT_EQ(valid_wt, ex.weights) << "recv_topk_weights (0 where the expert is not local)";
    int64_t padding_not_minus_one = 0;
    for (size_t i = static_cast<size_t>(n * w.k); i < idx.size(); ++i) padding_not_minus_one += idx[i] != -1 ? 1 : 0;
    EXPECT_EQ(padding_not_minus_one, 0) << "recv_topk_idx of the worst-case padding rows must be -1";
  } else {
    EXPECT_FALSE(res.recv_topk_idx.defined()) << shape_of(res.recv_topk_idx);
    EXPECT_FALSE(res.recv_topk_weights.defined()) << shape_of(res.recv_topk_weights);
  }

  // Per-expert list (not defined for a cached dispatch).
  if (!x.cached) {
    if (x.num_worst > 0) {
      EXPECT_TRUE(res.num_recv_tokens_per_expert_list.empty()) << "per-expert list with num_worst_tokens > 0";
    } else {
      std::vector<int> want, want_gbl;
      for (int e = 0; e < w.El; ++e) {
        want.push_back(static_cast<int>(align_up(ex.expert_count[static_cast<size_t>(e)], x.alignment)));
        want_gbl.push_back(static_cast<int>(align_up(ex.gbl_local_expert_count[static_cast<size_t>(e)], x.alignment)));
      }
      EXPECT_EQ(res.num_recv_tokens_per_expert_list, want) << "per-expert list, alignment " << x.alignment;
      EXPECT_EQ(res.num_recv_tokens_per_expert_list, want_gbl) << "per-expert list vs all-reduced counts";
    }
  }

  // Rank-encoded semantics, read through the handle (ep.md "Rank-encoded data").
  if (x.data == Data::rank_encoded && n > 0) {
    const Tensor valid = res.recv_x.slice(0, 0, n);
    const Tensor seen = x.fp8 ? cast_back_from_fp8(valid, res.recv_x_scales.slice(0, 0, n), DType::bf16) : valid;
    check_rank_encoded(seen, h, n, w.R, me);
  }
}

enum class Bias { none, b0, b1, both };
const char* bias_name(Bias b) {
  switch (b) {
    case Bias::none: return "no bias";
    case Bias::b0: return "bias_0";
    case Bias::b1: return "bias_1";
    case Bias::both: return "bias_0+bias_1";
  }
  return "?";
}

struct CombineExpectation {
  const Tensor* original = nullptr;  // bf16 [T, H] the token's x before dispatch
  const Tensor* seen = nullptr;      // bf16 [T, H] what one receiver returns (before its factor)
  std::vector<double> factor;        // [T] sum over receiving ranks of the factor each applied
  Tensor bias_0, bias_1;
  bool fp8 = false;
  std::optional<std::vector<float>> topk_weights;  // expected combined_topk_weights [T * k]
  int k = 0;
};

void check_combine(const CombineResult& res, const CombineExpectation& c) {
  const Tensor& x = *c.original;
  const int64_t T = x.size(0), H = x.size(1);
  ASSERT_TRUE(res.combined_x.defined());
  ASSERT_EQ(res.combined_x.dtype(), DType::bf16);
  ASSERT_EQ(res.combined_x.shape(), (Shape{T, H})) << shape_of(res.combined_x);
  const bool has_bias = c.bias_0.defined() || c.bias_1.defined();
  // Element by element: sum of the receivers' rows (exact in f32 here) plus the biases.
  int64_t bad = 0, first_t = -1, first_c = -1;
  float first_got = 0, first_want = 0;
  // ep.md: calc_diff(combined / is_token_in_rank.sum(1), x) over the tokens that went somewhere.
  // With biases the bf16 rounding of the result is relative to |n x + b0 + b1|, not |x|: a
  // correct result can miss 5e-6 against x (5.2e-6 seen), so bf16 with biases is judged
  // against the exact sum instead (and FP8 with biases against x as well, at 5e-4).
  std::vector<float> check, ref, got_all, want_all;
  for (int64_t t = 0; t < T; ++t) {
    const double f = c.factor[static_cast<size_t>(t)];
    for (int64_t col = 0; col < H; ++col) {
      const float v = bf16_at(*c.seen, t, col);
      const float b0 = c.bias_0.defined() ? bf16_at(c.bias_0, t, col) : 0.0f;
      const float b1 = c.bias_1.defined() ? bf16_at(c.bias_1, t, col) : 0.0f;
      const float sum = static_cast<float>(f) * v;  // exact: few bits times a bf16
      const float want = (sum + b0) + b1;
      const float got = bf16_at(res.combined_x, t, col);
      bool ok;
      if (!has_bias) {
        ok = got == bf16_to_f32(f32_to_bf16(want));
      } else {
        // One bf16 rounding of the result, plus f32 rounding of the additions in any order.
        const float tol = std::ldexp(std::fabs(want), -8) + std::ldexp(std::fabs(sum) + std::fabs(b0) + std::fabs(b1), -18);
        ok = std::fabs(got - want) <= tol;
      }
      if (!ok && bad++ == 0) first_t = t, first_c = col, first_got = got, first_want = want;
      if (f > 0) {
        check.push_back((got - b0 - b1) / static_cast<float>(f));
        ref.push_back(bf16_at(x, t, col));
      }
      if (has_bias) {
        got_all.push_back(got);
        want_all.push_back(want);
      }
    }
  }
  EXPECT_EQ(bad, 0) << bad << " combined elements wrong; first: token " << first_t << " column " << first_c << ": got "
                    << first_got << ", expected " << first_want << (has_bias ? " (+- one bf16 ulp)" : " (exact)")
                    << "; the token's row summed with factor " << (first_t >= 0 ? c.factor[static_cast<size_t>(first_t)] : 0);
  auto diff_of = [](std::vector<float>& a, std::vector<float>& b) {
    const int64_t m = static_cast<int64_t>(a.size());
    return calc_diff(Tensor::from_blob(a.data(), {m}, DType::f32), Tensor::from_blob(b.data(), {m}, DType::f32));
  };
  if (!check.empty() && (!has_bias || c.fp8)) {
    EXPECT_LT(diff_of(check, ref), c.fp8 ? 5e-4 : 5e-6) << "calc_diff(combined / is_token_in_rank.sum(1), x)";
  }
  if (!got_all.empty()) {
    EXPECT_LT(diff_of(got_all, want_all), 5e-6) << "calc_diff(combined, sum of the returned rows + biases)";
  }
  if (c.topk_weights) {
    ASSERT_TRUE(res.combined_topk_weights.defined());
    ASSERT_EQ(res.combined_topk_weights.dtype(), DType::f32);
    ASSERT_EQ(res.combined_topk_weights.shape(), (Shape{T, c.k})) << shape_of(res.combined_topk_weights);
    EXPECT_EQ(vector_of<float>(res.combined_topk_weights), *c.topk_weights) << "combined_topk_weights";
  } else {
    EXPECT_FALSE(res.combined_topk_weights.defined()) << shape_of(res.combined_topk_weights);
  }
}

// combined_topk_weights when every receiver returns its recv_topk_weights: the weight of
// each valid entry (only its expert's rank has it nonzero), 0 for -1 entries.
std::vector<float> summed_dispatch_weights(const World& w) {
  const int me = my_rank();
  std::vector<float> out(static_cast<size_t>(w.T(me) * w.k), 0.0f);
  for (int64_t t = 0; t < w.T(me); ++t)
    for (int j = 0; j < w.k; ++j)
      if (w.expert_of(me, t, j) >= 0)
        out[static_cast<size_t>(t * w.k + j)] = w.weights[static_cast<size_t>(me)][static_cast<size_t>(t * w.k + j)];
  return out;
}

std::vector<double> coverage_factor(const Expected& ex) { return {ex.coverage.begin(), ex.coverage.end()}; }

// ------------------------------------------------------------------ one dispatch + combine case

struct Case {
  bool fp8 = false, with_topk = true, async = false, cached = false;
  int alignment = 1;
  std::optional<Config> config;
  Bias bias = Bias::none;
  bool zero_copy = true;  // combine once more from Buffer::alloc_shared memory
  std::string str() const {
    std::ostringstream s;
    s << (fp8 ? "fp8" : "bf16") << (with_topk ? ", with top-k" : ", without top-k") << (async ? ", async" : ", sync")
      << (cached ? ", cached handle" : ", fresh") << ", alignment " << alignment << ", "
      << (config ? "config num_sms=" + std::to_string(config->num_sms) + " nvl_send=" + std::to_string(config->num_max_nvl_chunked_send_tokens)
                 : std::string("default config"))
      << ", " << bias_name(bias);
    return s.str();
  }
};

// Everything a world needs that does not depend on the case flags.
struct Prepared {
  const World* world;
  const Expected* ex;
  Data data;
  uint64_t seed;
  Payload payload[2];    // [fp8]
  Tensor rows;           // expected received bf16 rows
  Quantized q;           // expected received e4m3 rows
  Payload other[2];      // different activations, for the dispatch that makes a cached handle
};

Prepared prepare(const World& w, const Expected& ex, Data data, uint64_t seed) {
  const int me = my_rank();
  Prepared p{&w, &ex, data, seed, {}, {}, {}, {}};
  const Tensor x = make_x(data, seed, me, w.T(me), w.H);
  const Tensor other = make_x(Data::random, seed + 1000, me, w.T(me), w.H);
  for (int f = 0; f < 2; ++f) {
    p.payload[f] = make_payload(x, f == 1);
    p.other[f] = make_payload(other, f == 1);
  }
  p.rows = make_rows(data, seed, ex.src_rank, ex.src_token, w.H);
  p.q = per_token_cast_to_fp8(p.rows, false, 128);
  return p;
}

DispatchArgs fresh_args(const Payload& pl, const RoutingTensors& rt, bool with_topk, int alignment, const std::optional<Config>& config,
                        bool async) {
  DispatchArgs a;
  a.x = pl.x;
  a.x_scales = pl.scales;
  a.num_tokens_per_rank = rt.num_tokens_per_rank;
  a.is_token_in_rank = rt.is_token_in_rank;
  a.num_tokens_per_expert = rt.num_tokens_per_expert;
  if (with_topk) {
    a.topk_idx = rt.topk_idx;
    a.topk_weights = rt.topk_weights;
  }
  a.expert_alignment = alignment;
  a.config = config;
  a.async_finish = async;
  return a;
}

Tensor bias_tensor(int64_t T, int64_t H, uint64_t seed) { return random_bf16({T, H}, hash4(seed, static_cast<uint64_t>(my_rank()), 0xb0, 0)); }

void run_case(Buffer& buf, const Prepared& p, const Case& c) {
  const World& w = *p.world;
  const Expected& ex = *p.ex;
  const int me = my_rank();
  const int f = c.fp8 ? 1 : 0;
  const Payload& pl = p.payload[f];
  const RoutingTensors rt = routing_of(w, ex);

  // Cached mode: the handle comes from an earlier fresh dispatch of other activations.
  DispatchResult first;
  if (c.cached) {
    if (!collective_step("dispatch (to make the cached handle)", [&] {
          first = buf.dispatch(fresh_args(p.other[f], rt, c.with_topk, c.alignment, c.config, c.async));
          first.event.wait();
        }))
      return;
  }

  DispatchResult res;
  if (!collective_step("dispatch", [&] {
        if (c.cached) {
          DispatchArgs a;
          a.x = pl.x;
          a.x_scales = pl.scales;
          a.handle = first.handle;
          a.config = c.config;
          a.async_finish = c.async;
          res = buf.dispatch(a);
        } else {
          res = buf.dispatch(fresh_args(pl, rt, c.with_topk, c.alignment, c.config, c.async));
        }
        if (c.async) {
          res.event.wait();
          EXPECT_TRUE(res.event.done());
        }
      }))
    return;

  const DispatchHandle& handle = c.cached ? first.handle : res.handle;
  DispatchExpectation de;
  de.world = &w;
  de.ex = &ex;
  de.data = p.data;
  de.fp8 = c.fp8;
  de.with_topk = c.with_topk && !c.cached;
  de.cached = c.cached;
  de.alignment = c.alignment;
  de.rows = p.rows;
  de.q = p.q;
  {
    SCOPED_TRACE("dispatch");
    check_dispatch(res, handle, de);
  }

  // Combine: every rank returns what it received, unchanged (bf16; FP8 cast back).
  const int64_t T = w.T(me), H = w.H;
  CombineArgs ca;
  ca.x = to_bf16_values(res.recv_x, res.recv_x_scales);
  ca.handle = handle;
  if (c.with_topk) ca.topk_weights = c.cached ? first.recv_topk_weights : res.recv_topk_weights;
  if (c.bias == Bias::b0 || c.bias == Bias::both) ca.bias_0 = bias_tensor(T, H, p.seed + 1);
  if (c.bias == Bias::b1 || c.bias == Bias::both) ca.bias_1 = bias_tensor(T, H, p.seed + 2);
  ca.config = c.config;
  ca.async_finish = c.async;
  CombineResult comb;
  if (!collective_step("combine", [&] {
        comb = buf.combine(ca);
        if (c.async) {
          comb.event.wait();
          EXPECT_TRUE(comb.event.done());
        }
      }))
    return;
  CombineExpectation ce;
  ce.original = &pl.original;
  ce.seen = &pl.seen;
  ce.factor = coverage_factor(ex);
  ce.bias_0 = ca.bias_0;
  ce.bias_1 = ca.bias_1;
  ce.fp8 = c.fp8;
  ce.k = w.k;
  if (c.with_topk) ce.topk_weights = summed_dispatch_weights(w);
  {
    SCOPED_TRACE("combine");
    check_combine(comb, ce);
  }

  if (!c.zero_copy) return;
  // The same combine with x in other memory must give bit-identical results: x in this rank's
  // Buffer::alloc_shared memory (owners read it in place) and, for bf16 where recv_x itself
  // lives in the Buffer's shared memory, x copied to private memory.
  auto again = [&](const char* what, bool shared_memory, int64_t row_pad = 0) {
    CombineResult other;
    if (!collective_step(std::string("combine (") + what + ")", [&] {
          // row_pad > 0: private rows further apart than a row (a column slice of a wider tensor)
          Tensor xs = shared_memory ? buf.alloc_shared(ca.x.shape(), DType::bf16)
                      : row_pad > 0 ? Tensor::empty({ca.x.size(0), ca.x.size(1) + row_pad}, DType::bf16).slice(1, 0, ca.x.size(1))
                                    : Tensor::empty(ca.x.shape(), DType::bf16);
          EXPECT_EQ(xs.shape(), ca.x.shape());
          EXPECT_EQ(xs.dtype(), DType::bf16);
          if (ca.x.numel() > 0 && xs.shape() == ca.x.shape() && xs.dtype() == DType::bf16) xs.copy_from(ca.x);
          CombineArgs sa = ca;
          sa.x = xs;
          other = buf.combine(sa);
          if (c.async) other.event.wait();
        }))
      return;
    EXPECT_EQ(fnv1a(0, other.combined_x), fnv1a(0, comb.combined_x)) << "combined_x with x " << what << " differs";
    EXPECT_EQ(fnv1a(0, other.combined_topk_weights), fnv1a(0, comb.combined_topk_weights))
        << "combined_topk_weights with x " << what << " differ";
  };
  again("from Buffer::alloc_shared", true);
  if (!c.fp8) again("copied to private memory", false);
  if (!c.fp8 && c.cached) again("copied to private memory, rows padded", false, 32);
}

// Every case of ep.md's matrix: {bf16, fp8} x {with, without top-k} x {sync, async} x
// {fresh, cached}, each for rank-encoded and random activations.
void run_matrix(const WorldSpec& spec, uint64_t seed) {
  const World w = make_world(spec);
  const Expected ex = expect_for(w);
  BufferGuard buf = make_buffer();
  const Prepared prepared[2] = {prepare(w, ex, Data::rank_encoded, seed), prepare(w, ex, Data::random, seed)};
  const std::optional<Config> configs[3] = {std::nullopt, Buffer::get_dispatch_config(w.R), small_chunk_config()};
  int index = 0;
  for (bool fp8 : {false, true})
    for (bool with_topk : {false, true})
      for (bool async : {false, true})
        for (bool cached : {false, true})
          for (const Prepared& p : prepared) {
            Case c;
            c.fp8 = fp8;
            c.with_topk = with_topk;
            c.async = async;
            c.cached = cached;
            c.alignment = async ? 128 : 1;
            c.config = configs[index % 3];
            c.bias = static_cast<Bias>(index % 4);
            ++index;
            SCOPED_TRACE(c.str() + ", " + data_name(p.data) + " rows, H=" + std::to_string(w.H));
            run_case(*buf, p, c);
          }
}

std::vector<int64_t> tokens_per_rank(const std::function<int64_t(int)>& f) {
  std::vector<int64_t> t;
  for (int i = 0; i < num_ranks(); ++i) t.push_back(f(i));
  return t;
}

// ------------------------------------------------------------------ tests: buffer and layout

TEST(EpBuffer, RanksConfigAndLifecycle) {
  const int R = num_ranks(), me = my_rank();
  BufferGuard buf = make_buffer();
  EXPECT_EQ(buf->get_rank(), me);
  EXPECT_EQ(buf->get_num_ranks(), R);
  EXPECT_TRUE(buf->is_available());
  if (std::getenv("MOEKIT_EP_RANKS_PER_NODE") == nullptr) {
    // mpirun on one machine: one node.
    EXPECT_EQ(buf->get_num_local_ranks(), R);
    EXPECT_EQ(buf->get_local_rank(), me);
  }
  if (const char* env = std::getenv("MOEKIT_EP_TIMEOUT_S")) {
    EXPECT_EQ(buf->timeout_s(), std::strtod(env, nullptr));
  } else {
    EXPECT_EQ(buf->timeout_s(), 100.0);
  }
  // Combine reads peers' private x through process_vm_readv unless told not to (the suite
  // also runs with MOEKIT_EP_CMA=0: ep_intranode_np4_staged).
  const char* cma = std::getenv("MOEKIT_EP_CMA");
  if (cma != nullptr && std::string(cma) == "0") {
    EXPECT_FALSE(buf->reads_peer_memory());
  }
  if (const char* want = std::getenv("MOEKIT_EP_TEST_EXPECT_CMA")) {
    EXPECT_EQ(buf->reads_peer_memory(), std::string(want) == "1");
  }
  const Tensor local = buf->get_local_buffer_tensor();
  EXPECT_TRUE(local.defined());
  EXPECT_EQ(local.dtype(), DType::u8);
  EXPECT_EQ(local.shape(), (Shape{nvl_bytes_for(kMaxHidden * 2)}));

  for (const Config& c : {Buffer::get_dispatch_config(R), Buffer::get_combine_config(R)}) {
    EXPECT_GT(c.num_sms, 0);
    EXPECT_GT(c.num_max_nvl_chunked_send_tokens, 0);
    EXPECT_GT(c.num_max_nvl_chunked_recv_tokens, 0);
    const int64_t small = c.get_nvl_buffer_size_hint(256 * 2, R), large = c.get_nvl_buffer_size_hint(7168 * 2, R);
    EXPECT_GT(small, 0);
    EXPECT_GE(large, small);
  }

  // MOEKIT_EP_CMA takes 0 or 1 only: anything else is an error on every rank, before any
  // communication (every rank reads the same environment here).
  {
    const ScopedEnv bad("MOEKIT_EP_CMA", "2");
    EXPECT_EP_ERROR(make_buffer());
  }

  // Explicit options win over the environment.
  BufferOptions o;
  o.timeout_s = 7.5;
  BufferGuard second = make_buffer(o);
  EXPECT_EQ(second->timeout_s(), 7.5);
  second->destroy();
  EXPECT_FALSE(second->is_available());

  // Later calls raise Error (on every rank, no communication).
  const World w = make_world(spec(256, 2, 2, tokens_per_rank([](int i) { return 3 + i; }), 1));
  const Expected ex = expect_for(w);
  const RoutingTensors rt = routing_of(w, ex);
  const Payload pl = make_payload(make_x(Data::random, 5, me, w.T(me), w.H), false);
  EXPECT_EP_ERROR(second->dispatch(fresh_args(pl, rt, true, 1, std::nullopt, false)));

  // The first buffer still works after the second one went away.
  const Prepared p = prepare(w, ex, Data::rank_encoded, 5);
  Case c;
  run_case(*buf, p, c);
}

void check_layout(Buffer& buf, const World& w, const Expected& ex) {
  const int me = my_rank();
  const int64_t T = w.T(me);
  const Tensor topk = tensor_of(w.topk[static_cast<size_t>(me)], {T, w.k}, DType::i64);
  DispatchLayout layout;
  try {
    layout = buf.get_dispatch_layout(topk, w.E);
    layout.event.wait();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "get_dispatch_layout threw: " << e.what();
    return;
  }
  ASSERT_TRUE(layout.num_tokens_per_rank.defined());
  EXPECT_EQ(layout.num_tokens_per_rank.dtype(), DType::i32);
  EXPECT_EQ(layout.num_tokens_per_rank.shape(), (Shape{w.R}));
  EXPECT_EQ(vector_of<int32_t>(layout.num_tokens_per_rank), ex.tokens_per_rank) << "num_tokens_per_rank";
  if (buf.get_num_local_ranks() == w.R) {
    EXPECT_FALSE(layout.num_tokens_per_rdma_rank.defined()) << "one node: " << shape_of(layout.num_tokens_per_rdma_rank);
  }
  ASSERT_TRUE(layout.num_tokens_per_expert.defined());
  EXPECT_EQ(layout.num_tokens_per_expert.dtype(), DType::i32);
  EXPECT_EQ(layout.num_tokens_per_expert.shape(), (Shape{w.E}));
  EXPECT_EQ(vector_of<int32_t>(layout.num_tokens_per_expert), ex.tokens_per_expert) << "num_tokens_per_expert";
  ASSERT_TRUE(layout.is_token_in_rank.defined());
  EXPECT_EQ(layout.is_token_in_rank.dtype(), DType::boolean);
  EXPECT_EQ(layout.is_token_in_rank.shape(), (Shape{T, w.R}));
  EXPECT_EQ(vector_of<uint8_t>(layout.is_token_in_rank), ex.is_token_in_rank) << "is_token_in_rank";
}

TEST(EpLayout, MatchesIndependentCount) {
  const int R = num_ranks();
  BufferGuard buf = make_buffer();
  struct Variant {
    const char* name;
    WorldSpec spec;
  };
  const std::vector<Variant> variants = {
      {"8 experts per rank, top-8, T from 0", spec(128, 8, 8, tokens_per_rank([](int i) { return i == 1 ? 0 : 37 + 61 * i; }), 11)},
      {"1 expert per rank", spec(128, 1, std::min(R, 4), tokens_per_rank([](int i) { return 50 + i; }), 12)},
      {"2 experts per rank, top-1", spec(128, 2, 1, tokens_per_rank([](int i) { return 300 - 7 * i; }), 13).drop(0.2, 0.03)},
      {"every entry -1", spec(128, 4, 3, tokens_per_rank([](int) { return 9; }), 14).drop(0.0, 1.0)},
      {"many -1 entries, 32 experts per rank", spec(128, 32, 8, tokens_per_rank([](int i) { return 1 + 100 * i; }), 15).drop(0.5, 0.03)},
  };
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    const World w = make_world(v.spec);
    const Expected ex = expect_for(w);
    check_layout(*buf, w, ex);
  }
}

// ------------------------------------------------------------------ tests: the matrix

TEST(EpIntranode, MatrixHidden7168) {
  // T differs per rank, rank 1 has none; 8 experts per rank, top-8.
  run_matrix(spec(7168, 8, 8, tokens_per_rank([](int i) { return i == 1 ? 0 : 24 + (53 * i) % 73; }), 101),
             101);
}

TEST(EpIntranode, MatrixOddHidden) {
  // H = 256 + 72 (a partial last FP8 group); a few hundred tokens; the last rank's experts are
  // never chosen, so it receives nothing; the first rank sends one token.
  const int R = num_ranks();
  std::vector<int> targets;
  for (int r = 0; r + 1 < R; ++r) targets.push_back(r);
  run_matrix(spec(328, 8, 8, tokens_per_rank([](int i) { return i == 0 ? 1 : 120 + (71 * i) % 151; }), 202).targets(targets),
             202);
}

TEST(EpIntranode, ExpertAlignment) {
  const World w = make_world(spec(512, 4, 4, tokens_per_rank([](int i) { return 40 + 13 * i; }), 303));
  const Expected ex = expect_for(w);
  BufferGuard buf = make_buffer();
  const Prepared p = prepare(w, ex, Data::random, 303);
  for (int alignment : {1, 2, 7, 128}) {
    Case c;
    c.alignment = alignment;
    c.zero_copy = false;
    SCOPED_TRACE("alignment " + std::to_string(alignment));
    run_case(*buf, p, c);
  }
}

TEST(EpIntranode, EdgeWorlds) {
  const int R = num_ranks();
  struct Variant {
    const char* name;
    WorldSpec spec;
  };
  const std::vector<Variant> variants = {
      {"no tokens anywhere", spec(256, 8, 8, tokens_per_rank([](int) { return 0; }), 401)},
      {"every token to rank 0 only", spec(256, 4, 3, tokens_per_rank([](int i) { return 20 + i; }), 402).targets({0})},
      {"one expert per rank, top-1, one token each", spec(256, 1, 1, tokens_per_rank([](int) { return 1; }), 403).drop(0.0, 0.0)},
      {"every token to every rank", spec(384, 1, R, tokens_per_rank([](int i) { return 17 * (i + 1); }), 404).drop(0.0, 0.0)},
      {"tokens that go nowhere", spec(256, 2, 2, tokens_per_rank([](int i) { return 30 + i; }), 405).drop(0.4, 0.3)},
  };
  BufferGuard buf = make_buffer();
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    const World w = make_world(v.spec);
    const Expected ex = expect_for(w);
    check_layout(*buf, w, ex);
    const Prepared p = prepare(w, ex, Data::rank_encoded, v.spec.seed);
    for (bool fp8 : {false, true}) {
      Case c;
      c.fp8 = fp8;
      c.bias = fp8 ? Bias::both : Bias::none;
      SCOPED_TRACE(c.str());
      run_case(*buf, p, c);
    }
  }
}

// Receiver r returns its rows times 2^(r % 4) and its own weights: combine must sum the
// distinct contributions of every receiving rank (not, e.g., one row times the count).
TEST(EpIntranode, CombineSumsEveryReceiver) {
  const int me = my_rank();
  const World w = make_world(spec(1024, 4, 6, tokens_per_rank([](int i) { return 50 + 9 * i; }), 501));
  const Expected ex = expect_for(w);
  BufferGuard buf = make_buffer();
  const Payload pl = make_payload(make_x(Data::random, 501, me, w.T(me), w.H), false);
  const RoutingTensors rt = routing_of(w, ex);
  for (Bias bias : {Bias::none, Bias::b0, Bias::b1, Bias::both}) {
    SCOPED_TRACE(bias_name(bias));
    DispatchResult res;
    if (!collective_step("dispatch", [&] { res = buf->dispatch(fresh_args(pl, rt, true, 1, std::nullopt, false)); })) return;
    const int64_t n = ex.n(), H = w.H;
    if (res.recv_x.shape() != Shape{n, H}) {
      ADD_FAILURE() << "recv_x " << shape_of(res.recv_x);
    }
    const float scale = static_cast<float>(1 << (me % 4));
    Tensor y = Tensor::empty({res.recv_x.size(0), H}, DType::bf16);
    for (int64_t r = 0; r < y.size(0); ++r)
      for (int64_t c = 0; c < H; ++c) y.data_ptr<uint16_t>()[r * H + c] = f32_to_bf16(scale * bf16_at(res.recv_x, r, c));
    // Weights: small integers that identify the receiver, source token and slot.
    Tensor yw = Tensor::empty({res.recv_x.size(0), w.k}, DType::f32);
    for (int64_t r = 0; r < yw.size(0); ++r)
      for (int j = 0; j < w.k; ++j) {
        const int64_t tok = r < n ? ex.src_token[static_cast<size_t>(r)] : 0;
        yw.data_ptr<float>()[r * w.k + j] = static_cast<float>((me + 1) * 1000 + (tok % 7) * 10 + j);
      }
    CombineArgs ca;
    ca.x = y;
    ca.handle = res.handle;
    ca.topk_weights = yw;
    if (bias == Bias::b0 || bias == Bias::both) ca.bias_0 = bias_tensor(w.T(me), H, 511);
    if (bias == Bias::b1 || bias == Bias::both) ca.bias_1 = bias_tensor(w.T(me), H, 512);
    CombineResult comb;
    if (!collective_step("combine", [&] { comb = buf->combine(ca); })) return;
    CombineExpectation ce;
    ce.original = &pl.original;
    ce.seen = &pl.seen;
    ce.bias_0 = ca.bias_0;
    ce.bias_1 = ca.bias_1;
    ce.k = w.k;
    ce.factor.assign(static_cast<size_t>(w.T(me)), 0.0);
    std::vector<float> want_w(static_cast<size_t>(w.T(me) * w.k), 0.0f);
    for (int64_t t = 0; t < w.T(me); ++t)
      for (int r = 0; r < w.R; ++r)
        if (w.sends(me, t, r)) {
          ce.factor[static_cast<size_t>(t)] += static_cast<double>(1 << (r % 4));
          for (int j = 0; j < w.k; ++j) want_w[static_cast<size_t>(t * w.k + j)] += static_cast<float>((r + 1) * 1000 + (t % 7) * 10 + j);
        }
    ce.topk_weights = want_w;
    check_combine(comb, ce);
  }
}

// Combine's hidden size comes from its own x, and may be 0: an empty [T, 0] result and the
// weights still summed, whether rows are staged or read from the peers' memory (a division
// by the row size had crashed the latter).
TEST(EpIntranode, CombineOfZeroHidden) {
  const int me = my_rank();
  const World w = make_world(spec(256, 4, 6, tokens_per_rank([](int i) { return 20 + 3 * i; }), 601));
  const Expected ex = expect_for(w);
  BufferGuard buf = make_buffer();
  const Payload pl = make_payload(make_x(Data::random, 601, me, w.T(me), w.H), false);
  const RoutingTensors rt = routing_of(w, ex);
  DispatchResult res;
  if (!collective_step("dispatch", [&] { res = buf->dispatch(fresh_args(pl, rt, true, 1, std::nullopt, false)); })) return;
  Tensor yw = Tensor::empty({res.recv_x.size(0), w.k}, DType::f32);
  for (int64_t i = 0; i < yw.numel(); ++i) yw.data_ptr<float>()[i] = 1.0f;
  CombineArgs ca;
  ca.x = Tensor::empty({res.recv_x.size(0), 0}, DType::bf16);
  ca.handle = res.handle;
  ca.topk_weights = yw;
  CombineResult comb;
  if (!collective_step("combine", [&] { comb = buf->combine(ca); })) return;
  EXPECT_EQ(comb.combined_x.shape(), (Shape{w.T(me), 0}));
  ASSERT_EQ(comb.combined_topk_weights.shape(), (Shape{w.T(me), w.k}));
  for (int64_t t = 0; t < w.T(me); ++t) {
    int receivers = 0;
    for (int r = 0; r < w.R; ++r) receivers += w.sends(me, t, r) ? 1 : 0;
    for (int j = 0; j < w.k; ++j)
      EXPECT_EQ(comb.combined_topk_weights.data_ptr<float>()[t * w.k + j], static_cast<float>(receivers)) << "token " << t;
  }
}

// The normal combine's way of moving a private x (Buffer::combine_private_x): the same on
// every rank after every call, decided after the probing calls where reads are possible, and
// never a change in the bits. Combines whose x lives in the buffer everywhere do not count.
// The private x cycles through three contents (x, 2x, 4x: exact in bf16), so that rows left
// in the staging area by an earlier call cannot pass for this call's.
// `force`: MOEKIT_EP_CMA for this buffer on every rank ("1"), on rank 0 only ("1@0": every
// rank must then probe), or as the environment has it (""). `verdict`: costs injected so
// that rank 0 alone would choose the other way than the node's sum ("read" or "staged"
// expected), or none ("": timed).
void check_private_x_choice(const std::string& force, int private_calls, const std::string& verdict = "") {
  const int me = my_rank();
  // Rank 0 finds reading 1000x cheaper (or dearer) than staging, every other rank the
  // opposite by 100x: the sum over ranks decides against rank 0's own view.
  const bool read_wins = verdict == "read";
  if (!verdict.empty())
    moekit::ep::detail::set_combine_costs_for_testing(me == 0 ? (read_wins ? 1.0 : 1000.0) : (read_wins ? 100.0 : 1.0),
                                                      me == 0 ? (read_wins ? 1000.0 : 1.0) : (read_wins ? 1.0 : 100.0));
  struct Restore {
    ~Restore() { moekit::ep::detail::set_combine_costs_for_testing(0, 0); }
  } restore;
  const World w = make_world(spec(1024, 4, 6, tokens_per_rank([](int i) { return 60 + 7 * i; }), 611));
  const Expected ex = expect_for(w);
  const char* env = std::getenv("MOEKIT_EP_CMA");
  const bool forced = force == "1" || (force.empty() && env != nullptr && std::string(env) == "1");
  BufferGuard buf = [&] {
    if (force.empty()) return make_buffer();
    const ScopedEnv set("MOEKIT_EP_CMA", force == "1" || me == 0 ? "1" : nullptr);
    return make_buffer();
  }();
  const Payload pl = make_payload(make_x(Data::random, 611, me, w.T(me), w.H), false);
  const RoutingTensors rt = routing_of(w, ex);
  DispatchResult res;
  if (!collective_step("dispatch", [&] { res = buf->dispatch(fresh_args(pl, rt, true, 1, std::nullopt, false)); })) return;
  auto path_code = [&] {
    const std::string p = buf->combine_private_x();
    return p == "probing" ? 0 : p == "read" ? 1 : p == "staged" ? 2 : 3;
  };
  auto expect_same_everywhere = [&](const std::string& when) {
    int code[2] = {path_code(), -path_code()};
    MPI_Allreduce(MPI_IN_PLACE, code, 2, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    EXPECT_EQ(code[0], -code[1]) << "combine_private_x differs between ranks " << when;
    EXPECT_NE(path_code(), 3) << buf->combine_private_x();
  };
  // (one node: across nodes the normal combine moves rows through MPI, never reading x)
  const bool reads = buf->reads_peer_memory() && buf->get_num_local_ranks() == buf->get_num_ranks();
  auto expect_start = [&] {
    if (!reads) EXPECT_STREQ(buf->combine_private_x(), "staged");
    else EXPECT_STREQ(buf->combine_private_x(), forced ? "read" : "probing");
  };
  expect_start();
  Tensor yw = Tensor::empty({res.recv_x.size(0), w.k}, DType::f32);
  for (int64_t i = 0; i < yw.numel(); ++i) yw.data_ptr<float>()[i] = 0.5f;
  // Each x in the buffer on every rank: read in place, not counted; then a private copy.
  std::vector<uint64_t> want;
  std::vector<Tensor> private_x;
  for (const float factor : {1.0f, 2.0f, 4.0f}) {
    Tensor shared = buf->alloc_shared(res.recv_x.shape(), DType::bf16);
    for (int64_t r = 0; r < shared.size(0); ++r)
      for (int64_t c = 0; c < w.H; ++c) shared.data_ptr<uint16_t>()[r * w.H + c] = f32_to_bf16(factor * bf16_at(res.recv_x, r, c));
    CombineArgs in_place;
    in_place.x = shared;
    in_place.handle = res.handle;
    in_place.topk_weights = yw;
    CombineResult comb;
    if (!collective_step("combine in place", [&] { comb = buf->combine(in_place); })) return;
    want.push_back(fnv1a(fnv1a(0, comb.combined_x), comb.combined_topk_weights));
    private_x.push_back(Tensor::empty(shared.shape(), DType::bf16));
    private_x.back().copy_from(shared);
  }
  expect_start();
  for (int call = 0; call < private_calls; ++call) {
    SCOPED_TRACE("private call " + std::to_string(call));
    CombineArgs priv;
    priv.x = private_x[static_cast<size_t>(call % 3)];
    priv.handle = res.handle;
    priv.topk_weights = yw;
    CombineResult comb;
    if (!collective_step("combine", [&] { comb = buf->combine(priv); })) return;
    EXPECT_EQ(fnv1a(fnv1a(0, comb.combined_x), comb.combined_topk_weights), want[static_cast<size_t>(call % 3)]);
    expect_same_everywhere("after private call " + std::to_string(call));
    if (!reads) EXPECT_STREQ(buf->combine_private_x(), "staged");
    else if (forced) EXPECT_STREQ(buf->combine_private_x(), "read");
    else if (call < 6) EXPECT_STREQ(buf->combine_private_x(), "probing");  // (calls 0-5 probe; call 6 decides)
    else if (!verdict.empty()) EXPECT_EQ(buf->combine_private_x(), verdict);
    else EXPECT_STRNE(buf->combine_private_x(), "probing");
  }
}

TEST(EpIntranode, CombinePrivateXChoiceIsTheSameEverywhereAndKeepsTheBits) {
  {
    SCOPED_TRACE("MOEKIT_EP_CMA as set");
    check_private_x_choice("", 9);
  }
  {
    SCOPED_TRACE("MOEKIT_EP_CMA=1 on every rank");
    check_private_x_choice("1", 3);
  }
  {
    SCOPED_TRACE("MOEKIT_EP_CMA=1 on rank 0 only");
    check_private_x_choice("1@0", 3);
  }
  if (num_ranks() > 1) {
    for (const char* verdict : {"read", "staged"}) {
      SCOPED_TRACE(std::string("injected costs for ") + verdict);
      check_private_x_choice("", 9, verdict);
    }
  }
}

// ------------------------------------------------------------------ tests: worst case, cross-check, determinism

TEST(EpIntranode, NumWorstTokens) {
  const World w = make_world(spec(640, 8, 8, tokens_per_rank([](int i) { return i == 0 ? 0 : 30 + 11 * i; }), 601));
  const Expected ex = expect_for(w);
  BufferGuard buf = make_buffer();
  const RoutingTensors rt = routing_of(w, ex);
  const Prepared p = prepare(w, ex, Data::rank_encoded, 601);
  // Enough for any routing: every token of every rank.
  const int64_t worst = std::max<int64_t>(ex.gbl_total_tokens, 1);
  for (bool fp8 : {false, true}) {
    SCOPED_TRACE(fp8 ? "fp8" : "bf16");
    const Payload& pl = p.payload[fp8 ? 1 : 0];
    DispatchResult res;
    if (!collective_step("dispatch (num_worst_tokens)", [&] {
          DispatchArgs a = fresh_args(pl, rt, true, 1, std::nullopt, false);
          a.num_worst_tokens = worst;
          res = buf->dispatch(a);
        }))
      return;
    DispatchExpectation de;
    de.world = &w;
    de.ex = &ex;
    de.data = p.data;
    de.fp8 = fp8;
    de.with_topk = true;
    de.num_worst = worst;
    de.rows = p.rows;
    de.q = p.q;
    check_dispatch(res, res.handle, de);
    // Combine straight from the worst-case sized output (no host sync in between).
    CombineArgs ca;
    ca.x = to_bf16_values(res.recv_x, res.recv_x_scales);
    ca.handle = res.handle;
    ca.topk_weights = res.recv_topk_weights;
    CombineResult comb;
    if (!collective_step("combine (worst-case sized x)", [&] { comb = buf->combine(ca); })) return;
    CombineExpectation ce;
    ce.original = &pl.original;
    ce.seen = &pl.seen;
    ce.factor = coverage_factor(ex);
    ce.fp8 = fp8;
    ce.k = w.k;
    ce.topk_weights = summed_dispatch_weights(w);
    check_combine(comb, ce);
  }
}

// The same exchange as a plain MPI_Alltoallv: rows packed per destination in token order.
struct AlltoallvResult {
  std::vector<char> x, scales;
  std::vector<int32_t> src_idx;
  std::vector<int64_t> topk;
  std::vector<float> weights;
  int64_t rows = 0;
};

template <class T>
std::vector<T> alltoallv_rows(const std::vector<std::vector<T>>& per_dest, int64_t row_elems, int64_t* rows_out) {
  const int R = num_ranks();
  std::vector<int> send_counts(static_cast<size_t>(R)), recv_counts(static_cast<size_t>(R)), sdispl(static_cast<size_t>(R)),
      rdispl(static_cast<size_t>(R));
  std::vector<T> send;
  for (int r = 0; r < R; ++r) {
    sdispl[static_cast<size_t>(r)] = static_cast<int>(send.size() * sizeof(T));
    send_counts[static_cast<size_t>(r)] = static_cast<int>(per_dest[static_cast<size_t>(r)].size() * sizeof(T));
    send.insert(send.end(), per_dest[static_cast<size_t>(r)].begin(), per_dest[static_cast<size_t>(r)].end());
  }
  MPI_Alltoall(send_counts.data(), 1, MPI_INT, recv_counts.data(), 1, MPI_INT, MPI_COMM_WORLD);
  int total = 0;
  for (int r = 0; r < R; ++r) {
    rdispl[static_cast<size_t>(r)] = total;
    total += recv_counts[static_cast<size_t>(r)];
  }
  std::vector<T> recv(static_cast<size_t>(total) / sizeof(T));
  MPI_Alltoallv(send.data(), send_counts.data(), sdispl.data(), MPI_BYTE, recv.data(), recv_counts.data(), rdispl.data(), MPI_BYTE,
                MPI_COMM_WORLD);
  if (rows_out) *rows_out = row_elems > 0 ? static_cast<int64_t>(recv.size()) / row_elems : 0;
  return recv;
}

AlltoallvResult alltoallv_dispatch(const World& w, const Payload& pl, bool fp8) {
  const int me = my_rank(), R = w.R, k = w.k;
  const int64_t T = w.T(me), H = w.H, groups = (H + 127) / 128;
  const int64_t row_bytes_x = H * static_cast<int64_t>(pl.x.element_size());
  std::vector<std::vector<char>> xs(static_cast<size_t>(R)), ss(static_cast<size_t>(R));
  std::vector<std::vector<int32_t>> ids(static_cast<size_t>(R));
  std::vector<std::vector<int64_t>> tk(static_cast<size_t>(R));
  std::vector<std::vector<float>> wt(static_cast<size_t>(R));
  const std::vector<uint8_t>& inr = w.in_rank[static_cast<size_t>(me)];
  for (int64_t t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) {
      if (!inr[static_cast<size_t>(t * R + r)]) continue;
      auto& dx = xs[static_cast<size_t>(r)];
      dx.insert(dx.end(), row_bytes(pl.x, t), row_bytes(pl.x, t) + row_bytes_x);
      if (fp8) {
        auto& ds = ss[static_cast<size_t>(r)];
        ds.insert(ds.end(), row_bytes(pl.scales, t), row_bytes(pl.scales, t) + groups * 4);
      }
      ids[static_cast<size_t>(r)].push_back(static_cast<int32_t>(t));
      for (int j = 0; j < k; ++j) {
        tk[static_cast<size_t>(r)].push_back(w.topk[static_cast<size_t>(me)][static_cast<size_t>(t * k + j)]);
        wt[static_cast<size_t>(r)].push_back(w.weights[static_cast<size_t>(me)][static_cast<size_t>(t * k + j)]);
      }
    }
  AlltoallvResult out;
  out.x = alltoallv_rows(xs, row_bytes_x, &out.rows);
  out.scales = alltoallv_rows(ss, groups * 4, nullptr);
  out.src_idx = alltoallv_rows(ids, 1, nullptr);
  out.topk = alltoallv_rows(tk, k, nullptr);
  out.weights = alltoallv_rows(wt, k, nullptr);
  // The receiver's rewrite to local expert ids.
  for (size_t i = 0; i < out.topk.size(); ++i) {
    const int64_t e = out.topk[i];
    const bool local = e >= 0 && e / w.El == me;
    out.topk[i] = local ? e - static_cast<int64_t>(me) * w.El : -1;
    if (!local) out.weights[i] = 0.0f;
  }
  return out;
}

TEST(EpIntranode, MatchesMpiAlltoallv) {
  const int me = my_rank();
  const World w = make_world(spec(7168, 8, 8, tokens_per_rank([](int i) { return 20 + (37 * i) % 61; }), 701));
  const Expected ex = expect_for(w);
  BufferGuard buf = make_buffer();
  const RoutingTensors rt = routing_of(w, ex);
  const Tensor x = make_x(Data::random, 701, me, w.T(me), w.H);
  for (bool fp8 : {false, true}) {
    SCOPED_TRACE(fp8 ? "fp8" : "bf16");
    const Payload pl = make_payload(x, fp8);
    DispatchResult res;
    if (!collective_step("dispatch", [&] { res = buf->dispatch(fresh_args(pl, rt, true, 1, std::nullopt, false)); })) return;
    const AlltoallvResult ref = alltoallv_dispatch(w, pl, fp8);
    const int64_t rows = ref.rows;
    ASSERT_EQ(res.recv_x.shape(), (Shape{rows, w.H}));
    {
      const Tensor want = Tensor::from_blob(ref.x.data(), {rows, w.H}, pl.x.dtype());
      int64_t bad = 0;
      for (int64_t r = 0; r < rows; ++r)
        bad += std::memcmp(row_bytes(res.recv_x, r), row_bytes(want, r), static_cast<size_t>(w.H) * want.element_size()) != 0;
      EXPECT_EQ(bad, 0) << "rows differing from the MPI_Alltoallv exchange";
    }
    if (fp8) {
      ASSERT_EQ(res.recv_x_scales.shape(), (Shape{rows, (w.H + 127) / 128}));
      EXPECT_EQ(std::memcmp(res.recv_x_scales.contiguous().data(), ref.scales.data(), ref.scales.size()), 0)
          << "scales differ from the MPI_Alltoallv exchange";
    }
    EXPECT_EQ(vector_of<int32_t>(res.handle.recv_src_idx), ref.src_idx);
    EXPECT_EQ(vector_of<int64_t>(res.recv_topk_idx), ref.topk);
    EXPECT_EQ(vector_of<float>(res.recv_topk_weights), ref.weights);
  }
}

// ep.md "a pressure mode reruns 20 times and compares hashes". Each rank returns its rows times
// a non-power-of-two factor, so the f32 sum is inexact and its order shows in the result.
TEST(EpIntranode, DeterministicOver20Runs) {
  const int me = my_rank();
  const World w = make_world(spec(2048, 8, 8, tokens_per_rank([](int i) { return 40 + (29 * i) % 47; }), 801));
  const Expected ex = expect_for(w);
  BufferGuard buf = make_buffer();
  const RoutingTensors rt = routing_of(w, ex);
  const Tensor x = make_x(Data::random, 801, me, w.T(me), w.H);
  for (bool fp8 : {false, true}) {
    SCOPED_TRACE(fp8 ? "fp8" : "bf16");
    const Payload pl = make_payload(x, fp8);
    const Tensor b0 = bias_tensor(w.T(me), w.H, 802);
    std::vector<uint64_t> hashes;
    for (int run = 0; run < 20; ++run) {
      DispatchResult res;
      CombineResult comb;
      const bool ok = collective_step("dispatch + combine, run " + std::to_string(run), [&] {
        res = buf->dispatch(fresh_args(pl, rt, true, 1, std::nullopt, run % 2 == 1));
        res.event.wait();
        const Tensor seen = to_bf16_values(res.recv_x, res.recv_x_scales);
        Tensor y = Tensor::empty(seen.shape(), DType::bf16);
        const float factor = 1.0f + 0.3713f * static_cast<float>(me + 1);
        for (int64_t r = 0; r < y.size(0); ++r)
          for (int64_t c = 0; c < w.H; ++c) y.data_ptr<uint16_t>()[r * w.H + c] = f32_to_bf16(factor * bf16_at(seen, r, c));
        CombineArgs ca;
        ca.x = y;
        ca.handle = res.handle;
        ca.topk_weights = res.recv_topk_weights;
        ca.bias_0 = b0;
        ca.async_finish = run % 2 == 1;
        comb = buf->combine(ca);
        comb.event.wait();
      });
      if (!ok) return;
      uint64_t h = 0xcbf29ce484222325ULL;
      for (const Tensor* t : {&res.recv_x, &res.recv_x_scales, &res.recv_topk_idx, &res.recv_topk_weights, &res.handle.recv_src_idx,
                              &comb.combined_x, &comb.combined_topk_weights})
        h = fnv1a(h, *t);
      h = fnv1a(h, res.num_recv_tokens_per_expert_list.data(), res.num_recv_tokens_per_expert_list.size() * sizeof(int));
      hashes.push_back(h);
    }
    int64_t differing = 0;
    for (uint64_t h : hashes) differing += h != hashes.front();
    EXPECT_EQ(differing, 0) << "runs whose output hash differs from the first run's";
  }
}

// ep.h: received tensors live in the Buffer's shared memory "and stay valid for as long as the
// caller holds them": later dispatches and combines, and destroying the Buffer, must not
// change results still held.
TEST(EpIntranode, HeldResultsStayValid) {
  const int me = my_rank();
  const World w = make_world(spec(1536, 4, 4, tokens_per_rank([](int i) { return 30 + 17 * i; }), 1201));
  const Expected ex = expect_for(w);
  BufferGuard buf = make_buffer();
  const RoutingTensors rt = routing_of(w, ex);
  const Prepared p = prepare(w, ex, Data::rank_encoded, 1201);
  const Payload& pl = p.payload[0];
  DispatchResult held;
  CombineResult held_comb;
  if (!collective_step("first dispatch + combine", [&] {
        held = buf->dispatch(fresh_args(pl, rt, true, 1, std::nullopt, false));
        CombineArgs ca;
        ca.x = held.recv_x;
        ca.handle = held.handle;
        ca.topk_weights = held.recv_topk_weights;
        held_comb = buf->combine(ca);
      }))
    return;
  auto fingerprint = [&] {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (const Tensor* t : {&held.recv_x, &held.recv_topk_idx, &held.recv_topk_weights, &held.handle.recv_src_idx,
                            &held.handle.rank_prefix_matrix, &held_comb.combined_x, &held_comb.combined_topk_weights})
      h = fnv1a(h, *t);
    return h;
  };
  const uint64_t before = fingerprint();

  // Other traffic on the same buffer: other activations, FP8, a cached dispatch, combines.
  const Tensor other = make_x(Data::random, 1202, me, w.T(me), w.H);
  for (int round = 0; round < 3; ++round) {
    const Payload op = make_payload(other, round == 1);
    if (!collective_step("later dispatch + combine, round " + std::to_string(round), [&] {
          DispatchArgs a = fresh_args(op, rt, true, 1, std::nullopt, round == 2);
          if (round == 2) {
            a = DispatchArgs{};
            a.x = op.x;
            a.handle = held.handle;
          }
          DispatchResult r = buf->dispatch(a);
          r.event.wait();
          CombineArgs ca;
          ca.x = to_bf16_values(r.recv_x, r.recv_x_scales);
          ca.handle = held.handle;
          CombineResult c = buf->combine(ca);
          c.event.wait();
        }))
      return;
  }
  EXPECT_EQ(fingerprint(), before) << "results held from the first dispatch/combine changed after later operations";
  {
    SCOPED_TRACE("held dispatch result after later operations");
    DispatchExpectation de;
    de.world = &w;
    de.ex = &ex;
    de.data = p.data;
    de.with_topk = true;
    de.rows = p.rows;
    de.q = p.q;
    check_dispatch(held, held.handle, de);
  }
  {
    SCOPED_TRACE("held combine result after later operations");
    CombineExpectation ce;
    ce.original = &pl.original;
    ce.seen = &pl.seen;
    ce.factor = coverage_factor(ex);
    ce.k = w.k;
    ce.topk_weights = summed_dispatch_weights(w);
    check_combine(held_comb, ce);
  }
  EXPECT_NO_THROW(buf->destroy());
  EXPECT_EQ(fingerprint(), before) << "results held across Buffer::destroy() changed";
}

// ------------------------------------------------------------------ tests: bad input

// Collective (the Buffer constructions). The size hint and the Buffer's options refuse values
// that would give a negative or wrapped size, or a wait without end.
TEST(EpErrors, SizeHintAndOptionsRefuseBadValues) {
  Config c;
  EXPECT_TRUE(expect_ep_error_on([&] { (void)c.get_nvl_buffer_size_hint(-1, 2); }, "hidden_bytes"));
  EXPECT_TRUE(expect_ep_error_on([&] { (void)c.get_nvl_buffer_size_hint(7168, -2); }, "num_ranks"));
  EXPECT_TRUE(expect_ep_error_on([&] { (void)c.get_nvl_buffer_size_hint(7168, 0); }, "num_ranks"));
  Config negative = c;
  negative.num_max_nvl_chunked_recv_tokens = -5;
  EXPECT_TRUE(expect_ep_error_on([&] { (void)negative.get_nvl_buffer_size_hint(7168, 2); }, "num_max_nvl_chunked_recv_tokens"));
  Config huge = c;
  huge.num_max_nvl_chunked_recv_tokens = std::numeric_limits<int>::max();
  EXPECT_TRUE(expect_ep_error_on([&] { (void)huge.get_nvl_buffer_size_hint(int64_t{1} << 40, 1 << 20); }, "num_max_nvl_chunked_recv_tokens"));
  EXPECT_GT(c.get_nvl_buffer_size_hint(7168 * 2, 8), 8 * 256 * 7168 * 2);
  // Options: every rank passes the same bad value, and each raises its own Error.
  for (const double bad : {std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
    BufferOptions o;
    o.timeout_s = bad;
    EXPECT_TRUE(all_ranks(expect_ep_error_on([&] { Buffer b(MPI_COMM_WORLD, 1 << 20, 0, o); }, "options.timeout_s")));
  }
  BufferOptions o;
  o.ranks_per_node = -3;
  EXPECT_TRUE(all_ranks(expect_ep_error_on([&] { Buffer b(MPI_COMM_WORLD, 1 << 20, 0, o); }, "options.ranks_per_node")));
  {  // the default timeout from the environment: finite too
    ScopedEnv inf("MOEKIT_EP_TIMEOUT_S", "inf");
    EXPECT_TRUE(all_ranks(expect_ep_error_on([&] { Buffer b(MPI_COMM_WORLD, 1 << 20, 0); }, "MOEKIT_EP_TIMEOUT_S")));
  }
}

TEST(EpErrors, BadInputRaisesOnEveryRankThenBufferStillWorks) {
  const int me = my_rank(), R = num_ranks();
  const World w = make_world(spec(256, 4, 4, tokens_per_rank([](int i) { return 10 + 3 * i; }), 901));
  const Expected ex = expect_for(w);
  BufferGuard buf = make_buffer();
  const int64_t T = w.T(me), H = w.H;
  const RoutingTensors rt = routing_of(w, ex);

  // get_dispatch_layout: expert ids out of range, bad num_experts, wrong dtype.
  {
    std::vector<int64_t> bad = w.topk[static_cast<size_t>(me)];
    bad[static_cast<size_t>(T * w.k / 2)] = w.E;  // == num_experts
    EXPECT_EP_ERROR(buf->get_dispatch_layout(tensor_of(bad, {T, w.k}, DType::i64), w.E));
    bad[static_cast<size_t>(T * w.k / 2)] = -2;
    EXPECT_EP_ERROR(buf->get_dispatch_layout(tensor_of(bad, {T, w.k}, DType::i64), w.E));
    EXPECT_EP_ERROR(buf->get_dispatch_layout(rt.topk_idx, w.E + 1));  // not a multiple of R
    EXPECT_EP_ERROR(buf->get_dispatch_layout(rt.topk_idx, 0));
    std::vector<int32_t> narrow(w.topk[static_cast<size_t>(me)].begin(), w.topk[static_cast<size_t>(me)].end());
    EXPECT_EP_ERROR(buf->get_dispatch_layout(tensor_of(narrow, {T, w.k}, DType::i32), w.E));
    EXPECT_EP_ERROR(buf->get_dispatch_layout(rt.topk_idx.reshape({T * w.k}), w.E));  // 1-D
  }

  const Tensor x = make_x(Data::random, 901, me, T, H);
  const Payload pl = make_payload(x, false), pl8 = make_payload(x, true);
  auto good = [&](const Payload& p) { return fresh_args(p, rt, true, 1, std::nullopt, false); };
  {
    SCOPED_TRACE("dispatch: x dtype f32");
    DispatchArgs a = good(pl);
    a.x = Tensor::zeros({T, H}, DType::f32);
    EXPECT_EP_ERROR(buf->dispatch(a));
  }
  {
    SCOPED_TRACE("dispatch: x rows != topk_idx rows");
    DispatchArgs a = good(pl);
    a.x = make_x(Data::random, 902, me, T + 1, H);
    EXPECT_EP_ERROR(buf->dispatch(a));
  }
  {
    SCOPED_TRACE("dispatch: topk_idx rows != is_token_in_rank rows");
    DispatchArgs a = good(pl);
    std::vector<int64_t> idx = w.topk[static_cast<size_t>(me)];
    idx.resize(static_cast<size_t>((T + 1) * w.k), -1);
    a.topk_idx = tensor_of(idx, {T + 1, w.k}, DType::i64);
    EXPECT_EP_ERROR(buf->dispatch(a));
  }
  {
    SCOPED_TRACE("dispatch: topk_weights shape != topk_idx shape");
    DispatchArgs a = good(pl);
    a.topk_weights = Tensor::zeros({T, w.k + 1}, DType::f32);
    EXPECT_EP_ERROR(buf->dispatch(a));
  }
  {
    SCOPED_TRACE("dispatch: num_tokens_per_rank of R + 1 entries");
    DispatchArgs a = good(pl);
    a.num_tokens_per_rank = Tensor::zeros({R + 1}, DType::i32);
    EXPECT_EP_ERROR(buf->dispatch(a));
  }
  {
    SCOPED_TRACE("dispatch: expert id >= num_experts in topk_idx");
    DispatchArgs a = good(pl);
    std::vector<int64_t> idx = w.topk[static_cast<size_t>(me)];
    if (!idx.empty()) idx[0] = w.E;
    a.topk_idx = tensor_of(idx, {T, w.k}, DType::i64);
    if (T > 0) EXPECT_EP_ERROR(buf->dispatch(a));
  }
  {
    SCOPED_TRACE("dispatch: e4m3 x without scales");
    DispatchArgs a = good(pl8);
    a.x_scales = Tensor();
    EXPECT_EP_ERROR(buf->dispatch(a));
  }
  {
    SCOPED_TRACE("dispatch: num_worst_tokens of 2^40 (rows are indexed by i32)");
    DispatchArgs a = good(pl);
    a.num_worst_tokens = int64_t{1} << 40;
    EXPECT_TRUE(expect_ep_error_on([&] { (void)buf->dispatch(a); }, "num_worst_tokens"));
  }
  {
    SCOPED_TRACE("dispatch: a negative count in num_tokens_per_expert");
    DispatchArgs a = good(pl);
    a.num_tokens_per_expert = Tensor::zeros({w.E}, DType::i32);
    a.num_tokens_per_expert.copy_from(rt.num_tokens_per_expert);
    a.num_tokens_per_expert.data_ptr<int32_t>()[0] = -1000;
    EXPECT_TRUE(expect_ep_error_on([&] { (void)buf->dispatch(a); }, "num_tokens_per_expert[0]"));
  }
  {
    SCOPED_TRACE("dispatch: e4m3 x with scales of the wrong shape");
    DispatchArgs a = good(pl8);
    a.x_scales = Tensor::zeros({T, (H + 127) / 128 + 1}, DType::f32);
    EXPECT_EP_ERROR(buf->dispatch(a));
  }
  {
    SCOPED_TRACE("dispatch: bf16 x with scales");
    DispatchArgs a = good(pl);
    a.x_scales = pl8.scales;
    EXPECT_EP_ERROR(buf->dispatch(a));
  }

  // A good dispatch: the buffer still works, and gives a handle for the checks below.
  DispatchResult res;
  if (!collective_step("dispatch after bad input", [&] { res = buf->dispatch(good(pl)); })) return;
  {
    SCOPED_TRACE("cached dispatch with topk_idx");
    DispatchArgs a;
    a.x = pl.x;
    a.handle = res.handle;
    a.topk_idx = rt.topk_idx;
    a.topk_weights = rt.topk_weights;
    EXPECT_EP_ERROR(buf->dispatch(a));
  }
  {
    SCOPED_TRACE("cached dispatch with x of another token count");
    DispatchArgs a;
    a.x = make_x(Data::random, 903, me, T + 2, H);
    a.handle = res.handle;
    EXPECT_EP_ERROR(buf->dispatch(a));
  }
  const int64_t n = res.recv_x.size(0);
  auto good_combine = [&] {
    CombineArgs ca;
    ca.x = res.recv_x;
    ca.handle = res.handle;
    ca.topk_weights = res.recv_topk_weights;
    return ca;
  };
  {
    SCOPED_TRACE("combine: x rows != received rows");
    CombineArgs ca = good_combine();
    ca.x = Tensor::zeros({n + 1, H}, DType::bf16);
    ca.topk_weights = Tensor();
    EXPECT_EP_ERROR(buf->combine(ca));
  }
  {
    SCOPED_TRACE("combine: bias_1 of dtype f32");
    CombineArgs ca = good_combine();
    ca.bias_1 = Tensor::zeros({T, H}, DType::f32);
    EXPECT_EP_ERROR(buf->combine(ca));
  }
  {
    SCOPED_TRACE("combine: x dtype f32");
    CombineArgs ca = good_combine();
    ca.x = Tensor::zeros({n, H}, DType::f32);
    EXPECT_EP_ERROR(buf->combine(ca));
  }
  {
    SCOPED_TRACE("combine: bias of the wrong shape");
    CombineArgs ca = good_combine();
    ca.bias_0 = Tensor::zeros({T + 1, H}, DType::bf16);
    EXPECT_EP_ERROR(buf->combine(ca));
  }
  {
    // (Its column count is the combine's own top-k, as upstream: not checked against dispatch.)
    SCOPED_TRACE("combine: topk_weights rows != received rows");
    CombineArgs ca = good_combine();
    ca.topk_weights = Tensor::zeros({n + 1, w.k}, DType::f32);
    EXPECT_EP_ERROR(buf->combine(ca));
  }
  {
    SCOPED_TRACE("combine: no handle");
    CombineArgs ca = good_combine();
    ca.handle = DispatchHandle{};
    EXPECT_EP_ERROR(buf->combine(ca));
  }

  // After all that, a whole case still passes on the same buffer.
  const Prepared p = prepare(w, ex, Data::rank_encoded, 904);
  Case c;
  c.bias = Bias::both;
  SCOPED_TRACE("good case after the bad input");
  run_case(*buf, p, c);
}

// ------------------------------------------------------------------ tests: faults (last)

// Only rank 0 has bad input; it raises at once and the others must not hang: they raise
// (TimeoutError naming rank 0 after the buffer's 2 s, or a propagated error).
TEST(EpFaults, BadInputOnOneRankDoesNotHangTheOthers) {
  const int me = my_rank();
  if (num_ranks() < 2) GTEST_SKIP() << "needs two ranks";
  const World w = make_world(spec(256, 2, 2, tokens_per_rank([](int i) { return 8 + i; }), 1001));
  const Expected ex = expect_for(w);
  BufferOptions o;
  o.timeout_s = 2;
  BufferGuard buf = make_buffer(o);
  const RoutingTensors rt = routing_of(w, ex);
  const Payload pl = make_payload(make_x(Data::random, 1001, me, w.T(me), w.H), false);
  DispatchArgs a = fresh_args(pl, rt, true, 1, std::nullopt, false);
  if (me == 0) a.x = Tensor::zeros({w.T(me), w.H}, DType::f32);
  const auto start = std::chrono::steady_clock::now();
  try {
    (void)buf->dispatch(a);
    ADD_FAILURE() << "dispatch returned although rank 0 never took part";
  } catch (const TimeoutError& e) {
    EXPECT_NE(me, 0) << "rank 0's bad x must be an argument Error, not a TimeoutError: " << e.what();
    const std::vector<int>& silent = e.silent_ranks();
    EXPECT_NE(std::find(silent.begin(), silent.end(), 0), silent.end()) << e.what();
  } catch (const moekit::Error&) {
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
  }
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(waited, 30.0) << "the Buffer's timeout is 2 s";
  if (me == 0) {
    EXPECT_LT(waited, 1.5) << "an argument check must not wait for the other ranks";
  }
  MPI_Barrier(MPI_COMM_WORLD);
  EXPECT_NO_THROW(buf->destroy());
  EXPECT_FALSE(buf->is_available());
}

// Collective: rank 0 combines `b` (another dispatch's result), the other ranks `a`. Every rank
// must raise at once on the handle (within 5 s, not by timeout), and then a combine of `a` on
// every rank must work.
void expect_mixed_handles_raise(Buffer& buf, const DispatchResult& a, const DispatchResult& b) {
  const DispatchResult& mine = my_rank() == 0 ? b : a;
  CombineArgs mixed;
  mixed.x = mine.recv_x;
  mixed.handle = mine.handle;
  const auto start = std::chrono::steady_clock::now();
  try {
    (void)buf.combine(mixed);
    ADD_FAILURE() << "combine returned with rank 0 on another dispatch's handle";
  } catch (const TimeoutError& e) {
    ADD_FAILURE() << "a TimeoutError, not the handle check: " << e.what();
  } catch (const moekit::Error& e) {
    EXPECT_NE(std::string(e.what()).find("handle"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 5.0);
  CombineArgs good;
  good.x = a.recv_x;
  good.handle = a.handle;
  EXPECT_TRUE(collective_step("combine the same dispatch on every rank", [&] { (void)buf.combine(good); }));
}

// Rank 0 combines with the handle of another dispatch than its peers (review finding,
// 2026-12-03): the expert ranks would write rows at offsets of a layout the owners did not
// make, into live shared memory. Every rank must raise at once, and the buffer stay usable.
TEST(EpFaults, CombineWithAnotherDispatchsHandleRaisesEverywhere) {
  const int me = my_rank();
  if (num_ranks() < 2) GTEST_SKIP() << "needs two ranks";
  const World wa = make_world(spec(256, 2, 2, tokens_per_rank([](int i) { return 8 + i; }), 1101));
  const World wb = make_world(spec(256, 2, 2, tokens_per_rank([](int i) { return 13 + 2 * i; }), 1102));
  BufferOptions o;
  o.timeout_s = 10;
  BufferGuard buf = make_buffer(o);
  const RoutingTensors ra = routing_of(wa, expect_for(wa)), rb = routing_of(wb, expect_for(wb));
  const Payload pa = make_payload(make_x(Data::random, 1101, me, wa.T(me), wa.H), false);
  const Payload pb = make_payload(make_x(Data::random, 1102, me, wb.T(me), wb.H), false);
  DispatchResult da, db;
  if (!collective_step("dispatch A, then B", [&] {
        da = buf->dispatch(fresh_args(pa, ra, true, 1, std::nullopt, false));
        db = buf->dispatch(fresh_args(pb, rb, true, 1, std::nullopt, false));
      }))
    return;
  expect_mixed_handles_raise(*buf, da, db);
}

// As above, with two dispatches that send as many tokens between every pair of ranks but
// different ones (A: each rank's token 0 to the next rank, B: its token 1). Until the handle
// check covered the dispatch itself, not only its counts, the combine returned without an
// error and summed the wrong tokens; across nodes MPI aborted the job (truncated message).
TEST(EpFaults, CombineWithAnotherDispatchOfTheSameCountsRaisesEverywhere) {
  const int me = my_rank(), R = num_ranks();
  if (R < 2) GTEST_SKIP() << "needs two ranks";
  const int64_t T = 2, H = 128, E = 2 * R;
  BufferOptions o;
  o.timeout_s = 10;
  BufferGuard buf = make_buffer(o);
  const Tensor x = random_bf16({T, H}, hash4(0x5a3e, static_cast<uint64_t>(me), 0, 0));
  auto dispatch_token = [&](int64_t token) {  // that token to the next rank's first expert, the other nowhere
    Tensor idx = Tensor::empty({T, 1}, DType::i64);
    for (int64_t t = 0; t < T; ++t) idx.data_ptr<int64_t>()[t] = t == token ? 2 * ((me + 1) % R) : -1;
    const DispatchLayout layout = buf->get_dispatch_layout(idx, static_cast<int>(E));
    DispatchArgs a;
    a.x = x;
    a.num_tokens_per_rank = layout.num_tokens_per_rank;
    a.is_token_in_rank = layout.is_token_in_rank;
    a.num_tokens_per_expert = layout.num_tokens_per_expert;
    return buf->dispatch(a);
  };
  DispatchResult da, db;
  if (!collective_step("dispatch A, then B", [&] {
        da = dispatch_token(0);
        db = dispatch_token(1);
      }))
    return;
  expect_mixed_handles_raise(*buf, db, da);
}

// Each rank sends both of its tokens to the next rank, with is_token_in_rank given as bytes
// of 2 (from_blob over u8 data: not a valid bool, read as "sent"). Then it writes garbage
// into its handle's public tensors (send_head far out of range, is_token_in_rank all false):
// the combine and a cached dispatch must still use the dispatch's routing. Before, combine
// followed the public send_head (a segfault) and the cached dispatch its is_token_in_rank.
TEST(EpFaults, HandleTensorsAreForInspectionOnly) {
  const int me = my_rank(), R = num_ranks();
  if (R < 2) GTEST_SKIP() << "needs two ranks";
  const int64_t T = 2, H = 128, E = R;
  BufferGuard buf = make_buffer();
  auto x_of = [&](int rank) { return random_bf16({T, H}, hash4(0x4a7d, static_cast<uint64_t>(rank), 0, 0)); };
  const Tensor x = x_of(me), from_prev = x_of((me + R - 1) % R);
  Tensor idx = Tensor::empty({T, 1}, DType::i64);
  for (int64_t t = 0; t < T; ++t) idx.data_ptr<int64_t>()[t] = (me + 1) % R;
  const DispatchLayout layout = buf->get_dispatch_layout(idx, static_cast<int>(E));
  std::vector<uint8_t> in_rank_bytes(static_cast<size_t>(T * R), 0);
  for (int64_t t = 0; t < T; ++t) in_rank_bytes[static_cast<size_t>(t * R + (me + 1) % R)] = 2;
  DispatchArgs a;
  a.x = x;
  a.num_tokens_per_rank = layout.num_tokens_per_rank;
  a.is_token_in_rank = Tensor::from_blob(in_rank_bytes.data(), {T, R}, DType::boolean);
  a.num_tokens_per_expert = layout.num_tokens_per_expert;
  DispatchResult d;
  if (!collective_step("dispatch with is_token_in_rank bytes of 2", [&] { d = buf->dispatch(a); })) return;
  auto same_bits = [&](const Tensor& got, const Tensor& want, const char* what) {
    ASSERT_EQ(got.size(0), want.size(0)) << what;
    for (int64_t i = 0; i < want.numel(); ++i)
      ASSERT_EQ(got.data_ptr<uint16_t>()[i], want.data_ptr<uint16_t>()[i]) << what << ", element " << i;
  };
  same_bits(d.recv_x, from_prev, "received rows");
  std::fill_n(d.handle.send_head.data_ptr<int32_t>(), T * R, int32_t{1} << 28);
  std::memset(d.handle.is_token_in_rank.data(), 0, static_cast<size_t>(T * R));
  CombineArgs c;
  c.x = d.recv_x;
  c.handle = d.handle;
  CombineResult back;
  EXPECT_TRUE(collective_step("combine after writing into the handle", [&] { back = buf->combine(c); }));
  if (back.combined_x.defined()) same_bits(back.combined_x, x, "combined rows (each token's one row, back)");
  DispatchArgs cached;
  cached.x = x;
  cached.handle = d.handle;
  DispatchResult again;
  EXPECT_TRUE(collective_step("cached dispatch after writing into the handle", [&] { again = buf->dispatch(cached); }));
  if (again.recv_x.defined()) same_bits(again.recv_x, from_prev, "rows of the cached dispatch");
}

// Rank 1 comes to destroy() after the others' 2 s timeout: every other rank raises
// TimeoutError naming it. On its node they had raised a plain Error naming no rank until
// session 32; on other nodes, where an MPI barrier cannot tell who has come, until session
// 33 (2026-12-04: destroy's arrival messages). Then everyone goes on.
TEST(EpFaults, DestroyTimeoutNamesTheLateRank) {
  const int me = my_rank();
  if (num_ranks() < 2) GTEST_SKIP() << "needs two ranks";
  BufferOptions o;
  o.timeout_s = 2;
  BufferGuard buf = make_buffer(o);
  const int per_node = buf->get_num_local_ranks();
  if (me == 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(3500));
    try {
      buf->destroy();
    } catch (const std::exception&) {  // (whether the late rank raises is not specified)
    }
  } else {
    try {
      buf->destroy();
      ADD_FAILURE() << "destroy returned although rank 1 had not come";
    } catch (const TimeoutError& e) {
      EXPECT_EQ(e.silent_ranks(), std::vector<int>{1}) << "rank " << me << " (node " << me / per_node << "): " << e.what();
    } catch (const moekit::Error& e) {
      ADD_FAILURE() << "rank " << me << " (node " << me / per_node << ") raised an Error naming no rank: " << e.what();
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// Rank 1 never calls dispatch: the others raise TimeoutError naming it; then every rank
// destroys that buffer and a new one works.
TEST(EpFaults, TimeoutNamesTheSilentRank) {
  const int me = my_rank();
  if (num_ranks() < 2) GTEST_SKIP() << "needs two ranks";
  const World w = make_world(spec(256, 2, 2, tokens_per_rank([](int i) { return 8 + i; }), 1101));
  const Expected ex = expect_for(w);
  {
    BufferOptions o;
    o.timeout_s = 2;
    BufferGuard buf = make_buffer(o);
    EXPECT_EQ(buf->timeout_s(), 2.0);
    const RoutingTensors rt = routing_of(w, ex);
    const Payload pl = make_payload(make_x(Data::random, 1101, me, w.T(me), w.H), false);
    if (me == 1) {
      std::this_thread::sleep_for(std::chrono::seconds(4));
    } else {
      const auto start = std::chrono::steady_clock::now();
      try {
        (void)buf->dispatch(fresh_args(pl, rt, true, 1, std::nullopt, false));
        ADD_FAILURE() << "dispatch returned although rank 1 never called it";
      } catch (const TimeoutError& e) {
        const std::vector<int>& silent = e.silent_ranks();
        EXPECT_NE(std::find(silent.begin(), silent.end(), 1), silent.end()) << "silent_ranks() lacks rank 1: " << e.what();
        EXPECT_EQ(std::find(silent.begin(), silent.end(), me), silent.end()) << "silent_ranks() names the caller: " << e.what();
        EXPECT_NE(std::string(e.what()).find('1'), std::string::npos) << "what() should name rank 1: " << e.what();
      } catch (const std::exception& e) {
        ADD_FAILURE() << "expected moekit::ep::TimeoutError, got: " << e.what();
      }
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      EXPECT_GE(waited, 1.5) << "gave up before the 2 s timeout";
      EXPECT_LT(waited, 30.0) << "took far longer than the 2 s timeout";
      // This rank's op count is now ahead of rank 1's: a further normal op raises at once
      // (it had gone on in a mixed state; review finding, 2026-12-04).
      const auto again = std::chrono::steady_clock::now();
      EXPECT_TRUE(expect_ep_error_on([&] { (void)buf->dispatch(fresh_args(pl, rt, true, 1, std::nullopt, false)); }, "buffer"));
      EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - again).count(), 1.0) << "must not wait";
    }
    MPI_Barrier(MPI_COMM_WORLD);
    EXPECT_NO_THROW(buf->destroy());
    EXPECT_FALSE(buf->is_available());
  }
  // Everyone continues: a new buffer works.
  BufferGuard fresh = make_buffer();
  const Prepared p = prepare(w, ex, Data::rank_encoded, 1102);
  Case c;
  SCOPED_TRACE("new buffer after the timeout");
  run_case(*fresh, p, c);
}

}  // namespace
}  // namespace moekit::ep

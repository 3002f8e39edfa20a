// Reference GEMM: D = C + A·Bᵀ in f64, all four layouts, optional per-K-group scales.
#include <numeric>
#include <vector>
#include <stdexcept>
#include <string>

#include "reference.h"

namespace moekit::ref {

double operand_scale(const Tensor& sf, int64_t r, int64_t g);  // formats_ref.cpp

namespace {

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("ref::gemm: " + what);
}
void require_extent(const Operand& op) {
  require((op.packed_extent + 1) / 2 == op.values.size(1), "packed_extent does not match the stored columns");
}

int64_t unpacked_cols(const Tensor& t) { return t.dtype() == DType::e2m1x2 ? 2 * t.size(1) : t.size(1); }
int64_t logical_cols(const Operand& op) {
  if (op.values.dtype() != DType::e2m1x2 || op.packed_extent < 0) return unpacked_cols(op.values);
  require_extent(op);
  return op.packed_extent;
}

// Logical element (mn, kk) of an operand stored either [MN, K] (k_inner) or [K, MN].
double element(const Tensor& t, bool k_inner, int64_t mn, int64_t kk) {
  return k_inner ? value_at(t, mn, kk) : value_at(t, kk, mn);
}


// All logical elements [mn][k] of an operand, decoded once: value_at per use made the
// triple loop the slowest part of the GEMM tests. Same values, so the same sums.
std::vector<double> logical_values(const Tensor& t, bool k_inner, int64_t mn, int64_t k) {
  std::vector<double> out(static_cast<size_t>(mn * k));
  for (int64_t i = 0; i < mn; ++i)
    for (int64_t kk = 0; kk < k; ++kk) out[static_cast<size_t>(i * k + kk)] = element(t, k_inner, i, kk);
  return out;
}

bool a_k_inner(Layout l) { return l == Layout::nt || l == Layout::nn; }
bool b_k_inner(Layout l) { return l == Layout::nt || l == Layout::tt; }

}  // namespace

GemmProblem gemm_problem(Layout layout, const Operand& a, const Operand& b) {
  require(a.values.dim() == 2 && b.values.dim() == 2, "A and B must be 2-D");
  const bool ak = a_k_inner(layout), bk = b_k_inner(layout);
  GemmProblem p;
  p.m = ak ? a.values.size(0) : logical_cols(a);
  p.k = ak ? logical_cols(a) : a.values.size(0);
  p.n = bk ? b.values.size(0) : logical_cols(b);
  const int64_t kb = bk ? logical_cols(b) : b.values.size(0);
  require(p.k == kb, "K of A (" + std::to_string(p.k) + ") != K of B (" + std::to_string(kb) + ")");
  return p;
}

std::vector<double> gemm(Layout layout, const Operand& a, const Operand& b, const Tensor& c) {
  const GemmProblem p = gemm_problem(layout, a, b);
  const bool ak = a_k_inner(layout), bk = b_k_inner(layout);
  const bool scaled = a.sf.defined() || b.sf.defined();
  // Promotion groups: the common refinement of both operands' K groups (gcd of gran_k),
  // within which both scales are constant.
  require((!a.sf.defined() || a.gran_k > 0) && (!b.sf.defined() || b.gran_k > 0), "gran_k must be positive");
  int64_t group = p.k > 0 ? p.k : 1;
  if (a.sf.defined()) group = a.gran_k;
  if (b.sf.defined()) group = a.sf.defined() ? std::gcd(a.gran_k, b.gran_k) : b.gran_k;
  std::vector<double> d(static_cast<size_t>(p.m * p.n), 0.0);
  const std::vector<double> av = logical_values(a.values, ak, p.m, p.k), bv = logical_values(b.values, bk, p.n, p.k);
  for (int64_t i = 0; i < p.m; ++i)
    for (int64_t j = 0; j < p.n; ++j) {
      double acc = c.defined() ? value_at(c, i, j) : 0.0;
      const double* ai = av.data() + i * p.k;
      const double* bj = bv.data() + j * p.k;
      for (int64_t k0 = 0; k0 < p.k; k0 += group) {
        double partial = 0.0;
        for (int64_t kk = k0; kk < std::min(p.k, k0 + group); ++kk) partial += ai[kk] * bj[kk];
        if (scaled) {
          if (a.sf.defined()) partial *= operand_scale(a.sf, i / a.gran_mn, k0 / a.gran_k);
          if (b.sf.defined()) partial *= operand_scale(b.sf, j / b.gran_mn, k0 / b.gran_k);
        }
        acc += partial;
      }
      d[i * p.n + j] = acc;
    }
  return d;
}

Tensor to_tensor(const std::vector<double>& values, int64_t rows, int64_t cols, DType dtype) {
  require(static_cast<int64_t>(values.size()) == rows * cols, "to_tensor: size mismatch");
  Tensor t = Tensor::empty({rows, cols}, dtype);
  for (int64_t i = 0; i < rows * cols; ++i) {
    if (dtype == DType::f32) t.data_ptr<float>()[i] = static_cast<float>(values[i]);
    else if (dtype == DType::bf16) t.data_ptr<uint16_t>()[i] = nearest_bf16(static_cast<float>(values[i]));
    else throw std::invalid_argument("ref::to_tensor: dtype must be f32 or bf16");
  }
  return t;
}

std::vector<double> to_f64(const Tensor& t) {
  require(t.dim() == 2, "to_f64: 2-D tensor expected");
  const int64_t rows = t.size(0), cols = unpacked_cols(t);
  std::vector<double> out(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = value_at(t, r, c);
  return out;
}

}  // namespace moekit::ref

// tools/epcomm/demo_model.cc — demo inputs from the seed and the dense single-process reference.
// The reference shares the router and expert code with the ranks, but no communication or routing plan.
//
// Tolerance. Both paths feed each expert bitwise the same fp32 row and get bitwise the same fp32 output y
// (Expert::forward's row results do not depend on batching). They differ only in roundings:
//   - the distributed path rounds to the dtype once before combine: each expert output (expert_major) or
//     each rank's weighted partial sum (rank_major); either is off by at most u * sum_k w_k |y_k| =: u * S;
//   - fp32 sums of at most K terms in another order: at most about K * 2^-24 * S;
//   - each side rounds its final fp32 sum once: at most u |ref| each.
// So |out - ref| <= 2u|ref| + (u + 2K * 2^-24) * S; 1% slack covers second-order terms, and for f16 one
// subnormal step covers results below the normal range.
#include "demo_model.h"

#include <algorithm>
#include <cmath>

#include "numerics.h"

namespace epcomm::cli {

RankInputs make_rank_inputs(const DemoOptions& o, const Router& router, int s) {
  const int64_t T = o.run.tokens, H = o.run.hidden;
  const int K = o.run.topk;
  const size_t row_bytes = static_cast<size_t>(H) * dtype_size(o.run.dtype);
  RankInputs in;
  in.x.resize(static_cast<size_t>(T) * row_bytes);
  in.topk_idx.resize(static_cast<size_t>(T * K));
  in.topk_weights.resize(static_cast<size_t>(T * K));
  std::vector<float> xf(static_cast<size_t>(H));
  for (int64_t t = 0; t < T; ++t) {
    std::byte* row = in.x.data() + t * row_bytes;
    make_token(o.run.seed, s, t, H, o.run.dtype, row);
    load_row(o.run.dtype, row, H, xf.data());  // the router sees the token as stored
    router.route(xf.data(), in.topk_idx.data() + t * K, in.topk_weights.data() + t * K);
  }
  return in;
}

std::string tolerance_formula(const DemoOptions& o) {
  const char* u = o.run.dtype == DType::bf16 ? "2^-8" : o.run.dtype == DType::f16 ? "2^-11" : "2^-24";
  return std::string("|out - ref| <= 1.01 * (2u*|ref| + (u + 2K*2^-24) * sum_k w_k*|y_k|), u = ") + u + " (" +
         dtype_name(o.run.dtype) + " unit roundoff), K = " + std::to_string(o.run.topk);
}

namespace {

// Dense fp32 reference: acc = sum_k w_k y_k and bound = sum_k w_k |y_k| for every token of every rank.
struct Dense {
  std::vector<float> acc, bound;  // [R * T, H]
};

Dense dense_reference(const DemoOptions& o) {
  const int R = o.run.ranks, K = o.run.topk, E = o.run.experts;
  const int64_t T = o.run.tokens, H = o.run.hidden, N = R * T;
  const size_t row_bytes = static_cast<size_t>(H) * dtype_size(o.run.dtype);
  Router router(o.run.seed, o.shape());
  std::vector<float> seen(static_cast<size_t>(N * H));  // each token as every expert sees it
  std::vector<std::vector<std::pair<int64_t, float>>> users(static_cast<size_t>(E));  // (token, weight)
  for (int s = 0; s < R; ++s) {
    RankInputs in = make_rank_inputs(o, router, s);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t g = s * T + t;
      seen_token_f32(o.run.quant, o.run.dtype, in.x.data() + t * row_bytes, H, seen.data() + g * H);
      for (int k = 0; k < K; ++k) users[in.topk_idx[t * K + k]].emplace_back(g, in.topk_weights[t * K + k]);
    }
  }
  Dense d{std::vector<float>(seen.size(), 0.0f), std::vector<float>(seen.size(), 0.0f)};
  std::vector<float> xin, y;
  for (int e = 0; e < E; ++e) {
    const auto& u = users[e];
    if (u.empty()) continue;
    const int64_t n = static_cast<int64_t>(u.size());
    xin.resize(static_cast<size_t>(n * H));
    y.resize(static_cast<size_t>(n * H));
    for (int64_t i = 0; i < n; ++i) std::copy_n(seen.data() + u[i].first * H, H, xin.data() + i * H);
    Expert(o.run.seed, e, o.shape()).forward(xin.data(), n, y.data());
    for (int64_t i = 0; i < n; ++i) {
      float* acc = d.acc.data() + u[i].first * H;
      float* bound = d.bound.data() + u[i].first * H;
      const float w = u[i].second;
      const float* yi = y.data() + i * H;
      for (int64_t h = 0; h < H; ++h) {
        acc[h] += w * yi[h];
        bound[h] += w * std::fabs(yi[h]);
      }
    }
  }
  return d;
}

}  // namespace

CheckResult check_against_reference(const DemoOptions& o, const std::vector<std::byte>& combined,
                                    Progress& progress, std::vector<float>* reference) {
  progress.phase("reference: every token through its top-k experts in one process");
  Dense d = dense_reference(o);
  progress.phase("comparing");
  const DType dt = o.run.dtype;
  const double u = unit_roundoff(dt);
  const double per_bound = u + 2.0 * o.run.topk / 16777216.0;
  const double floor = dt == DType::f16 ? 1.0 / 16777216.0 : 1e-37;
  const int64_t H = o.run.hidden;
  CheckResult c;
  c.elements = static_cast<int64_t>(d.acc.size());
  for (int64_t i = 0; i < c.elements; ++i) {
    const double ref = round_to(dt, d.acc[i]);
    const double got = load_elem(dt, combined.data(), i);
    const double err = std::fabs(got - ref);
    const double tol = 1.01 * (2 * u * std::fabs(ref) + per_bound * d.bound[i]) + floor;
    c.max_abs_ref = std::max(c.max_abs_ref, std::fabs(ref));
    if (!(err <= tol)) ++c.failures;  // NaN fails too
    const double ratio = err / tol;
    if (!(ratio <= c.worst_ratio)) {  // also taken for NaN
      c.worst_ratio = std::isnan(ratio) ? INFINITY : ratio;
      c.worst_token = i / H;
      c.worst_col = i % H;
    }
    if (!(err <= c.max_abs_err)) c.max_abs_err = std::isnan(err) ? INFINITY : err;
  }
  if (reference) {
    reference->resize(d.acc.size());
    for (size_t i = 0; i < d.acc.size(); ++i) (*reference)[i] = round_to(dt, d.acc[i]);
  }
  return c;
}

double ErrorStats::rms_err() const {
  return elements > 0 ? std::sqrt(sum_sq_err / static_cast<double>(elements)) : 0.0;
}

double ErrorStats::rel_rms_err() const {
  return sum_sq_ref > 0 ? std::sqrt(sum_sq_err / sum_sq_ref) : 0.0;
}

namespace {

// Accumulates the error of value `got` against `ref` (both exact in fp32), element by element.
void accumulate(ErrorStats& s, double got, double ref) {
  double err = std::fabs(got - ref);
  if (std::isnan(err)) err = INFINITY;
  ++s.elements;
  s.max_abs_err = std::max(s.max_abs_err, err);
  s.max_abs_ref = std::max(s.max_abs_ref, std::fabs(ref));
  s.sum_sq_err += err * err;
  s.sum_sq_ref += ref * ref;
}

}  // namespace

QuantCost quantization_cost(const DemoOptions& o, const std::vector<std::byte>& quantized,
                            const std::vector<std::byte>& plain, const std::vector<float>& quant_reference,
                            Progress& progress) {
  progress.phase("reference without quantization, for the extra error of --quant");
  DemoOptions unquantized = o;
  unquantized.run.quant.reset();
  const Dense d = dense_reference(unquantized);
  const DType dt = o.run.dtype;
  QuantCost q;
  for (size_t i = 0; i < d.acc.size(); ++i) {
    const double ref = round_to(dt, d.acc[i]);
    accumulate(q.plain, load_elem(dt, plain.data(), static_cast<int64_t>(i)), ref);
    accumulate(q.quantized, load_elem(dt, quantized.data(), static_cast<int64_t>(i)), ref);
    accumulate(q.reference, quant_reference[i], ref);
  }
  return q;
}

}  // namespace epcomm::cli

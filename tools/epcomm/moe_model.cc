// tools/epcomm/moe_model.cc — router and SwiGLU experts of the demo layer.
// Loops are written as row updates (axpy) so the compiler vectorizes them without reassociating sums.
#include "moe_model.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "numerics.h"

namespace epcomm::cli {

namespace {
constexpr int64_t kTileRows = 8;  // rows sharing one pass over an expert's weights

// Random matrix of `rows` x `cols` with values uniform * scale, rounded to bf16.
std::vector<float> random_matrix(uint64_t seed, StreamKind kind, uint64_t id, int64_t rows, int64_t cols,
                                 float scale) {
  const RandomStream rng(seed, kind, id);
  std::vector<float> m(static_cast<size_t>(rows * cols));
  for (size_t i = 0; i < m.size(); ++i) m[i] = round_to(DType::bf16, rng.uniform(i) * scale);
  return m;
}
}  // namespace

Router::Router(uint64_t seed, const MoeShape& shape) : shape_(shape) {
  // Logits of a few units: the softmax is peaked enough that the top-k weights differ visibly.
  w_ = random_matrix(seed, StreamKind::router, 0, shape.hidden, shape.experts,
                     4.0f / std::sqrt(static_cast<float>(shape.hidden)));
}

void Router::route(const float* x, int64_t* ids, float* weights) const {
  const int64_t H = shape_.hidden;
  const int E = shape_.experts, K = shape_.topk;
  std::vector<float> p(static_cast<size_t>(E), 0.0f);
  for (int64_t h = 0; h < H; ++h) {
    const float xh = x[h];
    const float* w = w_.data() + h * E;
    for (int e = 0; e < E; ++e) p[e] += xh * w[e];
  }
  float mx = *std::max_element(p.begin(), p.end()), sum = 0.0f;
  for (float& v : p) {
    v = std::exp(v - mx);
    sum += v;
  }
  for (float& v : p) v /= sum;
  std::vector<int> order(static_cast<size_t>(E));
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + K, order.end(),
                    [&](int a, int b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
  float chosen = 0.0f;
  for (int k = 0; k < K; ++k) chosen += p[order[k]];
  for (int k = 0; k < K; ++k) {
    ids[k] = order[k];
    weights[k] = p[order[k]] / chosen;
  }
}

Expert::Expert(uint64_t seed, int expert, const MoeShape& shape) : H_(shape.hidden), I_(shape.intermediate) {
  const float in_scale = 2.0f / std::sqrt(static_cast<float>(H_));
  const float out_scale = 2.0f / std::sqrt(static_cast<float>(I_));
  const auto id = static_cast<uint64_t>(expert);
  gate_ = random_matrix(seed, StreamKind::gate, id, H_, I_, in_scale);
  up_ = random_matrix(seed, StreamKind::up, id, H_, I_, in_scale);
  down_ = random_matrix(seed, StreamKind::down, id, I_, H_, out_scale);
}

void Expert::forward(const float* x, int64_t n, float* y) const {
  for (int64_t r = 0; r < n; r += kTileRows) forward_tile(x + r * H_, std::min(kTileRows, n - r), y + r * H_);
}

void Expert::forward_tile(const float* x, int64_t n, float* y) const {
  std::vector<float> g(static_cast<size_t>(n * I_), 0.0f), u(static_cast<size_t>(n * I_), 0.0f);
  for (int64_t h = 0; h < H_; ++h) {
    const float* wg = gate_.data() + h * I_;
    const float* wu = up_.data() + h * I_;
    for (int64_t r = 0; r < n; ++r) {
      const float xh = x[r * H_ + h];
      float* gr = g.data() + r * I_;
      float* ur = u.data() + r * I_;
      for (int64_t i = 0; i < I_; ++i) {
        gr[i] += xh * wg[i];
        ur[i] += xh * wu[i];
      }
    }
  }
  for (size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];  // silu(g) * u
  std::fill(y, y + n * H_, 0.0f);
  for (int64_t i = 0; i < I_; ++i) {
    const float* wd = down_.data() + i * H_;
    for (int64_t r = 0; r < n; ++r) {
      const float a = g[r * I_ + i];
      float* yr = y + r * H_;
      for (int64_t h = 0; h < H_; ++h) yr[h] += a * wd[h];
    }
  }
}

}  // namespace epcomm::cli

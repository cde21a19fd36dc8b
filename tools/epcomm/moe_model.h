// tools/epcomm/moe_model.h — the MoE layer of `epcomm demo`: a softmax top-k router and SwiGLU experts,
// generated from the seed so that every rank (and the reference) builds the same weights on its own.
#pragma once

#include <cstdint>
#include <vector>

namespace epcomm::cli {

struct MoeShape {
  int64_t hidden;        // H
  int64_t intermediate;  // I, the expert's inner width
  int experts;           // E
  int topk;              // K
};

// Router: logits = x @ W (W is [H, E], fp32), p = softmax(logits) in fp32, the K largest p (ties: lower
// expert first) in descending order, weights = those p renormalized to sum to 1.
class Router {
 public:
  Router(uint64_t seed, const MoeShape& shape);
  // ids and weights: K values each.
  void route(const float* x, int64_t* ids, float* weights) const;

 private:
  MoeShape shape_;
  std::vector<float> w_;  // [H, E]
};

// One expert: y = W_down^T (silu(W_gate^T x) * (W_up^T x)). Weights are bf16 values held as fp32 (gate and
// up [H, I], down [I, H]); math is fp32 with a fixed accumulation order per row, so a row's result does not
// depend on which other rows share the call.
class Expert {
 public:
  Expert(uint64_t seed, int expert, const MoeShape& shape);
  // x: [n, H] fp32, y: [n, H] fp32.
  void forward(const float* x, int64_t n, float* y) const;

 private:
  void forward_tile(const float* x, int64_t n, float* y) const;
  int64_t H_, I_;
  std::vector<float> gate_, up_, down_;
};

}  // namespace epcomm::cli

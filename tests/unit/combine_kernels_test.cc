// unit/combine_kernels_test.cc — the combine reductions (docs/normal-mode.md) against the oracle's own
// scalar arithmetic, bit for bit: the one-node reduction (reduce_token) and the two halves of the
// hierarchical one (reduce_partial, finish_partials); the one-node reduction in every kernel the CPU runs.
// Widths cover the 64-element register blocks and their tails; inputs include NaN, infinities, -0 and
// subnormals.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "engine/kernels.h"
#include "support/ref_float.h"
#include "support/rng.h"

namespace epcomm::engine {
namespace {

using testing::elem_size;
using testing::f32_bits;
using testing::f32_from_bits;
using testing::load_f32;
using testing::SplitMix64;
using testing::store_rounded;

constexpr DType kDtypes[] = {DType::bf16, DType::f16, DType::f32};
constexpr int64_t kWidths[] = {1, 15, 63, 64, 65, 200, 7168};
// Every count the vector kernels unroll at compile time (1-8), and run-time counts beyond.
constexpr int kCounts[] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 13};

// A value of `dtype` as raw bytes: mostly ordinary numbers, sometimes a special one.
void random_element(SplitMix64& rng, DType dtype, uint8_t* out) {
  static const float specials[] = {0.0f,
                                   -0.0f,
                                   1e-40f,
                                   -3e-39f,
                                   65504.0f,
                                   3e38f,
                                   -3e38f,
                                   f32_from_bits(0x7F800000u),
                                   f32_from_bits(0xFF800000u),
                                   f32_from_bits(0x7FC00001u)};
  float v;
  if (rng.below(50) == 0)
    v = specials[rng.below(sizeof specials / sizeof specials[0])];
  else
    v = (static_cast<float>(rng.below(2000001)) - 1000000.0f) / 4096.0f;
  store_rounded(dtype, v, out);
  if (dtype == DType::f32) std::memcpy(out, &v, 4);  // keep payloads and -0 as drawn
}

std::vector<uint8_t> random_row(SplitMix64& rng, DType dtype, int64_t n) {
  std::vector<uint8_t> row(static_cast<size_t>(n) * elem_size(dtype));
  for (int64_t i = 0; i < n; ++i) random_element(rng, dtype, row.data() + i * elem_size(dtype));
  return row;
}

// Element i of a node's partial: p = +0; p = p + f32(w_j * x_j) (or p + x_j) for j in order.
float oracle_partial(DType dt, const std::vector<std::vector<uint8_t>>& rows, const float* w, int64_t i) {
  float p = 0.0f;
  for (size_t j = 0; j < rows.size(); ++j) {
    float x = load_f32(dt, rows[j].data(), i);
    float c = w ? w[j] * x : x;
    p = p + c;
  }
  return p;
}

// acc = +0 + s, then the biases, then one rounding.
void oracle_finish(DType dt, float s, const uint8_t* b1, const uint8_t* b2, int64_t i, uint8_t* out) {
  float acc = 0.0f + s;
  if (b1) acc = acc + load_f32(dt, b1, i);
  if (b2) acc = acc + load_f32(dt, b2, i);
  store_rounded(dt, acc, out);
}

bool same_f32(float a, float b) {
  return f32_bits(a) == f32_bits(b) || (a != a && b != b);  // partials are internal: any NaN is a NaN
}

struct Case {
  DType dt;
  int64_t hidden;
  int n;
  bool weighted;
  int biases;
};

std::string describe(const Case& c) {
  return std::string(dtype_name(c.dt)) + " hidden " + std::to_string(c.hidden) + " n " + std::to_string(c.n) +
         (c.weighted ? " weighted" : "") + " biases " + std::to_string(c.biases);
}

template <typename Body>
void for_each_case(Body&& body) {
  for (DType dt : kDtypes)
    for (int64_t hidden : kWidths)
      for (int n : kCounts)
        for (bool weighted : {false, true})
          for (int biases : {0, 1, 2}) body(Case{dt, hidden, n, weighted, biases});
}

TEST(CombineKernels, OneNodeReductionMatchesOracle) {
  SplitMix64 rng(11);
  for_each_case([&](const Case& c) {
    const size_t es = elem_size(c.dt);
    std::vector<std::vector<uint8_t>> rows;
    std::vector<const uint8_t*> ptrs;
    std::vector<float> w;
    for (int j = 0; j < c.n; ++j) {
      rows.push_back(random_row(rng, c.dt, c.hidden));
      w.push_back(static_cast<float>(rng.below(1000)) / 997.0f);
    }
    for (auto& r : rows) ptrs.push_back(r.data());
    const auto b1 = random_row(rng, c.dt, c.hidden), b2 = random_row(rng, c.dt, c.hidden);
    const uint8_t* p1 = c.biases >= 1 ? b1.data() : nullptr;
    const uint8_t* p2 = c.biases >= 2 ? b2.data() : nullptr;
    std::vector<uint8_t> got(c.hidden * es + 64), want(c.hidden * es);
    // 64-byte aligned output, as the library's allocations are (the bf16 path streams then).
    uint8_t* out = got.data() + ((64 - reinterpret_cast<uintptr_t>(got.data()) % 64) % 64);
    for (int64_t i = 0; i < c.hidden; ++i)
      oracle_finish(c.dt, oracle_partial(c.dt, rows, c.weighted ? w.data() : nullptr, i), p1, p2, i,
                    want.data() + i * es);
    reduce_token(c.dt, ptrs.data(), c.weighted ? w.data() : nullptr, c.n, c.hidden, p1, p2, out);
    ASSERT_EQ(0, std::memcmp(out, want.data(), want.size())) << describe(c) << " (reduce_token)";
    // Every implementation this CPU runs, not only the one reduce_token picked.
    for (const ReduceKernel& k : reduce_kernels()) {
      std::memset(out, 0xA5, want.size());
      k.run(c.dt, ptrs.data(), c.weighted ? w.data() : nullptr, c.n, c.hidden, p1, p2, out);
      ASSERT_EQ(0, std::memcmp(out, want.data(), want.size())) << describe(c) << " (" << k.name << ")";
    }
  });
}

TEST(CombineKernels, EveryKernelThisCpuRunsIsListedBestFirst) {
  const std::vector<ReduceKernel> k = reduce_kernels();
  std::vector<std::string> names;
  for (const ReduceKernel& e : k) names.push_back(e.name);
  std::vector<std::string> want;
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) want.push_back("avx512");
  if (__builtin_cpu_supports("avx2")) want.push_back("avx2");
#endif
  want.push_back("portable");
  EXPECT_EQ(want, names);
}

TEST(CombineKernels, NodePartialsAndTheirSumMatchOracle) {
  SplitMix64 rng(12);
  for_each_case([&](const Case& c) {
    const size_t es = elem_size(c.dt);
    // A token's contributions split over up to three nodes; each node's partial, then the origin's sum.
    std::vector<std::vector<std::vector<uint8_t>>> node_rows(3);
    std::vector<std::vector<float>> node_w(3);
    for (int j = 0; j < c.n; ++j) {
      const size_t node = rng.below(3);
      node_rows[node].push_back(random_row(rng, c.dt, c.hidden));
      node_w[node].push_back(static_cast<float>(rng.below(1000)) / 997.0f);
    }
    std::vector<std::vector<float>> parts(3, std::vector<float>(c.hidden));
    std::vector<const float*> part_ptrs;
    for (int node = 0; node < 3; ++node) {
      std::vector<const uint8_t*> ptrs;
      for (auto& r : node_rows[node]) ptrs.push_back(r.data());
      const float* w = c.weighted ? node_w[node].data() : nullptr;
      reduce_partial(c.dt, ptrs.data(), w, static_cast<int>(ptrs.size()), c.hidden, parts[node].data());
      for (int64_t i = 0; i < c.hidden; ++i)
        ASSERT_TRUE(same_f32(parts[node][i], oracle_partial(c.dt, node_rows[node], w, i)))
            << describe(c) << " node " << node << " element " << i;
      part_ptrs.push_back(parts[node].data());
    }
    const auto b1 = random_row(rng, c.dt, c.hidden), b2 = random_row(rng, c.dt, c.hidden);
    const uint8_t* p1 = c.biases >= 1 ? b1.data() : nullptr;
    const uint8_t* p2 = c.biases >= 2 ? b2.data() : nullptr;
    for (int np : {0, 1, 3}) {
      std::vector<uint8_t> got(c.hidden * es), want(c.hidden * es);
      finish_partials(c.dt, part_ptrs.data(), np, c.hidden, p1, p2, got.data());
      for (int64_t i = 0; i < c.hidden; ++i) {
        float s = 0.0f;
        for (int node = 0; node < np; ++node) s = s + parts[node][i];
        oracle_finish(c.dt, s, p1, p2, i, want.data() + i * es);
      }
      ASSERT_EQ(0, std::memcmp(got.data(), want.data(), want.size())) << describe(c) << " nodes " << np;
    }
  });
}

}  // namespace
}  // namespace epcomm::engine

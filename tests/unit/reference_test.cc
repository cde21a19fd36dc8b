// unit/reference_test.cc — pins the test oracle (tests/support) against hand-worked numbers from
// docs/normal-mode.md, and checks the seeded problem generator's promises.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "support/check.h"
#include "support/problem.h"
#include "support/ref_float.h"
#include "support/reference.h"

namespace epcomm::testing {
namespace {

using Order = ReceiveOrder;
using I64s = std::vector<int64_t>;
using I32s = std::vector<int32_t>;
using F32s = std::vector<float>;
using Bytes = std::vector<uint8_t>;

// ---------------------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------------------

Bytes to_dtype(DType dtype, const F32s& values) {
  Bytes out(values.size() * elem_size(dtype));
  for (size_t i = 0; i < values.size(); ++i)
    store_rounded(dtype, values[i], out.data() + i * elem_size(dtype));
  return out;
}

F32s from_dtype(DType dtype, const Bytes& bytes) {
  F32s out(bytes.size() / elem_size(dtype));
  for (size_t i = 0; i < out.size(); ++i) out[i] = load_f32(dtype, bytes.data(), static_cast<int64_t>(i));
  return out;
}

std::vector<uint16_t> u16_of(const Bytes& bytes) {
  std::vector<uint16_t> out(bytes.size() / 2);
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

// A problem given literally: per rank the [T*K] ids, [T*K] weights and [T*H] payload values.
Problem hand_problem(int R, int E, int K, int64_t H, DType dtype, const std::vector<I64s>& topk,
                     const std::vector<F32s>& weights, const std::vector<F32s>& x) {
  Problem p;
  p.spec.num_ranks = R;
  p.spec.num_experts = E;
  p.spec.num_topk = K;
  p.spec.hidden = H;
  p.spec.dtype = dtype;
  for (int s = 0; s < R; ++s) {
    RankInputs in;
    in.num_tokens = static_cast<int64_t>(topk[s].size()) / K;
    in.topk_idx = topk[s];
    in.topk_weights = weights[s];
    in.x = to_dtype(dtype, x[s]);
    p.ranks.push_back(in);
  }
  validate_problem(p);
  return p;
}

// The worked example used throughout (R = 2, E = 4 so L = 2, K = 2, H = 1, f32):
//   rank 0: t0 -> experts {1, 2}, t1 -> {3, 3} (a repeat), t2 -> {-1, 0};  x = 10, 11, 12
//   rank 1: t0 -> {2, -1},        t1 -> {0, 1};                              x = 20, 21
Problem example() {
  return hand_problem(2, 4, 2, 1, DType::f32, {{1, 2, 3, 3, -1, 0}, {2, -1, 0, 1}},
                      {{0.5f, 0.25f, 0.125f, 0.75f, 0.875f, 0.375f}, {0.5f, 0.0625f, 0.25f, 0.625f}},
                      {{10, 11, 12}, {20, 21}});
}

// ---------------------------------------------------------------------------------------------------------
// Scalar conversions (docs/quant.md vectors)
// ---------------------------------------------------------------------------------------------------------

TEST(ReferenceFloat, Bf16Vectors) {
  const std::vector<std::pair<uint32_t, uint16_t>> cases = {
      {0x3f808000, 0x3f80}, {0x3f818000, 0x3f82}, {0x3f808001, 0x3f81}, {0x43eff333, 0x43f0},
      {0x7f7fffff, 0x7f80}, {0x007fffff, 0x0080}, {0x00000001, 0x0000}, {0xffc00001, 0x7fc0},
      {0x80000000, 0x8000}, {0xff800000, 0xff80}};
  for (auto [in, out] : cases) EXPECT_EQ(f32_to_bf16(f32_from_bits(in)), out) << std::hex << in;
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7F80) == 0x7F80 && (h & 0x7F)) continue;  // NaN: canonicalized
    EXPECT_EQ(f32_to_bf16(bf16_to_f32(static_cast<uint16_t>(h))), h);
  }
}

TEST(ReferenceFloat, F16Vectors) {
  const std::vector<std::pair<uint32_t, uint16_t>> cases = {
      {0x3f800000, 0x3c00}, {0x3f801000, 0x3c00}, {0x3f803000, 0x3c02}, {0x3f801001, 0x3c01},
      {0x3dcccccd, 0x2e66}, {0x477fe000, 0x7bff}, {0x477fefff, 0x7bff}, {0x477ff000, 0x7c00},
      {0x7f7fffff, 0x7c00}, {0xff800000, 0xfc00}, {0x80000000, 0x8000}, {0x33800000, 0x0001},
      {0x33000000, 0x0000}, {0x33400000, 0x0001}, {0x387fc000, 0x03ff}, {0x7fc00000, 0x7e00},
      {0xffc00001, 0x7e00}};
  for (auto [in, out] : cases) EXPECT_EQ(f32_to_f16(f32_from_bits(in)), out) << std::hex << in;
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7C00) == 0x7C00 && (h & 0x3FF)) continue;
    EXPECT_EQ(f32_to_f16(f16_to_f32(static_cast<uint16_t>(h))), h);
  }
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(f32_bits(f16_to_f32(0x8000)), 0x80000000u);
  EXPECT_EQ(f16_to_f32(0x3555), 0.333251953125f);
}

TEST(ReferenceFloat, F32OutputCanonicalizesNaN) {
  uint8_t out[4];
  store_rounded(DType::f32, f32_from_bits(0xFFC00001), out);
  uint32_t bits;
  std::memcpy(&bits, out, 4);
  EXPECT_EQ(bits, 0x7FC00000u);
  store_rounded(DType::f32, -0.0f, out);
  std::memcpy(&bits, out, 4);
  EXPECT_EQ(bits, 0x80000000u);
}

// ---------------------------------------------------------------------------------------------------------
// docs/normal-mode.md layout
// ---------------------------------------------------------------------------------------------------------

TEST(ReferenceLayout, WorkedExample) {
  const Problem p = example();
  RefLayout a = ref_layout(p, 0);
  EXPECT_EQ(a.is_token_in_rank, (std::vector<uint8_t>{1, 1, 0, 1, 1, 0}));
  EXPECT_EQ(a.num_tokens_per_rank, (I32s{2, 2}));
  EXPECT_EQ(a.num_tokens_per_expert, (I32s{1, 1, 1, 2}));  // the repeated expert 3 counts twice
  EXPECT_TRUE(a.num_tokens_per_rdma_rank.empty());         // one node: None
  RefLayout b = ref_layout(p, 1, /*ranks_per_node=*/1);
  EXPECT_EQ(b.is_token_in_rank, (std::vector<uint8_t>{0, 1, 1, 0}));
  EXPECT_EQ(b.num_tokens_per_rank, (I32s{1, 1}));
  EXPECT_EQ(b.num_tokens_per_expert, (I32s{1, 1, 1, 0}));
  EXPECT_EQ(b.num_tokens_per_rdma_rank, (I32s{1, 1}));
  EXPECT_TRUE(ref_layout(p, 1, 2).num_tokens_per_rdma_rank.empty());
}

TEST(ReferenceLayout, NodeCountsCountATokenOnce) {
  // R = 4, P = 2: t0 -> ranks 0 and 1 (both node 0), t1 -> rank 3 (node 1), t2 -> nothing.
  const RefLayout l = ref_layout_of({0, 1, 3, -1, -1, -7}, 3, 2, 4, 4, 2);
  EXPECT_EQ(l.num_tokens_per_rank, (I32s{1, 1, 0, 1}));
  EXPECT_EQ(l.num_tokens_per_rdma_rank, (I32s{1, 1}));
  EXPECT_EQ(l.num_tokens_per_expert, (I32s{1, 1, 0, 1}));
  const RefLayout four_nodes = ref_layout_of({0, 1, 3, -1, -1, -7}, 3, 2, 4, 4, 1);
  EXPECT_EQ(four_nodes.num_tokens_per_rdma_rank, (I32s{1, 1, 0, 1}));
}

TEST(ReferenceLayout, OutOfRangeIdNamesFirstSlot) {
  try {
    ref_layout_of({0, 1, 2, 9, 8, 0}, 3, 2, 2, 4);
    FAIL() << "no throw";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), "topk_idx[1, 1] = 9 is out of range [0, 4)");
  }
  EXPECT_THROW(ref_layout_of({0}, 1, 1, 2, 4, 3), std::invalid_argument);  // R % P != 0
}

TEST(ReferenceLayout, ZeroTokens) {
  const RefLayout l = ref_layout_of({}, 0, 3, 2, 4, 1);
  EXPECT_EQ(l.num_tokens_per_rank, (I32s{0, 0}));
  EXPECT_EQ(l.num_tokens_per_rdma_rank, (I32s{0, 0}));
  EXPECT_EQ(l.num_tokens_per_expert, (I32s{0, 0, 0, 0}));
  EXPECT_TRUE(l.is_token_in_rank.empty());
}

// ---------------------------------------------------------------------------------------------------------
// docs/normal-mode.md expert_major
// ---------------------------------------------------------------------------------------------------------

TEST(ReferenceDispatch, ExpertMajorWorkedExample) {
  const Problem p = example();
  const RefDispatch d0 = ref_dispatch(p, 0, Order::expert_major);
  // expert 0: (0,2,1), (1,1,0); expert 1: (0,0,0), (1,1,1)
  EXPECT_EQ(d0.num_recv_rows, 4);
  EXPECT_EQ(d0.num_rows, 4);
  EXPECT_EQ(d0.src_rank, (I32s{0, 1, 0, 1}));
  EXPECT_EQ(d0.src_token, (I32s{2, 1, 0, 1}));
  EXPECT_EQ(d0.src_slot, (I32s{1, 0, 0, 1}));
  EXPECT_EQ(from_dtype(DType::f32, d0.recv_x), (F32s{12, 21, 10, 21}));
  EXPECT_EQ(d0.recv_topk_idx, (I64s{-1, 0, 0, -1, 1, -1, -1, 1}));
  check_equal("weights", d0.recv_topk_weights, F32s{0, 0.375f, 0.25f, 0, 0.5f, 0, 0, 0.625f});
  EXPECT_EQ(d0.cnt, (I64s{2, 2}));
  EXPECT_EQ(d0.list, (I64s{2, 2}));
  EXPECT_EQ(d0.result_list(), (I64s{2, 2}));
  EXPECT_EQ(d0.rows_per_source, (I64s{2, 2}));

  const RefDispatch d1 = ref_dispatch(p, 1, Order::expert_major);
  // expert 2: (0,0,1), (1,0,0); expert 3 (repeated in one row: two adjacent rows): (0,1,0), (0,1,1)
  EXPECT_EQ(d1.src_rank, (I32s{0, 1, 0, 0}));
  EXPECT_EQ(d1.src_token, (I32s{0, 0, 1, 1}));
  EXPECT_EQ(d1.src_slot, (I32s{1, 0, 0, 1}));
  EXPECT_EQ(from_dtype(DType::f32, d1.recv_x), (F32s{10, 20, 11, 11}));
  EXPECT_EQ(d1.recv_topk_idx, (I64s{-1, 0, 0, -1, 1, -1, -1, 1}));
  check_equal("weights", d1.recv_topk_weights, F32s{0, 0.25f, 0.5f, 0, 0.125f, 0, 0, 0.75f});
  EXPECT_EQ(d1.cnt, (I64s{2, 2}));
  EXPECT_EQ(d1.rows_per_source, (I64s{3, 1}));
}

TEST(ReferenceDispatch, ExpertMajorAlignmentPads) {
  const Problem p = example();
  const RefDispatch d0 = ref_dispatch(p, 0, Order::expert_major, 4);
  EXPECT_EQ(d0.num_recv_rows, 8);
  EXPECT_EQ(d0.num_rows, 8);
  EXPECT_EQ(d0.src_rank, (I32s{0, 1, -1, -1, 0, 1, -1, -1}));
  EXPECT_EQ(d0.src_token, (I32s{2, 1, -1, -1, 0, 1, -1, -1}));
  EXPECT_EQ(d0.src_slot, (I32s{1, 0, -1, -1, 0, 1, -1, -1}));
  EXPECT_EQ(from_dtype(DType::f32, d0.recv_x), (F32s{12, 21, 0, 0, 10, 21, 0, 0}));
  EXPECT_EQ(d0.recv_topk_idx, (I64s{-1, 0, 0, -1, -1, -1, -1, -1, 1, -1, -1, 1, -1, -1, -1, -1}));
  for (int i : {2, 3, 6, 7})
    for (int k = 0; k < 2; ++k) EXPECT_EQ(f32_bits(d0.recv_topk_weights[i * 2 + k]), 0u);
  EXPECT_EQ(d0.cnt, (I64s{2, 2}));
  EXPECT_EQ(d0.list, (I64s{4, 4}));
  EXPECT_EQ(d0.rows_per_source, (I64s{2, 2}));  // PAD excluded
  // alignment 3: blocks of 3
  EXPECT_EQ(ref_dispatch(p, 1, Order::expert_major, 3).src_rank, (I32s{0, 1, -1, 0, 0, -1}));
}

// ---------------------------------------------------------------------------------------------------------
// docs/normal-mode.md rank_major
// ---------------------------------------------------------------------------------------------------------

TEST(ReferenceDispatch, RankMajorWorkedExample) {
  const Problem p = example();
  const RefDispatch d0 = ref_dispatch(p, 0, Order::rank_major);
  EXPECT_EQ(d0.src_rank, (I32s{0, 0, 1}));
  EXPECT_EQ(d0.src_token, (I32s{0, 2, 1}));
  EXPECT_EQ(d0.src_slot, (I32s{-1, -1, -1}));
  EXPECT_EQ(from_dtype(DType::f32, d0.recv_x), (F32s{10, 12, 21}));
  EXPECT_EQ(d0.recv_topk_idx, (I64s{1, -1, -1, 0, 0, 1}));
  check_equal("weights", d0.recv_topk_weights, F32s{0.5f, 0, 0, 0.375f, 0.25f, 0.625f});
  EXPECT_EQ(d0.cnt, (I64s{2, 2}));
  EXPECT_EQ(d0.list, (I64s{2, 2}));
  EXPECT_EQ(d0.rows_per_source, (I64s{2, 1}));

  const RefDispatch d1 = ref_dispatch(p, 1, Order::rank_major, 4);  // alignment: list only, no PAD
  EXPECT_EQ(d1.num_recv_rows, 3);
  EXPECT_EQ(d1.src_rank, (I32s{0, 0, 1}));
  EXPECT_EQ(d1.src_token, (I32s{0, 1, 0}));
  EXPECT_EQ(from_dtype(DType::f32, d1.recv_x), (F32s{10, 11, 20}));
  EXPECT_EQ(d1.recv_topk_idx, (I64s{-1, 0, 1, 1, 0, -1}));  // the repeated expert: both slots, one row
  check_equal("weights", d1.recv_topk_weights, F32s{0, 0.25f, 0.125f, 0.75f, 0.5f, 0});
  EXPECT_EQ(d1.cnt, (I64s{2, 2}));
  EXPECT_EQ(d1.list, (I64s{4, 4}));
  EXPECT_EQ(d1.rows_per_source, (I64s{2, 1}));
}

TEST(ReferenceDispatch, RankMajorWithoutTopk) {
  Problem p = example();
  p.spec.topk = false;
  const RefDispatch d1 = ref_dispatch(p, 1, Order::rank_major, 4);
  EXPECT_EQ(d1.src_rank, (I32s{0, 0, 1}));
  EXPECT_EQ(d1.src_token, (I32s{0, 1, 0}));
  EXPECT_TRUE(d1.recv_topk_idx.empty());
  EXPECT_TRUE(d1.recv_topk_weights.empty());
  EXPECT_EQ(d1.cnt, (I64s{2, 2}));  // from num_tokens_per_expert
  EXPECT_EQ(d1.list, (I64s{4, 4}));
  EXPECT_THROW(ref_dispatch(p, 1, Order::expert_major), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------------------
// docs/normal-mode.md worst case, zero tokens
// ---------------------------------------------------------------------------------------------------------

TEST(ReferenceDispatch, WorstCaseTail) {
  const Problem p = example();
  const RefDispatch w = ref_dispatch(p, 0, Order::expert_major, 1, 6);
  EXPECT_FALSE(w.overflow);
  EXPECT_EQ(w.num_recv_rows, 4);
  EXPECT_EQ(w.num_rows, 6);
  EXPECT_EQ(w.src_rank, (I32s{0, 1, 0, 1, -1, -1}));
  EXPECT_EQ(w.src_slot, (I32s{1, 0, 0, 1, -1, -1}));
  EXPECT_EQ(from_dtype(DType::f32, w.recv_x), (F32s{12, 21, 10, 21, 0, 0}));
  EXPECT_EQ(w.recv_topk_idx, (I64s{-1, 0, 0, -1, 1, -1, -1, 1, -1, -1, -1, -1}));
  EXPECT_EQ(w.list, (I64s{2, 2}));
  EXPECT_TRUE(w.result_list().empty());

  const RefDispatch r = ref_dispatch(p, 1, Order::rank_major, 1, 5);
  EXPECT_EQ(r.num_rows, 5);
  EXPECT_EQ(r.src_token, (I32s{0, 1, 0, -1, -1}));
  EXPECT_EQ(r.recv_topk_idx, (I64s{-1, 0, 1, 1, 0, -1, -1, -1, -1, -1}));

  const RefDispatch exact = ref_dispatch(p, 0, Order::expert_major, 1, 4);  // N == worst: fits
  EXPECT_FALSE(exact.overflow);
  EXPECT_EQ(exact.num_rows, 4);
  const RefDispatch over = ref_dispatch(p, 0, Order::expert_major, 1, 3);
  EXPECT_TRUE(over.overflow);
  EXPECT_EQ(over.num_recv_rows, 4);
  EXPECT_TRUE(over.recv_x.empty());
}

TEST(ReferenceDispatch, ZeroTokenRanks) {
  // rank 1 holds no tokens; rank 0's only token goes to rank 0.
  const Problem p = hand_problem(2, 2, 1, 3, DType::bf16, {{0}, {}}, {{0.5f}, {}}, {{1, 2, 3}, {}});
  for (Order order : {Order::expert_major, Order::rank_major}) {
    const RefDispatch d1 = ref_dispatch(p, 1, order, 4);
    EXPECT_EQ(d1.num_rows, 0);
    EXPECT_TRUE(d1.recv_x.empty());
    EXPECT_EQ(d1.list, (I64s{0}));
    EXPECT_EQ(d1.rows_per_source, (I64s{0, 0}));
    const RefDispatch d0 = ref_dispatch(p, 0, order);
    EXPECT_EQ(d0.num_rows, 1);
    EXPECT_EQ(from_dtype(DType::bf16, d0.recv_x), (F32s{1, 2, 3}));
  }
  const Problem empty = hand_problem(1, 2, 2, 5, DType::f16, {{}}, {{}}, {{}});
  const RefDispatch e = ref_dispatch(empty, 0, Order::expert_major, 1, 2);
  EXPECT_EQ(e.num_rows, 2);
  EXPECT_EQ(e.recv_x, Bytes(2 * 5 * 2, 0));
  EXPECT_EQ(e.src_rank, (I32s{-1, -1}));
}

// ---------------------------------------------------------------------------------------------------------
// docs/normal-mode.md cached dispatch
// ---------------------------------------------------------------------------------------------------------

TEST(ReferenceDispatch, CachedPlacement) {
  const Problem p = example();
  // New x of 3 bytes per row: rank s, token t carries {s, t, 0xAB}.
  const std::vector<Bytes> new_x = {{0, 0, 0xAB, 0, 1, 0xAB, 0, 2, 0xAB}, {1, 0, 0xAB, 1, 1, 0xAB}};
  const Bytes em = ref_cached_dispatch(p, 0, Order::expert_major, 4, 10, new_x, 3);
  const Bytes z = {0, 0, 0};
  Bytes want;
  for (const Bytes& row :
       std::vector<Bytes>{{0, 2, 0xAB}, {1, 1, 0xAB}, z, z, {0, 0, 0xAB}, {1, 1, 0xAB}, z, z, z, z})
    want.insert(want.end(), row.begin(), row.end());
  EXPECT_EQ(em, want);
  const Bytes rm = ref_cached_dispatch(p, 1, Order::rank_major, 1, 0, new_x, 3);
  EXPECT_EQ(rm, (Bytes{0, 0, 0xAB, 0, 1, 0xAB, 1, 0, 0xAB}));
  EXPECT_THROW(ref_cached_dispatch(p, 0, Order::expert_major, 1, 3, new_x, 3), std::invalid_argument);
  EXPECT_THROW(ref_cached_dispatch(p, 0, Order::expert_major, 1, 0, new_x, 2), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------------------
// docs/normal-mode.md combine
// ---------------------------------------------------------------------------------------------------------

const float kNaN = f32_from_bits(0x7FC00000);

TEST(ReferenceCombine, ExpertMajorWeightedSum) {
  const Problem p = example();
  // Outputs per row, in the row order of the expert_major worked example (alignment 4, NaN PAD rows):
  //   rank 0: (0,2,1)=3 (1,1,0)=13 PAD PAD (0,0,0)=5 (1,1,1)=17 PAD PAD
  //   rank 1: (0,0,1)=7 (1,0,0)=19 PAD PAD (0,1,0)=9 (0,1,1)=11 PAD PAD
  const std::vector<Bytes> y = {to_dtype(DType::f32, {3, 13, kNaN, kNaN, 5, 17, kNaN, kNaN}),
                                to_dtype(DType::f32, {7, 19, kNaN, kNaN, 9, 11, kNaN, kNaN})};
  const RefCombine c0 = ref_combine(p, 0, Order::expert_major, 4, 0, DType::f32, 1, y, nullptr, nullptr, {});
  // t0: 0.5*5 + 0.25*7; t1: 0.125*9 + 0.75*11; t2: slot 0 is -1, 0.375*3
  EXPECT_EQ(from_dtype(DType::f32, c0.combined_x), (F32s{4.25f, 9.375f, 1.125f}));
  EXPECT_TRUE(c0.has_weights);
  check_equal("w", c0.combined_topk_weights, F32s{0.5f, 0.25f, 0.125f, 0.75f, 0, 0.375f});
  const RefCombine c1 = ref_combine(p, 1, Order::expert_major, 4, 0, DType::f32, 1, y, nullptr, nullptr, {});
  EXPECT_EQ(from_dtype(DType::f32, c1.combined_x), (F32s{9.5f, 13.875f}));  // 0.5*19; 0.25*13 + 0.625*17
  check_equal("w", c1.combined_topk_weights, F32s{0.5f, 0, 0.25f, 0.625f});

  // Bias tensor, then tuple (added in order after the sum).
  const Bytes b0 = to_dtype(DType::f32, {1, 2, 3}), b1 = to_dtype(DType::f32, {0.5f, 0.5f, 0.5f});
  const RefCombine cb =
      ref_combine(p, 0, Order::expert_major, 4, 0, DType::f32, 1, y, nullptr, nullptr, {&b0});
  EXPECT_EQ(from_dtype(DType::f32, cb.combined_x), (F32s{5.25f, 11.375f, 4.125f}));
  const RefCombine ct =
      ref_combine(p, 0, Order::expert_major, 4, 0, DType::f32, 1, y, nullptr, nullptr, {&b0, &b1});
  EXPECT_EQ(from_dtype(DType::f32, ct.combined_x), (F32s{5.75f, 11.875f, 4.625f}));

  // Explicit origin-side weights replace the dispatch weights; a -1 slot still uses +0.
  const F32s explicit_w = {1, 2, 0.5f, 0.5f, 9, 2};
  const RefCombine ce =
      ref_combine(p, 0, Order::expert_major, 4, 0, DType::f32, 1, y, &explicit_w, nullptr, {});
  EXPECT_EQ(from_dtype(DType::f32, ce.combined_x), (F32s{19, 10, 6}));
  check_equal("w", ce.combined_topk_weights, F32s{1, 2, 0.5f, 0.5f, 0, 2});
}

TEST(ReferenceCombine, WorstCaseRowsAndChecks) {
  const Problem p = example();
  const std::vector<Bytes> y = {to_dtype(DType::f32, {3, 13, 5, 17, kNaN, kNaN}),
                                to_dtype(DType::f32, {7, 19, 9, 11, kNaN, kNaN})};
  const RefCombine c = ref_combine(p, 0, Order::expert_major, 1, 6, DType::f32, 1, y, nullptr, nullptr, {});
  EXPECT_EQ(from_dtype(DType::f32, c.combined_x), (F32s{4.25f, 9.375f, 1.125f}));
  EXPECT_NO_THROW(ref_combine(p, 0, Order::expert_major, 1, -1, DType::f32, 1, y, nullptr, nullptr, {}));
  EXPECT_THROW(ref_combine(p, 0, Order::expert_major, 1, 0, DType::f32, 1, y, nullptr, nullptr, {}),
               std::invalid_argument);  // 6 rows where N = 4 was expected
  const F32s bad_w = {1};
  EXPECT_THROW(ref_combine(p, 0, Order::expert_major, 1, 6, DType::f32, 1, y, &bad_w, nullptr, {}),
               std::invalid_argument);
}

TEST(ReferenceCombine, RankMajorSumOfCopies) {
  const Problem p = example();
  // rank 0 rows (0,0) (0,2) (1,1); rank 1 rows (0,0) (0,1) (1,0); a worst-case NaN tail row on rank 1.
  const std::vector<Bytes> y = {to_dtype(DType::f32, {2, 4, 100}), to_dtype(DType::f32, {8, 16, 200, kNaN})};
  const RefCombine c = ref_combine(p, 0, Order::rank_major, 1, -1, DType::f32, 1, y, nullptr, nullptr, {});
  EXPECT_EQ(from_dtype(DType::f32, c.combined_x), (F32s{10, 16, 4}));
  EXPECT_FALSE(c.has_weights);
  EXPECT_TRUE(c.combined_topk_weights.empty());
  const RefCombine c1 = ref_combine(p, 1, Order::rank_major, 1, -1, DType::f32, 1, y, nullptr, nullptr, {});
  EXPECT_EQ(from_dtype(DType::f32, c1.combined_x), (F32s{200, 100}));

  // Feeding back recv_topk_weights returns the original weights bitwise, +0 at -1 slots.
  std::vector<F32s> g;
  for (int d = 0; d < 2; ++d) g.push_back(ref_dispatch(p, d, Order::rank_major).recv_topk_weights);
  const Bytes bias = to_dtype(DType::f32, {1, 1, 1});
  const RefCombine cw = ref_combine(p, 0, Order::rank_major, 1, -1, DType::f32, 1, y, nullptr, &g, {&bias});
  EXPECT_EQ(from_dtype(DType::f32, cw.combined_x), (F32s{11, 17, 5}));
  EXPECT_TRUE(cw.has_weights);
  check_equal("w", cw.combined_topk_weights, F32s{0.5f, 0.25f, 0.125f, 0.75f, 0, 0.375f});
  // Any receiving-side weights: summed over the copies.
  std::vector<F32s> g2 = {{1, 2, 3, 4, 5, 6}, {10, 20, 30, 40, 50, 60}};
  const RefCombine c2 = ref_combine(p, 0, Order::rank_major, 1, -1, DType::f32, 1, y, nullptr, &g2, {});
  check_equal("w", c2.combined_topk_weights, F32s{11, 22, 30, 40, 3, 4});
}

TEST(ReferenceCombine, SingleRoundingBf16) {
  // One rank, one expert, K = 2 (both slots on expert 0), weights 1; outputs chosen to hit bf16 ties.
  const Problem p = hand_problem(1, 1, 2, 1, DType::bf16, {{0, 0, 0, 0, 0, 0, -1, -1, 0, -1}},
                                 {{1, 1, 1, 1, 1, 1, 1, 1, 1, 1}}, {{0, 0, 0, 0, 0}});
  const float e8 = std::ldexp(1.0f, -8);
  // rows: (t0,k0) (t0,k1) (t1,k0) (t1,k1) (t2,k0) (t2,k1) (t4,k0)
  const std::vector<Bytes> y = {to_dtype(DType::bf16, {1, e8, 1, 3 * e8 / 2, 1.0078125f, e8, -0.0f})};
  const RefCombine c = ref_combine(p, 0, Order::expert_major, 1, 0, DType::bf16, 1, y, nullptr, nullptr, {});
  // 1+2^-8: tie -> even 0x3F80; 1+3*2^-9: up 0x3F81; 1+2^-7+2^-8: tie, odd -> up 0x3F82; no slot: +0;
  // a lone -0 contribution: +0 + -0 = +0.
  EXPECT_EQ(u16_of(c.combined_x), (std::vector<uint16_t>{0x3F80, 0x3F81, 0x3F82, 0x0000, 0x0000}));
  // Bias joins before the single rounding: 1 + 2^-8 + 2^-20 is above the tie.
  const Bytes bias = to_dtype(DType::bf16, {std::ldexp(1.0f, -20), 0, 0, 2.5f, 0});
  const RefCombine cb =
      ref_combine(p, 0, Order::expert_major, 1, 0, DType::bf16, 1, y, nullptr, nullptr, {&bias});
  EXPECT_EQ(u16_of(cb.combined_x), (std::vector<uint16_t>{0x3F81, 0x3F81, 0x3F82, 0x4020, 0x0000}));
}

TEST(ReferenceCombine, RoundingF16AndF32) {
  const Problem p = hand_problem(1, 1, 2, 2, DType::f16, {{0, 0, 0, 0}}, {{1, 1, 1, 0.5f}}, {{0, 0, 0, 0}});
  const float e11 = std::ldexp(1.0f, -11);
  // row (t,k), 2 columns each: t0: {1, 1} + {2^-11, 3*2^-12}; t1: {1, 2} + 0.5*{2^-10, 4}
  const std::vector<Bytes> y16 = {to_dtype(DType::f16, {1, 1, e11, 3 * e11 / 2, 1, 2, 2 * e11, 4})};
  const RefCombine c16 =
      ref_combine(p, 0, Order::expert_major, 1, 0, DType::f16, 2, y16, nullptr, nullptr, {});
  EXPECT_EQ(u16_of(c16.combined_x), (std::vector<uint16_t>{0x3C00, 0x3C01, 0x3C00, 0x4400}));
  // f32 combine: no rounding beyond f32; 1 + 2^-11 exactly.
  const std::vector<Bytes> y32 = {to_dtype(DType::f32, {1, 1, e11, 3 * e11 / 2, 1, 2, 2 * e11, 4})};
  const RefCombine c32 =
      ref_combine(p, 0, Order::expert_major, 1, 0, DType::f32, 2, y32, nullptr, nullptr, {});
  EXPECT_EQ(from_dtype(DType::f32, c32.combined_x), (F32s{1 + e11, 1 + 3 * e11 / 2, 1 + e11, 4}));
}

TEST(ReferenceCombine, CanonicalOrderAndNodePartials) {
  // R = 2, E = 2 (one expert per rank), K = 3, f32. Rank 0's token t0 -> experts {0, 1, 1}, t1 -> {1, 1, 0}.
  const Problem p =
      hand_problem(2, 2, 3, 1, DType::f32, {{0, 1, 1, 1, 1, 0}, {}}, {{1, 1, 1, 1, 1, 1}, {}}, {{0, 0}, {}});
  const float e24 = std::ldexp(1.0f, -24);
  // rank 0 rows: (0,0,0) (0,1,2); rank 1 rows: (0,0,1) (0,0,2) (0,1,0) (0,1,1)
  const std::vector<Bytes> y = {to_dtype(DType::f32, {1, 1}), to_dtype(DType::f32, {e24, e24, e24, e24})};
  auto run = [&](int ranks_per_node) {
    return from_dtype(DType::f32, ref_combine(p, 0, Order::expert_major, 1, 0, DType::f32, 1, y, nullptr,
                                              nullptr, {}, ranks_per_node)
                                      .combined_x);
  };
  // One node, slot order: t0 = ((1 + e) + e) = 1; t1 = ((e + e) + 1) = 1 + 2^-23.
  EXPECT_EQ(run(0), (F32s{1, 1 + 2 * e24}));
  EXPECT_EQ(run(2), (F32s{1, 1 + 2 * e24}));
  // Two nodes: t0 = (0 + 1) + (e + e) = 1 + 2^-23.
  EXPECT_EQ(run(1), (F32s{1 + 2 * e24, 1 + 2 * e24}));
}

TEST(ReferenceCombine, RankMajorNodePartials) {
  // R = 4, E = 4, K = 3: rank 0's token -> ranks 0, 2, 3. Copies: 1, e, e.
  const Problem p = hand_problem(4, 4, 3, 1, DType::f32, {{0, 2, 3}, {}, {}, {}}, {{1, 1, 1}, {}, {}, {}},
                                 {{0}, {}, {}, {}});
  const float e24 = std::ldexp(1.0f, -24);
  const std::vector<Bytes> y = {
      to_dtype(DType::f32, {1}), {}, to_dtype(DType::f32, {e24}), to_dtype(DType::f32, {e24})};
  const std::vector<F32s> g = {{1, 0, 0}, {}, {0, e24, 0}, {0, 0, e24}};
  const std::vector<F32s> g_sum = {{1, 0, 0}, {}, {e24, 0, 0}, {e24, 0, 0}};
  auto run = [&](int ranks_per_node, const std::vector<F32s>* weights) {
    return ref_combine(p, 0, Order::rank_major, 1, 0, DType::f32, 1, y, nullptr, weights, {}, ranks_per_node);
  };
  EXPECT_EQ(from_dtype(DType::f32, run(0, &g).combined_x), (F32s{1}));            // (1 + e) + e
  EXPECT_EQ(from_dtype(DType::f32, run(1, &g).combined_x), (F32s{1}));            // same order, one per node
  EXPECT_EQ(from_dtype(DType::f32, run(2, &g).combined_x), (F32s{1 + 2 * e24}));  // 1 + (e + e)
  check_equal("w", run(2, &g).combined_topk_weights, F32s{1, e24, e24});
  check_equal("w", run(0, &g_sum).combined_topk_weights, F32s{1, 0, 0});
  check_equal("w", run(2, &g_sum).combined_topk_weights, F32s{1 + 2 * e24, 0, 0});
}

// ---------------------------------------------------------------------------------------------------------
// Generator
// ---------------------------------------------------------------------------------------------------------

ProblemSpec spec_of(int R, int E, int K, int64_t H, uint64_t seed) {
  ProblemSpec s;
  s.num_ranks = R;
  s.num_experts = E;
  s.num_topk = K;
  s.hidden = H;
  s.seed = seed;
  return s;
}

TEST(ReferenceProblem, DeterministicAndShaped) {
  ProblemSpec spec = spec_of(4, 16, 4, 37, 123);
  spec.neg_prob = 0.3;
  spec.dup_prob = 0.3;
  const Problem a = make_problem(spec), b = make_problem(spec);
  spec.seed = 124;
  const Problem c = make_problem(spec);
  bool differs = false;
  int negatives = 0, repeats = 0;
  for (int s = 0; s < 4; ++s) {
    const RankInputs& in = a.ranks[s];
    EXPECT_EQ(in.topk_idx, b.ranks[s].topk_idx);
    EXPECT_EQ(in.x, b.ranks[s].x);
    check_equal("weights", in.topk_weights, b.ranks[s].topk_weights);
    differs = differs || in.topk_idx != c.ranks[s].topk_idx;
    EXPECT_GE(in.num_tokens, 0);
    EXPECT_LE(in.num_tokens, 64);
    EXPECT_EQ(in.x.size(), static_cast<size_t>(in.num_tokens * 37 * 2));
    for (int64_t t = 0; t < in.num_tokens; ++t) {
      std::set<int64_t> seen;
      for (int k = 0; k < 4; ++k) {
        const int64_t v = in.topk_idx[t * 4 + k];
        EXPECT_TRUE(v >= -1 && v < 16);
        if (v < 0) ++negatives;
        if (v >= 0 && !seen.insert(v).second) ++repeats;
        const float w = in.topk_weights[t * 4 + k];
        EXPECT_TRUE(w > 0 && w < 1);
        const double scaled = std::ldexp(static_cast<double>(w), 25);
        EXPECT_EQ(std::fmod(scaled, 2.0), 1.0);  // odd multiple of 2^-25
      }
      const std::optional<RowTag> tag = decode_row_tag(in.x.data() + t * a.row_bytes(), 37, DType::bf16);
      ASSERT_TRUE(tag.has_value());
      EXPECT_EQ(tag->rank, s);
      EXPECT_EQ(tag->token, t);
    }
  }
  EXPECT_TRUE(differs);
  EXPECT_GT(negatives, 0);
  EXPECT_GT(repeats, 0);
}

TEST(ReferenceProblem, RoutingModesAndOverrides) {
  ProblemSpec spec = spec_of(4, 8, 3, 4, 7);
  spec.tokens_override = {0, 5, 200, 1};
  spec.routing = ProblemSpec::Routing::skewed_one_rank;
  spec.skew_rank = 2;
  const Problem skew = make_problem(spec);
  for (int s = 0; s < 4; ++s) {
    EXPECT_EQ(skew.ranks[s].num_tokens, spec.tokens_override[s]);
    for (int64_t v : skew.ranks[s].topk_idx) EXPECT_TRUE(v == -1 || v / 2 == 2);
  }
  EXPECT_EQ(ref_dispatch(skew, 0, Order::rank_major).num_rows, 0);
  spec.routing = ProblemSpec::Routing::all_empty;
  const Problem empty = make_problem(spec);
  for (int s = 0; s < 4; ++s)
    for (int64_t v : empty.ranks[s].topk_idx) EXPECT_EQ(v, -1);
  spec.num_experts = 6;  // not a multiple of R
  EXPECT_THROW(make_problem(spec), std::invalid_argument);
}

TEST(ReferenceProblem, TagsAndRandomBits) {
  for (DType dtype : {DType::bf16, DType::f16, DType::f32}) {
    for (int64_t H : {1, 2, 3, 4, 9}) {
      const int64_t t = H >= 4 ? 1234567 : (H >= 2 ? 100 : 0);
      Bytes row(H * elem_size(dtype));
      write_tagged_row(126, t, H, dtype, row.data());
      const std::optional<RowTag> tag = decode_row_tag(row.data(), H, dtype);
      ASSERT_TRUE(tag.has_value());
      EXPECT_EQ(tag->rank, 126);
      EXPECT_EQ(tag->token, t);
      if (H > 4) {
        row[row.size() - 1] ^= 0x40;  // corrupt the last column
        EXPECT_FALSE(decode_row_tag(row.data(), H, dtype).has_value());
      }
      EXPECT_FALSE(decode_row_tag(Bytes(row.size(), 0).data(), H, dtype).has_value());
    }
  }
  const Bytes bits = make_payload(1, 64, 64, DType::bf16, true, 99);
  std::set<uint16_t> seen;
  for (uint16_t v : u16_of(bits)) seen.insert(v);
  for (uint16_t special : {0x7FC0, 0xFFC1, 0x7F81, 0x8000, 0x0001, 0x807F, 0x7F80, 0xFF80})
    EXPECT_TRUE(seen.count(special)) << std::hex << special;
  EXPECT_EQ(bits, make_payload(1, 64, 64, DType::bf16, true, 99));
  EXPECT_NE(bits, make_payload(2, 64, 64, DType::bf16, true, 99));
}

TEST(ReferenceProblem, ExpertOutputs) {
  const I32s src_rank = {0, -1, 1}, src_token = {3, -1, 3}, src_slot = {1, -1, 1};
  for (DType dtype : {DType::bf16, DType::f16, DType::f32}) {
    const Bytes y = make_expert_output(5, src_rank, src_token, src_slot, dtype, 6);
    const F32s v = from_dtype(dtype, y);
    for (int h = 0; h < 6; ++h) {
      EXPECT_TRUE(std::isnan(v[6 + h]));  // PAD row
      EXPECT_GE(std::fabs(v[h]), 0.125f);
      EXPECT_LE(std::fabs(v[h]), 8.0f);
      EXPECT_EQ(v[h], expert_output_value(5, 0, 3, 1, h, dtype));
    }
    EXPECT_NE(Bytes(y.begin(), y.begin() + 6 * elem_size(dtype)),
              Bytes(y.begin() + 12 * elem_size(dtype), y.end()));
  }
}

// ---------------------------------------------------------------------------------------------------------
// Generated problems: invariants of the oracle across R, E, K, H
// ---------------------------------------------------------------------------------------------------------

struct Dims {
  int R, E, K;
  int64_t H;
};
void PrintTo(const Dims& d, std::ostream* os) {
  *os << "R" << d.R << "E" << d.E << "K" << d.K << "H" << d.H;
}

class ReferenceInvariants : public ::testing::TestWithParam<Dims> {};

TEST_P(ReferenceInvariants, DispatchConservesAndTagsMatch) {
  const Dims sh = GetParam();
  ProblemSpec spec = spec_of(sh.R, sh.E, sh.K, sh.H, 1000 + sh.R * 7 + sh.K);
  spec.max_tokens = 40;
  spec.dup_prob = 0.2;
  const Problem p = make_problem(spec);
  const int L = sh.E / sh.R;
  int64_t valid_pairs = 0, token_rank_pairs = 0;
  for (int s = 0; s < sh.R; ++s) {
    const RefLayout l = ref_layout(p, s);
    for (int32_t v : l.num_tokens_per_expert) valid_pairs += v;
    for (int32_t v : l.num_tokens_per_rank) token_rank_pairs += v;
  }
  int64_t em_pairs = 0, rm_rows = 0;
  for (int d = 0; d < sh.R; ++d) {
    for (int64_t align : {1, 4}) {
      const RefDispatch em = ref_dispatch(p, d, Order::expert_major, align);
      int64_t sum_list = 0, start = 0;
      for (int j = 0; j < L; ++j) {
        EXPECT_EQ(start % align, 0);
        for (int64_t i = start; i < start + em.cnt[j]; ++i) {
          const int32_t s = em.src_rank[i];
          ASSERT_GE(s, 0);
          EXPECT_EQ(p.ranks[s].topk_idx[em.src_token[i] * sh.K + em.src_slot[i]], int64_t{d} * L + j);
          EXPECT_EQ(em.recv_topk_idx[i * sh.K + em.src_slot[i]], j);
        }
        for (int64_t i = start + em.cnt[j]; i < start + em.list[j]; ++i) EXPECT_EQ(em.src_rank[i], -1);
        start += em.list[j];
        sum_list += em.list[j];
      }
      EXPECT_EQ(sum_list, em.num_rows);
      if (align == 1)
        for (int64_t c : em.cnt) em_pairs += c;
      for (int64_t i = 0; i < em.num_rows; ++i) {
        const std::optional<RowTag> tag =
            decode_row_tag(em.recv_x.data() + i * p.row_bytes(), sh.H, spec.dtype);
        if (em.src_rank[i] < 0) {
          EXPECT_FALSE(tag.has_value());
          continue;
        }
        if (sh.H >= 2) {
          ASSERT_TRUE(tag.has_value());
          EXPECT_EQ(tag->rank, em.src_rank[i]);
          EXPECT_EQ(tag->token, em.src_token[i]);
        }
      }
    }
    const RefDispatch rm = ref_dispatch(p, d, Order::rank_major);
    rm_rows += rm.num_rows;
    const RefDispatch placement = ref_dispatch_placement(p, d, Order::rank_major);
    EXPECT_EQ(placement.src_rank, rm.src_rank);
    EXPECT_EQ(placement.src_token, rm.src_token);
    EXPECT_EQ(placement.src_slot, rm.src_slot);
    EXPECT_EQ(placement.list, rm.list);
    EXPECT_TRUE(placement.recv_x.empty());
    for (int s = 0; s < sh.R; ++s) EXPECT_EQ(rm.rows_per_source[s], ref_layout(p, s).num_tokens_per_rank[d]);
    // Worst-case prefix equals the exact result; the tail is empty.
    const RefDispatch w = ref_dispatch(p, d, Order::rank_major, 1, rm.num_rows + 3);
    EXPECT_EQ(Bytes(w.recv_x.begin(), w.recv_x.begin() + rm.recv_x.size()), rm.recv_x);
    EXPECT_EQ(Bytes(w.recv_x.begin() + rm.recv_x.size(), w.recv_x.end()), Bytes(3 * p.row_bytes(), 0));
    EXPECT_EQ(I64s(w.recv_topk_idx.begin(), w.recv_topk_idx.begin() + rm.recv_topk_idx.size()),
              rm.recv_topk_idx);
  }
  EXPECT_EQ(em_pairs, valid_pairs);
  EXPECT_EQ(rm_rows, token_rank_pairs);
}

TEST_P(ReferenceInvariants, CombineIdentities) {
  const Dims sh = GetParam();
  ProblemSpec spec = spec_of(sh.R, sh.E, sh.K, sh.H, 2000 + sh.R * 7 + sh.K);
  spec.max_tokens = 24;
  const Problem p = make_problem(spec);
  const int P = sh.R % 2 == 0 ? 2 : 0;
  std::vector<Bytes> em_x, rm_x;
  std::vector<F32s> rm_w;
  for (int d = 0; d < sh.R; ++d) {
    em_x.push_back(ref_dispatch(p, d, Order::expert_major, 4).recv_x);
    const RefDispatch rm = ref_dispatch(p, d, Order::rank_major);
    rm_x.push_back(rm.recv_x);
    rm_w.push_back(rm.recv_topk_weights);
  }
  for (int r = 0; r < sh.R; ++r) {
    const RankInputs& in = p.ranks[r];
    const RefLayout l = ref_layout(p, r);
    // rank_major: recv_x fed back = round(x * #destinations), since equal f32 addends sum exactly here.
    const RefCombine rm =
        ref_combine(p, r, Order::rank_major, 1, 0, DType::bf16, sh.H, rm_x, nullptr, &rm_w, {}, P);
    for (int64_t t = 0; t < in.num_tokens; ++t) {
      int copies = 0;
      for (int d = 0; d < sh.R; ++d) copies += l.is_token_in_rank[t * sh.R + d];
      for (int64_t h = 0; h < sh.H; ++h) {
        const float x = load_f32(DType::bf16, in.x.data(), t * sh.H + h);
        const float want = copies == 0 ? 0.0f : x * static_cast<float>(copies);  // no copy: +0, never -0
        EXPECT_EQ(f32_to_bf16(want), f32_to_bf16(load_f32(DType::bf16, rm.combined_x.data(), t * sh.H + h)));
      }
      for (int k = 0; k < sh.K; ++k) {
        const float want = in.topk_idx[t * sh.K + k] >= 0 ? in.topk_weights[t * sh.K + k] : 0.0f;
        EXPECT_EQ(f32_bits(rm.combined_topk_weights[t * sh.K + k]), f32_bits(want));
      }
    }
    // expert_major: recv_x fed back ~ x * sum(valid w) (bf16 rounding of a few f32 products).
    const RefCombine em =
        ref_combine(p, r, Order::expert_major, 4, 0, DType::bf16, sh.H, em_x, nullptr, nullptr, {}, P);
    for (int64_t t = 0; t < in.num_tokens; ++t) {
      float wsum = 0;
      for (int k = 0; k < sh.K; ++k)
        if (in.topk_idx[t * sh.K + k] >= 0) wsum += in.topk_weights[t * sh.K + k];
      for (int64_t h = 0; h < sh.H; ++h) {
        const float x = load_f32(DType::bf16, in.x.data(), t * sh.H + h);
        const float got = load_f32(DType::bf16, em.combined_x.data(), t * sh.H + h);
        EXPECT_NEAR(got, x * wsum, std::fabs(x * wsum) * 0.01f + 1e-6f);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, ReferenceInvariants,
                         ::testing::Values(Dims{1, 4, 2, 8}, Dims{2, 8, 4, 13}, Dims{3, 6, 3, 1},
                                           Dims{4, 16, 8, 32}, Dims{8, 32, 6, 7}),
                         [](const ::testing::TestParamInfo<Dims>& info) {
                           return "R" + std::to_string(info.param.R) + "E" + std::to_string(info.param.E) +
                                  "K" + std::to_string(info.param.K) + "H" + std::to_string(info.param.H);
                         });

// ---------------------------------------------------------------------------------------------------------
// check.h
// ---------------------------------------------------------------------------------------------------------

TEST(ReferenceCheck, MessagesNameTheFirstDifference) {
  Bytes a(3 * 4 * 2), b;
  for (int t = 0; t < 3; ++t) write_tagged_row(1, t, 4, DType::bf16, a.data() + t * 8);
  b = a;
  write_tagged_row(0, 9, 4, DType::bf16, b.data() + 8);
  EXPECT_NO_THROW(check_rows_equal("x", a, a, 8, DType::bf16));
  try {
    check_rows_equal("recv_x", a, b, 8, DType::bf16);
    FAIL();
  } catch (const std::runtime_error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("recv_x: row 1, column 0 (byte 0 of 8): actual 0x4000, expected 0x3f80"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("actual row (s=1, t=1), expected row (s=0, t=9)"), std::string::npos) << m;
  }
  EXPECT_THROW(check_rows_equal("x", a, Bytes(8), 8, DType::bf16), std::runtime_error);
  try {
    check_equal("idx", I64s{1, 2, 3, 4}, I64s{1, 2, 3, -1}, 2);
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()), "idx[1, 1]: actual 4, expected -1");
  }
  EXPECT_THROW(check_equal("w", F32s{0.0f}, F32s{-0.0f}), std::runtime_error);  // bitwise
  EXPECT_NO_THROW(check_equal("w", F32s{kNaN}, F32s{kNaN}));
  EXPECT_THROW(check_scalar("n", int64_t{3}, int64_t{4}), std::runtime_error);
}

}  // namespace
}  // namespace epcomm::testing

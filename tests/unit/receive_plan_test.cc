// The receive plan of one rank (routing::plan_receive), checked against hand-computed layouts: the packed
// expert_major layout and the low-latency layout with fixed expert blocks (docs/low-latency.md).
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "routing/layout.h"

namespace epcomm::routing {
namespace {

// Two ranks, four experts (L = 2). pairs[s][e]: source s's pairs per expert; tokens[s][d]: its tokens per
// rank.
struct TwoRanks {
  std::vector<int32_t> pairs0{2, 1, 0, 3}, pairs1{1, 0, 2, 2};
  std::vector<int32_t> tokens0{3, 3}, tokens1{1, 3};
  ExpertMap map{4, 2, 2};
  ReceivePlan plan(int d, int64_t block_rows, int64_t alignment = 1) const {
    return plan_receive(d, ReceiveOrder::expert_major, map, alignment, {pairs0.data(), pairs1.data()},
                        {tokens0.data(), tokens1.data()}, block_rows);
  }
};

TEST(ReceivePlan, PackedExpertMajor) {
  const ReceivePlan p = TwoRanks{}.plan(1, 0);
  // Rank 1 hosts experts 2 and 3: expert 2 gets 0 + 2 pairs, expert 3 gets 3 + 2.
  EXPECT_EQ(p.cnt, (std::vector<int64_t>{2, 5}));
  EXPECT_EQ(p.num_recv_rows, 7);
  // start[s * L + j]: expert 2 from source 0 at 0, from source 1 at 0; expert 3 from source 0 at 2, source 1
  // at 5.
  EXPECT_EQ(p.start, (std::vector<int64_t>{0, 2, 0, 5}));
  EXPECT_EQ(p.rows_per_source, (std::vector<int64_t>{3, 4}));
}

TEST(ReceivePlan, LowLatencyBlocksStartAtMultiplesOfTheBlock) {
  const ReceivePlan p = TwoRanks{}.plan(0, 8);
  // Rank 0 hosts experts 0 and 1: expert 0 gets 2 + 1 pairs, expert 1 gets 1 + 0.
  EXPECT_EQ(p.cnt, (std::vector<int64_t>{3, 1}));
  EXPECT_EQ(p.num_recv_rows, 16);  // L * block_rows, whatever the counts
  EXPECT_EQ(p.start, (std::vector<int64_t>{0, 8, 2, 9}));
  EXPECT_EQ(p.pad_begin, (std::vector<int64_t>{3, 9}));
  EXPECT_EQ(p.block_end, (std::vector<int64_t>{8, 16}));
  EXPECT_EQ(p.rows_per_source, (std::vector<int64_t>{3, 1}));
}

TEST(ReceivePlan, LowLatencyBlocksIgnoreAlignmentPadding) {
  // The block size alone places the blocks; the aligned list still reports align_up(cnt).
  const ReceivePlan p = TwoRanks{}.plan(1, 6, 4);
  EXPECT_EQ(p.start, (std::vector<int64_t>{0, 6, 0, 9}));
  EXPECT_EQ(p.list, (std::vector<int64_t>{4, 8}));
  EXPECT_EQ(p.num_recv_rows, 12);
}

// The plan of random counts against a row-by-row model written from docs/normal-mode.md and
// docs/low-latency.md: expert_major places expert j's rows from source 0, 1, ... in turn, then its PAD rows
// up to the aligned list (packed) or to the end of its block of block_rows (low latency); rank_major places
// source s's tokens after those of the sources before it.
ReceivePlan model_plan(int d, ReceiveOrder order, int R, int L, int64_t alignment, int64_t block_rows,
                       const std::vector<std::vector<int32_t>>& pairs,
                       const std::vector<std::vector<int32_t>>& tokens) {
  ReceivePlan m;
  m.cnt.assign(L, 0);
  m.rows_per_source.assign(R, 0);
  for (int j = 0; j < L; ++j)
    for (int s = 0; s < R; ++s) m.cnt[j] += pairs[s][d * L + j];
  for (int j = 0; j < L; ++j) m.list.push_back((m.cnt[j] + alignment - 1) / alignment * alignment);
  int64_t row = 0;
  if (order == ReceiveOrder::rank_major) {
    for (int s = 0; s < R; ++s) {
      m.start.push_back(row);
      m.rows_per_source[s] = tokens[s][d];
      row += tokens[s][d];
    }
    m.num_recv_rows = row;
    return m;
  }
  m.start.assign(static_cast<size_t>(R) * L, -1);
  for (int j = 0; j < L; ++j) {
    const int64_t first = block_rows > 0 ? j * block_rows : row;
    row = first;
    for (int s = 0; s < R; ++s) {
      m.start[static_cast<size_t>(s) * L + j] = row;
      for (int i = 0; i < pairs[s][d * L + j]; ++i, ++row) ++m.rows_per_source[s];
    }
    m.pad_begin.push_back(row);
    row = block_rows > 0 ? first + block_rows : first + m.list[j];
    m.block_end.push_back(row);
  }
  m.num_recv_rows = row;
  return m;
}

TEST(ReceivePlan, RandomCountsMatchTheRowByRowModel) {
  std::mt19937 rng(7);
  ReceivePlan
      reused;  // filled again for every receiver of every trial: nothing of an earlier plan may remain
  for (int trial = 0; trial < 300; ++trial) {
    const int R = 1 + static_cast<int>(rng() % 9), L = 1 + static_cast<int>(rng() % 40);
    const int64_t alignment = 1 + static_cast<int64_t>(rng() % 4) * (rng() % 2 ? 1 : 16);
    const ReceiveOrder order = rng() % 3 ? ReceiveOrder::expert_major : ReceiveOrder::rank_major;
    std::vector<std::vector<int32_t>> pairs(R, std::vector<int32_t>(static_cast<size_t>(R) * L)),
        tokens(R, std::vector<int32_t>(R));
    int32_t most = 0;
    for (auto& v : pairs)
      for (int32_t& c : v) most = std::max(most, c = rng() % 4 ? 0 : static_cast<int32_t>(rng() % 5));
    for (auto& v : tokens)
      for (int32_t& c : v) c = static_cast<int32_t>(rng() % 6);
    // Low-latency blocks hold every source's pairs of an expert.
    const int64_t block_rows = order == ReceiveOrder::expert_major && rng() % 2 ? R * (most + 1) : 0;
    std::vector<const int32_t*> pp, tt;
    for (int s = 0; s < R; ++s) {
      pp.push_back(pairs[s].data());
      tt.push_back(tokens[s].data());
    }
    const ExpertMap map{R * L, R, L};
    for (int d = 0; d < R; ++d) {
      SCOPED_TRACE(::testing::Message() << "trial " << trial << " R " << R << " L " << L << " d " << d);
      const ReceivePlan m = model_plan(d, order, R, L, alignment, block_rows, pairs, tokens);
      auto expect_model = [&](const ReceivePlan& p) {
        EXPECT_EQ(p.order, order);
        EXPECT_EQ(p.cnt, m.cnt);
        EXPECT_EQ(p.list, m.list);
        EXPECT_EQ(p.start, m.start);
        EXPECT_EQ(p.pad_begin, m.pad_begin);
        EXPECT_EQ(p.block_end, m.block_end);
        EXPECT_EQ(p.rows_per_source, m.rows_per_source);
        EXPECT_EQ(p.num_recv_rows, m.num_recv_rows);
      };
      expect_model(plan_receive(d, order, map, alignment, pp, tt, block_rows));
      plan_receive(reused, d, order, map, alignment, pp, tt, block_rows);
      expect_model(reused);
    }
  }
}

}  // namespace
}  // namespace epcomm::routing

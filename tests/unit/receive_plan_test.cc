// The receive plan of one rank (routing::plan_receive), checked against hand-computed layouts: the packed
// expert_major layout and the low-latency layout with fixed expert blocks (docs/low-latency.md).
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace epcomm::routing

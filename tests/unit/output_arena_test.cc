// unit/output_arena_test.cc — the output arena's allocator: page-granular best fit, coalescing, the cache of
// freed pages and its limit, reserve, and blocks keeping the arena alive.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "tensor/output_arena.h"

namespace epcomm {
namespace {

constexpr size_t kPage = OutputArena::kPage;

// An arena over a fresh shared mapping (shmem, as the transport's memfd), which it takes over.
std::shared_ptr<OutputArena> make_arena(size_t bytes, size_t cache_limit) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  EXPECT_NE(p, MAP_FAILED);
  return std::make_shared<OutputArena>(static_cast<uint8_t*>(p), bytes, cache_limit);
}

size_t resident_pages(const void* p, size_t bytes) {
  std::vector<unsigned char> v(bytes / kPage);
  EXPECT_EQ(mincore(const_cast<void*>(p), bytes, v.data()), 0);
  size_t n = 0;
  for (unsigned char c : v) n += c & 1;
  return n;
}

int64_t offset(const OutputArena& a, const Tensor& t) {
  return a.offset_of(t.data(), t.nbytes());
}

TEST(OutputArena, BlocksArePagesInsideTheArenaAndDistinct) {
  auto a = make_arena(64 * kPage, 64 * kPage);
  Tensor x = a->allocate(DType::bf16, {3, 7});  // 42 bytes: one page
  Tensor y = a->allocate(DType::f32, {1025});   // 4100 bytes: two pages
  Tensor z = a->allocate(DType::u8, {0});       // empty: still one page, a valid pointer
  ASSERT_TRUE(x.defined() && y.defined() && z.defined());
  EXPECT_EQ(offset(*a, x), 0);
  EXPECT_EQ(offset(*a, y), static_cast<int64_t>(kPage));
  EXPECT_EQ(offset(*a, z), static_cast<int64_t>(3 * kPage));
  EXPECT_EQ(x.shape(), (Shape{3, 7}));
  EXPECT_EQ(a->live_bytes(), 4 * kPage);
  std::memset(y.data(), 7, y.nbytes());
  EXPECT_EQ(a->offset_of(nullptr, 1), -1);
  EXPECT_EQ(a->offset_of(a->base() + 64 * kPage - 8, 16), -1);  // runs past the end
}

TEST(OutputArena, FreedBlocksComeBackBestFitAndCoalesce) {
  auto a = make_arena(64 * kPage, 64 * kPage);
  Tensor p = a->allocate(DType::u8, {2 * kPage});
  Tensor q = a->allocate(DType::u8, {kPage});
  Tensor r = a->allocate(DType::u8, {3 * kPage});
  Tensor s = a->allocate(DType::u8, {kPage});  // keeps r's neighbour busy
  const int64_t p_at = offset(*a, p), r_at = offset(*a, r);
  r = Tensor();
  p = Tensor();
  EXPECT_EQ(a->cached_bytes(), 5 * kPage);
  // Best fit: a two-page request takes p's range (exactly two), not r's three.
  Tensor t = a->allocate(DType::u8, {2 * kPage});
  EXPECT_EQ(offset(*a, t), p_at);
  t = Tensor();
  q = Tensor();  // p, q and r's ranges are now one free range of six pages
  Tensor u = a->allocate(DType::u8, {6 * kPage});
  EXPECT_EQ(offset(*a, u), p_at);
  EXPECT_LT(p_at, r_at);
  EXPECT_EQ(a->cached_bytes(), 0u);
}

// Thousands of allocations and releases of 1-9 pages in a random order (the free lists reuse their tree
// nodes): live blocks never overlap and the bookkeeping adds up at every step. Frees everything at the end.
void allocate_and_free_at_random(OutputArena& a, size_t pages_in_arena) {
  std::vector<Tensor> live;
  std::vector<uint8_t> used(pages_in_arena, 0);
  uint64_t state = 12345;
  auto next = [&] { return (state = state * 6364136223846793005ull + 1442695040888963407ull) >> 33; };
  auto mark = [&](const Tensor& t, uint8_t v) {
    const size_t first = static_cast<size_t>(offset(a, t)) / kPage;
    for (size_t i = first; i < first + t.nbytes() / kPage; ++i) {
      if (v) ASSERT_EQ(used[i], 0) << "page " << i << " handed out twice";
      used[i] = v;
    }
  };
  size_t live_pages = 0;
  for (int step = 0; step < 4000; ++step) {
    if (live.size() < 40 && (live.empty() || next() % 3 != 0)) {
      const int64_t pages = 1 + static_cast<int64_t>(next() % 9);
      Tensor t = a.allocate(DType::u8, {pages * static_cast<int64_t>(kPage)});
      if (!t.defined()) continue;  // fragmented: no free range of that size now
      live.push_back(t);
      mark(t, 1);
      live_pages += static_cast<size_t>(pages);
    } else {
      const size_t i = next() % live.size();
      mark(live[i], 0);
      live_pages -= live[i].nbytes() / kPage;
      live[i] = live.back();
      live.pop_back();
    }
    ASSERT_EQ(a.live_bytes(), live_pages * kPage) << "step " << step;
  }
  live.clear();
  EXPECT_EQ(a.live_bytes(), 0u);
}

TEST(OutputArena, RandomAllocationsCoalesceBackIntoTheirFreeLists) {
  // Every freed block keeps its pages (cache limit = the arena). Blocks are carved from the front of the
  // never-used range, so the pages ever used are a prefix [0, k): freed, they are one kept range again, and
  // the rest of the arena is the other.
  constexpr size_t kPages = 256;
  auto a = make_arena(kPages * kPage, kPages * kPage);
  allocate_and_free_at_random(*a, kPages);
  const size_t kept = a->cached_bytes();
  ASSERT_GT(kept, 0u);
  Tensor front = a->allocate(DType::u8, {static_cast<int64_t>(kept)});
  ASSERT_TRUE(front.defined()) << "the kept ranges did not coalesce into one of " << kept << " bytes";
  EXPECT_EQ(offset(*a, front), 0);
  Tensor rest = a->allocate(DType::u8, {static_cast<int64_t>(kPages * kPage - kept)});
  ASSERT_TRUE(rest.defined());
  EXPECT_EQ(offset(*a, rest), static_cast<int64_t>(kept));
}

TEST(OutputArena, RandomAllocationsBeyondTheCacheLimitStayDistinct) {
  // A small cache limit: most freed blocks go back to the system and to the other free list.
  constexpr size_t kPages = 256;
  auto a = make_arena(kPages * kPage, 16 * kPage);
  allocate_and_free_at_random(*a, kPages);
  EXPECT_LE(a->cached_bytes(), 16 * kPage);
}

TEST(OutputArena, FreedPagesBeyondTheCacheLimitGoBackToTheSystem) {
  auto a = make_arena(64 * kPage, 4 * kPage);
  Tensor x = a->allocate(DType::u8, {4 * kPage});
  Tensor y = a->allocate(DType::u8, {8 * kPage});
  std::memset(x.data(), 1, x.nbytes());
  std::memset(y.data(), 1, y.nbytes());
  uint8_t* yp = static_cast<uint8_t*>(y.data());
  EXPECT_EQ(resident_pages(yp, 8 * kPage), 8u);
  x = Tensor();  // fits the cache: keeps its pages
  EXPECT_EQ(a->cached_bytes(), 4 * kPage);
  y = Tensor();  // beyond it: removed
  EXPECT_EQ(a->cached_bytes(), 4 * kPage);
  EXPECT_EQ(resident_pages(yp, 8 * kPage), 0u);
  EXPECT_EQ(a->live_bytes(), 0u);
  // The cached range is preferred over the returned one.
  Tensor z = a->allocate(DType::u8, {4 * kPage});
  EXPECT_EQ(offset(*a, z), 0);
}

TEST(OutputArena, FullArenaReturnsAnUndefinedTensor) {
  auto a = make_arena(8 * kPage, 8 * kPage);
  Tensor x = a->allocate(DType::u8, {6 * kPage});
  EXPECT_TRUE(x.defined());
  EXPECT_FALSE(a->allocate(DType::u8, {3 * kPage}).defined());
  EXPECT_TRUE(a->allocate(DType::u8, {2 * kPage}).defined());
}

TEST(OutputArena, ReserveWritesPagesThroughAndKeepsThem) {
  auto a = make_arena(64 * kPage, kPage);  // the reserve is kept whatever the cache limit
  EXPECT_EQ(a->reserve(10 * kPage - 5), 0);
  EXPECT_EQ(resident_pages(a->base(), 10 * kPage), 10u);
  EXPECT_EQ(a->cached_bytes(), 10 * kPage);
  Tensor x = a->allocate(DType::u8, {10 * kPage});
  EXPECT_EQ(offset(*a, x), 0);
  EXPECT_EQ(a->reserve(100 * kPage), -1);  // does not fit
}

TEST(OutputArena, BlocksKeepTheArenaAlive) {
  auto a = make_arena(16 * kPage, 16 * kPage);
  Tensor x = a->allocate(DType::u8, {kPage});
  std::weak_ptr<OutputArena> w = a;
  a.reset();
  EXPECT_FALSE(w.expired());
  std::memset(x.data(), 3, x.nbytes());  // still mapped
  x = Tensor();
  EXPECT_TRUE(w.expired());
}

}  // namespace
}  // namespace epcomm

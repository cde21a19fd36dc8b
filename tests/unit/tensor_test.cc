// unit/tensor_test.cc — Tensor bookkeeping: contiguity, sizes, the default allocator.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cstring>
#include <vector>

#include "epcomm/tensor.h"

namespace epcomm {

TEST(Tensor, ContiguityFollowsStrides) {
  float buf[12];
  EXPECT_TRUE(Tensor::wrap(buf, DType::f32, {3, 4}).is_contiguous());
  EXPECT_FALSE(Tensor::wrap(buf, DType::f32, {3, 4}, {1, 3}).is_contiguous());  // column-major
  EXPECT_TRUE(Tensor::wrap(buf, DType::f32, {1, 4}, {99, 1}).is_contiguous());  // size-1 dims are free
}

TEST(Tensor, EmptyTensorsAreContiguousWhateverTheirStrides) {
  // torch hands out [0, K] tensors with arbitrary strides and a null data pointer.
  Tensor t = Tensor::wrap(nullptr, DType::f32, {0, 8}, {1, 0});
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.numel(), 0);
  EXPECT_EQ(t.nbytes(), 0u);
}

TEST(Tensor, DefaultAllocatorAlignsAndRecyclesLargeBlocks) {
  Tensor a = empty(DType::bf16, {4096, 7168});  // 56 MiB: a recycled huge-page block
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % 64, 0u);
  void* p = a.data();
  a = Tensor();
  Tensor b = empty(DType::bf16, {4096, 7168});
  EXPECT_EQ(b.data(), p);  // the freed block came back
  Tensor c = empty(DType::u8, {3});
  EXPECT_EQ(reinterpret_cast<uintptr_t>(c.data()) % 64, 0u);
}

// Pages of [p, p + bytes) resident in memory (mincore; p page-aligned).
size_t resident_pages(const void* p, size_t bytes) {
  std::vector<unsigned char> v(bytes / 4096);
  EXPECT_EQ(mincore(const_cast<void*>(p), bytes, v.data()), 0);
  size_t n = 0;
  for (unsigned char c : v) n += c & 1;
  return n;
}

constexpr int64_t kMiB = 1 << 20;

TEST(CachingAllocator, TakesTheSmallestCachedBlockThatFitsAndKeepsTheRest) {
  auto alloc = detail::make_caching_allocator(size_t{1} << 30);
  Tensor a = alloc->allocate(DType::u8, {10 * kMiB});
  uint8_t* p = a.data_as<uint8_t>();
  std::memset(p, 0x5A, 10 * kMiB);
  a = Tensor();
  Tensor b = alloc->allocate(DType::u8, {6 * kMiB - 100});  // 3 units of the cached 5
  EXPECT_EQ(b.data(), p);
  Tensor c = alloc->allocate(DType::u8, {4 * kMiB});  // the rest of it, pages and bytes kept
  ASSERT_EQ(c.data(), p + 6 * kMiB);
  EXPECT_EQ(c.data_as<uint8_t>()[0], 0x5A);
  EXPECT_EQ(c.data_as<uint8_t>()[4 * kMiB - 1], 0x5A);
}

TEST(CachingAllocator, GrowsTheLargestCachedBlockInsteadOfMappingAFreshOne) {
  auto alloc = detail::make_caching_allocator(size_t{1} << 30);
  Tensor a = alloc->allocate(DType::u8, {4 * kMiB});
  std::memset(a.data(), 0x33, 4 * kMiB);
  a = Tensor();
  Tensor b = alloc->allocate(DType::u8, {8 * kMiB});  // no cached block fits: the 4 MiB one grows
  const uint8_t* q = b.data_as<uint8_t>();
  EXPECT_EQ(reinterpret_cast<uintptr_t>(q) % 64, 0u);
  EXPECT_EQ(q[0], 0x33);  // its pages moved along
  EXPECT_EQ(q[4 * kMiB - 1], 0x33);
  EXPECT_EQ(q[4 * kMiB], 0);  // the new part is fresh
  EXPECT_EQ(q[8 * kMiB - 1], 0);
}

TEST(CachingAllocator, ReserveFaultsMemoryInAheadOfTheFirstAllocation) {
  auto fresh = detail::make_caching_allocator(size_t{1} << 30);
  Tensor f = fresh->allocate(DType::u8, {8 * kMiB});
  EXPECT_EQ(resident_pages(f.data(), 8 * kMiB), 0u);  // a fresh mapping: nothing faulted yet
  auto alloc = detail::make_caching_allocator(size_t{1} << 30);
  alloc->reserve(8 * kMiB);
  Tensor a = alloc->allocate(DType::u8, {8 * kMiB});
  EXPECT_EQ(resident_pages(a.data(), 8 * kMiB), size_t{8 * kMiB / 4096});
  // A smaller cached block does not count: reserving more maps (and faults in) a block of the full size.
  a = Tensor();
  alloc->reserve(16 * kMiB);
  Tensor b = alloc->allocate(DType::u8, {16 * kMiB});
  EXPECT_EQ(resident_pages(b.data(), 16 * kMiB), size_t{16 * kMiB / 4096});
}

TEST(CachingAllocator, KeepsNoMoreThanItsLimit) {
  auto alloc = detail::make_caching_allocator(size_t{4} << 20);
  Tensor a = alloc->allocate(DType::u8, {8 * kMiB});
  std::memset(a.data(), 1, 8 * kMiB);
  a = Tensor();  // over the limit: unmapped, not cached
  Tensor b = alloc->allocate(DType::u8, {8 * kMiB});
  EXPECT_EQ(resident_pages(b.data(), 8 * kMiB), 0u);
}

}  // namespace epcomm

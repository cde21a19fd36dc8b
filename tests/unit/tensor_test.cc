// unit/tensor_test.cc — Tensor bookkeeping: contiguity, sizes, the default allocator.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <cstring>

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

// Minor page faults of this process so far.
long minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

TEST(Tensor, DefaultAllocatorReserveFaultsMemoryInAhead) {
  auto alloc = default_allocator();
  alloc->reserve(size_t{120} << 20);
  // A request of at least half the reserved block takes it: writing it costs no page faults.
  Tensor a = alloc->allocate(DType::u8, {int64_t{100} << 20});
  long f0 = minor_faults();
  std::memset(a.data(), 1, a.nbytes());
  const long with_reserve = minor_faults() - f0;
  // The same request again (the block is in use): fresh memory, faulted in on first touch.
  Tensor b = alloc->allocate(DType::u8, {int64_t{100} << 20});
  EXPECT_NE(a.data(), b.data());
  f0 = minor_faults();
  std::memset(b.data(), 1, b.nbytes());
  const long fresh = minor_faults() - f0;
  EXPECT_GE(fresh, 40) << "100 MiB of fresh memory took only " << fresh << " faults";
  EXPECT_LT(with_reserve * 4, fresh) << "reserved memory faulted " << with_reserve << " times, fresh "
                                     << fresh;
  // A request below half the block does not take it; one of at least half does.
  void* reserved = a.data();
  a = Tensor();
  Tensor c = alloc->allocate(DType::u8, {int64_t{40} << 20});
  EXPECT_NE(c.data(), reserved);
  Tensor d = alloc->allocate(DType::u8, {int64_t{61} << 20});
  EXPECT_EQ(d.data(), reserved);
}

}  // namespace epcomm

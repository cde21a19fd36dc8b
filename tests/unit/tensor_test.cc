// unit/tensor_test.cc — Tensor bookkeeping: contiguity, sizes, the default allocator.
#include <gtest/gtest.h>

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

}  // namespace epcomm

// api/arena_allocator.h — outputs carved from a rank's output arena (tensor/output_arena.h) and handed to the
// user's allocator (Allocator::adopt), so that peers on the host can write rows straight into them. Shared by
// the Buffer and the operator family's group contexts.
#pragma once

#include <cstdint>
#include <memory>

#include "epcomm/tensor.h"
#include "tensor/output_arena.h"

namespace epcomm::detail {

// From the arena while it has room, else from `user` itself.
class ArenaAllocator final : public Allocator {
 public:
  ArenaAllocator(std::shared_ptr<OutputArena> arena, std::shared_ptr<Allocator> user)
      : arena_(std::move(arena)), user_(std::move(user)) {}
  Tensor allocate(DType dtype, const Shape& shape) override {
    Tensor t = arena_->allocate(dtype, shape);
    return t.defined() ? user_->adopt(std::move(t)) : user_->allocate(dtype, shape);
  }
  void reserve(size_t bytes) override { arena_->reserve(bytes); }
  Tensor adopt(Tensor t) override { return user_->adopt(std::move(t)); }

 private:
  std::shared_ptr<OutputArena> arena_;
  std::shared_ptr<Allocator> user_;
};

// An output-arena size option resolved: >= 0 as given, -1 = EPCOMM_OUTPUT_ARENA, else the physical memory
// (address space only: pages exist where outputs were written).
size_t arena_bytes_for(int64_t option);

}  // namespace epcomm::detail

// tensor/output_arena.cc — page-granular best-fit allocation over a shared mapping, with two coalesced free
// lists (pages kept / pages returned) so that outputs reuse memory that is already faulted in everywhere.
#include "tensor/output_arena.h"

#include <sys/mman.h>

#include <cstring>

#include "common/check.h"

namespace epcomm {

OutputArena::OutputArena(uint8_t* base, size_t bytes, size_t cache_limit)
    : base_(base), bytes_(bytes / kPage * kPage), cache_limit_(cache_limit) {
  if (bytes_) insert(cold_, cold_size_, 0, bytes_);
}

OutputArena::~OutputArena() {
  if (base_) munmap(base_, bytes_);
}

bool OutputArena::take(std::map<size_t, size_t>& by_offset, std::multimap<size_t, size_t>& by_size,
                       size_t size, size_t& offset) {
  auto it = by_size.lower_bound(size);
  if (it == by_size.end()) return false;
  const size_t have = it->first;
  offset = it->second;
  by_size.erase(it);
  by_offset.erase(offset);
  // The tail stays free in place. It needs no merging: the range was coalesced, so its right neighbour is
  // not in this list.
  if (have > size) {
    by_offset.emplace(offset + size, have - size);
    by_size.emplace(have - size, offset + size);
  }
  return true;
}

void OutputArena::insert(std::map<size_t, size_t>& by_offset, std::multimap<size_t, size_t>& by_size,
                         size_t offset, size_t size) {
  auto drop_size = [&](size_t s, size_t off) {
    auto [a, b] = by_size.equal_range(s);
    for (; a != b; ++a)
      if (a->second == off) {
        by_size.erase(a);
        return;
      }
  };
  auto next = by_offset.lower_bound(offset);
  if (next != by_offset.end() && next->first == offset + size) {
    size += next->second;
    drop_size(next->second, next->first);
    next = by_offset.erase(next);
  }
  if (next != by_offset.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      offset = prev->first;
      size += prev->second;
      drop_size(prev->second, prev->first);
      by_offset.erase(prev);
    }
  }
  by_offset.emplace(offset, size);
  by_size.emplace(size, offset);
}

Tensor OutputArena::allocate(DType dtype, const Shape& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  const size_t bytes = static_cast<size_t>(n) * dtype_size(dtype);
  const size_t size = std::max(whole_pages(bytes), kPage);
  size_t offset = 0;
  {
    std::lock_guard<std::mutex> lk(m_);
    if (take(hot_, hot_size_, size, offset)) {
      hot_bytes_ -= size;
    } else if (!take(cold_, cold_size_, size, offset)) {
      return Tensor();
    }
    live_bytes_ += size;
  }
  auto self = shared_from_this();
  std::shared_ptr<void> owner(base_ + offset, [self, offset, size](void*) { self->release(offset, size); });
  return Tensor::wrap(base_ + offset, dtype, shape, {}, std::move(owner));
}

int64_t OutputArena::reserve(size_t bytes) {
  if (bytes == 0) return -1;
  const size_t size = whole_pages(bytes);
  size_t offset = 0;
  {
    std::lock_guard<std::mutex> lk(m_);
    if (!take(cold_, cold_size_, size, offset)) return -1;
  }
  // Write through: the kernel allocates (and zeroes) every page now, not in the first call.
  std::memset(base_ + offset, 0, size);
  std::lock_guard<std::mutex> lk(m_);
  insert(hot_, hot_size_, offset, size);  // kept whatever the cache limit: the caller asked for it
  hot_bytes_ += size;
  return static_cast<int64_t>(offset);
}

void OutputArena::release(size_t offset, size_t size) {
  std::unique_lock<std::mutex> lk(m_);
  live_bytes_ -= size;
  if (hot_bytes_ + size <= cache_limit_) {
    insert(hot_, hot_size_, offset, size);
    hot_bytes_ += size;
    return;
  }
  lk.unlock();
  // Beyond the cache: the pages go back to the system (for every process that maps them).
  madvise(base_ + offset, size, MADV_REMOVE);
  lk.lock();
  insert(cold_, cold_size_, offset, size);
}

int64_t OutputArena::offset_of(const void* p, size_t n) const {
  const auto* q = static_cast<const uint8_t*>(p);
  if (!q || q < base_ || q + n > base_ + bytes_) return -1;
  return q - base_;
}

size_t OutputArena::live_bytes() const {
  std::lock_guard<std::mutex> lk(m_);
  return live_bytes_;
}

size_t OutputArena::cached_bytes() const {
  std::lock_guard<std::mutex> lk(m_);
  return hot_bytes_;
}

}  // namespace epcomm

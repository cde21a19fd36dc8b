// tensor/output_arena.cc — page-granular best-fit allocation over a shared mapping, with two coalesced free
// lists (pages kept / pages returned) so that outputs reuse memory that is already faulted in everywhere.
#include "tensor/output_arena.h"

#include <sys/mman.h>

#include <cstring>

#include "common/check.h"

namespace epcomm {

namespace {

constexpr size_t kSpareNodes = 64;  // kept per index: more than the outputs of a few calls in flight

template <class Tree>
void keep_node(std::vector<typename Tree::node_type>& spare, typename Tree::node_type node) {
  if (spare.size() < kSpareNodes) spare.push_back(std::move(node));
}

// An entry of `tree`, made from a kept node when there is one.
template <class Tree>
void emplace_reusing(Tree& tree, std::vector<typename Tree::node_type>& spare, size_t key, size_t value) {
  if (spare.empty()) {
    tree.emplace(key, value);
    return;
  }
  typename Tree::node_type node = std::move(spare.back());
  spare.pop_back();
  node.key() = key;
  node.mapped() = value;
  tree.insert(std::move(node));
}

}  // namespace

FreeRanges::FreeRanges() {
  spare_offset_.reserve(kSpareNodes);
  spare_size_.reserve(kSpareNodes);
}

void FreeRanges::put(size_t offset, size_t size) {
  emplace_reusing(by_offset_, spare_offset_, offset, size);
  emplace_reusing(by_size_, spare_size_, size, offset);
}

void FreeRanges::drop(ByOffset::iterator it) {
  auto [a, b] = by_size_.equal_range(it->second);
  for (; a != b; ++a)
    if (a->second == it->first) {
      keep_node<BySize>(spare_size_, by_size_.extract(a));
      break;
    }
  keep_node<ByOffset>(spare_offset_, by_offset_.extract(it));
}

bool FreeRanges::take(size_t size, size_t& offset) {
  auto it = by_size_.lower_bound(size);
  if (it == by_size_.end()) return false;
  const size_t have = it->first;
  offset = it->second;
  keep_node<BySize>(spare_size_, by_size_.extract(it));
  keep_node<ByOffset>(spare_offset_, by_offset_.extract(offset));
  // The tail stays free in place. It needs no merging: the range was coalesced, so its right neighbour is
  // not in this list.
  if (have > size) put(offset + size, have - size);
  return true;
}

void FreeRanges::insert(size_t offset, size_t size) {
  auto next = by_offset_.lower_bound(offset);
  if (next != by_offset_.end() && next->first == offset + size) {
    size += next->second;
    auto after = std::next(next);
    drop(next);
    next = after;
  }
  if (next != by_offset_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      offset = prev->first;
      size += prev->second;
      drop(prev);
    }
  }
  put(offset, size);
}

OutputArena::OutputArena(uint8_t* base, size_t bytes, size_t cache_limit)
    : base_(base), bytes_(bytes / kPage * kPage), cache_limit_(cache_limit) {
  if (bytes_) cold_.insert(0, bytes_);
}

OutputArena::~OutputArena() {
  if (base_) munmap(base_, bytes_);
}

Tensor OutputArena::allocate(DType dtype, const Shape& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  const size_t bytes = static_cast<size_t>(n) * dtype_size(dtype);
  const size_t size = std::max(whole_pages(bytes), kPage);
  size_t offset = 0;
  {
    std::lock_guard<std::mutex> lk(m_);
    if (hot_.take(size, offset)) {
      hot_bytes_ -= size;
    } else if (!cold_.take(size, offset)) {
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
    if (!cold_.take(size, offset)) return -1;
  }
  // Write through: the kernel allocates (and zeroes) every page now, not in the first call.
  std::memset(base_ + offset, 0, size);
  std::lock_guard<std::mutex> lk(m_);
  hot_.insert(offset, size);  // kept whatever the cache limit: the caller asked for it
  hot_bytes_ += size;
  return static_cast<int64_t>(offset);
}

void OutputArena::release(size_t offset, size_t size) {
  std::unique_lock<std::mutex> lk(m_);
  live_bytes_ -= size;
  if (hot_bytes_ + size <= cache_limit_) {
    hot_.insert(offset, size);
    hot_bytes_ += size;
    return;
  }
  lk.unlock();
  // Beyond the cache: the pages go back to the system (for every process that maps them).
  madvise(base_ + offset, size, MADV_REMOVE);
  lk.lock();
  cold_.insert(offset, size);
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

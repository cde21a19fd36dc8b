// tensor/tensor.cc — Tensor bookkeeping and the default aligned allocator.
#include "epcomm/tensor.h"

#include <sys/mman.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>

#include "common/check.h"
#include "tensor/output_arena.h"

namespace epcomm {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::bf16:
    case DType::f16:
      return 2;
    case DType::f32:
    case DType::i32:
      return 4;
    case DType::i64:
      return 8;
    case DType::i8:
    case DType::u8:
    case DType::boolean:
    case DType::f8e4m3:
    case DType::f8e5m2:
    case DType::e8m0:
    case DType::f4x2:
      return 1;
  }
  return 1;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::bf16:
      return "bf16";
    case DType::f16:
      return "f16";
    case DType::f32:
      return "f32";
    case DType::i8:
      return "i8";
    case DType::u8:
      return "u8";
    case DType::i32:
      return "i32";
    case DType::i64:
      return "i64";
    case DType::boolean:
      return "bool";
    case DType::f8e4m3:
      return "f8e4m3";
    case DType::f8e5m2:
      return "f8e5m2";
    case DType::e8m0:
      return "e8m0";
    case DType::f4x2:
      return "f4x2";
  }
  return "?";
}

std::string shape_str(const Shape& shape) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << ']';
  return os.str();
}

Tensor Tensor::wrap(void* data, DType dtype, Shape shape, Shape strides, std::shared_ptr<void> owner) {
  Tensor t;
  for (int64_t s : shape) EPCOMM_CHECK(s >= 0, "tensor shape ", shape_str(shape), " has a negative size");
  if (strides.empty()) {
    strides.resize(shape.size());
    int64_t st = 1;
    for (size_t i = shape.size(); i-- > 0;) {
      strides[i] = st;
      st *= shape[i];
    }
  }
  EPCOMM_CHECK_EQ(strides.size(), shape.size(), "tensor strides must have one entry per dimension");
  t.data_ = data;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  t.strides_ = std::move(strides);
  t.owner_ = std::move(owner);
  return t;
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int64_t s : shape_) n *= s;
  return n;
}

bool Tensor::is_contiguous() const {
  if (numel() == 0) return true;  // no element to misplace (torch agrees): strides of empty tensors are free
  int64_t st = 1;
  for (size_t i = shape_.size(); i-- > 0;) {
    if (shape_[i] != 1 && strides_[i] != st) return false;
    st *= shape_[i];
  }
  return true;
}

namespace {

// Small tensors come from aligned_alloc. Large ones (>= 2 MiB) are anonymous mappings in whole 2 MiB
// units, 2 MiB-aligned and advised to use transparent huge pages, recycled through a bounded cache: a fresh
// mapping faults on first touch (the kernel zeroes every page; 0.4-10 GB/s on the development VM), which
// would dominate a dispatch whose outputs are hundreds of MiB. Recycled blocks keep their pages.
//
// Output sizes change from call to call (routing), so a request takes the smallest cached block that fits
// and returns the rest of it to the cache; when none fits it grows the largest cached block with mremap
// (its pages move, only the difference is fresh) before it maps fresh memory. reserve() faults a block in
// ahead of time (BufferOptions::num_output_reserve_bytes).
class CachingAllocator final : public Allocator, public std::enable_shared_from_this<CachingAllocator> {
 public:
  static constexpr size_t kLarge = size_t{2} << 20;
  explicit CachingAllocator(size_t limit) : limit_(limit) {}
  ~CachingAllocator() override {
    for (auto& [size, p] : free_) munmap(p, size);
  }

  Tensor allocate(DType dtype, const Shape& shape) override {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    const size_t bytes = static_cast<size_t>(n) * dtype_size(dtype);
    if (bytes < kLarge) {
      size_t rounded = (bytes + 63) / 64 * 64;
      void* p = std::aligned_alloc(64, rounded ? rounded : 64);
      if (!p) oom(bytes, dtype, shape);
      return Tensor::wrap(p, dtype, shape, {}, std::shared_ptr<void>(p, [](void* q) { std::free(q); }));
    }
    const size_t size = units(bytes);
    void* p = take(size);
    if (!p) p = map_fresh(size);
    if (!p) oom(bytes, dtype, shape);
    auto self = shared_from_this();
    std::shared_ptr<void> owner(p, [self, size](void* q) { self->give_back(q, size); });
    return Tensor::wrap(p, dtype, shape, {}, std::move(owner));
  }

  // Makes sure a cached block of at least `bytes` exists (cached blocks already have their pages).
  void reserve(size_t bytes) override {
    if (bytes < kLarge) return;
    const size_t size = units(bytes);
    {
      std::lock_guard<std::mutex> lk(m_);
      if (free_.lower_bound(size) != free_.end()) return;
    }
    void* p = map_fresh(size);
    if (!p)
      EPCOMM_THROW(SystemError, "out of memory reserving ", size, " bytes of output memory (",
                   "BufferOptions::num_output_reserve_bytes)");
    // Write through: the kernel faults (and zeroes) every page now, not in the first call, and every byte
    // is written once (on the development VM a first pass over memory the kernel has just zeroed still ran
    // several times slower than later ones; docs/performance.md).
    std::memset(p, 0, size);
    give_back(p, size);
  }

  static std::shared_ptr<CachingAllocator> instance() {
    static std::shared_ptr<CachingAllocator> a = std::make_shared<CachingAllocator>(kOutputCacheBytes);
    return a;
  }

 private:
  static size_t units(size_t bytes) { return (bytes + kLarge - 1) / kLarge * kLarge; }

  [[noreturn]] static void oom(size_t bytes, DType dtype, const Shape& shape) {
    EPCOMM_THROW(SystemError, "out of memory allocating ", bytes, " bytes for a ", dtype_name(dtype),
                 shape_str(shape), " tensor");
  }

  // A 2 MiB-aligned anonymous mapping of `size` bytes (so that every unit can be a huge page), or null.
  static void* map_fresh(size_t size) {
    void* raw = mmap(nullptr, size + kLarge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return nullptr;
    const uintptr_t a = reinterpret_cast<uintptr_t>(raw), b = (a + kLarge - 1) / kLarge * kLarge;
    if (b > a) munmap(raw, b - a);
    if (b + size < a + size + kLarge) munmap(reinterpret_cast<void*>(b + size), a + kLarge - b);
    void* p = reinterpret_cast<void*>(b);
    madvise(p, size, MADV_HUGEPAGE);
    return p;
  }

  void* take(size_t size) {
    std::unique_lock<std::mutex> lk(m_);
    if (free_.empty()) return nullptr;
    auto it = free_.lower_bound(size);
    if (it != free_.end()) {  // best fit; the rest stays cached
      const size_t have = it->first;
      auto* p = static_cast<char*>(it->second);
      free_.erase(it);
      cached_ -= have;
      if (have > size) {
        free_.emplace(have - size, p + size);
        cached_ += have - size;
      }
      return p;
    }
    // None fits: grow the largest cached block. Its pages move with it; only the difference faults.
    it = std::prev(free_.end());
    const size_t have = it->first;
    void* q = it->second;
    free_.erase(it);
    cached_ -= have;
    lk.unlock();
    void* p = mremap(q, have, size, MREMAP_MAYMOVE);
    if (p == MAP_FAILED) {
      munmap(q, have);
      return nullptr;
    }
    madvise(p, size, MADV_HUGEPAGE);
    return p;
  }

  void give_back(void* p, size_t size) {
    {
      std::lock_guard<std::mutex> lk(m_);
      if (cached_ + size <= limit_) {
        free_.emplace(size, p);
        cached_ += size;
        return;
      }
    }
    munmap(p, size);
  }

  std::mutex m_;
  std::multimap<size_t, void*> free_;  // size -> start of a cached block
  size_t cached_ = 0;
  size_t limit_;  // bytes kept for reuse at most
};

}  // namespace

std::shared_ptr<Allocator> default_allocator() {
  return CachingAllocator::instance();
}

namespace detail {
std::shared_ptr<Allocator> make_caching_allocator(size_t cache_limit_bytes) {
  return std::make_shared<CachingAllocator>(cache_limit_bytes);
}
}  // namespace detail

Tensor empty(DType dtype, const Shape& shape, Allocator* alloc) {
  if (!alloc) alloc = default_allocator().get();
  return alloc->allocate(dtype, shape);
}

}  // namespace epcomm

// tensor/tensor.cc — Tensor bookkeeping and the default aligned allocator.
#include "epcomm/tensor.h"

#include <sys/mman.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <sstream>

#include "common/check.h"

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
// units, advised to use transparent huge pages, and recycled through a bounded cache: a fresh mapping
// faults on first touch at well under 1 GB/s with 4 KiB pages, which would dominate a dispatch whose
// outputs are hundreds of MiB. Recycled blocks keep their pages.
class CachingAllocator final : public Allocator {
 public:
  static constexpr size_t kLarge = size_t{2} << 20;

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
    const size_t size = (bytes + kLarge - 1) / kLarge * kLarge;
    void* p = take(size);
    if (!p) {
      p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) oom(bytes, dtype, shape);
      madvise(p, size, MADV_HUGEPAGE);
    }
    auto self = shared_from_this_();
    std::shared_ptr<void> owner(p, [self, size](void* q) { self->give_back(q, size); });
    return Tensor::wrap(p, dtype, shape, {}, std::move(owner));
  }

  static std::shared_ptr<CachingAllocator> instance() {
    static std::shared_ptr<CachingAllocator> a(new CachingAllocator());
    return a;
  }

 private:
  std::shared_ptr<CachingAllocator> shared_from_this_() { return instance(); }

  [[noreturn]] static void oom(size_t bytes, DType dtype, const Shape& shape) {
    EPCOMM_THROW(SystemError, "out of memory allocating ", bytes, " bytes for a ", dtype_name(dtype),
                 shape_str(shape), " tensor");
  }

  void* take(size_t size) {
    std::lock_guard<std::mutex> lk(m_);
    auto it = free_.find(size);
    if (it == free_.end()) return nullptr;
    void* p = it->second;
    free_.erase(it);
    cached_ -= size;
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
  std::multimap<size_t, void*> free_;
  size_t cached_ = 0;
  size_t limit_ = size_t{4} << 30;  // bytes kept for reuse at most
};

}  // namespace

std::shared_ptr<Allocator> default_allocator() {
  return CachingAllocator::instance();
}

Tensor empty(DType dtype, const Shape& shape, Allocator* alloc) {
  if (!alloc) alloc = default_allocator().get();
  return alloc->allocate(dtype, shape);
}

}  // namespace epcomm

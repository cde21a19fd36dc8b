// tensor/tensor.cc — Tensor bookkeeping and the default aligned allocator.
#include "epcomm/tensor.h"

#include <cstdlib>
#include <sstream>

#include "common/check.h"

namespace epcomm {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::bf16:
    case DType::f16: return 2;
    case DType::f32:
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::i8:
    case DType::u8:
    case DType::boolean:
    case DType::f8e4m3:
    case DType::f8e5m2:
    case DType::e8m0:
    case DType::f4x2: return 1;
  }
  return 1;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::f32: return "f32";
    case DType::i8: return "i8";
    case DType::u8: return "u8";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::boolean: return "bool";
    case DType::f8e4m3: return "f8e4m3";
    case DType::f8e5m2: return "f8e5m2";
    case DType::e8m0: return "e8m0";
    case DType::f4x2: return "f4x2";
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
  int64_t st = 1;
  for (size_t i = shape_.size(); i-- > 0;) {
    if (shape_[i] != 1 && strides_[i] != st) return false;
    st *= shape_[i];
  }
  return true;
}

namespace {
class AlignedAllocator final : public Allocator {
 public:
  Tensor allocate(DType dtype, const Shape& shape) override {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    size_t bytes = static_cast<size_t>(n) * dtype_size(dtype);
    size_t rounded = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded ? rounded : 64);
    if (!p) EPCOMM_THROW(SystemError, "out of memory allocating ", bytes, " bytes for a ", dtype_name(dtype), shape_str(shape), " tensor");
    std::shared_ptr<void> owner(p, [](void* q) { std::free(q); });
    return Tensor::wrap(p, dtype, shape, {}, std::move(owner));
  }
};
}  // namespace

std::shared_ptr<Allocator> default_allocator() {
  static std::shared_ptr<Allocator> alloc = std::make_shared<AlignedAllocator>();
  return alloc;
}

Tensor empty(DType dtype, const Shape& shape, Allocator* alloc) {
  if (!alloc) alloc = default_allocator().get();
  return alloc->allocate(dtype, shape);
}

}  // namespace epcomm

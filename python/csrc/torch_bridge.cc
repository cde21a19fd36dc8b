// python/csrc/torch_bridge.cc — dtype mapping, zero-copy input wrapping, torch-backed output allocation.
#include "torch_bridge.h"

#include <utility>

#include "epcomm/error.h"

namespace epcomm::python {
namespace {

// Owners created here hold one at::Tensor; the deleter's type marks them so that to_torch can find the
// tensor again (std::get_deleter) instead of aliasing its memory.
struct TorchOwnerDeleter {
  void operator()(void* p) const { delete static_cast<at::Tensor*>(p); }
};

std::shared_ptr<void> own(at::Tensor t) {
  return std::shared_ptr<void>(new at::Tensor(std::move(t)), TorchOwnerDeleter{});
}

[[noreturn]] void invalid(const std::string& message) {
  throw Error(ErrorCode::InvalidUsage, message);
}

// Outputs are torch tensors (torch_empty).
class TorchAllocator final : public Allocator {
 public:
  Tensor allocate(DType dtype, const Shape& shape) override {
    at::Tensor t;
    try {
      t = torch_empty(shape, torch_dtype(dtype));
    } catch (const c10::Error& e) {  // epcomm's callers handle epcomm::Error only
      throw Error(ErrorCode::SystemError, std::string("allocating a ") + dtype_name(dtype) +
                                              shape_str(shape) + " output: " + e.what_without_backtrace());
    }
    void* data = t.data_ptr();
    return Tensor::wrap(data, dtype, shape, {}, own(std::move(t)));
  }
  void reserve(size_t bytes) override { default_allocator()->reserve(bytes); }
  // Memory from the Buffer's output arena: torch storage over it that keeps the block alive.
  Tensor adopt(Tensor t) override {
    std::shared_ptr<void> keep = t.owner();
    std::vector<int64_t> shape(t.shape().begin(), t.shape().end());
    at::Tensor a = at::from_blob(
        t.data(), shape, [keep](void*) mutable { keep.reset(); },
        at::TensorOptions().dtype(torch_dtype(t.dtype())).device(at::kCPU));
    return Tensor::wrap(t.data(), t.dtype(), t.shape(), {}, own(std::move(a)));
  }
};

}  // namespace

at::Tensor torch_empty(at::IntArrayRef shape, at::ScalarType type) {
  // Measured: a 470 MB dispatch output from at::empty made every call fault it again (2-3 s per dispatch
  // instead of 46-70 ms).
  static const std::shared_ptr<Allocator> cache = default_allocator();
  const auto options = at::TensorOptions().dtype(type).device(at::kCPU);
  int64_t n = 1;
  for (int64_t s : shape) {
    if (s < 0 || (s > 0 && n > (int64_t{1} << 62) / s))
      throw Error(ErrorCode::SystemError, "torch_empty: a tensor of shape " + c10::str(shape) +
                                              " has a negative size or more than 2^62 elements");
    n *= s;
  }
  if (static_cast<size_t>(n) * at::elementSize(type) < (size_t{2} << 20)) return at::empty(shape, options);
  Tensor block = cache->allocate(DType::u8, {n * static_cast<int64_t>(at::elementSize(type))});
  std::shared_ptr<void> keep = block.owner();
  return at::from_blob(
      block.data(), shape, [keep](void*) mutable { keep.reset(); }, options);
}

at::ScalarType torch_dtype(DType dtype) {
  switch (dtype) {
    case DType::bf16:
      return at::kBFloat16;
    case DType::f16:
      return at::kHalf;
    case DType::f32:
      return at::kFloat;
    case DType::i8:
      return at::kChar;
    case DType::u8:
      return at::kByte;
    case DType::i32:
      return at::kInt;
    case DType::i64:
      return at::kLong;
    case DType::boolean:
      return at::kBool;
    case DType::f8e4m3:
    case DType::f8e5m2:
    case DType::e8m0:
    case DType::f4x2:
      return at::kByte;  // one byte each; viewed as the real dtype in Python when possible
  }
  return at::kByte;
}

// The torch.<name> a Python user knows a scalar type by (c10's own names are C++ spellings: "ComplexFloat").
std::string python_dtype_name(at::ScalarType type) {
  static const std::pair<at::ScalarType, const char*> kNames[] = {{at::kDouble, "float64"},
                                                                  {at::kShort, "int16"},
                                                                  {at::kComplexHalf, "complex32"},
                                                                  {at::kComplexFloat, "complex64"},
                                                                  {at::kComplexDouble, "complex128"},
                                                                  {at::kQInt8, "qint8"},
                                                                  {at::kQUInt8, "quint8"},
                                                                  {at::kQInt32, "qint32"}};
  for (const auto& [t, name] : kNames)
    if (t == type) return std::string("torch.") + name;
  return std::string("torch dtype ") + c10::toString(type);
}

DType epcomm_dtype(at::ScalarType type, const char* what) {
  switch (type) {
    case at::kBFloat16:
      return DType::bf16;
    case at::kHalf:
      return DType::f16;
    case at::kFloat:
      return DType::f32;
    case at::kChar:
      return DType::i8;
    case at::kByte:
      return DType::u8;
    case at::kInt:
      return DType::i32;
    case at::kLong:
      return DType::i64;
    case at::kBool:
      return DType::boolean;
      // The one-byte formats, where the torch built against has their dtypes (2.1 fp8, 2.7 e8m0, 2.8 fp4x2).
#if __has_include(<c10/util/Float8_e4m3fn.h>)
    case at::ScalarType::Float8_e4m3fn:
      return DType::f8e4m3;
    case at::ScalarType::Float8_e5m2:
      return DType::f8e5m2;
#endif
#if __has_include(<c10/util/Float8_e8m0fnu.h>)
    case at::ScalarType::Float8_e8m0fnu:
      return DType::e8m0;
#endif
#if __has_include(<c10/util/Float4_e2m1fn_x2.h>)
    case at::ScalarType::Float4_e2m1fn_x2:
      return DType::f4x2;
#endif
    default:
      break;
  }
  invalid(std::string("argument: ") + what + ": " + python_dtype_name(type) +
          " is not a dtype epcomm moves (torch.bfloat16, float16, float32, int8, uint8, int32, int64, bool, "
          "float8_e4m3fn, float8_e5m2, float8_e8m0fnu, float4_e2m1fn_x2; uint8 for the last four where the "
          "installed torch lacks them)");
}

DType parse_dtype(const std::string& name) {
  for (DType d : {DType::bf16, DType::f16, DType::f32, DType::i8, DType::u8, DType::i32, DType::i64,
                  DType::boolean, DType::f8e4m3, DType::f8e5m2, DType::e8m0, DType::f4x2})
    if (name == dtype_name(d)) return d;
  invalid("dtype: unknown epcomm dtype name '" + name + "'");
}

Tensor from_torch(const at::Tensor& t, const char* what, const std::optional<std::string>& as) {
  if (!t.defined()) invalid(std::string("argument: ") + what + ": got an undefined tensor");
  if (!t.device().is_cpu())
    invalid(std::string("argument: ") + what + ": expected a CPU tensor, got one on " + t.device().str());
  if (t.layout() != at::kStrided)
    invalid(std::string("argument: ") + what + ": expected a dense (strided) tensor");
  DType d = epcomm_dtype(t.scalar_type(), what);
  if (as) {
    DType want = parse_dtype(*as);
    if (static_cast<int64_t>(dtype_size(want)) != t.element_size())
      invalid(std::string("argument: ") + what + ": cannot read a " + c10::toString(t.scalar_type()) +
              " tensor as " + *as);
    d = want;
  }
  Shape shape(t.sizes().begin(), t.sizes().end());
  Shape strides(t.strides().begin(), t.strides().end());
  if (t.numel() == 0) strides.clear();  // torch calls any empty tensor contiguous; so does epcomm then
  return Tensor::wrap(t.data_ptr(), d, std::move(shape), std::move(strides), own(t));
}

std::optional<Tensor> from_torch(const std::optional<at::Tensor>& t, const char* what,
                                 const std::optional<std::string>& as) {
  if (!t || !t->defined()) return std::nullopt;
  return from_torch(*t, what, as);
}

at::Tensor to_torch(const Tensor& t) {
  // torch rejects (with c10::Error) a view whose extent overflows: epcomm must never hand one out.
  __int128 extent = 1;
  for (size_t i = 0; i < t.shape().size(); ++i)
    if (t.shape()[i] > 0) extent += static_cast<__int128>(t.shape()[i] - 1) * t.strides()[i];
  if (extent * static_cast<__int128>(dtype_size(t.dtype())) >= (static_cast<__int128>(1) << 62))
    throw Error(ErrorCode::Internal,
                "to_torch: a tensor of shape " + shape_str(t.shape()) + " spans more than 2^62 bytes");
  const at::ScalarType type = torch_dtype(t.dtype());
  const std::shared_ptr<void>& owner = t.owner();
  if (owner && std::get_deleter<TorchOwnerDeleter>(owner)) {
    const at::Tensor& base = *static_cast<const at::Tensor*>(owner.get());
    if (base.data_ptr() == t.data() && base.scalar_type() == type && base.sizes().vec() == t.shape() &&
        base.is_contiguous() && t.is_contiguous())
      return base;
  }
  auto options = at::TensorOptions().dtype(type).device(at::kCPU);
  if (!owner) {  // borrowed memory that epcomm keeps: hand out a copy the caller owns
    return at::from_blob(t.data(), t.shape(), t.strides(), options).clone();
  }
  std::shared_ptr<void> keep = owner;
  return at::from_blob(
      t.data(), t.shape(), t.strides(), [keep](void*) mutable { keep.reset(); }, options);
}

std::shared_ptr<Allocator> torch_allocator() {
  static std::shared_ptr<Allocator> a = std::make_shared<TorchAllocator>();
  return a;
}

}  // namespace epcomm::python

// epcomm/tensor.h — host tensors (dtype, shape, strides, shared ownership) and the output allocator.
// A Tensor is a cheap, copyable view; copies share the storage. epcomm never writes into an input tensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace epcomm {

enum class DType : uint8_t {
  bf16,
  f16,
  f32,
  i8,
  u8,
  i32,
  i64,
  boolean,
  f8e4m3,  // OCP E4M3 (torch.float8_e4m3fn)
  f8e5m2,  // OCP E5M2 (torch.float8_e5m2)
  e8m0,    // power-of-two scale byte (torch.float8_e8m0fnu)
  f4x2,    // two e2m1 codes per byte
};

size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& shape);

class Tensor {
 public:
  Tensor() = default;
  // Wraps memory owned elsewhere; `owner` keeps it alive (may be empty for borrowed memory the caller keeps
  // alive). Empty `strides` means row-major contiguous.
  static Tensor wrap(void* data, DType dtype, Shape shape, Shape strides = {},
                     std::shared_ptr<void> owner = {});

  bool defined() const { return data_ != nullptr || !shape_.empty(); }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  int64_t size(int64_t d) const { return shape_.at(static_cast<size_t>(d)); }
  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  bool is_contiguous() const;
  void* data() const { return data_; }
  template <typename T>
  T* data_as() const {
    return static_cast<T*>(data_);
  }
  const std::shared_ptr<void>& owner() const { return owner_; }

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::u8;
  Shape shape_, strides_;
  std::shared_ptr<void> owner_;
};

// Allocates every output epcomm returns. The Python front hands in one that returns torch storage.
// Must be thread-safe: operations allocate on the Buffer's communication thread.
class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual Tensor allocate(DType dtype, const Shape& shape) = 0;
  // Makes `bytes` of output memory ready ahead of the first allocate() (faulted in, kept for reuse); a hint,
  // no-op by default.
  virtual void reserve(size_t bytes) { (void)bytes; }
  // Takes over memory epcomm carved for an output elsewhere (a Buffer's shared output arena,
  // BufferOptions::num_output_arena_bytes) and returns the tensor to hand out: it must view the same bytes
  // (peers write into them) and keep `t.owner()` alive as long as it lives. The default returns `t`; the
  // Python front wraps it in torch storage.
  virtual Tensor adopt(Tensor t) { return t; }
};

// The library's allocator: 64-byte aligned heap memory for small tensors; large ones (>= 2 MiB) from a
// process-wide cache of huge-page-advised mappings that keeps their pages across calls (up to 4 GiB).
std::shared_ptr<Allocator> default_allocator();

namespace detail {
// A separate instance of the library's caching allocator (default_allocator() is one), keeping at most
// `cache_limit_bytes` for reuse; for tests and for users who want a private cache.
std::shared_ptr<Allocator> make_caching_allocator(size_t cache_limit_bytes);
}  // namespace detail

// Convenience: a new contiguous tensor from `alloc` (default_allocator() when null).
Tensor empty(DType dtype, const Shape& shape, Allocator* alloc = nullptr);

// Plain tensor, or pre-quantized (data, scales).
struct Payload {
  Tensor data;
  std::optional<Tensor> scales;
};

}  // namespace epcomm

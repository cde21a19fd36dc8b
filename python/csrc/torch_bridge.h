// python/csrc/torch_bridge.h — torch tensors in and out of epcomm: dtype mapping, zero-copy wrapping of
// inputs, and the allocator that makes every epcomm output a torch tensor the C++ side writes into.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <optional>
#include <string>

#include "epcomm/tensor.h"

namespace epcomm::python {

// epcomm dtype <-> torch dtype. The one-byte formats (f8e4m3, f8e5m2, e8m0, f4x2) leave C++ as torch.uint8
// and the Python layer views them as the real torch dtypes where the installed torch has them; as input the
// real dtypes are read directly (epcomm_dtype), uint8 with a format name (from_torch's `as`).
at::ScalarType torch_dtype(DType dtype);
DType epcomm_dtype(at::ScalarType type, const char* what);
DType parse_dtype(const std::string& name);  // "bf16", "f8e4m3", ... (dtype_name's spelling)

// Wraps a CPU tensor without copying; the returned Tensor keeps `t` alive (epcomm holds inputs of
// asynchronous calls until they complete). `as` reinterprets a one-byte tensor as an epcomm format torch
// lacks (for example "f8e4m3" for a uint8 tensor). `what` names the argument in error messages.
Tensor from_torch(const at::Tensor& t, const char* what, const std::optional<std::string>& as = std::nullopt);
std::optional<Tensor> from_torch(const std::optional<at::Tensor>& t, const char* what,
                                 const std::optional<std::string>& as = std::nullopt);

// The torch tensor behind an epcomm output: the very tensor the allocator made, or (for memory epcomm owns)
// a tensor aliasing it that keeps the owner alive. Never copies.
at::Tensor to_torch(const Tensor& t);

// A new CPU tensor: 2 MiB or more over epcomm's caching allocator (memory whose pages stay across calls;
// torch's CPU allocator unmaps such sizes on free, so every call would fault them in again), smaller ones
// from at::empty. Uninitialized. Thread-safe and GIL-free.
at::Tensor torch_empty(at::IntArrayRef shape, at::ScalarType type);

// Allocates outputs with torch_empty. Thread-safe and GIL-free (it runs on Buffers' communication threads).
std::shared_ptr<Allocator> torch_allocator();

}  // namespace epcomm::python

// quant/simd.h — the implementations of the fp8 and MX block quantizers of block.h: hand-written AVX-512
// and AVX2 kernels (simd.cc) and the portable loops of kernels.h, chosen once at load time.
#pragma once

#include <cstdint>
#include <vector>

#include "quant/block.h"

namespace epcomm::quant {

// One implementation of fp8_per_group128, fp8_per_token, fp8_per_group128_a3, mx_quantize and
// int8_per_token_a3, with the signatures of block.h. The arguments are checked before (block.cc); every set
// gives the same bits.
struct Fp8KernelSet {
  const char* name;
  void (*per_group128)(Fp8Format fmt, DType in, const void* x, int64_t n, const Smoothing& c, uint8_t* codes,
                       void* scales, Group128Options options);
  void (*per_token)(Fp8Format fmt, DType in, const void* x, int64_t n, const Smoothing& c, uint8_t* codes,
                    float* scale);
  void (*per_group128_a3)(Fp8Format fmt, DType in, const void* x, int64_t n, const Smoothing& c,
                          uint8_t* codes, float* scales);
  void (*mx)(MxElem elem, ScaleRule rule, DType in, const void* x, int64_t n, uint8_t* codes,
             uint8_t* scales);
  void (*int8_per_token)(DType in, const void* x, int64_t n, const Smoothing& c, int8_t* q, float* scale);
};

// The sets this CPU runs, best first: "avx512" (AVX-512 F and BW), "avx2" (x86-64-v3), then "portable".
// block.h's functions use the first; the tests check each against the portable one.
std::vector<Fp8KernelSet> fp8_kernel_sets();
// The portable set alone (block.cc).
Fp8KernelSet portable_fp8_kernels();

}  // namespace epcomm::quant

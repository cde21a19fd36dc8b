// engine/kernels.h — the copy and reduction loops of the data path.
// Whole rows at a time; results never depend on vector width (no FMA, fixed summation order).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "epcomm/tensor.h"

namespace epcomm::engine {

// Copies one payload row (large rows with streaming stores, unless `cache_resident`: plain stores, for
// rows their reader is to find in the cache). `fence` false: the caller issues one store_fence() after a
// batch of rows, before whatever publishes them.
void copy_row(void* dst, const void* src, size_t bytes, bool fence = true, bool cache_resident = false);
// Copies one row to each of `n` destinations in one pass over the source (each block loaded once, stored
// to every destination), as copy_row would one by one.
void copy_row_to(uint8_t* const* dsts, int n, const void* src, size_t bytes, bool fence = true,
                 bool cache_resident = false);
// A pushed token (both dispatches): its `bytes` of data from `src` to each of the n rows `dsts`, in one pass
// (streaming stores unless `cache_resident`; the caller fences before publishing), and its `scale_bytes` of
// scales from `scales` to each of `scale_dsts` (none when scale_bytes is 0).
void write_token_rows(uint8_t* const* dsts, uint8_t* const* scale_dsts, int n, const void* src, size_t bytes,
                      const void* scales, size_t scale_bytes, bool cache_resident);
// A dispatch whose pushed rows, all ranks of the host together, weigh at most this many bytes writes them
// with plain stores: they stay in the shared cache, where their receivers read them next (the combine, or
// the experts), instead of going to memory and back. Half the last-level cache the system reports, at most
// 16 MiB (a VM may report the whole machine's caches), 16 MiB when it reports none.
size_t cache_resident_push_bytes();
void store_fence();

// Packs row t of a strided scales tensor (element (t, c) at base + (t*st0 + c*st1) * elem) contiguously.
void gather_scales(uint8_t* dst, const uint8_t* base, int64_t t, int64_t st0, int64_t st1, int64_t cols,
                   size_t elem);

// One combined token (docs/normal-mode.md on one node): p = +0; p = p + f32(w_i * f32(x_i)) for each
// contribution in order (unweighted when `weights` is null); acc = +0 + p; then the biases; one rounding.
// `rows[i]` points at contribution i (dtype `dt`, `hidden` elements); bias pointers may be null.
void reduce_token(DType dt, const uint8_t* const* rows, const float* weights, int n, int64_t hidden,
                  const uint8_t* bias1, const uint8_t* bias2, uint8_t* out);

// The implementations of reduce_token this CPU can run, best first ("avx512", "avx2", then "portable"):
// reduce_token uses the first. Every one gives the same bits; the tests check each against an oracle.
struct ReduceKernel {
  const char* name;
  void (*run)(DType dt, const uint8_t* const* rows, const float* weights, int n, int64_t hidden,
              const uint8_t* bias1, const uint8_t* bias2, uint8_t* out);
};
std::vector<ReduceKernel> reduce_kernels();

// Internode (partial_kernels.cc): one node's f32 partial p = +0 + c_1 + ... + c_n of a token (c as in
// reduce_token), and the origin's acc = +0 + p_1 + ... + p_n over nodes in ascending order, then the biases,
// then one rounding to `dt`. n may be 0 (the result is the rounded bias, or +0).
void reduce_partial(DType dt, const uint8_t* const* rows, const float* weights, int n, int64_t hidden,
                    float* out);
void finish_partials(DType dt, const float* const* parts, int n, int64_t hidden, const uint8_t* bias1,
                     const uint8_t* bias2, uint8_t* out);
// Prefetches the first bytes of each of `n` rows (what reduce_token reads before its own prefetch runs
// ahead), so that the next token's misses overlap the current token's reduction. A row that directly
// follows the same copy of the previous token (`prev[j] + row_bytes`, j < prev_n) is skipped: the
// hardware prefetcher already streams it, and a software prefetch there only takes a miss buffer (on the
// development VM it cost rank_major's direct combine 10-20%, docs/performance.md).
void prefetch_row_starts(const uint8_t* const* rows, int n, size_t row_bytes,
                         const uint8_t* const* prev = nullptr, int prev_n = 0);

}  // namespace epcomm::engine

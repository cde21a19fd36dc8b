// tensor/output_arena.h — a rank's output arena: one shared-memory range (a mapping of its segment's memfd,
// which every peer on the host maps too) that a Buffer's outputs are carved from, so that a peer can write a
// dispatched row straight into its final place in this rank's output (docs/design.md, "Output arena").
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "epcomm/tensor.h"

namespace epcomm {

// Freed output memory kept (with its pages) for later outputs, at most: the caching allocator's limit per
// process and each output arena's.
constexpr size_t kOutputCacheBytes = size_t{4} << 30;

// A coalesced list of free ranges [offset, offset + size), indexed by offset and by size (best fit). The
// tree nodes of erased entries are kept for later entries, so that the take() and insert() of an output's
// allocation and release allocate no memory once the list has settled. Not thread-safe.
class FreeRanges {
 public:
  FreeRanges();
  // Takes `size` bytes from the smallest range that holds them (its tail stays free in place) and sets
  // `offset`; false when none holds `size`.
  bool take(size_t size, size_t& offset);
  // Adds a range, merged with its free neighbours.
  void insert(size_t offset, size_t size);

 private:
  using ByOffset = std::map<size_t, size_t>;     // offset -> size
  using BySize = std::multimap<size_t, size_t>;  // size -> offset
  void put(size_t offset, size_t size);          // one entry in both indexes
  void drop(ByOffset::iterator it);              // an entry out of both indexes

  ByOffset by_offset_;
  BySize by_size_;
  std::vector<ByOffset::node_type> spare_offset_;
  std::vector<BySize::node_type> spare_size_;
};

// Thread-safe. Blocks are whole pages; a freed block keeps its pages for the next output (no first-touch
// faults, and the peers' page tables stay valid), up to `cache_limit` bytes of freed memory, beyond which
// freed pages are returned to the system (MADV_REMOVE). Blocks keep the arena (and its mapping) alive.
class OutputArena : public std::enable_shared_from_this<OutputArena> {
 public:
  // Takes over the mapping [base, base + bytes) (munmapped when the arena and every block are gone).
  OutputArena(uint8_t* base, size_t bytes, size_t cache_limit);
  ~OutputArena();
  OutputArena(const OutputArena&) = delete;
  OutputArena& operator=(const OutputArena&) = delete;

  // A contiguous tensor in the arena, or an undefined Tensor when no free range holds it.
  Tensor allocate(DType dtype, const Shape& shape);
  // Writes through `bytes` (rounded up to pages) at the lowest free offset and keeps them as a freed block,
  // so that the next outputs of that size land on pages that exist. Returns the block's offset (0 on a
  // fresh arena; peers populate their view of it), or -1 when the arena cannot hold it.
  int64_t reserve(size_t bytes);

  uint8_t* base() const { return base_; }
  size_t bytes() const { return bytes_; }
  // Offset of [p, p + n) in the arena, or -1 when it does not lie inside.
  int64_t offset_of(const void* p, size_t n) const;

  // Bookkeeping, for tests: bytes handed out and not freed; freed bytes that keep their pages.
  size_t live_bytes() const;
  size_t cached_bytes() const;

  static constexpr size_t kPage = 4096;
  static size_t whole_pages(size_t bytes) { return (bytes + kPage - 1) / kPage * kPage; }

 private:
  void release(size_t offset, size_t size);

  uint8_t* base_;
  size_t bytes_, cache_limit_;
  mutable std::mutex m_;
  // Two free lists: `hot` ranges have their pages (freed blocks), `cold` ones do not (never used, or
  // returned to the system).
  FreeRanges hot_, cold_;
  size_t hot_bytes_ = 0, live_bytes_ = 0;
};

}  // namespace epcomm

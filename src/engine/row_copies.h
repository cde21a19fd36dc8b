// engine/row_copies.h — the payload rows a receiver places while it walks a staged window, copied by the
// call's copy threads. The walk itself stays on one thread (row offsets come from cursors that advance entry
// by entry); with more than one copy thread it only records where each row goes, and flush() then splits the
// recorded rows over the threads. Each row is copied by one thread with the same kernel, so the outputs are
// the same bytes whatever the thread count.
#pragma once

#include <cstring>
#include <vector>

#include "engine/kernels.h"
#include "engine/workers.h"

namespace epcomm::engine {

class RowCopies {
 public:
  // A payload is `data_bytes` of data followed by `scale_bytes` of scales. `workers` null or `threads` 1:
  // add() copies at once (the walk's own thread, nothing recorded).
  RowCopies(WorkerPool* workers, int threads, size_t data_bytes, size_t scale_bytes)
      : workers_(workers),
        threads_(threads),
        data_bytes_(data_bytes),
        scale_bytes_(scale_bytes),
        deferred_(workers != nullptr && threads > 1) {}

  // The payload at `src` goes to `data` (and its scales to `scales`, when there are any).
  void add(uint8_t* data, uint8_t* scales, const uint8_t* src) {
    if (!deferred_) return copy(data, scales, src, true);
    rows_.push_back({data, scales, src});
  }
  // Copies every recorded row (before whatever publishes them: a window's acknowledgement) and forgets them.
  void flush() {
    if (rows_.empty()) return;
    const int64_t n = static_cast<int64_t>(rows_.size());
    for_parts(workers_, threads_, n * static_cast<int64_t>(data_bytes_ + scale_bytes_), n,
              [&](int64_t begin, int64_t end) {
                for (int64_t i = begin; i < end; ++i)
                  copy(rows_[i].data, rows_[i].scales, rows_[i].src, false);
                store_fence();  // this thread's streaming stores, before the caller publishes them
              });
    rows_.clear();
  }

 private:
  struct Row {
    uint8_t *data, *scales;
    const uint8_t* src;
  };
  void copy(uint8_t* data, uint8_t* scales, const uint8_t* src, bool fence) const {
    copy_row(data, src, data_bytes_, fence);
    if (scale_bytes_) std::memcpy(scales, src + data_bytes_, scale_bytes_);
  }

  WorkerPool* const workers_;
  const int threads_;
  const size_t data_bytes_, scale_bytes_;
  const bool deferred_;
  std::vector<Row> rows_;
};

}  // namespace epcomm::engine

// tools/epcomm/bench_measure.h — the bench's reference measurements around an operation: the concurrent
// memcpy rate of the same per-rank byte counts, the peak resident set of a phase, and the copy-thread count.
#pragma once

#include <cstdint>

#include "epcomm/bootstrap.h"

namespace epcomm::cli {

// Collective. Every rank copies `bytes` (its own count; ranks may differ) with plain memcpy from one private,
// pre-touched buffer into another, split over `threads` threads, all ranks at once after a barrier; two
// blocks (fresh buffers each) of five repetitions. Returns the sum of all ranks' bytes / the slowest rank's
// time, median over a block's repetitions, the better block, in GB/s (1e9 bytes/s); 0 when no rank copies.
double concurrent_memcpy_gbps(Bootstrap& bootstrap, int64_t bytes, int threads);

// The copy threads per rank the engine uses for Config::num_threads = `requested` (engine::copy_threads):
// itself, at most the hardware threads, when > 0; else hardware threads / local ranks, at least 1.
int resolve_threads(int requested, int local_ranks);

// Starts a new peak-resident-set window for this process (Linux: VmHWM reset through /proc/self/clear_refs);
// where that is refused the window starts at the process's start.
void reset_peak_rss();
// The process's peak resident set since the last reset_peak_rss(), in MiB.
double peak_rss_mb();
// The process's proportional set size now (shared pages split among the processes mapping them), in MiB;
// 0 where /proc/self/smaps_rollup is missing.
double pss_mb();

}  // namespace epcomm::cli

// engine/workers.h — a rank's copy threads (Config::num_threads): a pool that runs one job on several
// threads at once, the caller among them. Workers sleep on a condition variable between jobs (they never
// spin), so copy threads that outnumber the cores only cost a wake-up each.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace epcomm::engine {

class WorkerPool {
 public:
  WorkerPool() = default;
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Runs job(i, n) for i in [0, n) at once, job(0, n) on the calling thread, and returns when every part
  // returned; rethrows the first exception a part threw. Starts workers the first time they are needed and
  // keeps them. Jobs from several threads run one after the other.
  void run(int n, const std::function<void(int, int)>& job);

 private:
  void work(int index);

  std::mutex run_mu_;  // one job at a time
  std::mutex mu_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> threads_;
  const std::function<void(int, int)>* job_ = nullptr;
  int parts_ = 0, pending_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

// The copy threads of a call: `requested` (Config::num_threads) up to twice the hardware threads (DeepEP's
// num_sms, 20-24, means GPU multiprocessors), or for 0 the host's hardware threads / its ranks, at least 1.
int copy_threads(int requested, int local_ranks);
// The threads a part of a call that moves `bytes` uses: one per EPCOMM_PARALLEL_BYTES (1 MiB) at most
// `threads`: waking a worker for less costs more than it saves.
int threads_for_bytes(int threads, int64_t bytes);

// [begin, end) of part i of n over `count` items, contiguous, sizes differing by at most one.
inline void part_range(int64_t count, int i, int n, int64_t& begin, int64_t& end) {
  const int64_t base = count / n, extra = count % n;
  begin = i * base + std::min<int64_t>(i, extra);
  end = begin + base + (i < extra ? 1 : 0);
}

// Runs body(begin, end) over contiguous parts of [0, count), one part per thread: threads_for_bytes(threads,
// bytes) threads of `workers` (the caller among them), or the caller alone when `workers` is null or one
// thread suffices. Every item is handled by exactly one thread, so a body that writes only its items' outputs
// gives the same bytes whatever the thread count. Returns the number of parts.
template <typename Body>
int for_parts(WorkerPool* workers, int threads, int64_t bytes, int64_t count, Body&& body) {
  const int n = workers ? static_cast<int>(std::min<int64_t>(threads_for_bytes(threads, bytes),
                                                             std::max<int64_t>(count, 1)))
                        : 1;
  if (n <= 1) {
    body(int64_t{0}, count);
    return 1;
  }
  workers->run(n, [&](int i, int parts) {
    int64_t begin, end;
    part_range(count, i, parts, begin, end);
    body(begin, end);
  });
  return n;
}

}  // namespace epcomm::engine

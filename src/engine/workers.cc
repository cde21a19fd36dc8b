// engine/workers.cc — the copy-thread pool.
#include "engine/workers.h"

#include <algorithm>

#include "common/env.h"

namespace epcomm::engine {

WorkerPool::~WorkerPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void WorkerPool::run(int n, const std::function<void(int, int)>& job) {
  if (n <= 1) return job(0, 1);
  std::lock_guard<std::mutex> one(run_mu_);
  {
    std::lock_guard<std::mutex> lk(mu_);
    while (static_cast<int>(threads_.size()) < n - 1) {
      const int index = static_cast<int>(threads_.size()) + 1;
      threads_.emplace_back([this, index] { work(index); });
    }
    job_ = &job;
    parts_ = n;
    pending_ = n - 1;
    error_ = nullptr;
    ++generation_;
  }
  wake_.notify_all();
  std::exception_ptr mine;
  try {
    job(0, n);
  } catch (...) {
    mine = std::current_exception();
  }
  std::unique_lock<std::mutex> lk(mu_);
  done_.wait(lk, [&] { return pending_ == 0; });
  job_ = nullptr;
  if (mine) std::rethrow_exception(mine);
  if (error_) std::rethrow_exception(error_);
}

void WorkerPool::work(int index) {
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lk(mu_);
  while (true) {
    wake_.wait(lk, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    if (index >= parts_) continue;  // this job has fewer parts than there are workers
    const std::function<void(int, int)>* job = job_;
    const int parts = parts_;
    lk.unlock();
    std::exception_ptr e;
    try {
      (*job)(index, parts);
    } catch (...) {
      e = std::current_exception();
    }
    lk.lock();
    if (e && !error_) error_ = e;
    if (--pending_ == 0) done_.notify_one();
  }
}

int copy_threads(int requested, int local_ranks) {
  static const int hw = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  if (requested <= 0) return std::max(1, hw / std::max(1, local_ranks));
  return std::min(requested, 2 * hw);
}

int threads_for_bytes(int threads, int64_t bytes) {
  static const int64_t per_thread = env::parallel_bytes_per_thread();
  return static_cast<int>(std::clamp<int64_t>(bytes / per_thread, 1, std::max(threads, 1)));
}

}  // namespace epcomm::engine

// tools/epcomm/rank_tools.h — what a rank body of the tool needs around the library calls: gathering
// per-rank numbers at every rank, wall-clock timing, and progress lines on stderr.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "epcomm/bootstrap.h"

namespace epcomm::cli {

// Collective: every rank passes a vector of the same length; returns size() * n values, rank-major.
template <typename T>
std::vector<T> all_gather_values(Bootstrap& bootstrap, const std::vector<T>& mine) {
  static_assert(std::is_trivially_copyable_v<T>);
  std::vector<std::byte> bytes(mine.size() * sizeof(T));
  if (!bytes.empty()) std::memcpy(bytes.data(), mine.data(), bytes.size());
  std::vector<std::byte> all = bootstrap.all_gather(bytes);
  std::vector<T> out(all.size() / sizeof(T));
  if (!out.empty()) std::memcpy(out.data(), all.data(), out.size() * sizeof(T));
  return out;
}

inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Phase lines on stderr ("[epcomm demo +1.2s] combine"), shown only once the run has taken more than a
// second: earlier lines are held back and printed when that second passes, so fast runs stay silent.
// Owned by one rank's thread; phase() is called from that thread only, the helper thread only flushes.
class Progress {
 public:
  Progress(std::string command, bool enabled);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;
  void phase(const std::string& what);

 private:
  void print_locked(double at, const std::string& what);

  std::string command_;
  bool enabled_;
  double start_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool live_ = false, stop_ = false;
  std::vector<std::pair<double, std::string>> held_;
  std::thread timer_;
};

}  // namespace epcomm::cli

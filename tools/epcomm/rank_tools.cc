// tools/epcomm/rank_tools.cc — progress lines that appear only for runs longer than a second.
// A helper thread flushes the held lines when the second passes; phase() prints directly afterwards.
#include "rank_tools.h"

#include <cstdio>

namespace epcomm::cli {

Progress::Progress(std::string command, bool enabled)
    : command_(std::move(command)), enabled_(enabled), start_(now_s()) {
  if (!enabled_) return;
  timer_ = std::thread([this] {
    std::unique_lock<std::mutex> lock(mutex_);
    if (cv_.wait_for(lock, std::chrono::seconds(1), [this] { return stop_; })) return;
    live_ = true;
    for (const auto& [at, what] : held_) print_locked(at, what);
    held_.clear();
  });
}

Progress::~Progress() {
  if (!enabled_) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  timer_.join();
}

void Progress::phase(const std::string& what) {
  if (!enabled_) return;
  std::lock_guard<std::mutex> lock(mutex_);
  double at = now_s() - start_;
  if (live_)
    print_locked(at, what);
  else
    held_.emplace_back(at, what);
}

void Progress::print_locked(double at, const std::string& what) {
  std::fprintf(stderr, "[%s +%.2fs] %s\n", command_.c_str(), at, what.c_str());
  std::fflush(stderr);
}

}  // namespace epcomm::cli

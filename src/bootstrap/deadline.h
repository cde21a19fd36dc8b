// bootstrap/deadline.h — the point in time that bounds one bootstrap wait.
// Converts to condition-variable deadlines and to poll(2) millisecond timeouts.
#pragma once

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <string>
#include <vector>

namespace epcomm::bootstrap_detail {

using Clock = std::chrono::steady_clock;

class Deadline {
 public:
  explicit Deadline(std::chrono::milliseconds timeout) : at_(Clock::now() + timeout) {}

  Clock::time_point at() const { return at_; }
  bool expired() const { return Clock::now() >= at_; }

  // Milliseconds left, rounded up so a poll never wakes just before the deadline; 0 once expired.
  int poll_ms() const {
    auto left = at_ - Clock::now();
    if (left <= Clock::duration::zero()) return 0;
    auto ms = std::chrono::ceil<std::chrono::milliseconds>(left).count();
    return static_cast<int>(std::min<int64_t>(ms, INT_MAX));
  }

 private:
  Clock::time_point at_;
};

// "[1, 4, 7]": how every error message lists ranks.
inline std::string format_ranks(const std::vector<int>& ranks) {
  std::string s = "[";
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(ranks[i]);
  }
  return s + "]";
}

}  // namespace epcomm::bootstrap_detail

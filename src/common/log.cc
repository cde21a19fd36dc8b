// common/log.cc — EPCOMM_LOG: the level, read once, and whole-line writes to stderr.
#include "common/log.h"

#include <unistd.h>

#include "common/env.h"

namespace epcomm::log {
namespace {
const char* const kNames[] = {"error", "warn", "info", "debug"};  // indexed by Level
}  // namespace

namespace detail {

std::atomic<int> g_level{-1};

int read_level() {
  const auto v = env::get("EPCOMM_LOG");
  int l = static_cast<int>(Level::warn);
  if (v) {
    l = -1;
    for (int i = 0; i < 4; ++i)
      if (*v == kNames[i]) l = i;
    EPCOMM_CHECK(l >= 0, "EPCOMM_LOG: expected error, warn, info or debug, got '", *v, "'");
  }
  g_level.store(l, std::memory_order_relaxed);
  return l;
}

}  // namespace detail

const char* name(Level l) {
  return kNames[static_cast<int>(l)];
}

void write(Level l, int rank, const std::string& text) {
  using ::epcomm::detail::cat;
  std::string line;
  const size_t label_end = text.rfind("epcomm[", 0) == 0 ? text.find("] ") : std::string::npos;
  if (rank >= 0)
    line = cat("epcomm[rank ", rank, "] ", name(l), ": ", text, "\n");
  else if (label_end !=
           std::string::npos)  // the text carries its own label: "epcomm[ep 3] dispatch_v2#2: ..."
    line = cat(text.substr(0, label_end + 2), name(l), ": ", text.substr(label_end + 2), "\n");
  else
    line = cat("epcomm ", name(l), ": ", text, "\n");
  const char* p = line.data();
  size_t left = line.size();
  while (left > 0) {
    const ssize_t n = ::write(STDERR_FILENO, p, left);
    if (n <= 0) return;  // stderr closed or full: a log line is never worth an error
    p += n;
    left -= static_cast<size_t>(n);
  }
}

void reset_for_tests() {
  detail::g_level.store(-1, std::memory_order_relaxed);
}

}  // namespace epcomm::log

// common/log.h — one line per event to stderr, filtered by EPCOMM_LOG (error, warn, info, debug; default
// warn). EPCOMM_LOG(level, rank, parts...) formats nothing unless the level is on: when off it costs one load
// and one branch. Lines read "epcomm[rank 3] info: <what>". With rank -1 a text that starts with its own
// label (a call prefix, "epcomm[ep 3] dispatch_v2#2: ...") gets the level after that label; other texts none.
#pragma once

#include <atomic>
#include <string>

#include "common/check.h"

namespace epcomm::log {

enum class Level : int { error = 0, warn = 1, info = 2, debug = 3 };

namespace detail {
extern std::atomic<int> g_level;  // -1: EPCOMM_LOG not read yet
int read_level();                 // parses EPCOMM_LOG, caches it; throws InvalidUsage on a bad value
}  // namespace detail

// The level in force. Throws Error(InvalidUsage) naming EPCOMM_LOG and its value when that is not one of the
// four names: Buffers and group contexts call it when they are created, so a bad value fails there.
inline Level level() {
  const int l = detail::g_level.load(std::memory_order_relaxed);
  return static_cast<Level>(l >= 0 ? l : detail::read_level());
}
inline bool enabled(Level l) {
  const int cur = detail::g_level.load(std::memory_order_relaxed);
  return static_cast<int>(l) <= (cur >= 0 ? cur : detail::read_level());
}
const char* name(Level l);
// Writes one whole line (a single write(2), so lines of concurrent ranks do not interleave).
void write(Level l, int rank, const std::string& text);
// For tests: forget the cached level, so that the next call reads EPCOMM_LOG again.
void reset_for_tests();

}  // namespace epcomm::log

#define EPCOMM_LOG(lvl, rank, ...)                                                                 \
  do {                                                                                             \
    if (::epcomm::log::enabled(::epcomm::log::Level::lvl))                                         \
      ::epcomm::log::write(::epcomm::log::Level::lvl, (rank), ::epcomm::detail::cat(__VA_ARGS__)); \
  } while (0)

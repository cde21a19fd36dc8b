// multirank/driver.h — multi-rank test bodies written once, run as threads or as forked processes.
// A case is a function of a RankCtx; it throws (std::runtime_error or epcomm::Error) to fail.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>

#include "common/check.h"
#include "epcomm/buffer.h"

namespace epcomm::testing {

struct RankCtx {
  std::shared_ptr<Group> group;
  int rank = 0, size = 1;
  std::string launcher;  // "thread" or "fork"
};

// Options in order, so that a case can say {fork_only, min_ranks, killed_rank}.
struct CaseInfo {
  bool fork_only = false;
  int min_ranks = 1;
  int killed_rank = -1;  // this rank is expected to die by SIGKILL (fork only)
  std::function<void(RankCtx&)> body;
};

std::map<std::string, CaseInfo>& cases();

struct Registrar {
  Registrar(const char* name, CaseInfo info) { cases()[name] = std::move(info); }
};

// Thrown by a case whose preconditions the launch does not meet: the driver exits 77 (skipped).
struct Skip : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace epcomm::testing

#define MR_CONCAT2(a, b) a##b
#define MR_CONCAT(a, b) MR_CONCAT2(a, b)
// MR_CASE(name, {options}) { body using `ctx` }
#define MR_CASE(name, ...)                                                                                   \
  static void MR_CONCAT(mr_body_, __LINE__)(::epcomm::testing::RankCtx & ctx);                               \
  static ::epcomm::testing::Registrar MR_CONCAT(mr_reg_, __LINE__)(                                          \
      name, [] {                                                                                             \
        ::epcomm::testing::CaseInfo i __VA_ARGS__;                                                           \
        i.body = MR_CONCAT(mr_body_, __LINE__);                                                              \
        return i;                                                                                            \
      }());                                                                                                  \
  static void MR_CONCAT(mr_body_, __LINE__)([[maybe_unused]] ::epcomm::testing::RankCtx & ctx)

// Fails the case with file:line, the condition and a message.
#define REQUIRE(cond, ...)                                                                                     \
  do {                                                                                                         \
    if (!(cond))                                                                                               \
      throw std::runtime_error(::epcomm::detail::cat(__FILE__, ":", __LINE__, ": REQUIRE(" #cond ") failed: ", \
                                                     ##__VA_ARGS__));                                          \
  } while (0)

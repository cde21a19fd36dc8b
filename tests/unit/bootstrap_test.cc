// unit/bootstrap_test.cc — the in-process, local (fork) and callback bootstraps and both launchers.
// Multi-rank bodies report through their exit code, since a forked child's gtest state never reaches the
// parent.
#include <gtest/gtest.h>
#include <sched.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "epcomm/bootstrap.h"
#include "epcomm/error.h"
#include "epcomm/launch.h"

namespace epcomm {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using Launcher = std::vector<RankExit> (*)(int, const RankFn&, const LaunchOptions&);

std::byte pattern(int rank, int round, size_t i) {
  return static_cast<std::byte>(
      (rank * 131 + round * 17 + static_cast<int>(i) * 7 + static_cast<int>(i >> 8)) & 0xff);
}

std::vector<std::byte> payload(int rank, int round, size_t len) {
  std::vector<std::byte> v(len);
  for (size_t i = 0; i < len; ++i) v[i] = pattern(rank, round, i);
  return v;
}

// Payload lengths cycle through 0, odd sizes and one large round that exceeds a socket buffer.
size_t round_len(int round) {
  if (round == 3) return 300 * 1000;
  return static_cast<size_t>((round * 13) % 97);
}

long long ms_since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
}

// Exit codes name the first failed check, so a failing rank says what went wrong.
int gather_body(Bootstrap& b, int expected_size, int rounds) {
  if (b.size() != expected_size) return 10;
  if (b.rank() < 0 || b.rank() >= b.size()) return 11;
  for (int k = 0; k < rounds; ++k) {
    const size_t len = round_len(k);
    std::vector<std::byte> all = b.all_gather(payload(b.rank(), k, len));
    if (all.size() != len * static_cast<size_t>(b.size())) return 12;
    for (int r = 0; r < b.size(); ++r)
      for (size_t i = 0; i < len; ++i)
        if (all[static_cast<size_t>(r) * len + i] != pattern(r, k, i)) {
          std::fprintf(stderr, "rank %d round %d: byte %zu of rank %d differs\n", b.rank(), k, i, r);
          return 13;
        }
    if (k % 4 == 1) b.barrier();
  }
  // unique_id: equal on every rank.
  std::vector<std::byte> slot(128, std::byte{0});
  if (b.unique_id().empty() || b.unique_id().size() >= slot.size()) return 14;
  std::memcpy(slot.data(), b.unique_id().data(), b.unique_id().size());
  std::vector<std::byte> ids = b.all_gather(slot);
  for (int r = 0; r < b.size(); ++r)
    if (std::memcmp(ids.data() + r * slot.size(), slot.data(), slot.size()) != 0) return 15;
  b.barrier();
  return 0;
}

void expect_all_exit(const std::vector<RankExit>& exits, int n, int code) {
  ASSERT_EQ(exits.size(), static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(exits[r].rank, r);
    EXPECT_EQ(exits[r].exit_code, code) << "rank " << r;
    EXPECT_EQ(exits[r].signal, 0) << "rank " << r;
  }
}

std::string fresh_job_id() {
  static std::atomic<int> n{0};
  return "test-" + std::to_string(getpid()) + "-" + std::to_string(n++) + "-" +
         std::to_string(Clock::now().time_since_epoch().count());
}

// ---------------------------------------------------------------- both launchers, 1/2/3/8 ranks

struct LauncherCase {
  const char* name;
  Launcher launch;
};
void PrintTo(const LauncherCase& c, std::ostream* os) {
  *os << c.name;
}
const LauncherCase kThreads{"threads", &launch_threads};
const LauncherCase kLocal{"local", &launch_local};

class LaunchTest : public ::testing::TestWithParam<std::tuple<LauncherCase, int>> {
 protected:
  Launcher launch() const { return std::get<0>(GetParam()).launch; }
  int np() const { return std::get<1>(GetParam()); }
  bool is_local() const { return std::get<0>(GetParam()).launch == &launch_local; }
};

TEST_P(LaunchTest, AllGatherAndBarrierManyRounds) {
  const int n = np();
  LaunchOptions opts;
  opts.timeout = 20s;
  opts.bootstrap_timeout = 10s;
  auto exits = launch()(
      n, [n](std::unique_ptr<Bootstrap> b) { return gather_body(*b, n, 40); }, opts);
  expect_all_exit(exits, n, 0);
}

TEST_P(LaunchTest, CallbackBootstrapWrapsTheLauncherBootstrap) {
  const int n = np();
  LaunchOptions opts;
  opts.timeout = 20s;
  opts.bootstrap_timeout = 10s;
  auto exits = launch()(
      n,
      [n](std::unique_ptr<Bootstrap> inner) {
        Bootstrap* raw = inner.get();
        auto cb = make_callback_bootstrap(
            raw->rank(), raw->size(),
            [raw](const std::vector<std::byte>& bytes) { return raw->all_gather(bytes); },
            [raw] { raw->barrier(); });
        if (cb->rank() != raw->rank() || cb->size() != raw->size()) return 20;
        return gather_body(*cb, n, 12);
      },
      opts);
  expect_all_exit(exits, n, 0);
}

TEST_P(LaunchTest, MismatchedLengthsFailEveryRank) {
  const int n = np();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  LaunchOptions opts;
  opts.timeout = 20s;
  opts.bootstrap_timeout = 5s;
  opts.quiet = true;
  auto exits = launch()(
      n,
      [](std::unique_ptr<Bootstrap> b) {
        b->barrier();
        const size_t len = b->rank() == 1 ? 8 : 4;
        try {
          b->all_gather(std::vector<std::byte>(len));
        } catch (const Error& e) {
          std::string m = e.what();
          if (e.code() != ErrorCode::InvalidUsage) return 30;
          if (m.find("rank 1 contributed 8 bytes but rank 0 contributed 4 bytes") == std::string::npos)
            return 31;
          // The bootstrap is failed for good afterwards.
          try {
            b->barrier();
          } catch (const Error& again) {
            return again.code() == ErrorCode::Aborted ? 0 : 33;
          }
          return 34;
        }
        return 35;
      },
      opts);
  expect_all_exit(exits, n, 0);
}

TEST_P(LaunchTest, MissingRankTimesOutNamingIt) {
  const int n = np();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  const int missing = n - 1;
  LaunchOptions opts;
  opts.timeout = 15s;
  opts.bootstrap_timeout = 500ms;
  opts.quiet = true;
  auto exits = launch()(
      n,
      [missing, local = is_local()](std::unique_ptr<Bootstrap> b) {
        if (b->rank() == missing) {
          // Stays connected but never joins, so the others see a silent rank rather than a closed socket.
          std::this_thread::sleep_for(1500ms);
          return 0;
        }
        const auto t0 = Clock::now();
        try {
          b->all_gather(payload(b->rank(), 0, 16));
        } catch (const Error& e) {
          const long long took = ms_since(t0);
          const std::string m = e.what();
          if (e.code() != ErrorCode::Timeout) return 40;
          if (m.find("all_gather") == std::string::npos) return 41;
          if (m.find("ranks [" + std::to_string(missing) + "]") == std::string::npos) return 42;
          if (m.find("500 ms") == std::string::npos) return 43;
          // The first rank to time out fails the collective for everyone, so only the local job's rank 0
          // (the judge) is sure to have waited its whole deadline; later arrivals hear the verdict sooner.
          if (took > 2500 || (local && b->rank() == 0 && took < 450)) return 44;
          return 0;
        }
        return 45;
      },
      opts);
  expect_all_exit(exits, n, 0);
}

std::string case_name(const ::testing::TestParamInfo<std::tuple<LauncherCase, int>>& info) {
  return std::string(std::get<0>(info.param).name) + "_np" + std::to_string(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Bootstrap, LaunchTest,
                         ::testing::Combine(::testing::Values(kThreads, kLocal),
                                            ::testing::Values(1, 2, 3, 8)),
                         case_name);

// ---------------------------------------------------------------- in-process bootstrap

TEST(InProcessBootstrap, MissingRankTimesOutNamingOperationTimeoutAndRank) {
  auto world = make_in_process_world(3, 300ms);
  std::vector<std::string> messages(2);
  std::vector<ErrorCode> codes(2, ErrorCode::Internal);
  std::vector<std::thread> threads;
  const auto t0 = Clock::now();
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      auto b = make_in_process_bootstrap(world, r);
      try {
        b->barrier();
      } catch (const Error& e) {
        messages[r] = e.what();
        codes[r] = e.code();
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_LT(ms_since(t0), 2000);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(codes[r], ErrorCode::Timeout);
    EXPECT_NE(messages[r].find("bootstrap barrier"), std::string::npos) << messages[r];
    EXPECT_NE(messages[r].find("300 ms"), std::string::npos) << messages[r];
    EXPECT_NE(messages[r].find("ranks [2]"), std::string::npos) << messages[r];
  }
  // The late rank finds the world failed.
  auto late = make_in_process_bootstrap(world, 2);
  try {
    late->barrier();
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Aborted);
    EXPECT_NE(std::string(e.what()).find("failed earlier"), std::string::npos) << e.what();
  }
}

TEST(InProcessBootstrap, OutOfOrderCollectivesAreInvalidUsage) {
  LaunchOptions opts;
  opts.timeout = 10s;
  opts.bootstrap_timeout = 5s;
  auto exits = launch_threads(
      2,
      [](std::unique_ptr<Bootstrap> b) {
        try {
          if (b->rank() == 0)
            b->barrier();
          else
            b->all_gather({});
        } catch (const Error& e) {
          return e.code() == ErrorCode::InvalidUsage &&
                         std::string(e.what()).find("out of order") != std::string::npos
                     ? 0
                     : 50;
        }
        return 51;
      },
      opts);
  expect_all_exit(exits, 2, 0);
}

TEST(InProcessBootstrap, ArgumentsAreChecked) {
  EXPECT_THROW(make_in_process_world(0), Error);
  auto world = make_in_process_world(2);
  EXPECT_THROW(make_in_process_bootstrap(world, 2), Error);
  EXPECT_THROW(make_in_process_bootstrap(nullptr, 0), Error);
  auto b = make_in_process_bootstrap(world, 1);
  EXPECT_THROW(make_in_process_bootstrap(world, 1), Error);  // one live bootstrap per rank
}

TEST(InProcessBootstrap, UniqueIdDiffersBetweenWorlds) {
  auto a = make_in_process_bootstrap(make_in_process_world(1), 0);
  auto b = make_in_process_bootstrap(make_in_process_world(1), 0);
  EXPECT_NE(a->unique_id(), b->unique_id());
  EXPECT_EQ(a->all_gather(payload(0, 0, 5)), payload(0, 0, 5));
}

// ---------------------------------------------------------------- callback bootstrap

TEST(CallbackBootstrap, ResultOfWrongSizeIsInvalidUsage) {
  // Single rank: correct for the id exchange at construction, then one byte short.
  bool broken = false;
  auto b = make_callback_bootstrap(
      0, 1,
      [&broken](const std::vector<std::byte>& bytes) {
        std::vector<std::byte> out = bytes;
        if (broken) out.pop_back();
        return out;
      },
      [] {});
  broken = true;
  try {
    b->all_gather(std::vector<std::byte>(10));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_EQ(e.code(), ErrorCode::InvalidUsage);
    EXPECT_NE(m.find("returned 9 bytes"), std::string::npos) << m;
    EXPECT_NE(m.find("= 10 bytes"), std::string::npos) << m;
  }
}

TEST(CallbackBootstrap, ArgumentsAreChecked) {
  auto ag = [](const std::vector<std::byte>& b) { return b; };
  EXPECT_THROW(make_callback_bootstrap(1, 1, ag, [] {}), Error);
  EXPECT_THROW(make_callback_bootstrap(0, 1, nullptr, [] {}), Error);
  EXPECT_THROW(make_callback_bootstrap(0, 1, ag, nullptr), Error);
}

// ---------------------------------------------------------------- local bootstrap

TEST(LocalBootstrap, RankThatNeverConnectsIsNamed) {
  const std::string job = fresh_job_id();
  std::vector<std::string> messages(2);
  std::vector<ErrorCode> codes(2, ErrorCode::Internal);
  std::vector<std::thread> threads;
  const auto t0 = Clock::now();
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      try {
        make_local_bootstrap(job, r, 3, 500ms);
      } catch (const Error& e) {
        messages[r] = e.what();
        codes[r] = e.code();
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_LT(ms_since(t0), 2500);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(codes[r], ErrorCode::Timeout) << messages[r];
    EXPECT_NE(messages[r].find("connect"), std::string::npos) << messages[r];
    EXPECT_NE(messages[r].find("ranks [2]"), std::string::npos) << messages[r];
  }
}

TEST(LocalBootstrap, MissingRootIsNamed) {
  try {
    make_local_bootstrap(fresh_job_id(), 1, 2, 200ms);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Timeout);
    EXPECT_NE(std::string(e.what()).find("rank 0 is not listening"), std::string::npos) << e.what();
  }
}

TEST(LocalBootstrap, JobIdIsReusableAndExclusive) {
  const std::string job = fresh_job_id();
  for (int round = 0; round < 2; ++round) {
    std::unique_ptr<Bootstrap> b0, b1;
    std::thread t([&] { b1 = make_local_bootstrap(job, 1, 2, 5s); });
    b0 = make_local_bootstrap(job, 0, 2, 5s);
    t.join();
    EXPECT_EQ(b0->unique_id(), b1->unique_id());
    // While this job's rank 0 lives, the name is taken.
    try {
      make_local_bootstrap(job, 0, 2, 5s);
      FAIL() << "expected an error";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::InvalidUsage) << e.what();
    }
  }  // destroying rank 0 frees the name: the second round binds it again
}

TEST(LocalBootstrap, ArgumentsAreChecked) {
  EXPECT_THROW(make_local_bootstrap("", 0, 1), Error);
  EXPECT_THROW(make_local_bootstrap("x", 1, 1), Error);
  EXPECT_THROW(make_local_bootstrap("x", 0, 0), Error);
  EXPECT_THROW(make_local_bootstrap("x", 0, 1, 0ms), Error);
}

// ---------------------------------------------------------------- launchers

TEST(LaunchLocal, KilledChildIsReportedAndItsPeerNamesIt) {
  LaunchOptions opts;
  opts.timeout = 20s;
  opts.bootstrap_timeout = 10s;
  const auto t0 = Clock::now();
  auto exits = launch_local(
      3,
      [](std::unique_ptr<Bootstrap> b) {
        b->barrier();
        if (b->rank() == 1) ::raise(SIGKILL);
        try {
          b->all_gather(payload(b->rank(), 0, 8));
        } catch (const Error& e) {
          // Rank 0 sees the closed socket; rank 2 hears rank 0's verdict. Both long before the 10 s deadline.
          const std::string m = e.what();
          if (e.code() != ErrorCode::Aborted) return 60;
          if (m.find("rank 1 closed") == std::string::npos) return 61;
          return 0;
        }
        return 62;
      },
      opts);
  EXPECT_LT(ms_since(t0), 5000);
  ASSERT_EQ(exits.size(), 3u);
  EXPECT_EQ(exits[0].exit_code, 0);
  EXPECT_EQ(exits[1].signal, SIGKILL);
  EXPECT_EQ(exits[1].exit_code, 128 + SIGKILL);
  EXPECT_EQ(exits[2].exit_code, 0);
}

TEST(LaunchLocal, TimeoutKillsTheRemainingRanks) {
  LaunchOptions opts;
  opts.timeout = 300ms;
  opts.quiet = true;
  const auto t0 = Clock::now();
  auto exits = launch_local(
      2,
      [](std::unique_ptr<Bootstrap> b) {
        if (b->rank() == 1) std::this_thread::sleep_for(30s);
        return 7;
      },
      opts);
  EXPECT_LT(ms_since(t0), 5000);
  ASSERT_EQ(exits.size(), 2u);
  EXPECT_EQ(exits[0].exit_code, 7);
  EXPECT_EQ(exits[0].signal, 0);
  EXPECT_EQ(exits[1].signal, SIGKILL);
}

TEST(Launchers, EscapingExceptionIsExitCodeOneWithRankPrefix) {
  for (Launcher launch : {&launch_threads, &launch_local}) {
    ::testing::internal::CaptureStderr();  // redirects fd 2, which forked children inherit
    auto exits = launch(
        2,
        [](std::unique_ptr<Bootstrap> b) -> int {
          if (b->rank() == 1) throw std::runtime_error("boom from the test");
          return 0;
        },
        LaunchOptions{});
    const std::string err = ::testing::internal::GetCapturedStderr();
    ASSERT_EQ(exits.size(), 2u);
    EXPECT_EQ(exits[0].exit_code, 0);
    EXPECT_EQ(exits[1].exit_code, 1);
    EXPECT_NE(err.find("[rank 1] boom from the test"), std::string::npos) << err;
  }
}

TEST(LaunchThreads, TimeoutAbortsRanksBlockedInTheBootstrap) {
  LaunchOptions opts;
  opts.timeout = 300ms;
  opts.bootstrap_timeout = 60s;
  opts.quiet = true;
  const auto t0 = Clock::now();
  auto exits = launch_threads(
      2,
      [](std::unique_ptr<Bootstrap> b) {
        if (b->rank() == 1) {
          std::this_thread::sleep_for(600ms);
          return 0;
        }
        try {
          b->barrier();
        } catch (const Error& e) {
          return e.code() == ErrorCode::Aborted ? 3 : 4;
        }
        return 5;
      },
      opts);
  EXPECT_LT(ms_since(t0), 3000);
  ASSERT_EQ(exits.size(), 2u);
  EXPECT_EQ(exits[0].exit_code, 3);
  EXPECT_EQ(exits[1].exit_code, 0);
}

// The CPUs the calling thread may run on.
std::vector<int> my_cpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) != 0) return {};
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}

// LaunchBind::cores as launch.h states it: with at least as many CPUs as ranks, rank r runs on the r-th of
// `ranks` equal groups of consecutive CPUs of the launcher's mask; otherwise on the launcher's mask.
std::vector<int> expected_share(const std::vector<int>& all, int rank, int ranks) {
  const size_t per = all.size() / static_cast<size_t>(ranks);
  if (per == 0) return all;
  return std::vector<int>(all.begin() + static_cast<std::ptrdiff_t>(per * rank),
                          all.begin() + static_cast<std::ptrdiff_t>(per * (rank + 1)));
}

TEST(Launchers, BindCoresGivesEachRankItsShareOfTheCpus) {
  const std::vector<int> all = my_cpus();
  ASSERT_FALSE(all.empty());
  const int n = static_cast<int>(all.size());
  for (Launcher launch : {&launch_threads, &launch_local})
    for (LaunchBind bind : {LaunchBind::cores, LaunchBind::none})
      for (int ranks : {1, 2, n, n + 1}) {
        LaunchOptions opts;
        opts.bind = bind;
        auto exits = launch(
            ranks,
            [&](std::unique_ptr<Bootstrap> b) {
              const std::vector<int> want =
                  bind == LaunchBind::cores ? expected_share(all, b->rank(), ranks) : all;
              return my_cpus() == want ? 0 : 7;
            },
            opts);
        SCOPED_TRACE(std::string(launch == &launch_local ? "local" : "threads") +
                     (bind == LaunchBind::cores ? " cores " : " none ") + std::to_string(ranks) + " ranks");
        expect_all_exit(exits, ranks, 0);
        EXPECT_EQ(my_cpus(), all) << "the launching thread keeps its mask";
        for (int r = 0; r < ranks; ++r)  // what the launcher reports (empty: unbound)
          EXPECT_EQ(launch_cpu_share(bind, r, ranks), bind == LaunchBind::cores && n >= ranks
                                                          ? expected_share(all, r, ranks)
                                                          : std::vector<int>{});
      }
}

TEST(Launchers, LaunchLocalGivesEachLaunchAFreshJob) {
  // Two launches in a row must not collide on the socket name (each draws a fresh job id).
  for (int i = 0; i < 2; ++i) {
    auto exits = launch_local(2, [](std::unique_ptr<Bootstrap> b) { return gather_body(*b, 2, 4); });
    expect_all_exit(exits, 2, 0);
  }
}

}  // namespace
}  // namespace epcomm

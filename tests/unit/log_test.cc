// tests/unit/log_test.cc — EPCOMM_LOG: parsing of the level, the error for a bad value, and the lines written
// to stderr (captured through a pipe), with and without a rank and with a call prefix as the label.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "common/log.h"
#include "epcomm/error.h"

namespace epcomm {
namespace {

class LogTest : public ::testing::Test {
 protected:
  void TearDown() override {
    unsetenv("EPCOMM_LOG");
    log::reset_for_tests();
  }
  static void set(const char* value) {
    setenv("EPCOMM_LOG", value, 1);
    log::reset_for_tests();
  }
  // What `fn` writes to stderr.
  template <typename Fn>
  static std::string capture(Fn fn) {
    int fds[2];
    EXPECT_EQ(pipe(fds), 0);
    const int saved = dup(STDERR_FILENO);
    dup2(fds[1], STDERR_FILENO);
    close(fds[1]);
    fn();
    dup2(saved, STDERR_FILENO);
    close(saved);
    std::string out;
    char buf[4096];
    fcntl(fds[0], F_SETFL, O_NONBLOCK);
    for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) out.append(buf, static_cast<size_t>(n));
    close(fds[0]);
    return out;
  }
};

TEST_F(LogTest, DefaultIsWarn) {
  unsetenv("EPCOMM_LOG");
  log::reset_for_tests();
  EXPECT_EQ(log::level(), log::Level::warn);
  EXPECT_TRUE(log::enabled(log::Level::error));
  EXPECT_TRUE(log::enabled(log::Level::warn));
  EXPECT_FALSE(log::enabled(log::Level::info));
}

TEST_F(LogTest, EveryNameSetsItsLevel) {
  const std::pair<const char*, log::Level> cases[] = {{"error", log::Level::error},
                                                      {"warn", log::Level::warn},
                                                      {"info", log::Level::info},
                                                      {"debug", log::Level::debug}};
  for (const auto& [name, level] : cases) {
    set(name);
    EXPECT_EQ(log::level(), level) << name;
    EXPECT_EQ(std::string(log::name(level)), name);
  }
  set("error");
  EXPECT_FALSE(log::enabled(log::Level::warn));
  set("debug");
  EXPECT_TRUE(log::enabled(log::Level::debug));
}

TEST_F(LogTest, BadValueNamesTheVariableAndTheValue) {
  set("verbose");
  try {
    log::level();
    FAIL() << "EPCOMM_LOG=verbose was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidUsage);
    EXPECT_NE(std::string(e.what()).find("EPCOMM_LOG: expected error, warn, info or debug, got 'verbose'"),
              std::string::npos)
        << e.what();
  }
}

TEST_F(LogTest, LinesCarryTheRankOrTheirOwnLabel) {
  set("info");
  const std::string out = capture([] {
    EPCOMM_LOG(info, 3, "Buffer: ", 4, " ranks");
    EPCOMM_LOG(debug, 3, "not written at info");
    EPCOMM_LOG(warn, -1, "epcomm[ep 2 tp 1] dispatch_v2#5: ", "done");
    EPCOMM_LOG(error, -1, "no label");
  });
  EXPECT_EQ(out,
            "epcomm[rank 3] info: Buffer: 4 ranks\n"
            "epcomm[ep 2 tp 1] warn: dispatch_v2#5: done\n"
            "epcomm error: no label\n");
}

TEST_F(LogTest, NothingIsFormattedWhenTheLevelIsOff) {
  set("warn");
  int evaluated = 0;
  auto costly = [&] {
    ++evaluated;
    return std::string("x");
  };
  const std::string out = capture([&] { EPCOMM_LOG(debug, 0, costly()); });
  EXPECT_EQ(evaluated, 0);
  EXPECT_EQ(out, "");
}

}  // namespace
}  // namespace epcomm

// common/process.cc — process identity and state from /proc.
#include "common/process.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace epcomm::process {
namespace {

struct Stat {
  bool ok = false;
  char state = '?';
  uint64_t start_ticks = 0;
};

// Fields 3 (state) and 22 (starttime) of /proc/<pid>/stat; `gone` is set when the pid does not exist.
Stat read_stat(int32_t pid, bool& gone) {
  Stat s;
  gone = false;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  const int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd == -1) {
    gone = errno == ENOENT || errno == ESRCH;
    return s;
  }
  char buf[1024];
  const ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) {
    gone = n < 0 && errno == ESRCH;
    return s;
  }
  buf[n] = '\0';
  const char* p = std::strrchr(buf, ')');  // the command name may hold spaces and parentheses
  if (!p || p[1] != ' ') return s;
  p += 2;
  s.state = *p;
  for (int field = 3; field < 22 && p; ++field) {
    p = std::strchr(p, ' ');
    if (p) ++p;
  }
  if (!p) return s;
  s.start_ticks = std::strtoull(p, nullptr, 10);
  s.ok = true;
  return s;
}

uint64_t namespace_of(const char* pid_dir) {
  char path[64];
  std::snprintf(path, sizeof path, "%s/ns/pid", pid_dir);
  struct stat st {};
  return stat(path, &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

}  // namespace

Id self() {
  Id id;
  id.pid = static_cast<int32_t>(getpid());
  bool gone = false;
  id.start_ticks = read_stat(id.pid, gone).start_ticks;
  id.pid_namespace = namespace_of("/proc/self");
  return id;
}

State state(const Id& id) {
  if (id.pid <= 0) return State::running;
  bool gone = false;
  const Stat s = read_stat(id.pid, gone);
  if (gone) return State::gone;
  if (!s.ok) return State::running;
  if (s.state == 'Z' || s.state == 'X' || (id.start_ticks && s.start_ticks != id.start_ticks))
    return State::gone;
  if (s.state == 'T' || s.state == 't') return State::stopped;
  return State::running;
}

const char* state_name(State s) {
  switch (s) {
    case State::running:
      return "running";
    case State::stopped:
      return "stopped";
    case State::gone:
      return "gone";
  }
  return "?";
}

}  // namespace epcomm::process

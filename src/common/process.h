// common/process.h — which process is which, and whether it still runs: lets a rank tell a peer on its host
// that was killed (gone) or stopped (SIGSTOP, a debugger) from one that is merely slow.
#pragma once

#include <cstdint>

namespace epcomm::process {

// A process, told apart from a later one that reuses its pid by its start time (clock ticks since boot).
struct Id {
  int32_t pid = 0;
  uint64_t start_ticks = 0;
  uint64_t pid_namespace = 0;  // inode of /proc/<pid>/ns/pid: pids compare only within one namespace
};

enum class State { running, stopped, gone };

// This process.
Id self();
// What `id` is doing now: gone once it exited or was killed (a zombie counts as gone) or its pid belongs to
// another process; stopped while SIGSTOP or a tracer holds it. Never throws; a /proc that cannot be read
// reads as running (nothing is concluded from missing information).
State state(const Id& id);
const char* state_name(State s);

}  // namespace epcomm::process

// common/env.cc — the environment knobs.
#include "common/env.h"

#include <algorithm>
#include <cstdlib>
#include <thread>

#include "common/check.h"

namespace epcomm::env {

const Knob kKnobs[] = {
    {"EPCOMM_TIMEOUT_S", "100",
     "deadline in seconds of every wait on a peer (restarts when the peer progresses)"},
    {"EPCOMM_POISON_OUTPUTS", "0", "1: fill every output with 0xFF bytes before writing it (debug, tests)"},
    {"DEEP_NORMAL_MODE_USE_INT8_QUANT", "0", "1: dispatch quantizes to int8 when quant_mode is not given"},
    {"EPCOMM_NORMAL_INT8", "0", "same as DEEP_NORMAL_MODE_USE_INT8_QUANT"},
    {"EPCOMM_SPIN", "auto",
     "polls of a doorbell before a waiter sleeps on its futex (auto: 20000, about 0.5 ms, or 16 when ranks "
     "outnumber "
     "cores)"},
    {"EPCOMM_RANKS_PER_NODE", "0",
     "node partition when a Buffer or a distribute-v2 group context is created with ranks_per_node = 0: "
     "P > 0 splits the ranks into nodes of P consecutive ranks (virtual nodes on one host talk over UCX "
     "only; a v2 group of at most P ranks is one node); 0 = one node per host"},
    {"EPCOMM_UCX_WRITE", "am",
     "how the UCX transport writes into a peer's region: am (active messages) or put (RMA puts, then a "
     "signal "
     "message); docs/internode.md"},
    {"EPCOMM_SHM", "auto",
     "how ranks on one host share their segments: memfd (anonymous, opened by peers through "
     "/proc/<pid>/fd; nothing can be left behind), named (POSIX names in /dev/shm, unlinked once every rank "
     "has mapped them; for ranks in different PID namespaces), auto (memfd, else named on every rank)"},
    {"EPCOMM_OUTPUT_ARENA", "auto",
     "address space of every rank's output arena when BufferOptions::num_output_arena_bytes is -1: auto (the "
     "host's physical memory), 0 (none: outputs come from the allocator and dispatch stages every row), or a "
     "byte count; docs/design.md"},
    {"EPCOMM_COMBINE_SHARING", "auto",
     "whether a rank done with its own tokens of a direct combine reduces the last chunks of a slower "
     "rank's tokens: auto (yes, unless the host's ranks exceed twice its cores), 1 (always), 0 (never); "
     "for A/B measurements, results are the same bits either way; docs/design.md"},
    {"EPCOMM_LOG", "warn",
     "what epcomm writes to stderr, one line per event prefixed with the rank: error, warn, info (also how "
     "each Buffer and group context was set up) or debug (also every call: the path it took, bytes, time); "
     "other values are an error; docs/env.md"},
    {"EPCOMM_WARMUP", "1",
     "1: a Buffer (normal mode; low-latency mode too when enabled) and a one-node operator group context "
     "make one-token round trips at the end of their creation, so that their first call runs like the next; "
     "0: none; docs/design.md"},
    {"EPCOMM_ARENA_SETTLE", "1",
     "1: a Buffer with an output reserve passes once over every reserve it may write rows into, through "
     "each of its mappings, when it is created (on some virtual machines the first pass of stores through "
     "a mapping of shared pages is 30-60x slower than the next); 0: no pass; docs/design.md"},
};
const int kNumKnobs = static_cast<int>(sizeof(kKnobs) / sizeof(kKnobs[0]));

std::optional<std::string> get(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return std::nullopt;
  return std::string(v);
}

bool get_flag(const char* name) {
  auto v = get(name);
  if (!v) return false;
  std::string s = *v;
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s == "1" || s == "true" || s == "yes" || s == "on";
}

double timeout_s() {
  auto v = get("EPCOMM_TIMEOUT_S");
  if (!v) return 100.0;
  char* end = nullptr;
  double d = std::strtod(v->c_str(), &end);
  EPCOMM_CHECK(end && *end == '\0' && d > 0, "EPCOMM_TIMEOUT_S: expected a positive number of seconds, got '",
               *v, "'");
  return d;
}

bool poison_outputs() {
  return get_flag("EPCOMM_POISON_OUTPUTS");
}

bool normal_int8() {
  auto a = get("DEEP_NORMAL_MODE_USE_INT8_QUANT");
  auto b = get("EPCOMM_NORMAL_INT8");
  return (a && *a == "1") || (b && *b == "1");
}

std::string shm_mode() {
  auto v = get("EPCOMM_SHM");
  if (!v) return "auto";
  EPCOMM_CHECK(*v == "auto" || *v == "memfd" || *v == "named",
               "EPCOMM_SHM: expected auto, memfd or named, got '", *v, "'");
  return *v;
}

// A non-negative integer variable, `fallback` when unset.
static int64_t count_of(const char* name, int64_t fallback) {
  auto v = get(name);
  if (!v) return fallback;
  char* end = nullptr;
  const long long n = std::strtoll(v->c_str(), &end, 10);
  EPCOMM_CHECK(end && end != v->c_str() && *end == '\0' && n >= 0, name, ": expected an integer >= 0, got '",
               *v, "'");
  return n;
}

int num_threads_default() {
  return static_cast<int>(std::min<int64_t>(count_of("EPCOMM_NUM_THREADS", 0), 1 << 20));
}

int64_t parallel_bytes_per_thread() {
  return std::max<int64_t>(count_of("EPCOMM_PARALLEL_BYTES", int64_t{2} << 20), 1);
}

int64_t output_arena_bytes() {
  auto v = get("EPCOMM_OUTPUT_ARENA");
  if (!v || *v == "auto") return -1;
  char* end = nullptr;
  const long long n = std::strtoll(v->c_str(), &end, 10);
  EPCOMM_CHECK(end && *end == '\0' && n >= 0,
               "EPCOMM_OUTPUT_ARENA: expected auto or a byte count >= 0, got '", *v, "'");
  return n;
}

int combine_sharing() {
  auto v = get("EPCOMM_COMBINE_SHARING");
  if (!v || *v == "auto") return -1;
  EPCOMM_CHECK(*v == "0" || *v == "1", "EPCOMM_COMBINE_SHARING: expected auto, 0 or 1, got '", *v, "'");
  return *v == "1";
}

bool warm_up() {
  auto v = get("EPCOMM_WARMUP");
  if (!v) return true;
  EPCOMM_CHECK(*v == "0" || *v == "1", "EPCOMM_WARMUP: expected 0 or 1, got '", *v, "'");
  return *v == "1";
}

bool arena_settle() {
  auto v = get("EPCOMM_ARENA_SETTLE");
  if (!v) return true;
  EPCOMM_CHECK(*v == "0" || *v == "1", "EPCOMM_ARENA_SETTLE: expected 0 or 1, got '", *v, "'");
  return *v == "1";
}

int ranks_per_node() {
  auto v = get("EPCOMM_RANKS_PER_NODE");
  if (!v) return 0;
  char* end = nullptr;
  long p = std::strtol(v->c_str(), &end, 10);
  EPCOMM_CHECK(end && *end == '\0' && p >= 0 && p < (1 << 20),
               "EPCOMM_RANKS_PER_NODE: expected a number of ranks >= 0, got '", *v, "'");
  return static_cast<int>(p);
}

bool ranks_outnumber_cores(int local_ranks, int per_core) {
  // Read once: it opens a file in /sys (10 µs under the development VM's hypervisor), and combine asks on
  // every call.
  static const unsigned hw = std::thread::hardware_concurrency();
  return hw != 0 && static_cast<unsigned>(local_ranks) > hw * static_cast<unsigned>(per_core);
}

int spin_count(int local_ranks) {
  if (auto v = get("EPCOMM_SPIN")) {
    int x = std::atoi(v->c_str());
    return x < 0 ? 0 : x;
  }
  // Spinning only pays when every rank has a core of its own; oversubscribed waiters sleep at once.
  return ranks_outnumber_cores(local_ranks) ? 16 : 20000;
}

std::string ucx_write_mode() {
  auto v = get("EPCOMM_UCX_WRITE");
  if (!v) return "am";
  EPCOMM_CHECK(*v == "am" || *v == "put", "EPCOMM_UCX_WRITE: expected 'am' or 'put', got '", *v, "'");
  return *v;
}

}  // namespace epcomm::env

// common/env.h — every environment variable epcomm reads, declared once with its default and meaning.
// docs/env.md lists the same table for users.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace epcomm::env {

struct Knob {
  const char* name;
  const char* default_value;
  const char* meaning;
};

// The table of knobs (for docs and `epcomm --help`).
extern const Knob kKnobs[];
extern const int kNumKnobs;

// Raw value, or nullopt when unset or empty.
std::optional<std::string> get(const char* name);
bool get_flag(const char* name);  // "1", "true", "yes", "on" (any case) are true

// Typed accessors for the knobs.
double timeout_s();     // EPCOMM_TIMEOUT_S, default 100
bool poison_outputs();  // EPCOMM_POISON_OUTPUTS
bool normal_int8();     // DEEP_NORMAL_MODE_USE_INT8_QUANT or EPCOMM_NORMAL_INT8 == "1"
// Whether `local_ranks` ranks on this host outnumber `per_core` times its hardware threads (per_core 1: a
// rank that waits should then give its core to the one it waits for).
bool ranks_outnumber_cores(int local_ranks, int per_core = 1);
int spin_count(int local_ranks);      // EPCOMM_SPIN: polls before a waiter sleeps on its futex
std::string ucx_write_mode();         // EPCOMM_UCX_WRITE: "am" (default) or "put"
int ranks_per_node();                 // EPCOMM_RANKS_PER_NODE, default 0 (one node per host)
std::string shm_mode();               // EPCOMM_SHM: "auto" (default), "memfd" or "named"
int num_threads_default();            // EPCOMM_NUM_THREADS: Config::num_threads's class default (0 = auto)
int64_t parallel_bytes_per_thread();  // EPCOMM_PARALLEL_BYTES: bytes a call moves per copy thread (2 MiB)
int64_t output_arena_bytes();         // EPCOMM_OUTPUT_ARENA: -1 = auto (default), else bytes (0 = none)
int combine_sharing();                // EPCOMM_COMBINE_SHARING: -1 = auto (default), 1 = always, 0 = never
bool warm_up();       // EPCOMM_WARMUP: one-token round trips at a Buffer's creation (default 1)
bool arena_settle();  // EPCOMM_ARENA_SETTLE: pass over the output reserves at creation (default 1)

}  // namespace epcomm::env

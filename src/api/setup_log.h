// api/setup_log.h — the EPCOMM_LOG=info line a Buffer or a group context writes once it is set up, and the
// EPCOMM_LOG=debug line of every call (path, bytes, time): one formatter for both API families.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/op_context.h"
#include "transport/network.h"
#include "transport/transport.h"

namespace epcomm::detail {

// "1.5 GiB", "64 MiB", "512 B".
std::string bytes_str(int64_t bytes);
// "0-3", "0,2,5", "none".
std::string rank_list(const std::vector<int>& ranks);
// The ranks, the node partition and how this rank reaches each peer: "4 ranks, 2 nodes of 2 (this rank on
// node 1 with ranks 2-3); shm (memfd, spin 20000) to ranks 2-3; ucx am over tcp to ranks 0 (rail peers);
// ranks 1 through a rail peer's node".
std::string describe_ranks(int rank, const std::vector<int>& node_of_rank, const Transport& tp,
                           const Network* network);

// Copy counters at the start of a call, and the path the call took told from their change.
struct CounterSnapshot {
  int64_t staged = 0, in_place = 0, pushed = 0, copied_rows = 0, in_place_rows = 0, direct = 0, shared = 0;
};
CounterSnapshot snapshot(const engine::CopyCounters& c);
// "pushed 4096 tokens into the receivers' outputs", "staged 12 tokens", "direct 4096 tokens, 310 shared" ...
std::string describe_path(const CounterSnapshot& before, const CounterSnapshot& after);
// Milliseconds since `t0`, with three decimals.
std::string elapsed_ms(std::chrono::steady_clock::time_point t0);

}  // namespace epcomm::detail

// engine/pair_exchange.h — the TP pair's record exchange: each of the two ranks stages its records in its own
// segment (two alternating halves) and the other pulls them, so both directions move at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "engine/op_context.h"

namespace epcomm::engine::v2 {

// After exchange_headers on a 2-rank context: sends `n_send` records of `rec_bytes` (pack(i, dst) writes
// record i) and receives the peer's `n_recv` records (unpack(i, src) reads record i). Returns once both
// directions are complete, including the peer's acknowledgement of our last window (so the next call may
// reuse the segment). Timeouts name the peer.
void pair_exchange(OpContext& ctx, const char* phase, int64_t n_send, int64_t n_recv, size_t rec_bytes,
                   const std::function<void(int64_t, uint8_t*)>& pack,
                   const std::function<void(int64_t, const uint8_t*)>& unpack);

}  // namespace epcomm::engine::v2

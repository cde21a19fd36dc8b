// api/buffer_impl.h — Buffer internals: its communication context (api/comm_context.h: transport, network,
// segment map, sequence number, failed state), the communication thread that runs operations one at a time
// in call order, the allocator and the copy threads.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "api/comm_context.h"
#include "common/env.h"
#include "engine/combine.h"
#include "engine/dispatch.h"
#include "engine/internode.h"
#include "engine/protocol.h"
#include "engine/workers.h"
#include "epcomm/buffer.h"
#include "transport/network.h"
#include "transport/transport.h"

namespace epcomm {

namespace ll {
struct MaskState;  // api/low_latency_masks.h
}

struct Buffer::Impl : detail::CommContext {
  std::shared_ptr<Group> group;
  BufferOptions options;
  std::shared_ptr<Allocator> allocator;
  engine::CopyCounters counters;
  Buffer::InternodeCounters internode_base;  // what the creation's warm-up sent (api/warm_up.cc)
  engine::WorkerPool workers;  // copy threads (Config::num_threads), started when a call first needs them
  std::shared_ptr<int> alive = std::make_shared<int>(0);  // handles hold a weak_ptr
  bool destroyed = false;
  // EPCOMM_POISON_OUTPUTS, read once when the Buffer is created (a getenv on every call cost more than a
  // 1-token call's bookkeeping in processes with large environments).
  const bool poison = env::poison_outputs();
  std::once_flag masks_once;
  std::shared_ptr<ll::MaskState> masks;  // low-latency rank masks (ll::mask_state creates them)

  // Communication thread.
  std::thread comm;
  std::mutex qm;
  std::condition_variable qcv;
  std::deque<std::function<void()>> queue;
  bool stop = false;

  std::string describe() const;  // the EPCOMM_LOG=info set-up line
  uint8_t* input_area() const;   // this rank's shared combine-input area
  uint8_t* dispatch_input_area() const;
  int64_t input_bytes() const { return static_cast<int64_t>(segment.combine_input_bytes); }
  int64_t dispatch_input_bytes() const { return static_cast<int64_t>(segment.dispatch_input_bytes); }
  void start_comm_thread();
  void stop_comm_thread() noexcept;
  void enqueue(std::function<void()> task);
  std::string prefix(const char* op, uint64_t s) const;
  void check_usable(const char* op);
};

namespace detail {
struct EventState;
// The creation's warm-up round trips (api/warm_up.cc; EPCOMM_WARMUP). Collective.
void warm_up(Buffer& buf, const BufferOptions& options);
}  // namespace detail

// One collective call's work on the communication thread: moves the data, calls on_shapes() once the
// outputs exist (before any payload moves), returns the bytes of its outputs (for the debug log).
using OpBody = std::function<int64_t(engine::OpContext&, const std::function<void()>& on_shapes)>;

// Runs `body` for sequence number `s` on the communication thread (on the caller's thread when `sync` and
// the communication thread is idle), under the Buffer's one failure policy (buffer.cc). A non-empty
// `failed_message` (this rank's validation failed) publishes a failed header instead of running it. `st`:
// the call's completion state, when the caller made it first (so that the body can signal progress in it).
std::shared_ptr<detail::EventState> launch(Buffer::Impl& b, uint64_t s, engine::OpKind kind,
                                           std::optional<EventOverlap> previous, std::string failed_message,
                                           bool sync, OpBody body,
                                           std::shared_ptr<detail::EventState> st = nullptr);

// launch() of a combine (normal or low-latency): a validation error `verr` fails the call on every rank and
// is thrown here; a synchronous call (!async_finish) waits and rethrows the call's error.
std::shared_ptr<detail::EventState> launch_combine(Buffer::Impl& b, uint64_t s, engine::OpKind kind,
                                                   std::optional<EventOverlap> previous,
                                                   const std::optional<Error>& verr, bool async_finish,
                                                   std::shared_ptr<engine::CombineInput> in,
                                                   std::shared_ptr<engine::CombineOutput> out);

// Buffer::fail_call of a low-latency call while rank masks or shrink are in use: publishes the failed header
// to the live ranks only (after the shrink agreement round) and returns true; false (nothing done) without
// masks.
bool fail_low_latency_among_live(Buffer::Impl& b, uint64_t s, engine::OpKind kind, const std::string& msg);

// The caller's side of a launched call: a validation error `verr` is thrown once the call has published it
// (the peers raise too); a synchronous call (!async_finish) waits and rethrows the call's error.
void await_launch(const std::shared_ptr<detail::EventState>& st, const std::optional<Error>& verr,
                  bool async_finish);

// Fills the engine input of a fresh or cached dispatch from the user's arguments; throws InvalidUsage
// naming the argument, the expected and the actual value (no rank prefix: the caller adds it).
void prepare_dispatch(const Buffer::Impl& b, const DispatchArgs& a, engine::DispatchInput& in,
                      ReceiveOrder& order);
// A fresh expert_major dispatch whose top-k ids the caller has normalized and checked (`ids`, [T * K],
// -1 for none; low-latency mode): no per-expert counts to compare, zero weights, `a` gives x, the format and
// the statistics (a.topk_idx only its dtype).
void prepare_dispatch_from_ids(const Buffer::Impl& b, const DispatchArgs& a, int num_experts, int num_topk,
                               std::vector<int32_t> ids, engine::DispatchInput& in);
void prepare_combine(const Buffer::Impl& b, const CombineArgs& a, engine::CombineInput& in);
// The outputs that num_worst_tokens sizes are allocated before the call runs: InvalidUsage unless they
// fit (below 2^31 rows, within the host's memory).
void check_worst_case_outputs(const engine::DispatchInput& in);
// The handle's Impl when it is one of this Buffer's (alive), after its dispatch's counts are known.
const Handle::Impl& own_handle(const Buffer::Impl& b, const std::shared_ptr<const Handle>& h);
// Offset of t's bytes in this rank's output arena, or -1 (no arena, several nodes, or t outside it).
int64_t arena_offset(const Buffer::Impl& b, const Tensor& t);

}  // namespace epcomm

// api/low_latency_masks.h — rank masks of low-latency mode (docs/low-latency.md, "Masks and shrink"): the
// per-Buffer mask, the view of the transport that holds only the unmasked ranks, and the agreement round
// through which the survivors of a missed deadline reach one mask.
#pragma once

#include <memory>
#include <mutex>
#include <vector>

#include "api/buffer_impl.h"
#include "engine/op_context.h"
#include "transport/transport.h"

namespace epcomm::ll {

// The mask of one Buffer: masked[r] = 1 for a masked rank. Guarded by `m` (read by the communication
// thread, updated by the caller's thread between calls).
struct MaskState {
  std::mutex m;
  std::vector<uint8_t> masked;
  bool shrink = false;  // a peer that misses a low-latency deadline is masked instead of failing the call
  std::vector<uint8_t> snapshot() {
    std::lock_guard<std::mutex> lk(m);
    return masked;
  }
  bool any() {
    std::lock_guard<std::mutex> lk(m);
    for (uint8_t v : masked)
      if (v) return true;
    return false;
  }
};
MaskState& mask_state(Buffer::Impl& b);

// The ranks a low-latency call runs among: the unmasked ones, ascending; only this rank when it is masked
// itself (it then sends and receives nothing).
std::vector<int32_t> live_ranks(const std::vector<uint8_t>& masked, int self);

// The shared-memory transport seen through a list of live ranks: rank index i is real rank live[i].
class MaskView final : public Transport {
 public:
  MaskView(Transport& base, std::vector<int32_t> live);
  int rank() const override { return self_; }
  int size() const override { return static_cast<int>(live_.size()); }
  size_t segment_bytes() const override { return base_.segment_bytes(); }
  uint8_t* segment(int r) const override { return base_.segment(live_[r]); }
  uint32_t doorbell() const override { return base_.doorbell(); }
  bool wait_doorbell(uint32_t seen, Clock::time_point until) const override {
    return base_.wait_doorbell(seen, until);
  }
  void notify(int r) const override { base_.notify(live_[r]); }
  bool oversubscribed() const override { return base_.oversubscribed(); }
  process::State peer_process(int r, int32_t* pid) const override {
    return base_.peer_process(live_[r], pid);
  }
  std::string describe() const override { return base_.describe(); }
  std::shared_ptr<OutputArena> output_arena() const override { return base_.output_arena(); }
  uint8_t* arena(int r) const override { return base_.arena(live_[r]); }
  int group_rank(int r) const override { return base_.group_rank(live_[r]); }
  bool partial() const override { return true; }

 private:
  Transport& base_;
  std::vector<int32_t> live_;
  int self_ = 0;
};

// The agreement round of call `ctx.seq()` among the unmasked ranks of `masked` (one node; ctx spans every
// rank): each rank says it arrived, waits for the others up to `timeout_s`, publishes the set it saw arrive,
// and waits (again up to `timeout_s`) for the sets of the ranks it saw. The agreed live set is the
// intersection of the sets that arrived; the ranks outside it are masked. Returns the new mask. Throws
// Timeout (naming the ranks that excluded it) when this rank is not in the agreed set.
std::vector<uint8_t> agree_on_mask(engine::OpContext& ctx, std::vector<uint8_t> masked, double timeout_s);

// The ranks one low-latency call runs among, decided on the communication thread when the call starts:
// after the agreement round when shrink is on (the Buffer's mask then includes what it decided).
struct LiveSet {
  std::vector<uint8_t> masked;
  std::vector<int32_t> live;  // live_ranks(masked, rank)
  bool identity() const { return live.size() == masked.size(); }
};
LiveSet enter_call(Buffer::Impl& b, engine::OpContext& ctx);

// Number of each real expert among the live ranks (-1: its rank is masked, or this rank is).
std::vector<int32_t> expert_map(const LiveSet& s, int num_local);
// Renumbers a prepared low-latency dispatch for the live ranks: pairs to masked experts are dropped, ranks
// and experts renumbered, the per-rank routing narrowed. A cost-statistics tensor is replaced by one of the
// live ranks (widen_stats adds it back).
void restrict_dispatch(engine::DispatchInput& in, const LiveSet& s, const std::vector<int32_t>& map,
                       Allocator& al);
// stats ([live] i64, accumulated by the call) added into `real` ([R]) at the real ranks.
void widen_stats(const Tensor& stats, Tensor& real, const std::vector<int32_t>& live);
std::optional<Tensor> narrow_stats(const std::optional<Tensor>& real, size_t live, Allocator& al);

// A low-latency combine whose dispatch ran among more ranks than are live now (a rank was masked in
// between, by hand or by this call's agreement round), one node, rows pushed by the dispatch: every live rank
// copies its expert outputs into its output arena and says where; each origin reduces its tokens from the
// live holders' rows (pairs held by masked ranks are absent) and says when it is done.
void combine_among_survivors(Buffer::Impl& b, engine::OpContext& ctx, const LiveSet& live,
                             const engine::CombineInput& in, engine::CombineOutput& out,
                             const std::function<void()>& on_shapes);

}  // namespace epcomm::ll

// engine/staged_sender.h — the sending half of the staged pipeline that dispatch and dispatch_v2 share.
// A sender stages its tokens window by window into the two halves of its data area and publishes each on
// Control::stage_ready; half w % 2 is reused for window w once every receiver acknowledged window w - 2
// (PeerCell::ack) and, across nodes, once the compact copies of the earlier windows are out
// (WindowSender, engine/forward.h). The receiving half is serve_published_windows (window_serve.h).
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "engine/forward.h"
#include "engine/op_context.h"
#include "engine/window_serve.h"

namespace epcomm::engine {

class StagedSender {
 public:
  explicit StagedSender(OpContext& ctx) : ctx_(ctx), me_(ctx.rank()), seq_(ctx.seq()) {}

  // This call's window count (it may change until the headers are in: the windows' geometry may too).
  void set_windows(int64_t n) { windows_ = n; }
  int64_t windows() const { return windows_; }
  int64_t staged() const { return staged_; }
  // The ranks that receive rows of ours and so acknowledge every window (known once the plan is): 1 each.
  void set_receivers(std::vector<uint8_t> receivers) { receivers_ = std::move(receivers); }
  bool receives(int p) const { return receivers_[static_cast<size_t>(p)] != 0; }
  // Across nodes: every staged window also goes, compact, to the nodes that need its tokens.
  template <typename... Args>
  void start_network(Args&&... args) {
    net_.emplace(ctx_, std::forward<Args>(args)...);
  }

  // Stages window staged() with stage(w) and publishes it. Only the first two windows may be staged before
  // the receivers are known (they need no acknowledgement).
  template <typename Stage>
  void stage_next(Stage&& stage) {
    stage(staged_);
    ++staged_;
    ctx_.control(me_)->stage_ready.store(pack(seq_, staged_), std::memory_order_seq_cst);
  }
  // Sends the staged windows across nodes (while the headers travel, and in every step).
  void send(bool& progressed) {
    if (net_) net_->send_staged(staged_, progressed);
  }
  // One poll of the data phase: sends what is staged, stages every window whose half is free and wakes the
  // receivers on this node. True once every window is staged, acknowledged and sent.
  template <typename Stage>
  bool step(bool& progressed, Stage&& stage) {
    send(progressed);
    while (staged_ < windows_ && (!net_ || net_->all_sent(staged_)) && can_stage(staged_)) {
      stage_next(stage);
      for (int p = 0; p < ctx_.size(); ++p)
        if (receives(p) && p != me_ && !ctx_.remote(p)) ctx_.notify(p);
      progressed = true;
    }
    return done();
  }
  bool done() const {
    return staged_ == windows_ && (windows_ == 0 || acked_by_all(windows_)) &&
           (!net_ || (net_->all_sent(windows_) && net_->complete()));
  }
  // For a timeout: the receivers whose acknowledgement of our last window is missing, or all receivers when
  // none is (the network still holds our windows).
  void add_awaited(std::vector<int>& peers) const {
    const uint64_t last = pack(seq_, std::max<int64_t>(windows_, 1));
    bool any = false;
    for (int p = 0; p < ctx_.size(); ++p)
      if (receives(p) && ctx_.cell(me_, p)->ack.load(std::memory_order_acquire) < last) {
        engine::add_awaited(peers, p, me_);
        any = true;
      }
    if (!any)
      for (int p = 0; p < ctx_.size(); ++p)
        if (receives(p)) engine::add_awaited(peers, p, me_);
  }

 private:
  bool acked_by_all(int64_t w) const {
    for (int p = 0; p < ctx_.size(); ++p)
      if (receives(p) && ctx_.cell(me_, p)->ack.load(std::memory_order_acquire) < pack(seq_, w)) return false;
    return true;
  }
  bool can_stage(int64_t w) const {
    if (w < 2) return true;
    return acked_by_all(w - 1) && (!net_ || (net_->all_sent(w - 1) && net_->half_free(w)));
  }

  OpContext& ctx_;
  const int me_;
  const uint64_t seq_;
  int64_t windows_ = 0, staged_ = 0;
  std::vector<uint8_t> receivers_;
  std::optional<WindowSender> net_;  // across nodes
};

}  // namespace epcomm::engine

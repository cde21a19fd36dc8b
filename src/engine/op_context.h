// engine/op_context.h — one collective call on the wire: the header exchange, signals, deadline-bounded
// progress loops, and error messages that start "epcomm[rank r] <op>#<seq>:" and name the peers.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "common/check.h"
#include "engine/protocol.h"
#include "transport/transport.h"

namespace epcomm::engine {

class OpContext {
 public:
  using Clock = std::chrono::steady_clock;
  OpContext(Transport& tp, const SegmentLayout& layout, uint64_t seq, OpKind op, double timeout_s);

  int rank() const { return rank_; }
  int size() const { return size_; }
  uint64_t seq() const { return seq_; }
  Transport& transport() const { return tp_; }
  const SegmentLayout& layout() const { return layout_; }
  std::string prefix() const;  // "epcomm[rank r] dispatch#7: ", or the label set by set_naming
  // Optional naming for groups whose ranks have another meaning (the operator family): `label` replaces
  // the prefix, and `peer_word` ("rank" by default, e.g. "ep rank") names peers in timeouts and aborts.
  void set_naming(std::string label, std::string peer_word) {
    label_ = std::move(label);
    peer_word_ = std::move(peer_word);
  }
  const std::string& peer_word() const { return peer_word_; }

  Control* control(int r) const { return reinterpret_cast<Control*>(tp_.segment(r) + layout_.control); }
  // The cell `writer` owns in `owner`'s segment.
  PeerCell* cell(int owner, int writer) const {
    return reinterpret_cast<PeerCell*>(tp_.segment(owner) + layout_.cells) + writer;
  }
  HeaderData* header(int r) const { return header_slot(r, seq_); }
  int32_t* counts(int r) const { return reinterpret_cast<int32_t*>(header(r) + 1); }
  uint8_t* data(int r) const { return tp_.segment(r) + layout_.data; }

  // Clears and returns this rank's header for this call; fill it, then publish_header().
  HeaderData& begin_header(OpKind op);
  void publish_header();
  // Waits for every peer's header of this call. Throws Aborted when a peer marked its header failed
  // (quoting its message) or failed earlier; Timeout naming the missing peers.
  void exchange_headers();

  // For a call this rank cannot run (its validation or previous_event failed): publishes a header marked
  // failed with `message` and waits for the peers' headers, so that every peer raises promptly.
  void publish_failed_header(OpKind op, const std::string& message);

  // Publishes a signal word in our own or a peer's segment and rings the owner's doorbell.
  void signal(std::atomic<uint64_t>& word, uint64_t value, int owner) const;
  void notify_all() const;

  // Runs step() until it returns true. step() returns false when it could not progress; then the loop
  // sleeps on the doorbell. The deadline restarts whenever step() made progress (`progressed` set).
  // `awaited()` lists the peers still awaited, for the Timeout message.
  template <typename Step, typename Awaited>
  void run(const char* phase, Step&& step, Awaited&& awaited) {
    auto deadline = Clock::now() + timeout_;
    while (true) {
      uint32_t snap = tp_.doorbell();
      bool progressed = false;
      if (step(progressed)) return;
      auto now = Clock::now();
      if (progressed) {
        deadline = now + timeout_;
        continue;
      }
      check_peers_alive();
      if (now >= deadline) raise_timeout(phase, awaited());
      tp_.wait_doorbell(snap, std::min(deadline, now + std::chrono::milliseconds(100)));
    }
  }

  // Ranks in the order their headers arrived (this rank first): data is served first come, first served,
  // so a late peer's data lands last and shows in its own cost-statistics element.
  const std::vector<int>& arrival_order() const { return arrival_order_; }

  // Throws Aborted when a peer has published a failure (its Buffer failed: ours cannot go on either).
  void check_peers_alive() const;
  bool saw_peer_failure() const { return saw_peer_failure_; }
  [[noreturn]] void raise_timeout(const char* phase, const std::vector<int>& peers) const;
  // Tells peers this rank will not continue (they raise Aborted quoting `message`).
  void publish_failure(const std::string& message) const;

 private:
  HeaderData* header_slot(int r, uint64_t seq) const {
    return reinterpret_cast<HeaderData*>(tp_.segment(r) + layout_.headers + (seq % 2) * layout_.header_bytes);
  }
  uint64_t last_seq_seen(int r) const;

  Transport& tp_;
  SegmentLayout layout_;
  int rank_, size_;
  uint64_t seq_;
  OpKind op_;
  Clock::duration timeout_;
  double timeout_s_;
  std::vector<int> arrival_order_;
  mutable bool saw_peer_failure_ = false;
  std::string label_, peer_word_ = "rank";
};

}  // namespace epcomm::engine

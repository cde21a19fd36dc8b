// engine/op_context.h — one collective call on the wire: the header exchange, signals, deadline-bounded
// progress loops, and error messages that start "epcomm[rank r] <op>#<seq>:" and name the peers.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "common/check.h"
#include "engine/internode.h"
#include "engine/protocol.h"
#include "transport/transport.h"

namespace epcomm::engine {

// What a rank's calls copied and what its peers read in place (Buffer::copy_counters). Written by the
// thread that runs the calls, read by any thread between calls.
struct CopyCounters {
  std::atomic<int64_t> dispatch_staged_tokens{0};    // tokens whose payload this rank staged (or quantized)
  std::atomic<int64_t> dispatch_in_place_tokens{0};  // tokens read in place from the shared dispatch input
  std::atomic<int64_t> dispatch_pushed_tokens{0};    // tokens whose rows it wrote into receivers' outputs
  std::atomic<int64_t> combine_copied_rows{0};       // rows this rank copied into other origins' windows
  std::atomic<int64_t> combine_in_place_rows{0};     // rows other origins read in place (shared input)
  std::atomic<int64_t> combine_direct_tokens{0};     // own tokens reduced straight from the holders' x
  std::atomic<int64_t> combine_shared_tokens{0};     // other origins' tokens it reduced for them (direct)
  void add(std::atomic<int64_t>& c, int64_t n) { c.fetch_add(n, std::memory_order_relaxed); }
  void reset() {
    for (auto* c :
         {&dispatch_staged_tokens, &dispatch_in_place_tokens, &dispatch_pushed_tokens, &combine_copied_rows,
          &combine_in_place_rows, &combine_direct_tokens, &combine_shared_tokens})
      c->store(0, std::memory_order_relaxed);
  }
};

class OpContext {
 public:
  using Clock = std::chrono::steady_clock;
  // `inter` (null on one node) maps remote ranks to their proxies' lanes; ranks are then global ranks while
  // `tp` spans this node only.
  OpContext(Transport& tp, const SegmentLayout& layout, uint64_t seq, OpKind op, double timeout_s,
            Internode* inter = nullptr);

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
  // "rank 3": how messages name call rank r (its rank in the group when the call runs among some ranks).
  std::string peer_name(int r) const { return detail::cat(peer_word_, " ", tp_.group_rank(r)); }
  // Messages number calls from the caller's first: `base` calls before it were the creation's own
  // (a Buffer's warm-up), so call `base + n` is shown as #n.
  void number_calls_after(uint64_t base) { shown_base_ = base; }
  // A call of the creation's warm-up: its messages (and debug lines) say so after the call's number.
  void mark_warm_up() { warm_up_ = true; }
  uint64_t shown(uint64_t seq) const { return seq > shown_base_ ? seq - shown_base_ : 0; }

  // Every accessor takes global ranks. A remote rank's words live in its proxy's lane (internode.h).
  Control* control(int r) const {
    if (remote(r)) return &lane_control(inter_->topo.proxy_of(r), node_of(r))->mirror;
    return reinterpret_cast<Control*>(seg(r) + layout_.control);
  }
  // The cell `writer` owns in `owner`'s segment: for a remote writer, the one its node's proxy forwards into;
  // for a remote owner, the one this node's readers of that owner write in its proxy's lane.
  PeerCell* cell(int owner, int writer) const {
    if (remote(owner))
      return reinterpret_cast<PeerCell*>(lane_base(inter_->topo.proxy_of(owner), node_of(owner)) +
                                         inter_->lane.readers) +
             inter_->topo.local_index[writer];
    if (remote(writer)) return &lane_control(owner, node_of(writer))->from_proxy;
    return reinterpret_cast<PeerCell*>(seg(owner) + layout_.cells) + writer;
  }
  HeaderData* header(int r) const { return header_slot(r, seq_); }
  int32_t* counts(int r) const { return reinterpret_cast<int32_t*>(header(r) + 1); }
  uint8_t* data(int r) const {
    if (remote(r)) return lane_base(inter_->topo.proxy_of(r), node_of(r)) + inter_->lane.data;
    return seg(r) + layout_.data;
  }
  // Rank r's shared input of this call (its dispatch x or its combine expert outputs, in one of its segment's
  // input areas or, kInputInArena, in its output arena; header input_offset), or null when r's input is
  // private or r is on another node (its memory is not mapped here).
  const uint8_t* shared_input(int r) const {
    const int64_t off = header(r)->input_offset;
    if (off < 0 || remote(r)) return nullptr;
    return (header(r)->flags & kInputInArena) ? tp_.arena(tp_index(r)) + off : seg(r) + off;
  }
  // Rings the doorbell of whoever waits for what this rank wrote for `r` (r itself, or its proxy here).
  void notify(int r) const;

  // Internode (null on one node).
  Internode* internode() const { return inter_; }
  bool remote(int r) const { return inter_ && !inter_->topo.is_local(r); }
  int node_of(int r) const { return inter_ ? inter_->topo.node_of[r] : 0; }
  // The lane `owner` (a rank of this node) keeps for node `node`.
  uint8_t* lane_base(int owner, int node) const {
    return seg(owner) + inter_->lanes_offset + inter_->lane_offset(node);
  }
  LaneControl* lane_control(int owner, int node) const {
    return reinterpret_cast<LaneControl*>(lane_base(owner, node));
  }
  // Network write into rank `peer`'s lane for this rank's node: `pieces` at `offset` within the lane, then
  // the signal word at `signal_offset` within the lane is raised to `value`. Returns the ticket.
  uint64_t write_lane(int peer, const Network::Piece* pieces, int n, size_t offset, size_t signal_offset,
                      uint64_t value) const;

  // Clears and returns this rank's header for this call; fill it, then publish_header().
  HeaderData& begin_header(OpKind op);
  void publish_header();
  // Waits for every peer's header of this call. Throws Aborted when a peer marked its header failed
  // (quoting its message) or failed earlier; Timeout naming the missing peers.
  // `meanwhile` (optional) runs on every pass of the wait, e.g. to send data to peers already known to be
  // ready.
  void exchange_headers(const std::function<void(bool& progressed)>& meanwhile = {});
  // Internode: tells the rail peers that this call is over here (their data of the next call may come), and
  // whether rail peer `peer` has said so for the previous call. Never throws.
  void release_lanes() const noexcept;
  // Waits (bounded by the deadline) until the network is done reading every write issued so far, so that
  // their source buffers may go. Called by the stages' guards when a call ends, early or not. Never throws.
  void drain_writes() const noexcept;
  bool lane_released(int peer) const {
    return lane_control(rank_, node_of(peer))->released.load(std::memory_order_acquire) + 1 >= seq_;
  }
  // True once rank r's header of this call is visible here.
  bool header_arrived(int r) const { return header(r)->seq.load(std::memory_order_acquire) == seq_; }

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
    bool grace = false;
    while (true) {
      uint32_t snap = tp_.doorbell();
      // A peer's failure is recorded after everything it sent before it has landed, so a step that began
      // after the failure was seen has looked at all of that: only then is the failure final (what the peer
      // delivered before failing may be all this call needed).
      const bool failed_before = any_peer_failed();
      bool progressed = false;
      if (step(progressed)) return;
      auto now = Clock::now();
      if (progressed) {
        deadline = now + timeout_;
        grace = false;
        continue;
      }
      if (failed_before)
        check_peers_alive();
      else if (any_peer_failed() || peer_gone(now, awaited))
        continue;  // the next pass looks at everything that peer delivered first
      if (now >= deadline) {
        // Across nodes a peer that can see why nobody progressed (a stopped rank on its host) times out at
        // about the same moment: give its notice kTimeoutGrace to arrive, so that we name that rank too.
        if (!inter_ || grace) raise_timeout(phase, awaited());
        grace = true;
        deadline = now + kTimeoutGrace;
      }
      tp_.wait_doorbell(snap, std::min(deadline, now + std::chrono::milliseconds(100)));
    }
  }

  // Ranks in the order their headers arrived (this rank first): data is served first come, first served,
  // so a late peer's data lands last and shows in its own cost-statistics element.
  const std::vector<int>& arrival_order() const { return arrival_order_; }

  // Throws Aborted when a peer has published a failure (its Buffer failed: ours cannot go on either) or a
  // peer on this host is gone (its process died). A lost rank (gone, or a broken connection to it) is named
  // alone: a peer that failed because of it passes its name on (Control::lost_rank).
  void check_peers_alive() const;
  bool any_peer_failed() const;  // what check_peers_alive() would throw for, without throwing
  // At most every kProcessWatch (it reads /proc): whether the process of a peer this wait still needs (or of
  // the proxy it comes through) is gone; then it is the lost rank and any_peer_failed() says so.
  template <typename Awaited>
  bool peer_gone(Clock::time_point now, Awaited&& awaited) const {
    if (now < next_watch_ || next_watch_ == Clock::time_point{}) {  // a call's first kProcessWatch: no look
      if (next_watch_ == Clock::time_point{}) next_watch_ = now + kProcessWatch;
      return false;
    }
    next_watch_ = now + kProcessWatch;
    return find_local_peer(process::State::gone, awaited()) >= 0;
  }
  static constexpr std::chrono::milliseconds kProcessWatch{100};
  static constexpr std::chrono::milliseconds kTimeoutGrace{800};
  static constexpr std::chrono::milliseconds kDrainAfterFailure{1000};
  bool saw_peer_failure() const { return saw_peer_failure_; }
  [[noreturn]] void raise_timeout(const char* phase, const std::vector<int>& peers) const;
  // Tells peers this rank will not continue (they raise Aborted quoting `message`).
  void publish_failure(const std::string& message) const;

 private:
  // Rank r (of this node) as the shared-memory transport numbers it.
  int tp_index(int r) const { return inter_ ? inter_->topo.local_index[r] : r; }
  uint8_t* seg(int r) const { return tp_.segment(tp_index(r)); }
  HeaderData* header_slot(int r, uint64_t seq) const {
    if (!own_header_.empty()) return reinterpret_cast<HeaderData*>(own_header_.data());
    if (remote(r))
      return reinterpret_cast<HeaderData*>(lane_base(inter_->topo.proxy_of(r), node_of(r)) +
                                           inter_->lane.headers + (seq % 2) * inter_->lane.header_bytes);
    return reinterpret_cast<HeaderData*>(seg(r) + layout_.headers + (seq % 2) * layout_.header_bytes);
  }
  void send_header_to_rails() const;
  uint64_t last_seq_seen(int r) const;
  // The first of `peers` whose process (a remote peer's: its proxy's) is in `state`, or -1; records it as
  // the lost rank.
  int find_local_peer(process::State state, const std::vector<int>& peers) const;
  [[noreturn]] void raise_lost() const;
  [[noreturn]] void raise_left_early(int r, uint64_t seen) const;

  Transport& tp_;
  SegmentLayout layout_;
  int rank_, size_;
  uint64_t seq_;
  uint64_t shown_base_ = 0;
  bool warm_up_ = false;
  OpKind op_;
  Clock::duration timeout_;
  double timeout_s_;
  std::vector<int> arrival_order_;
  mutable bool saw_peer_failure_ = false;
  mutable int lost_rank_ = -1;       // the rank whose loss this call saw (find_local_peer, a peer's notice)
  mutable std::string lost_reason_;  // "rank 2 died: ...": what happened to it
  mutable Clock::time_point next_watch_{};
  std::string label_, peer_word_ = "rank";
  Internode* inter_ = nullptr;
  mutable std::vector<uint8_t> own_header_;  // this rank's header when it runs alone in a view (see the ctor)
};

// Drains the network's writes (OpContext::drain_writes) when it goes out of scope: declare it after the
// buffers those writes read, so that it runs before they go. Classes that own such buffers drain in their
// destructor's body instead (it runs before any member is destroyed).
class DrainOnExit {
 public:
  explicit DrainOnExit(const OpContext& ctx) : ctx_(ctx) {}
  ~DrainOnExit() { ctx_.drain_writes(); }
  DrainOnExit(const DrainOnExit&) = delete;
  DrainOnExit& operator=(const DrainOnExit&) = delete;

 private:
  const OpContext& ctx_;
};

}  // namespace epcomm::engine

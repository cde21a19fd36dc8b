// engine/op_context.cc — header exchange, failure notices and timeouts.
#include "engine/op_context.h"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <sstream>
#include <thread>

namespace epcomm::engine {

OpContext::OpContext(Transport& tp, const SegmentLayout& layout, uint64_t seq, OpKind op, double timeout_s,
                     Internode* inter)
    : tp_(tp),
      layout_(layout),
      rank_(inter ? inter->topo.rank : tp.rank()),
      size_(inter ? inter->topo.size : tp.size()),
      seq_(seq),
      op_(op),
      timeout_(std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s))),
      timeout_s_(timeout_s),
      inter_(inter) {
  // A call of this rank alone in a view over some ranks (it is masked): nobody reads its header, and were it
  // written into the segment, this rank, which waits for nobody, could overwrite the header of an earlier
  // call (a failed one) before the peers of that call read it.
  if (!inter && size_ == 1 && tp.partial()) own_header_.assign(layout_.header_bytes, 0);
}

void OpContext::notify(int r) const {
  if (!inter_) return tp_.notify(r);
  const Topology& t = inter_->topo;
  tp_.notify(t.local_index[t.is_local(r) ? r : t.proxy_of(r)]);
}

uint64_t OpContext::write_lane(int peer, const Network::Piece* pieces, int n, size_t offset,
                               size_t signal_offset, uint64_t value) const {
  const size_t lane = inter_->lane_offset(inter_->topo.node());
  uint64_t t = 0;
  try {
    t = inter_->net->write_signal(peer, pieces, n, lane + offset, lane + signal_offset, value);
  } catch (const Error&) {
    // A peer that failed tells its rail peers before it goes: report its reason (naming the first culprit)
    // rather than the closed connection it left behind.
    check_peers_alive();
    throw;
  }
  inter_->last_ticket = std::max(inter_->last_ticket, t);
  return t;
}

void OpContext::drain_writes() const noexcept {
  if (!inter_ || inter_->last_ticket == 0) return;
  // Writes to live peers still read their source buffers after another peer's connection failed (a failed
  // write completes too, once UCX reports it): wait for all of them, at most kDrainAfterFailure once a
  // failure is known, so that a caller never frees memory the network still sends from.
  auto deadline = Clock::now() + timeout_;
  bool failure_seen = false;
  try {
    while (!inter_->net->complete(inter_->last_ticket)) {
      const auto now = Clock::now();
      if (!failure_seen && !inter_->net->failure().empty()) {
        failure_seen = true;
        deadline = std::min(deadline, now + kDrainAfterFailure);
      }
      if (now >= deadline) break;
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  } catch (...) {
  }
}

void OpContext::release_lanes() const noexcept {
  if (!inter_) return;
  const Topology& t = inter_->topo;
  for (int n = 0; n < t.num_nodes; ++n) {
    if (n == t.node()) continue;
    try {
      write_lane(t.rail(n), nullptr, 0, 0, offsetof(LaneControl, released), seq_);
    } catch (...) {  // the network failed: the next call will say so
    }
  }
}

// Our header (and counts) into the lane each rail peer keeps for our node; `seq` is raised last.
void OpContext::send_header_to_rails() const {
  const Topology& t = inter_->topo;
  const HeaderData* h = header(rank_);
  const size_t slot = inter_->lane.headers + (seq_ % 2) * inter_->lane.header_bytes;
  Network::Piece piece{reinterpret_cast<const uint8_t*>(h) + sizeof(uint64_t),
                       sizeof(HeaderData) - sizeof(uint64_t) + sizeof(int32_t) * std::max(h->num_counts, 0)};
  for (int n = 0; n < t.num_nodes; ++n)
    if (n != t.node()) write_lane(t.rail(n), &piece, 1, slot + sizeof(uint64_t), slot, seq_);
}

std::string OpContext::prefix() const {
  if (!label_.empty()) return label_;
  return detail::cat("epcomm[rank ", rank_, "] ", op_kind_name(op_), "#", shown(seq_),
                     warm_up_ ? " (warm-up)" : "", ": ");
}

HeaderData& OpContext::begin_header(OpKind op) {
  HeaderData* h = header(rank_);
  h->seq.store(0, std::memory_order_relaxed);
  h->op = static_cast<uint32_t>(op);
  h->failed = 0;
  h->order = h->flags = 0;
  h->num_experts = h->num_topk = h->dtype = h->quant_mode = 0;
  h->hidden = h->row_bytes = h->num_tokens = h->expert_alignment = h->num_worst_tokens = 0;
  h->expert_block_rows = 0;
  h->handle_id = 0;
  h->input_offset = h->weights_offset = -1;
  std::fill(std::begin(h->chunks), std::end(h->chunks), 0);
  h->num_counts = 0;
  h->num_sparse = -1;
  h->message[0] = '\0';
  return *h;
}

void OpContext::publish_header() {
  header(rank_)->seq.store(seq_, std::memory_order_seq_cst);
  notify_all();
  if (inter_) send_header_to_rails();
}

void OpContext::publish_failed_header(OpKind op, const std::string& message) {
  HeaderData& h = begin_header(op);
  h.failed = 1;
  size_t n = std::min(message.size(), kMessageBytes - 1);
  std::memcpy(h.message, message.data(), n);
  h.message[n] = '\0';
  publish_header();
  exchange_headers();
}

void OpContext::signal(std::atomic<uint64_t>& word, uint64_t value, int owner) const {
  word.store(value, std::memory_order_seq_cst);
  notify(owner);
}

void OpContext::notify_all() const {
  for (int r = 0; r < tp_.size(); ++r)
    if (r != tp_.rank()) tp_.notify(r);
}

uint64_t OpContext::last_seq_seen(int r) const {
  uint64_t a = header_slot(r, 0)->seq.load(std::memory_order_acquire);
  uint64_t b = header_slot(r, 1)->seq.load(std::memory_order_acquire);
  return std::max(a, b);
}

void OpContext::exchange_headers(const std::function<void(bool& progressed)>& meanwhile) {
  std::vector<uint8_t> arrived(size_, 0);
  arrived[rank_] = 1;
  arrival_order_.assign(1, rank_);
  int missing = size_ - 1;
  run(
      "header exchange",
      [&](bool& progressed) {
        if (meanwhile) meanwhile(progressed);
        for (int r = 0; r < size_; ++r) {
          if (arrived[r]) continue;
          const uint64_t seen = header(r)->seq.load(std::memory_order_acquire);
          if (seen == seq_) {
            arrived[r] = 1;
            arrival_order_.push_back(r);
            --missing;
            progressed = true;
          } else if (seen > seq_) {  // its header of a later call is in our call's slot: it left ours
            raise_left_early(r, seen);
          }
        }
        return missing == 0;
      },
      [&] {
        std::vector<int> peers;
        for (int r = 0; r < size_; ++r)
          if (!arrived[r]) peers.push_back(r);
        return peers;
      });
  // A peer whose validation failed: every other rank raises Aborted quoting the first such rank.
  if (header(rank_)->failed) return;  // the caller raises its own error
  for (int r = 0; r < size_; ++r) {
    const HeaderData* h = header(r);
    if (h->failed)
      EPCOMM_THROW(Aborted, prefix(), "peer failure: ", peer_name(r),
                   " failed this call: ", std::string(h->message, strnlen(h->message, kMessageBytes)));
  }
}

bool OpContext::any_peer_failed() const {
  if (lost_rank_ >= 0) return true;
  if (inter_ && inter_->net->failed_peer() >= 0) return true;
  for (int r = 0; r < size_; ++r)
    if (r != rank_ && control(r)->failed.load(std::memory_order_acquire) != 0) return true;
  return false;
}

int OpContext::find_local_peer(process::State state, const std::vector<int>& peers) const {
  for (int p : peers) {
    const int r = remote(p) ? inter_->topo.proxy_of(p) : p;
    if (r == rank_) continue;
    int32_t pid = 0;
    if (tp_.peer_process(tp_index(r), &pid) != state) continue;
    lost_rank_ = r;
    lost_reason_ = state == process::State::gone
                       ? detail::cat(peer_name(r), " died: its process ", pid, " exited or was killed")
                       : detail::cat(peer_name(r), " is stopped: its process ", pid,
                                     " is held by SIGSTOP or a debugger");
    return r;
  }
  return -1;
}

void OpContext::raise_left_early(int r, uint64_t seen) const {
  saw_peer_failure_ = true;
  EPCOMM_THROW(
      Aborted, prefix(), "peer failure: ", peer_name(r), " is already at call #", shown(seen),
      ": it left this call before this rank read its header (the call failed on it, or it runs among "
      "other ranks now: a rank mask changed while this rank was still in this call)");
}

void OpContext::raise_lost() const {
  saw_peer_failure_ = true;
  EPCOMM_THROW(Aborted, prefix(), "peer failure: ", lost_reason_);
}

void OpContext::check_peers_alive() const {
  if (lost_rank_ >= 0) raise_lost();  // a peer this call needed died: name it alone
  if (inter_) {
    std::string f = inter_->net->failure();
    if (!f.empty()) {
      lost_rank_ = inter_->net->failed_peer();
      lost_reason_ = f;
      raise_lost();
    }
  }
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    const Control* c = control(r);
    if (c->failed.load(std::memory_order_acquire) == 0) continue;
    const std::string message(c->failed_message, strnlen(c->failed_message, kMessageBytes));
    if (c->lost_rank > 0) {  // r failed because it lost a rank: pass that rank's name on
      lost_rank_ = c->lost_rank - 1;
      lost_reason_ = message;
      raise_lost();
    }
    saw_peer_failure_ = true;
    EPCOMM_THROW(Aborted, prefix(), "peer failure: ", peer_name(r), " failed: ", message);
  }
}

void OpContext::raise_timeout(const char* phase, const std::vector<int>& peers) const {
  std::ostringstream os;
  os << prefix() << "timeout: no progress for " << timeout_s_ << " s in phase '" << phase << "'";
  // A stopped (or dead) peer on this host is why nobody progressed, whether this rank waits for it or for a
  // peer that waits for it: name it alone.
  std::vector<int> all(static_cast<size_t>(size_));
  for (int r = 0; r < size_; ++r) all[static_cast<size_t>(r)] = r;
  const std::vector<int>& everyone = all;
  for (const std::vector<int>* among : {&peers, &everyone})
    for (process::State st : {process::State::stopped, process::State::gone})
      if (find_local_peer(st, *among) >= 0)
        throw Error(ErrorCode::Timeout, detail::cat(os.str(), ": ", lost_reason_));
  std::ostringstream body;  // what the peers that hear of it quote: naming the one awaited peer
  body << "timeout: no progress for " << timeout_s_ << " s in phase '" << phase << "'; still waiting for ";
  for (size_t i = 0; i < peers.size(); ++i) {
    body << (i ? ", " : "") << peer_name(peers[i]) << " (last call seen: #" << shown(last_seq_seen(peers[i]));
    // A rank on another node is heard of through its rail peer here, which may be the one that is stuck.
    if (remote(peers[i])) {
      const int via = inter_->topo.proxy_of(peers[i]);
      body << "; on node " << node_of(peers[i]) << ", ";
      if (via == rank_)
        body << "this " << peer_word_ << "'s rail peer";
      else
        body << "reached through " << peer_name(via);
    }
    body << ")";
  }
  if (peers.empty()) body << "(no peer recorded)";
  if (peers.size() == 1) {  // the one peer this rank waits for is the lost one: peers that hear of it name it
    lost_rank_ = peers[0];
    lost_reason_ = body.str();
  }
  os.str("");
  os << prefix() << body.str();
  throw Error(ErrorCode::Timeout, os.str());
}

void OpContext::publish_failure(const std::string& message) const {
  Control* c = control(rank_);
  if (c->failed.load(std::memory_order_acquire) != 0) return;
  // Failing because a rank was lost: the peers hear what happened to that rank (they name it, not us).
  const std::string& text = lost_rank_ >= 0 ? lost_reason_ : message;
  size_t n = std::min(text.size(), kMessageBytes - 1);
  std::memcpy(c->failed_message, text.data(), n);
  c->failed_message[n] = '\0';
  c->lost_rank = lost_rank_ + 1;
  c->failed.store(seq_ + 1, std::memory_order_seq_cst);
  notify_all();
  if (!inter_) return;
  // Tell the other nodes through our rail peers (best effort: the network may be what failed).
  const Topology& t = inter_->topo;
  Network::Piece piece{reinterpret_cast<const uint8_t*>(&c->lost_rank), sizeof(int32_t) + n + 1};
  for (int node = 0; node < t.num_nodes; ++node) {
    if (node == t.node()) continue;
    try {
      write_lane(t.rail(node), &piece, 1, offsetof(Control, lost_rank), offsetof(Control, failed), seq_ + 1);
    } catch (...) {
    }
  }
}

}  // namespace epcomm::engine

// transport/ucx/ucx_write.cc — the UCX Network's data path: write_signal in both modes (active message;
// puts, flush, signal message), and arrivals (bounds, copy or rendezvous receive, in-order store-max
// signals, on_arrival), failures and goodbyes.
#include <cstdint>
#include <cstring>

#include "transport/ucx/ucx_network.h"

namespace epcomm::ucx {

// ---- data path ----

Peer& UcxNetwork::peer_of(int rank, const char* what) {
  int i = (rank >= 0 && rank < size_) ? peer_index_[rank] : -1;
  EPCOMM_CHECK(i >= 0, what, ": rank ", rank, " is not a peer of rank ", rank_);
  return *peers_[i];
}

void UcxNetwork::check_bounds(const Peer& p, size_t offset, size_t length, size_t signal_offset) const {
  const size_t region = options_.region_bytes;  // equal on every rank (checked at setup)
  EPCOMM_CHECK(offset <= region && length <= region - offset, "write_signal to rank ", p.rank,
               ": data at offset ", offset, " of ", length, " bytes falls outside the region of ", region,
               " bytes");
  EPCOMM_CHECK(signal_offset % 8 == 0 && signal_offset <= region && 8 <= region - signal_offset,
               "write_signal to rank ", p.rank, ": signal_offset ", signal_offset,
               " is not an 8-byte-aligned word inside the region of ", region, " bytes");
}

uint64_t UcxNetwork::write_signal(int peer, const Piece* pieces, int num_pieces, size_t offset,
                                  size_t signal_offset, uint64_t signal_value) {
  Peer& p = peer_of(peer, "write_signal");
  if (p.failed.load()) {
    std::lock_guard lock(fail_mu_);
    if (p.departed) {
      // The peer said goodbye: its Buffer finished its last call (a call that failed there was announced
      // before the goodbye), so it needs nothing more from us; e.g. our own failure notice after it left.
      const uint64_t ticket = tickets_.issue();
      tickets_.finish(ticket);
      return ticket;
    }
    EPCOMM_THROW(Aborted, p.failure);
  }
  EPCOMM_CHECK(num_pieces >= 0 && (num_pieces == 0 || pieces), "write_signal: bad piece list");
  size_t length = 0;
  for (int i = 0; i < num_pieces; ++i) {
    EPCOMM_CHECK(pieces[i].bytes <= SIZE_MAX - length, "write_signal to rank ", peer,
                 ": piece sizes overflow");
    length += pieces[i].bytes;
  }
  check_bounds(p, offset, length, signal_offset);

  auto* op = new SendOp{this, &p, tickets_.issue(), {}, {}};
  op->header = WireHeader{
      offset, mode_ == WriteMode::am ? length : 0, signal_offset, signal_value, p.next_seq_out++, rank_,
      kWrite};
  const uint64_t ticket = op->ticket;
  writes_.fetch_add(1, std::memory_order_relaxed);
  payload_bytes_.fetch_add(length, std::memory_order_relaxed);
  {
    auto lock = lock_worker();
    if (mode_ == WriteMode::am)
      send_am(op, pieces, num_pieces);
    else
      send_put(op, pieces, num_pieces);
  }
  if (p.failed.load()) {  // failed while starting this write (a goodbye meanwhile is not a failure)
    std::lock_guard lock(fail_mu_);
    if (!p.departed) EPCOMM_THROW(Aborted, p.failure);
  }
  return ticket;
}

void UcxNetwork::send_am(SendOp* op, const Piece* pieces, int num_pieces) {
  for (int i = 0; i < num_pieces; ++i)
    if (pieces[i].bytes) op->iov.push_back({const_cast<void*>(pieces[i].data), pieces[i].bytes});
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  rp.cb.send = &UcxNetwork::on_send_done;
  rp.user_data = op;
  // One piece goes as plain contiguous bytes (UCX's fastest path); several as an iov list.
  const void* buffer = op->iov.empty() ? nullptr : op->iov[0].buffer;
  size_t count = op->iov.empty() ? 0 : op->iov[0].length;
  if (op->iov.size() > 1) {
    rp.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
    rp.datatype = ucp_dt_make_iov();
    buffer = op->iov.data();
    count = op->iov.size();
  }
  in_flight_.fetch_add(1);
  started(ucp_am_send_nbx(op->peer->ep, kAmWrite, &op->header, sizeof(WireHeader), buffer, count, &rp), op);
}

// Puts, then a flush (remote completion: the data is in the peer's memory), then the signal as a message.
// A fence would be cheaper, but the signal is an active message that may travel on another lane than the
// puts, and nothing in UCX 1.13 that we could find promises that a fence orders the two.
void UcxNetwork::send_put(SendOp* op, const Piece* pieces, int num_pieces) {
  Peer& p = *op->peer;
  uint64_t at = p.remote_region + op->header.offset;
  for (int i = 0; i < num_pieces; ++i) {
    if (!pieces[i].bytes) continue;
    ucp_request_param_t rp{};
    ucs_status_ptr_t req = ucp_put_nbx(p.ep, pieces[i].data, pieces[i].bytes, at, p.rkey, &rp);
    if (is_request(req)) ucp_request_free(req);  // the flush below tells when it is done
    if (UCS_PTR_IS_ERR(req)) {
      record_failure(
          p, detail::cat("connection to ", name(p.rank), " failed: ", status_text(UCS_PTR_STATUS(req))));
      break;  // the flush reports the failure to this op
    }
    at += pieces[i].bytes;
  }
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  rp.cb.send = &UcxNetwork::on_flush_done;
  rp.user_data = op;
  in_flight_.fetch_add(1);
  ucs_status_ptr_t req = ucp_ep_flush_nbx(p.ep, &rp);
  if (is_request(req)) return wake_progress();
  on_flush_done(nullptr, req == nullptr ? UCS_OK : UCS_PTR_STATUS(req), op);
}

void UcxNetwork::send_signal_message(SendOp* op) {
  op->ticket = 0;
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  rp.cb.send = &UcxNetwork::on_send_done;
  rp.user_data = op;
  in_flight_.fetch_add(1);
  started(ucp_am_send_nbx(op->peer->ep, kAmWrite, &op->header, sizeof(WireHeader), nullptr, 0, &rp), op);
}

void UcxNetwork::started(ucs_status_ptr_t req, SendOp* op) {
  if (is_request(req)) return wake_progress();
  finish_send(op, req == nullptr ? UCS_OK : UCS_PTR_STATUS(req));
}

void UcxNetwork::finish_send(SendOp* op, ucs_status_t status) {
  if (status != UCS_OK && status != UCS_ERR_CANCELED)
    record_failure(*op->peer,
                   detail::cat("connection to ", name(op->peer->rank), " failed: ", status_text(status)));
  if (op->ticket) tickets_.finish(op->ticket);
  in_flight_.fetch_sub(1);
  delete op;
}

void UcxNetwork::on_send_done(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<SendOp*>(user_data);
  ucp_request_free(request);
  op->net->finish_send(op, status);
}

void UcxNetwork::on_flush_done(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<SendOp*>(user_data);
  UcxNetwork* net = op->net;
  if (request) ucp_request_free(request);
  // The data is in place (or the peer failed): the source memory is free either way.
  net->tickets_.finish(op->ticket);
  net->in_flight_.fetch_sub(1);
  if (status != UCS_OK || op->peer->failed.load()) {
    if (status != UCS_OK && status != UCS_ERR_CANCELED)
      net->record_failure(*op->peer, detail::cat("connection to ", net->name(op->peer->rank),
                                                 " failed: ", status_text(status)));
    delete op;
    return;
  }
  net->send_signal_message(op);
}

// ---- arrivals ----

ucs_status_t UcxNetwork::on_am(void* arg, const void* header, size_t header_length, void* data, size_t length,
                               const ucp_am_recv_param_t* param) {
  return static_cast<UcxNetwork*>(arg)->on_message(header, header_length, data, length, param);
}

ucs_status_t UcxNetwork::on_message(const void* header, size_t header_length, void* data, size_t length,
                                    const ucp_am_recv_param_t* param) {
  WireHeader h;
  const ucs_status_t reject =
      (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) ? UCS_ERR_INVALID_PARAM : UCS_OK;
  if (header_length != sizeof h) return reject;  // not ours
  std::memcpy(&h, header, sizeof h);
  int i = (h.sender >= 0 && h.sender < size_) ? peer_index_[h.sender] : -1;
  if (i < 0) return reject;
  Peer& p = *peers_[i];
  if (h.kind == kGoodbye) {
    depart(p);
    return reject;
  }
  const size_t region = options_.region_bytes;
  // The sender checked too; this check protects this rank's memory from a confused or hostile peer.
  if (h.length != length || h.offset > region || h.length > region - h.offset || h.signal_offset % 8 != 0 ||
      h.signal_offset > region || 8 > region - h.signal_offset) {
    record_failure(p, detail::cat("rank ", p.rank, " wrote outside the region of rank ", rank_, " (offset ",
                                  h.offset, ", ", length, " bytes, signal_offset ", h.signal_offset,
                                  ", region ", region, " bytes)"));
    land(p, h, false);
    return reject;
  }
  if (length == 0 || !(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
    if (length) std::memcpy(options_.region + h.offset, data, length);
    land(p, h, true);
    return UCS_OK;
  }
  // Rendezvous: UCX moves the data straight into place; the signal is raised when it has landed.
  auto* op = new RecvOp{this, &p, h};
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  rp.cb.recv_am = &UcxNetwork::on_recv_done;
  rp.user_data = op;
  in_flight_.fetch_add(1);
  ucs_status_ptr_t req = ucp_am_recv_data_nbx(worker_, data, options_.region + h.offset, length, &rp);
  if (!is_request(req)) on_recv_done(nullptr, req == nullptr ? UCS_OK : UCS_PTR_STATUS(req), length, op);
  return UCS_OK;
}

void UcxNetwork::on_recv_done(void* request, ucs_status_t status, size_t, void* user_data) {
  auto* op = static_cast<RecvOp*>(user_data);
  UcxNetwork* net = op->net;
  if (request) ucp_request_free(request);
  if (status != UCS_OK && status != UCS_ERR_CANCELED)
    net->record_failure(*op->peer, detail::cat("connection to ", net->name(op->peer->rank),
                                               " failed: ", status_text(status)));
  net->land(*op->peer, op->header, status == UCS_OK);
  net->in_flight_.fetch_sub(1);
  delete op;
}

// Signals are applied in the sender's issue order: once a signal is visible, every earlier write of that
// sender to this rank has landed too (rendezvous writes may finish out of order). A write that failed to
// land (its sender died during a rendezvous, or it was out of bounds) breaks that guarantee, so no signal of
// that sender is applied after it: a later, complete write's signal would otherwise announce the failed one's
// data too (a dispatch window half-written by a dying rank). The failure itself is recorded by the caller.
void UcxNetwork::land(Peer& p, const WireHeader& h, bool has_signal) {
  bool arrived = false;
  {
    std::lock_guard lock(recv_mu_);
    p.landed[h.seq] = Landed{has_signal, h.signal_offset, h.value};
    for (auto it = p.landed.begin(); it != p.landed.end() && it->first == p.next_seq_in;
         it = p.landed.erase(it), ++p.next_seq_in) {
      if (!it->second.has_signal) p.stream_broken = true;
      if (p.stream_broken) continue;
      auto* word = reinterpret_cast<uint64_t*>(options_.region + it->second.signal_offset);
      std::atomic_ref<uint64_t> signal(*word);
      uint64_t old = signal.load(std::memory_order_relaxed);
      while (old < it->second.value &&
             !signal.compare_exchange_weak(old, it->second.value, std::memory_order_release,
                                           std::memory_order_relaxed)) {
      }
      arrived = true;
    }
  }
  if (arrived) notify(p.rank);
}

void UcxNetwork::record_failure(Peer& p, const std::string& message) {
  {
    std::lock_guard lock(fail_mu_);
    // A peer that said goodbye, or our own teardown, closes connections: not failures.
    if (p.failed.load() || closing_.load()) return;
    p.failure = message;
    p.failed.store(true);
    if (failure_.empty()) {
      failure_ = message;
      failed_peer_.store(p.rank);
    }
  }
  notify(p.rank);  // waiters wake and see the failure
}

void UcxNetwork::depart(Peer& p) {
  std::lock_guard lock(fail_mu_);
  p.departed = true;
  if (p.failed.load()) return;
  p.failure = detail::cat(name(p.rank), " closed its connection to ", name(rank_));
  p.failed.store(true);
}

void UcxNetwork::notify(int peer_rank) {
  if (!closing_.load() && options_.on_arrival) options_.on_arrival(peer_rank);
}

void UcxNetwork::on_ep_error(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* p = static_cast<Peer*>(arg);
  p->net->record_failure(
      *p, detail::cat("connection to ", p->net->name(p->rank), " failed: ", status_text(status)));
}

std::string UcxNetwork::failure() const {
  std::lock_guard lock(fail_mu_);
  return failure_;
}

int UcxNetwork::failed_peer() const {
  return failed_peer_.load();
}

NetworkCounters UcxNetwork::counters() const {
  return NetworkCounters{writes_.load(), payload_bytes_.load()};
}

}  // namespace epcomm::ucx

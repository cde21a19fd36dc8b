// transport/ucx/ucx_network.cc — the internode Network over UCX: one context and one multi-threaded worker
// per Network, endpoints to the listed peers, writes as active messages (or RMA puts plus a signal message),
// and a progress thread that sleeps on the worker's event fd when nothing is in flight.
#include <sys/epoll.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <thread>

#include "common/env.h"
#include "epcomm/bootstrap.h"
#include "transport/network.h"
#include "transport/ucx/ucx_link.h"
#include "transport/ucx/ucx_util.h"

namespace epcomm {
namespace ucx {
namespace {

constexpr unsigned kAmWrite = 17;  // the one active-message id of this transport

enum class WriteMode : uint32_t { am = 1, put = 2 };

const char* mode_name(WriteMode m) {
  return m == WriteMode::am ? "am" : "put";
}

// Travels as the active-message header. In put mode the data is already in place (flushed) and only the
// signal travels as a message, so arrival handling is the same code for both modes.
struct WireHeader {
  uint64_t offset;
  uint64_t length;  // data bytes carried by this message (0 in put mode)
  uint64_t signal_offset;
  uint64_t value;
  uint64_t seq;  // per (sender, receiver): signals are applied in this order
  int32_t sender;
  uint32_t kind;  // kWrite, or kGoodbye: the sender is closing its Network (not a failure)
};
constexpr uint32_t kWrite = 0, kGoodbye = 1;

// What a rank publishes at setup (first all_gather round); the blobs follow in a second round.
struct RankInfo {
  uint64_t region_bytes;
  uint64_t region_address;
  uint32_t mode;
  uint32_t address_bytes;
  uint32_t rkey_bytes;
  uint32_t setup_failed;  // this rank could not create its UCX objects: everyone raises
};

struct Landed {
  bool has_signal;  // false: a rejected write, skipped so that later signals are not held up forever
  uint64_t signal_offset;
  uint64_t value;
};

class UcxNetwork;

struct Peer {
  UcxNetwork* net = nullptr;
  int rank = -1;
  ucp_ep_h ep = nullptr;
  ucp_rkey_h rkey = nullptr;          // put mode: the peer's region
  uint64_t remote_region = 0;         // put mode: its address in the peer's process
  uint64_t next_seq_out = 0;          // communication thread only
  std::atomic<bool> failed{false};    // failed, or departed: write_signal raises Aborted
  bool departed = false;              // said goodbye: its disconnect is not a failure (fail_mu_)
  std::string failure;                // guarded by UcxNetwork::fail_mu_
  uint64_t next_seq_in = 0;           // guarded by UcxNetwork::recv_mu_
  std::map<uint64_t, Landed> landed;  // arrived out of order, guarded by recv_mu_
};

// One write in flight: owns the header and the iov list, which UCX reads until the send completes.
struct SendOp {
  UcxNetwork* net;
  Peer* peer;
  uint64_t ticket;  // 0 for the signal message of put mode (its ticket completed at the flush)
  WireHeader header;
  std::vector<ucp_dt_iov_t> iov;
};

struct RecvOp {
  UcxNetwork* net;
  Peer* peer;
  WireHeader header;
};

// Tickets complete out of order (different peers); complete(t) needs "every ticket <= t finished".
class TicketTracker {
 public:
  uint64_t issue() {
    std::lock_guard lock(mu_);
    done_.push_back(false);
    return base_ + done_.size() - 1;
  }
  void finish(uint64_t ticket) {
    std::lock_guard lock(mu_);
    done_[ticket - base_] = true;
    while (!done_.empty() && done_.front()) {
      done_.pop_front();
      ++base_;
    }
  }
  bool complete(uint64_t ticket) {
    std::lock_guard lock(mu_);
    return ticket < base_;
  }

 private:
  std::mutex mu_;
  uint64_t base_ = 1;  // the oldest unfinished ticket (tickets start at 1)
  std::deque<bool> done_;
};

class UcxNetwork final : public Network {
 public:
  UcxNetwork(Bootstrap& bootstrap, const NetworkOptions& options);
  ~UcxNetwork() override;

  int rank() const override { return rank_; }
  const std::vector<int>& peers() const override { return options_.peers; }
  std::string describe() const override;
  uint64_t write_signal(int peer, const Piece* pieces, int num_pieces, size_t offset, size_t signal_offset,
                        uint64_t signal_value) override;
  bool complete(uint64_t ticket) override { return tickets_.complete(ticket); }
  std::string failure() const override;
  int failed_peer() const override;
  NetworkCounters counters() const override;
  double measure_link_gbps(Bootstrap& bootstrap, size_t bytes, int iterations) override;

 private:
  // Setup, in order.
  void check_options() const;
  void create_worker();
  void register_region();
  void exchange_and_connect(Bootstrap& bootstrap, bool local_setup_failed);
  void check_agreement(const std::vector<RankInfo>& infos) const;
  void connect(int peer_rank, const std::vector<std::byte>& address, const std::vector<std::byte>& rkey,
               uint64_t region_address);
  void wait_wireup();
  void teardown() noexcept;
  void close_endpoints(Clock::time_point deadline) noexcept;

  // Data path.
  Peer& peer_of(int rank, const char* what);
  void check_bounds(const Peer& p, size_t offset, size_t length, size_t signal_offset) const;
  void send_am(SendOp* op, const Piece* pieces, int num_pieces);
  void send_put(SendOp* op, const Piece* pieces, int num_pieces);
  void send_signal_message(SendOp* op);
  void started(ucs_status_ptr_t req, SendOp* op);
  void finish_send(SendOp* op, ucs_status_t status);

  // Arrivals (progress thread).
  ucs_status_t on_message(const void* header, size_t header_length, void* data, size_t length,
                          const ucp_am_recv_param_t* param);
  void land(Peer& p, const WireHeader& h, bool has_signal);
  void record_failure(Peer& p, const std::string& message);
  void depart(Peer& p);
  void say_goodbye(Clock::time_point deadline) noexcept;
  void notify(int peer_rank);

  // Progress thread.
  void progress_loop();
  void wake_progress();

  static void on_ep_error(void* arg, ucp_ep_h ep, ucs_status_t status);
  static ucs_status_t on_am(void* arg, const void* header, size_t header_length, void* data, size_t length,
                            const ucp_am_recv_param_t* param);
  static void on_send_done(void* request, ucs_status_t status, void* user_data);
  static void on_flush_done(void* request, ucs_status_t status, void* user_data);
  static void on_recv_done(void* request, ucs_status_t status, size_t length, void* user_data);

  int rank_, size_;
  NetworkOptions options_;
  WriteMode mode_ = WriteMode::am;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_mem_h region_memh_ = nullptr;
  std::vector<std::unique_ptr<Peer>> peers_;
  std::vector<int> peer_index_;  // by global rank, -1 when not a peer

  TicketTracker tickets_;
  std::atomic<int64_t> in_flight_{0};  // sends and rendezvous receives not yet completed
  std::atomic<uint64_t> writes_{0}, payload_bytes_{0};

  mutable std::mutex fail_mu_;
  std::string failure_;
  int failed_peer_ = -1;
  std::mutex recv_mu_;
  std::atomic<bool> closing_{false};  // teardown started: arrivals no longer call on_arrival

  std::thread progress_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> idle_sleep_{false};
  int epoll_fd_ = -1;
};

UcxNetwork::UcxNetwork(Bootstrap& bootstrap, const NetworkOptions& options)
    : rank_(bootstrap.rank()), size_(bootstrap.size()), options_(options), peer_index_(size_, -1) {
  // A rank whose options or UCX objects are bad still takes part in the exchange, so that the others
  // raise at once instead of waiting for the bootstrap's deadline; it raises its own error.
  std::exception_ptr local_error;
  try {
    check_options();
    mode_ = env::ucx_write_mode() == "put" ? WriteMode::put : WriteMode::am;
    create_worker();
    register_region();
  } catch (...) {
    local_error = std::current_exception();
  }
  try {
    exchange_and_connect(bootstrap, local_error != nullptr);
    wait_wireup();
    bootstrap.barrier();  // every rank can be written to once this returns anywhere
  } catch (...) {
    teardown();
    if (local_error) std::rethrow_exception(local_error);
    throw;
  }
}

UcxNetwork::~UcxNetwork() {
  teardown();
}

void UcxNetwork::check_options() const {
  EPCOMM_CHECK(options_.region != nullptr || options_.region_bytes == 0,
               "make_ucx_network: region is null but region_bytes = ", options_.region_bytes);
  EPCOMM_CHECK(reinterpret_cast<uintptr_t>(options_.region) % 8 == 0,
               "make_ucx_network: region must be 8-byte aligned (signal words are atomics)");
  EPCOMM_CHECK(options_.timeout_s > 0, "make_ucx_network: timeout_s must be positive, got ",
               options_.timeout_s);
  std::vector<int> seen(size_, 0);
  for (int p : options_.peers) {
    EPCOMM_CHECK(p >= 0 && p < size_ && p != rank_, "make_ucx_network: peer ", p, " of rank ", rank_,
                 " is not another rank of the bootstrap (size ", size_, ")");
    EPCOMM_CHECK(!seen[p]++, "make_ucx_network: peer ", p, " listed twice");
  }
}

void UcxNetwork::create_worker() {
  ucp_config_t* config = nullptr;
  EPCOMM_CHECK_UCS(ucp_config_read(nullptr, nullptr, &config));
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
  ucs_status_t st = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  EPCOMM_CHECK_UCS(st);

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  // The communication thread sends while the progress thread progresses.
  wp.thread_mode = UCS_THREAD_MODE_MULTI;
  EPCOMM_CHECK_UCS(ucp_worker_create(context_, &wp, &worker_));
  ucp_worker_attr_t attr{};
  attr.field_mask = UCP_WORKER_ATTR_FIELD_THREAD_MODE;
  EPCOMM_CHECK_UCS(ucp_worker_query(worker_, &attr));
  if (attr.thread_mode != UCS_THREAD_MODE_MULTI)
    EPCOMM_THROW(SystemError, "UCX worker without multi-thread support (this UCX was built without it)");

  ucp_am_handler_param_t hp{};
  hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                  UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
  hp.id = kAmWrite;
  hp.cb = &UcxNetwork::on_am;
  hp.arg = this;
  hp.flags = UCP_AM_FLAG_WHOLE_MSG;
  EPCOMM_CHECK_UCS(ucp_worker_set_am_recv_handler(worker_, &hp));

  int efd = -1;
  EPCOMM_CHECK_UCS(ucp_worker_get_efd(worker_, &efd));
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  EPCOMM_CHECK_ERRNO(epoll_fd_);
  epoll_event ev{};
  ev.events = EPOLLIN;
  EPCOMM_CHECK_ERRNO(epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, efd, &ev));
  progress_ = std::thread([this] { progress_loop(); });
}

void UcxNetwork::register_region() {
  if (mode_ != WriteMode::put || options_.region_bytes == 0) return;
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  mp.address = options_.region;
  mp.length = options_.region_bytes;
  EPCOMM_CHECK_UCS(ucp_mem_map(context_, &mp, &region_memh_));
}

void UcxNetwork::exchange_and_connect(Bootstrap& bootstrap, bool local_setup_failed) {
  ucp_address_t* address = nullptr;
  size_t address_bytes = 0;
  void* rkey = nullptr;
  size_t rkey_bytes = 0;
  if (!local_setup_failed) {
    EPCOMM_CHECK_UCS(ucp_worker_get_address(worker_, &address, &address_bytes));
    if (region_memh_) EPCOMM_CHECK_UCS(ucp_rkey_pack(context_, region_memh_, &rkey, &rkey_bytes));
  }
  RankInfo mine{options_.region_bytes,
                reinterpret_cast<uint64_t>(options_.region),
                static_cast<uint32_t>(mode_),
                static_cast<uint32_t>(address_bytes),
                static_cast<uint32_t>(rkey_bytes),
                local_setup_failed ? 1u : 0u};
  std::vector<std::byte> mine_bytes = as_bytes(&mine, sizeof mine);
  // Which ranks this one lists as peers, so that an asymmetric list is named instead of hanging.
  for (int r = 0; r < size_; ++r)
    mine_bytes.push_back(
        std::byte{std::find(options_.peers.begin(), options_.peers.end(), r) != options_.peers.end()});
  std::vector<std::byte> blob = as_bytes(address, address_bytes);
  std::vector<std::byte> rkey_blob = as_bytes(rkey, rkey_bytes);
  if (address) ucp_worker_release_address(worker_, address);
  if (rkey) ucp_rkey_buffer_release(rkey);

  const size_t stride = sizeof(RankInfo) + size_;
  std::vector<std::byte> all = bootstrap.all_gather(mine_bytes);
  std::vector<RankInfo> infos(size_);
  std::vector<size_t> address_lengths(size_), rkey_lengths(size_);
  for (int r = 0; r < size_; ++r) {
    std::memcpy(&infos[r], all.data() + r * stride, sizeof(RankInfo));
    address_lengths[r] = infos[r].address_bytes;
    rkey_lengths[r] = infos[r].rkey_bytes;
  }
  check_agreement(infos);
  // Every rank checks every pair, so that all raise the same error.
  const auto lists = [&](int a, int b) { return all[a * stride + sizeof(RankInfo) + b] != std::byte{0}; };
  for (int a = 0; a < size_; ++a)
    for (int b = 0; b < size_; ++b)
      if (lists(a, b) && !lists(b, a))
        EPCOMM_THROW(InvalidUsage, "make_ucx_network: rank ", a, " lists rank ", b, " as a peer, but rank ",
                     b, " does not list rank ", a, " (peers must be symmetric)");
  auto addresses = gather_blobs(bootstrap, blob, address_lengths);
  auto rkeys = gather_blobs(bootstrap, rkey_blob, rkey_lengths);
  for (int p : options_.peers) connect(p, addresses[p], rkeys[p], infos[p].region_address);
}

void UcxNetwork::check_agreement(const std::vector<RankInfo>& infos) const {
  for (int r = 0; r < size_; ++r)
    if (infos[r].setup_failed)
      EPCOMM_THROW(Aborted, "make_ucx_network: rank ", r, " failed to create its Network (see its error)");
  bool same_size = true, same_mode = true;
  for (const RankInfo& i : infos) {
    same_size &= i.region_bytes == infos[0].region_bytes;
    same_mode &= i.mode == infos[0].mode;
  }
  if (!same_size) {
    std::string list;
    for (int r = 0; r < size_; ++r)
      list += detail::cat(r ? ", " : "", "rank ", r, " = ", infos[r].region_bytes);
    EPCOMM_THROW(InvalidUsage, "make_ucx_network: region_bytes must be equal on every rank: ", list);
  }
  if (!same_mode) {
    std::string list;
    for (int r = 0; r < size_; ++r)
      list += detail::cat(r ? ", " : "", "rank ", r, " = ", mode_name(WriteMode(infos[r].mode)));
    EPCOMM_THROW(InvalidUsage, "make_ucx_network: EPCOMM_UCX_WRITE must be equal on every rank: ", list);
  }
}

void UcxNetwork::connect(int peer_rank, const std::vector<std::byte>& address,
                         const std::vector<std::byte>& rkey, uint64_t region_address) {
  auto p = std::make_unique<Peer>();
  p->net = this;
  p->rank = peer_rank;
  p->remote_region = region_address;
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.address = reinterpret_cast<const ucp_address_t*>(address.data());
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;  // a dead peer fails its endpoint instead of hanging sends
  ep.err_handler.cb = &UcxNetwork::on_ep_error;
  ep.err_handler.arg = p.get();
  Peer* raw = p.get();
  peer_index_[peer_rank] = static_cast<int>(peers_.size());
  peers_.push_back(std::move(p));
  ucs_status_t st = ucp_ep_create(worker_, &ep, &raw->ep);
  if (st != UCS_OK) {
    raw->ep = nullptr;
    EPCOMM_THROW(SystemError, "connection to rank ", peer_rank, " failed: ", status_text(st));
  }
  if (!rkey.empty()) {
    st = ucp_ep_rkey_unpack(raw->ep, rkey.data(), &raw->rkey);
    if (st != UCS_OK) EPCOMM_THROW(SystemError, "remote key of rank ", peer_rank, ": ", status_text(st));
  }
}

// Endpoints connect lazily; a flush completes once the connection is up, so a peer that cannot be reached
// fails here, within the deadline, rather than in the first write.
void UcxNetwork::wait_wireup() {
  const auto deadline = deadline_after(options_.timeout_s);
  for (auto& p : peers_) {
    ucp_request_param_t rp{};
    ucs_status_t st = wait_request(ucp_ep_flush_nbx(p->ep, &rp), deadline);
    if (st == UCS_ERR_TIMED_OUT)
      EPCOMM_THROW(Timeout, "make_ucx_network: connection to rank ", p->rank, " not established within ",
                   options_.timeout_s, " s");
    if (st != UCS_OK) EPCOMM_THROW(Aborted, "connection to rank ", p->rank, " failed: ", status_text(st));
  }
}

std::string UcxNetwork::describe() const {
  auto tls = env::get("UCX_TLS");
  return detail::cat("ucx ", mode_name(mode_), " over ",
                     tls ? *tls : std::string("UCX's choice of transports"));
}

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
  if (mode_ == WriteMode::am)
    send_am(op, pieces, num_pieces);
  else
    send_put(op, pieces, num_pieces);
  if (p.failed.load()) {  // failed while starting this write
    std::lock_guard lock(fail_mu_);
    EPCOMM_THROW(Aborted, p.failure);
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
          p, detail::cat("connection to rank ", p.rank, " failed: ", status_text(UCS_PTR_STATUS(req))));
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
                   detail::cat("connection to rank ", op->peer->rank, " failed: ", status_text(status)));
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
      net->record_failure(
          *op->peer, detail::cat("connection to rank ", op->peer->rank, " failed: ", status_text(status)));
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
    net->record_failure(*op->peer,
                        detail::cat("connection to rank ", op->peer->rank, " failed: ", status_text(status)));
  net->land(*op->peer, op->header, status == UCS_OK);
  net->in_flight_.fetch_sub(1);
  delete op;
}

// Signals are applied in the sender's issue order: once a signal is visible, every earlier write of that
// sender to this rank has landed too (rendezvous writes may finish out of order).
void UcxNetwork::land(Peer& p, const WireHeader& h, bool has_signal) {
  bool arrived = false;
  {
    std::lock_guard lock(recv_mu_);
    p.landed[h.seq] = Landed{has_signal, h.signal_offset, h.value};
    for (auto it = p.landed.begin(); it != p.landed.end() && it->first == p.next_seq_in;
         it = p.landed.erase(it), ++p.next_seq_in) {
      if (!it->second.has_signal) continue;
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
      failed_peer_ = p.rank;
    }
  }
  notify(p.rank);  // waiters wake and see the failure
}

void UcxNetwork::depart(Peer& p) {
  std::lock_guard lock(fail_mu_);
  p.departed = true;
  if (p.failed.load()) return;
  p.failure = detail::cat("rank ", p.rank, " closed its connection to rank ", rank_);
  p.failed.store(true);
}

void UcxNetwork::notify(int peer_rank) {
  if (!closing_.load() && options_.on_arrival) options_.on_arrival(peer_rank);
}

void UcxNetwork::on_ep_error(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* p = static_cast<Peer*>(arg);
  p->net->record_failure(*p, detail::cat("connection to rank ", p->rank, " failed: ", status_text(status)));
}

std::string UcxNetwork::failure() const {
  std::lock_guard lock(fail_mu_);
  return failure_;
}

int UcxNetwork::failed_peer() const {
  std::lock_guard lock(fail_mu_);
  return failed_peer_;
}

NetworkCounters UcxNetwork::counters() const {
  return NetworkCounters{writes_.load(), payload_bytes_.load()};
}

// ---- progress thread ----

void UcxNetwork::wake_progress() {
  if (idle_sleep_.load()) ucp_worker_signal(worker_);
}

// Drains the worker, then sleeps on its event fd: 100 ms when idle (a write or the stop flag signals the
// worker), 1 ms while operations are in flight, in case a transport moves them on without an event.
// Polling without sleeping while busy was tried: on 2 shared cores it cost the sending thread more than it
// gained (docs/internode.md).
void UcxNetwork::progress_loop() {
  while (!stop_.load()) {
    while (ucp_worker_progress(worker_) != 0) {
    }
    if (ucp_worker_arm(worker_) == UCS_ERR_BUSY) continue;
    idle_sleep_.store(true);
    epoll_event ev;
    if (!stop_.load()) epoll_wait(epoll_fd_, &ev, 1, in_flight_.load() > 0 ? 1 : 100);
    idle_sleep_.store(false);
  }
}

// ---- teardown: bounded by timeout_s, never throws ----

void UcxNetwork::teardown() noexcept {
  const auto deadline = deadline_after(options_.timeout_s);
  if (progress_.joinable()) {
    // Let writes in flight finish (a dead peer's fail at once), so their memory is no longer read.
    while (in_flight_.load() > 0 && Clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (progress_.joinable()) say_goodbye(deadline);
  closing_.store(true);
  for (auto& p : peers_)
    if (p->rkey) ucp_rkey_destroy(p->rkey), p->rkey = nullptr;
  if (progress_.joinable()) close_endpoints(deadline);
  stop_.store(true);
  if (progress_.joinable()) {
    ucp_worker_signal(worker_);
    progress_.join();
  }
  if (epoll_fd_ >= 0) close(epoll_fd_);
  if (region_memh_) ucp_mem_unmap(context_, region_memh_);
  if (worker_) ucp_worker_destroy(worker_);  // closes whatever did not close in time
  if (context_) ucp_cleanup(context_);
  worker_ = nullptr;
  context_ = nullptr;
}

// Tells live peers that the coming disconnect is a close, not a failure (a peer that outlives this Network
// must not report it as failed). The flush-close that follows delivers the message first.
void UcxNetwork::say_goodbye(Clock::time_point deadline) noexcept {
  std::vector<ucs_status_ptr_t> requests;
  WireHeader bye{0, 0, 0, 0, 0, rank_, kGoodbye};
  for (auto& p : peers_) {
    if (!p->ep || p->failed.load()) continue;
    ucp_request_param_t rp{};
    requests.push_back(ucp_am_send_nbx(p->ep, kAmWrite, &bye, sizeof bye, nullptr, 0, &rp));
  }
  for (ucs_status_ptr_t req : requests) wait_request(req, deadline);
}

// Flush-close endpoints to live peers (what we sent is delivered), force-close failed ones; the progress
// thread drives the close requests.
void UcxNetwork::close_endpoints(Clock::time_point deadline) noexcept {
  std::vector<ucs_status_ptr_t> requests;
  for (auto& p : peers_) {
    if (!p->ep) continue;
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = p->failed.load() ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    requests.push_back(ucp_ep_close_nbx(p->ep, &rp));
    p->ep = nullptr;
  }
  for (ucs_status_ptr_t req : requests) wait_request(req, deadline);
}

// ---- link bandwidth ----

double UcxNetwork::measure_link_gbps(Bootstrap& bootstrap, size_t bytes, int iterations) {
  EPCOMM_CHECK(bytes > 0 && iterations > 0, "measure_link_gbps: bytes and iterations must be positive, got ",
               bytes, " and ", iterations);
  const int partner = options_.peers.empty() ? -1 : options_.peers.front();
  ucp_ep_h ep = partner < 0 ? nullptr : peer_of(partner, "measure_link_gbps").ep;
  return measure_put_gbps(context_, bootstrap, ep, partner, bytes, iterations, options_.timeout_s);
}

}  // namespace
}  // namespace ucx

std::unique_ptr<Network> make_ucx_network(Bootstrap& bootstrap, const NetworkOptions& options) {
  return std::make_unique<ucx::UcxNetwork>(bootstrap, options);
}

}  // namespace epcomm

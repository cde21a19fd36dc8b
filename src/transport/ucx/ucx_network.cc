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
#include "transport/ucx/ucx_network.h"
#include "transport/ucx/ucx_util.h"

namespace epcomm {
namespace ucx {

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
    EPCOMM_THROW(SystemError, "connection to ", name(peer_rank), " failed: ", status_text(st));
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
      EPCOMM_THROW(Timeout, "make_ucx_network: connection to ", name(p->rank), " not established within ",
                   options_.timeout_s, " s");
    if (st != UCS_OK) EPCOMM_THROW(Aborted, "connection to ", name(p->rank), " failed: ", status_text(st));
  }
}

std::string UcxNetwork::describe() const {
  auto tls = env::get("UCX_TLS");
  return detail::cat("ucx ", mode_name(mode_), " over ",
                     tls ? *tls : std::string("UCX's choice of transports"));
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
    while (true) {
      unsigned events;
      {
        std::lock_guard lock(worker_mu_);
        events = ucp_worker_progress(worker_);
      }
      if (events == 0) break;
      if (worker_waiters_.load(std::memory_order_relaxed) > 0) std::this_thread::yield();
    }
    ucs_status_t armed;
    {
      std::lock_guard lock(worker_mu_);
      armed = ucp_worker_arm(worker_);
    }
    if (armed == UCS_ERR_BUSY) continue;
    idle_sleep_.store(true);
    epoll_event ev;
    if (!stop_.load()) epoll_wait(epoll_fd_, &ev, 1, in_flight_.load() > 0 ? 1 : 100);
    idle_sleep_.store(false);
  }
}

// ---- teardown: bounded by timeout_s, never throws ----

void UcxNetwork::teardown() noexcept {
  // Three stages share the deadline. A peer that is unreachable without having failed (a cut link: TCP
  // notices late) keeps writes in flight or the goodbye pending: then every endpoint is force-closed, which
  // cancels what is still queued, instead of a flush-close that could not finish before the worker goes
  // (UCX asserts when a worker is destroyed under pending requests).
  const auto start = Clock::now();
  const double budget =
      abandoned_.load() ? std::min(options_.timeout_s, kAbandonedTeardownS) : options_.timeout_s;
  const auto third = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(budget / 3));
  bool stuck = false;
  if (progress_.joinable()) {
    // Let writes in flight finish (a dead peer's fail at once), so their memory is no longer read.
    while (in_flight_.load() > 0 && Clock::now() < start + third)
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    stuck = in_flight_.load() > 0;
  }
  if (progress_.joinable() && !stuck) stuck = !say_goodbye(start + 2 * third);
  closing_.store(true);
  for (auto& p : peers_)
    if (p->rkey) ucp_rkey_destroy(p->rkey), p->rkey = nullptr;
  if (progress_.joinable()) close_endpoints(start + 3 * third, stuck);
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
bool UcxNetwork::say_goodbye(Clock::time_point deadline) noexcept {
  std::vector<ucs_status_ptr_t> requests;
  WireHeader bye{0, 0, 0, 0, 0, rank_, kGoodbye};
  for (auto& p : peers_) {
    if (!p->ep || p->failed.load()) continue;
    ucp_request_param_t rp{};
    requests.push_back(ucp_am_send_nbx(p->ep, kAmWrite, &bye, sizeof bye, nullptr, 0, &rp));
  }
  bool all = true;
  for (ucs_status_ptr_t req : requests) all = wait_request(req, deadline) != UCS_ERR_TIMED_OUT && all;
  return all;
}

// Flush-close endpoints to live peers (what we sent is delivered), force-close failed ones (all of them when
// `force`); the progress thread drives the close requests.
void UcxNetwork::close_endpoints(Clock::time_point deadline, bool force) noexcept {
  std::vector<ucs_status_ptr_t> requests;
  for (auto& p : peers_) {
    if (!p->ep) continue;
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = force || p->failed.load() ? UCP_EP_CLOSE_FLAG_FORCE : 0;
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

}  // namespace ucx

std::unique_ptr<Network> make_ucx_network(Bootstrap& bootstrap, const NetworkOptions& options) {
  return std::make_unique<ucx::UcxNetwork>(bootstrap, options);
}

}  // namespace epcomm

// transport/ucx/ucx_network.h — the UCX Network's internals, shared by ucx_network.cc (setup, progress
// thread, teardown) and ucx_write.cc (writes and arrivals). Internal to transport/ucx/.
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transport/network.h"
#include "transport/ucx/ucx_util.h"

namespace epcomm::ucx {

constexpr unsigned kAmWrite = 17;  // the one active-message id of this transport

enum class WriteMode : uint32_t { am = 1, put = 2 };

inline const char* mode_name(WriteMode m) {
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
  bool has_signal;  // false: a write that failed to land; no later signal of its sender applies (land)
  uint64_t signal_offset;
  uint64_t value;
};

class UcxNetwork;

struct Peer {
  UcxNetwork* net = nullptr;
  int rank = -1;
  ucp_ep_h ep = nullptr;
  ucp_rkey_h rkey = nullptr;        // put mode: the peer's region
  uint64_t remote_region = 0;       // put mode: its address in the peer's process
  uint64_t next_seq_out = 0;        // communication thread only
  std::atomic<bool> failed{false};  // failed (write_signal raises Aborted), or departed
  bool departed =
      false;            // said goodbye: its disconnect is not a failure, writes to it are dropped (fail_mu_)
  std::string failure;  // guarded by UcxNetwork::fail_mu_
  uint64_t next_seq_in = 0;           // guarded by UcxNetwork::recv_mu_
  std::map<uint64_t, Landed> landed;  // arrived out of order, guarded by recv_mu_
  bool stream_broken = false;         // a write failed to land: no later signal applies (recv_mu_)
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

// Owns one UCP context, one worker (UCS_THREAD_MODE_MULTI) and its progress thread, an endpoint per peer,
// and in put mode the registration of the region. Threads: write_signal/complete/failure come from the
// owner's communication thread; UCX callbacks (arrivals, completions, endpoint errors) run on the progress
// thread, the only one calling ucp_worker_progress. Construction is collective; destruction is not (it
// sends live peers a goodbye, then closes) and, like the wire-up, is bounded by timeout_s.
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
  void abandon() noexcept override { abandoned_.store(true); }
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
  void close_endpoints(Clock::time_point deadline, bool force) noexcept;

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
  // A rank as errors name it ("rank 3", or "ep rank 3": NetworkOptions::peer_word).
  std::string name(int rank) const { return detail::cat(options_.peer_word, " ", rank); }
  void depart(Peer& p);
  bool say_goodbye(Clock::time_point deadline) noexcept;  // false: a goodbye did not go out in time
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
  std::atomic<int> failed_peer_{-1};  // read without the lock: OpContext::run asks at every step
  std::mutex recv_mu_;
  std::atomic<bool> abandoned_{false};  // teardown bounded by kAbandonedTeardownS (abandon())
  std::atomic<bool> closing_{false};    // teardown started: arrivals no longer call on_arrival

  // Serializes the threads that enter the worker on the data path (the progress thread, the communication
  // thread's sends). UCX's own lock in UCS_THREAD_MODE_MULTI is a spinlock: with more threads than cores
  // a thread spun away its whole time slice whenever the holder was descheduled (a fifth of all CPU time
  // in a 4-rank combine across two virtual nodes on 2 cores). This mutex sleeps instead, and the progress
  // thread yields between progress calls while a sender waits.
  mutable std::recursive_mutex worker_mu_;
  mutable std::atomic<int> worker_waiters_{0};
  std::unique_lock<std::recursive_mutex> lock_worker() const {
    worker_waiters_.fetch_add(1, std::memory_order_relaxed);
    std::unique_lock lock(worker_mu_);
    worker_waiters_.fetch_sub(1, std::memory_order_relaxed);
    return lock;
  }
  std::thread progress_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> idle_sleep_{false};
  int epoll_fd_ = -1;
};

}  // namespace epcomm::ucx

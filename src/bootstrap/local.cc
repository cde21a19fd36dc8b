// bootstrap/local.cc — processes on one host: a star of abstract Unix-domain sockets around rank 0.
//
// Rank 0 listens on "\0epcomm-<job_id>" (no file, so nothing is left behind even after kill -9); every other
// rank connects, says hello (rank, size) and waits for rank 0's welcome once all ranks are in. A collective
// is one frame from each non-root to rank 0 and one result frame back. Rank 0 judges every collective:
// when a rank is missing, closes, or disagrees, rank 0 sends the verdict (an abort frame carrying the error
// code and message) to everyone still connected, so every rank throws the same error naming the culprit.
// Any failure fails the bootstrap for good and closes its sockets, which tells the others.
#include <poll.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <thread>
#include <utility>

#include "bootstrap/deadline.h"
#include "bootstrap/socket.h"
#include "common/check.h"
#include "epcomm/bootstrap.h"

namespace epcomm {
namespace {

using namespace std::chrono_literals;
using bootstrap_detail::accept_pending;
using bootstrap_detail::Deadline;
using bootstrap_detail::Fd;
using bootstrap_detail::format_ranks;
using bootstrap_detail::FrameReader;
using bootstrap_detail::FrameType;
using bootstrap_detail::IoStatus;
using bootstrap_detail::ReadTarget;

uint64_t fnv1a64(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

bool is_name_safe(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](unsigned char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
           c == '_' || c == '.';
  });
}

// The abstract socket name; a hash stands in for job ids too long for sun_path.
std::string socket_name(const std::string& job_id) {
  std::string name = "epcomm-" + job_id;
  if (name.size() <= bootstrap_detail::kMaxAbstractNameBytes) return name;
  return "epcomm-h" + hex64(fnv1a64(job_id));
}

// Used to name shared memory, so it keeps to portable file-name characters and a modest length.
std::string unique_id_for(const std::string& job_id) {
  if (job_id.size() <= 64 && is_name_safe(job_id)) return "lo-" + job_id;
  return "lo-h" + hex64(fnv1a64(job_id));
}

const char* op_name(FrameType type) {
  switch (type) {
    case FrameType::kAllGather:
      return "all_gather";
    case FrameType::kBarrier:
      return "barrier";
    case FrameType::kHello:
      return "connect";
    default:
      return "an unknown collective";
  }
}

struct Hello {
  int32_t rank;
  int32_t size;
};

class LocalBootstrap final : public Bootstrap {
 public:
  LocalBootstrap(const std::string& job_id, int rank, int size, std::chrono::milliseconds timeout)
      : job_id_(job_id),
        rank_(rank),
        size_(size),
        timeout_(timeout),
        // Non-roots wait this much longer than rank 0 so that rank 0's verdict, which names the missing
        // rank, reaches them before their own deadline would only blame rank 0.
        grace_(std::min<std::chrono::milliseconds>(timeout, 2s)),
        unique_id_(unique_id_for(job_id)) {
    if (size_ == 1) return;
    if (rank_ == 0)
      connect_as_root();
    else
      connect_as_peer();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& unique_id() const override { return unique_id_; }

  std::vector<std::byte> all_gather(const std::vector<std::byte>& bytes) override {
    return collective(FrameType::kAllGather, bytes);
  }
  void barrier() override { collective(FrameType::kBarrier, {}); }

 private:
  std::vector<std::byte> collective(FrameType type, const std::vector<std::byte>& bytes) {
    if (failure_)
      EPCOMM_THROW(Aborted, "bootstrap ", op_name(type), " on rank ", rank_,
                   ": this bootstrap failed earlier: ", failure_->what());
    ++seq_;
    if (size_ == 1) return bytes;
    return rank_ == 0 ? root_collective(type, bytes) : peer_collective(type, bytes);
  }

  std::string where() const { return detail::cat("(local job '", job_id_, "' of ", size_, " ranks)"); }

  // ---- rank 0 ----

  void connect_as_root() {
    const Deadline deadline(timeout_);
    listener_ = bootstrap_detail::is_tcp_endpoint(job_id_)
                    ? bootstrap_detail::listen_tcp(job_id_)
                    : bootstrap_detail::listen_abstract(socket_name(job_id_));
    const int listener = listener_.get();
    peers_.resize(static_cast<size_t>(size_));
    struct Pending {
      Fd fd;
      FrameReader reader;
    };
    std::vector<std::unique_ptr<Pending>> pending;  // accepted, hello not complete yet
    int num_connected = 0;
    while (num_connected < size_ - 1) {
      std::vector<pollfd> fds{{listener, POLLIN, 0}};
      for (auto& p : pending) fds.push_back({p->fd.get(), POLLIN, 0});
      int r = ::poll(fds.data(), fds.size(), deadline.poll_ms());
      if (r < 0 && errno == EINTR) continue;
      EPCOMM_CHECK_ERRNO(r);
      if (r == 0) {
        if (!deadline.expired()) continue;
        std::vector<int> missing;
        for (int q = 1; q < size_; ++q)
          if (!peers_[q].valid()) missing.push_back(q);
        fail(ErrorCode::Timeout,
             detail::cat("bootstrap connect timed out after ", timeout_.count(), " ms on rank 0: ranks ",
                         format_ranks(missing), " did not connect ", where()));
      }
      // Pending entries first: accepting below appends to `pending` and would shift the pollfd indices.
      for (size_t i = pending.size(); i-- > 0;) {
        if (fds[i + 1].revents == 0) continue;
        IoStatus s = pending[i]->reader.read_from(pending[i]->fd.get());
        // A connection that closes or speaks garbage before saying hello is not a rank yet: forget it. If it
        // was a rank that died, the deadline names it as missing.
        if (s != IoStatus::kOk) {
          pending.erase(pending.begin() + static_cast<ptrdiff_t>(i));
          continue;
        }
        if (!pending[i]->reader.done()) continue;
        register_peer(std::move(pending[i]->fd), pending[i]->reader);
        pending.erase(pending.begin() + static_cast<ptrdiff_t>(i));
        ++num_connected;
      }
      if (fds[0].revents != 0) {
        for (Fd fd = accept_pending(listener); fd.valid(); fd = accept_pending(listener))
          pending.push_back(std::make_unique<Pending>(Pending{std::move(fd), FrameReader{}}));
      }
    }
    // The listener stays open (never accepted from again) so that the job id stays taken while the job
    // lives: a second job started with the same id fails at once instead of meeting this job's ranks.
    const Deadline send_deadline(timeout_);
    for (int q = 1; q < size_; ++q) {
      IoStatus s =
          bootstrap_detail::send_frame(peers_[q].get(), FrameType::kWelcome, 0, nullptr, 0, send_deadline);
      if (s != IoStatus::kOk)
        fail(ErrorCode::Aborted,
             detail::cat("bootstrap connect on rank 0: rank ", q,
                         " closed its connection before the welcome (exited or died?) ", where()));
    }
  }

  // Checks a hello and files the connection under its rank; a bad hello fails the whole group.
  void register_peer(Fd fd, FrameReader& reader) {
    if (reader.type() != FrameType::kHello || reader.payload().size() != sizeof(Hello))
      fail(ErrorCode::Internal,
           detail::cat("bootstrap connect on rank 0: a connection sent frame type ", reader.header().type,
                       " of ", reader.payload().size(), " bytes instead of a hello ", where()));
    Hello hello;
    std::memcpy(&hello, reader.payload().data(), sizeof(hello));
    if (hello.rank <= 0 || hello.rank >= size_ || peers_[hello.rank].valid()) {
      std::string msg =
          hello.rank > 0 && hello.rank < size_
              ? detail::cat("bootstrap connect: two processes claim rank ", hello.rank, " ", where())
              : detail::cat("bootstrap connect: a process claims rank ", hello.rank,
                            " (expected 1 <= rank < ", size_, ") ", where());
      send_abort(fd.get(), ErrorCode::InvalidUsage, msg, Deadline(200ms));
      fail(ErrorCode::InvalidUsage, msg);
    }
    peers_[hello.rank] = std::move(fd);
    if (hello.size != size_)
      fail(ErrorCode::InvalidUsage, detail::cat("bootstrap connect: rank ", hello.rank, " says the job has ",
                                                hello.size, " ranks but rank 0 says ", size_, " ", where()));
  }

  std::vector<std::byte> root_collective(FrameType type, const std::vector<std::byte>& bytes) {
    const char* op = op_name(type);
    const Deadline deadline(timeout_);
    std::vector<FrameReader> readers(static_cast<size_t>(size_));
    std::vector<ReadTarget> targets;
    for (int q = 1; q < size_; ++q) targets.push_back({peers_[q].get(), &readers[q]});

    bootstrap_detail::ReadOutcome got = bootstrap_detail::read_frames(targets, deadline);
    if (got.status == IoStatus::kTimeout) {
      std::vector<int> missing;
      for (int q = 1; q < size_; ++q)
        if (!readers[q].done()) missing.push_back(q);
      fail(ErrorCode::Timeout,
           detail::cat("bootstrap ", op, " timed out after ", timeout_.count(), " ms on rank 0: ranks ",
                       format_ranks(missing), " did not arrive ", where()));
    }
    if (got.status != IoStatus::kOk) {
      const int q = got.failed_index + 1;
      if (got.status == IoStatus::kClosed)
        fail(ErrorCode::Aborted, detail::cat("bootstrap ", op, " on rank 0: rank ", q,
                                             " closed its connection (exited, died, or failed) ", where()));
      fail(ErrorCode::Internal,
           detail::cat("bootstrap ", op, " on rank 0: rank ", q, " sent a malformed frame ", where()));
    }

    const size_t len = bytes.size();
    for (int q = 1; q < size_; ++q) {
      const FrameReader& r = readers[q];
      if (r.type() != type)
        fail(ErrorCode::InvalidUsage,
             detail::cat("bootstrap: rank ", q, " called ", op_name(r.type()), " while rank 0 called ", op,
                         " (collectives out of order) ", where()));
      if (r.header().seq != seq_)
        fail(ErrorCode::Internal, detail::cat("bootstrap ", op, ": rank ", q, " is at collective #",
                                              r.header().seq, " but rank 0 at #", seq_, " ", where()));
      if (r.header().len != len)
        fail(ErrorCode::InvalidUsage, detail::cat("bootstrap ", op, ": rank ", q, " contributed ",
                                                  r.header().len, " bytes but rank 0 contributed ", len,
                                                  " bytes (expected equal lengths on every rank) ", where()));
    }

    std::vector<std::byte> result(len * static_cast<size_t>(size_));
    if (len > 0) {
      std::memcpy(result.data(), bytes.data(), len);
      for (int q = 1; q < size_; ++q)
        std::memcpy(result.data() + static_cast<size_t>(q) * len, readers[q].payload().data(), len);
    }

    const Deadline send_deadline(timeout_);
    for (int q = 1; q < size_; ++q) {
      IoStatus s = bootstrap_detail::send_frame(peers_[q].get(), FrameType::kResult, seq_, result.data(),
                                                result.size(), send_deadline);
      if (s == IoStatus::kClosed)
        fail(ErrorCode::Aborted, detail::cat("bootstrap ", op, " on rank 0: rank ", q,
                                             " closed its connection before taking the result ", where()));
      if (s == IoStatus::kTimeout)
        fail(ErrorCode::Timeout,
             detail::cat("bootstrap ", op, " timed out after ", timeout_.count(), " ms on rank 0: rank ", q,
                         " did not take the result ", where()));
    }
    return result;
  }

  // Best effort: a peer that is gone simply misses the verdict and sees the closed socket instead.
  static void send_abort(int fd, ErrorCode code, const std::string& message, const Deadline& deadline) {
    std::vector<std::byte> payload(sizeof(uint32_t) + message.size());
    const uint32_t c = static_cast<uint32_t>(code);
    std::memcpy(payload.data(), &c, sizeof(c));
    std::memcpy(payload.data() + sizeof(c), message.data(), message.size());
    try {
      bootstrap_detail::send_frame(fd, FrameType::kAbort, 0, payload.data(), payload.size(), deadline);
    } catch (const Error&) {
    }
  }

  // ---- ranks 1 .. size-1 ----

  void connect_as_peer() {
    const Deadline deadline(timeout_);
    const Deadline answer_deadline(timeout_ + grace_);
    const std::string name = socket_name(job_id_);
    auto backoff = 1ms;
    for (;;) {
      root_ = bootstrap_detail::is_tcp_endpoint(job_id_) ? bootstrap_detail::try_connect_tcp(job_id_)
                                                         : bootstrap_detail::try_connect_abstract(name);
      if (root_.valid()) break;
      if (deadline.expired())
        fail(ErrorCode::Timeout,
             detail::cat("bootstrap connect timed out after ", timeout_.count(), " ms on rank ", rank_,
                         ": rank 0 is not listening (did it start?) ", where()));
      std::this_thread::sleep_for(
          std::min<std::chrono::milliseconds>(backoff, std::chrono::milliseconds(deadline.poll_ms())));
      backoff = std::min(backoff * 2, std::chrono::milliseconds(50));
    }
    const Hello hello{rank_, size_};
    IoStatus s =
        bootstrap_detail::send_frame(root_.get(), FrameType::kHello, 0, &hello, sizeof(hello), deadline);
    FrameReader reader = await_root("connect", s, answer_deadline);
    if (reader.type() != FrameType::kWelcome)
      fail(ErrorCode::Internal, detail::cat("bootstrap connect on rank ", rank_, ": rank 0 sent frame type ",
                                            reader.header().type, " instead of the welcome ", where()));
  }

  std::vector<std::byte> peer_collective(FrameType type, const std::vector<std::byte>& bytes) {
    const char* op = op_name(type);
    const Deadline deadline(timeout_);
    const Deadline answer_deadline(timeout_ + grace_);
    IoStatus s = bootstrap_detail::send_frame(root_.get(), type, seq_, bytes.data(), bytes.size(), deadline);
    FrameReader reader = await_root(op, s, answer_deadline);
    const size_t expected = bytes.size() * static_cast<size_t>(size_);
    if (reader.type() != FrameType::kResult || reader.header().seq != seq_ ||
        reader.payload().size() != expected)
      fail(ErrorCode::Internal,
           detail::cat("bootstrap ", op, " on rank ", rank_, ": rank 0 answered frame type ",
                       reader.header().type, " for collective #", reader.header().seq, " with ",
                       reader.payload().size(), " bytes; expected a result for #", seq_, " with ", expected,
                       " bytes ", where()));
    return std::move(reader.payload());
  }

  // After sending to rank 0 (status `sent`), reads its answer. An abort frame is rank 0's verdict and is
  // rethrown with its code; it may be waiting in the socket even when our send found the socket closed.
  FrameReader await_root(const char* op, IoStatus sent, const Deadline& deadline) {
    if (sent == IoStatus::kTimeout)
      fail(ErrorCode::Timeout,
           detail::cat("bootstrap ", op, " timed out after ", timeout_.count(), " ms on rank ", rank_,
                       ": rank 0 did not take our data ", where()));
    FrameReader reader;
    auto got = bootstrap_detail::read_frames({{root_.get(), &reader}},
                                             sent == IoStatus::kOk ? deadline : Deadline(0ms));
    if (got.status == IoStatus::kOk && reader.type() == FrameType::kAbort) {
      const auto& p = reader.payload();
      uint32_t code = static_cast<uint32_t>(ErrorCode::Internal);
      if (p.size() >= sizeof(code)) std::memcpy(&code, p.data(), sizeof(code));
      std::string message(reinterpret_cast<const char*>(p.data()) + std::min(p.size(), sizeof(code)),
                          p.size() - std::min(p.size(), sizeof(code)));
      fail(static_cast<ErrorCode>(code),
           detail::cat("bootstrap ", op, " on rank ", rank_, " failed: rank 0 reports: ", message));
    }
    if (got.status == IoStatus::kOk && sent == IoStatus::kOk) return reader;
    if (got.status == IoStatus::kTimeout && sent == IoStatus::kOk)
      fail(ErrorCode::Timeout, detail::cat("bootstrap ", op, " timed out after ", timeout_.count(),
                                           " ms on rank ", rank_, ": rank 0 did not answer ", where()));
    if (got.status == IoStatus::kMalformed)
      fail(ErrorCode::Internal,
           detail::cat("bootstrap ", op, " on rank ", rank_, ": rank 0 sent a malformed frame ", where()));
    fail(ErrorCode::Aborted,
         detail::cat("bootstrap ", op, " on rank ", rank_,
                     ": rank 0 closed the connection (exited, died, or failed) ", where()));
  }

  // Fails this bootstrap for good. Rank 0 first passes the verdict to every connected rank; closing the
  // sockets then tells everyone else (including rank 0, when a non-root gives up) without waiting.
  [[noreturn]] void fail(ErrorCode code, const std::string& message) {
    if (!failure_) failure_.emplace(code, message);
    if (rank_ == 0) {
      const Deadline deadline(200ms);
      for (auto& p : peers_)
        if (p.valid()) send_abort(p.get(), code, message, deadline);
    }
    for (auto& p : peers_) p.reset();
    root_.reset();
    listener_.reset();
    throw Error(code, message);
  }

  const std::string job_id_;
  const int rank_;
  const int size_;
  const std::chrono::milliseconds timeout_;
  const std::chrono::milliseconds grace_;
  const std::string unique_id_;
  uint64_t seq_ = 0;       // collectives started, equal on every rank while the group is healthy
  std::vector<Fd> peers_;  // rank 0: peers_[q] is rank q's connection (peers_[0] unused)
  Fd root_;                // other ranks: the connection to rank 0
  Fd listener_;            // rank 0: keeps the job id's socket name taken until destruction
  std::optional<Error> failure_;
};

}  // namespace

std::unique_ptr<Bootstrap> make_local_bootstrap(const std::string& job_id, int rank, int size,
                                                std::chrono::milliseconds timeout) {
  EPCOMM_CHECK(!job_id.empty(), "make_local_bootstrap: job_id is empty");
  EPCOMM_CHECK_GT(size, 0, "make_local_bootstrap: bad job size");
  EPCOMM_CHECK(rank >= 0 && rank < size, "make_local_bootstrap: rank ", rank,
               " is outside the job (expected 0 <= rank < ", size, ")");
  EPCOMM_CHECK_GT(timeout.count(), 0, "make_local_bootstrap: the timeout must be positive (ms)");
  return std::make_unique<LocalBootstrap>(job_id, rank, size, timeout);
}

}  // namespace epcomm

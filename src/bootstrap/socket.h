// bootstrap/socket.h — non-blocking Unix-domain stream sockets in Linux's abstract namespace, and framed
// messages over them. Every call that waits is bounded by a Deadline; nothing here raises SIGPIPE.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "bootstrap/deadline.h"

namespace epcomm::bootstrap_detail {

// Owns one file descriptor. Move-only; closes it on destruction.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  Fd& operator=(Fd&& other) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void reset();

 private:
  int fd_ = -1;
};

// The longest name the abstract namespace takes (sun_path minus its leading NUL byte).
constexpr size_t kMaxAbstractNameBytes = 107;

// Binds and listens on the abstract address "\0<name>". Throws Error(InvalidUsage) when the name is taken
// (another job with the same id runs on this host) and Error(SystemError) for other failures.
Fd listen_abstract(const std::string& name);

// One non-blocking connect attempt. Returns an invalid Fd when nobody listens yet or the listener's backlog
// is full, so the caller retries until its deadline; throws Error(SystemError) for anything else.
Fd try_connect_abstract(const std::string& name);

// The same over TCP, for ranks on different hosts or network namespaces: `endpoint` is "tcp://A.B.C.D:PORT".
Fd listen_tcp(const std::string& endpoint);
Fd try_connect_tcp(const std::string& endpoint);
inline bool is_tcp_endpoint(const std::string& s) {
  return s.rfind("tcp://", 0) == 0;
}

// Accepts one pending connection without blocking; an invalid Fd when none is pending.
Fd accept_pending(int listen_fd);

enum class IoStatus {
  kOk,
  kTimeout,    // the deadline passed first
  kClosed,     // the peer closed its end (exited, died, or gave up)
  kMalformed,  // the peer sent bytes that are not an epcomm frame
};

// Frames are a fixed header then `len` payload bytes, in host byte order (both ends on one host, or, over
// TCP, on hosts of the same byte order).
enum class FrameType : uint32_t {
  kHello = 1,  // non-root -> root at connect: payload int32 rank, int32 size
  kWelcome,    // root -> non-root: every rank connected
  kAllGather,  // non-root -> root: this rank's contribution
  kBarrier,    // non-root -> root: empty
  kResult,     // root -> non-root: size * len bytes, rank-major
  kAbort,      // root -> non-root: payload uint32 ErrorCode, then the message; the group is failed
};

struct FrameHeader {
  uint32_t magic;
  uint32_t type;
  uint64_t seq;  // collective number, equal on every rank; 0 for the connect handshake
  uint64_t len;
};

constexpr uint32_t kFrameMagic = 0x42435045;  // "EPCB"
constexpr uint64_t kMaxFrameBytes = uint64_t{1}
                                    << 34;  // bounds the allocation a corrupt header could ask for

// Sends all `len` bytes, waiting for buffer space until the deadline.
IoStatus send_all(int fd, const void* data, size_t len, const Deadline& deadline);
IoStatus send_frame(int fd, FrameType type, uint64_t seq, const void* payload, size_t len,
                    const Deadline& deadline);

// Assembles one frame from a non-blocking socket across any number of readiness events.
class FrameReader {
 public:
  // Reads what is available without blocking and never past the end of this frame. kOk means more bytes are
  // needed or the frame is complete (see done()).
  IoStatus read_from(int fd);
  bool done() const { return done_; }
  const FrameHeader& header() const { return header_; }
  FrameType type() const { return static_cast<FrameType>(header_.type); }
  std::vector<std::byte>& payload() { return payload_; }

 private:
  FrameHeader header_{};
  size_t header_got_ = 0;
  std::vector<std::byte> payload_;
  size_t payload_got_ = 0;
  bool done_ = false;
};

struct ReadTarget {
  int fd;
  FrameReader* reader;
};

struct ReadOutcome {
  IoStatus status;
  int failed_index = -1;  // the target that closed or sent garbage
};

// Polls every target until each reader holds a whole frame (kOk), one peer closes or sends garbage (the first
// such target is reported), or the deadline passes (kTimeout; done() tells which readers are incomplete).
ReadOutcome read_frames(const std::vector<ReadTarget>& targets, const Deadline& deadline);

}  // namespace epcomm::bootstrap_detail

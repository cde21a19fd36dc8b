// bootstrap/socket.cc — abstract Unix-domain sockets and framed, deadline-bounded I/O.
#include "bootstrap/socket.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>

#include "common/check.h"

namespace epcomm::bootstrap_detail {
namespace {

struct AbstractAddress {
  sockaddr_un addr{};
  socklen_t len = 0;
};

AbstractAddress abstract_address(const std::string& name) {
  EPCOMM_CHECK(!name.empty(), "bootstrap: the abstract socket name is empty");
  EPCOMM_CHECK_LE(name.size(), kMaxAbstractNameBytes, "bootstrap: abstract socket name '", name,
                  "' is too long");
  AbstractAddress a;
  a.addr.sun_family = AF_UNIX;
  a.addr.sun_path[0] = '\0';  // the abstract namespace: no file, gone when the last descriptor closes
  std::memcpy(a.addr.sun_path + 1, name.data(), name.size());
  a.len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return a;
}

Fd new_socket() {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  EPCOMM_CHECK_ERRNO(fd);
  return Fd(fd);
}

// Waits until `fd` has any of `events` (or an error/hangup, which the next I/O call reports). False on
// timeout.
bool wait_for(int fd, short events, const Deadline& deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    int r = ::poll(&p, 1, deadline.poll_ms());
    if (r > 0) return true;
    if (r == 0) {
      if (deadline.expired()) return false;
      continue;
    }
    if (errno == EINTR) continue;
    EPCOMM_CHECK_ERRNO(r);
  }
}

}  // namespace

Fd& Fd::operator=(Fd&& other) noexcept {
  if (this != &other) {
    reset();
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

void Fd::reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

Fd listen_abstract(const std::string& name) {
  AbstractAddress a = abstract_address(name);
  Fd fd = new_socket();
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&a.addr), a.len) == -1) {
    int err = errno;
    if (err == EADDRINUSE)
      EPCOMM_THROW(InvalidUsage, "bootstrap: abstract socket '@", name,
                   "' is already bound: another job with the same job id runs on this host");
    EPCOMM_THROW(SystemError, "bootstrap: bind('@", name, "') failed: ", std::strerror(err), " (errno ", err,
                 ")");
  }
  EPCOMM_CHECK_ERRNO(::listen(fd.get(), SOMAXCONN));
  return fd;
}

Fd try_connect_abstract(const std::string& name) {
  AbstractAddress a = abstract_address(name);
  Fd fd = new_socket();
  for (;;) {
    if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&a.addr), a.len) == 0) return fd;
    int err = errno;
    if (err == EINTR) continue;
    // Not bound yet, backlog full, or (never seen for AF_UNIX) still in progress: let the caller retry.
    if (err == ECONNREFUSED || err == ENOENT || err == EAGAIN || err == EINPROGRESS) return Fd();
    EPCOMM_THROW(SystemError, "bootstrap: connect('@", name, "') failed: ", std::strerror(err), " (errno ",
                 err, ")");
  }
}

// "tcp://A.B.C.D:PORT" -> IPv4 socket address; InvalidUsage naming the endpoint otherwise.
static sockaddr_in tcp_address(const std::string& endpoint) {
  const std::string rest = endpoint.substr(6);  // after "tcp://"
  const size_t colon = rest.rfind(':');
  sockaddr_in a{};
  a.sin_family = AF_INET;
  char* end = nullptr;
  const long port = colon == std::string::npos ? -1 : std::strtol(rest.c_str() + colon + 1, &end, 10);
  const bool ok = colon != std::string::npos && end && *end == '\0' && port > 0 && port < 65536 &&
                  ::inet_pton(AF_INET, rest.substr(0, colon).c_str(), &a.sin_addr) == 1;
  EPCOMM_CHECK(ok, "bootstrap: endpoint '", endpoint,
               "': expected tcp://A.B.C.D:PORT (numeric IPv4, port 1..65535)");
  a.sin_port = htons(static_cast<uint16_t>(port));
  return a;
}

static Fd new_tcp_socket() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  EPCOMM_CHECK_ERRNO(fd);
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return Fd(fd);
}

Fd listen_tcp(const std::string& endpoint) {
  sockaddr_in a = tcp_address(endpoint);
  Fd fd = new_tcp_socket();
  int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&a), sizeof(a)) == -1) {
    int err = errno;
    if (err == EADDRINUSE)
      EPCOMM_THROW(InvalidUsage, "bootstrap: ", endpoint, " is already in use: another job listens there");
    EPCOMM_THROW(SystemError, "bootstrap: bind(", endpoint, ") failed: ", std::strerror(err), " (errno ", err,
                 ")");
  }
  EPCOMM_CHECK_ERRNO(::listen(fd.get(), SOMAXCONN));
  return fd;
}

Fd try_connect_tcp(const std::string& endpoint) {
  sockaddr_in a = tcp_address(endpoint);
  Fd fd = new_tcp_socket();
  int rc = ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&a), sizeof(a));
  if (rc == -1 && errno == EINPROGRESS) {  // give one attempt up to 200 ms, then let the caller retry
    pollfd p{fd.get(), POLLOUT, 0};
    if (::poll(&p, 1, 200) <= 0) return Fd();
    int err = 0;
    socklen_t len = sizeof(err);
    ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    rc = err == 0 ? 0 : -1;
    errno = err;
  }
  if (rc == 0) return fd;
  int err = errno;
  if (err == ECONNREFUSED || err == EINTR || err == ETIMEDOUT || err == EHOSTUNREACH || err == ENETUNREACH ||
      err == EAGAIN)
    return Fd();
  EPCOMM_THROW(SystemError, "bootstrap: connect(", endpoint, ") failed: ", std::strerror(err), " (errno ",
               err, ")");
}

Fd accept_pending(int listen_fd) {
  for (;;) {
    int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) return Fd(fd);
    int err = errno;
    if (err == EINTR) continue;
    if (err == EAGAIN || err == EWOULDBLOCK || err == ECONNABORTED) return Fd();
    EPCOMM_THROW(SystemError, "bootstrap: accept failed: ", std::strerror(err), " (errno ", err, ")");
  }
}

IoStatus send_all(int fd, const void* data, size_t len, const Deadline& deadline) {
  const char* p = static_cast<const char*>(data);
  while (len > 0) {
    ssize_t n = ::send(fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      len -= static_cast<size_t>(n);
      continue;
    }
    int err = errno;
    if (err == EINTR) continue;
    if (err == EAGAIN || err == EWOULDBLOCK) {
      if (!wait_for(fd, POLLOUT, deadline)) return IoStatus::kTimeout;
      continue;
    }
    if (err == EPIPE || err == ECONNRESET || err == ENOTCONN) return IoStatus::kClosed;
    EPCOMM_THROW(SystemError, "bootstrap: send failed: ", std::strerror(err), " (errno ", err, ")");
  }
  return IoStatus::kOk;
}

IoStatus send_frame(int fd, FrameType type, uint64_t seq, const void* payload, size_t len,
                    const Deadline& deadline) {
  FrameHeader h{kFrameMagic, static_cast<uint32_t>(type), seq, static_cast<uint64_t>(len)};
  IoStatus s = send_all(fd, &h, sizeof(h), deadline);
  if (s != IoStatus::kOk || len == 0) return s;
  return send_all(fd, payload, len, deadline);
}

IoStatus FrameReader::read_from(int fd) {
  while (!done_) {
    char* dst;
    size_t want;
    if (header_got_ < sizeof(header_)) {
      dst = reinterpret_cast<char*>(&header_) + header_got_;
      want = sizeof(header_) - header_got_;
    } else {
      dst = reinterpret_cast<char*>(payload_.data()) + payload_got_;
      want = payload_.size() - payload_got_;
    }
    ssize_t n = ::recv(fd, dst, want, MSG_DONTWAIT);
    if (n == 0) return IoStatus::kClosed;
    if (n < 0) {
      int err = errno;
      if (err == EINTR) continue;
      if (err == EAGAIN || err == EWOULDBLOCK) return IoStatus::kOk;
      if (err == ECONNRESET || err == ENOTCONN) return IoStatus::kClosed;
      EPCOMM_THROW(SystemError, "bootstrap: recv failed: ", std::strerror(err), " (errno ", err, ")");
    }
    if (header_got_ < sizeof(header_)) {
      header_got_ += static_cast<size_t>(n);
      if (header_got_ < sizeof(header_)) continue;
      if (header_.magic != kFrameMagic || header_.len > kMaxFrameBytes) return IoStatus::kMalformed;
      payload_.resize(static_cast<size_t>(header_.len));
    } else {
      payload_got_ += static_cast<size_t>(n);
    }
    done_ = payload_got_ == payload_.size();
  }
  return IoStatus::kOk;
}

ReadOutcome read_frames(const std::vector<ReadTarget>& targets, const Deadline& deadline) {
  std::vector<pollfd> fds;
  std::vector<int> index;  // fds[i] belongs to targets[index[i]]
  for (;;) {
    fds.clear();
    index.clear();
    for (size_t i = 0; i < targets.size(); ++i) {
      if (targets[i].reader->done()) continue;
      fds.push_back(pollfd{targets[i].fd, POLLIN, 0});
      index.push_back(static_cast<int>(i));
    }
    if (fds.empty()) return {IoStatus::kOk};
    int r = ::poll(fds.data(), fds.size(), deadline.poll_ms());
    if (r < 0) {
      if (errno == EINTR) continue;
      EPCOMM_CHECK_ERRNO(r);
    }
    if (r == 0) {
      if (deadline.expired()) return {IoStatus::kTimeout};
      continue;
    }
    for (size_t k = 0; k < fds.size(); ++k) {
      if (fds[k].revents == 0) continue;
      const ReadTarget& t = targets[index[k]];
      IoStatus s = t.reader->read_from(t.fd);
      if (s != IoStatus::kOk) return {s, index[k]};
    }
  }
}

}  // namespace epcomm::bootstrap_detail

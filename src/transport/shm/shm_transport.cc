// transport/shm/shm_transport.cc — one POSIX shared-memory segment per rank, mapped by every rank;
// futex doorbells with a bounded spin so that 8 ranks on 2 cores do not burn CPU.
#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstring>
#include <vector>

#include "common/check.h"
#include "common/env.h"
#include "epcomm/bootstrap.h"
#include "transport/transport.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define EPCOMM_CPU_RELAX() _mm_pause()
#else
#define EPCOMM_CPU_RELAX() __asm__ __volatile__("" ::: "memory")
#endif

namespace epcomm {
namespace {

// The first page of every segment belongs to the transport; the engine gets the rest.
struct alignas(64) ShmHeader {
  std::atomic<uint32_t> doorbell;
  std::atomic<uint32_t> sleepers;
};
constexpr size_t kShmHeaderBytes = 4096;
constexpr size_t kNameBytes = 96;

long futex(std::atomic<uint32_t>* addr, int op, uint32_t val, const timespec* ts) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), op, val, ts, nullptr, 0);
}

class ShmTransport final : public Transport {
 public:
  ShmTransport(Bootstrap& bootstrap, size_t segment_bytes, uint64_t instance, int host_ranks);
  ~ShmTransport() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  size_t segment_bytes() const override { return bytes_; }
  uint8_t* segment(int r) const override { return maps_[r] + kShmHeaderBytes; }
  uint32_t doorbell() const override { return header(rank_)->doorbell.load(std::memory_order_seq_cst); }
  bool wait_doorbell(uint32_t seen, Clock::time_point until) const override;
  void notify(int r) const override;

 private:
  ShmHeader* header(int r) const { return reinterpret_cast<ShmHeader*>(maps_[r]); }
  void unlink_all() noexcept;

  int rank_, size_;
  int spins_;  // polls before sleeping: a waiter only spins when every rank can have its own core
  size_t bytes_;
  std::vector<uint8_t*> maps_;
  std::vector<std::string> names_;
};

// Maps the page tables of the first kPeerHotBytes of a peer's segment now (the pages exist: their owner
// wrote them through), so that the first call does not take those minor faults one by one.
constexpr size_t kPeerHotBytes = size_t{16} << 20;
void populate_start(uint8_t* p, size_t total) {
  const size_t hot = std::min(total, kPeerHotBytes);
#ifdef MADV_POPULATE_READ
  if (madvise(p, hot, MADV_POPULATE_READ) == 0) return;
#endif
  for (size_t off = 0; off < hot; off += 4096) (void)*static_cast<volatile const uint8_t*>(p + off);
}

ShmTransport::ShmTransport(Bootstrap& bootstrap, size_t segment_bytes, uint64_t instance, int host_ranks)
    : rank_(bootstrap.rank()), size_(bootstrap.size()), bytes_(segment_bytes), maps_(size_, nullptr) {
  spins_ = env::spin_count(host_ranks > 0 ? host_ranks : size_);
  const size_t total = segment_bytes + kShmHeaderBytes;
  std::string own = detail::cat("/epcomm-", bootstrap.unique_id(), "-", instance, "-r", rank_);
  EPCOMM_CHECK_LT(own.size(), kNameBytes, "shared-memory name too long");
  names_.assign(size_, std::string());
  names_[rank_] = own;
  try {
    int fd = shm_open(own.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EPCOMM_CHECK_ERRNO(fd);
    // Reserve the pages now so that a full /dev/shm fails here with ENOSPC instead of SIGBUS later.
    int rc = posix_fallocate(fd, 0, static_cast<off_t>(total));
    if (rc != 0) {
      close(fd);
      EPCOMM_THROW(SystemError, "cannot allocate a shared-memory segment of ", total,
                   " bytes (num_nvl_bytes = ", segment_bytes, ") in /dev/shm: ", std::strerror(rc));
    }
    void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    close(fd);
    if (p == MAP_FAILED)
      EPCOMM_THROW(SystemError, "mmap of ", total, " bytes failed: ", std::strerror(errno));
    maps_[rank_] = static_cast<uint8_t*>(p);
    // Write through the whole segment once: first-touch faults are paid here, not by the first dispatch.
    std::memset(p, 0, total);

    std::vector<std::byte> mine(kNameBytes, std::byte{0});
    std::memcpy(mine.data(), own.data(), own.size());
    auto all = bootstrap.all_gather(mine);
    for (int r = 0; r < size_; ++r) {
      const char* n = reinterpret_cast<const char*>(all.data()) + static_cast<size_t>(r) * kNameBytes;
      names_[r] = std::string(n, strnlen(n, kNameBytes));
    }
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      int pfd = shm_open(names_[r].c_str(), O_RDWR, 0600);
      if (pfd == -1)
        EPCOMM_THROW(SystemError, "cannot open the shared-memory segment ", names_[r], " of rank ", r, ": ",
                     std::strerror(errno));
      // Only the start of a peer's segment is populated (control words, headers and the engine's windows
      // live there); the rest enters this process's page tables, and its resident set, where this rank
      // touches it. Populating everything would count every peer's whole segment in every rank's RSS.
      void* q = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, pfd, 0);
      close(pfd);
      if (q == MAP_FAILED)
        EPCOMM_THROW(SystemError, "mmap of rank ", r, "'s segment failed: ", std::strerror(errno));
      maps_[r] = static_cast<uint8_t*>(q);
      populate_start(maps_[r], total);
    }
    bootstrap.barrier();  // every rank has mapped every segment: the names are no longer needed
    unlink_all();
  } catch (...) {
    unlink_all();
    for (int r = 0; r < size_; ++r)
      if (maps_[r]) munmap(maps_[r], total);
    throw;
  }
}

ShmTransport::~ShmTransport() {
  unlink_all();
  for (int r = 0; r < size_; ++r)
    if (maps_[r]) munmap(maps_[r], bytes_ + kShmHeaderBytes);
}

void ShmTransport::unlink_all() noexcept {
  // Every rank unlinks every name (ENOENT is fine): a rank killed after creating its segment but before the
  // barrier does not leave its name behind as long as one peer got past the all-gather.
  for (auto& n : names_)
    if (!n.empty()) shm_unlink(n.c_str());
  names_.clear();
}

bool ShmTransport::wait_doorbell(uint32_t seen, Clock::time_point until) const {
  ShmHeader* h = header(rank_);
  const int spins = spins_;
  for (int i = 0; i < spins; ++i) {
    if (h->doorbell.load(std::memory_order_acquire) != seen) return true;
    EPCOMM_CPU_RELAX();
  }
  while (true) {
    auto now = Clock::now();
    if (now >= until) return h->doorbell.load(std::memory_order_acquire) != seen;
    auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(until - now);
    if (left > std::chrono::milliseconds(50)) left = std::chrono::milliseconds(50);
    timespec ts{static_cast<time_t>(left.count() / 1000000000), static_cast<long>(left.count() % 1000000000)};
    h->sleepers.fetch_add(1, std::memory_order_seq_cst);
    if (h->doorbell.load(std::memory_order_seq_cst) == seen) futex(&h->doorbell, FUTEX_WAIT, seen, &ts);
    h->sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (h->doorbell.load(std::memory_order_acquire) != seen) return true;
  }
}

void ShmTransport::notify(int r) const {
  ShmHeader* h = header(r);
  h->doorbell.fetch_add(1, std::memory_order_seq_cst);
  if (h->sleepers.load(std::memory_order_seq_cst) != 0) futex(&h->doorbell, FUTEX_WAKE, INT_MAX, nullptr);
}

}  // namespace

std::unique_ptr<Transport> make_shm_transport(Bootstrap& bootstrap, size_t segment_bytes, uint64_t instance,
                                              int host_ranks) {
  return std::make_unique<ShmTransport>(bootstrap, segment_bytes, instance, host_ranks);
}

}  // namespace epcomm

// transport/shm/shm_transport.cc — one POSIX shared-memory segment per rank, mapped by every rank;
// futex doorbells with a bounded spin so that 8 ranks on 2 cores do not burn CPU.
#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <vector>

#include "common/check.h"
#include "common/env.h"
#include "common/log.h"
#include "common/process.h"
#include "epcomm/bootstrap.h"
#include "tensor/output_arena.h"
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

struct SegmentRef;

class ShmTransport final : public Transport {
 public:
  ShmTransport(Bootstrap& bootstrap, size_t segment_bytes, uint64_t instance, int host_ranks,
               ArenaRequest arena);
  ~ShmTransport() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  size_t segment_bytes() const override { return bytes_; }
  uint8_t* segment(int r) const override { return maps_[r] + kShmHeaderBytes; }
  uint32_t doorbell() const override { return header(rank_)->doorbell.load(std::memory_order_seq_cst); }
  bool wait_doorbell(uint32_t seen, Clock::time_point until) const override;
  void notify(int r) const override;
  std::shared_ptr<OutputArena> output_arena() const override { return own_arena_; }
  uint8_t* arena(int r) const override { return arenas_[r]; }
  bool oversubscribed() const override { return oversubscribed_; }
  process::State peer_process(int r, int32_t* pid) const override {
    if (pid) *pid = procs_[r].pid;
    return procs_[r].pid > 0 ? process::state(procs_[r]) : process::State::running;
  }
  std::string describe() const override {
    return detail::cat("shm (", memfd_ ? "memfd" : "named, /dev/shm", ", spin ", spins_,
                       oversubscribed_ ? ", ranks outnumber cores" : "", ")");
  }

 private:
  ShmHeader* header(int r) const { return reinterpret_cast<ShmHeader*>(maps_[r]); }
  void unlink_all() noexcept;
  // Creates our segment (a memfd, or a name in /dev/shm) and maps every rank's. false: some rank could not
  // open some memfd and `must` is false (every rank then returns false and has released everything).
  bool attach(Bootstrap& bootstrap, uint64_t instance, bool memfd, bool must);
  // attach's phases: our segment created, sized and mapped (own_fd set as soon as it exists, so that the
  // caller closes it whatever happens); a peer's segment mapped; every rank's first failure to open one.
  void create_own_segment(const std::string& own, bool memfd, bool must, SegmentRef& mine, int& own_fd,
                          int& create_errno);
  void map_peer(int r, const SegmentRef& ref, int pfd, size_t total);
  std::pair<int, int> first_open_failure(Bootstrap& bootstrap, int failed_peer);
  void attach_own_arena(int fd, size_t total, SegmentRef& mine);
  void settle_reserves(Bootstrap& bootstrap, const std::vector<SegmentRef>& refs);
  void watch_peers(const std::vector<SegmentRef>& refs, const process::Id& self);

  int rank_, size_;
  int spins_;  // polls before sleeping: a waiter only spins when every rank can have its own core
  bool oversubscribed_ = false;  // the host's ranks outnumber its cores
  bool memfd_ = true;            // segments are memfds (false: POSIX names in /dev/shm)
  size_t bytes_;
  ArenaRequest arena_req_;
  std::vector<uint8_t*> maps_;
  std::vector<size_t> map_bytes_;  // what maps_[r] covers: the segment, and a peer's arena after it
  std::vector<uint8_t*> arenas_;   // every rank's output arena as mapped here (own: own_arena_'s), or null
  std::shared_ptr<OutputArena> own_arena_;
  std::vector<std::string> names_;
  std::vector<process::Id> procs_;  // the peers' processes, where they can be watched (pid 0: not watched)
};

// The arena starts at the first page boundary after the segment, in the same file.
size_t arena_file_offset(size_t segment_total) {
  return OutputArena::whole_pages(segment_total);
}

// Maps the page tables of the first kPeerHotBytes of a peer's segment now (the pages exist: their owner
// wrote them through), so that the first call does not take those minor faults one by one.
constexpr size_t kPeerHotBytes = size_t{16} << 20;
// A segment is reserved and written through up to kEagerSegmentBytes when it is created (all of the default
// 64 MiB one), so that no call pays first-touch faults there. Beyond that a memfd segment is address space
// whose pages come when the engine first writes them (they read as zeros): a large num_nvl_bytes, such as
// the 2e9 per rank DeepEP's scripts pass, then costs memory only where rows go instead of everywhere at once.
// A named segment in /dev/shm is reserved whole: tmpfs would turn a page it cannot allocate later into
// SIGBUS, where a memfd's owner only meets the ordinary out-of-memory rules.
constexpr size_t kEagerSegmentBytes = size_t{256} << 20;
// Makes the first `bytes` of a peer's arena (pages its owner wrote through) as cheap to write from here as
// later: page-table entries in one batch, then one load per page, because on some virtual machines (the
// development VM among them) the first access to a page through a new mapping costs several microseconds
// even with its entry present (measured: a first streaming-store pass over 470 MB through a fresh, populated
// mapping took 0.7-0.9 s, the next ones 20-30 ms; after one load per page the first took 22-25 ms).
// One load per page of [p, p + bytes).
void touch_pages(const uint8_t* p, size_t bytes) {
  for (size_t off = 0; off < bytes; off += OutputArena::kPage)
    (void)*static_cast<volatile const uint8_t*>(p + off);
}

// `for_writing`: this rank will write rows there (page-table entries made writable), else only read them.
void warm_peer_range(uint8_t* p, size_t bytes, bool for_writing) {
  if (!bytes) return;
#if defined(MADV_POPULATE_WRITE) && defined(MADV_POPULATE_READ)
  // Older kernels: the loads below fault the entries in.
  (void)madvise(p, bytes, for_writing ? MADV_POPULATE_WRITE : MADV_POPULATE_READ);
#endif
  touch_pages(p, bytes);
}

// Stores zeros over [p, p + bytes) with streaming stores (one pass, around the cache).
void stream_zeros(uint8_t* p, size_t bytes) {
#if defined(__x86_64__)
  const __m128i z = _mm_setzero_si128();
  size_t i = 0;
  for (; i + 16 <= bytes; i += 16) _mm_stream_si128(reinterpret_cast<__m128i*>(p + i), z);
  _mm_sfence();
  if (i < bytes) std::memset(p + i, 0, bytes - i);
#else
  std::memset(p, 0, bytes);
#endif
}

void populate_start(uint8_t* p, size_t total) {
  const size_t hot = std::min(total, kPeerHotBytes);
#ifdef MADV_POPULATE_READ
  if (madvise(p, hot, MADV_POPULATE_READ) == 0) return;
#endif
  touch_pages(p, hot);
}

// What every rank publishes about its segment: a memfd is opened by its peers through
// /proc/<pid>/fd/<fd> (and checked by device and inode, so a recycled pid cannot hand over another file);
// a named segment through shm_open(name).
struct SegmentRef {
  int32_t memfd;  // 1: memfd (pid, fd, dev, ino); 0: POSIX name
  int32_t pid;
  int32_t fd;
  int32_t pad;
  uint64_t start_ticks, pid_namespace;  // with pid: the owner's process (process::Id), watched by its peers
  uint64_t dev;
  uint64_t ino;
  uint64_t arena_bytes;    // 0: no output arena (after the segment, at arena_file_offset)
  uint64_t arena_reserve;  // its first bytes written through by the owner: peers populate their view
  char name[kNameBytes];
};

std::vector<SegmentRef> gather_refs(Bootstrap& bootstrap, const SegmentRef& mine) {
  std::vector<std::byte> bytes(sizeof(SegmentRef));
  std::memcpy(bytes.data(), &mine, sizeof(SegmentRef));
  auto all = bootstrap.all_gather(bytes);
  std::vector<SegmentRef> refs(static_cast<size_t>(bootstrap.size()));
  std::memcpy(refs.data(), all.data(), all.size());
  return refs;
}

// Opens rank r's segment; -1 with errno set (and `what` saying which path) when it cannot be opened.
int open_peer(const SegmentRef& ref, std::string& what) {
  if (!ref.memfd) {
    const std::string name(ref.name, strnlen(ref.name, kNameBytes));
    what = detail::cat("shm_open(", name, ")");
    return shm_open(name.c_str(), O_RDWR, 0600);
  }
  what = detail::cat("/proc/", ref.pid, "/fd/", ref.fd);
  if (ref.fd < 0) {  // the peer could not create a memfd
    errno = ENOSYS;
    return -1;
  }
  int fd = open(what.c_str(), O_RDWR | O_CLOEXEC);
  if (fd == -1) return -1;
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_dev) != ref.dev ||
      static_cast<uint64_t>(st.st_ino) != ref.ino) {
    close(fd);
    errno = ESTALE;  // not the file the peer published (the peer is gone and its pid was reused)
    return -1;
  }
  return fd;
}

ShmTransport::ShmTransport(Bootstrap& bootstrap, size_t segment_bytes, uint64_t instance, int host_ranks,
                           ArenaRequest arena)
    : rank_(bootstrap.rank()),
      size_(bootstrap.size()),
      bytes_(segment_bytes),
      arena_req_(arena),
      maps_(size_, nullptr),
      map_bytes_(size_, 0),
      arenas_(size_, nullptr) {
  const int local_ranks = host_ranks > 0 ? host_ranks : size_;
  spins_ = env::spin_count(local_ranks);
  oversubscribed_ = env::ranks_outnumber_cores(local_ranks);
  const std::string mode = env::shm_mode();
  const bool named = mode == "named" || !attach(bootstrap, instance, /*memfd=*/true, mode == "memfd");
  if (named) {
    if (mode != "named")
      EPCOMM_LOG(warn, rank_,
                 "shared memory: a rank could not open a peer's memfd, so every rank uses named "
                 "segments in /dev/shm (EPCOMM_SHM=named says so up front)");
    attach(bootstrap, instance, /*memfd=*/false, true);
  }
  memfd_ = !named;
}

void ShmTransport::create_own_segment(const std::string& own, bool memfd, bool must, SegmentRef& mine,
                                      int& own_fd, int& create_errno) {
  const size_t total = bytes_ + kShmHeaderBytes;
  if (memfd) {
    // Anonymous: no name exists at any moment, so a crash, even of every rank during setup, leaves nothing
    // behind; the memory goes with the last process that holds it. A kernel without memfds (before 3.17)
    // makes every rank fall back to names below, unless EPCOMM_SHM=memfd.
    own_fd = memfd_create(own.c_str() + 1, MFD_CLOEXEC);
    create_errno = errno;
    if (own_fd == -1 && must)
      EPCOMM_THROW(SystemError, "memfd_create failed: ", std::strerror(errno),
                   " (EPCOMM_SHM=named uses /dev/shm)");
  } else {
    names_.assign(size_, std::string());
    names_[rank_] = own;
    own_fd = shm_open(own.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EPCOMM_CHECK_ERRNO(own_fd);
  }
  mine.fd = own_fd;
  if (own_fd == -1) return;
  struct stat st {};
  EPCOMM_CHECK_ERRNO(fstat(own_fd, &st));
  mine.dev = static_cast<uint64_t>(st.st_dev);
  mine.ino = static_cast<uint64_t>(st.st_ino);
  // Reserve the eager part now so that a full /dev/shm (or memory limit) fails here with an error instead
  // of SIGBUS later (kEagerSegmentBytes).
  const size_t eager = memfd ? std::min(total, kEagerSegmentBytes) : total;
  if (ftruncate(own_fd, static_cast<off_t>(total)) != 0)
    EPCOMM_THROW(SystemError, "cannot size a shared-memory segment of ", total,
                 " bytes: ", std::strerror(errno));
  int rc = posix_fallocate(own_fd, 0, static_cast<off_t>(eager));
  if (rc != 0)
    EPCOMM_THROW(SystemError, "cannot allocate a shared-memory segment of ", eager,
                 " bytes (num_nvl_bytes = ", bytes_, ")", memfd ? "" : " in /dev/shm", ": ",
                 std::strerror(rc));
  const int populate = eager == total ? MAP_POPULATE : MAP_NORESERVE;
  void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED | populate, own_fd, 0);
  if (p == MAP_FAILED) EPCOMM_THROW(SystemError, "mmap of ", total, " bytes failed: ", std::strerror(errno));
  maps_[rank_] = static_cast<uint8_t*>(p);
  map_bytes_[rank_] = total;
  // Write through the eager part once: its first-touch faults are paid here, not by the first dispatch.
  std::memset(p, 0, eager);
  attach_own_arena(own_fd, total, mine);
}

// Only the start of a peer's segment is populated (control words, headers and the engine's windows live
// there); the rest enters this process's page tables, and its resident set, where this rank touches it.
// Populating everything would count every peer's whole segment in every rank's RSS. A peer's arena is mapped
// with its segment (address space only: pages exist where the peer wrote).
void ShmTransport::map_peer(int r, const SegmentRef& ref, int pfd, size_t total) {
  const size_t span = ref.arena_bytes ? arena_file_offset(total) + ref.arena_bytes : total;
  void* q = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, pfd, 0);
  close(pfd);
  if (q == MAP_FAILED)
    EPCOMM_THROW(SystemError, "mmap of rank ", r, "'s segment", ref.arena_bytes ? " and output arena" : "",
                 " (", span, " bytes of address space) failed: ", std::strerror(errno),
                 ref.arena_bytes ? " (BufferOptions::num_output_arena_bytes = 0 or EPCOMM_OUTPUT_ARENA=0 "
                                   "turns the arenas off)"
                                 : "");
  maps_[r] = static_cast<uint8_t*>(q);
  map_bytes_[r] = span;
  populate_start(maps_[r], total);
  if (ref.arena_bytes) {
    arenas_[r] = maps_[r] + arena_file_offset(total);
    // The peer wrote its reserve through: map those pages here now, not one fault at a time in the first
    // dispatch that writes rows into them (or the first combine that reads rows from them).
    const size_t reserve = std::min<uint64_t>(ref.arena_reserve, ref.arena_bytes);
    warm_peer_range(arenas_[r], reserve, arena_req_.peers_write);
  }
}

// Every rank learns which rank, if any, could not open which segment (this is also the barrier after which
// the names and the memfds are no longer needed): (culprit, the peer it could not open), or (-1, -1).
std::pair<int, int> ShmTransport::first_open_failure(Bootstrap& bootstrap, int failed_peer) {
  const int32_t mine_failed = failed_peer;
  std::vector<std::byte> bytes(sizeof mine_failed);
  std::memcpy(bytes.data(), &mine_failed, sizeof mine_failed);
  const auto all = bootstrap.all_gather(bytes);
  for (int r = 0; r < size_; ++r) {
    int32_t f;
    std::memcpy(&f, all.data() + static_cast<size_t>(r) * sizeof f, sizeof f);
    if (f >= 0) return {r, f};
  }
  return {-1, -1};
}

bool ShmTransport::attach(Bootstrap& bootstrap, uint64_t instance, bool memfd, bool must) {
  const size_t total = bytes_ + kShmHeaderBytes;
  std::string own = detail::cat("/epcomm-", bootstrap.unique_id(), "-", instance, "-r", rank_);
  EPCOMM_CHECK_LT(own.size(), kNameBytes, "shared-memory name too long");
  int own_fd = -1, create_errno = 0;
  auto release = [&] {
    unlink_all();
    if (own_fd != -1) close(own_fd);
    own_fd = -1;
    for (int r = 0; r < size_; ++r)
      if (maps_[r]) munmap(maps_[r], map_bytes_[r]);
    std::fill(maps_.begin(), maps_.end(), nullptr);
    std::fill(arenas_.begin(), arenas_.end(), nullptr);
    own_arena_.reset();
  };
  try {
    SegmentRef mine{};
    mine.memfd = memfd ? 1 : 0;
    const process::Id self = process::self();
    mine.pid = self.pid;
    mine.start_ticks = self.start_ticks;
    mine.pid_namespace = self.pid_namespace;
    std::memcpy(mine.name, own.data(), own.size());
    create_own_segment(own, memfd, must, mine, own_fd, create_errno);

    const std::vector<SegmentRef> refs = gather_refs(bootstrap, mine);
    if (!memfd)
      for (int r = 0; r < size_; ++r)
        names_[r] = std::string(refs[r].name, strnlen(refs[r].name, kNameBytes));
    int failed_peer = own_fd == -1 ? rank_ : -1, failed_errno = create_errno;
    std::string failed_what = "memfd_create";
    for (int r = 0; r < size_ && failed_peer < 0; ++r) {
      if (r == rank_) continue;
      std::string what;
      int pfd = open_peer(refs[r], what);
      if (pfd == -1) {
        failed_peer = r;
        failed_errno = errno;
        failed_what = what;
        break;
      }
      map_peer(r, refs[r], pfd, total);
    }
    const auto [culprit, culprit_peer] = first_open_failure(bootstrap, failed_peer);
    if (culprit >= 0 && must) {
      const char* hint = memfd ? " (ranks in different PID namespaces, or processes that are not dumpable, "
                                 "cannot open each other's memfds: set EPCOMM_SHM=named)"
                               : "";
      if (failed_peer >= 0)
        EPCOMM_THROW(SystemError, "cannot open the shared-memory segment of rank ", failed_peer, " through ",
                     failed_what, ": ", std::strerror(failed_errno), hint);
      EPCOMM_THROW(SystemError, "rank ", culprit, " cannot open the shared-memory segment of rank ",
                   culprit_peer, " (its own error says why)", hint);
    }
    if (culprit >= 0) {
      release();  // every rank falls back together
      return false;
    }
    settle_reserves(bootstrap, refs);
    watch_peers(refs, self);
    unlink_all();
    close(own_fd);
    own_fd = -1;
    return true;
  } catch (...) {
    release();
    throw;
  }
}

// Peers are watched when they are other processes in our PID namespace (ranks that are threads of this
// process, or processes whose pids mean nothing here, are not).
void ShmTransport::watch_peers(const std::vector<SegmentRef>& refs, const process::Id& self) {
  procs_.assign(size_, process::Id{});
  for (int r = 0; r < size_; ++r) {
    const SegmentRef& ref = refs[r];
    if (r == rank_ || ref.pid <= 0 || ref.pid == self.pid || !self.pid_namespace ||
        ref.pid_namespace != self.pid_namespace)
      continue;
    procs_[r] = process::Id{ref.pid, ref.start_ticks, ref.pid_namespace};
  }
}

ShmTransport::~ShmTransport() {
  unlink_all();
  for (int r = 0; r < size_; ++r)
    if (maps_[r]) munmap(maps_[r], map_bytes_[r]);
}

// Every mapping of a reserve is populated now. On some virtual machines (the development VM among them) the
// first pass of stores through a mapping of shared pages, once another mapping of them is populated, runs
// 30-60x slower than the next pass, through either mapping (measured on 128 MiB with two populated
// mappings: 213-445 ms for the first streaming pass through each, 7 ms for the next; one load or one store
// per page beforehand does not help, a full pass does, and it lasts). Without the passes below the first
// calls that write rows into a reserve pay that (the first 256-token expert_major dispatch after a 2 GiB
// reserve took 10-37x its median). A reserve is how a caller asks to pay first-touch costs at creation
// instead, so this rank passes once over every reserve it may write rows into: its own, and each peer's
// through its mapping of it (on a machine without the effect that costs one streaming pass of memory
// bandwidth). The reserves hold nothing yet (zeros, which the passes store again), and a barrier keeps every
// rank from writing outputs there before the others are done. EPCOMM_ARENA_SETTLE=0 skips the passes.
void ShmTransport::settle_reserves(Bootstrap& bootstrap, const std::vector<SegmentRef>& refs) {
  bool any = false;  // the same on every rank: the barrier below is collective (whatever each rank's env)
  for (int r = 0; r < size_; ++r) any = any || (refs[r].arena_bytes && refs[r].arena_reserve);
  if (!any) return;
  if (env::arena_settle())
    for (int i = 0; i < size_; ++i) {
      const int r = (rank_ + i) % size_;  // ours first, then the peers' (from different ranks at once)
      if (arenas_[r] && refs[r].arena_bytes && (r == rank_ || arena_req_.peers_write))
        stream_zeros(arenas_[r], std::min<uint64_t>(refs[r].arena_reserve, refs[r].arena_bytes));
    }
  bootstrap.barrier();
}

// Our output arena: the file grows (sparsely) by the arena, mapped on its own so that it outlives the
// transport while outputs carved from it are alive. Without address space for it the Buffer simply has
// no arena (its outputs come from its allocator and dispatch copies as without one).
void ShmTransport::attach_own_arena(int fd, size_t total, SegmentRef& mine) {
  if (arena_req_.bytes == 0) return;
  const size_t bytes = arena_req_.bytes / OutputArena::kPage * OutputArena::kPage;
  const size_t at = arena_file_offset(total);
  if (ftruncate(fd, static_cast<off_t>(at + bytes)) != 0)
    EPCOMM_THROW(SystemError, "cannot extend the shared-memory segment by an output arena of ", bytes,
                 " bytes: ", std::strerror(errno));
  void* a =
      mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, static_cast<off_t>(at));
  if (a == MAP_FAILED) return;  // (the file stays longer: sparse, nothing maps that part)
  own_arena_ = std::make_shared<OutputArena>(static_cast<uint8_t*>(a), bytes, kOutputCacheBytes);
  arenas_[rank_] = own_arena_->base();
  mine.arena_bytes = bytes;
  const size_t reserve = std::min(arena_req_.reserve, bytes);
  if (reserve) mine.arena_reserve = own_arena_->reserve(reserve) == 0 ? reserve : 0;
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
                                              int host_ranks, ArenaRequest arena) {
  return std::make_unique<ShmTransport>(bootstrap, segment_bytes, instance, host_ranks, arena);
}

}  // namespace epcomm

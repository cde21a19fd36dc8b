// transport/transport.h — the internal interface of the memory a host's ranks share (shm implements it;
// the network between hosts is transport/network.h). A Transport gives this rank load/store access to every
// local peer's segment, a doorbell to sleep on, and what it can tell about the peers' processes.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "common/process.h"

namespace epcomm {

class Bootstrap;
class OutputArena;

// Owned by one Buffer; used by its communication thread only (not thread-safe).
class Transport {
 public:
  using Clock = std::chrono::steady_clock;
  virtual ~Transport() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Bytes usable by the engine in every rank's segment (equal on all ranks).
  virtual size_t segment_bytes() const = 0;
  // The segment of `rank` (own included), readable and writable with plain loads/stores and atomics.
  virtual uint8_t* segment(int rank) const = 0;

  // This rank's doorbell: bumped by every notify() aimed at it. Take a snapshot *before* checking the
  // conditions you wait for, then wait_doorbell(snapshot): no wake-up can be lost.
  virtual uint32_t doorbell() const = 0;
  // Spins briefly, then sleeps until the doorbell differs from `seen` or `until` passes.
  // Returns true when it changed. Never throws.
  virtual bool wait_doorbell(uint32_t seen, Clock::time_point until) const = 0;
  // Rings `rank`'s doorbell after this rank published something it may wait for (release ordering).
  virtual void notify(int rank) const = 0;
  // Whether the ranks on this host outnumber its cores: a rank that waits for a peer is then often waiting
  // for that peer to get a core, so it should sleep rather than start work that keeps the core busy.
  virtual bool oversubscribed() const { return false; }
  // The process of `rank` on this host: gone (killed, exited), stopped (SIGSTOP, a debugger) or running;
  // `pid` (optional) gets its pid for messages. A transport that cannot tell (ranks as threads of one
  // process, peers in another PID namespace, a remote peer) answers running. Reads /proc: call it when a
  // wait makes no progress, not on every poll.
  virtual process::State peer_process(int rank, int32_t* pid = nullptr) const {
    (void)rank;
    (void)pid;
    return process::State::running;
  }
  // The rank that messages name for transport rank `rank`: itself, except in a view over some ranks of
  // another transport (a call among the live ranks of a group), which names the group's rank.
  virtual int group_rank(int rank) const { return rank; }
  // Whether this is such a view (its segments are also used by calls among other sets of ranks).
  virtual bool partial() const { return false; }
  // A short description for EPCOMM_LOG=info: "shm (memfd, spin 20000)", ...
  virtual std::string describe() const = 0;

  // The output arenas (shm, when the Buffer asked for them): this rank's, which its outputs are carved from,
  // and every rank's as mapped here (own included), so that a peer writes rows into their final place.
  virtual std::shared_ptr<OutputArena> output_arena() const { return nullptr; }
  virtual uint8_t* arena(int rank) const {
    (void)rank;
    return nullptr;
  }
};

// An output arena for every rank: `bytes` of address space (pages exist only where outputs were written),
// the first `reserve` bytes written through when it is created and mapped by every peer up front.
struct ArenaRequest {
  size_t bytes = 0;  // 0: none
  size_t reserve = 0;
  // false: the peers only read a rank's outputs (the ranks of a node of a Buffer across nodes), so their
  // view of its reserve is populated for reading and not written through at creation.
  bool peers_write = true;
};

// Shared memory between the ranks of one host (transport/shm/). Collective over `bootstrap`.
// Every name is unlinked before this returns, so nothing is left in /dev/shm even after kill -9.
// `host_ranks`: the ranks running on this host (of any group), which decides whether waiters may spin
// (env::spin_count); 0 = the bootstrap's size.
std::unique_ptr<Transport> make_shm_transport(Bootstrap& bootstrap, size_t segment_bytes, uint64_t instance,
                                              int host_ranks = 0, ArenaRequest arena = {});

}  // namespace epcomm

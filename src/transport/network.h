// transport/network.h — the internal interface of the internode transport (UCX today, transport/ucx/).
// Where the shared-memory Transport gives load/store access to the segments of the ranks of one node, a
// Network moves bytes between ranks on different nodes: "write these bytes at this offset of the peer's
// region, then raise this signal word there". The engine builds its two-hop protocol on that one verb.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace epcomm {

class Bootstrap;

struct NetworkOptions {
  // Ranks this rank will exchange with (global ranks of the bootstrap; endpoints are created to these only).
  // Must be symmetric: if a lists b, b lists a.
  std::vector<int> peers;
  // This rank's receive region: every write aimed at this rank lands in [region, region + region_bytes).
  // Usually a part of the rank's shared-memory segment, so that the ranks of its node can read what arrived.
  uint8_t* region = nullptr;
  size_t region_bytes = 0;
  // Called on the transport's progress thread after a write has landed and its signal word was stored, with
  // the sending rank; also after a peer failed (with that peer). Typically rings local doorbells. Must not
  // block or throw.
  std::function<void(int peer)> on_arrival;
  double timeout_s = 100;          // setup and teardown deadline
  std::string peer_word = "rank";  // how errors name a peer ("connection to rank 3 failed: ...")
};

// Counters since creation (for tests and the bench): what this rank handed to the network.
struct NetworkCounters {
  uint64_t writes = 0;         // write_signal calls
  uint64_t payload_bytes = 0;  // data bytes of those calls (signals not included)
};

// Owned by one Buffer. write_signal/complete/failure are called by the Buffer's communication thread only;
// arrivals are handled on the transport's own progress thread, which sleeps when nothing happens.
class Network {
 public:
  virtual ~Network() = default;

  virtual int rank() const = 0;
  virtual const std::vector<int>& peers() const = 0;
  // A short description for messages and the bench: "ucx am over tcp", "ucx put over rc_mlx5", ...
  virtual std::string describe() const = 0;

  struct Piece {
    const void* data;
    size_t bytes;
  };
  // Asynchronously writes the concatenation of `pieces` at byte `offset` of `peer`'s region; once all of
  // it is there, stores `signal_value` into the 8-byte-aligned uint64 at `signal_offset` of that region
  // (atomically, release, and never lowering it: the stored value is max(old, signal_value)), then runs the
  // peer's on_arrival. Pieces may be empty (a signal alone). The pieces' memory must stay untouched until
  // complete() returns true for the returned ticket (or for a later one: tickets complete in order per
  // rank, as seen by complete()). Throws Aborted naming the peer when the endpoint to it has failed, and
  // InvalidUsage when offset/size fall outside the peer's region. A write to a peer that said goodbye (its
  // Network is being destroyed after its last call) is dropped: its ticket completes at once.
  virtual uint64_t write_signal(int peer, const Piece* pieces, int num_pieces, size_t offset,
                                size_t signal_offset, uint64_t signal_value) = 0;
  // True once every write with a ticket <= `ticket` has been handed off (its source memory may be reused).
  virtual bool complete(uint64_t ticket) = 0;
  // Empty, or the first failure seen: "connection to rank 3 failed: Connection reset by remote peer
  // (UCX status -25)".
  virtual std::string failure() const = 0;
  // The peer named by failure(), or -1.
  virtual int failed_peer() const = 0;

  virtual NetworkCounters counters() const = 0;

  // The group over this Network failed (a peer died, stopped or timed out): its destruction need not wait for
  // peers that may never answer. Bounds the teardown by kAbandonedTeardown instead of timeout_s; what is
  // still queued is cancelled. Never throws.
  virtual void abandon() noexcept {}
  static constexpr double kAbandonedTeardownS = 0.5;

  // Raw bandwidth of this transport, for the bench's ratio_to_link: a collective over every rank of the
  // bootstrap that created this Network; ranks pair up with their first peer and move `bytes` each way
  // `iterations` times with the transport's fastest one-sided verb (a put into a registered region whose
  // packed remote key travelled through the Bootstrap). Returns this rank's GB/s (1e9 bytes/s).
  virtual double measure_link_gbps(Bootstrap& bootstrap, size_t bytes, int iterations) = 0;
};

// UCX (transport/ucx/). Collective over `bootstrap`: every rank of it calls this, with or without peers.
// Honours UCX's own environment (UCX_TLS, UCX_NET_DEVICES, ...). Errors name the peer and the UCX status.
std::unique_ptr<Network> make_ucx_network(Bootstrap& bootstrap, const NetworkOptions& options);

}  // namespace epcomm

// multirank/cases_network.cc — the internode Network (transport/network.h) over UCX, driven directly:
// bytes and signals between ranks of one host over whatever UCX_TLS allows (ctest sets tcp).
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "epcomm/bootstrap.h"
#include "multirank/driver.h"
#include "transport/network.h"

using namespace epcomm;
using namespace epcomm::testing;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// A rank's receive region (plain memory, 8-byte aligned) and its Network, with on_arrival counted per sender.
struct Endpoint {
  std::vector<uint64_t> words;
  std::unique_ptr<std::atomic<uint64_t>[]> arrivals;
  std::unique_ptr<Network> net;
  int size = 0;

  uint8_t* region() { return reinterpret_cast<uint8_t*>(words.data()); }
  // on_arrival runs just after the signal (or the failure) is stored, so a waiter that saw the word may
  // be a moment early: allow it one second.
  bool called_by(int peer) const;
  std::atomic_ref<uint64_t> signal(size_t offset) { return std::atomic_ref<uint64_t>(words[offset / 8]); }
};

std::vector<int> all_others(const RankCtx& ctx) {
  std::vector<int> p;
  for (int r = 0; r < ctx.size; ++r)
    if (r != ctx.rank) p.push_back(r);
  return p;
}

std::unique_ptr<Endpoint> open_endpoint(RankCtx& ctx, size_t region_bytes, std::vector<int> peers,
                                        double timeout_s = 30) {
  auto e = std::make_unique<Endpoint>();
  e->size = ctx.size;
  e->words.assign((region_bytes + 7) / 8, 0);
  e->arrivals.reset(new std::atomic<uint64_t>[ctx.size + 1]);
  for (int r = 0; r <= ctx.size; ++r) e->arrivals[r] = 0;
  NetworkOptions o;
  o.peers = std::move(peers);
  o.region = e->region();
  o.region_bytes = region_bytes;
  o.timeout_s = timeout_s;
  Endpoint* raw = e.get();
  o.on_arrival = [raw](int peer) {
    // Anything outside [0, size) is counted in the last slot, which must stay 0.
    raw->arrivals[(peer >= 0 && peer < raw->size) ? peer : raw->size].fetch_add(1);
  };
  e->net = make_ucx_network(ctx.group->bootstrap(), o);
  return e;
}

// Polls `done` until it holds or `timeout_s` passes; false on timeout.
template <typename F>
bool wait_for(F done, double timeout_s) {
  auto t0 = Clock::now();
  while (!done()) {
    if (seconds_since(t0) > timeout_s) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  return true;
}

bool Endpoint::called_by(int peer) const {
  return wait_for([&] { return arrivals[peer].load() > 0; }, 1);
}

// The byte that write `w` of `sender` to `receiver` carries at position `i`: every byte names its origin.
uint8_t pattern(int sender, int receiver, int w, size_t i) {
  uint64_t x =
      (static_cast<uint64_t>(sender) * 1000003u + receiver * 7919u + w * 104729u + i) * 0x9E3779B97F4A7C15ull;
  return static_cast<uint8_t>(x >> 56);
}

void expect_invalid_usage(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
  } catch (const Error& e) {
    std::string m = e.what();
    REQUIRE(e.code() == ErrorCode::InvalidUsage, "expected InvalidUsage, got ", error_code_name(e.code()),
            ": ", m);
    for (const std::string& p : parts) REQUIRE(m.find(p) != std::string::npos, "'", p, "' missing in: ", m);
    return;
  }
  REQUIRE(false, "expected InvalidUsage");
}

// Layout of the correctness case: each sender owns an area of small writes; the one big write (>= 16 MiB)
// from the previous rank lands in its own area, then the write of many pieces from the same rank; signal
// words (one per sender) come last.
constexpr size_t kSmallArea = 2 << 20;
constexpr size_t kBigWrite = (16 << 20) + 4099;
constexpr int kManyPieces = 70;  // more than any transport's iov limit (tcp: 6)
constexpr size_t kManyArea = kManyPieces * 40000;
constexpr int kWrites = 300;

struct Layout {
  int size;
  size_t small_area(int sender) const { return sender * kSmallArea; }
  size_t big_area() const { return size * kSmallArea; }
  size_t many_area() const { return big_area() + ((kBigWrite + 7) / 8) * 8; }
  size_t signal(int sender) const { return many_area() + kManyArea + 8 * sender; }
  size_t bytes() const { return signal(size) + 64; }
};

// One sender's writes to one receiver: sizes and piece splits from a seed both sides know.
struct Plan {
  struct Write {
    size_t offset, length;
    std::vector<size_t> pieces;
  };
  std::vector<Write> writes;
};

Plan plan_of(int sender, int receiver, const Layout& L) {
  std::mt19937_64 rng(sender * 131 + receiver);
  Plan p;
  size_t at = L.small_area(sender);
  for (int w = 0; w < kWrites; ++w) {
    Plan::Write wr;
    int n = static_cast<int>(rng() % 5);  // 0 pieces: a signal alone
    for (int k = 0; k < n; ++k) wr.pieces.push_back(rng() % 3 == 0 ? 0 : rng() % 3000);  // empty pieces too
    wr.offset = at;
    wr.length = 0;
    for (size_t b : wr.pieces) wr.length += b;
    at += wr.length;
    p.writes.push_back(wr);
  }
  if (at > L.small_area(sender) + kSmallArea) throw std::runtime_error("test plan overflows its area");
  return p;
}

}  // namespace

MR_CASE("net_write_signal", {false, 2}) {
  // Every rank writes kWrites writes of 0-4 pieces (some empty, some with no data at all) to every peer, and
  // one write of more than 16 MiB in 3 pieces to the next rank; receivers compare every byte, senders check
  // tickets and counters, and on_arrival was called with each sender (and nobody else).
  const Layout L{ctx.size};
  auto e = open_endpoint(ctx, L.bytes(), all_others(ctx));
  Network& net = *e->net;
  REQUIRE(net.rank() == ctx.rank && net.peers().size() == static_cast<size_t>(ctx.size - 1));
  const int next = (ctx.rank + 1) % ctx.size, prev = (ctx.rank + ctx.size - 1) % ctx.size;

  std::vector<std::vector<uint8_t>> sources;  // kept until the tickets complete
  std::vector<uint64_t> tickets;
  uint64_t payload = 0, writes = 0;
  auto send = [&](int peer, int w, size_t offset, const std::vector<size_t>& piece_bytes, size_t signal,
                  uint64_t value) {
    size_t total = 0;
    for (size_t b : piece_bytes) total += b;
    sources.emplace_back(total);
    for (size_t i = 0; i < total; ++i) sources.back()[i] = pattern(ctx.rank, peer, w, i);
    std::vector<Network::Piece> pieces;
    size_t at = 0;
    for (size_t b : piece_bytes) {
      pieces.push_back({sources.back().data() + at, b});
      at += b;
    }
    uint64_t t =
        net.write_signal(peer, pieces.data(), static_cast<int>(pieces.size()), offset, signal, value);
    REQUIRE(tickets.empty() || t > tickets.back(), "tickets must increase: ", t, " after ", tickets.back());
    tickets.push_back(t);
    payload += total;
    ++writes;
  };
  std::vector<Plan> plans(ctx.size);
  for (int peer : net.peers()) plans[peer] = plan_of(ctx.rank, peer, L);
  for (int w = 0; w < kWrites; ++w)
    for (int peer : net.peers()) {
      const Plan::Write& wr = plans[peer].writes[w];
      send(peer, w, wr.offset, wr.pieces, L.signal(ctx.rank), w + 1);
    }
  const size_t third = kBigWrite / 3;
  send(next, -1, L.big_area(), {third, third, kBigWrite - 2 * third}, L.signal(ctx.rank), kWrites + 1);
  std::vector<size_t> many;  // ~1.4 MB in 70 pieces: a rendezvous write from an iov list
  for (int k = 0; k < kManyPieces; ++k) many.push_back(k % 7 == 3 ? 0 : 1 + (k * 7919) % 39999);
  send(next, -2, L.many_area(), many, L.signal(ctx.rank), kWrites + 2);

  REQUIRE(wait_for([&] { return net.complete(tickets.back()); }, 30),
          "tickets did not complete: ", net.failure());
  for (uint64_t t : tickets) REQUIRE(net.complete(t), "ticket ", t, " not complete after ", tickets.back());
  NetworkCounters c = net.counters();
  REQUIRE(c.writes == writes && c.payload_bytes == payload, "counters ", c.writes, "/", c.payload_bytes,
          ", expected ", writes, "/", payload);

  for (int s : net.peers()) {
    const uint64_t last = s == prev ? kWrites + 2 : kWrites;
    REQUIRE(wait_for([&] { return e->signal(L.signal(s)).load(std::memory_order_acquire) == last; }, 30),
            "signal of rank ", s, " is ", e->signal(L.signal(s)).load(), ", expected ", last, "; ",
            net.failure());
    Plan p = plan_of(s, ctx.rank, L);
    for (int w = 0; w < kWrites; ++w)
      for (size_t i = 0; i < p.writes[w].length; ++i)
        REQUIRE(e->region()[p.writes[w].offset + i] == pattern(s, ctx.rank, w, i), "write ", w, " of rank ",
                s, " differs at byte ", i);
    REQUIRE(e->called_by(s), "on_arrival never called with rank ", s);
  }
  for (size_t i = 0; i < kBigWrite; ++i)
    REQUIRE(e->region()[L.big_area() + i] == pattern(prev, ctx.rank, -1, i), "big write differs at byte ", i);
  size_t many_bytes = 0;
  for (int k = 0; k < kManyPieces; ++k) many_bytes += k % 7 == 3 ? 0 : 1 + (k * 7919) % 39999;
  for (size_t i = 0; i < many_bytes; ++i)
    REQUIRE(e->region()[L.many_area() + i] == pattern(prev, ctx.rank, -2, i), "many-piece write differs at ",
            i);
  REQUIRE(e->region()[L.many_area() + many_bytes] == 0, "many-piece write ran past its end");
  REQUIRE(e->arrivals[ctx.size].load() == 0 && e->arrivals[ctx.rank].load() == 0,
          "on_arrival with a non-peer");
  ctx.group->bootstrap().barrier();  // nobody tears down while a peer still checks
  REQUIRE(net.failure().empty() && net.failed_peer() == -1, "unexpected failure: ", net.failure());
}

MR_CASE("net_store_max", {false, 2}) {
  // Signals never go down, and are applied in each sender's order: when the receiver sees a signal, the
  // data of that write and of every earlier write of the same sender is in place.
  constexpr int kSteps = 400;
  constexpr size_t kRow = 14336;      // a 7168-wide bf16 row
  constexpr size_t kBlock = 4 << 20;  // large enough for the rendezvous protocol
  const size_t block_at = kSteps * kRow, word_a = block_at + kBlock, word_b = word_a + 8;
  // Ranks pair up (0-1, 2-3); an odd last rank only takes part in the collectives.
  const int peer = ctx.rank ^ 1;
  auto e = open_endpoint(ctx, word_b + 8, peer < ctx.size ? std::vector<int>{peer} : std::vector<int>{});
  Network& net = *e->net;
  if (peer >= ctx.size) return ctx.group->bootstrap().barrier();
  std::vector<uint8_t> rows(kSteps * kRow), block(kBlock);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = pattern(ctx.rank, peer, static_cast<int>(i / kRow), i);
  for (size_t i = 0; i < kBlock; ++i) block[i] = pattern(ctx.rank, peer, -3, i);
  // A high value alone, then a lower one with a large block, then a marker (no data) on another word: the
  // marker may not overtake the block, and the lower value may not lower the word.
  Network::Piece none{nullptr, 0};
  net.write_signal(peer, &none, 0, 0, word_a, 1000000);
  Network::Piece big{block.data(), kBlock};
  net.write_signal(peer, &big, 1, block_at, word_a, 7);
  uint64_t t = net.write_signal(peer, nullptr, 0, 0, word_b, 1);
  // (>= 1: the peer may already have raised it further with its rows.)
  REQUIRE(wait_for([&] { return e->signal(word_b).load(std::memory_order_acquire) >= 1; }, 30),
          "marker missing: ", net.failure());
  REQUIRE(e->signal(word_a).load() == 1000000, "signal lowered to ", e->signal(word_a).load());
  for (size_t i = 0; i < kBlock; ++i)
    REQUIRE(e->region()[block_at + i] == pattern(peer, ctx.rank, -3, i),
            "the marker overtook the block (byte ", i, ")");
  // Rows with increasing values on word_b; the receiver checks the rows up to what it sees, while they fly.
  for (int s = 1; s < kSteps; ++s) {
    Network::Piece row{rows.data() + s * kRow, kRow};
    t = net.write_signal(peer, &row, 1, s * kRow, word_b, s + 1);
  }
  int checked = 1;
  auto t0 = Clock::now();
  while (checked < kSteps) {
    REQUIRE(seconds_since(t0) < 30, "stuck at row ", checked, ": ", net.failure());
    const int seen = static_cast<int>(e->signal(word_b).load(std::memory_order_acquire));
    for (; checked < seen; ++checked)
      for (size_t i = 0; i < kRow; ++i)
        REQUIRE(e->region()[checked * kRow + i] == pattern(peer, ctx.rank, checked, checked * kRow + i),
                "row ", checked, " not in place when the signal said ", seen);
  }
  REQUIRE(wait_for([&] { return net.complete(t); }, 30), "last ticket incomplete");
  REQUIRE(e->called_by(peer), "on_arrival never called with rank ", peer);
  ctx.group->bootstrap().barrier();
  REQUIRE(net.failure().empty(), net.failure());
}

MR_CASE("net_out_of_range", {false, 2}) {
  // Bad offsets raise InvalidUsage naming the peer, the offset, the length and the region size, and move
  // nothing; a write to a rank that is not a peer too; the Network stays usable.
  constexpr size_t kRegion = 4096;
  auto e = open_endpoint(ctx, kRegion, all_others(ctx));
  Network& net = *e->net;
  const int peer = (ctx.rank + 1) % ctx.size;
  std::vector<uint8_t> data(100, 0xAB);
  Network::Piece piece{data.data(), data.size()};
  const std::string who = detail::cat("rank ", peer);
  expect_invalid_usage([&] { net.write_signal(peer, &piece, 1, 4000, 0, 1); },
                       {who, "offset 4000", "100 bytes", "4096 bytes"});
  expect_invalid_usage([&] { net.write_signal(peer, &piece, 1, SIZE_MAX - 10, 0, 1); }, {who, "4096 bytes"});
  expect_invalid_usage([&] { net.write_signal(peer, &piece, 1, 0, 4096, 1); }, {who, "signal_offset 4096"});
  expect_invalid_usage([&] { net.write_signal(peer, &piece, 1, 0, 12, 1); }, {who, "signal_offset 12"});
  expect_invalid_usage([&] { net.write_signal(ctx.rank, &piece, 1, 0, 0, 1); },
                       {detail::cat("rank ", ctx.rank, " is not a peer")});
  REQUIRE(net.counters().writes == 0, "rejected writes were counted");
  net.write_signal(peer, &piece, 1, kRegion - 108, kRegion - 8, 5);
  const int from = (ctx.rank + ctx.size - 1) % ctx.size;
  REQUIRE(wait_for([&] { return e->signal(kRegion - 8).load() == 5; }, 30),
          "valid write lost: ", net.failure());
  REQUIRE(e->region()[kRegion - 108] == 0xAB && e->region()[kRegion - 9] == 0xAB &&
              e->region()[kRegion - 109] == 0,
          "edge write misplaced");
  REQUIRE(e->called_by(from), "on_arrival never called with rank ", from);
  ctx.group->bootstrap().barrier();
  REQUIRE(net.failure().empty(), net.failure());
}

MR_CASE("net_unequal_regions", {false, 2}) {
  // Rank 1 has a larger region: every rank raises InvalidUsage listing each rank's value.
  const size_t bytes = ctx.rank == 1 ? 8192 : 4096;
  std::string list = "rank 0 = 4096, rank 1 = 8192";
  expect_invalid_usage([&] { open_endpoint(ctx, bytes, all_others(ctx)); }, {"region_bytes", list});
  // The bootstrap is still in step: an equal retry works.
  auto e = open_endpoint(ctx, 4096, all_others(ctx));
  REQUIRE(e->net->failure().empty(), e->net->failure());
}

MR_CASE("net_idle_sleeps", {false, 2}) {
  // An idle Network costs no CPU: its progress thread sleeps on the worker's event fd. CPU time of the
  // process (every rank's, under the thread launcher) over one idle second stays far below a busy core's.
  auto e = open_endpoint(ctx, 4096, all_others(ctx));
  ctx.group->bootstrap().barrier();
  auto cpu_seconds = [] {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return u.ru_utime.tv_sec + u.ru_stime.tv_sec + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
  };
  const double c0 = cpu_seconds();
  std::this_thread::sleep_for(std::chrono::seconds(1));
  const double used = cpu_seconds() - c0;
  REQUIRE(used < 0.1, "an idle second cost ", used, " s of CPU");
  ctx.group->bootstrap().barrier();
}

MR_CASE("net_setup_errors", {false, 2}) {
  // Errors that one rank's arguments cause are raised on every rank, at once and in step: an asymmetric
  // peer list (InvalidUsage everywhere), and a bad peer list on rank 1 (its own InvalidUsage; Aborted
  // naming it elsewhere). Afterwards a correct Network works.
  std::vector<int> peers = ctx.rank == 1 ? std::vector<int>{} : all_others(ctx);
  if (ctx.rank != 1) peers.erase(std::remove(peers.begin(), peers.end(), 1), peers.end());
  if (ctx.rank == 0) peers.push_back(1);  // only rank 0 lists rank 1
  expect_invalid_usage([&] { open_endpoint(ctx, 4096, peers); },
                       {"rank 0 lists rank 1 as a peer, but rank 1 does not list rank 0"});
  auto t0 = Clock::now();
  try {
    open_endpoint(ctx, 4096, ctx.rank == 1 ? std::vector<int>{1} : all_others(ctx));
    REQUIRE(false, "a bad peer list on rank 1 must fail everywhere");
  } catch (const Error& e) {
    std::string m = e.what();
    if (ctx.rank == 1)
      REQUIRE(e.code() == ErrorCode::InvalidUsage && m.find("peer 1 of rank 1") != std::string::npos, m);
    else
      REQUIRE(e.code() == ErrorCode::Aborted &&
                  m.find("rank 1 failed to create its Network") != std::string::npos,
              m);
  }
  REQUIRE(seconds_since(t0) < 5, "the error took ", seconds_since(t0), " s");
  auto e = open_endpoint(ctx, 4096, all_others(ctx));
  REQUIRE(e->net->failure().empty(), e->net->failure());
}

MR_CASE("net_peer_killed", {true, 2, 1}) {
  // Rank 1 dies (SIGKILL) while the others write to it: failure() names rank 1 within the deadline,
  // write_signal raises Aborted naming it, on_arrival(1) woke the waiters, and destruction does not hang.
  const double timeout = 5;
  auto e = open_endpoint(ctx, 1 << 20, all_others(ctx), timeout);
  Network& net = *e->net;
  ctx.group->bootstrap().barrier();
  if (ctx.rank == 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    kill(getpid(), SIGKILL);
  }
  std::vector<uint8_t> row(14336, 1);
  Network::Piece piece{row.data(), row.size()};
  auto t0 = Clock::now();
  bool aborted = false;
  uint64_t t = 0;
  while (net.failure().empty() && seconds_since(t0) < timeout) {
    try {
      t = net.write_signal(1, &piece, 1, 0, 1 << 19, 1);
    } catch (const Error& err) {
      REQUIRE(err.code() == ErrorCode::Aborted, "got ", error_code_name(err.code()), ": ", err.what());
      aborted = true;
      break;
    }
    wait_for([&] { return net.complete(t) || !net.failure().empty(); }, timeout);
  }
  const std::string f = net.failure();
  REQUIRE(
      f.find("connection to rank 1 failed") != std::string::npos && f.find("UCX status") != std::string::npos,
      "failure: '", f, "' after ", seconds_since(t0), " s");
  REQUIRE(net.failed_peer() == 1, "failed_peer ", net.failed_peer());
  REQUIRE(seconds_since(t0) < timeout, "failure seen after ", seconds_since(t0), " s");
  std::fprintf(stderr, "[rank %d] saw the failure after %.3f s: %s\n", ctx.rank, seconds_since(t0),
               f.c_str());
  REQUIRE(e->called_by(1), "on_arrival(1) not called on failure");
  if (!aborted) {
    try {
      net.write_signal(1, &piece, 1, 0, 1 << 19, 2);
      REQUIRE(false, "write_signal to a failed peer must raise");
    } catch (const Error& err) {
      REQUIRE(err.code() == ErrorCode::Aborted && std::string(err.what()).find("rank 1") != std::string::npos,
              err.what());
    }
  }
  auto t1 = Clock::now();
  e.reset();
  REQUIRE(seconds_since(t1) < timeout + 1, "destruction took ", seconds_since(t1), " s");
}

MR_CASE("net_link_gbps", {false, 2}) {
  // Ranks pair up (0-1, 2-3, ...); an odd last rank has no peer, still takes part, and gets 0.
  const int partner = ctx.rank ^ 1;
  std::vector<int> peers;
  if (partner < ctx.size) peers.push_back(partner);
  auto e = open_endpoint(ctx, 4096, peers);
  double gbps = e->net->measure_link_gbps(ctx.group->bootstrap(), 4 << 20, 8);
  if (peers.empty())
    REQUIRE(gbps == 0, "a rank without peers measured ", gbps);
  else
    REQUIRE(gbps > 0, "measured ", gbps, " GB/s");
  std::fprintf(stderr, "[rank %d] %s: %.2f GB/s\n", ctx.rank, e->net->describe().c_str(), gbps);
}

// Not a ctest entry: the measurement behind docs/internode.md (run it with EPCOMM_UCX_WRITE=am and =put).
// Rank 0 writes to rank 1: batches of B rows of 14 KB (one write_signal per row, each raising the same
// word), or 1 MiB writes; rank 1 times from a barrier until the last signal arrives.
MR_CASE("net_throughput", {false, 2}) {
  constexpr size_t kRow = 14336;
  const int rounds = 20;
  struct Config {
    size_t bytes;
    int batch;
  };
  const Config configs[] = {{kRow, 64}, {kRow, 256}, {kRow, 512}, {1 << 20, 16}};
  size_t region = 0;
  for (const Config& c : configs) region = std::max(region, c.bytes * c.batch + 64);
  auto e = open_endpoint(ctx, region, ctx.rank < 2 ? std::vector<int>{1 - ctx.rank} : std::vector<int>{});
  std::vector<uint8_t> src(region, 3);
  uint64_t value = 0;
  for (const Config& c : configs) {
    const size_t word = c.bytes * c.batch;
    ctx.group->bootstrap().barrier();
    auto t0 = Clock::now();
    for (int r = 0; r < rounds; ++r) {
      if (ctx.rank == 0) {
        uint64_t t = 0;
        for (int i = 0; i < c.batch; ++i) {
          Network::Piece p{src.data() + i * c.bytes, c.bytes};
          t = e->net->write_signal(1, &p, 1, i * c.bytes, word, ++value);
        }
        REQUIRE(wait_for([&] { return e->net->complete(t); }, 60), "stuck");
      } else if (ctx.rank == 1) {
        value += c.batch;
        REQUIRE(wait_for([&] { return e->signal(word).load() >= value; }, 60), "stuck: ", e->net->failure());
      }
    }
    if (ctx.rank == 1) {
      double s = seconds_since(t0);
      std::printf("%s rows of %zu B, batch %d: %.3f GB/s, %.1f us per batch\n", e->net->describe().c_str(),
                  c.bytes, c.batch, c.bytes * c.batch * rounds / s / 1e9, s / rounds * 1e6);
      std::fflush(stdout);
    }
    ctx.group->bootstrap().barrier();
  }
}

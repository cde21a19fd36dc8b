// multirank/cases_failures.cc — cross-rank failures: mismatched parameters, a peer whose validation failed,
// a rank that skips a call, a rank killed during a dispatch; plus events and cost statistics.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "multirank/round_trip.h"
#include "support/check.h"
#include "transport/transport.h"

using namespace epcomm;
using namespace epcomm::testing;
using Clock = std::chrono::steady_clock;

namespace {

ProblemSpec small_spec(const RankCtx& ctx, int64_t hidden = 64, int64_t tokens = 12) {
  ProblemSpec s;
  s.num_ranks = ctx.size;
  s.num_experts = 2 * ctx.size;
  s.num_topk = 2;
  s.hidden = hidden;
  s.seed = 7;
  s.min_tokens = s.max_tokens = tokens;
  s.neg_prob = 0;
  return s;
}

DispatchArgs args_of(const Problem& P, int r, const LayoutResult& lay) {
  DispatchArgs a;
  a.x.data = x_of(P, r);
  a.topk_idx = topk_idx_of(P, r);
  a.topk_weights = topk_weights_of(P, r);
  a.num_tokens_per_expert = lay.num_tokens_per_expert;
  return a;
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

}  // namespace

MR_CASE("mismatch", {false, 2}) {
  // Ranks disagree on hidden, then on the receive order: every rank raises InvalidUsage naming the parameter
  // and each rank's value; the Buffer stays usable.
  Buffer buf(ctx.group, test_options(4 << 20, 20));
  Problem P = make_problem(small_spec(ctx, ctx.rank == 1 ? 32 : 64));
  LayoutResult lay = buf.get_dispatch_layout(topk_idx_of(P, ctx.rank), P.spec.num_experts);
  expect_error([&] { buf.dispatch(args_of(P, ctx.rank, lay)); }, ErrorCode::InvalidUsage,
               {"mismatch", "hidden", "rank 0 = 64", "rank 1 = 32"});
  Problem Q = make_problem(small_spec(ctx));
  DispatchArgs a = args_of(Q, ctx.rank, lay);
  a.receive_order = ctx.rank == 0 ? ReceiveOrder::rank_major : ReceiveOrder::expert_major;
  expect_error([&] { buf.dispatch(a); }, ErrorCode::InvalidUsage,
               {"mismatch", "receive_order", "rank 0 = rank_major"});
  RoundTrip rt;
  rt.spec = small_spec(ctx);
  run_round_trip(ctx, buf, rt);
}

MR_CASE("peer_validation_abort", {false, 2}) {
  // Rank 1 passes bad weights: it raises its InvalidUsage, every other rank raises Aborted quoting it at
  // once (far below the 30 s deadline), and the next call works.
  Buffer buf(ctx.group, test_options(4 << 20, 30));
  Problem P = make_problem(small_spec(ctx));
  LayoutResult lay = buf.get_dispatch_layout(topk_idx_of(P, ctx.rank), P.spec.num_experts);
  DispatchArgs a = args_of(P, ctx.rank, lay);
  std::vector<float> w(12);
  if (ctx.rank == 1) a.topk_weights = Tensor::wrap(w.data(), DType::f32, {12, 1});
  auto t0 = Clock::now();
  if (ctx.rank == 1)
    expect_error([&] { buf.dispatch(a); }, ErrorCode::InvalidUsage,
                 {"epcomm[rank 1] dispatch#1", "topk_weights: shape"});
  else
    expect_error([&] { buf.dispatch(a); }, ErrorCode::Aborted,
                 {"peer failure", "rank 1", "topk_weights: shape"});
  REQUIRE(seconds_since(t0) < 10, "abort took ", seconds_since(t0), " s");
  RoundTrip rt;
  rt.spec = small_spec(ctx);
  run_round_trip(ctx, buf, rt);
}

MR_CASE("timeout_names_missing_rank", {false, 2}) {
  // The last rank skips a dispatch: the others raise Timeout within the deadline, naming it.
  const double timeout = 2.0;
  Buffer buf(ctx.group, test_options(4 << 20, timeout));
  Problem P = make_problem(small_spec(ctx));
  LayoutResult lay = buf.get_dispatch_layout(topk_idx_of(P, ctx.rank), P.spec.num_experts);
  const int missing = ctx.size - 1;
  if (ctx.rank == missing) {
    std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int>(timeout * 1000) + 1500));
    return;
  }
  auto t0 = Clock::now();
  // The first rank to give up raises Timeout; a peer may see its failure notice first and raise Aborted
  // quoting it. Either way the message names the missing rank.
  try {
    buf.dispatch(args_of(P, ctx.rank, lay));
    REQUIRE(false, "dispatch must fail without rank ", missing);
  } catch (const Error& e) {
    check_names_missing(e, ctx, "rank", missing, 0);
    REQUIRE(std::string(e.what()).find("header exchange") != std::string::npos, "message: ", e.what());
  }
  double took = seconds_since(t0);
  REQUIRE(took >= timeout * 0.9 && took < timeout + 3, "timeout after ", took, " s");
  // The Buffer failed: later calls raise Aborted quoting the first error.
  expect_error([&] { buf.dispatch(args_of(P, ctx.rank, lay)); }, ErrorCode::Aborted,
               {"failed earlier", "timeout"});
}

// This rank is SIGKILLed `ms` milliseconds from now while it keeps dispatching.
[[noreturn]] static void die_in_dispatches(Buffer& buf, const Problem& P, int rank, const LayoutResult& lay,
                                           int ms) {
  std::thread killer([ms] {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    kill(getpid(), SIGKILL);
  });
  killer.detach();
  while (true) buf.dispatch(args_of(P, rank, lay));
}

MR_CASE("kill_rank_during_dispatch", {true, 2, 1}) {
  // Rank 1 dies (SIGKILL) in the middle of a large dispatch: every other rank fails with Timeout or
  // Aborted naming rank 1 within the deadline, and nothing stays in /dev/shm (checked by the driver).
  const double timeout = 3.0;
  ProblemSpec s = small_spec(ctx, 4096, 512);
  s.num_experts = 8 * ctx.size;
  s.num_topk = 8;
  Problem P = make_problem(s);
  Buffer buf(ctx.group, test_options(1 << 20, timeout));  // small segment: many rounds
  LayoutResult lay = buf.get_dispatch_layout(topk_idx_of(P, ctx.rank), P.spec.num_experts);
  if (ctx.rank == 1) die_in_dispatches(buf, P, ctx.rank, lay, 30);
  auto t0 = Clock::now();
  try {
    for (int i = 0; i < 1000; ++i) buf.dispatch(args_of(P, ctx.rank, lay));
    REQUIRE(false, "the dispatches must fail once rank 1 is dead");
  } catch (const Error& e) {
    std::string m = e.what();
    REQUIRE(e.code() == ErrorCode::Timeout || e.code() == ErrorCode::Aborted, "got ",
            error_code_name(e.code()), ": ", m);
    REQUIRE(m.find("rank 1") != std::string::npos, "error does not name rank 1: ", m);
  }
  REQUIRE(seconds_since(t0) < timeout + 5, "failure took ", seconds_since(t0), " s");
}

MR_CASE("killed_rank_named_promptly", {true, 2, 1}) {
  // Rank 1 dies (SIGKILL) in a loop of dispatches under a long deadline: every survivor sees its process go
  // and raises Aborted naming rank 1 alone ("rank 1 died") well before the deadline (docs/reliability.md).
  const double timeout = 30.0;
  ProblemSpec s = small_spec(ctx, 256, 128);
  s.num_experts = 4 * ctx.size;
  s.num_topk = 4;
  Problem P = make_problem(s);
  Buffer buf(ctx.group, test_options(1 << 20, timeout));
  LayoutResult lay = buf.get_dispatch_layout(topk_idx_of(P, ctx.rank), P.spec.num_experts);
  if (ctx.rank == 1) die_in_dispatches(buf, P, ctx.rank, lay, 50);
  Clock::time_point last = Clock::now();
  try {
    for (int i = 0; i < 1000000; ++i) {
      buf.dispatch(args_of(P, ctx.rank, lay));
      last = Clock::now();
    }
    REQUIRE(false, "the dispatches must fail once rank 1 is dead");
  } catch (const Error& e) {
    const std::string m = e.what();
    REQUIRE(e.code() == ErrorCode::Aborted, "got ", error_code_name(e.code()), ": ", m);
    REQUIRE(m.find("peer failure: rank 1 died") != std::string::npos,
            "error does not name rank 1 alone: ", m);
    for (int r = 0; r < ctx.size; ++r)
      if (r != 1 && r != ctx.rank)
        REQUIRE(m.find("rank " + std::to_string(r)) == std::string::npos, "error names live rank ", r, ": ",
                m);
  }
  REQUIRE(seconds_since(last) < 1.5, "the dead rank was seen only ", seconds_since(last),
          " s after the last completed call");
}

MR_CASE("killed_during_segment_setup", {true, 2, 0}) {
  // Rank 0 is killed while its shared-memory segment exists and it waits for rank 1 to publish its own (rank
  // 1 is alive but late): no rank ever reaches the point where segments are unlinked, and still nothing may
  // stay in /dev/shm (checked by the driver). With EPCOMM_SHM=named rank 0's name stays there and this fails.
  if (ctx.rank == 0) {
    std::thread killer([] {
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      kill(getpid(), SIGKILL);
    });
    killer.detach();
    auto transport = make_shm_transport(ctx.group->bootstrap(), 4 << 20, ctx.group->next_instance(), 0);
    REQUIRE(false, "rank 0 should have been killed during the segment setup");
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(4000));
}

MR_CASE("events_async_chain", {}) {
  // async_finish returns before completion; previous_event chains; a failed previous_event makes the next
  // call fail on this rank and abort on the others; EventOverlap rethrows on every wait().
  Buffer buf(ctx.group, test_options(4 << 20, 20));
  Problem P = make_problem(small_spec(ctx));
  LayoutResult lay = buf.get_dispatch_layout(topk_idx_of(P, ctx.rank), P.spec.num_experts);
  DispatchArgs a = args_of(P, ctx.rank, lay);
  a.async_finish = true;
  DispatchResult d1 = buf.dispatch(a);
  DispatchArgs b = args_of(P, ctx.rank, lay);
  b.async_finish = true;
  b.previous_event = d1.event;
  DispatchResult d2 = buf.dispatch(b);
  CombineArgs c;
  c.x = d2.recv_x.data;
  c.handle = d2.handle;
  c.previous_event = d2.event;
  c.async_finish = true;
  CombineResult cr = buf.combine(c);
  cr.event.wait();
  REQUIRE(d1.event.is_complete() && d2.event.is_complete(), "chained events complete in order");
  auto want = ref_dispatch(P, ctx.rank, ReceiveOrder::expert_major);
  check_rows_equal("async recv_x", tensor_bytes(d2.recv_x.data), want.recv_x, P.row_bytes(), P.spec.dtype);
  EventOverlap done = buf.capture();
  REQUIRE(done.is_complete(), "capture() returns a completed event");
}

MR_CASE("cost_stats", {false, 2}) {
  // Statistics accumulate, never decrease, and a rank that starts 200 ms late is the largest element.
  Buffer buf(ctx.group, test_options(4 << 20, 20));
  Problem P = make_problem(small_spec(ctx));
  LayoutResult lay = buf.get_dispatch_layout(topk_idx_of(P, ctx.rank), P.spec.num_experts);
  std::vector<int64_t> dst(ctx.size, 0), cst(ctx.size, 0);
  std::vector<int32_t> dst32(ctx.size, 0);
  std::vector<int64_t> prev = dst;
  for (int i = 0; i < 3; ++i) {
    const int late = ctx.size - 1;
    if (i == 2 && ctx.rank == late) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    DispatchArgs a = args_of(P, ctx.rank, lay);
    a.dispatch_wait_recv_cost_stats = Tensor::wrap(dst.data(), DType::i64, {ctx.size});
    DispatchResult d = buf.dispatch(a);
    for (int s = 0; s < ctx.size; ++s) REQUIRE(dst[s] >= prev[s], "statistics must not decrease");
    if (i == 2 && ctx.rank != late)
      for (int s = 0; s < ctx.size; ++s)
        REQUIRE(s == late || dst[late] - prev[late] >= dst[s] - prev[s], "late rank ", late,
                " is not the largest: ", dst[late] - prev[late], " vs rank ", s, " ", dst[s] - prev[s]);
    if (i == 2 && ctx.rank != late)
      REQUIRE(dst[late] - prev[late] >= 150000, "late rank waited only ", dst[late] - prev[late], " us");
    prev = dst;
    CombineArgs c;
    c.x = d.recv_x.data;
    c.handle = d.handle;
    c.combine_send_cost_stats = Tensor::wrap(cst.data(), DType::i64, {ctx.size});
    buf.combine(c);
    for (int s = 0; s < ctx.size; ++s) REQUIRE(cst[s] >= 0, "combine statistics non-negative");
  }
  DispatchArgs a = args_of(P, ctx.rank, lay);  // i32 statistics are accepted
  a.dispatch_wait_recv_cost_stats = Tensor::wrap(dst32.data(), DType::i32, {ctx.size});
  buf.dispatch(a);
  for (int s = 0; s < ctx.size; ++s) REQUIRE(dst32[s] >= 0, "i32 statistics");
}

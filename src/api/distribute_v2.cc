// api/distribute_v2.cc — dispatch_v2, combine_v2 and combine_add_rms_norm: validate on the caller's thread,
// then run the engine's stages on the EP group's context (and the TP pair's), in the order of
// docs/distribute-v2.md: dispatch = EP exchange then TP all-gather; combine = TP reduce then EP exchange.
// Calls are blocking.
//
// Failure rules (docs/distribute-v2.md): a rank whose local checks fail publishes a failed header for the
// call on every group the call uses, so the peers raise Aborted naming it, and every group stays usable. A
// stage fails its group under the one policy of every communication context (detail::run_call: after data
// started moving, on a timeout, a peer's failure or an internal error); the other group of the call gets a
// failed header instead of silence.
#include <cstring>
#include <memory>
#include <mutex>

#include "api/distribute_v2_args.h"
#include "api/low_latency_masks.h"
#include "api/moe_context.h"
#include "api/setup_log.h"
#include "common/check.h"
#include "common/log.h"
#include "engine/distribute_v2.h"
#include "engine/workers.h"
#include "epcomm/buffer.h"

namespace epcomm::moe {
namespace {

using engine::OpContext;
using engine::OpKind;

struct Stage {
  GroupContext* group = nullptr;
  std::unique_ptr<ll::MaskView> view;  // OpOptions::live_ranks: the group's transport seen through them
  std::unique_ptr<OpContext> ctx;
  explicit operator bool() const { return ctx != nullptr; }
};

// Why OpOptions::live_ranks cannot be used by this call, or "" when it can (or is empty).
std::string live_ranks_problem(const GroupContext& g, const std::vector<int>& live, bool with_tp) {
  if (live.empty()) return {};
  if (g.inter) return "argument: live_ranks: a call among some ranks needs a group on one node";
  if (with_tp) return "argument: live_ranks: not available with a TP pair (tp_world_size = 2)";
  const int R = g.transport->size();
  bool me = false;
  for (size_t i = 0; i < live.size(); ++i) {
    if (live[i] < 0 || live[i] >= R || (i > 0 && live[i] <= live[i - 1]))
      return epcomm::detail::cat("argument: live_ranks: expected ascending ranks in [0, ", R, "), got ",
                                 live[i], " at index ", i);
    me = me || live[i] == g.rank;
  }
  if (!me) return epcomm::detail::cat("argument: live_ranks: must include this rank (", g.rank, ")");
  return {};
}

// "epcomm[ep e] op#n: " (with " tp t" for a TP pair, " (warm-up)" for the context's creation calls).
std::string label(const char* op, uint64_t seq, int ep, int tp, bool with_tp, bool warm_up) {
  const std::string tp_part = with_tp ? epcomm::detail::cat(" tp ", tp) : std::string();
  return epcomm::detail::cat("epcomm[ep ", ep, tp_part, "] ", op, "#", seq, warm_up ? " (warm-up)" : "",
                             ": ");
}

// Everything one call needs to hold: both groups' contexts, locked, with their sequence numbers taken.
struct Call {
  OpKind kind;
  std::string prefix;
  Stage ep, tp;
  std::unique_lock<std::mutex> ep_lock, tp_lock;

  Call(OpKind k, const char* op, Group& ep_group, Group* tp_group, int64_t tp_world_size,
       const std::optional<std::chrono::milliseconds>& timeout, const std::vector<int>& live = {})
      : kind(k) {
    GroupContext& eg = context_of(ep_group);
    const bool with_tp = tp_world_size == 2 && tp_group && tp_group->size() == 2;
    GroupContext* tg = with_tp ? &context_of(*tp_group) : nullptr;
    ep_lock = std::unique_lock<std::mutex>(eg.call);
    if (tg) tp_lock = std::unique_lock<std::mutex>(tg->call);
    const uint64_t seq = ++eg.seq;
    prefix =
        label(op, eg.shown_seq(seq), ep_group.rank(), with_tp ? tp_group->rank() : 0, with_tp, eg.warming_up);
    const double t = timeout ? std::chrono::duration<double>(*timeout).count() : eg.timeout_s;
    const double tt = t > 0 ? t : eg.timeout_s;
    // A failed group is not used again (its peers see its failure notice); the other group gets a failed
    // header so that its peers do not wait for this call.
    std::string refused;
    ErrorCode refused_code = ErrorCode::Aborted;
    const std::string live_problem = live_ranks_problem(eg, live, with_tp);
    if (const std::string f = eg.failed(); !f.empty()) {
      refused = "the ep group failed earlier: " + f;
    } else {
      ep.group = &eg;
      Transport* among = eg.transport.get();
      if (!live.empty() && live_problem.empty()) {
        ep.view =
            std::make_unique<ll::MaskView>(*eg.transport, std::vector<int32_t>(live.begin(), live.end()));
        among = ep.view.get();
      }
      ep.ctx = std::make_unique<OpContext>(*among, eg.segment.engine, seq, k, tt, eg.inter.get());
      ep.ctx->set_naming(prefix, "ep rank");
      eg.name_call(*ep.ctx);
    }
    if (refused.empty() && !live_problem.empty()) {
      refused = live_problem;
      refused_code = ErrorCode::InvalidUsage;
    }
    if (tg) {
      const uint64_t tseq = ++tg->seq;
      if (tg->inter) {  // the TP stages exchange through one node's shared memory
        refused =
            "argument: tp_group: its two ranks are on different nodes (hosts, or virtual nodes of "
            "EPCOMM_RANKS_PER_NODE); a TP pair must be on one node";
        refused_code = ErrorCode::InvalidUsage;
      } else if (const std::string f = tg->failed(); !f.empty()) {
        refused = "the tp group failed earlier: " + f;
      } else {
        tp.group = tg;
        tp.ctx = std::make_unique<OpContext>(*tg->transport, tg->segment.engine, tseq, k, tt);
        tp.ctx->set_naming(epcomm::detail::cat(prefix, "tp pair #", tg->shown_seq(tseq), ": "), "tp rank");
        tg->name_call(*tp.ctx);
      }
    }
    if (!refused.empty()) fail_validation(Error(refused_code, refused));
    if (!(t > 0))
      fail_validation(Error(ErrorCode::InvalidUsage,
                            epcomm::detail::cat("argument: timeout: expected > 0, got ", t, " s")));
  }

  // Local checks failed: tell both groups, then raise.
  [[noreturn]] void fail_validation(const Error& e) {
    const std::string msg = prefix + e.what();
    fail_header(ep, msg);
    fail_header(tp, msg);
    throw Error(e.code(), msg);
  }

  // Publishes a failed header so that the group's peers raise Aborted promptly. Errors while doing so (the
  // peers may be gone) are dropped: the caller raises its own error.
  void fail_header(Stage& s, const std::string& msg) {
    if (!s) return;
    try {
      s.ctx->publish_failed_header(kind, msg);
    } catch (...) {
    }
    s.ctx->release_lanes();  // across nodes: this call is over here, the peers' next one may send
  }

  // Runs one stage under the failure policy of detail::run_call; on failure warns `other` when it has not
  // run yet.
  template <typename Body>
  void run(Stage& s, Stage* other, Body&& body) {
    try {
      epcomm::detail::run_call(*s.group, *s.ctx, [&](const std::function<void()>& moving) {
        const bool debug = log::enabled(log::Level::debug);
        const auto t0 = debug ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
        body(*s.ctx, moving);
        if (debug) EPCOMM_LOG(debug, -1, s.ctx->prefix(), "done; ", epcomm::detail::elapsed_ms(t0));
      });
    } catch (const Error& e) {
      if (other) fail_header(*other, e.what());
      throw;
    }
  }
};

// What the ep group's context lends a call: its copy threads (OpOptions::num_threads of them; 0: the class
// default, resolved as the Buffer's are) and its copy counters.
template <typename In>
void use_group(const Call& call, const OpOptions& o, In& in) {
  in.workers = &call.ep.group->workers;
  in.threads = engine::copy_threads(o.num_threads > 0 ? o.num_threads : Buffer::num_threads(),
                                    call.ep.group->transport->size());
  in.counters = &call.ep.group->counters;
}

// Allocated expand_x / dynamic_scales were not zeroed: every row the call wrote is valid, the rest are zeros
// (docs/distribute-v2.md).
void zero_unwritten_rows(const detail::DispatchPlan& plan, const engine::v2::DispatchV2Output& out) {
  const DispatchV2Result& r = plan.result;
  const int64_t written = out.n_own + out.n_peer;
  auto zero_from = [written](const Tensor& t, size_t row_bytes) {
    const size_t from = static_cast<size_t>(written) * row_bytes;
    if (t.nbytes() > from) std::memset(t.data_as<uint8_t>() + from, 0, t.nbytes() - from);
  };
  if (plan.zero_tail_x) zero_from(r.expand_x, plan.in.fmt.data_bytes);
  if (plan.zero_tail_scales) zero_from(r.dynamic_scales, plan.in.fmt.scale_bytes);
}

}  // namespace

DispatchV2Result dispatch_v2(Group& ep_group, Group* tp_group, const DispatchV2Args& a, const OpOptions& o) {
  Call call(OpKind::dispatch_v2, "dispatch_v2", ep_group, tp_group, a.tp_world_size, o.timeout, o.live_ranks);
  detail::DispatchPlan plan;
  try {
    detail::prepare_dispatch(ep_group, tp_group, a, o, plan);
    use_group(call, o, plan.in);
    plan.in.payload_scratch = &call.ep.group->payload_scratch;
  } catch (const Error& e) {
    call.fail_validation(e);
  }
  DispatchV2Result& r = plan.result;
  engine::v2::DispatchV2Output out;
  out.expand_x = r.expand_x.data_as<uint8_t>();
  out.dynamic_scales = plan.in.fmt.scale_bytes ? r.dynamic_scales.data_as<uint8_t>() : nullptr;
  out.assist = r.assist_info_for_combine.data_as<int32_t>();
  out.expert_token_nums = r.expert_token_nums.data_as<int64_t>();
  out.ep_recv_counts = r.ep_recv_counts.data_as<int32_t>();
  out.tp_recv_counts = plan.tp_world_size > 0 ? r.tp_recv_counts.data_as<int32_t>() : nullptr;
  out.expand_scales = a.expert_scales ? r.expand_scales.data_as<float>() : nullptr;
  if (const auto arena = call.ep.group->arena()) {
    out.expand_x_offset = arena->offset_of(r.expand_x.data(), r.expand_x.nbytes());
    if (out.dynamic_scales)
      out.scales_offset = arena->offset_of(r.dynamic_scales.data(), r.dynamic_scales.nbytes());
  }
  call.run(call.ep, call.tp ? &call.tp : nullptr, [&](OpContext& ctx, const std::function<void()>& moving) {
    engine::v2::run_dispatch_v2(ctx, plan.in, out, moving);
  });
  if (call.tp)
    call.run(call.tp, nullptr, [&](OpContext& ctx, const std::function<void()>& moving) {
      engine::v2::run_dispatch_v2_tp(ctx, plan.in, out, moving);
    });
  engine::v2::write_dispatch_counts(plan.in, out, plan.tp_world_size, plan.tp_rank);
  zero_unwritten_rows(plan, out);
  return r;
}

namespace {

void run_combine(Call& call, Group& ep_group, Group* tp_group, const CombineV2Args& a,
                 const CombineAddRmsNormArgs* norm, const OpOptions& o, detail::CombinePlan& plan) {
  try {
    detail::prepare_combine(ep_group, tp_group, a, norm, o, plan);
    engine::v2::prepare_combine_v2(plan.in);
    use_group(call, o, plan.in);
  } catch (const Error& e) {
    call.fail_validation(e);
  }
  std::vector<uint8_t> reduced;
  if (call.tp) {
    reduced.resize(static_cast<size_t>(plan.in.n_own * plan.in.H) * 2);
    call.run(call.tp, &call.ep, [&](OpContext& ctx, const std::function<void()>& moving) {
      engine::v2::run_combine_v2_tp(ctx, plan.in, plan.expand_x, plan.n_send, reduced.data(), moving);
    });
    plan.in.rows = reduced.data();
  }
  if (const auto arena = call.ep.group->arena(); arena && plan.in.n_own > 0)
    plan.in.rows_offset = arena->offset_of(
        plan.in.rows, static_cast<size_t>(plan.in.n_own) * static_cast<size_t>(plan.in.H) * 2);
  engine::v2::CombineV2Output out;
  out.x = plan.x.data_as<uint8_t>();
  if (norm) {
    out.y = plan.y.data_as<uint8_t>();
    out.rstd = plan.rstd.data_as<float>();
  }
  call.run(call.ep, nullptr, [&](OpContext& ctx, const std::function<void()>& moving) {
    engine::v2::run_combine_v2(ctx, plan.in, out, moving);
  });
}

}  // namespace

Tensor combine_v2(Group& ep_group, Group* tp_group, const CombineV2Args& a, const OpOptions& o) {
  Call call(OpKind::combine_v2, "combine_v2", ep_group, tp_group, a.tp_world_size, o.timeout, o.live_ranks);
  detail::CombinePlan plan;
  run_combine(call, ep_group, tp_group, a, nullptr, o, plan);
  return plan.x;
}

CombineAddRmsNormResult combine_add_rms_norm(Group& ep_group, Group* tp_group, const CombineAddRmsNormArgs& a,
                                             const OpOptions& o) {
  Call call(OpKind::combine_add_rms_norm, "combine_add_rms_norm", ep_group, tp_group, a.tp_world_size,
            o.timeout, o.live_ranks);
  detail::CombinePlan plan;
  run_combine(call, ep_group, tp_group, a, &a, o, plan);
  return {plan.y, plan.rstd, plan.x};
}

std::vector<int32_t> agree_on_mask(Group& ep_group, const std::vector<int32_t>& masked, const OpOptions& o) {
  GroupContext& g = context_of(ep_group);
  std::unique_lock<std::mutex> lock(g.call);
  const uint64_t seq = ++g.seq;
  const std::string prefix = label("agree_on_mask", g.shown_seq(seq), g.rank, 0, false, g.warming_up);
  const int R = ep_group.size();
  EPCOMM_CHECK(!g.inter, prefix, "rank masks of the operators work on one node only; this group spans ",
               g.num_nodes, " nodes");
  EPCOMM_CHECK(static_cast<int>(masked.size()) == R, prefix, "argument: masked: expected ", R,
               " entries (one per rank), got ", masked.size());
  for (size_t r = 0; r < masked.size(); ++r)
    EPCOMM_CHECK(masked[r] == 0 || masked[r] == 1, prefix, "argument: masked[", r, "]: expected 0 or 1, got ",
                 masked[r]);
  if (masked[g.rank]) return masked;
  if (const std::string f = g.failed(); !f.empty())
    EPCOMM_THROW(Aborted, prefix, "the ep group failed earlier: ", f);
  const double t = o.timeout ? std::chrono::duration<double>(*o.timeout).count() : g.timeout_s;
  OpContext ctx(*g.transport, g.segment.engine, seq, OpKind::low_latency_clean, t);
  ctx.set_naming(prefix, "ep rank");
  g.name_call(ctx);
  const std::vector<uint8_t> agreed =
      ll::agree_on_mask(ctx, std::vector<uint8_t>(masked.begin(), masked.end()), t);
  return std::vector<int32_t>(agreed.begin(), agreed.end());
}

void fail_call(Group& ep_group, Group* tp_group, const std::string& op, int64_t tp_world_size, ErrorCode code,
               const std::string& message, const std::vector<int>& live_ranks) {
  static const std::pair<const char*, OpKind> kOps[] = {
      {"dispatch_v2", OpKind::dispatch_v2},
      {"combine_v2", OpKind::combine_v2},
      {"combine_add_rms_norm", OpKind::combine_add_rms_norm}};
  for (const auto& [name, kind] : kOps) {
    if (op != name) continue;
    Call call(kind, name, ep_group, tp_group, tp_world_size, std::nullopt, live_ranks);
    call.fail_validation(Error(code, message));
  }
  EPCOMM_THROW(InvalidUsage, "epcomm[ep ", ep_group.rank(),
               "] fail_call: argument: op: expected dispatch_v2, combine_v2 or combine_add_rms_norm, got '",
               op, "'");
}

}  // namespace epcomm::moe

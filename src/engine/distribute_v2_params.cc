// engine/distribute_v2_params.cc — the parameters every rank of an operator-family call must agree on,
// carried in the header's counts area, and the cross-rank check that names every disagreeing peer.
#include <cstring>

#include "engine/distribute_v2.h"

namespace epcomm::engine::v2 {

const char* param_name(int p) {
  switch (p) {
    case kParamW:
      return "ep_world_size";
    case kParamE:
      return "moe_expert_num";
    case kParamT:
      return "tp_world_size";
    case kParamShard:
      return "expert_shard_type";
    case kParamS:
      return "shared_expert_num (effective)";
    case kParamSr:
      return "shared_expert_rank_num";
    case kParamGlobalBs:
      return "global_bs";
    case kParamH:
      return "H (hidden size)";
    case kParamK:
      return "K (top-k)";
    case kParamDtype:
      return "x/expand_x dtype";
    case kParamQuantMode:
      return "quant_mode";
    case kParamOutDtype:
      return "expand_x output dtype";
    case kParamCommQuant:
      return "comm_quant_mode";
    case kParamBs:
      return "Bs (tokens, global_bs = 0)";
    case kParamEpRank:
      return "ep_rank_id";
  }
  return "?";
}

static std::string param_value(int p, int32_t v) {
  if (p == kParamDtype || p == kParamOutDtype) return dtype_name(static_cast<DType>(v));
  return std::to_string(v);
}

int32_t* put_params(OpContext& ctx, const Params& params, int num_counts) {
  HeaderData& h = *ctx.header(ctx.rank());
  h.num_counts = kNumParams + num_counts;
  int32_t* c = ctx.counts(ctx.rank());
  std::memcpy(c, params.v, sizeof(params.v));
  return c + kNumParams;
}

const int32_t* peer_counts(const OpContext& ctx, int r) {
  return ctx.counts(r) + kNumParams;
}

void check_params(const OpContext& ctx, OpKind op, const std::vector<int>& fields, bool bs_matters) {
  const int me = ctx.rank();
  std::string report;
  const int32_t* mine = ctx.counts(me);
  for (int r = 0; r < ctx.size(); ++r) {
    if (r == me) continue;
    const HeaderData* h = ctx.header(r);
    if (h->op != static_cast<uint32_t>(op)) {
      report += detail::cat(report.empty() ? "" : "; ", ctx.peer_name(r), " is in ",
                            op_kind_name(static_cast<OpKind>(h->op)), "#", ctx.shown(ctx.seq()), " (ours ",
                            op_kind_name(op), ")");
      continue;
    }
    const int32_t* theirs = ctx.counts(r);
    std::string diff;
    auto compare = [&](int p) {
      if (theirs[p] != mine[p])
        diff += detail::cat(diff.empty() ? "" : ", ", param_name(p), " = ", param_value(p, theirs[p]),
                            " (ours ", param_value(p, mine[p]), ")");
    };
    for (int p : fields) compare(p);
    if (bs_matters && mine[kParamGlobalBs] == 0 && theirs[kParamGlobalBs] == 0) compare(kParamBs);
    if (!diff.empty()) report += detail::cat(report.empty() ? "" : "; ", ctx.peer_name(r), ": ", diff);
  }
  if (!report.empty())
    EPCOMM_THROW(InvalidUsage, ctx.prefix(), "mismatch: peers disagree with this rank: ", report);
}

}  // namespace epcomm::engine::v2

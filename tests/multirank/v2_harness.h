// multirank/v2_harness.h — running dispatch_v2 / combine_v2 / combine_add_rms_norm on a test's ranks and
// checking every output against the distribute-v2 reference (support/v2_reference.h).
#pragma once

#include <memory>
#include <optional>

#include "epcomm/moe/distribute_v2.h"
#include "multirank/driver.h"
#include "support/v2_reference.h"

namespace epcomm::testing::v2 {

// The groups of one test: the EP group (the world itself when T <= 1) and the TP pair.
struct V2Groups {
  std::shared_ptr<Group> ep, tp;
  int ep_rank = 0, tp_rank = 0;  // with V2Run::options.live_ranks: the index in them
  int T = 0;
};
// Collective: splits the world for tp_world_size = 2 and creates the contexts with `segment_bytes`.
V2Groups make_v2_groups(RankCtx& ctx, int tp_world_size, int64_t segment_bytes = 256 << 10,
                        double timeout_s = 30);

struct V2Run {
  V2Spec spec;
  enum class Experts { identity, distinct } experts = Experts::distinct;
  int comm_quant = 0;
  bool rms_norm = false;        // also run combine_add_rms_norm (same routing)
  bool shared_x = false;        // pass shared_expert_x to combine (spec.shared_ranks must be 0)
  bool caller_buffers = false;  // pass *_out buffers (larger than needed, filled with a sentinel)
  // Where the caller buffers of dispatch_v2's expand_x and dynamic_scales lie: private memory, the output
  // arena (moe::output_buffer: senders push), or the arena on even ep ranks only (nobody pushes).
  enum class Place { private_memory, arena, arena_even_ranks } place = Place::private_memory;
  // Checked after the dispatch: whether this rank's tokens were pushed (dispatch_pushed_tokens grew) or
  // staged; unset: not checked.
  std::optional<bool> expect_push;
  // Where combine's expand_x (the expert outputs) lies; with every rank's in its output arena the origins
  // read the rows in place (comm_quant 0, one node), which expect_in_place checks (copy counters).
  Place combine_place = Place::private_memory;
  std::optional<bool> expect_in_place;
  bool combine = true;
  float norm_eps = 1e-6f;
  moe::OpOptions options;  // passed to every call
};

// One dispatch (+ combines) checked against the reference, every output bit for bit, tails included.
void run_v2(V2Groups& g, const V2Run& run, const std::string& where = "");

// The arguments the harness passes for `spec` on rank (ep, tp) (tests of errors edit them). Views point into
// `p` and `scales_shape` must outlive the call.
moe::DispatchV2Args dispatch_args(const V2Problem& p, int ep, int tp);
moe::CombineV2Args combine_args(const V2Problem& p, int ep, int tp, const moe::DispatchV2Result& d,
                                std::vector<uint8_t>& expert_out);

}  // namespace epcomm::testing::v2

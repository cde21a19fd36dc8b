// api/low_latency_masks.cc — rank masks of low-latency mode: per-Buffer state, the live-rank view of the
// transport and the shrink agreement round (docs/low-latency.md, "Masks and shrink").
#include "api/low_latency_masks.h"

#include <algorithm>
#include <cstring>

#include "common/check.h"
#include "common/log.h"
#include "common/process.h"
#include "engine/combine.h"
#include "engine/kernels.h"

namespace epcomm::ll {

MaskState& mask_state(Buffer::Impl& b) {
  std::call_once(b.masks_once, [&b] {
    b.masks = std::make_shared<MaskState>();
    b.masks->masked.assign(b.num_ranks, 0);
    b.masks->shrink = b.options.enable_shrink;
  });
  return *b.masks;
}

std::vector<int32_t> live_ranks(const std::vector<uint8_t>& masked, int self) {
  if (masked[self]) return {self};
  std::vector<int32_t> live;
  for (int r = 0; r < static_cast<int>(masked.size()); ++r)
    if (!masked[r]) live.push_back(r);
  return live;
}

MaskView::MaskView(Transport& base, std::vector<int32_t> live) : base_(base), live_(std::move(live)) {
  auto it = std::find(live_.begin(), live_.end(), base.rank());
  EPCOMM_ASSERT(it != live_.end(), "MaskView: this rank is not among the live ranks");
  self_ = static_cast<int>(it - live_.begin());
}

namespace {

using Clock = std::chrono::steady_clock;

// Waits until ready(r) for every r with want[r], or until the deadline; returns the ranks that were ready.
// A wanted rank whose process is gone (killed, exited; looked at every OpContext::kProcessWatch) is not
// waited for: it can never arrive. `gone` (optional) gets those ranks.
template <typename Ready>
std::vector<uint8_t> wait_for(const engine::OpContext& ctx, const std::vector<uint8_t>& want,
                              double timeout_s, Ready&& ready, std::vector<uint8_t>* gone = nullptr) {
  const Transport& tp = ctx.transport();
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  std::vector<uint8_t> got(want.size(), 0), dead(want.size(), 0);
  auto next_watch = Clock::now() + engine::OpContext::kProcessWatch;
  while (true) {
    const uint32_t snap = tp.doorbell();
    bool all = true;
    for (size_t r = 0; r < want.size(); ++r) {
      if (want[r] && !got[r] && !dead[r]) got[r] = ready(static_cast<int>(r)) ? 1 : 0;
      all = all && (!want[r] || got[r] || dead[r]);
    }
    const auto now = Clock::now();
    if (all || now >= deadline) break;
    if (now >= next_watch) {
      next_watch = now + engine::OpContext::kProcessWatch;
      for (size_t r = 0; r < want.size(); ++r)
        if (want[r] && !got[r] && tp.peer_process(static_cast<int>(r)) == process::State::gone) dead[r] = 1;
      continue;
    }
    tp.wait_doorbell(snap, std::min({deadline, next_watch, now + std::chrono::milliseconds(100)}));
  }
  if (gone) *gone = dead;
  return got;
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) s += detail::cat(s.empty() ? "" : ", ", r);
  return s;
}

}  // namespace

std::vector<uint8_t> agree_on_mask(engine::OpContext& ctx, std::vector<uint8_t> masked, double timeout_s) {
  const int R = ctx.size(), me = ctx.rank();
  const uint64_t seq = ctx.seq();
  const int slot = static_cast<int>(seq % 2);
  EPCOMM_ASSERT(R <= engine::kMaxRanks, "agree_on_mask: too many ranks");
  std::vector<uint8_t> want(R, 0);
  for (int r = 0; r < R; ++r) want[r] = !masked[r] && r != me;
  // Round 1: arrival.
  ctx.control(me)->ll_arrive.store(seq, std::memory_order_release);
  for (int r = 0; r < R; ++r)
    if (want[r]) ctx.transport().notify(r);
  std::vector<uint8_t> dead;
  std::vector<uint8_t> seen = wait_for(
      ctx, want, timeout_s,
      [&](int r) { return ctx.control(r)->ll_arrive.load(std::memory_order_acquire) >= seq; }, &dead);
  seen[me] = 1;
  // Round 2: every rank publishes what it saw; the agreed set is the intersection over the ranks seen.
  engine::Control* c = ctx.control(me);
  std::fill(std::begin(c->ll_view[slot]), std::end(c->ll_view[slot]), 0);
  for (int r = 0; r < R; ++r)
    if (seen[r]) c->ll_view[slot][r / 64] |= uint64_t{1} << (r % 64);
  c->ll_view_seq[slot].store(seq, std::memory_order_release);
  for (int r = 0; r < R; ++r)
    if (seen[r] && r != me) ctx.transport().notify(r);
  std::vector<uint8_t> want2(R, 0);
  for (int r = 0; r < R; ++r) want2[r] = seen[r] && r != me;
  std::vector<uint8_t> views = wait_for(ctx, want2, timeout_s, [&](int r) {
    return ctx.control(r)->ll_view_seq[slot].load(std::memory_order_acquire) == seq;
  });
  std::vector<uint8_t> agreed = seen;
  std::vector<int> excluded_me, lost, lost_gone;
  for (int r = 0; r < R; ++r) {
    if (!want2[r]) continue;
    if (!views[r]) {
      agreed[r] = 0;
      continue;
    }
    const uint64_t* v = ctx.control(r)->ll_view[slot];
    for (int q = 0; q < R; ++q)
      if (!((v[q / 64] >> (q % 64)) & 1)) {
        if (q == me) excluded_me.push_back(r);
        agreed[q] = 0;
      }
  }
  if (!excluded_me.empty())
    EPCOMM_THROW(Timeout, ctx.prefix(), "this rank missed the low-latency deadline of ranks ",
                 rank_list(excluded_me), " (", timeout_s, " s), which masked it (enable_shrink)");
  for (int r = 0; r < R; ++r)
    if (!masked[r] && !agreed[r]) {
      masked[r] = 1;
      (dead[r] ? lost_gone : lost).push_back(r);
    }
  if (!lost.empty())
    EPCOMM_LOG(warn, me, ctx.prefix(), "masked rank(s) ", rank_list(lost), ": missed the deadline of ",
               timeout_s, " s (enable_shrink)");
  if (!lost_gone.empty())
    EPCOMM_LOG(warn, me, ctx.prefix(), "masked rank(s) ", rank_list(lost_gone),
               ": the process is gone (enable_shrink)");
  return masked;
}

LiveSet enter_call(Buffer::Impl& b, engine::OpContext& ctx) {
  MaskState& ms = mask_state(b);
  LiveSet s;
  s.masked = ms.snapshot();
  bool shrink = false;
  {
    std::lock_guard<std::mutex> lk(ms.m);
    shrink = ms.shrink;
  }
  if (shrink && !s.masked[b.rank]) {
    s.masked = agree_on_mask(ctx, s.masked, b.timeout_s);
    std::lock_guard<std::mutex> lk(ms.m);
    for (size_t r = 0; r < s.masked.size(); ++r) ms.masked[r] = ms.masked[r] || s.masked[r];
  }
  s.live = live_ranks(s.masked, b.rank);
  return s;
}

std::vector<int32_t> expert_map(const LiveSet& s, int num_local) {
  const int R = static_cast<int>(s.masked.size());
  std::vector<int32_t> map(static_cast<size_t>(R) * num_local, -1);
  for (size_t v = 0; v < s.live.size(); ++v) {
    const int d = s.live[v];
    if (s.masked[d]) continue;  // this rank, masked itself: nothing is sent
    for (int j = 0; j < num_local; ++j) map[d * num_local + j] = static_cast<int32_t>(v * num_local + j);
  }
  return map;
}

std::optional<Tensor> narrow_stats(const std::optional<Tensor>& real, size_t live, Allocator& al) {
  if (!real) return std::nullopt;
  Tensor t = al.allocate(DType::i64, {static_cast<int64_t>(live)});
  std::fill(t.data_as<int64_t>(), t.data_as<int64_t>() + live, 0);
  return t;
}

void widen_stats(const Tensor& stats, Tensor& real, const std::vector<int32_t>& live) {
  const auto* s = stats.data_as<int64_t>();
  auto* d = real.data_as<int64_t>();
  for (size_t v = 0; v < live.size(); ++v) d[live[v]] += s[v];
}

void restrict_dispatch(engine::DispatchInput& in, const LiveSet& s, const std::vector<int32_t>& map,
                       Allocator& al) {
  const int Rv = static_cast<int>(s.live.size());
  const int L = static_cast<int>(map.size() / s.masked.size());
  const int64_t T = in.num_tokens;
  const int K = in.num_topk;
  in.num_experts = Rv * L;
  in.pairs_per_expert.assign(in.num_experts, 0);
  in.tokens_per_rank.assign(Rv, 0);
  in.in_rank.assign(static_cast<size_t>(T) * Rv, 0);
  for (int64_t t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) {
      int32_t& id = in.ids[t * K + k];
      if (id < 0) continue;
      id = map[id];
      if (id < 0) continue;
      ++in.pairs_per_expert[id];
      uint8_t& hit = in.in_rank[t * Rv + id / L];
      if (!hit) ++in.tokens_per_rank[id / L];
      hit = 1;
    }
  if (in.cost_stats) in.cost_stats = narrow_stats(in.cost_stats, s.live.size(), al);
}

namespace {

// Waits until `word` of every live peer reached this call; Timeout naming the others.
void wait_live(const engine::OpContext& ctx, const LiveSet& live, double timeout_s, const char* phase,
               std::atomic<uint64_t> engine::Control::*word) {
  std::vector<uint8_t> want(live.masked.size(), 0);
  for (int32_t r : live.live) want[r] = r != ctx.rank();
  const uint64_t seq = ctx.seq();
  std::vector<uint8_t> got = wait_for(ctx, want, timeout_s, [&](int r) {
    return (ctx.control(r)->*word).load(std::memory_order_acquire) >= seq;
  });
  std::vector<int> missing;
  for (size_t r = 0; r < want.size(); ++r)
    if (want[r] && !got[r]) missing.push_back(static_cast<int>(r));
  if (!missing.empty())
    EPCOMM_THROW(Timeout, ctx.prefix(), phase, ": rank(s) ", rank_list(missing), " did not arrive within ",
                 timeout_s, " s");
}

void signal_live(const engine::OpContext& ctx, const LiveSet& live, std::atomic<uint64_t>& word) {
  word.store(ctx.seq(), std::memory_order_release);
  for (int32_t r : live.live)
    if (r != ctx.rank()) ctx.transport().notify(r);
}

}  // namespace

void combine_among_survivors(Buffer::Impl& b, engine::OpContext& ctx, const LiveSet& live,
                             const engine::CombineInput& in, engine::CombineOutput& out,
                             const std::function<void()>& on_shapes) {
  const Handle::Impl& hd = *in.handle;
  const int L = hd.num_local, K = hd.num_topk;
  const int64_t H = in.hidden, block = hd.expert_block_rows;
  EPCOMM_CHECK(hd.pushed && in.dtype == DType::bf16, ctx.prefix(),
               "a rank of this handle's dispatch is masked now, and that dispatch did not push its rows "
               "(dispatch statistics or several nodes); dispatch again among the live ranks");
  // Our expert outputs (valid rows only) into the output arena, where the origins read them.
  const size_t row_bytes = static_cast<size_t>(H) * 2;
  Tensor xs = b.allocator->allocate(DType::bf16, {L * block, H});
  for (int j = 0; j < L; ++j)
    if (hd.cnt[j] > 0)
      std::memcpy(xs.data_as<uint8_t>() + j * block * row_bytes, in.x + j * block * row_bytes,
                  static_cast<size_t>(hd.cnt[j]) * row_bytes);
  const int64_t off = arena_offset(b, xs);
  EPCOMM_CHECK(off >= 0, ctx.prefix(),
               "a combine among fewer ranks than its dispatch needs the output arena");
  engine::Control* me = ctx.control(ctx.rank());
  me->ll_x_offset = off;
  signal_live(ctx, live, me->ll_x_ready);
  wait_live(ctx, live, b.timeout_s, "expert outputs", &engine::Control::ll_x_ready);
  on_shapes();
  const auto* w = in.weights_used.data();
  std::vector<uint8_t> live_now(live.masked.size(), 0);
  for (int32_t r : live.live) live_now[r] = !live.masked[r];
  std::vector<const uint8_t*> rows(K);
  std::vector<float> ws(K);
  for (int64_t t = 0; t < hd.num_tokens; ++t) {
    int n = 0;
    for (int k = 0; k < K; ++k) {
      const int32_t id = hd.topk_ids[t * K + k];
      if (id < 0) continue;
      const int holder = hd.live_ranks.empty() ? id / L : hd.live_ranks[id / L];
      if (!live_now[holder]) continue;  // masked: its experts' pairs are absent
      rows[n] = ctx.transport().arena(holder) + ctx.control(holder)->ll_x_offset +
                static_cast<int64_t>(hd.send_rows[t * K + k]) * row_bytes;
      ws[n++] = w[t * K + k];
    }
    engine::reduce_token(DType::bf16, rows.data(), ws.data(), n, H, nullptr, nullptr,
                         out.combined_x.data_as<uint8_t>() + t * row_bytes);
  }
  signal_live(ctx, live, me->ll_x_done);
  wait_live(ctx, live, b.timeout_s, "origins done", &engine::Control::ll_x_done);
}

}  // namespace epcomm::ll

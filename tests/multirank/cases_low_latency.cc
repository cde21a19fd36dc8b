// multirank/cases_low_latency.cc — Buffer::low_latency_dispatch / low_latency_combine (docs/low-latency.md)
// against a reference written from the spec: every rank regenerates every rank's tokens and routing from one
// seed, derives the rows each local expert must receive (in source rank, token order), their FP8 codes and
// scales (support/quant_reference.h), and the canonical f32 weighted sum combine must return, bit for bit.
#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstring>
#include <numeric>
#include <thread>
#include <vector>

#include <unistd.h>

#include "multirank/driver.h"
#include "multirank/round_trip.h"
#include "support/quant_reference.h"
#include "support/rng.h"

using namespace epcomm;
using namespace epcomm::testing;
using namespace epcomm::testing::qref;

namespace {

struct LlTestShape {
  int64_t t_max = 6, hidden = 256;
  int experts_per_rank = 3, topk = 3;
};

// Rank s's tokens: T_s = (s * 5 + seed) % (t_max + 1) (some ranks have none), bf16 values, distinct experts
// per token with about one slot in six empty (-1).
struct LlRankInputs {
  int64_t T = 0;
  std::vector<uint16_t> x;   // [T, H] bf16 bits
  std::vector<int64_t> ids;  // [T, K]
  std::vector<float> w;      // [T, K]
};

LlRankInputs inputs_of(uint64_t seed, int s, int E, const LlTestShape& sh) {
  LlRankInputs in;
  in.T = static_cast<int64_t>((s * 5 + seed) % static_cast<uint64_t>(sh.t_max + 1));
  SplitMix64 rng(seed * 7919 + static_cast<uint64_t>(s));
  in.x.resize(static_cast<size_t>(in.T * sh.hidden));
  for (auto& v : in.x) v = enc_bf16(static_cast<float>(rng.unit() * 4.0 - 2.0));
  std::vector<int64_t> perm(static_cast<size_t>(E));
  for (int64_t t = 0; t < in.T; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    for (int i = E - 1; i > 0; --i)
      std::swap(perm[i], perm[static_cast<size_t>(rng.below(static_cast<uint64_t>(i + 1)))]);
    for (int k = 0; k < sh.topk; ++k) {
      in.ids.push_back(rng.below(6) == 0 ? -1 : perm[k]);
      in.w.push_back(static_cast<float>(rng.unit()));
    }
  }
  return in;
}

// Rows of local expert j on rank d, in order: (source, token).
std::vector<std::pair<int, int64_t>> expected_rows(const std::vector<LlRankInputs>& all, int d, int j, int L,
                                                   int K) {
  std::vector<std::pair<int, int64_t>> rows;
  for (int s = 0; s < static_cast<int>(all.size()); ++s)
    for (int64_t t = 0; t < all[s].T; ++t)
      for (int k = 0; k < K; ++k)
        if (all[s].ids[t * K + k] == d * L + j) rows.emplace_back(s, t);
  return rows;
}

void check_rows(RankCtx& ctx, const std::vector<LlRankInputs>& all, const LowLatencyDispatchResult& r,
                const LlTestShape& sh, bool fp8) {
  const int L = sh.experts_per_rank, R = ctx.size;
  const int64_t H = sh.hidden, RT = R * sh.t_max, G = H / 128;
  for (int j = 0; j < L; ++j) {
    const auto rows = expected_rows(all, ctx.rank, j, L, sh.topk);
    REQUIRE(r.recv_count.data_as<int32_t>()[j] == static_cast<int32_t>(rows.size()), "expert ", j);
    std::vector<int64_t> per(R, 0);
    for (size_t i = 0; i < rows.size(); ++i) {
      const auto [s, t] = rows[i];
      ++per[s];
      REQUIRE(r.src_info.data_as<int32_t>()[j * RT + i] == t, "expert ", j, " row ", i, ": src_info");
      const uint16_t* src = all[s].x.data() + t * H;
      if (!fp8) {
        REQUIRE(std::memcmp(r.recv_x.data_as<uint16_t>() + (j * RT + i) * H, src, 2 * H) == 0, "expert ", j,
                " row ", i, ": payload");
        continue;
      }
      std::vector<float> xf(static_cast<size_t>(H));
      for (int64_t h = 0; h < H; ++h) xf[h] = static_cast<float>(dec_bf16(src[h]));
      const RefBlock ref = fp8_group128(true, xf, false, false);
      REQUIRE(std::memcmp(r.recv_x.data_as<uint8_t>() + (j * RT + i) * H, ref.codes.data(), H) == 0,
              "expert ", j, " row ", i, ": codes");
      for (int64_t g = 0; g < G; ++g)  // DeepEP's column-major scales: [L, G, R*T_max] in memory
        REQUIRE(r.recv_scales->data_as<float>()[(j * G + g) * RT + i] == ref.scales[g], "expert ", j, " row ",
                i, " group ", g, ": scale");
    }
    int64_t begin = 0;
    for (int s = 0; s < R; ++s) {
      REQUIRE(r.layout_range.data_as<int64_t>()[j * R + s] == ((begin << 32) | per[s]), "expert ", j,
              " source ", s, ": layout_range");
      begin += per[s];
    }
  }
}

// combined[t] = bf16(sum over k ascending with ids >= 0 of w * y), y = the dispatched row scaled by (1 +
// e/8).
std::vector<uint16_t> combine_ref(const LlRankInputs& in, const LlTestShape& sh) {
  std::vector<uint16_t> out(static_cast<size_t>(in.T * sh.hidden));
  for (int64_t t = 0; t < in.T; ++t)
    for (int64_t h = 0; h < sh.hidden; ++h) {
      float acc = 0.0f;
      for (int k = 0; k < sh.topk; ++k) {
        const int64_t e = in.ids[t * sh.topk + k];
        if (e < 0) continue;
        const uint16_t y =
            enc_bf16(static_cast<float>(dec_bf16(in.x[t * sh.hidden + h])) * (1.0f + e / 8.0f));
        const float p = in.w[t * sh.topk + k] * static_cast<float>(dec_bf16(y));
        acc = acc + p;
      }
      out[t * sh.hidden + h] = enc_bf16(acc);
    }
  return out;
}

LowLatencyDispatchArgs dispatch_args(LlRankInputs& in, int E, const LlTestShape& sh, bool fp8) {
  LowLatencyDispatchArgs a;
  a.x = Tensor::wrap(in.x.data(), DType::bf16, {in.T, sh.hidden});
  a.topk_idx = Tensor::wrap(in.ids.data(), DType::i64, {in.T, sh.topk});
  a.num_max_dispatch_tokens_per_rank = sh.t_max;
  a.num_experts = E;
  a.use_fp8 = fp8;
  return a;
}

// The inputs as the live ranks see them (docs/low-latency.md, "Masks and shrink"): a masked source sends
// nothing, a pair to a masked rank's expert is absent.
std::vector<LlRankInputs> without(std::vector<LlRankInputs> all, const std::vector<int>& masked, int L) {
  auto is_masked = [&](int r) { return std::find(masked.begin(), masked.end(), r) != masked.end(); };
  for (int s = 0; s < static_cast<int>(all.size()); ++s) {
    if (is_masked(s)) all[s].T = 0;
    for (auto& id : all[s].ids)
      if (id >= 0 && is_masked(static_cast<int>(id / L))) id = -1;
  }
  return all;
}

LowLatencyCombineArgs combine_args(Buffer& buf, const LowLatencyDispatchResult& d, LlRankInputs& mine,
                                   const LlTestShape& sh, int rank, int R) {
  Tensor y = buf.low_latency_combine_buffer(*d.handle);
  const int L = sh.experts_per_rank;
  const int64_t RT = R * sh.t_max;
  std::fill_n(y.data_as<uint16_t>(), y.numel(), uint16_t{0x7FC0});
  for (int j = 0; j < L; ++j)
    for (int64_t i = 0; i < d.recv_count.data_as<int32_t>()[j]; ++i)
      for (int64_t h = 0; h < sh.hidden; ++h) {
        const int64_t at = (j * RT + i) * sh.hidden + h;
        const float v = static_cast<float>(dec_bf16(d.recv_x.data_as<uint16_t>()[at]));
        y.data_as<uint16_t>()[at] = enc_bf16(v * (1.0f + (rank * L + j) / 8.0f));
      }
  LowLatencyCombineArgs c;
  c.x = y;
  c.handle = d.handle;
  c.topk_idx = Tensor::wrap(mine.ids.data(), DType::i64, {mine.T, sh.topk});
  c.topk_weights = Tensor::wrap(mine.w.data(), DType::f32, {mine.T, sh.topk});
  return c;
}

void check_combined(const Tensor& out, const LlRankInputs& ref_in, const LlTestShape& sh, const char* what) {
  const std::vector<uint16_t> ref = combine_ref(ref_in, sh);
  REQUIRE(out.nbytes() == 2 * ref.size() &&
              (ref.empty() || std::memcmp(out.data(), ref.data(), out.nbytes()) == 0),
          what, ": combine differs from the canonical f32 sum (without the masked ranks' experts)");
}

}  // namespace

MR_CASE("low_latency_round_trip", {}) {
  const LlTestShape sh;
  const int E = ctx.size * sh.experts_per_rank;
  BufferOptions o = test_options();
  o.low_latency_mode = true;
  o.num_rdma_bytes = Buffer::get_low_latency_rdma_size_hint(sh.t_max, sh.hidden, ctx.size, E);
  Buffer buf(ctx.group, o);
  for (uint64_t seed : {1, 2}) {
    std::vector<LlRankInputs> all;
    for (int s = 0; s < ctx.size; ++s) all.push_back(inputs_of(seed, s, E, sh));
    LlRankInputs& mine = all[ctx.rank];
    check_rows(ctx, all, buf.low_latency_dispatch(dispatch_args(mine, E, sh, true)), sh, true);
    const LowLatencyDispatchResult d = buf.low_latency_dispatch(dispatch_args(mine, E, sh, false));
    check_rows(ctx, all, d, sh, false);
    // The experts write into the zero-copy buffer: y = row * (1 + e / 8) for the valid rows, NaN elsewhere.
    check_combined(buf.low_latency_combine(combine_args(buf, d, mine, sh, ctx.rank, ctx.size)).combined_x,
                   mine, sh, "no mask");
  }
}

// Masks set by hand on every rank: the last rank is masked for a dispatch and its combine; then rank 0 is
// masked between a dispatch and its combine (the survivors combine without its experts); clean restores.
MR_CASE("low_latency_masks", {}) {
  const LlTestShape sh;
  const int R = ctx.size, E = R * sh.experts_per_rank, L = sh.experts_per_rank;
  Buffer buf(ctx.group, [] {
    BufferOptions o = test_options();
    o.low_latency_mode = true;
    return o;
  }());
  std::vector<LlRankInputs> all;
  for (int s = 0; s < R; ++s) all.push_back(inputs_of(3, s, E, sh));
  LlRankInputs& mine = all[ctx.rank];
  const int last = R - 1;
  buf.low_latency_update_mask_buffer(last, true);
  REQUIRE(buf.low_latency_query_mask_buffer()[last] == 1, "query after update");
  std::vector<LlRankInputs> live = without(all, {last}, L);
  const LowLatencyDispatchResult d = buf.low_latency_dispatch(dispatch_args(mine, E, sh, false));
  if (ctx.rank == last) {
    for (int j = 0; j < L; ++j)
      REQUIRE(d.recv_count.data_as<int32_t>()[j] == 0, "a masked rank receives nothing");
  } else {
    check_rows(ctx, live, d, sh, false);
  }
  LlRankInputs ref_in = mine;  // a masked rank gets nothing back: all its pairs are absent
  if (ctx.rank == last)
    std::fill(ref_in.ids.begin(), ref_in.ids.end(), -1);
  else
    ref_in.ids = live[ctx.rank].ids;
  check_combined(buf.low_latency_combine(combine_args(buf, d, mine, sh, ctx.rank, R)).combined_x, ref_in, sh,
                 "last rank masked");
  if (R >= 3) {
    const LowLatencyDispatchResult d2 = buf.low_latency_dispatch(dispatch_args(mine, E, sh, false));
    buf.low_latency_update_mask_buffer(0, true);
    LlRankInputs r2 = mine;
    if (ctx.rank == 0 || ctx.rank == last)
      std::fill(r2.ids.begin(), r2.ids.end(), -1);
    else
      r2.ids = without(all, {0, last}, L)[ctx.rank].ids;
    check_combined(buf.low_latency_combine(combine_args(buf, d2, mine, sh, ctx.rank, R)).combined_x, r2, sh,
                   "rank 0 masked after the dispatch");
  }
  buf.low_latency_clean_mask_buffer();
  REQUIRE(buf.low_latency_query_mask_buffer() == std::vector<int32_t>(R, 0), "clean clears the mask");
  const LowLatencyDispatchResult d3 = buf.low_latency_dispatch(dispatch_args(mine, E, sh, false));
  check_rows(ctx, all, d3, sh, false);
  check_combined(buf.low_latency_combine(combine_args(buf, d3, mine, sh, ctx.rank, R)).combined_x, mine, sh,
                 "after clean");
}

// A low-latency Buffer for the shrink cases (8 MiB segment, deadline `timeout`).
static BufferOptions shrink_options(double timeout) {
  BufferOptions o = test_options(8 << 20, timeout);
  o.low_latency_mode = true;
  return o;
}

// Shrink: the last rank never calls; the survivors mask it in the dispatch's agreement round (after the
// deadline), all report the same mask, and dispatch and combine complete without its experts.
MR_CASE("low_latency_shrink", {false, 3}) {
  const LlTestShape sh;
  const int R = ctx.size, E = R * sh.experts_per_rank, L = sh.experts_per_rank;
  const double timeout = 1.0;
  Buffer buf(ctx.group, shrink_options(timeout));
  buf.set_low_latency_shrink(true);
  const int stopped = R - 1;
  if (ctx.rank == stopped) {
    std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int>(timeout * 3000) + 500));
    return;
  }
  std::vector<LlRankInputs> all;
  for (int s = 0; s < R; ++s) all.push_back(inputs_of(5, s, E, sh));
  LlRankInputs& mine = all[ctx.rank];
  const std::vector<LlRankInputs> live = without(all, {stopped}, L);
  for (int round = 0; round < 2; ++round) {
    const LowLatencyDispatchResult d = buf.low_latency_dispatch(dispatch_args(mine, E, sh, false));
    std::vector<int32_t> want(R, 0);
    want[stopped] = 1;
    REQUIRE(buf.low_latency_query_mask_buffer() == want, "round ", round, ": the stopped rank is masked");
    check_rows(ctx, live, d, sh, false);
    LlRankInputs ref_in = mine;
    ref_in.ids = live[ctx.rank].ids;
    check_combined(buf.low_latency_combine(combine_args(buf, d, mine, sh, ctx.rank, R)).combined_x, ref_in,
                   sh, "shrink");
  }
}

// Shrink with a rank that is killed (SIGKILL) before its dispatch, under a long deadline: the survivors see
// its process go and mask it at once (docs/low-latency.md, "Masks and shrink"), report the same mask, and
// complete dispatch and combine without its experts well before the deadline.
MR_CASE("low_latency_shrink_killed", {true, 3, 2}) {
  const LlTestShape sh;
  const int R = ctx.size, E = R * sh.experts_per_rank, L = sh.experts_per_rank;
  const double timeout = 30.0;
  Buffer buf(ctx.group, shrink_options(timeout));
  buf.set_low_latency_shrink(true);
  const int killed = 2;
  if (ctx.rank == killed) kill(getpid(), SIGKILL);
  std::vector<LlRankInputs> all;
  for (int s = 0; s < R; ++s) all.push_back(inputs_of(7, s, E, sh));
  LlRankInputs& mine = all[ctx.rank];
  const std::vector<LlRankInputs> live = without(all, {killed}, L);
  const auto t0 = std::chrono::steady_clock::now();
  const LowLatencyDispatchResult d = buf.low_latency_dispatch(dispatch_args(mine, E, sh, false));
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  REQUIRE(waited < timeout / 3, "masking the killed rank took ", waited, " s (deadline ", timeout, " s)");
  std::vector<int32_t> want(R, 0);
  want[killed] = 1;
  REQUIRE(buf.low_latency_query_mask_buffer() == want, "the killed rank is masked");
  check_rows(ctx, live, d, sh, false);
  LlRankInputs ref_in = mine;
  ref_in.ids = live[ctx.rank].ids;
  check_combined(buf.low_latency_combine(combine_args(buf, d, mine, sh, ctx.rank, R)).combined_x, ref_in, sh,
                 "shrink, killed rank");
}

// engine/combine.cc — combine over a Transport: windows over each origin's tokens with one fixed slot per
// (token, slot k) in expert_major or (token, rank d) in rank_major, so that the origin reads every copy of a
// token side by side and reduces in canonical order without staging anything else.
#include "engine/combine.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "engine/dispatch.h"
#include "engine/kernels.h"

namespace epcomm::engine {

using Clock = std::chrono::steady_clock;

// Combine window half: a few MiB, well inside the L3 the ranks of a host share (see docs/performance.md).
constexpr size_t kCombineHalfBytes = size_t{4} << 20;

void run_combine(OpContext& ctx, const CombineInput& in, CombineOutput& out,
                 const std::function<void()>& on_shapes) {
  const int R = ctx.size(), me = ctx.rank();
  const Handle::Impl& hd = *in.handle;
  const bool expert = hd.order == ReceiveOrder::expert_major;
  const int K = hd.num_topk;
  const int64_t T = hd.num_tokens, Hc = in.hidden;
  const size_t elem = dtype_size(in.dtype);
  const auto t_start = Clock::now();

  HeaderData& h = ctx.begin_header(OpKind::combine);
  h.order = static_cast<uint32_t>(hd.order);
  h.flags = (hd.has_topk ? kHasTopk : 0) | (in.has_recv_weights ? kHasWeights : 0);
  h.num_experts = hd.num_experts;
  h.num_topk = K;
  h.dtype = static_cast<int32_t>(in.dtype);
  h.quant_mode = -1;
  h.hidden = Hc;
  h.row_bytes = static_cast<int64_t>(Hc * elem);
  h.num_tokens = T;
  h.expert_alignment = hd.expert_alignment;
  h.handle_id = hd.seq;
  std::copy(std::begin(in.chunks), std::end(in.chunks), h.chunks);
  ctx.publish_header();
  ctx.exchange_headers();
  check_headers_match(ctx);
  const auto t_headers = Clock::now();

  const int slots = expert ? K : R;
  const size_t row_bytes = static_cast<size_t>(Hc) * elem;
  const size_t wbytes = in.has_recv_weights ? sizeof(float) * K : 0;
  // Two halves when a window fits in half the area: contributors fill window w + 1 while the origin reduces
  // w. A half is capped at kCombineHalfBytes so that the copies a contributor writes are still in the
  // shared cache when the origin reads them (a 32 MiB half went to DRAM and back: two extra touches).
  size_t half = std::min(kCombineHalfBytes, ctx.layout().data_bytes / 2 / kAlign * kAlign);
  if (combine_geometry(half, row_bytes, slots, wbytes).window < 1)
    half = ctx.layout().data_bytes / 2 / kAlign * kAlign;  // one token's slots exceed the cap
  const bool two = combine_geometry(half, row_bytes, slots, wbytes).window >= 1;
  const int64_t halves = two ? 2 : 1;
  const size_t area_bytes = two ? half : ctx.layout().data_bytes;
  const CombineGeometry geo = combine_geometry(area_bytes, row_bytes, slots, wbytes);
  if (geo.window < 1)
    EPCOMM_THROW(InvalidUsage, ctx.prefix(), "capacity: num_nvl_bytes = ", ctx.layout().total,
                 " cannot hold the ", slots, " copies of one token (", row_bytes,
                 " bytes each); the minimum for this call is ",
                 control_bytes(R) + combine_min_data_bytes(row_bytes, slots, wbytes));

  // The caller allocated the outputs (their shapes are known locally); only the debug poison happens here.
  if (in.poison) {
    if (out.combined_x.nbytes()) std::memset(out.combined_x.data(), 0xFF, out.combined_x.nbytes());
    if (out.combined_topk_weights && out.combined_topk_weights->nbytes())
      std::memset(out.combined_topk_weights->data(), 0xFF, out.combined_topk_weights->nbytes());
  }
  on_shapes();

  const int64_t W = geo.window;
  std::vector<int64_t> nwin(R), filled(R, 0), done_us(R, -1);
  for (int s = 0; s < R; ++s) {
    int64_t Ts = ctx.header(s)->num_tokens;
    nwin[s] = hd.rows_per_source[s] > 0 ? (Ts + W - 1) / W : 0;
    if (nwin[s] == 0)
      done_us[s] = std::chrono::duration_cast<std::chrono::microseconds>(t_headers - t_start).count();
  }
  const int64_t my_nwin = (T + W - 1) / W;
  const uint64_t seq = ctx.seq();
  const int32_t* src_tok = hd.recv_src_token.data_as<int32_t>();
  const int32_t* src_slot = hd.recv_src_slot.data_as<int32_t>();
  std::vector<int64_t> pos(hd.source_offsets.begin(), hd.source_offsets.end() - 1);
  uint8_t* my_area = ctx.data(me);
  // Own contributions, per half and slot: pointers into x (and the receiving-side weights) instead of copies.
  const int64_t WL = std::max<int64_t>(1, std::min(W, T));  // a window never holds more than T tokens
  std::vector<const uint8_t*> local_rows(static_cast<size_t>(halves) * WL * slots, nullptr);
  std::vector<const float*> local_weights(static_cast<size_t>(halves) * WL * slots, nullptr);
  const size_t weights_off = static_cast<size_t>(W) * slots * geo.row_stride;

  // Contributor: write the copies of origin s's tokens in window w into s's slots.
  auto fill = [&](int s, int64_t w) {
    uint8_t* area = ctx.data(s) + static_cast<size_t>(w % halves) * area_bytes;
    const int64_t t0 = w * W, t1 = t0 + W;
    const int64_t end = hd.source_offsets[s + 1];
    while (pos[s] < end) {
      const int32_t row = hd.source_rows[pos[s]];
      const int64_t t = src_tok[row];
      if (t >= t1) break;
      const int slot = expert ? src_slot[row] : me;
      const size_t idx = static_cast<size_t>(t - t0) * slots + slot;
      if (s == me) {  // own copies are read in place by the reduction: no copy
        const size_t l = static_cast<size_t>(w % halves) * WL * slots + idx;
        local_rows[l] = in.x + row * row_bytes;
        if (wbytes) local_weights[l] = in.recv_weights + row * K;
      } else {
        // Plain stores: the origin reads this copy within the next window or two, from the cache.
        std::memcpy(area + idx * geo.row_stride, in.x + row * row_bytes, row_bytes);
        if (wbytes)
          std::memcpy(area + weights_off + idx * geo.weight_stride, in.recv_weights + row * K, wbytes);
      }
      ++pos[s];
    }
  };

  // Origin: reduce window w into combined_x.
  const uint8_t* rows_ptr[1024];
  float wts[1024];
  const uint8_t* next_ptr[1024];
  float next_wts[1024];
  uint8_t* cx = out.combined_x.data_as<uint8_t>();
  float* cw = out.combined_topk_weights ? out.combined_topk_weights->data_as<float>() : nullptr;
  auto reduce = [&](int64_t w) {
    const int64_t t0 = w * W, t1 = std::min(T, t0 + W);
    const uint8_t* win = my_area + static_cast<size_t>(w % halves) * area_bytes;
    const uint8_t** lrow = local_rows.data() + static_cast<size_t>(w % halves) * WL * slots;
    const float** lw = local_weights.data() + static_cast<size_t>(w % halves) * WL * slots;
    // The copy of slot `slot` of token t: our own expert output in place, or a peer's in the window.
    auto copy_of = [&](int64_t t, int slot) -> const uint8_t* {
      const size_t idx = static_cast<size_t>(t - t0) * slots + slot;
      return lrow[idx] ? lrow[idx] : win + idx * geo.row_stride;
    };
    // The contributions of token t in canonical order (slot k ascending, or rank d ascending).
    auto gather = [&](int64_t t, const uint8_t** ptrs, float* ws) {
      int n = 0;
      if (expert) {
        for (int k = 0; k < K; ++k) {
          if (hd.topk_ids[t * K + k] < 0) continue;
          ptrs[n] = copy_of(t, k);
          ws[n++] = in.weights_used[t * K + k];
        }
      } else {
        for (int d = 0; d < R; ++d)
          if (hd.in_rank[t * R + d]) ptrs[n++] = copy_of(t, d);
      }
      return n;
    };
    for (int64_t t = t0; t < t1; ++t) {
      const int n = gather(t, rows_ptr, wts);
      // The kernel prefetches ahead within a row; the starts of the next token's rows are fetched here.
      if (t + 1 < t1) prefetch_row_starts(next_ptr, gather(t + 1, next_ptr, next_wts), row_bytes);
      reduce_token(in.dtype, rows_ptr, expert ? wts : nullptr, n, Hc,
                   in.bias1 ? in.bias1 + t * row_bytes : nullptr,
                   in.bias2 ? in.bias2 + t * row_bytes : nullptr, cx + t * row_bytes);
      if (!expert && cw) {
        const size_t first = static_cast<size_t>(t - t0) * slots;
        for (int k = 0; k < K; ++k) {
          float p = 0.0f;
          for (int d = 0; d < R; ++d) {
            if (!hd.in_rank[t * R + d]) continue;
            const float* g =
                lw[first + d]
                    ? lw[first + d]
                    : reinterpret_cast<const float*>(win + weights_off + (first + d) * geo.weight_stride);
            p = p + g[k];
          }
          cw[t * K + k] = 0.0f + p;
        }
      }
    }
    std::fill(lrow, lrow + static_cast<size_t>(WL) * slots,
              nullptr);  // the next window in this half starts empty
    std::fill(lw, lw + static_cast<size_t>(WL) * slots, nullptr);
  };

  int64_t reduced = 0, opened = 0;
  auto contributors_done = [&](int64_t w) {
    for (int p = 0; p < R; ++p)
      if (hd.tokens_per_rank[p] > 0 &&
          ctx.cell(me, p)->done.load(std::memory_order_acquire) < pack(seq, w + 1))
        return false;
    return true;
  };
  ctx.run(
      "data",
      [&](bool& progressed) {
        if (opened < my_nwin && opened < reduced + halves) {
          ++opened;
          ctx.control(me)->combine_open.store(pack(seq, opened), std::memory_order_seq_cst);
          for (int p = 0; p < R; ++p)
            if (hd.tokens_per_rank[p] > 0 && p != me) ctx.transport().notify(p);
          progressed = true;
        }
        bool all = true;
        for (int s : ctx.arrival_order()) {
          while (filled[s] < nwin[s] &&
                 ctx.control(s)->combine_open.load(std::memory_order_acquire) >= pack(seq, filled[s] + 1)) {
            fill(s, filled[s]);
            ++filled[s];
            ctx.signal(ctx.cell(s, me)->done, pack(seq, filled[s]), s);
            progressed = true;
            if (filled[s] == nwin[s])
              done_us[s] =
                  std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t_start).count();
          }
          all = all && filled[s] == nwin[s];
        }
        if (reduced < opened && contributors_done(reduced)) {
          reduce(reduced);
          ++reduced;
          progressed = true;
        }
        return all && reduced == my_nwin;
      },
      [&] {
        std::vector<int> peers;
        for (int s = 0; s < R; ++s)
          if (filled[s] < nwin[s] && s != me) peers.push_back(s);
        if (reduced < opened)
          for (int p = 0; p < R; ++p)
            if (hd.tokens_per_rank[p] > 0 && p != me &&
                ctx.cell(me, p)->done.load() < pack(seq, reduced + 1) &&
                std::find(peers.begin(), peers.end(), p) == peers.end())
              peers.push_back(p);
        return peers;
      });

  if (expert) std::memcpy(cw, in.weights_used.data(), sizeof(float) * T * K);
  if (in.cost_stats) add_cost_stats(*in.cost_stats, done_us);
}

}  // namespace epcomm::engine

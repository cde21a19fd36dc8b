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

void run_combine(OpContext& ctx, const CombineInput& in, CombineOutput& out, const std::function<void()>& on_shapes) {
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
  const CombineGeometry geo = combine_geometry(ctx.layout().data_bytes, row_bytes, slots, wbytes);
  if (geo.window < 1)
    EPCOMM_THROW(InvalidUsage, ctx.prefix(), "capacity: num_nvl_bytes = ", ctx.layout().total, " cannot hold the ",
                 slots, " copies of one token (", row_bytes, " bytes each); the minimum for this call is ",
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
    if (nwin[s] == 0) done_us[s] = std::chrono::duration_cast<std::chrono::microseconds>(t_headers - t_start).count();
  }
  const int64_t my_nwin = (T + W - 1) / W;
  const uint64_t seq = ctx.seq();
  const int32_t* src_tok = hd.recv_src_token.data_as<int32_t>();
  const int32_t* src_slot = hd.recv_src_slot.data_as<int32_t>();
  std::vector<int64_t> pos(hd.source_offsets.begin(), hd.source_offsets.end() - 1);
  uint8_t* my_area = ctx.data(me);
  const size_t weights_off = static_cast<size_t>(W) * slots * geo.row_stride;

  // Contributor: write the copies of origin s's tokens in window w into s's slots.
  auto fill = [&](int s, int64_t w) {
    uint8_t* area = ctx.data(s);
    const int64_t t0 = w * W, t1 = t0 + W;
    const int64_t end = hd.source_offsets[s + 1];
    while (pos[s] < end) {
      const int32_t row = hd.source_rows[pos[s]];
      const int64_t t = src_tok[row];
      if (t >= t1) break;
      const int slot = expert ? src_slot[row] : me;
      const size_t idx = static_cast<size_t>(t - t0) * slots + slot;
      copy_row(area + idx * geo.row_stride, in.x + row * row_bytes, row_bytes);
      if (wbytes) std::memcpy(area + weights_off + idx * geo.weight_stride, in.recv_weights + row * K, wbytes);
      ++pos[s];
    }
  };

  // Origin: reduce window w into combined_x.
  const uint8_t* rows_ptr[1024];
  float wts[1024];
  uint8_t* cx = out.combined_x.data_as<uint8_t>();
  float* cw = out.combined_topk_weights ? out.combined_topk_weights->data_as<float>() : nullptr;
  auto reduce = [&](int64_t w) {
    const int64_t t0 = w * W, t1 = std::min(T, t0 + W);
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* base = my_area + static_cast<size_t>(t - t0) * slots * geo.row_stride;
      int n = 0;
      if (expert) {
        for (int k = 0; k < K; ++k) {
          if (hd.topk_ids[t * K + k] < 0) continue;
          rows_ptr[n] = base + k * geo.row_stride;
          wts[n++] = in.weights_used[t * K + k];
        }
      } else {
        for (int d = 0; d < R; ++d)
          if (hd.in_rank[t * R + d]) rows_ptr[n++] = base + d * geo.row_stride;
      }
      reduce_token(in.dtype, rows_ptr, expert ? wts : nullptr, n, Hc, in.bias1 ? in.bias1 + t * row_bytes : nullptr,
                   in.bias2 ? in.bias2 + t * row_bytes : nullptr, cx + t * row_bytes);
      if (!expert && cw) {
        const uint8_t* wbase = my_area + weights_off + static_cast<size_t>(t - t0) * slots * geo.weight_stride;
        for (int k = 0; k < K; ++k) {
          float p = 0.0f;
          for (int d = 0; d < R; ++d)
            if (hd.in_rank[t * R + d]) p = p + reinterpret_cast<const float*>(wbase + d * geo.weight_stride)[k];
          cw[t * K + k] = 0.0f + p;
        }
      }
    }
  };

  int64_t reduced = 0;
  bool open = false;
  auto contributors_done = [&](int64_t w) {
    for (int p = 0; p < R; ++p)
      if (hd.tokens_per_rank[p] > 0 && ctx.cell(me, p)->done.load(std::memory_order_acquire) < pack(seq, w + 1))
        return false;
    return true;
  };
  ctx.run(
      "data",
      [&](bool& progressed) {
        if (reduced < my_nwin && !open) {
          ctx.control(me)->combine_open.store(pack(seq, reduced + 1), std::memory_order_seq_cst);
          for (int p = 0; p < R; ++p)
            if (hd.tokens_per_rank[p] > 0 && p != me) ctx.transport().notify(p);
          open = true;
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
              done_us[s] = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t_start).count();
          }
          all = all && filled[s] == nwin[s];
        }
        if (open && contributors_done(reduced)) {
          reduce(reduced);
          ++reduced;
          open = false;
          progressed = true;
        }
        return all && reduced == my_nwin;
      },
      [&] {
        std::vector<int> peers;
        for (int s = 0; s < R; ++s)
          if (filled[s] < nwin[s] && s != me) peers.push_back(s);
        if (open)
          for (int p = 0; p < R; ++p)
            if (hd.tokens_per_rank[p] > 0 && p != me && ctx.cell(me, p)->done.load() < pack(seq, reduced + 1) &&
                std::find(peers.begin(), peers.end(), p) == peers.end())
              peers.push_back(p);
        return peers;
      });

  if (expert) std::memcpy(cw, in.weights_used.data(), sizeof(float) * T * K);
  if (in.cost_stats) add_cost_stats(*in.cost_stats, done_us);
}

}  // namespace epcomm::engine

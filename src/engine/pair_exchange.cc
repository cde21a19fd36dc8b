// engine/pair_exchange.cc — windowed record exchange between the two ranks of a TP pair.
#include "engine/pair_exchange.h"

#include <algorithm>

namespace epcomm::engine::v2 {

static uint64_t pack_word(uint64_t seq, uint64_t w) {
  return engine::pack(seq, w);
}

void pair_exchange(OpContext& ctx, const char* phase, int64_t n_send, int64_t n_recv, size_t rec_bytes,
                   const std::function<void(int64_t, uint8_t*)>& pack,
                   const std::function<void(int64_t, const uint8_t*)>& unpack) {
  const int me = ctx.rank(), peer = 1 - me;
  const size_t stride = align64(std::max<size_t>(rec_bytes, 1));
  const size_t half = ctx.layout().data_bytes / 2 / kAlign * kAlign;
  const int64_t per_window = static_cast<int64_t>(half / stride);
  if ((n_send > 0 || n_recv > 0) && per_window < 1)
    EPCOMM_THROW(InvalidUsage, ctx.prefix(), "capacity: the TP group's segment (", ctx.layout().total,
                 " bytes) cannot hold two records of ", rec_bytes, " bytes; the minimum is ",
                 control_bytes(2) + 2 * stride);
  const int64_t my_windows = n_send > 0 ? (n_send + per_window - 1) / per_window : 0;
  const int64_t peer_windows = n_recv > 0 ? (n_recv + per_window - 1) / per_window : 0;
  const uint64_t seq = ctx.seq();
  uint8_t* mine = ctx.data(me);
  const uint8_t* theirs = ctx.data(peer);
  std::atomic<uint64_t>& my_ready = ctx.control(me)->stage_ready;
  const std::atomic<uint64_t>& peer_ready = ctx.control(peer)->stage_ready;
  const std::atomic<uint64_t>& acked = ctx.cell(me, peer)->ack;  // written by the peer
  std::atomic<uint64_t>& my_ack = ctx.cell(peer, me)->ack;       // written by us

  int64_t staged = 0, pulled = 0;
  // Half w % 2 is free once the peer has pulled window w - 2.
  auto half_free = [&](int64_t w) {
    return w < 2 || acked.load(std::memory_order_acquire) >= pack_word(seq, w - 1);
  };
  ctx.run(
      phase,
      [&](bool& progressed) {
        while (staged < my_windows && half_free(staged)) {
          uint8_t* dst = mine + static_cast<size_t>(staged % 2) * half;
          const int64_t i0 = staged * per_window, i1 = std::min(n_send, i0 + per_window);
          for (int64_t i = i0; i < i1; ++i) pack(i, dst + static_cast<size_t>(i - i0) * stride);
          ++staged;
          ctx.signal(my_ready, pack_word(seq, staged), peer);
          progressed = true;
        }
        while (pulled < peer_windows &&
               peer_ready.load(std::memory_order_acquire) >= pack_word(seq, pulled + 1)) {
          const uint8_t* src = theirs + static_cast<size_t>(pulled % 2) * half;
          const int64_t i0 = pulled * per_window, i1 = std::min(n_recv, i0 + per_window);
          for (int64_t i = i0; i < i1; ++i) unpack(i, src + static_cast<size_t>(i - i0) * stride);
          ++pulled;
          ctx.signal(my_ack, pack_word(seq, pulled), peer);
          progressed = true;
        }
        const bool sent = staged == my_windows && (my_windows == 0 || acked.load(std::memory_order_acquire) >=
                                                                          pack_word(seq, my_windows));
        return sent && pulled == peer_windows;
      },
      [&] { return std::vector<int>{peer}; });
}

}  // namespace epcomm::engine::v2

// engine/combine_direct.cc — direct combine: every origin reads each copy of its tokens in place, at the
// rows its pushed dispatch wrote them to, and ranks done with their own tokens help reduce the others'.
#include "engine/combine_direct.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>

#include "common/env.h"
#include "engine/kernels.h"
#include "engine/window_serve.h"
#include "tensor/output_arena.h"

namespace epcomm::engine {
namespace {

// The chunks an origin's `share_chunks` word (first << 32 | end) leaves unclaimed: [first, end).
struct ChunkRange {
  uint32_t first, end;
  explicit ChunkRange(uint64_t word)
      : first(static_cast<uint32_t>(word >> 32)), end(static_cast<uint32_t>(word)) {}
  uint32_t left() const { return end > first ? end - first : 0; }
};

// Claims one chunk of an origin's `share_chunks`: the origin from the front, helpers from the back. False
// once none is left.
bool claim_chunk(std::atomic<uint64_t>& word, bool front, uint32_t& chunk) {
  uint64_t v = word.load(std::memory_order_acquire);
  while (true) {
    const auto [first, end] = ChunkRange(v);
    if (first >= end) return false;
    const uint64_t next =
        front ? (uint64_t{first + 1} << 32) | end : (uint64_t{first} << 32) | uint64_t{end - 1};
    if (word.compare_exchange_weak(v, next, std::memory_order_acq_rel, std::memory_order_acquire)) {
      chunk = front ? first : end - 1;
      return true;
    }
  }
}

// The count of a word pack(seq, n) written in this call, else 0 (a word of an earlier call).
uint64_t count_of(uint64_t word, uint64_t seq) {
  return word >> 32 == seq ? static_cast<uint32_t>(word) : 0;
}

// Reduces tokens of one origin from its copy table (ShareCopy, `slots` per token), as mapped on the rank
// that runs it: the origin itself, or a helper reducing a chunk of the origin's tokens into its outputs.
struct DirectReduce {
  const ShareCopy* table;
  int slots, K;
  DType dtype;
  int64_t hidden;
  size_t row_bytes;
  const uint8_t* const* xs;  // every holder's x
  const float* const* gs;    // rank_major: every holder's receiving-side weights
  const uint8_t *bias1, *bias2;
  bool weighted;  // expert_major: each copy scaled by its weight
  uint8_t* cx;
  float* cw;  // rank_major: sums of the holders' receiving-side weight rows, or null

  void run(int64_t t0, int64_t t1) const {
    // Token t's copies, gathered one token ahead so that the starts of the next token's rows are fetched
    // while this one is reduced (the kernel prefetches within).
    struct Copies {
      const uint8_t* rows[1024];
      float w[1024];
      const float* g[1024];
      int n = 0;
    } bufs[2];
    auto gather = [&](int64_t t, Copies& c) {
      c.n = 0;
      const ShareCopy* e = table + t * slots;
      for (int i = 0; i < slots && e[i].holder >= 0; ++i, ++c.n) {
        c.rows[c.n] = xs[e[i].holder] + e[i].row * static_cast<int64_t>(row_bytes);
        c.w[c.n] = e[i].weight;
        if (cw) c.g[c.n] = gs[e[i].holder] + static_cast<int64_t>(e[i].row) * K;
      }
    };
    if (t0 < t1) gather(t0, bufs[0]);
    for (int64_t t = t0; t < t1; ++t) {
      const Copies& c = bufs[(t - t0) % 2];
      if (t + 1 < t1) {
        Copies& next = bufs[(t + 1 - t0) % 2];
        gather(t + 1, next);
        prefetch_row_starts(next.rows, next.n, row_bytes, c.rows, c.n);
      }
      reduce_token(dtype, c.rows, weighted ? c.w : nullptr, c.n, hidden,
                   bias1 ? bias1 + t * row_bytes : nullptr, bias2 ? bias2 + t * row_bytes : nullptr,
                   cx + t * row_bytes);
      if (cw)
        for (int k = 0; k < K; ++k) {
          float p = 0.0f;
          for (int i = 0; i < c.n; ++i) p = p + c.g[i][k];
          cw[t * K + k] = 0.0f + p;
        }
    }
  }
};

// Reduces this rank's tokens with `own` over the call's copy threads: chunks claimed from the front of
// `shared` (peers done with their own tokens claim from its back), or contiguous parts when nothing is
// shared (null). Returns the tokens reduced here; `bytes` (the rows read) sizes the thread count.
int64_t reduce_own_tokens(const DirectReduce& own, const CombineInput& in, std::atomic<uint64_t>* shared,
                          int64_t T, int64_t bytes) {
  std::atomic<int64_t> reduced{0};
  auto part = [&](int i, int n) {
    int64_t count = 0;
    if (shared) {
      uint32_t c;
      while (claim_chunk(*shared, true, c)) {
        const int64_t t0 = int64_t{c} * kShareChunkTokens, t1 = std::min(T, t0 + kShareChunkTokens);
        own.run(t0, t1);
        count += t1 - t0;
      }
    } else {
      int64_t t0, t1;
      part_range(T, i, n, t0, t1);
      own.run(t0, t1);
      count = t1 - t0;
    }
    reduced.fetch_add(count, std::memory_order_relaxed);
    if (n > 1) store_fence();  // this thread's streaming stores, before they are published
  };
  const int threads = threads_for_bytes(in.threads, bytes);
  if (in.workers && threads > 1)
    in.workers->run(threads, part);
  else
    part(0, 1);
  return reduced.load();
}

// One direct combine call; run_direct below is its driver.
class DirectCombine {
 public:
  DirectCombine(OpContext& ctx, const CombineInput& in, CombineOutput& out);
  void run();

 private:
  void locate_inputs();
  void build_table();
  void offer_tokens();
  bool help_one();
  void help_with(int o, uint32_t chunk);
  int64_t reduced_by_helpers() const;
  void close();
  std::vector<int> open_origins() const;
  std::vector<int> awaited_peers() const;
  bool data_step(bool& progressed);
  void count() const;

  OpContext& ctx_;
  const CombineInput& in_;
  const HandleData& hd_;
  const int R_, me_;
  const bool expert_;
  const int K_;
  const int64_t T_;
  const uint64_t seq_;
  const size_t row_bytes_;
  const int slots_;
  uint8_t* const cx_;
  // rank_major: combined_topk_weights (returned with receiving-side weights) sums the holders' rows of them.
  float* const cw_;
  const bool sum_g_;
  Control* const mine_;
  std::vector<const uint8_t*> xs_;
  std::vector<const float*> gs_;  // rank_major: the holders' receiving-side weights
  bool share_ = false, offer_ = false;
  int64_t cx_off_ = -1, cw_off_ = -1;
  std::vector<ShareCopy> private_table_;
  ShareCopy* table_ = nullptr;
  DirectReduce own_{};
  int64_t reduced_ = 0, helped_ = 0;
  std::vector<int64_t> claimed_, done_;
  bool closed_ = false;
};

DirectCombine::DirectCombine(OpContext& ctx, const CombineInput& in, CombineOutput& out)
    : ctx_(ctx),
      in_(in),
      hd_(*in.handle),
      R_(ctx.size()),
      me_(ctx.rank()),
      expert_(hd_.order == ReceiveOrder::expert_major),
      K_(hd_.num_topk),
      T_(hd_.num_tokens),
      seq_(ctx.seq()),
      row_bytes_(static_cast<size_t>(in.hidden) * dtype_size(in.dtype)),
      slots_(hd_.copy_slots()),
      cx_(out.combined_x.data_as<uint8_t>()),
      cw_(out.combined_topk_weights ? out.combined_topk_weights->data_as<float>() : nullptr),
      sum_g_(!expert_ && cw_),
      mine_(ctx.control(ctx.rank())),
      claimed_(ctx.size(), 0),
      done_(ctx.size(), 0) {
  // Offer our tokens to helpers when they may write our outputs (both in our output arena).
  const std::shared_ptr<OutputArena> arena = ctx_.transport().output_arena();
  cx_off_ = arena ? arena->offset_of(cx_, out.combined_x.nbytes()) : -1;
  cw_off_ = sum_g_ && arena ? arena->offset_of(cw_, sizeof(float) * T_ * K_) : -1;
  // auto: also when the ranks outnumber the cores, up to two per core. The scheduler shares the cores by
  // time, not by progress: a core can idle while two unfinished ranks take turns on the other. Beyond two
  // per core, a helper descheduled in the middle of a chunk holds its origin up for longer than sharing
  // gains (docs/performance.md, "Shared reduction when oversubscribed"). All R ranks are on this host
  // (direct: one node).
  static const int sharing = env::combine_sharing();  // read once: a getenv per call is not free
  share_ = R_ > 1 && (sharing < 0 ? !env::ranks_outnumber_cores(R_, 2) : sharing == 1);
}

void DirectCombine::locate_inputs() {
  xs_.assign(R_, nullptr);
  gs_.assign(R_, nullptr);
  for (int p = 0; p < R_; ++p) {
    xs_[p] = p == me_ ? in_.x : ctx_.shared_input(p);
    const int64_t g = ctx_.header(p)->weights_offset;
    gs_[p] = p == me_ ? in_.recv_weights
             : g >= 0 ? reinterpret_cast<const float*>(ctx_.transport().arena(p) + g)
                      : nullptr;
  }
}

// The copy table (per token and slot: holder, row, weight) goes in our data area (unused by a direct
// combine) whenever it fits, offered or not: no allocation per call.
void DirectCombine::build_table() {
  const size_t table_bytes = sizeof(ShareCopy) * static_cast<size_t>(T_) * slots_;
  const bool table_fits = table_bytes <= ctx_.layout().data_bytes;
  // Offered when there are no biases (private tensors) and the table is in shared memory.
  offer_ = share_ && table_fits && T_ >= 2 * kShareChunkTokens && !in_.bias1 && !in_.bias2 && cx_off_ >= 0 &&
           (!sum_g_ || cw_off_ >= 0);
  if (!table_fits) private_table_.resize(static_cast<size_t>(T_) * slots_);
  table_ = table_fits ? reinterpret_cast<ShareCopy*>(ctx_.data(me_)) : private_table_.data();
  const int32_t* at = hd_.send_rows.data();
  for (int64_t t = 0; t < T_; ++t) {
    ShareCopy* e = table_ + t * slots_;
    int n = 0;
    hd_.for_each_copy(t, [&](int slot, int holder) {
      e[n++] = {holder, at[t * slots_ + slot], expert_ ? in_.weights_used[t * K_ + slot] : 0.0f};
    });
    if (n < slots_) e[n].holder = -1;
  }
}

void DirectCombine::offer_tokens() {
  mine_->share_out_offset = cx_off_;
  mine_->share_weights_offset = cw_off_;
  mine_->share_chunks.store((T_ + kShareChunkTokens - 1) / kShareChunkTokens, std::memory_order_relaxed);
  mine_->share_ready.store(pack(seq_, 1), std::memory_order_release);
  for (int p = 0; p < R_; ++p)
    if (p != me_) ctx_.notify(p);  // a peer already done with its own tokens may start on ours
}

// Reduces chunk `chunk` of origin o into its outputs (in its output arena, as mapped here); its results are
// ours to publish (share_done) before it may close.
void DirectCombine::help_with(int o, uint32_t chunk) {
  Control* oc = ctx_.control(o);
  PeerCell* cell = ctx_.cell(o, me_);
  const int64_t To = ctx_.header(o)->num_tokens;
  const int64_t t0 = int64_t{chunk} * kShareChunkTokens, t1 = std::min(To, t0 + kShareChunkTokens);
  claimed_[o] += t1 - t0;
  cell->share_claimed.store(pack(seq_, claimed_[o]), std::memory_order_release);
  uint8_t* base = ctx_.transport().arena(o);
  const int64_t wo = oc->share_weights_offset;
  DirectReduce theirs = own_;  // the same call's geometry and holders, the origin's table and outputs
  theirs.table = reinterpret_cast<const ShareCopy*>(ctx_.data(o));
  theirs.bias1 = theirs.bias2 = nullptr;  // an origin with biases does not offer
  theirs.cx = base + oc->share_out_offset;
  theirs.cw = wo >= 0 ? reinterpret_cast<float*>(base + wo) : nullptr;
  theirs.run(t0, t1);
  done_[o] += t1 - t0;
  helped_ += t1 - t0;
  cell->share_done.store(pack(seq_, done_[o]), std::memory_order_release);
  ctx_.notify(o);
}

// Helping: one chunk of the origin with the most chunks left (the slowest, on a host with many ranks).
bool DirectCombine::help_one() {
  if (!share_) return false;
  while (true) {
    int o = -1;
    uint32_t most = 0;
    for (int p = 0; p < R_; ++p) {
      if (p == me_ || ctx_.control(p)->share_ready.load(std::memory_order_acquire) != pack(seq_, 1)) continue;
      const uint32_t left = ChunkRange(ctx_.control(p)->share_chunks.load(std::memory_order_relaxed)).left();
      if (left > most) {
        most = left;
        o = p;
      }
    }
    if (o < 0) return false;
    uint32_t c;
    if (!claim_chunk(ctx_.control(o)->share_chunks, false, c)) continue;  // taken meanwhile: look again
    help_with(o, c);
    return true;
  }
}

// Our tokens helpers have reduced so far (all of the rest once it equals T - reduced).
int64_t DirectCombine::reduced_by_helpers() const {
  int64_t n = 0;
  for (int p = 0; p < R_; ++p)
    if (p != me_) n += count_of(ctx_.cell(me_, p)->share_done.load(std::memory_order_acquire), seq_);
  return n;
}

// Closed: the holders we read from may return (and reuse their x) once every origin they serve is.
void DirectCombine::close() {
  mine_->combine_open.store(pack(seq_, 1), std::memory_order_seq_cst);
  for (int p = 0; p < R_; ++p)
    if (hd_.tokens_per_rank[p] > 0 && p != me_) ctx_.notify(p);
  closed_ = true;
}

std::vector<int> DirectCombine::open_origins() const {
  std::vector<int> peers;
  for (int s = 0; s < R_; ++s)
    if (s != me_ && hd_.rows_per_source[s] > 0 &&
        ctx_.control(s)->combine_open.load(std::memory_order_acquire) < pack(seq_, 1))
      peers.push_back(s);
  return peers;
}

std::vector<int> DirectCombine::awaited_peers() const {
  std::vector<int> peers = open_origins();
  for (int p = 0; p < R_; ++p)  // helpers still reducing tokens of ours
    if (count_of(ctx_.cell(me_, p)->share_claimed.load(), seq_) !=
        count_of(ctx_.cell(me_, p)->share_done.load(), seq_))
      add_awaited(peers, p, me_);
  return peers;
}

bool DirectCombine::data_step(bool& progressed) {
  if (!closed_ && reduced_by_helpers() == T_ - reduced_) {
    close();
    progressed = true;
  }
  if (help_one()) {
    progressed = true;
    return false;
  }
  return closed_ && open_origins().empty();
}

void DirectCombine::count() const {
  if (!in_.counters) return;
  int64_t lent = 0;
  for (int s = 0; s < R_; ++s) lent += s == me_ ? 0 : hd_.rows_per_source[s];
  in_.counters->add(in_.counters->combine_in_place_rows, lent);
  in_.counters->add(in_.counters->combine_direct_tokens, T_);
  in_.counters->add(in_.counters->combine_shared_tokens, helped_);
}

void DirectCombine::run() {
  locate_inputs();
  build_table();
  if (offer_) offer_tokens();
  own_ = DirectReduce{table_,
                      slots_,
                      K_,
                      in_.dtype,
                      in_.hidden,
                      row_bytes_,
                      xs_.data(),
                      gs_.data(),
                      in_.bias1,
                      in_.bias2,
                      expert_,
                      cx_,
                      sum_g_ ? cw_ : nullptr};
  // Our tokens we reduced ourselves, over the call's copy threads.
  reduced_ = reduce_own_tokens(own_, in_, offer_ ? &mine_->share_chunks : nullptr, T_,
                               T_ * slots_ * static_cast<int64_t>(row_bytes_));
  if (expert_ && cw_ && T_ * K_ > 0) std::memcpy(cw_, in_.weights_used.data(), sizeof(float) * T_ * K_);
  ctx_.run(
      "data", [&](bool& progressed) { return data_step(progressed); }, [&] { return awaited_peers(); });
  count();
}

}  // namespace

// Direct combine (every header says kReadRowsInPlace): each origin reads every copy of its tokens straight
// from its holder's x, at the rows the dispatch wrote them to (handle send_rows), and reduces them in the
// same canonical order as the windows would. No windows: the headers are the only synchronisation before,
// and `combine_open` = pack(seq, 1) (closed) tells a holder that an origin is done with its rows.
//
// Shared reduction: an origin whose outputs lie in its output arena publishes its copy table, and a rank
// done with its own tokens reduces chunks of the origin's last ones (docs/design.md, "Combine"), so that the
// call takes about the mean of the ranks' times rather than the slowest one's. A token's result does not
// depend on which rank reduced it (same kernel, same order).
void run_direct(OpContext& ctx, const CombineInput& in, CombineOutput& out) {
  DirectCombine(ctx, in, out).run();
}

}  // namespace epcomm::engine

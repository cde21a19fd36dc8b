// engine/protocol.h — what the engine keeps in every rank's segment: control words, the header ring and
// the data area, carved by one function that also gives the minimum size (size hints use the same one).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace epcomm::engine {

constexpr int kMaxExperts = 16384;  // counts capacity of a header slot
constexpr int kMaxRanks = 1024;
constexpr size_t kMessageBytes = 1024;
constexpr size_t kAlign = 64;
// A dispatch whose tokens reach at most this many experts also lists them in its header (HeaderData::sparse),
// next to the fields its peers read anyway, and leaves the per-expert counts array unwritten: a decode step
// then costs its peers a few cache lines of it instead of E / 16.
constexpr int kSparseCounts = 16;

inline size_t align64(size_t n) {
  return (n + kAlign - 1) / kAlign * kAlign;
}

enum class OpKind : uint32_t {
  dispatch = 1,
  cached_dispatch = 2,
  combine = 3,
  dispatch_v2 = 4,  // the operator family (docs/distribute-v2.md)
  combine_v2 = 5,
  combine_add_rms_norm = 6,
  low_latency_dispatch = 7,  // docs/low-latency.md: the dispatch protocol with the low-latency layout
  low_latency_combine = 8,
  low_latency_clean = 9,  // clean_low_latency_buffer / low_latency_clean_mask_buffer with rank masks
};
const char* op_kind_name(OpKind op);

// Flags of HeaderData::flags.
constexpr uint32_t kHasTopk = 1, kHasWeights = 2, kHasBias = 4, kHasInRank = 8;
// Dispatch: this rank's outputs come from its output arena and its rows can be pushed (one node, fresh or
// cached after a pushed fresh one, private, sender-quantized or (data, scales) x). When every rank says so,
// senders write rows straight into the receivers' recv_x.
constexpr uint32_t kPushRows = 16;
// input_offset counts from the start of this rank's output arena, not of its segment (combine: x is, or lies
// in, an output of this Buffer, e.g. the dispatched recv_x fed back by in-place experts).
constexpr uint32_t kInputInArena = 32;
// Combine: this rank can take part in a direct combine (one node): its x is shared (input_offset >= 0), its
// handle knows where its tokens' copies lie on their holders (the dispatch pushed them), no cost statistics
// are asked for, and in rank_major with receiving-side weights those lie in its output arena
// (weights_offset >= 0). When every rank says so, origins read every copy straight from the holders' x, with
// no windows: one synchronisation at the start (the headers) and one at the end (origins closed).
constexpr uint32_t kReadRowsInPlace = 64;

// One collective call's header: parameters that must match across ranks, this rank's validation status
// and message. Written with plain stores, then `seq` is released; readers acquire `seq` first.
struct HeaderData {
  std::atomic<uint64_t> seq;
  uint32_t op;
  uint32_t failed;  // 1: this rank's validation (or previous_event) failed; message says why
  uint32_t order;
  uint32_t flags;
  int32_t num_experts, num_topk, dtype, quant_mode;
  int64_t hidden, row_bytes, num_tokens, expert_alignment, num_worst_tokens;
  int64_t expert_block_rows;  // low-latency dispatch: R * T_max (0: normal mode)
  uint64_t handle_id;
  int32_t chunks[4];
  // Where this rank's `x` starts, in bytes from the start of its segment, when it lies in a shared input
  // area (one node only; -1 otherwise): combine's expert outputs in the combine-input area (origins read
  // them in place), dispatch's tokens in the dispatch-input area (receivers read them in place, nothing is
  // staged but the routing).
  int64_t input_offset;
  // Combine, rank_major: where this rank's receiving-side weights start in its output arena, or -1.
  int64_t weights_offset;
  int32_t num_counts;  // entries of the counts array that follows: E pairs per expert, then R tokens per rank
  // Dispatch: >= 0: the non-zero pairs per expert are these (expert, count) pairs, and the counts array's
  // first E entries are not written; -1: read them there.
  int32_t num_sparse;
  int32_t sparse[2 * kSparseCounts];
  char message[kMessageBytes];
};

// Control words at the start of every segment.
struct alignas(64) Control {
  std::atomic<uint64_t> failed;        // 0, or 1 + sequence number of the call in which this rank failed
  std::atomic<uint64_t> stage_ready;   // dispatch: pack(seq, w + 1) once window w is staged
  std::atomic<uint64_t> combine_open;  // combine: pack(seq, w + 1) once window w may be written
  // Dispatch with pushed rows: pack(seq, 1) once `out_offset` holds where this call's recv_x starts in this
  // rank's output arena (senders may write into it then).
  std::atomic<uint64_t> out_ready;
  int64_t out_offset;
  int64_t out_scale_offset;  // the scales of a quantized recv_x (rows of scale_row_bytes), or -1
  // Direct combine, shared reduction: pack(seq, 1) once this rank's copy table (ShareCopy entries at the
  // start of its data area) is written and `share_chunks` reset, so that ranks done with their own tokens
  // may reduce chunks of ours (kShareChunkTokens each) into our combined_x (and, rank_major, our
  // combined_topk_weights), which lie in our output arena at `share_out_offset` (`share_weights_offset`).
  std::atomic<uint64_t> share_ready;
  // The chunks nobody has claimed: first << 32 | end. This rank claims from the front, helpers from the
  // back, each by compare-and-swap.
  std::atomic<uint64_t> share_chunks;
  int64_t share_out_offset, share_weights_offset;
  // With `failed`: 1 + the rank whose loss made this rank fail (its process died or stopped, its connection
  // broke), 0 for any other failure; then failed_message says what happened to that rank, not to this one.
  // Sent across nodes with failed_message in one piece.
  int32_t lost_rank;
  char failed_message[kMessageBytes];
  // Low-latency shrink agreement (docs/low-latency.md, "Masks and shrink"), one node: `ll_arrive` is the
  // sequence number of the last low-latency call this rank reached; for call `seq`, slot seq % 2 holds the
  // bit set of the ranks this rank saw arrive (`ll_view`, 64 ranks per word), published by `ll_view_seq`.
  std::atomic<uint64_t> ll_arrive;
  std::atomic<uint64_t> ll_view_seq[2];
  uint64_t ll_view[2][kMaxRanks / 64];
  // A low-latency combine among fewer ranks than its dispatch: `ll_x_ready` = seq once this rank's expert
  // outputs lie in its output arena at `ll_x_offset`; `ll_x_done` = seq once it has read its tokens' rows.
  std::atomic<uint64_t> ll_x_ready, ll_x_done;
  int64_t ll_x_offset;
};
static_assert(offsetof(Control, failed_message) == offsetof(Control, lost_rank) + sizeof(int32_t));

// Written by peer p into this rank's segment.
struct alignas(64) PeerCell {
  std::atomic<uint64_t> ack;     // dispatch: p finished reading our window: pack(seq, w + 1)
  std::atomic<uint64_t> done;    // combine: p finished writing into our window: pack(seq, w + 1)
  std::atomic<uint64_t> pushed;  // dispatch: p wrote every row of its tokens into our recv_x: pack(seq, 1)
  // Direct combine: tokens of ours p has claimed, and of those reduced (results written), in this call:
  // pack(seq, n). We close once every claimed token is reduced.
  std::atomic<uint64_t> share_claimed, share_done;
};

// Direct combine, shared reduction: one entry per copy of an origin's token, `slots` entries per token in
// canonical order (the rank that holds the copy, its row in that rank's x, and in expert_major its weight);
// holder -1 ends a token with fewer copies.
struct ShareCopy {
  int32_t holder, row;
  float weight;
};
constexpr int64_t kShareChunkTokens = 16;

inline uint64_t pack(uint64_t seq, uint64_t w) {
  return (seq << 32) | w;
}

struct SegmentLayout {
  size_t control = 0, cells = 0, headers = 0, header_bytes = 0, data = 0, data_bytes = 0, total = 0;
};

// Carves a segment of `segment_bytes` for `num_ranks`; data_bytes is 0 when it does not even fit the
// control part (the caller reports capacity).
SegmentLayout carve(size_t segment_bytes, int num_ranks);
// Bytes of everything but the data area.
size_t control_bytes(int num_ranks);

// Per-call data-area geometry. Dispatch: the area is two halves, each holding `window` staged tokens
// (payload at stride `row_stride`, then metadata at stride `meta_stride`). Combine: one window of
// `window` origin tokens × `slots` contributions (row at stride `row_stride`, then weights).
struct DispatchGeometry {
  size_t row_stride, meta_stride, half_bytes;
  int64_t window;               // tokens per half; 0 = does not fit
  bool cache_resident = false;  // windows small enough to stay in the shared cache: stage with plain stores
};
// On one node a dispatch window holds at most this many bytes (rows + routing), so that the receivers read
// what the sender staged from the shared cache instead of from memory (docs/performance.md).
constexpr size_t kDispatchWindowBytes = size_t{1} << 20;
DispatchGeometry dispatch_geometry(size_t data_bytes, size_t row_bytes, size_t meta_bytes);
size_t dispatch_min_data_bytes(size_t row_bytes, size_t meta_bytes);

struct CombineGeometry {
  size_t row_stride, weight_stride;
  int slots;
  int64_t window;  // origin tokens per window; 0 = does not fit
};
CombineGeometry combine_geometry(size_t data_bytes, size_t row_bytes, int slots, size_t weight_bytes);
size_t combine_min_data_bytes(size_t row_bytes, int slots, size_t weight_bytes);

}  // namespace epcomm::engine

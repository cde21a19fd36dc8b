// api/args.cc — argument checks of dispatch and combine (docs/normal-mode.md):
// every message names the argument, the expected and the actual value.
#include <cstring>

#include <unistd.h>

#include "api/buffer_impl.h"
#include "common/check.h"
#include "common/env.h"
#include "quant/row.h"
#include "routing/layout.h"
#include "tensor/output_arena.h"

namespace epcomm {

// Where t's bytes start in this rank's output arena (an arena, t non-empty and inside it), or -1: the peers
// of a combine on this rank's node can then read it in place.
int64_t arena_offset(const Buffer::Impl& b, const Tensor& t) {
  if (t.nbytes() == 0) return -1;
  const auto arena = b.transport->output_arena();
  return arena ? arena->offset_of(t.data(), t.nbytes()) : -1;
}

namespace {

std::string describe(const Tensor& t) {
  return detail::cat(dtype_name(t.dtype()), shape_str(t.shape()));
}

void check_shape(const Tensor& t, const char* name, const Shape& expected, const char* meaning) {
  EPCOMM_CHECK(t.shape() == expected, "argument: ", name, ": shape ", shape_str(t.shape()), ", expected ",
               shape_str(expected), " = ", meaning);
}

void check_dtype(const Tensor& t, const char* name, std::initializer_list<DType> ok) {
  for (DType d : ok)
    if (t.dtype() == d) return;
  std::string list;
  for (DType d : ok) list += detail::cat(list.empty() ? "" : " or ", dtype_name(d));
  EPCOMM_THROW(InvalidUsage, "argument: ", name, ": dtype ", dtype_name(t.dtype()), ", expected ", list);
}

void check_contiguous(const Tensor& t, const char* name) {
  EPCOMM_CHECK(t.is_contiguous(), "argument: ", name, ": must be contiguous (shape ", shape_str(t.shape()),
               ", strides ", shape_str(t.strides()), ")");
}

// Element i of t in row-major order of its shape, read through its strides (a strided view reads right).
int64_t read_int(const Tensor& t, int64_t i) {
  int64_t at = t.is_contiguous() ? i : 0;
  for (int64_t d = t.is_contiguous() ? -1 : t.dim() - 1; d >= 0; --d) {
    const int64_t n = t.size(d);
    at += (n > 0 ? i % n : 0) * t.strides()[static_cast<size_t>(d)];
    i = n > 0 ? i / n : 0;
  }
  switch (t.dtype()) {
    case DType::i64:
      return t.data_as<int64_t>()[at];
    case DType::i32:
      return t.data_as<int32_t>()[at];
    case DType::boolean:
    case DType::u8:
      return t.data_as<uint8_t>()[at];
    default:
      return 0;
  }
}

// A passed layout tensor must equal what the top-k ids give.
template <typename V>
void check_equal_layout(const Tensor& t, const char* name, const std::vector<V>& expected) {
  for (size_t i = 0; i < expected.size(); ++i) {
    int64_t v = read_int(t, static_cast<int64_t>(i));
    EPCOMM_CHECK(v == static_cast<int64_t>(expected[i]), "argument: ", name,
                 " disagrees with topk_idx at index ", i, ": got ", v, ", topk_idx gives ",
                 static_cast<int64_t>(expected[i]));
  }
}

void check_stats(const std::optional<Tensor>& t, const char* name, int R) {
  if (!t) return;
  check_dtype(*t, name, {DType::i64, DType::i32});
  check_shape(*t, name, {R}, "[num_ranks]");
  check_contiguous(*t, name);
}

// Config::num_threads, else the class default (Buffer::set_num_threads, EPCOMM_NUM_THREADS), resolved.
int threads_of(const std::optional<Config>& c, const Buffer::Impl& b) {
  const int requested = c && c->num_threads > 0 ? c->num_threads : Buffer::num_threads();
  return engine::copy_threads(requested, b.transport->size());
}

std::array<int32_t, 4> chunks_of(const std::optional<Config>& c) {
  Config cfg = c ? *c : Buffer::get_dispatch_config(1);
  cfg.validate();
  return {cfg.num_max_nvl_chunked_send_tokens, cfg.num_max_nvl_chunked_recv_tokens,
          cfg.num_max_rdma_chunked_send_tokens, cfg.num_max_rdma_chunked_recv_tokens};
}

}  // namespace

const Handle::Impl& own_handle(const Buffer::Impl& b, const std::shared_ptr<const Handle>& h) {
  const Handle::Impl& hd = h->impl();
  EPCOMM_CHECK(hd.buffer_key == &b && !hd.buffer_alive.expired(),
               "argument: handle: it belongs to another Buffer or to a destroyed one");
  if (hd.wait_shapes) {  // the handle of an asynchronous dispatch: its counts must be known
    try {
      hd.wait_shapes();
    } catch (const std::exception& e) {
      EPCOMM_THROW(InvalidUsage, "argument: handle: the dispatch that produced it failed: ", e.what());
    }
  }
  return hd;
}

namespace {

[[noreturn]] void bad_tuple(const Payload& x) {
  EPCOMM_THROW(
      InvalidUsage,
      "argument: x: a (data, scales) tuple must be one of: (i8 [T,H], f32 [T]) int8; (f8e4m3 [T,H], f32 [T]) "
      "pertoken_fp8_e4m3; (f8e4m3 [T,H], f32 [T, ceil(H/128)]) pergroup_fp8_e4m3; (f8e4m3 or f8e5m2 [T,H], "
      "e8m0 [T, H/32] or [T*H/32]) mx_fp8_e4m3/mx_fp8_e5m2; (f4x2 [T,H/2], e8m0 [T, H/32] or [T*H/32]) "
      "mx_fp4_e2m1; got (",
      describe(x.data), ", ", describe(*x.scales), ")");
}

// Pre-quantized (data, scales): the mode follows from dtypes and shapes (docs/normal-mode.md table).
engine::RowFormat infer_tuple(const Payload& x, int64_t& hidden, int64_t& st0, int64_t& st1) {
  using SS = engine::RowFormat::ScaleShape;
  const Tensor& d = x.data;
  const Tensor& s = *x.scales;
  if (d.dim() != 2) bad_tuple(x);
  const int64_t T = d.size(0), C = d.size(1);
  engine::RowFormat f;
  f.plain = false;
  f.data_dtype = d.dtype();
  f.data_cols = C;
  f.data_row_bytes = static_cast<size_t>(C);
  f.scale_dtype = s.dtype();
  auto vec_or_mat = [&](int64_t cols) {
    if (s.dim() == 1 && cols == 1 && s.size(0) == T) {
      st0 = s.strides()[0];
      st1 = 0;
      return SS::vec;
    }
    if (s.dim() == 2 && s.size(0) == T && s.size(1) == cols) {
      st0 = s.strides()[0];
      st1 = s.strides()[1];
      return SS::mat;
    }
    return SS::none;
  };
  if ((d.dtype() == DType::i8 || d.dtype() == DType::f8e4m3) && s.dtype() == DType::f32) {
    hidden = C;
    if (s.dim() == 1) {
      if (vec_or_mat(1) != SS::vec) bad_tuple(x);
      f.scale_shape = SS::vec;
      f.scale_cols = 1;
      f.mode = d.dtype() == DType::i8 ? QuantMode::int8 : QuantMode::pertoken_fp8_e4m3;
    } else {
      if (d.dtype() != DType::f8e4m3 || vec_or_mat((C + 127) / 128) != SS::mat) bad_tuple(x);
      f.scale_shape = SS::mat;
      f.scale_cols = (C + 127) / 128;
      f.mode = QuantMode::pergroup_fp8_e4m3;
    }
  } else if ((d.dtype() == DType::f8e4m3 || d.dtype() == DType::f8e5m2 || d.dtype() == DType::f4x2) &&
             s.dtype() == DType::e8m0) {
    hidden = d.dtype() == DType::f4x2 ? 2 * C : C;
    if (hidden % 32 != 0) bad_tuple(x);
    const int64_t G = hidden / 32;
    if (s.dim() == 1 && s.size(0) == T * G) {
      st1 = s.strides()[0];
      st0 = G * st1;
    } else if (vec_or_mat(G) != SS::mat) {
      bad_tuple(x);
    }
    f.scale_shape = SS::flat;
    f.scale_cols = G;
    f.mode = d.dtype() == DType::f8e5m2 ? QuantMode::mx_fp8_e5m2
             : d.dtype() == DType::f4x2 ? QuantMode::mx_fp4_e2m1
                                        : QuantMode::mx_fp8_e4m3;
  } else {
    bad_tuple(x);
  }
  f.scale_row_bytes = static_cast<size_t>(f.scale_cols) * dtype_size(f.scale_dtype);
  return f;
}

// Selects the payload format: tuple > quant_mode > environment switch > plain (docs/normal-mode.md).
void select_format(const DispatchArgs& a, engine::DispatchInput& in) {
  const Tensor& x = a.x.data;
  EPCOMM_CHECK(x.defined(), "argument: x: expected a [num_tokens, hidden] tensor, got None");
  EPCOMM_CHECK(x.dim() == 2, "argument: x: expected a 2-D [num_tokens, hidden] tensor, got shape ",
               shape_str(x.shape()));
  EPCOMM_CHECK(x.size(1) >= 1, "argument: x: hidden (columns) must be >= 1, got shape ",
               shape_str(x.shape()));
  check_contiguous(x, "x");
  in.x = x.data_as<uint8_t>();
  in.x_dtype = x.dtype();
  in.x_row_bytes = static_cast<size_t>(x.size(1)) * dtype_size(x.dtype());
  in.keep.push_back(x);
  if (a.x.scales) {
    int64_t hidden = 0, st0 = 0, st1 = 0;
    in.format = infer_tuple(a.x, hidden, st0, st1);
    EPCOMM_CHECK(!a.quant_mode || *a.quant_mode == in.format.mode,
                 "argument: quant_mode = ", quant_mode_name(*a.quant_mode),
                 " contradicts the (data, scales) tuple, which is ", quant_mode_name(in.format.mode));
    in.hidden = hidden;
    in.scales = a.x.scales->data_as<uint8_t>();
    in.scale_stride0 = st0;
    in.scale_stride1 = st1;
    in.keep.push_back(*a.x.scales);
    return;
  }
  std::optional<QuantMode> mode = a.quant_mode;
  if (!mode && env::normal_int8()) mode = QuantMode::int8;
  in.hidden = x.size(1);
  if (mode && *mode == QuantMode::bf16) {
    EPCOMM_CHECK(x.dtype() == DType::bf16, "argument: x: quant_mode = bf16 requires x of dtype bf16, got ",
                 dtype_name(x.dtype()));
    mode.reset();
  }
  if (!mode) {
    check_dtype(x, "x", {DType::bf16, DType::f16, DType::f32});
    in.format.plain = true;
    in.format.data_dtype = x.dtype();
    in.format.data_cols = x.size(1);
    in.format.data_row_bytes = in.x_row_bytes;
    return;
  }
  check_dtype(x, "x", {DType::bf16, DType::f16, DType::f32});
  quant::check_hidden(*mode, in.hidden);
  engine::RowFormat& f = in.format;
  f.plain = false;
  f.mode = *mode;
  f.quantize = *mode;
  f.data_dtype = quant::data_dtype(*mode);
  f.data_row_bytes = quant::row_data_bytes(*mode, in.hidden);
  f.data_cols = static_cast<int64_t>(f.data_row_bytes);
  f.scale_dtype = quant::scale_dtype(*mode);
  f.scale_row_bytes = quant::row_scale_bytes(*mode, in.hidden);
  f.scale_cols = static_cast<int64_t>(f.scale_row_bytes / dtype_size(f.scale_dtype));
  using SS = engine::RowFormat::ScaleShape;
  const bool group128 = *mode == QuantMode::pergroup_fp8_e4m3 || *mode == QuantMode::pergroup_fp8_e4m3_pow2 ||
                        *mode == QuantMode::pergroup_fp8_e4m3_ue8m0;
  f.scale_shape = group128                                                              ? SS::mat
                  : (*mode == QuantMode::int8 || *mode == QuantMode::pertoken_fp8_e4m3) ? SS::vec
                                                                                        : SS::flat;
}

// x in this rank's shared dispatch-input area, plain (no scales, no quantization): the receivers read its
// rows in place (one node only).
void detect_shared_dispatch_input(const Buffer::Impl& b, const DispatchArgs& a, engine::DispatchInput& in) {
  if (b.dispatch_input_bytes() == 0 || b.inter || !in.format.plain || a.x.scales || a.x.data.nbytes() == 0)
    return;
  const uint8_t* area = b.dispatch_input_area();
  if (in.x >= area && in.x + a.x.data.nbytes() <= area + b.dispatch_input_bytes())
    in.shared_offset = static_cast<int64_t>(b.segment.dispatch_input_offset) + (in.x - area);
}

}  // namespace

namespace {

// Checks and copies what every dispatch takes: chunk sizes, copy threads, cost statistics, alignment and
// worst-case sizes.
void prepare_common(const Buffer::Impl& b, const DispatchArgs& a, engine::DispatchInput& in) {
  const int R = b.num_ranks;
  auto ch = chunks_of(a.config);
  std::copy(ch.begin(), ch.end(), in.chunks);
  in.threads = threads_of(a.config, b);
  check_stats(a.dispatch_wait_recv_cost_stats, "dispatch_wait_recv_cost_stats", R);
  if (a.dispatch_wait_recv_cost_stats) {
    in.cost_stats = a.dispatch_wait_recv_cost_stats;
    in.keep.push_back(*a.dispatch_wait_recv_cost_stats);
  }
  EPCOMM_CHECK(a.expert_alignment >= 1, "argument: expert_alignment: expected >= 1, got ",
               a.expert_alignment);
  EPCOMM_CHECK(
      a.expert_alignment < (int64_t{1} << 31),
      "argument: expert_alignment: expected below 2^31 (a rank receives at most 2^31 - 1 rows), got ",
      a.expert_alignment);
  EPCOMM_CHECK(a.num_worst_tokens >= 0, "argument: num_worst_tokens: expected >= 0, got ",
               a.num_worst_tokens);
}

// A cached re-dispatch (docs/normal-mode.md): the handle's routing, x alone.
void prepare_cached(const Buffer::Impl& b, const DispatchArgs& a, engine::DispatchInput& in,
                    ReceiveOrder& order) {
  const Handle::Impl& hd = own_handle(b, a.handle);
  in.cached = true;
  in.handle = std::shared_ptr<const Handle::Impl>(a.handle, &hd);
  order = hd.order;
  in.order = hd.order;
  for (auto [name, given] : {std::pair<const char*, bool>{"topk_idx", a.topk_idx.has_value()},
                             {"topk_weights", a.topk_weights.has_value()},
                             {"num_tokens_per_rank", a.num_tokens_per_rank.has_value()},
                             {"num_tokens_per_rdma_rank", a.num_tokens_per_rdma_rank.has_value()},
                             {"is_token_in_rank", a.is_token_in_rank.has_value()},
                             {"num_tokens_per_expert", a.num_tokens_per_expert.has_value()}})
    EPCOMM_CHECK(!given, "argument: ", name, " must be None for a cached dispatch (handle given)");
  EPCOMM_CHECK(a.expert_alignment == 1 || a.expert_alignment == hd.expert_alignment,
               "argument: expert_alignment = ", a.expert_alignment, " differs from the handle's ",
               hd.expert_alignment);
  EPCOMM_CHECK(a.num_worst_tokens == 0 || a.num_worst_tokens == hd.num_worst_tokens,
               "argument: num_worst_tokens = ", a.num_worst_tokens, " differs from the handle's ",
               hd.num_worst_tokens);
  EPCOMM_CHECK(!a.receive_order || *a.receive_order == hd.order,
               "argument: receive_order = ", receive_order_name(*a.receive_order),
               " differs from the handle's ", receive_order_name(hd.order));
  select_format(a, in);
  detect_shared_dispatch_input(b, a, in);
  EPCOMM_CHECK_EQ(a.x.data.size(0), hd.num_tokens, "argument: x: rows must equal handle.num_tokens");
  in.num_tokens = hd.num_tokens;
  in.num_experts = hd.num_experts;
  in.num_topk = hd.num_topk;
  in.expert_alignment = hd.expert_alignment;
  in.num_worst_tokens = hd.num_worst_tokens;
}

// The routing the engine takes from a computed layout (is_token_in_rank is moved out of `lay`).
void take_layout(engine::DispatchInput& in, routing::Layout& lay) {
  in.pairs_per_expert = lay.num_tokens_per_expert;
  in.tokens_per_rank = lay.num_tokens_per_rank;
  in.in_rank = std::move(lay.is_token_in_rank);
}

// A fresh dispatch with top-k: the ids normalized, the layout computed and checked against the caller's.
void routing_from_topk(const Buffer::Impl& b, const DispatchArgs& a, engine::DispatchInput& in,
                       const routing::ExpertMap& map) {
  const int R = b.num_ranks;
  const int64_t T = in.num_tokens, E = in.num_experts;
  const Tensor& npe = *a.num_tokens_per_expert;
  const Tensor& ti = *a.topk_idx;
  const Tensor& tw = *a.topk_weights;
  EPCOMM_CHECK(ti.dim() == 2 && ti.size(0) == T, "argument: topk_idx: shape ", shape_str(ti.shape()),
               ", expected [", T, ", num_topk] = [num_tokens, num_topk]");
  check_dtype(ti, "topk_idx", {DType::i64, DType::i32});
  check_contiguous(ti, "topk_idx");
  const int K = static_cast<int>(ti.size(1));
  EPCOMM_CHECK(K >= 1 && K <= 1024, "argument: topk_idx: num_topk = ", K, ", expected 1 to 1024");
  check_shape(tw, "topk_weights", {T, K}, "[num_tokens, num_topk]");
  check_dtype(tw, "topk_weights", {DType::f32});
  check_contiguous(tw, "topk_weights");
  in.num_topk = K;
  in.idx_dtype = ti.dtype();
  in.ids.resize(static_cast<size_t>(T) * K);
  routing::normalize_topk_ids(ti.data(), ti.dtype() == DType::i64, T, K, static_cast<int>(E), in.ids.data());
  in.weights.assign(tw.data_as<float>(), tw.data_as<float>() + T * K);
  auto lay = routing::compute_layout(in.ids.data(), T, K, map, b.node_of_rank, b.num_nodes);
  check_equal_layout(npe, "num_tokens_per_expert", lay.num_tokens_per_expert);
  if (a.num_tokens_per_rank) {
    check_shape(*a.num_tokens_per_rank, "num_tokens_per_rank", {R}, "[num_ranks]");
    check_dtype(*a.num_tokens_per_rank, "num_tokens_per_rank", {DType::i32, DType::i64});
    check_equal_layout(*a.num_tokens_per_rank, "num_tokens_per_rank", lay.num_tokens_per_rank);
  }
  if (a.is_token_in_rank) {
    check_shape(*a.is_token_in_rank, "is_token_in_rank", {T, R}, "[num_tokens, num_ranks]");
    check_dtype(*a.is_token_in_rank, "is_token_in_rank", {DType::boolean, DType::i32});
    check_equal_layout(*a.is_token_in_rank, "is_token_in_rank", lay.is_token_in_rank);
  }
  if (a.num_tokens_per_rdma_rank) {
    check_shape(*a.num_tokens_per_rdma_rank, "num_tokens_per_rdma_rank", {b.num_nodes}, "[num_nodes]");
    check_dtype(*a.num_tokens_per_rdma_rank, "num_tokens_per_rdma_rank", {DType::i32, DType::i64});
    check_equal_layout(*a.num_tokens_per_rdma_rank, "num_tokens_per_rdma_rank", lay.num_tokens_per_node);
  }
  take_layout(in, lay);
}

// A fresh dispatch without top-k (rank_major): is_token_in_rank gives the routing.
void routing_from_in_rank(const Buffer::Impl& b, const DispatchArgs& a, engine::DispatchInput& in,
                          ReceiveOrder order) {
  const int R = b.num_ranks;
  const int64_t T = in.num_tokens, E = in.num_experts;
  const Tensor& npe = *a.num_tokens_per_expert;
  EPCOMM_CHECK(
      order == ReceiveOrder::rank_major,
      "argument: receive_order = expert_major requires topk_idx and topk_weights (got None); DeepEP's "
      "contract without top-k is receive_order = rank_major: pass receive_order=\"rank_major\", or in "
      "Python create the Buffer with flavor=\"deepep\" (or set EPCOMM_FLAVOR=deepep)");
  EPCOMM_CHECK(a.is_token_in_rank.has_value(),
               "argument: is_token_in_rank: required without topk_idx, got None");
  const Tensor& itr = *a.is_token_in_rank;
  check_shape(itr, "is_token_in_rank", {T, R}, "[num_tokens, num_ranks]");
  check_dtype(itr, "is_token_in_rank", {DType::boolean, DType::i32});
  in.in_rank.resize(static_cast<size_t>(T) * R);
  in.tokens_per_rank.assign(R, 0);
  for (int64_t i = 0; i < T * R; ++i) {
    int64_t v = read_int(itr, i);
    EPCOMM_CHECK(v == 0 || v == 1, "argument: is_token_in_rank[", i / R, ", ", i % R, "] = ", v,
                 ", expected 0 or 1");
    in.in_rank[i] = static_cast<uint8_t>(v);
    in.tokens_per_rank[i % R] += static_cast<int32_t>(v);
  }
  if (a.num_tokens_per_rank) {
    check_shape(*a.num_tokens_per_rank, "num_tokens_per_rank", {R}, "[num_ranks]");
    check_dtype(*a.num_tokens_per_rank, "num_tokens_per_rank", {DType::i32, DType::i64});
    check_equal_layout(*a.num_tokens_per_rank, "num_tokens_per_rank (column sums of is_token_in_rank)",
                       in.tokens_per_rank);
  }
  in.pairs_per_expert.resize(E);
  for (int64_t e = 0; e < E; ++e) {
    int64_t v = read_int(npe, e);
    EPCOMM_CHECK(v >= 0 && v < (int64_t{1} << 31), "argument: num_tokens_per_expert[", e, "] = ", v,
                 ", expected 0 to 2^31 - 1");
    in.pairs_per_expert[e] = static_cast<int32_t>(v);
  }
}

// What every fresh dispatch takes from `a` besides its routing: order, payload format, tokens, alignment.
void prepare_fresh(const Buffer::Impl& b, const DispatchArgs& a, ReceiveOrder order,
                   engine::DispatchInput& in) {
  in.order = order;
  select_format(a, in);
  detect_shared_dispatch_input(b, a, in);
  const int64_t T = a.x.data.size(0);
  EPCOMM_CHECK(T < (int64_t{1} << 31), "argument: x: num_tokens = ", T, " must be below 2^31");
  in.num_tokens = T;
  in.expert_alignment = a.expert_alignment;
  in.num_worst_tokens = a.num_worst_tokens;
}

}  // namespace

void prepare_dispatch_from_ids(const Buffer::Impl& b, const DispatchArgs& a, int num_experts, int num_topk,
                               std::vector<int32_t> ids, engine::DispatchInput& in) {
  prepare_common(b, a, in);
  prepare_fresh(b, a, ReceiveOrder::expert_major, in);
  const int64_t T = in.num_tokens;
  in.num_experts = num_experts;
  in.num_topk = num_topk;
  in.idx_dtype = a.topk_idx ? a.topk_idx->dtype() : DType::i64;
  in.ids = std::move(ids);
  in.weights.assign(static_cast<size_t>(T) * num_topk, 0.0f);
  const routing::ExpertMap map{num_experts, b.num_ranks, num_experts / b.num_ranks};
  auto lay = routing::compute_layout(in.ids.data(), T, num_topk, map, b.node_of_rank, b.num_nodes);
  take_layout(in, lay);
}

void prepare_dispatch(const Buffer::Impl& b, const DispatchArgs& a, engine::DispatchInput& in,
                      ReceiveOrder& order) {
  const int R = b.num_ranks;
  prepare_common(b, a, in);
  if (a.handle) return prepare_cached(b, a, in, order);
  order = a.receive_order.value_or(b.options.receive_order);
  prepare_fresh(b, a, order, in);

  EPCOMM_CHECK(a.topk_idx.has_value() == a.topk_weights.has_value(),
               "argument: topk_idx and topk_weights must be given together (got topk_idx ",
               a.topk_idx ? "given" : "None", ", topk_weights ", a.topk_weights ? "given" : "None", ")");
  EPCOMM_CHECK(a.num_tokens_per_expert.has_value(),
               "argument: num_tokens_per_expert: required for a fresh dispatch, got None");
  const Tensor& npe = *a.num_tokens_per_expert;
  EPCOMM_CHECK(npe.dim() == 1,
               "argument: num_tokens_per_expert: expected a 1-D [num_experts] tensor, got shape ",
               shape_str(npe.shape()));
  check_dtype(npe, "num_tokens_per_expert", {DType::i32, DType::i64});
  const int64_t E = npe.size(0);
  EPCOMM_CHECK(E >= 1 && E % R == 0, "argument: num_experts = ", E,
               " (from num_tokens_per_expert) must be a positive multiple of the number of ranks ", R);
  EPCOMM_CHECK(E <= engine::kMaxExperts, "argument: num_experts = ", E, " exceeds the supported maximum ",
               engine::kMaxExperts);
  in.num_experts = static_cast<int>(E);
  routing::ExpertMap map{static_cast<int>(E), R, static_cast<int>(E / R)};

  if (a.topk_idx)
    routing_from_topk(b, a, in, map);
  else
    routing_from_in_rank(b, a, in, order);
}

void check_worst_case_outputs(const engine::DispatchInput& in) {
  const int64_t w = in.num_worst_tokens;
  if (w == 0 || in.cached) return;
  EPCOMM_CHECK(w < (int64_t{1} << 31), "argument: num_worst_tokens = ", w,
               ", expected below 2^31 (a rank receives at most 2^31 - 1 rows)");
  const auto& f = in.format;
  const double per_row = static_cast<double>(f.data_row_bytes + f.scale_row_bytes + 3 * sizeof(int32_t)) +
                         static_cast<double>(in.num_topk) * (dtype_size(in.idx_dtype) + sizeof(float));
  const double need = per_row * static_cast<double>(w);
  const double have =
      static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGESIZE));
  EPCOMM_CHECK(need <= have, "capacity: num_worst_tokens = ", w, " sizes the outputs at ",
               static_cast<int64_t>(need), " bytes (", static_cast<int64_t>(per_row),
               " per row), more than this host's memory (", static_cast<int64_t>(have),
               " bytes); nothing was allocated");
}

void prepare_combine(const Buffer::Impl& b, const CombineArgs& a, engine::CombineInput& in) {
  const int R = b.num_ranks;
  EPCOMM_CHECK(a.handle != nullptr, "argument: handle: required, got None");
  const Handle::Impl& hd = own_handle(b, a.handle);
  in.handle = &hd;
  in.keep_handle = a.handle;
  auto ch = chunks_of(a.config);
  std::copy(ch.begin(), ch.end(), in.chunks);
  in.threads = threads_of(a.config, b);
  check_stats(a.combine_send_cost_stats, "combine_send_cost_stats", R);
  if (a.combine_send_cost_stats) {
    in.cost_stats = a.combine_send_cost_stats;
    in.keep.push_back(*a.combine_send_cost_stats);
  }
  const Tensor& x = a.x;
  EPCOMM_CHECK(x.defined() && x.dim() == 2,
               "argument: x: expected a 2-D [handle.num_rows, hidden] tensor, got ",
               x.defined() ? shape_str(x.shape()) : std::string("None"));
  EPCOMM_CHECK(x.size(0) == hd.num_rows, "argument: x: shape ", shape_str(x.shape()), ", expected [",
               hd.num_rows, ", hidden] = [handle.num_rows, hidden]");
  EPCOMM_CHECK(x.size(1) >= 1, "argument: x: hidden (columns) must be >= 1, got shape ",
               shape_str(x.shape()));
  check_dtype(x, "x", {DType::bf16, DType::f16, DType::f32});
  check_contiguous(x, "x");
  in.dtype = x.dtype();
  in.hidden = x.size(1);
  in.x = x.data_as<uint8_t>();
  in.keep.push_back(x);
  // x in this rank's shared combine-input area, or in its output arena (an output of this Buffer, e.g. the
  // dispatched recv_x itself): the ranks of this node that reduce its rows (the origins, or across nodes the
  // proxies of remote origins) read them in place.
  if (b.input_bytes() > 0 && x.nbytes() > 0) {
    const uint8_t* area = b.input_area();
    if (in.x >= area && in.x + x.nbytes() <= area + b.input_bytes())
      in.shared_offset = static_cast<int64_t>(b.segment.combine_input_offset) + (in.x - area);
  }
  if (in.shared_offset < 0) {
    in.shared_offset = arena_offset(b, x);
    in.shared_in_arena = in.shared_offset >= 0;
  }
  const int64_t T = hd.num_tokens;
  const int K = hd.num_topk;
  if (hd.order == ReceiveOrder::expert_major) {
    const float* w = hd.topk_weights.data();
    if (a.topk_weights) {
      check_shape(*a.topk_weights, "topk_weights", {T, K},
                  "[num_tokens, num_topk] on the origin rank (expert_major)");
      check_dtype(*a.topk_weights, "topk_weights", {DType::f32});
      check_contiguous(*a.topk_weights, "topk_weights");
      w = a.topk_weights->data_as<float>();
    }
    in.weights_used.resize(static_cast<size_t>(T) * K);
    for (int64_t i = 0; i < T * K; ++i) in.weights_used[i] = hd.topk_ids[i] >= 0 ? w[i] : 0.0f;
  } else if (a.topk_weights) {
    EPCOMM_CHECK(K > 0,
                 "argument: topk_weights: the dispatch had no top-k, so combine takes no topk_weights");
    check_shape(*a.topk_weights, "topk_weights", {hd.num_rows, K},
                "[handle.num_rows, num_topk] on the receiving rank (rank_major)");
    check_dtype(*a.topk_weights, "topk_weights", {DType::f32});
    check_contiguous(*a.topk_weights, "topk_weights");
    in.recv_weights = a.topk_weights->data_as<float>();
    in.has_recv_weights = true;
    in.keep.push_back(*a.topk_weights);
    // In the output arena (e.g. the dispatched recv_topk_weights): origins of a direct combine read it there.
    in.recv_weights_offset = arena_offset(b, *a.topk_weights);
  }
  auto bias = [&](const std::optional<Tensor>& t, const char* name) -> const uint8_t* {
    if (!t) return nullptr;
    check_shape(*t, name, {T, in.hidden}, "[num_tokens, hidden]");
    EPCOMM_CHECK(t->dtype() == x.dtype(), "argument: ", name, ": dtype ", dtype_name(t->dtype()),
                 ", expected x's dtype ", dtype_name(x.dtype()));
    check_contiguous(*t, name);
    in.keep.push_back(*t);
    return t->data_as<uint8_t>();
  };
  in.bias1 = bias(a.bias, "bias");
  in.bias2 = bias(a.bias2, "bias[1]");
  EPCOMM_CHECK(!in.bias2 || in.bias1, "argument: bias: a second bias needs the first");
}

}  // namespace epcomm

// multirank/cases_quant.cc — quantized dispatch (docs/normal-mode.md): every mode, both orders;
// received codes and scales equal the quantizer applied once to the source row, bitwise; tuple input
// arrives verbatim; the environment switch and its priority; combine of the dequantized rows.
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>

#include "multirank/round_trip.h"
#include "quant/row.h"
#include "support/check.h"

using namespace epcomm;
using namespace epcomm::testing;

namespace {

const QuantMode kModes[] = {
    QuantMode::int8,        QuantMode::pertoken_fp8_e4m3, QuantMode::pergroup_fp8_e4m3,
    QuantMode::mx_fp8_e4m3, QuantMode::mx_fp8_e5m2,       QuantMode::mx_fp4_e2m1};

// Every rank's rows quantized: [T, data | scales] per rank, the record dispatch moves.
std::vector<std::vector<uint8_t>> quantized_records(const Problem& P, QuantMode mode) {
  const int64_t H = P.spec.hidden;
  const size_t db = quant::row_data_bytes(mode, H), sb = quant::row_scale_bytes(mode, H);
  const size_t xrow = P.row_bytes();
  std::vector<std::vector<uint8_t>> out(P.spec.num_ranks);
  for (int s = 0; s < P.spec.num_ranks; ++s) {
    const auto& in = P.ranks[s];
    out[s].resize(in.num_tokens * (db + sb));
    for (int64_t t = 0; t < in.num_tokens; ++t) {
      uint8_t* rec = out[s].data() + t * (db + sb);
      quant::quantize_row(mode, P.spec.dtype, in.x.data() + t * xrow, H, rec, rec + db);
    }
  }
  return out;
}

// Received rows split back into the record form [rows, data | scales].
std::vector<uint8_t> records_of(const Payload& recv, size_t db, size_t sb) {
  const int64_t rows = recv.data.size(0);
  std::vector<uint8_t> out(rows * (db + sb));
  const uint8_t* d = recv.data.data_as<uint8_t>();
  const uint8_t* s = recv.scales ? recv.scales->data_as<uint8_t>() : nullptr;
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(out.data() + r * (db + sb), d + r * db, db);
    if (sb) std::memcpy(out.data() + r * (db + sb) + db, s + r * sb, sb);
  }
  return out;
}

void check_shapes(const Payload& recv, QuantMode mode, int64_t rows, int64_t H) {
  REQUIRE(recv.data.dtype() == quant::data_dtype(mode), "data dtype ", dtype_name(recv.data.dtype()));
  REQUIRE(recv.scales.has_value(), "scales missing");
  REQUIRE(recv.scales->dtype() == quant::scale_dtype(mode), "scale dtype ", dtype_name(recv.scales->dtype()));
  Shape data = {rows, mode == QuantMode::mx_fp4_e2m1 ? H / 2 : H};
  Shape scales = mode == QuantMode::int8 || mode == QuantMode::pertoken_fp8_e4m3 ? Shape{rows}
                 : mode == QuantMode::pergroup_fp8_e4m3 ? Shape{rows, (H + 127) / 128}
                                                        : Shape{rows * H / 32};
  REQUIRE(recv.data.shape() == data, "data shape ", shape_str(recv.data.shape()), ", expected ",
          shape_str(data));
  REQUIRE(recv.scales->shape() == scales, "scales shape ", shape_str(recv.scales->shape()), ", expected ",
          shape_str(scales));
}

}  // namespace

MR_CASE("dispatch_quant", {}) {
  Buffer buf(ctx.group, test_options(1 << 20));  // small segment: rounds too
  uint64_t seed = 300;
  for (ReceiveOrder order : {ReceiveOrder::expert_major, ReceiveOrder::rank_major}) {
    for (QuantMode mode : kModes) {
      for (DType dt : {DType::bf16, DType::f32}) {
        ProblemSpec s;
        s.num_ranks = ctx.size;
        s.num_experts = 2 * ctx.size;
        s.num_topk = 3;
        s.hidden = 320;  // 2.5 groups of 128, 10 MX blocks
        s.dtype = dt;
        s.seed = seed++;
        s.max_tokens = 24;
        s.random_bits = dt == DType::f32 && mode == QuantMode::int8;  // NaN/Inf/subnormal rows too
        const Problem P = make_problem(s);
        const int r = ctx.rank;
        const std::string where =
            epcomm::detail::cat("[", quant_mode_name(mode), " ", receive_order_name(order), " ",
                                dtype_name(dt), " rank ", r, "]");
        LayoutResult lay = buf.get_dispatch_layout(topk_idx_of(P, r), s.num_experts);
        DispatchArgs a;
        a.x.data = x_of(P, r);
        a.topk_idx = topk_idx_of(P, r);
        a.topk_weights = topk_weights_of(P, r);
        a.num_tokens_per_expert = lay.num_tokens_per_expert;
        a.receive_order = order;
        a.expert_alignment = 4;
        a.quant_mode = mode;
        DispatchResult d = buf.dispatch(a);

        const size_t db = quant::row_data_bytes(mode, s.hidden), sb = quant::row_scale_bytes(mode, s.hidden);
        const auto recs = quantized_records(P, mode);
        const RefDispatch place = ref_dispatch_placement(P, r, order, 4);
        const auto want = ref_place_rows(P, place, recs, db + sb);
        check_shapes(d.recv_x, mode, place.num_rows, s.hidden);
        check_rows_equal(where + " recv (data|scales)", records_of(d.recv_x, db, sb), want, db + sb,
                         DType::u8);

        // Cached re-dispatch quantizes the same way and lands rows in the same places.
        DispatchArgs ca;
        ca.x.data = x_of(P, r);
        ca.handle = d.handle;
        ca.quant_mode = mode;
        DispatchResult cd = buf.dispatch(ca);
        check_rows_equal(where + " cached recv (data|scales)", records_of(cd.recv_x, db, sb), want, db + sb,
                         DType::u8);

        // Tuple input: the same codes and scales, moved verbatim, mode inferred.
        if (dt == DType::bf16) {
          const int64_t T = P.ranks[r].num_tokens;
          std::vector<uint8_t> data(T * db), scales(T * sb);
          for (int64_t t = 0; t < T; ++t) {
            std::memcpy(data.data() + t * db, recs[r].data() + t * (db + sb), db);
            std::memcpy(scales.data() + t * sb, recs[r].data() + t * (db + sb) + db, sb);
          }
          DispatchArgs ta = a;
          ta.quant_mode.reset();
          ta.x.data = Tensor::wrap(data.data(), quant::data_dtype(mode),
                                   {T, mode == QuantMode::mx_fp4_e2m1 ? s.hidden / 2 : s.hidden});
          const int64_t G = mode == QuantMode::pergroup_fp8_e4m3 ? (s.hidden + 127) / 128 : s.hidden / 32;
          if (mode == QuantMode::int8 || mode == QuantMode::pertoken_fp8_e4m3)
            ta.x.scales = Tensor::wrap(scales.data(), DType::f32, {T});
          else if (mode == QuantMode::pergroup_fp8_e4m3)
            ta.x.scales = Tensor::wrap(scales.data(), DType::f32, {T, G});
          else
            ta.x.scales = Tensor::wrap(scales.data(), DType::e8m0, {T * G});
          const Buffer::CopyCounters c0 = buf.copy_counters();
          DispatchResult td = buf.dispatch(ta);
          check_rows_equal(where + " tuple recv", records_of(td.recv_x, db, sb), want, db + sb, DType::u8);
          // With output arenas on one node the data rows and the gathered scales are pushed, else staged.
          const Buffer::CopyCounters c1 = buf.copy_counters();
          const bool pushes = buf.num_output_arena_bytes() > 0 && buf.num_nodes() == 1;
          check_scalar<int64_t>(where + " tuple: dispatch_pushed_tokens",
                                c1.dispatch_pushed_tokens - c0.dispatch_pushed_tokens, pushes ? T : 0);
          check_scalar<int64_t>(where + " tuple: dispatch_staged_tokens",
                                c1.dispatch_staged_tokens - c0.dispatch_staged_tokens, pushes ? 0 : T);
          if (mode == QuantMode::pergroup_fp8_e4m3) {  // column-major scales (a transposed [G, T] tensor)
            std::vector<uint8_t> cols(T * sb);
            for (int64_t t = 0; t < T; ++t)
              for (int64_t g = 0; g < G; ++g)
                std::memcpy(&cols[(g * T + t) * 4], &scales[(t * G + g) * 4], 4);
            ta.x.scales = Tensor::wrap(cols.data(), DType::f32, {T, G}, {1, T});
            DispatchResult cm = buf.dispatch(ta);
            check_rows_equal(where + " tuple recv, column-major scales", records_of(cm.recv_x, db, sb), want,
                             db + sb, DType::u8);
          }
        }

        // Combine of the dequantized rows: bitwise the reference fed with the same dequantized rows.
        const int64_t rows = place.num_rows;
        std::vector<float> deq(rows * s.hidden, std::numeric_limits<float>::quiet_NaN());
        const auto mine = records_of(d.recv_x, db, sb);
        for (int64_t i = 0; i < rows; ++i)
          if (place.src_rank[i] >= 0)
            quant::dequantize_row(mode, mine.data() + i * (db + sb), mine.data() + i * (db + sb) + db,
                                  s.hidden, deq.data() + i * s.hidden);
        CombineArgs c;
        c.x = Tensor::wrap(deq.data(), DType::f32, {rows, s.hidden});
        c.handle = d.handle;
        if (order == ReceiveOrder::rank_major) c.topk_weights = d.recv_topk_weights;
        CombineResult cr = buf.combine(c);
        std::vector<std::vector<uint8_t>> outs(ctx.size);
        std::vector<std::vector<float>> recv_w(ctx.size);
        for (int q = 0; q < ctx.size; ++q) {
          RefDispatch pq = ref_dispatch(P, q, order, 4);
          recv_w[q] = pq.recv_topk_weights;
          auto rq = ref_place_rows(P, pq, recs, db + sb);
          outs[q].assign(pq.num_rows * s.hidden * 4, 0xFF);
          for (int64_t i = 0; i < pq.num_rows; ++i)
            if (pq.src_rank[i] >= 0)
              quant::dequantize_row(mode, rq.data() + i * (db + sb), rq.data() + i * (db + sb) + db, s.hidden,
                                    reinterpret_cast<float*>(outs[q].data()) + i * s.hidden);
        }
        RefCombine rc = ref_combine(P, r, order, 4, 0, DType::f32, s.hidden, outs, nullptr,
                                    order == ReceiveOrder::rank_major ? &recv_w : nullptr, {},
                                    buf.num_nodes() > 1 ? ctx.size / buf.num_nodes() : 0);
        check_rows_equal(where + " combine(dequantized)", tensor_bytes(cr.combined_x), rc.combined_x,
                         s.hidden * 4, DType::f32);
      }
    }
  }
}

MR_CASE("dispatch_quant_priority", {}) {
  // quant_mode > DEEP_NORMAL_MODE_USE_INT8_QUANT > plain; mismatched tuples and modes raise.
  Buffer buf(ctx.group, test_options(1 << 20));
  ProblemSpec s;
  s.num_ranks = ctx.size;
  s.num_experts = 2 * ctx.size;
  s.num_topk = 2;
  s.hidden = 64;
  s.seed = 9;
  s.max_tokens = 8;
  const Problem P = make_problem(s);
  LayoutResult lay = buf.get_dispatch_layout(topk_idx_of(P, ctx.rank), s.num_experts);
  DispatchArgs a;
  a.x.data = x_of(P, ctx.rank);
  a.topk_idx = topk_idx_of(P, ctx.rank);
  a.topk_weights = topk_weights_of(P, ctx.rank);
  a.num_tokens_per_expert = lay.num_tokens_per_expert;
  static std::mutex env_mutex;  // threads share the environment
  {
    std::lock_guard<std::mutex> lk(env_mutex);
    setenv("DEEP_NORMAL_MODE_USE_INT8_QUANT", "1", 1);
  }
  ctx.group->bootstrap().barrier();
  DispatchResult d = buf.dispatch(a);  // env: int8
  REQUIRE(d.recv_x.data.dtype() == DType::i8 && d.recv_x.scales && d.recv_x.scales->dtype() == DType::f32,
          "the environment switch selects int8");
  a.quant_mode = QuantMode::bf16;  // the argument wins
  d = buf.dispatch(a);
  REQUIRE(d.recv_x.data.dtype() == DType::bf16 && !d.recv_x.scales, "quant_mode=bf16 beats the environment");
  ctx.group->bootstrap().barrier();
  {
    std::lock_guard<std::mutex> lk(env_mutex);
    unsetenv("DEEP_NORMAL_MODE_USE_INT8_QUANT");
  }
  a.quant_mode.reset();
  d = buf.dispatch(a);
  REQUIRE(d.recv_x.data.dtype() == DType::bf16 && !d.recv_x.scales, "plain without switch");
  // A tuple contradicting quant_mode.
  std::vector<int8_t> q(P.ranks[ctx.rank].num_tokens * 64);
  std::vector<float> sc(P.ranks[ctx.rank].num_tokens);
  a.x.data = Tensor::wrap(q.data(), DType::i8, {P.ranks[ctx.rank].num_tokens, 64});
  a.x.scales = Tensor::wrap(sc.data(), DType::f32, {P.ranks[ctx.rank].num_tokens});
  a.quant_mode = QuantMode::mx_fp8_e4m3;
  expect_error([&] { buf.dispatch(a); }, ErrorCode::InvalidUsage,
               {"quant_mode = mx_fp8_e4m3 contradicts", "int8"});
  // MX needs hidden % 32 == 0.
  DispatchArgs m;
  std::vector<uint16_t> x(P.ranks[ctx.rank].num_tokens * 40);
  m = a;
  m.x.scales.reset();
  m.x.data = Tensor::wrap(x.data(), DType::bf16, {P.ranks[ctx.rank].num_tokens, 40});
  m.quant_mode = QuantMode::mx_fp4_e2m1;
  expect_error([&] { buf.dispatch(m); }, ErrorCode::InvalidUsage, {"40"});
}

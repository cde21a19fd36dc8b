// multirank/cases_errors.cc — every bad-input case of docs/normal-mode.md raises epcomm::Error naming the
// argument, the expected and the actual value; all ranks make the same bad call, and the Buffer stays usable.
#include <cstring>

#include "multirank/round_trip.h"
#include "support/check.h"

using namespace epcomm;
using namespace epcomm::testing;

namespace {

// A valid small problem and the arguments of a valid dispatch; cases break one thing.
struct Fixture {
  RankCtx& ctx;
  Problem P;
  Buffer buf;
  LayoutResult lay;
  explicit Fixture(RankCtx& c, int64_t nvl = 4 << 20)
      : ctx(c),
        P(make_problem([&] {
          ProblemSpec s;
          s.num_ranks = c.size;
          s.num_experts = 4 * c.size;
          s.num_topk = 3;
          s.hidden = 64;
          s.seed = 99;
          s.min_tokens = s.max_tokens = 10;
          return s;
        }())),
        buf(c.group, test_options(nvl, 20)),
        lay(buf.get_dispatch_layout(topk_idx_of(P, c.rank), P.spec.num_experts)) {}
  DispatchArgs args() {
    DispatchArgs a;
    a.x.data = x_of(P, ctx.rank);
    a.topk_idx = topk_idx_of(P, ctx.rank);
    a.topk_weights = topk_weights_of(P, ctx.rank);
    a.num_tokens_per_expert = lay.num_tokens_per_expert;
    return a;
  }
  DispatchResult ok() {
    DispatchResult d = buf.dispatch(args());
    REQUIRE(d.recv_x.data.size(1) == 64, "valid dispatch after an error");
    return d;
  }
  void bad_dispatch(const DispatchArgs& a, std::initializer_list<const char*> keys) {
    expect_error([&] { buf.dispatch(a); }, ErrorCode::InvalidUsage, keys);
    ok();  // the Buffer is still usable on every rank
  }
};

std::vector<uint8_t> g_scratch(1 << 20);

}  // namespace

#define ERROR_CASE(name) MR_CASE("error." name, {})

ERROR_CASE("x_not_2d") {
  Fixture f(ctx);
  auto a = f.args();
  a.x.data = Tensor::wrap(g_scratch.data(), DType::bf16, {640});
  f.bad_dispatch(a, {"argument", "x", "2-D", "[640]"});
}
ERROR_CASE("x_dtype") {
  Fixture f(ctx);
  auto a = f.args();
  a.x.data = Tensor::wrap(g_scratch.data(), DType::i32, {10, 64});
  f.bad_dispatch(a, {"argument", "x", "dtype i32", "bf16 or f16 or f32"});
}
ERROR_CASE("topk_weights_shape") {
  Fixture f(ctx);
  auto a = f.args();
  a.topk_weights = Tensor::wrap(g_scratch.data(), DType::f32, {10, 2});
  f.bad_dispatch(a, {"topk_weights: shape [10, 2], expected [10, 3] = [num_tokens, num_topk]"});
}
ERROR_CASE("topk_idx_dtype") {
  Fixture f(ctx);
  auto a = f.args();
  a.topk_idx = Tensor::wrap(g_scratch.data(), DType::f32, {10, 3});
  f.bad_dispatch(a, {"topk_idx", "dtype f32", "i64 or i32"});
}
ERROR_CASE("topk_without_weights") {
  Fixture f(ctx);
  auto a = f.args();
  a.topk_weights.reset();
  f.bad_dispatch(a, {"topk_idx and topk_weights must be given together"});
}
ERROR_CASE("missing_num_tokens_per_expert") {
  Fixture f(ctx);
  auto a = f.args();
  a.num_tokens_per_expert.reset();
  f.bad_dispatch(a, {"num_tokens_per_expert", "required", "None"});
}
ERROR_CASE("experts_not_multiple_of_ranks") {
  if (ctx.size < 2) throw Skip("needs 2 ranks");
  Fixture f(ctx);
  auto a = f.args();
  std::vector<int32_t> npe(4 * ctx.size + 1, 0);
  a.num_tokens_per_expert = Tensor::wrap(npe.data(), DType::i32, {4 * ctx.size + 1});
  f.bad_dispatch(a, {"num_experts = ", "multiple of the number of ranks"});
  expect_error([&] { f.buf.get_dispatch_layout(topk_idx_of(f.P, ctx.rank), 4 * ctx.size + 1); },
               ErrorCode::InvalidUsage, {"num_experts", "multiple"});
}
ERROR_CASE("expert_id_out_of_range") {
  Fixture f(ctx);
  auto a = f.args();
  std::vector<int64_t> ids(f.P.ranks[ctx.rank].topk_idx);
  ids[2 * 3 + 1] = 4 * ctx.size;  // token 2, slot 1
  ids[5 * 3 + 0] = 4 * ctx.size + 7;
  a.topk_idx = Tensor::wrap(ids.data(), DType::i64, {10, 3});
  f.bad_dispatch(a, {"topk_idx[2, 1] = ", "is out of range [0, "});
  expect_error([&] { f.buf.get_dispatch_layout(*a.topk_idx, 4 * ctx.size); }, ErrorCode::InvalidUsage,
               {"topk_idx[2, 1]", "out of range"});
}
ERROR_CASE("num_tokens_per_rank_mismatch") {
  Fixture f(ctx);
  auto a = f.args();
  std::vector<int32_t> v = tensor_to_i32(f.lay.num_tokens_per_rank);
  v.back() += 1;
  a.num_tokens_per_rank = Tensor::wrap(v.data(), DType::i32, {ctx.size});
  f.bad_dispatch(a, {"num_tokens_per_rank disagrees with topk_idx at index"});
}
ERROR_CASE("is_token_in_rank_mismatch") {
  Fixture f(ctx);
  auto a = f.args();
  std::vector<uint8_t> v(static_cast<size_t>(10) * ctx.size);
  std::memcpy(v.data(), f.lay.is_token_in_rank.data(), v.size());
  v[3 * ctx.size] ^= 1;
  a.is_token_in_rank = Tensor::wrap(v.data(), DType::boolean, {10, ctx.size});
  f.bad_dispatch(
      a, {"is_token_in_rank disagrees with topk_idx at index ", std::to_string(3 * ctx.size).c_str()});
}
ERROR_CASE("expert_major_without_topk") {
  Fixture f(ctx);
  auto a = f.args();
  a.topk_idx.reset();
  a.topk_weights.reset();
  a.is_token_in_rank = f.lay.is_token_in_rank;
  a.receive_order = ReceiveOrder::expert_major;
  f.bad_dispatch(a, {"expert_major requires topk_idx"});
}
ERROR_CASE("expert_alignment_zero") {
  Fixture f(ctx);
  auto a = f.args();
  a.expert_alignment = 0;
  f.bad_dispatch(a, {"expert_alignment: expected >= 1, got 0"});
}
ERROR_CASE("num_worst_tokens_negative") {
  Fixture f(ctx);
  auto a = f.args();
  a.num_worst_tokens = -3;
  f.bad_dispatch(a, {"num_worst_tokens: expected >= 0, got -3"});
}
ERROR_CASE("expert_alignment_huge") {
  Fixture f(ctx);
  auto a = f.args();
  a.expert_alignment = int64_t{1} << 40;
  f.bad_dispatch(a, {"expert_alignment: expected below 2^31", "got 1099511627776"});
}
ERROR_CASE("expert_alignment_beyond_memory") {
  // Every expert with a token pads to 2^28 rows: about 2^30 rows of 176 bytes per receiver, checked on every
  // rank against the host's memory before any output is allocated.
  Fixture f(ctx);
  auto a = f.args();
  a.expert_alignment = int64_t{1} << 28;
  a.receive_order = ReceiveOrder::expert_major;
  f.bad_dispatch(a, {"capacity: receiving rank", "more than this host's memory", "nothing was sent"});
}
ERROR_CASE("num_worst_tokens_huge") {
  Fixture f(ctx);
  auto a = f.args();
  a.num_worst_tokens = int64_t{1} << 62;
  f.bad_dispatch(a, {"num_worst_tokens = 4611686018427387904, expected below 2^31"});
}
ERROR_CASE("num_worst_tokens_beyond_memory") {
  // Sized before anything is allocated: 2^31 - 1 rows of 64 bf16 far exceed any host's memory.
  Fixture f(ctx);
  auto a = f.args();
  a.num_worst_tokens = (int64_t{1} << 31) - 1;
  f.bad_dispatch(a, {"capacity: num_worst_tokens = 2147483647 sizes the outputs at",
                     "more than this host's memory", "nothing was allocated"});
}
ERROR_CASE("strided_layout_tensors") {
  // Layout tensors are read through their strides: a strided view of the right counts is accepted, a
  // strided view of wrong ones is rejected naming the index.
  Fixture f(ctx);
  const int64_t E = f.P.spec.num_experts;
  std::vector<int32_t> wide(static_cast<size_t>(2 * E), -7);
  for (int64_t e = 0; e < E; ++e)
    wide[static_cast<size_t>(2 * e)] = f.lay.num_tokens_per_expert.data_as<int32_t>()[e];
  auto a = f.args();
  a.num_tokens_per_expert = Tensor::wrap(wide.data(), DType::i32, {E}, {2});
  DispatchResult d = f.buf.dispatch(a);
  REQUIRE(d.recv_x.data.size(1) == 64, "strided num_tokens_per_expert accepted");
  for (int64_t e = 0; e < E; ++e)
    std::swap(wide[static_cast<size_t>(2 * e)], wide[static_cast<size_t>(2 * e + 1)]);
  a.num_tokens_per_expert = Tensor::wrap(wide.data(), DType::i32, {E}, {2});
  f.bad_dispatch(a, {"num_tokens_per_expert disagrees with topk_idx at index 0: got -7"});
}
ERROR_CASE("bad_tuple") {
  Fixture f(ctx);
  auto a = f.args();
  a.x.data = Tensor::wrap(g_scratch.data(), DType::f8e4m3, {10, 64});
  a.x.scales = Tensor::wrap(g_scratch.data() + 4096, DType::i32, {10, 1});
  f.bad_dispatch(a, {"(data, scales) tuple must be one of", "got (f8e4m3[10, 64], i32[10, 1])"});
}
ERROR_CASE("quant_mode_bf16_needs_bf16") {
  Fixture f(ctx);
  auto a = f.args();
  std::vector<float> x(640);
  a.x.data = Tensor::wrap(x.data(), DType::f32, {10, 64});
  a.quant_mode = QuantMode::bf16;
  f.bad_dispatch(a, {"quant_mode = bf16 requires x of dtype bf16, got f32"});
}
ERROR_CASE("config_chunks") {
  Fixture f(ctx);
  auto a = f.args();
  Config c;
  c.num_max_nvl_chunked_send_tokens = 512;
  a.config = c;
  f.bad_dispatch(
      a,
      {"config.num_max_nvl_chunked_send_tokens: expected <= num_max_nvl_chunked_recv_tokens = 256, got 512"});
}
ERROR_CASE("cost_stats_shape") {
  Fixture f(ctx);
  auto a = f.args();
  std::vector<int64_t> st(ctx.size + 1);
  a.dispatch_wait_recv_cost_stats = Tensor::wrap(st.data(), DType::i64, {ctx.size + 1});
  f.bad_dispatch(a, {"dispatch_wait_recv_cost_stats: shape"});
}
ERROR_CASE("cached_with_topk") {
  Fixture f(ctx);
  auto d = f.ok();
  auto a = f.args();
  a.handle = d.handle;
  f.bad_dispatch(a, {"topk_idx must be None for a cached dispatch"});
}
ERROR_CASE("cached_wrong_rows") {
  Fixture f(ctx);
  auto d = f.ok();
  DispatchArgs a;
  a.handle = d.handle;
  a.x.data = Tensor::wrap(g_scratch.data(), DType::bf16, {9, 64});
  f.bad_dispatch(a, {"x: rows must equal handle.num_tokens", "9", "10"});
}
ERROR_CASE("combine_x_rows") {
  Fixture f(ctx);
  auto d = f.ok();
  CombineArgs c;
  c.handle = d.handle;
  c.x = Tensor::wrap(g_scratch.data(), DType::bf16, {d.handle->num_rows() + 1, 64});
  expect_error([&] { f.buf.combine(c); }, ErrorCode::InvalidUsage, {"x: shape", "[handle.num_rows, hidden]"});
  c.x = d.recv_x.data;
  f.buf.combine(c);
}
ERROR_CASE("combine_bias_shape") {
  Fixture f(ctx);
  auto d = f.ok();
  CombineArgs c;
  c.handle = d.handle;
  c.x = d.recv_x.data;
  c.bias = Tensor::wrap(g_scratch.data(), DType::bf16, {10, 65});
  expect_error([&] { f.buf.combine(c); }, ErrorCode::InvalidUsage,
               {"bias: shape [10, 65], expected [10, 64]"});
  c.bias = Tensor::wrap(g_scratch.data(), DType::f16, {10, 64});
  expect_error([&] { f.buf.combine(c); }, ErrorCode::InvalidUsage,
               {"bias: dtype f16, expected x's dtype bf16"});
}
ERROR_CASE("combine_topk_weights_shape") {
  Fixture f(ctx);
  auto d = f.ok();
  CombineArgs c;
  c.handle = d.handle;
  c.x = d.recv_x.data;
  c.topk_weights = Tensor::wrap(g_scratch.data(), DType::f32, {10, 4});
  expect_error([&] { f.buf.combine(c); }, ErrorCode::InvalidUsage,
               {"topk_weights: shape [10, 4], expected [10, 3]"});
}
ERROR_CASE("handle_of_other_buffer") {
  Fixture f(ctx);
  auto d = f.ok();
  Buffer other(ctx.group, test_options(1 << 20, 20));
  CombineArgs c;
  c.handle = d.handle;
  c.x = d.recv_x.data;
  expect_error([&] { other.combine(c); }, ErrorCode::InvalidUsage, {"handle", "another Buffer"});
}
ERROR_CASE("destroyed_buffer") {
  Fixture f(ctx);
  auto d = f.ok();
  f.buf.destroy();
  expect_error([&] { f.buf.dispatch(f.args()); }, ErrorCode::InvalidUsage, {"destroyed"});
}
ERROR_CASE("segment_below_minimum") {
  // The capacity error states this call's minimum; with exactly that many bytes the call succeeds, one byte
  // less fails on every rank; min_nvl_bytes() covers it.
  auto minimum_of = [&](int64_t nvl) -> int64_t {
    Fixture f(ctx, nvl);
    try {
      f.buf.dispatch(f.args());
    } catch (const Error& e) {
      std::string m = e.what();
      const std::string key = "the minimum for this call is ";
      auto pos = m.find(key);
      REQUIRE(e.code() == ErrorCode::InvalidUsage && pos != std::string::npos &&
                  m.find("num_nvl_bytes") != std::string::npos,
              "unexpected error: ", m);
      return std::stoll(m.substr(pos + key.size()));
    }
    return -1;
  };
  const int64_t tiny = min_nvl_bytes(1, 1, ctx.size);  // the smallest segment a Buffer accepts
  const int64_t minimum = minimum_of(tiny);
  REQUIRE(minimum > tiny, "a segment of ", tiny, " bytes must be too small");
  REQUIRE(minimum_of(minimum) == -1, "exactly the minimum must succeed");
  REQUIRE(minimum_of(minimum - 1) == minimum, "one byte below the minimum must fail naming it");
  REQUIRE(min_nvl_bytes(64 * 2, 3, ctx.size) >= minimum, "min_nvl_bytes must cover the call");
}
ERROR_CASE("low_latency_mode") {
  // Low-latency calls need low_latency_mode = true; every rank raises, and the Buffer stays usable.
  Buffer b(ctx.group, test_options(1 << 20));
  LowLatencyDispatchArgs a;
  a.x = empty(DType::bf16, {1, 128});
  a.topk_idx = empty(DType::i64, {1, 1});
  a.topk_idx.data_as<int64_t>()[0] = 0;
  a.num_max_dispatch_tokens_per_rank = 1;
  a.num_experts = ctx.size;
  expect_error([&] { b.low_latency_dispatch(a); }, ErrorCode::InvalidUsage,
               {"low_latency_dispatch", "low_latency_mode"});
  // Ranks that disagree on the mode fail at creation.
  if (ctx.size < 2) return;
  BufferOptions o = test_options(1 << 20);
  o.low_latency_mode = ctx.rank == 1;
  expect_error([&] { Buffer c(ctx.group, o); }, ErrorCode::InvalidUsage,
               {"mismatch", "low_latency_mode", "rank 1 = 1"});
}
ERROR_CASE("num_nvl_bytes_differ") {
  if (ctx.size < 2) throw Skip("needs 2 ranks");
  BufferOptions o = test_options((1 << 20) + 4096 * ctx.rank);
  expect_error([&] { Buffer b(ctx.group, o); }, ErrorCode::InvalidUsage,
               {"mismatch", "num_nvl_bytes", "rank 1 = "});
}
ERROR_CASE("quant_mode_unknown_name") {
  expect_error([&] { parse_quant_mode("fp7"); }, ErrorCode::InvalidUsage,
               {"quant_mode", "mx_fp4_e2m1", "'fp7'"});
  expect_error([&] { parse_receive_order("token_major"); }, ErrorCode::InvalidUsage,
               {"receive_order", "'token_major'"});
}

// tools/epcomm/demo_ll.cc — `epcomm demo --api low-latency`: a decode loop of one MoE layer over several
// steps through low_latency_dispatch / low_latency_combine (docs/low-latency.md), every step checked
// against a dense single-process reference, with the communication latency of each step.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "epcomm/buffer.h"
#include "flags.h"
#include "moe_model.h"
#include "numerics.h"
#include "rank_tools.h"
#include "report.h"
#include "run_options.h"
#include "subcommands.h"

namespace epcomm::cli {
namespace {

const char* kEpilog =
    "What it does: every rank holds --experts / ranks experts (SwiGLU, fp32 math). At each decode step "
    "every\n"
    "rank regenerates a batch of at most --tokens tokens from --seed and the step (batch sizes vary per "
    "step\n"
    "and rank, some are empty), routes them (softmax, top-k, weights renormalized), calls "
    "low_latency_dispatch\n"
    "(bf16 rows, or with --fp8 e4m3 codes per 128 channels), applies its experts to the rows of each local\n"
    "expert's block, writes the outputs into get_next_low_latency_combine_buffer (zero copy) and calls\n"
    "low_latency_combine:  out = round(sum_k w_k expert_k(x)).\n"
    "Rank 0 computes every step densely from the same (dequantized) token values and compares element by\n"
    "element within 2u(sum_k w_k|y_k| + |out|), u the bf16 unit roundoff. The per-step time is the slowest\n"
    "rank's dispatch + combine (expert computation excluded).\n\n"
    "Exit status: 0 PASS, 1 FAIL or a runtime error, 2 a bad flag or an argument the library rejected.\n";

struct DemoLlOptions {
  int ranks = 4, experts = 8, topk = 2, steps = 4;
  int64_t tokens = 8, hidden = 256, intermediate = 128;
  bool fp8 = false;
  uint64_t seed = 1;
  LaunchFlags launch;
  MoeShape shape() const { return {hidden, intermediate, experts, topk}; }
};

// Rank r's batch at step `step`: between T_max - 2 and T_max tokens (at least 0).
struct Batch {
  int64_t T = 0;
  std::vector<std::byte> x;  // [T, H] bf16
  std::vector<int64_t> ids;  // [T, K]
  std::vector<float> weights;
};

Batch make_batch(const DemoLlOptions& o, int r, int step) {
  Batch b;
  b.T = std::max<int64_t>(0, o.tokens - (step + r) % 3);
  const int64_t H = o.hidden;
  const size_t row = static_cast<size_t>(H) * 2;
  b.x.resize(static_cast<size_t>(b.T) * row);
  b.ids.resize(static_cast<size_t>(b.T) * o.topk);
  b.weights.resize(b.ids.size());
  Router router(o.seed, o.shape());
  std::vector<float> xf(static_cast<size_t>(H));
  for (int64_t t = 0; t < b.T; ++t) {
    make_token(o.seed + 7919 * static_cast<uint64_t>(step), r, t, H, DType::bf16, b.x.data() + t * row);
    load_row(DType::bf16, b.x.data() + t * row, H, xf.data());
    router.route(xf.data(), b.ids.data() + t * o.topk, b.weights.data() + t * o.topk);
  }
  return b;
}

std::optional<QuantMode> quant_of(const DemoLlOptions& o) {
  return o.fp8 ? std::optional<QuantMode>(QuantMode::pergroup_fp8_e4m3) : std::nullopt;
}

// Row i of local expert j's block as fp32: bf16 converts; fp8 dequantizes with its column of scales.
void block_row_f32(const DemoLlOptions& o, const LowLatencyDispatchResult& d, int j, int64_t i, float* out) {
  const int64_t H = o.hidden, RT = d.recv_x.size(1);
  const size_t elem = dtype_size(d.recv_x.dtype());
  auto* row = d.recv_x.data_as<std::byte>() + (static_cast<size_t>(j) * RT + i) * H * elem;
  if (!o.fp8) return load_row(DType::bf16, row, H, out);
  const int64_t G = H / 128;
  std::vector<float> s(static_cast<size_t>(G));
  const float* cols = d.recv_scales->data_as<float>() + static_cast<size_t>(j) * G * RT;
  for (int64_t g = 0; g < G; ++g) s[g] = cols[g * RT + i];
  Payload p{Tensor::wrap(row, DType::f8e4m3, {1, H}), Tensor::wrap(s.data(), DType::f32, {1, G})};
  recv_row_f32(p, quant_of(o), H, 0, out);
}

// The experts over the valid rows of each local expert's block, written as bf16 into `y` [L, R*T_max, H].
void run_experts(const DemoLlOptions& o, int r, const LowLatencyDispatchResult& d, const Tensor& y) {
  const int64_t H = o.hidden, RT = d.recv_x.size(1);
  const int L = static_cast<int>(d.recv_x.size(0));
  for (int j = 0; j < L; ++j) {
    const int64_t n = d.recv_count.data_as<int32_t>()[j];
    if (n == 0) continue;
    std::vector<float> xin(static_cast<size_t>(n * H)), yout(static_cast<size_t>(n * H));
    for (int64_t i = 0; i < n; ++i) block_row_f32(o, d, j, i, xin.data() + i * H);
    Expert(o.seed, r * L + j, o.shape()).forward(xin.data(), n, yout.data());
    store_row(DType::bf16, yout.data(), n * H, y.data_as<std::byte>() + static_cast<size_t>(j) * RT * H * 2);
  }
}

// One step on this rank: returns the combined output [T, H] bf16 and the communication seconds.
std::vector<std::byte> decode_step(const DemoLlOptions& o, Buffer& buffer, int r, const Batch& b,
                                   double& secs) {
  LowLatencyDispatchArgs a;
  a.x = Tensor::wrap(const_cast<std::byte*>(b.x.data()), DType::bf16, {b.T, o.hidden});
  a.topk_idx = Tensor::wrap(const_cast<int64_t*>(b.ids.data()), DType::i64, {b.T, o.topk});
  a.num_max_dispatch_tokens_per_rank = o.tokens;
  a.num_experts = o.experts;
  a.use_fp8 = o.fp8;
  double t0 = now_s();
  LowLatencyDispatchResult d = buffer.low_latency_dispatch(a);
  secs = now_s() - t0;
  Tensor y = buffer.low_latency_combine_buffer(*d.handle);
  run_experts(o, r, d, y);
  LowLatencyCombineArgs c;
  c.x = y;
  c.handle = d.handle;
  c.topk_idx = a.topk_idx;
  c.topk_weights = Tensor::wrap(const_cast<float*>(b.weights.data()), DType::f32, {b.T, o.topk});
  t0 = now_s();
  Tensor out = buffer.low_latency_combine(c).combined_x;
  secs += now_s() - t0;
  return std::vector<std::byte>(out.data_as<std::byte>(), out.data_as<std::byte>() + out.nbytes());
}

// Rank 0: the dense layer on every rank's batch of `step`, compared with `all` (each rank's output in turn).
struct Check {
  int64_t checked = 0, failures = 0;
  double max_err = 0, worst = 0;
};

void check_step(const DemoLlOptions& o, int step, const std::vector<std::vector<std::byte>>& all, Check& c) {
  const int64_t H = o.hidden;
  const double u = unit_roundoff(DType::bf16);
  std::vector<float> xs(static_cast<size_t>(H)), y(static_cast<size_t>(H));
  for (int s = 0; s < o.ranks; ++s) {
    const Batch b = make_batch(o, s, step);
    for (int64_t t = 0; t < b.T; ++t) {
      seen_token_f32(quant_of(o), DType::bf16, b.x.data() + t * H * 2, H, xs.data());
      std::vector<double> ref(static_cast<size_t>(H), 0.0), mag(static_cast<size_t>(H), 0.0);
      for (int k = 0; k < o.topk; ++k) {
        Expert(o.seed, static_cast<int>(b.ids[t * o.topk + k]), o.shape()).forward(xs.data(), 1, y.data());
        const float w = b.weights[t * o.topk + k];
        for (int64_t h = 0; h < H; ++h) {
          const double v = round_to(DType::bf16, y[h]);
          ref[h] += w * v;
          mag[h] += std::fabs(w * v);
        }
      }
      for (int64_t h = 0; h < H; ++h) {
        const double err = std::fabs(load_elem(DType::bf16, all[s].data(), t * H + h) - ref[h]);
        const double tol = 2 * u * (mag[h] + std::fabs(ref[h])) + 1e-30;
        c.max_err = std::max(c.max_err, err);
        c.worst = std::max(c.worst, err / tol);
        c.failures += err > tol;
        ++c.checked;
      }
    }
  }
}

int demo_rank_ll(const DemoLlOptions& o, std::unique_ptr<Bootstrap> bootstrap) {
  auto group = Group::create(std::move(bootstrap));
  const int r = group->rank();
  Bootstrap& bs = group->bootstrap();
  Progress progress("epcomm demo", r == 0 && !o.launch.quiet);
  BufferOptions bo;
  bo.low_latency_mode = true;
  bo.timeout_s = o.launch.timeout_s;
  bo.num_rdma_bytes = Buffer::get_low_latency_rdma_size_hint(o.tokens, o.hidden, o.ranks, o.experts);
  Buffer buffer(group, bo);
  std::vector<double> step_us;
  std::vector<std::vector<std::vector<std::byte>>> outputs;  // rank 0: [step][rank], checked at the end
  for (int step = 0; step < o.steps; ++step) {
    progress.phase("decode step " + std::to_string(step));
    bs.barrier();  // every rank starts the step together
    double secs = 0;
    std::vector<std::byte> out = decode_step(o, buffer, r, make_batch(o, r, step), secs);
    const size_t slot = static_cast<size_t>(o.tokens * o.hidden * 2);  // outputs padded to T_max rows
    out.resize(slot);
    const auto times = all_gather_values(bs, std::vector<double>{secs});
    const auto gathered = all_gather_values(bs, out);
    if (r != 0) continue;
    step_us.push_back(*std::max_element(times.begin(), times.end()) * 1e6);
    auto& all = outputs.emplace_back();
    for (int s = 0; s < o.ranks; ++s)
      all.emplace_back(gathered.begin() + s * slot, gathered.begin() + (s + 1) * slot);
  }
  if (r != 0) return kExitOk;
  progress.phase("dense reference");
  Check check;
  for (size_t step = 0; step < outputs.size(); ++step)
    check_step(o, static_cast<int>(step), outputs[step], check);
  std::printf(
      "epcomm demo --api low-latency: %d ranks, %d experts (%d per rank), top-%d, T_max %lld, H %lld, %s\n",
      o.ranks, o.experts, o.experts / o.ranks, o.topk, static_cast<long long>(o.tokens),
      static_cast<long long>(o.hidden), o.fp8 ? "fp8 e4m3 per 128 channels" : "bf16");
  for (size_t s = 0; s < step_us.size(); ++s)
    std::printf("  step %zu: dispatch + combine %.0f us (slowest rank)\n", s, step_us[s]);
  std::printf(
      "  checked %lld elements against the dense reference: max |err| %.3g, worst err/tolerance %.3g\n",
      static_cast<long long>(check.checked), check.max_err, check.worst);
  std::printf("%s\n", check.failures == 0 ? "PASS" : "FAIL");
  std::fflush(stdout);
  return check.failures == 0 ? kExitOk : kExitFail;
}

DemoLlOptions parse_options(FlagParser& p) {
  DemoLlOptions o;
  o.ranks = static_cast<int>(p.integer("ranks", 1, 1024));
  o.tokens = p.integer("tokens", 1, 1 << 16);
  o.hidden = p.integer("hidden", 1, 1 << 16);
  o.intermediate = p.integer("intermediate", 1, 1 << 16);
  o.experts = static_cast<int>(p.integer("experts", 1, 4096));
  o.topk = static_cast<int>(p.integer("topk", 1, 32));
  o.steps = static_cast<int>(p.integer("steps", 1, 1 << 20));
  o.fp8 = p.on("fp8");
  o.seed = static_cast<uint64_t>(p.integer("seed", 0, INT64_MAX));
  o.launch = read_launch_flags(p);
  if (o.experts % o.ranks != 0)
    throw UsageError(
        bad_value("experts", "a multiple of ranks = " + std::to_string(o.ranks), std::to_string(o.experts)));
  if (o.topk > o.experts) throw UsageError(bad_value("topk", "<= experts", std::to_string(o.topk)));
  if (o.fp8 && o.hidden % 128 != 0)
    throw UsageError(bad_value("hidden", "a multiple of 128 with --fp8", std::to_string(o.hidden)));
  return o;
}

}  // namespace

int run_demo_ll(int argc, char** argv) {
  FlagParser p(
      "epcomm demo --api low-latency", "epcomm demo --api low-latency [flags]",
      "A decode loop of one MoE layer through low_latency_dispatch / low_latency_combine, every step\n"
      "checked against a dense reference (PASS/FAIL), with the latency of each step.");
  p.add("api", "NAME", "normal", "low-latency selects this demo");
  p.add("ranks", "N", "4", "local ranks");
  p.add("tokens", "T", "8", "num_max_dispatch_tokens_per_rank (batches hold T_max - 2 to T_max tokens)");
  p.add("hidden", "H", "256", "hidden size");
  p.add("intermediate", "I", "128", "expert inner width");
  p.add("experts", "E", "8", "experts (a multiple of ranks)");
  p.add("topk", "K", "2", "experts per token (1 to 32)");
  p.add("steps", "N", "4", "decode steps");
  p.add_switch("fp8", "dispatch e4m3 codes per 128 channels (use_fp8; hidden % 128 == 0)");
  p.add("seed", "S", "1", "random seed");
  add_launch_flags(p);
  p.set_epilog(kEpilog);
  if (!p.parse(argc, argv)) {
    std::fputs(p.help().c_str(), stdout);
    return kExitOk;
  }
  const DemoLlOptions o = parse_options(p);
  const RunOptions ro = launch_options(o.launch, o.ranks);
  return run_ranks("epcomm demo", ro,
                   [&](std::unique_ptr<Bootstrap> bs) { return demo_rank_ll(o, std::move(bs)); });
}

}  // namespace epcomm::cli

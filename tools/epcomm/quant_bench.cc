// tools/epcomm/quant_bench.cc — the quantizer throughput benchmark of quant_bench.h.
#include "quant_bench.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <random>

#include "common/check.h"
#include "quant/block.h"
#include "quant/element.h"

namespace epcomm::cli {
using namespace quant;  // the algorithms under test, by their spec names

namespace {

double best_seconds(int iters, const std::function<void()>& pass) {
  double best = 1e30;
  for (int it = 0; it < iters; ++it) {
    auto t0 = std::chrono::steady_clock::now();
    pass();
    std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
    best = std::min(best, dt.count());
  }
  return best;
}

}  // namespace

std::vector<QuantBenchResult> run_quant_benchmark(int64_t rows, int64_t hidden, int iters) {
  EPCOMM_CHECK_GT(rows, 0, "rows must be positive");
  EPCOMM_CHECK_GT(hidden, 0, "hidden must be positive");
  EPCOMM_CHECK_GT(iters, 0, "iters must be positive");
  const size_t n = static_cast<size_t>(rows * hidden);
  const int64_t H = hidden;
  std::vector<uint16_t> x(n);
  std::mt19937 rng(12345);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (auto& v : x) v = to_bf16_bits(dist(rng));
  std::vector<uint8_t> codes(n);
  std::vector<float> fscales(static_cast<size_t>(rows * ((H + 7) / 8)));
  std::vector<uint8_t> bscales(static_cast<size_t>(rows * ((H + 31) / 32)));
  std::vector<uint16_t> hscales(static_cast<size_t>(rows * ((H + 7) / 8)));
  std::vector<float> out(n);
  std::vector<float> smooth(static_cast<size_t>(H), 0.75f);
  const double bytes = static_cast<double>(n) * 2.0;
  const int64_t G = (H + 127) / 128, B = (H + 31) / 32, C = (H + 7) / 8;

  auto xr = [&](int64_t r) { return x.data() + r * H; };
  auto cr = [&](int64_t r) { return codes.data() + r * H; };
  auto qr = [&](int64_t r) { return reinterpret_cast<int8_t*>(codes.data()) + r * H; };
  std::vector<QuantBenchResult> res;
  auto add = [&](const std::string& name, const std::function<void(int64_t)>& row) {
    double s = best_seconds(iters, [&] {
      for (int64_t r = 0; r < rows; ++r) row(r);
    });
    res.push_back({name, bytes / s / 1e9});
  };
  const DType bf = DType::bf16;
  const Smoothing none = Smoothing::none();

  add("int8_per_token_a3", [&](int64_t r) { int8_per_token_a3(bf, xr(r), H, none, qr(r), &fscales[r]); });
  add("int8_per_token_a3.smooth", [&](int64_t r) {
    int8_per_token_a3(bf, xr(r), H, Smoothing::vector(smooth.data()), qr(r), &fscales[r]);
  });
  add("int8_per_token_a3.dequant",
      [&](int64_t r) { dequant_int8_per_token(qr(r), fscales[r], H, out.data() + r * H); });
  add("int8_per_token_950", [&](int64_t r) { int8_per_token_950(bf, xr(r), H, none, qr(r), &fscales[r]); });
  for (Fp8Format f : {Fp8Format::e4m3, Fp8Format::e5m2}) {
    std::string sfx = f == Fp8Format::e4m3 ? "_e4m3" : "_e5m2";
    add("fp8_per_token" + sfx, [&](int64_t r) { fp8_per_token(f, bf, xr(r), H, none, cr(r), &fscales[r]); });
    add("fp8_per_token" + sfx + ".dequant",
        [&](int64_t r) { dequant_fp8_per_token(f, cr(r), fscales[r], H, out.data() + r * H); });
  }
  add("fp8_per_group128_e4m3",
      [&](int64_t r) { fp8_per_group128(Fp8Format::e4m3, bf, xr(r), H, none, cr(r), &fscales[r * G]); });
  add("fp8_per_group128_e4m3.dequant", [&](int64_t r) {
    dequant_fp8_per_group128(Fp8Format::e4m3, cr(r), &fscales[r * G], H, out.data() + r * H);
  });
  add("fp8_per_group128_e4m3.ue8m0", [&](int64_t r) {
    fp8_per_group128(Fp8Format::e4m3, bf, xr(r), H, none, cr(r), &bscales[r * G], {true, true});
  });
  add("fp8_per_group128_a3_e4m3",
      [&](int64_t r) { fp8_per_group128_a3(Fp8Format::e4m3, bf, xr(r), H, none, cr(r), &fscales[r * G]); });
  const std::pair<MxElem, const char*> mx[] = {
      {MxElem::e4m3, "mxfp8_e4m3"}, {MxElem::e5m2, "mxfp8_e5m2"}, {MxElem::e2m1, "mxfp4_e2m1"}};
  for (auto [e, name] : mx) {
    if (e == MxElem::e2m1 && H % 2 != 0) continue;  // f4x2 packs pairs
    auto codes_of = [&, e = e](int64_t r) { return e == MxElem::e2m1 ? codes.data() + r * H / 2 : cr(r); };
    add(name, [&, e = e](int64_t r) {
      mx_quantize(e, ScaleRule::floor, bf, xr(r), H, codes_of(r), &bscales[r * B]);
    });
    add(std::string(name) + ".rceil", [&, e = e](int64_t r) {
      mx_quantize(e, ScaleRule::rceil, bf, xr(r), H, codes_of(r), &bscales[r * B]);
    });
    add(std::string(name) + ".dequant",
        [&, e = e](int64_t r) { dequant_mx(e, codes_of(r), &bscales[r * B], H, out.data() + r * H); });
  }
  add("int8_static", [&](int64_t r) { int8_static(bf, xr(r), H, Smoothing::vector(smooth.data()), qr(r)); });
  add("hif8_static", [&](int64_t r) { hif8_static(bf, xr(r), H, Smoothing::vector(smooth.data()), cr(r)); });
  add("int8_group8_combine", [&](int64_t r) { int8_group8_combine(bf, xr(r), H, qr(r), &hscales[r * C]); });
  add("int8_group8_combine.dequant", [&](int64_t r) {
    int8_group8_combine_dequant(bf, qr(r), &hscales[r * C], H,
                                reinterpret_cast<uint16_t*>(out.data()) + r * H);
  });
  return res;
}

}  // namespace epcomm::cli

// tools/epcomm/quant_bench.h — `epcomm bench --quantizers`: single-thread throughput of every block quantizer
// and dequantizer of the library (quant/block.h) on bf16 input (docs/quant.md). A measurement, not a test: it
// never asserts anything. It lives in the tool, not the library: it only calls quant/block.h.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace epcomm::cli {

struct QuantBenchResult {
  // Spec algorithm name (with its element format where the spec leaves it open, e.g. "fp8_per_token_e4m3");
  // "<name>.<variant>" for a non-default option ("smooth", "ue8m0", "rceil"); "<name>.dequant" for the
  // inverse (fp32 out). `epcomm bench --quantizers` splits names at the first '.'.
  std::string algo;
  double gbps_bf16_in;  // GB/s (1e9 bytes) of bf16 input, rows * hidden * 2 bytes per pass, one core
};

// Quantizes (and dequantizes) a rows x hidden bf16 matrix of seeded random values `iters` times per algorithm
// on the calling thread and reports the best pass. Throws Error(InvalidUsage) for non-positive arguments;
// mxfp4 is skipped for an odd hidden.
std::vector<QuantBenchResult> run_quant_benchmark(int64_t rows, int64_t hidden, int iters);

}  // namespace epcomm::cli

// tools/epcomm/bench_baseline_nompi.cc — bench_baseline.h in a build without MPI (tools/epcomm/CMakeLists.txt
// picks this file or bench_baseline.cc): no MPI bootstrap and no baseline; the bench prints its fields as
// null.
#include "bench_baseline.h"
#include "flags.h"

namespace epcomm::cli {

namespace {
const char* kNoMpi =
    "--bootstrap mpi: this build of epcomm has no MPI (CMake found no MPI C++ library; install Open MPI,\n"
    "e.g. libopenmpi-dev openmpi-bin, and reconfigure)";
}  // namespace

bool have_mpi() {
  return false;
}

std::unique_ptr<Bootstrap> make_world_bootstrap(std::chrono::milliseconds) {
  throw UsageError(kNoMpi);
}

struct AlltoallvBaseline::State {};

AlltoallvBaseline::AlltoallvBaseline(const BaselineInputs&) {
  throw UsageError(kNoMpi);
}
AlltoallvBaseline::~AlltoallvBaseline() = default;
void AlltoallvBaseline::dispatch() {}
void AlltoallvBaseline::dispatch_cached() {}
void AlltoallvBaseline::combine(const std::byte*, const float*) {}
int64_t AlltoallvBaseline::num_rows() const {
  return 0;
}
const std::byte* AlltoallvBaseline::recv_x() const {
  return nullptr;
}
const int64_t* AlltoallvBaseline::recv_topk_idx() const {
  return nullptr;
}
const float* AlltoallvBaseline::recv_topk_weights() const {
  return nullptr;
}
const std::vector<int64_t>& AlltoallvBaseline::num_recv_tokens_per_expert_list() const {
  static const std::vector<int64_t> none;
  return none;
}
const std::byte* AlltoallvBaseline::combined_x() const {
  return nullptr;
}
const float* AlltoallvBaseline::combined_topk_weights() const {
  return nullptr;
}

}  // namespace epcomm::cli

// examples/quickstart.cc — the README's example: 4 forked ranks dispatch tokens to their top-2 experts
// and combine the (identity) expert outputs back. Built and run by the test suite (example.quickstart).
#include <cmath>
#include <cstdio>
#include <vector>

#include "epcomm/buffer.h"
#include "epcomm/launch.h"

int main() {
  auto results = epcomm::launch_local(4, [](std::unique_ptr<epcomm::Bootstrap> bootstrap) -> int {
    auto group = epcomm::Group::create(std::move(bootstrap));
    epcomm::Buffer buffer(group);  // collective; 64 MiB shared-memory segment per rank

    const int64_t T = 8, H = 16, K = 2, E = 8;  // tokens, hidden, top-k, experts (2 per rank)
    std::vector<float> x(T * H), w(T * K, 0.5f);
    std::vector<int64_t> ids(T * K);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < H; ++h) x[t * H + h] = float(group->rank() * 100 + t);
      ids[t * K + 0] = (t + group->rank()) % E;
      ids[t * K + 1] = (t + 3) % E == ids[t * K] ? -1 : (t + 3) % E;  // -1: no expert in this slot
    }
    auto topk_idx = epcomm::Tensor::wrap(ids.data(), epcomm::DType::i64, {T, K});
    auto layout = buffer.get_dispatch_layout(topk_idx, E);

    epcomm::DispatchArgs args;
    args.x.data = epcomm::Tensor::wrap(x.data(), epcomm::DType::f32, {T, H});
    args.topk_idx = topk_idx;
    args.topk_weights = epcomm::Tensor::wrap(w.data(), epcomm::DType::f32, {T, K});
    args.num_tokens_per_expert = layout.num_tokens_per_expert;
    epcomm::DispatchResult d = buffer.dispatch(args);  // one row per (token, expert) on the expert's rank

    // The "experts" return their rows unchanged; combine weights them and sums them on the origin rank.
    epcomm::CombineArgs c;
    c.x = d.recv_x.data;
    c.handle = d.handle;
    epcomm::CombineResult out = buffer.combine(c);

    for (int64_t t = 0; t < T; ++t) {
      float expected = x[t * H] * (ids[t * K + 1] >= 0 ? 1.0f : 0.5f);  // sum of the valid weights
      if (out.combined_x.data_as<float>()[t * H] != expected) {
        std::fprintf(stderr, "rank %d token %ld: got %f, expected %f\n", group->rank(), long(t),
                     out.combined_x.data_as<float>()[t * H], expected);
        return 1;
      }
    }
    std::printf("rank %d: received %ld rows, combine correct\n", group->rank(), long(d.recv_x.data.size(0)));
    return 0;
  });
  for (const auto& r : results)
    if (r.exit_code != 0) return 1;
  return 0;
}

// examples/consumer/round_trip.h — the body of one rank, shared by main.cc (forked ranks) and mpi_main.cc
// (mpirun): 4 tokens per rank, each sent to 2 of 4 experts, dispatched and combined unchanged, so that every
// token comes back as its row times the sum of its weights (0.75). Returns the rank's exit code.
#pragma once

#include <cstdio>
#include <memory>
#include <vector>

#include "epcomm/buffer.h"
#include "epcomm/version.h"

inline int round_trip(std::unique_ptr<epcomm::Bootstrap> bootstrap) {
  auto group = epcomm::Group::create(std::move(bootstrap));
  epcomm::Buffer buffer(group);
  const int64_t T = 4, H = 8, K = 2, E = 4;
  std::vector<float> x(T * H), w(T * K);
  std::vector<int64_t> ids(T * K);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) x[t * H + h] = float(group->rank() * 1000 + t * 10 + h);
    ids[t * K] = t % E;
    ids[t * K + 1] = (t + 1) % E;
    w[t * K] = 0.25f;
    w[t * K + 1] = 0.5f;
  }
  auto topk_idx = epcomm::Tensor::wrap(ids.data(), epcomm::DType::i64, {T, K});
  auto layout = buffer.get_dispatch_layout(topk_idx, E);
  epcomm::DispatchArgs args;
  args.x.data = epcomm::Tensor::wrap(x.data(), epcomm::DType::f32, {T, H});
  args.topk_idx = topk_idx;
  args.topk_weights = epcomm::Tensor::wrap(w.data(), epcomm::DType::f32, {T, K});
  args.num_tokens_per_expert = layout.num_tokens_per_expert;
  epcomm::DispatchResult d = buffer.dispatch(args);
  epcomm::CombineArgs c;
  c.x = d.recv_x.data;
  c.handle = d.handle;
  epcomm::CombineResult out = buffer.combine(c);
  const float* y = out.combined_x.data_as<float>();
  for (int64_t i = 0; i < T * H; ++i) {
    if (y[i] != x[i] * 0.75f) {
      std::fprintf(stderr, "rank %d element %ld: got %g, expected %g\n", group->rank(), long(i), y[i],
                   x[i] * 0.75f);
      return 1;
    }
  }
  std::printf("rank %d: epcomm %s, %ld rows received, combine correct\n", group->rank(), epcomm::version(),
              long(d.recv_x.data.size(0)));
  return 0;
}

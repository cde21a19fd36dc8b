// tools/epcomm/bench_verify.cc — bench inputs from the seed, and the check of one dispatch and one combine.
// The expected values come from plain loops over every rank's regenerated routing; nothing is shared with
// the library except the quantizers (whose bytes a quantized dispatch must carry unchanged).
#include "bench_verify.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <sstream>

#include "numerics.h"
#include "quant/row.h"

namespace epcomm::cli {

namespace {

struct RecvRow {
  int s;      // -1 for a PAD row
  int64_t t;  // -1 for a PAD row
  int k;      // -1 in rank_major and for a PAD row
};

std::string row_str(int64_t i, const RecvRow& e) {
  std::ostringstream os;
  os << "row " << i << " (source rank " << e.s << ", token " << e.t << ", slot " << e.k << ")";
  return os.str();
}

// The rows rank r must receive, in order (docs/normal-mode.md expert_major with its PAD rows,
// docs/normal-mode.md rank_major).
std::vector<RecvRow> expected_rows(const RunOptions& o, ReceiveOrder order, int r,
                                   const std::vector<Routing>& all) {
  const int L = o.local_experts(), K = o.topk;
  std::vector<RecvRow> rows;
  if (order == ReceiveOrder::expert_major) {
    for (int j = 0; j < L; ++j) {
      const size_t block = rows.size();
      for (int s = 0; s < o.ranks; ++s)
        for (int64_t t = 0; t < o.tokens; ++t)
          for (int k = 0; k < K; ++k)
            if (all[s].ids[t * K + k] == r * L + j) rows.push_back({s, t, k});
      while ((rows.size() - block) % o.expert_alignment != 0) rows.push_back({-1, -1, -1});
    }
  } else {
    for (int s = 0; s < o.ranks; ++s)
      for (int64_t t = 0; t < o.tokens; ++t)
        for (int k = 0; k < K; ++k)
          if (all[s].ids[t * K + k] / L == r) {
            rows.push_back({s, t, -1});
            break;
          }
  }
  return rows;
}

bool same_bits(float a, float b) {
  return std::memcmp(&a, &b, 4) == 0;
}

// recv_topk_idx and recv_topk_weights of one row.
std::string check_row_topk(const RunOptions& o, ReceiveOrder order, int r, int64_t i, const RecvRow& e,
                           const Routing& src, const DispatchResult& d) {
  const int K = o.topk, L = o.local_experts();
  const int64_t* ids = d.recv_topk_idx->data_as<int64_t>() + i * K;
  const float* w = d.recv_topk_weights->data_as<float>() + i * K;
  for (int k = 0; k < K; ++k) {
    const int64_t v = src.ids[e.t * K + k];
    const bool mine = order == ReceiveOrder::expert_major ? k == e.k : v / L == r;
    const int64_t want_id = mine ? v - r * L : -1;
    const float want_w = mine ? src.weights[e.t * K + k] : 0.0f;
    if (ids[k] != want_id || !same_bits(w[k], want_w)) {
      std::ostringstream os;
      os << row_str(i, e) << ": recv_topk_idx/weights slot " << k << " = " << ids[k] << "/" << w[k]
         << ", expected " << want_id << "/" << want_w;
      return os.str();
    }
  }
  return "";
}

// Payload of one row: the source token's bytes, or its quantized bytes.
std::string check_row_payload(const RunOptions& o, int64_t i, const RecvRow& e, const DispatchResult& d,
                              std::vector<std::byte>& token, std::vector<std::byte>& data,
                              std::vector<std::byte>& scales) {
  const int64_t H = o.hidden;
  make_token(o.seed, e.s, e.t, H, o.dtype, token.data());
  const std::byte* got = static_cast<const std::byte*>(d.recv_x.data.data());
  if (!d.recv_x.scales) {
    if (std::memcmp(got + i * token.size(), token.data(), token.size()) != 0)
      return row_str(i, e) + ": payload differs from the source token";
    return "";
  }
  quant::quantize_row(*o.quant, o.dtype, token.data(), H, data.data(), scales.data());
  const std::byte* got_scales = static_cast<const std::byte*>(d.recv_x.scales->data());
  if (std::memcmp(got + i * data.size(), data.data(), data.size()) != 0 ||
      std::memcmp(got_scales + i * scales.size(), scales.data(), scales.size()) != 0)
    return row_str(i, e) + ": quantized payload differs from the quantized source token";
  return "";
}

// A PAD row (docs/normal-mode.md): payload bytes (data and scales) zero, recv_topk_idx all -1, weights +0.0.
std::string check_pad_row(const RunOptions& o, int64_t i, const DispatchResult& d) {
  const int K = o.topk;
  const int64_t rows = d.recv_x.data.size(0);
  auto zero = [rows](const Tensor& t, int64_t i) {  // MX scales may be flat: bytes per row from the row count
    const size_t n = t.nbytes() / static_cast<size_t>(rows);
    const std::byte* p = static_cast<const std::byte*>(t.data()) + i * n;
    return std::all_of(p, p + n, [](std::byte b) { return b == std::byte{0}; });
  };
  if (!zero(d.recv_x.data, i) || (d.recv_x.scales && !zero(*d.recv_x.scales, i)))
    return "PAD row " + std::to_string(i) + ": payload not zero";
  for (int k = 0; k < K; ++k)
    if (d.recv_topk_idx->data_as<int64_t>()[i * K + k] != -1 ||
        !same_bits(d.recv_topk_weights->data_as<float>()[i * K + k], 0.0f))
      return "PAD row " + std::to_string(i) + ": recv_topk_idx/weights slot " + std::to_string(k) +
             " not -1/+0.0";
  return "";
}

}  // namespace

void bench_route(const RunOptions& o, int s, int64_t t, int64_t* ids, float* weights) {
  const int E = o.experts, K = o.topk;
  const RandomStream pick(o.seed, StreamKind::routing, static_cast<uint64_t>(s));
  const RandomStream weight(o.seed, StreamKind::weights, static_cast<uint64_t>(s));
  // Partial Fisher-Yates over the experts: K distinct, each subset equally likely.
  std::vector<int64_t> perm(static_cast<size_t>(E));
  std::iota(perm.begin(), perm.end(), 0);
  for (int k = 0; k < K; ++k) {
    const uint64_t j = static_cast<uint64_t>(k) + pick.bits(static_cast<uint64_t>(t) * E + k) % (E - k);
    std::swap(perm[k], perm[j]);
    ids[k] = perm[k];
    weights[k] = 0.525f + 0.475f * weight.uniform(static_cast<uint64_t>(t) * K + k);
  }
}

Routing bench_routing(const RunOptions& o, int s) {
  Routing rt;
  rt.ids.resize(static_cast<size_t>(o.tokens * o.topk));
  rt.weights.resize(rt.ids.size());
  for (int64_t t = 0; t < o.tokens; ++t)
    bench_route(o, s, t, rt.ids.data() + t * o.topk, rt.weights.data() + t * o.topk);
  return rt;
}

std::string verify_dispatch(const RunOptions& o, ReceiveOrder order, int r, const DispatchResult& d) {
  std::vector<Routing> all;
  for (int s = 0; s < o.ranks; ++s) all.push_back(bench_routing(o, s));
  const std::vector<RecvRow> rows = expected_rows(o, order, r, all);
  const int64_t n = d.recv_x.data.size(0);
  if (n != static_cast<int64_t>(rows.size()))
    return "recv_x has " + std::to_string(n) + " rows, expected " + std::to_string(rows.size());
  const int L = o.local_experts();
  std::vector<int64_t> cnt(static_cast<size_t>(L), 0);
  for (int s = 0; s < o.ranks; ++s)
    for (int64_t v : all[s].ids)
      if (v / L == r) ++cnt[v % L];
  for (int64_t& c : cnt) c = (c + o.expert_alignment - 1) / o.expert_alignment * o.expert_alignment;
  if (*d.num_recv_tokens_per_expert_list != cnt)
    return "num_recv_tokens_per_expert_list differs from the expected (aligned) counts";

  const Tensor src_rank = d.handle->recv_src_rank(), src_token = d.handle->recv_src_token(),
               src_slot = d.handle->recv_src_slot();
  std::vector<std::byte> token(static_cast<size_t>(o.hidden) * dtype_size(o.dtype)), data, scales;
  if (d.recv_x.scales) {
    data.resize(quant::row_data_bytes(*o.quant, o.hidden));
    scales.resize(quant::row_scale_bytes(*o.quant, o.hidden));
  }
  for (int64_t i = 0; i < n; ++i) {
    const RecvRow& e = rows[i];
    if (src_rank.data_as<int32_t>()[i] != e.s || src_token.data_as<int32_t>()[i] != e.t ||
        src_slot.data_as<int32_t>()[i] != e.k)
      return row_str(i, e) + ": the handle names source rank " +
             std::to_string(src_rank.data_as<int32_t>()[i]) + ", token " +
             std::to_string(src_token.data_as<int32_t>()[i]) + ", slot " +
             std::to_string(src_slot.data_as<int32_t>()[i]);
    if (e.s < 0) {
      if (auto why = check_pad_row(o, i, d); !why.empty()) return why;
      continue;
    }
    if (auto why = check_row_topk(o, order, r, i, e, all[e.s], d); !why.empty()) return why;
    if (auto why = check_row_payload(o, i, e, d, token, data, scales); !why.empty()) return why;
  }
  return "";
}

std::string verify_combine(const RunOptions& o, ReceiveOrder order, int r, const std::vector<std::byte>& x,
                           const Routing& routing, const CombineResult& c) {
  const int64_t T = o.tokens, H = o.hidden;
  const int K = o.topk, L = o.local_experts();
  const double u = unit_roundoff(o.dtype);
  const size_t row_bytes = static_cast<size_t>(H) * dtype_size(o.dtype);
  std::vector<float> seen(static_cast<size_t>(H));
  const float* cw = c.combined_topk_weights ? c.combined_topk_weights->data_as<float>() : nullptr;
  for (int64_t t = 0; t < T; ++t) {
    seen_token_f32(o.quant, o.dtype, x.data() + t * row_bytes, H, seen.data());
    for (float& v : seen) v = round_to(o.dtype, v);  // the combine input is the dtype
    // expert_major: the weights of the slots; rank_major: 1 per destination rank.
    std::vector<float> factors;
    std::vector<bool> rank_seen(static_cast<size_t>(o.ranks), false);
    for (int k = 0; k < K; ++k) {
      const int64_t v = routing.ids[t * K + k];
      if (order == ReceiveOrder::expert_major)
        factors.push_back(routing.weights[t * K + k]);
      else if (!rank_seen[v / L]) {
        rank_seen[v / L] = true;
        factors.push_back(1.0f);
      }
      if (!cw || !same_bits(cw[t * K + k], routing.weights[t * K + k]))
        return "token " + std::to_string(t) + " slot " + std::to_string(k) +
               ": combined_topk_weights missing or not bitwise the dispatched weight";
    }
    const void* got = static_cast<const std::byte*>(c.combined_x.data()) + t * row_bytes;
    for (int64_t h = 0; h < H; ++h) {
      float acc = 0.0f;
      for (float f : factors) acc += f * seen[h];
      const double want = round_to(o.dtype, acc), have = load_elem(o.dtype, got, h);
      if (!(std::fabs(have - want) <= 2 * u * std::fabs(want))) {
        std::ostringstream os;
        os << "rank " << r << " token " << t << " column " << h << ": combined " << have << ", expected "
           << want;
        return os.str();
      }
    }
  }
  return "";
}

}  // namespace epcomm::cli

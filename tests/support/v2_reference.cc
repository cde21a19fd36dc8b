// support/v2_reference.cc — the distribute-v2 reference: problem generation and plain loops from the spec.
#include "support/v2_reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>

#include "quant/block.h"
#include "support/problem.h"
#include "support/ref_float.h"
#include "support/rng.h"

namespace epcomm::testing::v2 {

int64_t V2Spec::capacity(int p) const {
  if (p < shared_ranks) return max_bs() * ((W + R() - 1) / R());
  return G() * std::min(L(), K);
}

bool V2Rank::active_tok(int64_t t, int mask_dims, int K) const {
  if (mask_dims == 1) return mask[t] != 0;
  if (mask_dims == 2) {
    for (int k = 0; k < K; ++k)
      if (mask[t * K + k]) return true;
    return false;
  }
  return true;
}

bool V2Rank::active_slot(int64_t t, int k, int mask_dims, int K) const {
  if (mask_dims == 2) return mask[t * K + k] != 0;
  return active_tok(t, mask_dims, K);
}

namespace {

void store(DType dt, float v, uint8_t* out) {
  store_rounded(dt, v, out);
}

// A value exact in bf16 and fp16 with 1/8 <= |v| < 4: (64 + m) / 32 · 2^e, m < 64, e in [-2, 1].
float nice_value(SplitMix64& g) {
  const float mant = static_cast<float>(64 + g.below(64)) / 64.0f;
  const float v = std::ldexp(mant, static_cast<int>(g.below(4)) - 2);
  return g.below(2) ? -v : v;
}

std::vector<uint8_t> random_rows(SplitMix64& g, int64_t rows, int64_t H, DType dt) {
  std::vector<uint8_t> v(static_cast<size_t>(rows * H) * elem_size(dt));
  for (int64_t i = 0; i < rows * H; ++i) store(dt, nice_value(g), v.data() + i * elem_size(dt));
  return v;
}

}  // namespace

V2Problem make_v2_problem(const V2Spec& s) {
  V2Problem p;
  p.spec = s;
  const int K = s.K, E = s.E;
  const size_t el = elem_size(s.dtype);
  p.ranks.resize(static_cast<size_t>(s.world()));
  for (int w = 0; w < s.world(); ++w) {
    SplitMix64 g(hash_mix(s.seed, 0xD15, static_cast<uint64_t>(w)));
    V2Rank& r = p.ranks[w];
    r.bs = s.global_bs > 0 ? g.between(0, s.max_bs()) : s.bs;
    const int64_t bs = r.bs;
    // x: tagged with the world rank and token, or random; optional all-zero tokens.
    if (s.tagged) {
      r.x.resize(static_cast<size_t>(bs * s.H) * el);
      for (int64_t t = 0; t < bs; ++t) write_tagged_row(w, t, s.H, s.dtype, r.x.data() + t * s.H * el);
    } else {
      r.x = random_rows(g, bs, s.H, s.dtype);
    }
    if (s.zero_rows > 0)
      for (int64_t t = 0; t < bs; t += s.zero_rows) std::memset(r.x.data() + t * s.H * el, 0, s.H * el);
    // Mask.
    if (s.mask_dims == 1) {
      int64_t n_act = bs;
      switch (g.below(4)) {
        case 0:
          n_act = bs;
          break;
        case 1:
          n_act = 0;
          break;
        default:
          n_act = g.between(0, bs);
      }
      r.mask.assign(static_cast<size_t>(bs), 0);
      for (int64_t t = 0; t < n_act; ++t) r.mask[t] = 1;
    } else if (s.mask_dims == 2) {
      r.mask.assign(static_cast<size_t>(bs) * K, 0);
      for (int64_t t = 0; t < bs; ++t) {
        const bool whole_token_off = g.below(6) == 0;
        for (int k = 0; k < K; ++k) r.mask[t * K + k] = !whole_token_off && g.unit() < s.mask_prob;
      }
    }
    // Ids: K distinct experts per token; inactive slots get -1 or junk.
    r.ids.assign(static_cast<size_t>(bs) * K, -1);
    std::vector<int32_t> pool(E);
    for (int64_t t = 0; t < bs; ++t) {
      for (int e = 0; e < E; ++e) pool[e] = e;
      int front = 0;
      if (s.routing == V2Spec::Routing::one_rank) {
        // Experts of the skewed rank first, then the rest.
        const int L = s.L();
        for (int j = 0; j < L; ++j) std::swap(pool[j], pool[s.skew_rank * L + j]);
        for (int j = L - 1; j > 0; --j) std::swap(pool[j], pool[g.below(j + 1)]);
        front = std::min(L, K);
      }
      for (int k = front; k < K; ++k) std::swap(pool[k], pool[k + g.below(E - k)]);
      for (int k = 0; k < K; ++k) r.ids[t * K + k] = pool[k];
      for (int k = 0; k < K; ++k)
        if (!r.active_slot(t, k, s.mask_dims, K)) {
          switch (g.below(3)) {
            case 0:
              r.ids[t * K + k] = -1;
              break;
            case 1:
              r.ids[t * K + k] = E + 3;
              break;  // out of range: never read
            default:
              r.ids[t * K + k] = r.ids[t * K + (k + 1) % K];  // a duplicate: never read
          }
        }
    }
    r.weights = make_random_weights(bs * K, hash_mix(s.seed, 0x3E1, w));
    r.shared_x = random_rows(g, bs, s.H, s.dtype);
    r.residual = random_rows(g, bs, s.H, s.dtype);
  }
  SplitMix64 g(hash_mix(s.seed, 0x5CA1E));
  auto scale_value = [&] { return static_cast<float>(32 + g.below(65)) / 64.0f; };  // [0.5, 1.5], exact
  switch (s.smooth) {
    case V2Spec::Smooth::none:
      break;
    case V2Spec::Smooth::scalar:
      p.scales = {scale_value()};
      break;
    case V2Spec::Smooth::vector:
      for (int64_t h = 0; h < s.H; ++h) p.scales.push_back(scale_value());
      break;
    case V2Spec::Smooth::table:
      for (int64_t i = 0; i < (s.S() + s.E) * s.H; ++i) p.scales.push_back(scale_value());
      break;
  }
  p.gamma = random_rows(g, 1, s.H, s.dtype);
  return p;
}

namespace {

DType out_dtype_of(const V2Spec& s) {
  switch (s.quant_mode) {
    case 0:
      return s.dtype;
    case 1:
      return DType::i8;
    case 2:
      return s.y_dtype.value_or(DType::i8);
    default:
      return s.y_dtype.value_or(DType::f8e4m3);
  }
}

size_t scale_bytes_of(const V2Spec& s) {
  switch (s.quant_mode) {
    case 2:
      return 4;
    case 3:
      return 4 * static_cast<size_t>((s.H + 127) / 128);
    case 4:
      return static_cast<size_t>(((s.H + 31) / 32 + 1) / 2 * 2);
    default:
      return 0;
  }
}

// payload(r, t, row) of docs/distribute-v2.md: data bytes then scale bytes.
std::vector<uint8_t> payload(const V2Problem& p, const V2Rank& src, int64_t t, int row) {
  const V2Spec& s = p.spec;
  const DType od = out_dtype_of(s);
  const size_t db = static_cast<size_t>(s.H) * elem_size(od), sb = scale_bytes_of(s);
  std::vector<uint8_t> out(db + sb, 0);
  const uint8_t* x = src.x.data() + static_cast<size_t>(t * s.H) * elem_size(s.dtype);
  quant::Smoothing c;
  if (s.smooth == V2Spec::Smooth::scalar) c = quant::Smoothing::scalar(p.scales[0]);
  if (s.smooth == V2Spec::Smooth::vector) c = quant::Smoothing::vector(p.scales.data());
  if (s.smooth == V2Spec::Smooth::table)
    c = quant::Smoothing::vector(p.scales.data() + static_cast<size_t>(row) * s.H);
  const auto fmt = od == DType::f8e5m2 ? quant::Fp8Format::e5m2 : quant::Fp8Format::e4m3;
  float scale = 0;
  std::vector<float> group_scales(static_cast<size_t>((s.H + 127) / 128));
  switch (s.quant_mode) {
    case 0:
      std::memcpy(out.data(), x, db);
      break;
    case 1:
      quant::int8_static(s.dtype, x, s.H, c, reinterpret_cast<int8_t*>(out.data()));
      break;
    case 2:
      if (od == DType::i8)
        quant::int8_per_token_a3(s.dtype, x, s.H, c, reinterpret_cast<int8_t*>(out.data()), &scale);
      else
        quant::fp8_per_token(fmt, s.dtype, x, s.H, c, out.data(), &scale);
      std::memcpy(out.data() + db, &scale, 4);
      break;
    case 3:
      quant::fp8_per_group128_a3(fmt, s.dtype, x, s.H, c, out.data(), group_scales.data());
      std::memcpy(out.data() + db, group_scales.data(), 4 * group_scales.size());
      break;
    case 4:
      quant::mx_quantize(od == DType::f8e5m2 ? quant::MxElem::e5m2 : quant::MxElem::e4m3,
                         quant::ScaleRule::floor, s.dtype, x, s.H, out.data(), out.data() + db);
      break;
  }
  return out;
}

struct RefRow {
  std::vector<uint8_t> bytes;  // payload
  int32_t r, t, slot;
  float escale;
};

// docs/distribute-v2.md on EP group `tp`, receiving rank p.
std::vector<RefRow> ep_rows(const V2Problem& p, int ep, int tp, std::vector<int32_t>& cnt) {
  const V2Spec& s = p.spec;
  const int W = s.W, K = s.K, S = s.S();
  std::vector<RefRow> rows;
  cnt.clear();
  if (ep >= s.shared_ranks) {
    const int m = ep - s.shared_ranks, L = s.L();
    for (int el = 0; el < L; ++el) {
      const int e = m * L + el;
      for (int r = 0; r < W; ++r) {
        const V2Rank& src = p.at(r, tp);
        for (int64_t t = 0; t < src.bs; ++t)
          for (int k = 0; k < K; ++k)
            if (src.active_slot(t, k, s.mask_dims, K) && src.ids[t * K + k] == e)
              rows.push_back(
                  {payload(p, src, t, S + e), r, static_cast<int32_t>(t), k, src.weights[t * K + k]});
        cnt.push_back(static_cast<int32_t>(rows.size()));
      }
    }
  } else {
    const int sh = ep / s.R();
    for (int r = 0; r < W; ++r) {
      if (r % s.R() == ep % s.R()) {
        const V2Rank& src = p.at(r, tp);
        for (int64_t t = 0; t < src.bs; ++t)
          if (src.active_tok(t, s.mask_dims, K))
            rows.push_back({payload(p, src, t, sh), r, static_cast<int32_t>(t), K + sh, 1.0f});
      }
      cnt.push_back(static_cast<int32_t>(rows.size()));
    }
  }
  return rows;
}

}  // namespace

V2DispatchRef ref_dispatch_v2(const V2Problem& p, int ep, int tp) {
  const V2Spec& s = p.spec;
  V2DispatchRef d;
  const int Tp = s.Tp(), W = s.W;
  const int64_t A = s.capacity(ep);
  d.rows = Tp * A;
  d.out_dtype = out_dtype_of(s);
  d.data_bytes = static_cast<size_t>(s.H) * elem_size(d.out_dtype);
  d.scale_bytes = scale_bytes_of(s);
  const size_t scale_row_alloc = s.quant_mode <= 2 ? 4 : d.scale_bytes;  // modes 0-2: (rows,) f32
  d.expand_x.assign(static_cast<size_t>(d.rows) * d.data_bytes, 0);
  d.dynamic_scales.assign(static_cast<size_t>(d.rows) * scale_row_alloc, 0);
  d.assist.assign(static_cast<size_t>(A) * 128, 0);
  d.expand_scales.assign(s.expert_scales ? static_cast<size_t>(d.rows) : 0, 0.0f);

  std::vector<int32_t> cnt, peer_cnt;
  std::vector<RefRow> own = ep_rows(p, ep, tp, cnt), peer;
  if (s.T == 2) peer = ep_rows(p, ep, 1 - tp, peer_cnt);
  d.n_own = static_cast<int64_t>(own.size());
  d.n_peer = static_cast<int64_t>(peer.size());
  if (d.n_own > A || d.n_peer > A) throw std::runtime_error("reference: rows exceed the capacity A");
  auto put = [&](int64_t i, const RefRow& row) {
    std::memcpy(d.expand_x.data() + i * d.data_bytes, row.bytes.data(), d.data_bytes);
    if (d.scale_bytes)
      std::memcpy(d.dynamic_scales.data() + i * scale_row_alloc, row.bytes.data() + d.data_bytes,
                  d.scale_bytes);
    if (s.expert_scales) d.expand_scales[i] = row.escale;
    d.src_rank.push_back(row.r);
    d.src_token.push_back(row.t);
    d.src_slot.push_back(row.slot);
  };
  for (int64_t i = 0; i < d.n_own; ++i) {
    put(i, own[i]);
    d.assist[3 * i] = own[i].r;
    d.assist[3 * i + 1] = own[i].t;
    d.assist[3 * i + 2] = own[i].slot;
  }
  for (int64_t i = 0; i < d.n_peer; ++i) put(d.n_own + i, peer[i]);

  d.ep_recv_counts = cnt;
  d.ep_recv_counts.insert(d.ep_recv_counts.end(), peer_cnt.begin(), peer_cnt.end());
  const int Lp = s.local_experts(ep);
  if (s.T == 2) {
    d.expert_token_nums = {d.n_own + d.n_peer};
    d.tp_recv_counts.assign(2, 0);
    d.tp_recv_counts[tp] = static_cast<int32_t>(d.n_own);
    d.tp_recv_counts[1 - tp] = static_cast<int32_t>(d.n_peer);
  } else {
    if (s.T == 1) d.tp_recv_counts = {static_cast<int32_t>(d.n_own)};
    if (ep < s.shared_ranks) {
      d.expert_token_nums = {d.n_own};
    } else {
      int64_t prev = 0;
      for (int el = 0; el < Lp; ++el) {
        const int64_t end = cnt[static_cast<size_t>(el) * W + W - 1];
        d.expert_token_nums.push_back(s.token_nums_type == 0 ? end : end - prev);
        prev = end;
      }
    }
  }
  return d;
}

uint16_t ref_f16_exact_add(uint16_t a, uint16_t b) {
  const double sum = static_cast<double>(f16_to_f32(a)) + static_cast<double>(f16_to_f32(b));
  if (std::isnan(sum)) return 0x7E00;
  if (std::fabs(sum) >= 65520.0) return sum < 0 ? 0xFC00 : 0x7C00;  // rounds past the largest finite value
  // Candidates around the single-rounded fp32 value; pick the nearest fp16, ties to the even code.
  const uint16_t c = f32_to_f16(static_cast<float>(sum));
  uint16_t best = c;
  double best_err = std::fabs(static_cast<double>(f16_to_f32(c)) - sum);
  for (int d : {-1, 1}) {
    const int cand = static_cast<int>(c) + d;
    if (cand < 0 || cand > 0xFFFF) continue;
    const uint16_t cc = static_cast<uint16_t>(cand);
    if ((cc & 0x7C00) == 0x7C00 && (cc & 0x3FF)) continue;  // NaN codes
    if ((cc & 0x8000) != (c & 0x8000) && (c & 0x7FFF) != 0) continue;
    const double v = f16_to_f32(cc);
    if (std::isinf(v)) continue;
    const double err = std::fabs(v - sum);
    if (err < best_err || (err == best_err && (cc & 1) == 0 && (best & 1) == 1)) {
      best = cc;
      best_err = err;
    }
  }
  return best;
}

namespace {

// The TP reduce of docs/distribute-v2.md for one row.
std::vector<uint8_t> tp_add(DType dt, const uint8_t* y, const uint8_t* q, int64_t H) {
  std::vector<uint8_t> out(static_cast<size_t>(H) * 2);
  for (int64_t h = 0; h < H; ++h) {
    uint16_t a, b, r;
    std::memcpy(&a, y + 2 * h, 2);
    std::memcpy(&b, q + 2 * h, 2);
    if (dt == DType::bf16)
      r = f32_to_bf16(bf16_to_f32(a) + bf16_to_f32(b));
    else
      r = ref_f16_exact_add(a, b);
    std::memcpy(out.data() + 2 * h, &r, 2);
  }
  return out;
}

double rne_int(double v) {
  return std::nearbyint(v);
}

// comm_quant_mode 2 (docs/distribute-v2.md): encode with groups of 8, decode to dt, as fp32 values.
std::vector<float> group8_round_trip(DType dt, const uint8_t* y, int64_t H) {
  std::vector<float> out(static_cast<size_t>(H));
  const float inv127 = f32_from_bits(0x3C010204u);
  for (int64_t g0 = 0; g0 < H; g0 += 8) {
    const int64_t g1 = std::min(H, g0 + 8);
    float a = 0;
    for (int64_t h = g0; h < g1; ++h) a = std::max(a, std::fabs(load_f32(dt, y, h)));
    const float s32 = a * inv127;
    uint8_t sigma_bytes[2];
    store_rounded(dt, s32, sigma_bytes);
    const float sigma = a == 0 ? 0.0f : load_f32(dt, sigma_bytes, 0);
    for (int64_t h = g0; h < g1; ++h) {
      const float q = a == 0 ? 0.0f : static_cast<float>(rne_int(load_f32(dt, y, h) / s32));
      uint8_t dec[2];
      store_rounded(dt, q * sigma, dec);
      out[h] = load_f32(dt, dec, 0);
    }
  }
  return out;
}

}  // namespace

V2CombineAcc ref_combine_acc(const V2Problem& p, const std::vector<V2DispatchRef>& refs,
                             const std::vector<std::vector<uint8_t>>& outs, int ep, int tp, int comm_quant,
                             bool shared_x) {
  const V2Spec& s = p.spec;
  const int Tp = s.Tp(), K = s.K, S = s.S(), slots = K + S;
  const int64_t H = s.H;
  const DType dt = s.dtype;
  const size_t row = static_cast<size_t>(H) * 2;
  const V2Rank& me = p.at(ep, tp);
  // recv[(t, slot)] = the decoded row some rank of EP group `tp` returned to us.
  std::map<int64_t, std::vector<float>> recv;
  for (int q = 0; q < s.W; ++q) {
    const int w = q * Tp + tp;
    const V2DispatchRef& d = refs[w];
    for (int64_t i = 0; i < d.n_own; ++i) {
      if (d.src_rank[i] != ep) continue;
      std::vector<uint8_t> y(outs[w].begin() + i * row, outs[w].begin() + (i + 1) * row);
      if (s.T == 2) {
        const int pw = q * Tp + (1 - tp);
        y = tp_add(dt, y.data(), outs[pw].data() + (refs[pw].n_own + i) * row, H);
      }
      std::vector<float> v(static_cast<size_t>(H));
      if (comm_quant == 2)
        v = group8_round_trip(dt, y.data(), H);
      else
        for (int64_t h = 0; h < H; ++h) v[h] = load_f32(dt, y.data(), h);
      const int64_t key = static_cast<int64_t>(d.src_token[i]) * slots + d.src_slot[i];
      if (!recv.emplace(key, std::move(v)).second)
        throw std::runtime_error("reference: duplicate combine row");
    }
  }
  V2CombineAcc a;
  a.acc.assign(static_cast<size_t>(me.bs * H), 0.0f);
  a.active.assign(static_cast<size_t>(me.bs), 0);
  for (int64_t t = 0; t < me.bs; ++t) {
    if (!me.active_tok(t, s.mask_dims, K)) continue;
    a.active[t] = 1;
    float* acc = &a.acc[t * H];
    auto get = [&](int slot) -> const std::vector<float>& {
      auto it = recv.find(t * slots + slot);
      if (it == recv.end())
        throw std::runtime_error("reference: no row for token " + std::to_string(t) + " slot " +
                                 std::to_string(slot));
      return it->second;
    };
    for (int k = 0; k < K; ++k) {
      if (!me.active_slot(t, k, s.mask_dims, K)) continue;
      const std::vector<float>& v = get(k);
      const float w = me.weights[t * K + k];
      for (int64_t h = 0; h < H; ++h) {
        const float prod = v[h] * w;
        acc[h] = acc[h] + prod;
      }
    }
    for (int sh = 0; sh < S; ++sh) {
      const std::vector<float>& v = get(K + sh);
      for (int64_t h = 0; h < H; ++h) acc[h] = acc[h] + v[h];
    }
    if (shared_x)
      for (int64_t h = 0; h < H; ++h) acc[h] = acc[h] + load_f32(dt, me.shared_x.data(), t * H + h);
  }
  return a;
}

std::vector<uint8_t> ref_round(const V2Problem& p, const V2CombineAcc& a) {
  const int64_t H = p.spec.H;
  const int64_t bs = static_cast<int64_t>(a.active.size());
  std::vector<uint8_t> x(static_cast<size_t>(bs * H) * 2, 0);
  for (int64_t t = 0; t < bs; ++t)
    if (a.active[t])
      for (int64_t h = 0; h < H; ++h)
        store_rounded(p.spec.dtype, a.acc[t * H + h], x.data() + (t * H + h) * 2);
  return x;
}

V2NormRef ref_add_rms_norm(const V2Problem& p, const V2CombineAcc& a, const std::vector<uint8_t>& residual,
                           float eps) {
  const int64_t H = p.spec.H;
  const DType dt = p.spec.dtype;
  const int64_t bs = static_cast<int64_t>(a.active.size());
  V2NormRef r;
  r.x.assign(static_cast<size_t>(bs * H) * 2, 0);
  r.y.assign(static_cast<size_t>(bs * H) * 2, 0);
  r.rstd.assign(static_cast<size_t>(bs), 0.0f);
  const float inv_h = static_cast<float>(1.0 / static_cast<double>(H));
  for (int64_t t = 0; t < bs; ++t) {
    if (!a.active[t]) continue;
    std::vector<float> xf(static_cast<size_t>(H));
    double sum = 0;
    for (int64_t h = 0; h < H; ++h) {
      xf[h] = a.acc[t * H + h] + load_f32(dt, residual.data(), t * H + h);
      store_rounded(dt, xf[h], r.x.data() + (t * H + h) * 2);
      const float sq = xf[h] * xf[h];
      sum += static_cast<double>(sq * inv_h);
    }
    const float ms = static_cast<float>(sum);
    const float rstd = 1.0f / std::sqrt(ms + eps);
    r.rstd[t] = rstd;
    for (int64_t h = 0; h < H; ++h) {
      uint8_t tmp[2];
      store_rounded(dt, xf[h] * rstd, tmp);
      store_rounded(dt, load_f32(dt, tmp, 0) * load_f32(dt, p.gamma.data(), h), r.y.data() + (t * H + h) * 2);
    }
  }
  return r;
}

double calc_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = a[i] + 1, y = b[i] + 1;
    num += x * y;
    den += x * x + y * y;
  }
  return den == 0 ? 0 : 1 - 2 * num / den;
}

}  // namespace epcomm::testing::v2

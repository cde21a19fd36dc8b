// multirank/cases_fuzz.cc — a seeded fuzz of the C++ argument checks (docs/errors.md: every argument error is
// collective). Each trial builds a valid fresh dispatch, combine or cached dispatch of a random problem
// (every rank draws every rank's inputs from the seed), changes ONE field of DispatchArgs / CombineArgs on
// one rank or on every rank, and demands one of two endings:
//   - a clean error within kSlowErrorS on every rank: the changed ranks InvalidUsage naming the field (or
//     Aborted quoting another changed rank), the others Aborted quoting a changed rank or InvalidUsage for a
//     mismatch / capacity problem; then a whole round trip on the same Buffer (run_round_trip: layout,
//     dispatch, combines, cached dispatch, all against the reference) shows that the next call pairs;
//   - a result equal to the independent reference (support/reference.h) of the arguments as passed.
// The ending each change must give is stated with it, from docs/normal-mode.md. EPCOMM_FUZZ_TRIALS (default
// 1000) and EPCOMM_FUZZ_SEED (default 1); a failure names the seed, the trial and the change.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>

#include "multirank/round_trip.h"
#include "support/check.h"
#include "support/rng.h"

using namespace epcomm;
using namespace epcomm::testing;

namespace {

constexpr double kSlowErrorS = 3.0;
constexpr double kTimeoutS = 5.0;

enum class End { error, capacity, ok, either };

// Memory the changed arguments point at, alive for the trial.
struct Store {
  std::deque<std::vector<uint8_t>> blobs;
  Tensor make(DType dt, const Shape& shape, Shape strides = {}, uint8_t fill = 0) {
    int64_t n = 1;  // elements spanned
    for (size_t i = 0; i < shape.size(); ++i) {
      if (strides.empty())
        n *= shape[i];
      else
        n += (shape[i] - 1) * strides[i];
    }
    for (int64_t d : shape) n = d == 0 ? 0 : n;
    blobs.emplace_back(static_cast<size_t>(std::max<int64_t>(n, 1)) * dtype_size(dt), fill);
    return Tensor::wrap(blobs.back().data(), dt, shape, std::move(strides));
  }
  // A copy of t (contiguous, 2-D) whose last dimension has stride 2: the same values, not contiguous.
  Tensor strided(const Tensor& t) {
    const int64_t rows = t.dim() == 2 ? t.size(0) : 1, cols = t.size(t.dim() - 1);
    const size_t e = dtype_size(t.dtype());
    Shape strides = t.dim() == 2 ? Shape{2 * cols, 2} : Shape{2};
    Tensor s = make(t.dtype(), t.shape(), strides);
    for (int64_t i = 0; i < rows * cols; ++i)
      std::memcpy(s.data_as<uint8_t>() + 2 * i * e, t.data_as<uint8_t>() + i * e, e);
    return s;
  }
  Tensor copy(const Tensor& t) {
    Tensor c = make(t.dtype(), t.shape());
    if (t.nbytes()) std::memcpy(c.data(), t.data(), t.nbytes());
    return c;
  }
};

// What a trial calls, and with what (every rank computes every rank's values).
struct Trial {
  uint64_t seed = 0;
  int index = 0, api = 0;  // 0 fresh dispatch, 1 combine, 2 cached dispatch
  ProblemSpec spec;
  Problem P;
  ReceiveOrder order = ReceiveOrder::expert_major;
  int64_t align = 1, worst = 0;  // worst: equal on every rank
  bool layout = false;
  std::vector<int64_t> rows;  // N of every receiver
};

struct Mut {
  std::string label;
  // Changes rank r's arguments; returns false when the change does nothing there (no tokens).
  std::function<bool(int r, DispatchArgs&, CombineArgs&, Store&)> apply;
  End one = End::error, all = End::error;
  std::vector<std::string> names;
  std::function<End(const std::vector<int>&)> decide;  // where the ending depends on who changed
};

struct Outcome {
  bool ok = true;
  ErrorCode code = ErrorCode::Internal;
  bool epcomm = true;
  std::string msg;
  double secs = 0;
};

std::vector<Outcome> gather(RankCtx& ctx, const Outcome& o) {
  constexpr size_t kRec = 2048;
  std::vector<std::byte> mine(kRec);
  mine[0] = std::byte(o.ok);
  mine[1] = std::byte(static_cast<uint8_t>(o.code));
  mine[2] = std::byte(o.epcomm);
  std::memcpy(mine.data() + 8, &o.secs, sizeof(double));
  const size_t n = std::min(o.msg.size(), kRec - 17);
  std::memcpy(mine.data() + 16, o.msg.data(), n);
  std::vector<std::byte> all = ctx.group->bootstrap().all_gather(mine);
  std::vector<Outcome> out(ctx.size);
  for (int r = 0; r < ctx.size; ++r) {
    const std::byte* p = all.data() + r * kRec;
    out[r].ok = p[0] != std::byte(0);
    out[r].code = static_cast<ErrorCode>(static_cast<uint8_t>(p[1]));
    out[r].epcomm = p[2] != std::byte(0);
    std::memcpy(&out[r].secs, p + 8, sizeof(double));
    out[r].msg.assign(reinterpret_cast<const char*>(p + 16),
                      strnlen(reinterpret_cast<const char*>(p + 16), kRec - 17));
  }
  return out;
}

template <typename Fn>
Outcome outcome_of(Fn&& fn) {
  Outcome o;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    fn();
  } catch (const Error& e) {
    o.ok = false;
    o.code = e.code();
    o.msg = e.what();
  } catch (const std::exception& e) {
    o.ok = false;
    o.epcomm = false;
    o.msg = e.what();
  }
  o.secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return o;
}

bool contains_any(const std::string& msg, const std::vector<std::string>& names) {
  for (const auto& n : names)
    if (msg.find(n) != std::string::npos) return true;
  return false;
}

// Throws unless every rank's ending is what `expect` allows (the rules of tests/python/test_fuzz.py's judge);
// returns true when the call raised.
bool judge(const std::vector<Outcome>& every, End expect, const Mut& m, const std::vector<int>& changed) {
  auto is_changed = [&](int r) { return std::find(changed.begin(), changed.end(), r) != changed.end(); };
  bool any_ok = false, any_err = false;
  for (size_t r = 0; r < every.size(); ++r) {
    const Outcome& o = every[r];
    REQUIRE(o.ok || o.epcomm, "rank ", r, " threw a std::exception that is not an epcomm::Error: ", o.msg);
    REQUIRE(o.ok || o.code != ErrorCode::Timeout, "rank ", r, " timed out (a hang): ", o.msg);
    (o.ok ? any_ok : any_err) = true;
  }
  REQUIRE(!(any_ok && any_err), "the ranks ended differently: rank 0 ",
          every[0].ok ? "returned" : every[0].msg, "; rank 1 ", every[1].ok ? "returned" : every[1].msg);
  if (any_ok) {
    REQUIRE(expect == End::ok || expect == End::either, "expected an error, every rank returned a result");
    return false;
  }
  REQUIRE(expect != End::ok, "expected a result, got: ", every[0].msg);
  bool someone_found = false;
  for (size_t r = 0; r < every.size(); ++r) {
    const Outcome& o = every[r];
    const bool invalid = o.code == ErrorCode::InvalidUsage;
    const bool collective = invalid && (o.msg.find("mismatch") != std::string::npos ||
                                        o.msg.find("capacity") != std::string::npos);
    bool quotes = false;
    for (int t : changed)
      quotes |= t != static_cast<int>(r) && o.code == ErrorCode::Aborted &&
                o.msg.find(epcomm::detail::cat("rank ", t, " ")) != std::string::npos;
    bool ok = expect == End::capacity           ? invalid && o.msg.find("capacity") != std::string::npos
              : is_changed(static_cast<int>(r)) ? invalid || quotes
                                                : quotes || collective;
    REQUIRE(ok && contains_any(o.msg, m.names), "rank ", r,
            is_changed(static_cast<int>(r)) ? " (changed)" : "", ": ", error_code_name(o.code), ": '", o.msg,
            "' is not the clean error expected");
    REQUIRE(o.secs <= kSlowErrorS, "rank ", r, " raised only after ", o.secs, " s: ", o.msg);
    someone_found |= invalid;
  }
  REQUIRE(someone_found, "every rank raised Aborted: none found the error itself");
  return true;
}

// ---- the trial's problem, every rank's valid arguments, the reference of the arguments as passed
// -------------

Trial make_trial(uint64_t seed, int index, int R) {
  SplitMix64 g(hash_mix(seed, static_cast<uint64_t>(index), 0xF022));
  Trial t;
  t.seed = seed;
  t.index = index;
  t.api = static_cast<int>(g.below(3));
  ProblemSpec& s = t.spec;
  s.num_ranks = R;
  s.num_experts = R * static_cast<int>(g.between(1, 3));
  s.num_topk = static_cast<int>(g.between(1, 4));
  s.hidden = std::vector<int64_t>{8, 16, 24, 40}[g.below(4)];
  s.dtype = std::vector<DType>{DType::bf16, DType::f16, DType::f32}[g.below(3)];
  s.seed = g.next();
  s.min_tokens = 0;
  s.max_tokens = 8;
  s.random_bits = s.dtype == DType::bf16 && g.below(3) == 0;
  t.P = make_problem(s);
  t.order = g.below(2) ? ReceiveOrder::rank_major : ReceiveOrder::expert_major;
  t.align = g.between(1, 3);
  t.layout = g.below(2) == 0;
  for (int d = 0; d < R; ++d)
    t.rows.push_back(ref_dispatch_placement(t.P, d, t.order, t.align).num_recv_rows);
  if (g.below(5) == 0) t.worst = *std::max_element(t.rows.begin(), t.rows.end()) + g.between(0, 3);
  return t;
}

Tensor i32_tensor(Store& st, const std::vector<int32_t>& v) {
  Tensor t = st.make(DType::i32, {static_cast<int64_t>(v.size())});
  if (!v.empty()) std::memcpy(t.data(), v.data(), v.size() * 4);
  return t;
}

// Rank r's fresh dispatch, its layout tensors from the reference (so that any rank can build any rank's).
DispatchArgs fresh_args(const Trial& t, int r, Store& st) {
  DispatchArgs a;
  a.x.data = x_of(t.P, r);
  a.topk_idx = topk_idx_of(t.P, r);
  a.topk_weights = topk_weights_of(t.P, r);
  const RefLayout rl = ref_layout(t.P, r);
  a.num_tokens_per_expert = i32_tensor(st, rl.num_tokens_per_expert);
  if (t.layout) {
    a.num_tokens_per_rank = i32_tensor(st, rl.num_tokens_per_rank);
    Tensor in = st.make(DType::boolean, {t.P.ranks[r].num_tokens, t.spec.num_ranks});
    if (in.nbytes()) std::memcpy(in.data(), rl.is_token_in_rank.data(), in.nbytes());
    a.is_token_in_rank = in;
  }
  a.expert_alignment = t.align;
  a.num_worst_tokens = t.worst;
  a.receive_order = t.order;
  return a;
}

// The elements of a 1-D or 2-D tensor in row-major order, as bytes (any strides).
std::vector<uint8_t> bytes_any(const Tensor& t) {
  const size_t e = dtype_size(t.dtype());
  std::vector<uint8_t> out(static_cast<size_t>(t.numel()) * e);
  const int64_t rows = t.dim() == 2 ? t.size(0) : 1, cols = t.dim() == 0 ? 1 : t.size(t.dim() - 1);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      const int64_t off = (t.dim() == 2 ? i * t.strides()[0] : 0) + j * t.strides()[t.dim() - 1];
      std::memcpy(out.data() + (i * cols + j) * e, t.data_as<uint8_t>() + off * e, e);
    }
  return out;
}

std::vector<int64_t> ints_any(const Tensor& t) {
  std::vector<uint8_t> b = bytes_any(t);
  std::vector<int64_t> v(static_cast<size_t>(t.numel()));
  for (size_t i = 0; i < v.size(); ++i) {
    if (t.dtype() == DType::i64)
      std::memcpy(&v[i], b.data() + 8 * i, 8);
    else
      v[i] = reinterpret_cast<const int32_t*>(b.data())[i];
  }
  return v;
}

// The reference problem of every rank's fresh-dispatch arguments as passed (a valid ending: they agree).
Problem problem_of(const Trial& t, const std::vector<DispatchArgs>& eff, int me) {
  Problem P = t.P;
  P.spec.hidden = eff[me].x.data.size(1);
  P.spec.num_experts = static_cast<int>(eff[me].num_tokens_per_expert->numel());
  for (size_t s = 0; s < eff.size(); ++s) {
    RankInputs& in = P.ranks[s];
    in.x = bytes_any(eff[s].x.data);
    in.topk_idx = ints_any(*eff[s].topk_idx);
    std::vector<uint8_t> w = bytes_any(*eff[s].topk_weights);
    in.topk_weights.assign(w.size() / 4, 0.f);
    if (!w.empty()) std::memcpy(in.topk_weights.data(), w.data(), w.size());
  }
  return P;
}

void check_dispatch(const DispatchResult& d, const Problem& P, const DispatchArgs& a, int me,
                    const std::string& what) {
  const ReceiveOrder order = a.receive_order.value_or(ReceiveOrder::expert_major);
  const RefDispatch ref = ref_dispatch(P, me, order, a.expert_alignment, a.num_worst_tokens);
  check_rows_equal(what + " recv_x", tensor_bytes(d.recv_x.data), ref.recv_x, P.row_bytes(), P.spec.dtype);
  REQUIRE(d.recv_topk_idx && d.recv_topk_idx->dtype() == a.topk_idx->dtype(), what,
          ": recv_topk_idx must keep topk_idx's dtype");
  check_equal(what + " recv_topk_idx", tensor_to_i64(*d.recv_topk_idx), ref.recv_topk_idx, P.spec.num_topk);
  check_equal(what + " recv_topk_weights", tensor_to_f32(*d.recv_topk_weights), ref.recv_topk_weights,
              P.spec.num_topk);
  REQUIRE(d.num_recv_tokens_per_expert_list, what, ": list missing");
  check_equal(what + " list", *d.num_recv_tokens_per_expert_list, ref.result_list());
  check_equal(what + " handle.recv_src_rank", tensor_to_i32(d.handle->recv_src_rank()), ref.src_rank);
  check_equal(what + " handle.recv_src_token", tensor_to_i32(d.handle->recv_src_token()), ref.src_token);
}

// ---- the changes
// ------------------------------------------------------------------------------------------------

using Apply = std::function<bool(int, DispatchArgs&, CombineArgs&, Store&)>;

Mut change(std::string label, Apply apply, std::vector<std::string> names, End one = End::error,
           End all = End::error) {
  Mut m;
  m.label = std::move(label);
  m.apply = std::move(apply);
  m.names = std::move(names);
  m.one = one;
  m.all = all;
  return m;
}

void add_int_changes(std::vector<Mut>& m, const char* name, int64_t DispatchArgs::*field) {
  for (int64_t v : {int64_t{-1}, int64_t{1} << 31, int64_t{1} << 40, int64_t{1} << 62,
                    std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min()})
    m.push_back(change(epcomm::detail::cat(name, " = ", v),
                       [field, v](int, DispatchArgs& a, CombineArgs&, Store&) {
                         a.*field = v;
                         return true;
                       },
                       {name}));
}

// topk_idx with one slot set to v: a valid slot or a -1 slot, picked by `pick`.
Apply set_id(const Trial& t, int64_t v, bool valid_slot, uint64_t pick) {
  return [&t, v, valid_slot, pick](int r, DispatchArgs& a, CombineArgs&, Store& st) {
    std::vector<int64_t> ids = t.P.ranks[r].topk_idx;
    std::vector<size_t> cand;
    for (size_t i = 0; i < ids.size(); ++i)
      if ((ids[i] >= 0) == valid_slot) cand.push_back(i);
    if (cand.empty()) return false;
    ids[cand[pick % cand.size()]] = v;
    Tensor n = st.make(DType::i64, {t.P.ranks[r].num_tokens, t.spec.num_topk});
    std::memcpy(n.data(), ids.data(), ids.size() * 8);
    a.topk_idx = n;
    return true;
  };
}

void x_changes(std::vector<Mut>& m, const Trial& t) {
  const int64_t H = t.spec.hidden;
  const DType dt = t.spec.dtype;
  const Trial* tp = &t;
  auto T = [tp](int r) { return tp->P.ranks[r].num_tokens; };
  m.push_back(change("x dtype i32",
                     [=](int r, DispatchArgs& a, CombineArgs&, Store& s) {
                       a.x.data = s.make(DType::i32, {T(r), H});
                       return true;
                     },
                     {"x"}));
  m.push_back(change("x 1-D",
                     [=](int r, DispatchArgs& a, CombineArgs&, Store& s) {
                       a.x.data = s.make(dt, {T(r) * H});
                       return true;
                     },
                     {"x"}));
  m.push_back(change("x one row more",
                     [=](int r, DispatchArgs& a, CombineArgs&, Store& s) {
                       a.x.data = s.make(dt, {T(r) + 1, H});
                       return true;
                     },
                     {"x", "topk", "num_tokens"}));
  m.push_back(change("x no columns",
                     [=](int r, DispatchArgs& a, CombineArgs&, Store& s) {
                       a.x.data = s.make(dt, {T(r), 0});
                       return true;
                     },
                     {"x", "hidden"}));
  m.push_back(change("x undefined",
                     [](int, DispatchArgs& a, CombineArgs&, Store&) {
                       a.x.data = Tensor();
                       return true;
                     },
                     {"x"}));
  m.push_back(change(
      "x non-contiguous",
      [=](int r, DispatchArgs& a, CombineArgs&, Store& s) {
        if (T(r) == 0) return false;
        a.x.data = s.strided(a.x.data);
        return true;
      },
      {"x", "contiguous"}, End::either, End::either));
  m.push_back(change(
      "x wider (zeros)",
      [=](int r, DispatchArgs& a, CombineArgs&, Store& s) {
        a.x.data = s.make(dt, {T(r), H + 8});
        return true;
      },
      {"hidden"}, End::error, End::ok));
  m.push_back(change(
      "x NaN/Inf",
      [](int, DispatchArgs& a, CombineArgs&, Store& s) {
        if (a.x.data.nbytes() == 0) return false;
        a.x.data = s.copy(a.x.data);
        std::memset(a.x.data.data(), 0xFF, std::min<size_t>(a.x.data.nbytes(), 8));
        return true;
      },
      {}, End::ok, End::ok));
}

void topk_changes(std::vector<Mut>& m, const Trial& t, uint64_t pick) {
  const int K = t.spec.num_topk, R = t.spec.num_ranks;
  const Trial* tp = &t;
  auto T = [tp](int r) { return tp->P.ranks[r].num_tokens; };
  const std::vector<std::string> layout_names = {"num_tokens_per_expert", "num_tokens_per_rank",
                                                 "is_token_in_rank"};
  m.push_back(change("topk_idx = E", set_id(t, t.spec.num_experts, true, pick), {"topk_idx"}));
  m.push_back(change("topk_idx = 2^40", set_id(t, int64_t{1} << 40, true, pick), {"topk_idx"}));
  m.push_back(change("topk_idx valid slot -> -3", set_id(t, -3, true, pick), layout_names));
  m.push_back(change("topk_idx -1 -> -7", set_id(t, -7, false, pick), {}, End::ok, End::ok));
  m.push_back(change("topk_idx f32",
                     [=](int r, DispatchArgs& a, CombineArgs&, Store& s) {
                       a.topk_idx = s.make(DType::f32, {T(r), K});
                       return true;
                     },
                     {"topk_idx"}));
  m.push_back(change(
      "topk_idx i32",
      [tp, K](int r, DispatchArgs& a, CombineArgs&, Store& s) {
        Tensor n = s.make(DType::i32, {tp->P.ranks[r].num_tokens, K});
        for (size_t i = 0; i < tp->P.ranks[r].topk_idx.size(); ++i)
          n.data_as<int32_t>()[i] = static_cast<int32_t>(tp->P.ranks[r].topk_idx[i]);
        a.topk_idx = n;
        return true;
      },
      {}, End::ok, End::ok));
  m.push_back(change(
      "topk_idx non-contiguous",
      [=](int r, DispatchArgs& a, CombineArgs&, Store& s) {
        if (T(r) == 0) return false;
        a.topk_idx = s.strided(*a.topk_idx);
        return true;
      },
      {"topk_idx", "contiguous"}, End::either, End::either));
  m.push_back(change("topk_idx missing",
                     [](int, DispatchArgs& a, CombineArgs&, Store&) {
                       a.topk_idx.reset();
                       return true;
                     },
                     {"topk_idx", "topk_weights"}));
  m.push_back(change("topk_weights shape",
                     [=](int r, DispatchArgs& a, CombineArgs&, Store& s) {
                       a.topk_weights = s.make(DType::f32, {T(r), K + 1});
                       return true;
                     },
                     {"topk_weights"}));
  m.push_back(change("topk_weights f16",
                     [=](int r, DispatchArgs& a, CombineArgs&, Store& s) {
                       a.topk_weights = s.make(DType::f16, {T(r), K});
                       return true;
                     },
                     {"topk_weights"}));
  m.push_back(change("num_tokens_per_expert + 1",
                     [](int, DispatchArgs& a, CombineArgs&, Store& s) {
                       a.num_tokens_per_expert = s.copy(*a.num_tokens_per_expert);
                       a.num_tokens_per_expert->data_as<int32_t>()[0] += 1;
                       return true;
                     },
                     {"num_tokens_per_expert"}));
  for (int64_t e : {int64_t{t.spec.num_experts + 1}, int64_t{1} << 20})
    m.push_back(change(epcomm::detail::cat("num_experts ", e),
                       [e](int, DispatchArgs& a, CombineArgs&, Store& s) {
                         a.num_tokens_per_expert = s.make(DType::i32, {e});
                         return true;
                       },
                       {"num_experts", "num_tokens_per_expert"}));
  m.push_back(change("num_tokens_per_expert f32",
                     [tp](int, DispatchArgs& a, CombineArgs&, Store& s) {
                       a.num_tokens_per_expert = s.make(DType::f32, {tp->spec.num_experts});
                       return true;
                     },
                     {"num_tokens_per_expert"}));
  m.push_back(change("num_tokens_per_expert missing",
                     [](int, DispatchArgs& a, CombineArgs&, Store&) {
                       a.num_tokens_per_expert.reset();
                       return true;
                     },
                     {"num_tokens_per_expert"}));
  m.push_back(change("num_tokens_per_rank shape",
                     [R](int, DispatchArgs& a, CombineArgs&, Store& s) {
                       a.num_tokens_per_rank = s.make(DType::i32, {R + 1});
                       return true;
                     },
                     {"num_tokens_per_rank"}));
  m.push_back(change("num_tokens_per_rank + 1",
                     [tp, R](int r, DispatchArgs& a, CombineArgs&, Store& s) {
                       std::vector<int32_t> v = ref_layout(tp->P, r).num_tokens_per_rank;
                       v[0] += 1;
                       a.num_tokens_per_rank = i32_tensor(s, v);
                       return true;
                     },
                     {"num_tokens_per_rank"}));
  m.push_back(change(
      "num_tokens_per_rank strided",
      [tp, R](int r, DispatchArgs& a, CombineArgs&, Store& s) {
        const std::vector<int32_t> v = ref_layout(tp->P, r).num_tokens_per_rank;
        Tensor n = s.make(DType::i32, {R}, {2});
        for (int d = 0; d < R; ++d) n.data_as<int32_t>()[2 * d] = v[d];
        a.num_tokens_per_rank = n;
        return true;
      },
      {"num_tokens_per_rank", "contiguous"}, End::either, End::either));
  m.push_back(change("is_token_in_rank f32",
                     [=](int r, DispatchArgs& a, CombineArgs&, Store& s) {
                       a.is_token_in_rank = s.make(DType::f32, {T(r), R});
                       return true;
                     },
                     {"is_token_in_rank"}));
}

void count_changes(std::vector<Mut>& m, const Trial& t) {
  const int R = t.spec.num_ranks;
  const Trial* tp = &t;
  add_int_changes(m, "expert_alignment", &DispatchArgs::expert_alignment);
  m.push_back(change("expert_alignment 0",
                     [](int, DispatchArgs& a, CombineArgs&, Store&) {
                       a.expert_alignment = 0;
                       return true;
                     },
                     {"expert_alignment"}));
  Mut a1 = change("expert_alignment + 1",
                  [](int, DispatchArgs& a, CombineArgs&, Store&) {
                    a.expert_alignment += 1;
                    return true;
                  },
                  {"expert_alignment", "num_worst_tokens"});
  a1.decide = [tp,
               R](const std::vector<int>& ch) {  // every rank: more PAD rows may overflow num_worst_tokens
    if (static_cast<int>(ch.size()) < R) return End::error;
    for (int d = 0; d < R && tp->worst > 0; ++d)
      if (ref_dispatch_placement(tp->P, d, tp->order, tp->align + 1).num_recv_rows > tp->worst)
        return End::capacity;
    return End::ok;
  };
  m.push_back(std::move(a1));
  add_int_changes(m, "num_worst_tokens", &DispatchArgs::num_worst_tokens);
  const int64_t most = *std::max_element(t.rows.begin(), t.rows.end());
  if (most >= 2) {
    Mut w = change("num_worst_tokens too small",
                   [most](int, DispatchArgs& a, CombineArgs&, Store&) {
                     a.num_worst_tokens = most - 1;
                     return true;
                   },
                   {"num_worst_tokens"});
    w.decide = [tp, most](const std::vector<int>& ch) {
      for (int s : ch)
        if (tp->rows[s] > most - 1) return End::capacity;
      return End::ok;
    };
    m.push_back(std::move(w));
  }
  m.push_back(change(
      "num_worst_tokens larger",
      [most](int, DispatchArgs& a, CombineArgs&, Store&) {
        a.num_worst_tokens = most + 50;
        return true;
      },
      {}, End::ok, End::ok));
  const ReceiveOrder flip =
      t.order == ReceiveOrder::expert_major ? ReceiveOrder::rank_major : ReceiveOrder::expert_major;
  Mut o = change("receive_order flipped",
                 [flip](int, DispatchArgs& a, CombineArgs&, Store&) {
                   a.receive_order = flip;
                   return true;
                 },
                 {"receive_order", "num_worst_tokens"});
  o.decide = [tp, flip, R](const std::vector<int>& ch) {
    if (static_cast<int>(ch.size()) < R) return End::error;
    for (int d = 0; d < R && tp->worst > 0; ++d)
      if (ref_dispatch_placement(tp->P, d, flip, tp->align).num_recv_rows > tp->worst) return End::capacity;
    return End::ok;
  };
  m.push_back(std::move(o));
}

std::vector<Mut> dispatch_changes(const Trial& t, SplitMix64& g) {
  const int R = t.spec.num_ranks;
  const DType dt = t.spec.dtype;
  std::vector<Mut> m;
  x_changes(m, t);
  topk_changes(m, t, g.next());
  count_changes(m, t);
  m.push_back(change("config chunks",
                     [](int, DispatchArgs& a, CombineArgs&, Store&) {
                       Config c;
                       c.num_max_nvl_chunked_send_tokens = 512;
                       a.config = c;
                       return true;
                     },
                     {"config"}));
  m.push_back(change(
      "config other valid chunks",
      [](int, DispatchArgs& a, CombineArgs&, Store&) {
        Config c;
        c.num_max_nvl_chunked_send_tokens = 16;
        a.config = c;
        return true;
      },
      {"config"}, End::error, End::ok));
  m.push_back(change("stats shape",
                     [R](int, DispatchArgs& a, CombineArgs&, Store& s) {
                       a.dispatch_wait_recv_cost_stats = s.make(DType::i64, {R + 1});
                       return true;
                     },
                     {"dispatch_wait_recv_cost_stats"}));
  m.push_back(change("quant_mode bf16 with non-bf16 x",
                     [dt](int, DispatchArgs& a, CombineArgs&, Store&) {
                       if (dt == DType::bf16) return false;
                       a.quant_mode = QuantMode::bf16;
                       return true;
                     },
                     {"quant_mode"}));
  return m;
}

std::vector<Mut> combine_changes(const Trial& t) {
  const int K = t.spec.num_topk, R = t.spec.num_ranks;
  const Trial* tp = &t;
  std::vector<Mut> m;
  m.push_back(change("x one row more",
                     [](int, DispatchArgs&, CombineArgs& c, Store& s) {
                       c.x = s.make(c.x.dtype(), {c.x.size(0) + 1, c.x.size(1)});
                       return true;
                     },
                     {"x"}));
  m.push_back(change("x i32",
                     [](int, DispatchArgs&, CombineArgs& c, Store& s) {
                       c.x = s.make(DType::i32, c.x.shape());
                       return true;
                     },
                     {"x"}));
  m.push_back(change("x no columns",
                     [](int, DispatchArgs&, CombineArgs& c, Store& s) {
                       c.x = s.make(c.x.dtype(), {c.x.size(0), 0});
                       return true;
                     },
                     {"x", "hidden"}));
  m.push_back(change("x undefined",
                     [](int, DispatchArgs&, CombineArgs& c, Store&) {
                       c.x = Tensor();
                       return true;
                     },
                     {"x"}));
  m.push_back(change(
      "x wider (zeros)",
      [](int, DispatchArgs&, CombineArgs& c, Store& s) {
        c.x = s.make(c.x.dtype(), {c.x.size(0), c.x.size(1) + 2});
        return true;
      },
      {"hidden", "x"}, End::error, End::ok));
  m.push_back(change(
      "x non-contiguous",
      [](int, DispatchArgs&, CombineArgs& c, Store& s) {
        if (c.x.numel() == 0) return false;
        c.x = s.strided(c.x);
        return true;
      },
      {"x", "contiguous"}, End::either, End::either));
  m.push_back(change("handle missing",
                     [](int, DispatchArgs&, CombineArgs& c, Store&) {
                       c.handle.reset();
                       return true;
                     },
                     {"handle"}));
  m.push_back(change("handle of another Buffer",
                     [](int, DispatchArgs& a, CombineArgs& c, Store&) {
                       c.handle =
                           a.handle;  // the trial put the other Buffer's handle of the same dispatch there
                       return true;
                     },
                     {"handle", "Buffer"}));
  m.push_back(change("topk_weights shape",
                     [tp, K](int r, DispatchArgs&, CombineArgs& c, Store& s) {
                       c.topk_weights = s.make(DType::f32, {tp->P.ranks[r].num_tokens, K + 1});
                       return true;
                     },
                     {"topk_weights"}));
  m.push_back(change("bias shape",
                     [tp](int r, DispatchArgs&, CombineArgs& c, Store& s) {
                       c.bias = s.make(c.x.dtype(), {tp->P.ranks[r].num_tokens + 1, c.x.size(1)});
                       return true;
                     },
                     {"bias"}));
  m.push_back(change("bias dtype",
                     [tp](int r, DispatchArgs&, CombineArgs& c, Store& s) {
                       c.bias = s.make(c.x.dtype() == DType::f32 ? DType::bf16 : DType::f32,
                                       {tp->P.ranks[r].num_tokens, c.x.size(1)});
                       return true;
                     },
                     {"bias"}));
  m.push_back(change("stats dtype",
                     [R](int, DispatchArgs&, CombineArgs& c, Store& s) {
                       c.combine_send_cost_stats = s.make(DType::f32, {R});
                       return true;
                     },
                     {"combine_send_cost_stats"}));
  m.push_back(change(
      "stats i32",
      [R](int, DispatchArgs&, CombineArgs& c, Store& s) {
        c.combine_send_cost_stats = s.make(DType::i32, {R});
        return true;
      },
      {}, End::ok, End::ok));
  return m;
}

std::vector<Mut> cached_changes(const Trial& t) {
  const int64_t H = t.spec.hidden;
  const DType dt = t.spec.dtype;
  const Trial* tp = &t;
  std::vector<Mut> m;
  m.push_back(change("x one row more",
                     [=](int r, DispatchArgs& a, CombineArgs&, Store& s) {
                       a.x.data = s.make(dt, {tp->P.ranks[r].num_tokens + 1, H});
                       return true;
                     },
                     {"x"}));
  m.push_back(change("x no columns",
                     [=](int r, DispatchArgs& a, CombineArgs&, Store& s) {
                       a.x.data = s.make(dt, {tp->P.ranks[r].num_tokens, 0});
                       return true;
                     },
                     {"x", "hidden"}));
  m.push_back(change("topk_idx given",
                     [tp](int r, DispatchArgs& a, CombineArgs&, Store&) {
                       a.topk_idx = topk_idx_of(tp->P, r);
                       return true;
                     },
                     {"topk_idx"}));
  m.push_back(change("expert_alignment differs",
                     [tp](int, DispatchArgs& a, CombineArgs&, Store&) {
                       a.expert_alignment = tp->align + 1;
                       return true;
                     },
                     {"expert_alignment"}));
  m.push_back(change("num_worst_tokens differs",
                     [tp](int, DispatchArgs& a, CombineArgs&, Store&) {
                       a.num_worst_tokens = tp->worst + 7;
                       return true;
                     },
                     {"num_worst_tokens"}));
  m.push_back(change("receive_order differs",
                     [tp](int, DispatchArgs& a, CombineArgs&, Store&) {
                       a.receive_order = tp->order == ReceiveOrder::rank_major ? ReceiveOrder::expert_major
                                                                               : ReceiveOrder::rank_major;
                       return true;
                     },
                     {"receive_order"}));
  m.push_back(change(
      "x wider (zeros)",
      [=](int r, DispatchArgs& a, CombineArgs&, Store& s) {
        a.x.data = s.make(dt, {tp->P.ranks[r].num_tokens, H + 4});
        return true;
      },
      {"hidden"}, End::error, End::ok));
  add_int_changes(m, "expert_alignment", &DispatchArgs::expert_alignment);
  return m;
}

// ---- one trial
// ----------------------------------------------------------------------------------------------

struct Fuzz {
  RankCtx& ctx;
  Buffer buf, other;
  int clean_errors = 0, correct = 0;

  explicit Fuzz(RankCtx& c)
      : ctx(c),
        buf(c.group, test_options(4 << 20, kTimeoutS)),
        other(c.group, test_options(2 << 20, kTimeoutS)) {}

  void run(const Trial& t) {
    SplitMix64 g(hash_mix(t.seed, static_cast<uint64_t>(t.index), 0xC4A1));
    const int R = ctx.size;
    std::vector<Mut> muts = t.api == 0   ? dispatch_changes(t, g)
                            : t.api == 1 ? combine_changes(t)
                                         : cached_changes(t);
    const Mut& m = muts[g.below(muts.size())];
    std::vector<int> targets;
    if (g.below(10) < 7) {
      targets.push_back(static_cast<int>(g.below(R)));
    } else {
      for (int r = 0; r < R; ++r) targets.push_back(r);
    }
    try {
      once(t, m, targets);
    } catch (const std::exception& e) {
      throw std::runtime_error(epcomm::detail::cat(
          "fuzz seed ", t.seed, " trial ", t.index, " [",
          t.api == 0   ? "dispatch"
          : t.api == 1 ? "combine"
                       : "cached",
          ": ", m.label, ", on ", targets.size() == static_cast<size_t>(R) ? "every rank" : "one rank",
          "] rank ", ctx.rank, ": ", e.what(), "\n  reproduce: EPCOMM_FUZZ_SEED=", t.seed,
          " EPCOMM_FUZZ_TRIAL=", t.index, " multirank_tests --case fuzz_arguments --launcher thread --np ",
          R));
    }
  }

  // Every rank's valid arguments of the trial's call (the handle only on this rank: it is this rank's).
  void valid_args(const Trial& t, const DispatchResult& d, std::vector<DispatchArgs>& da,
                  std::vector<CombineArgs>& ca, Store& st) {
    for (int s = 0; s < ctx.size; ++s) {
      if (t.api == 0) {
        da[s] = fresh_args(t, s, st);
        continue;
      }
      da[s].x.data = x_of(t.P, s);
      da[s].handle = d.handle;
      const RefDispatch ref = ref_dispatch(t.P, s, t.order, t.align, t.worst);
      Tensor rx = st.make(t.spec.dtype, {ref.num_rows, t.spec.hidden});
      if (rx.nbytes()) std::memcpy(rx.data(), ref.recv_x.data(), rx.nbytes());
      ca[s].x = s == ctx.rank ? d.recv_x.data : rx;
      ca[s].handle = d.handle;
      if (t.order == ReceiveOrder::rank_major) {
        Tensor w = st.make(DType::f32, {ref.num_rows, t.spec.num_topk});
        if (w.nbytes()) std::memcpy(w.data(), ref.recv_topk_weights.data(), w.nbytes());
        ca[s].topk_weights = s == ctx.rank ? *d.recv_topk_weights : w;
      }
    }
  }

  void once(const Trial& t, const Mut& m, const std::vector<int>& targets) {
    const int R = ctx.size, me = ctx.rank;
    Store st;
    DispatchResult d;
    if (t.api != 0) {  // combine and cached dispatch start from a checked fresh dispatch
      DispatchArgs a = fresh_args(t, me, st);
      d = buf.dispatch(a);
      check_dispatch(d, t.P, a, me, "the dispatch before");
    }
    std::vector<DispatchArgs> da(R), eff_d;
    std::vector<CombineArgs> ca(R), eff_c;
    valid_args(t, d, da, ca, st);
    if (m.label == "handle of another Buffer")  // collective on every rank
      da[me].handle = other.dispatch(fresh_args(t, me, st)).handle;
    eff_d = da;
    eff_c = ca;
    std::vector<int> changed;
    for (int s : targets)
      if (m.apply(s, eff_d[s], eff_c[s], st)) changed.push_back(s);
    const End expect = changed.empty()                         ? End::ok
                       : m.decide                              ? m.decide(changed)
                       : static_cast<int>(changed.size()) == R ? m.all
                                                               : m.one;
    DispatchResult out;
    CombineResult cr;
    Outcome o = outcome_of([&] {
      if (t.api == 1) {
        cr = buf.combine(eff_c[me]);
        cr.event.wait();
      } else {
        out = buf.dispatch(eff_d[me]);
        out.event.wait();
      }
    });
    if (!judge(gather(ctx, o), expect, m, changed)) {
      verify(t, eff_d, eff_c, out, cr);
      ++correct;
      return;
    }
    ++clean_errors;
    RoundTrip rt;  // the next calls on this Buffer pair, and are correct
    rt.spec = t.spec;
    rt.order = t.order;
    rt.expert_alignment = t.align;
    rt.num_worst_tokens = t.worst;
    rt.cached = t.api == 2;
    run_round_trip(ctx, buf, rt);
  }

  // A result: equal to the reference of every rank's arguments as passed.
  void verify(const Trial& t, const std::vector<DispatchArgs>& da, const std::vector<CombineArgs>& ca,
              const DispatchResult& out, const CombineResult& cr) {
    const int me = ctx.rank, R = ctx.size;
    if (t.api == 0) return check_dispatch(out, problem_of(t, da, me), da[me], me, "changed call");
    if (t.api == 2) {
      std::vector<std::vector<uint8_t>> new_x(R);
      for (int s = 0; s < R; ++s) new_x[s] = bytes_any(da[s].x.data);
      const size_t row_bytes = static_cast<size_t>(da[me].x.data.size(1)) * dtype_size(da[me].x.data.dtype());
      const std::vector<uint8_t> want =
          ref_cached_dispatch(t.P, me, t.order, t.align, t.worst, new_x, row_bytes);
      return check_rows_equal("cached recv_x", tensor_bytes(out.recv_x.data), want, row_bytes,
                              da[me].x.data.dtype());
    }
    std::vector<std::vector<uint8_t>> fed(R);
    std::vector<std::vector<float>> recv_w(R);
    for (int s = 0; s < R; ++s) {
      fed[s] = bytes_any(ca[s].x);
      if (ca[s].topk_weights) {
        std::vector<uint8_t> w = bytes_any(*ca[s].topk_weights);
        recv_w[s].assign(w.size() / 4, 0.f);
        if (!w.empty()) std::memcpy(recv_w[s].data(), w.data(), w.size());
      }
    }
    const Tensor& x = ca[me].x;
    const bool rank_w = t.order == ReceiveOrder::rank_major;
    RefCombine rc = ref_combine(t.P, me, t.order, t.align, t.worst, x.dtype(), x.size(1), fed, nullptr,
                                rank_w ? &recv_w : nullptr, {});
    check_rows_equal("combined_x", tensor_bytes(cr.combined_x), rc.combined_x,
                     static_cast<size_t>(x.size(1)) * dtype_size(x.dtype()), x.dtype());
  }
};

int64_t env_int(const char* name, int64_t def) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoll(v) : def;
}

}  // namespace

MR_CASE("fuzz_arguments", {.min_ranks = 2}) {
  const uint64_t seed = static_cast<uint64_t>(env_int("EPCOMM_FUZZ_SEED", 1));
  const int64_t trials = env_int("EPCOMM_FUZZ_TRIALS", 1000), only = env_int("EPCOMM_FUZZ_TRIAL", -1);
  Fuzz f(ctx);
  const int64_t first = only >= 0 ? only : 0, last = only >= 0 ? only + 1 : trials;
  for (int64_t i = first; i < last; ++i) f.run(make_trial(seed, static_cast<int>(i), ctx.size));
  if (ctx.rank == 0)
    std::printf("fuzz_arguments: seed %llu, %lld trials: %d clean errors, %d correct results\n",
                static_cast<unsigned long long>(seed), static_cast<long long>(last - first), f.clean_errors,
                f.correct);
  REQUIRE(only >= 0 || trials < 50 || (f.clean_errors > 0 && f.correct > 0), "the fuzz saw only one ending");
}

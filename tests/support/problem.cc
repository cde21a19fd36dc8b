// support/problem.cc — seeded problem generation and the tagged/random payloads of problem.h.
#include "support/problem.h"

#include <cstring>
#include <stdexcept>
#include <string>

#include "support/ref_float.h"
#include "support/rng.h"

namespace epcomm::testing {

namespace {

constexpr int kMaxTaggedRanks = 128;
constexpr int64_t kMaxTaggedTokens = int64_t{1} << 21;

// Seed-stream ids, so that the streams of different purposes never coincide.
enum Stream : uint64_t { kStreamTokens = 1, kStreamRouting = 2, kStreamWeights = 3, kStreamPayload = 4 };

void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument("ProblemSpec: " + message);
}

bool is_float_dtype(DType dtype) {
  return dtype == DType::bf16 || dtype == DType::f16 || dtype == DType::f32;
}

void store_exact(DType dtype, float value, uint8_t* out) {
  store_rounded(dtype, value, out);
}

// Bit patterns a payload must carry byte for byte: NaNs of several signs and payloads, -0, subnormals, Inf.
uint32_t special_bits(DType dtype, uint64_t pick) {
  static constexpr uint32_t kBf16[] = {0x7FC0, 0xFFC1, 0x7F81, 0x8000, 0x0001, 0x807F, 0x7F80, 0xFF80};
  static constexpr uint32_t kF16[] = {0x7E00, 0xFE01, 0x7C01, 0x8000, 0x0001, 0x83FF, 0x7C00, 0xFC00};
  static constexpr uint32_t kF32[] = {0x7FC00000, 0xFFC00001, 0x7F800001, 0x80000000,
                                      0x00000001, 0x807FFFFF, 0x7F800000, 0xFF800000};
  switch (dtype) {
    case DType::bf16:
      return kBf16[pick % 8];
    case DType::f16:
      return kF16[pick % 8];
    default:
      return kF32[pick % 8];
  }
}

// One top-k row per the routing rules of ProblemSpec. Draw order is fixed: the result is a pure function of
// the generator state.
void make_topk_row(const ProblemSpec& spec, SplitMix64& rng, int64_t* row) {
  const int num_local = spec.num_experts / spec.num_ranks;
  for (int k = 0; k < spec.num_topk; ++k) {
    row[k] = -1;
    if (spec.routing == ProblemSpec::Routing::all_empty) continue;
    if (rng.unit() < spec.neg_prob) continue;
    int num_valid = 0;
    for (int j = 0; j < k; ++j) num_valid += row[j] >= 0;
    if (num_valid > 0 && rng.unit() < spec.dup_prob) {
      int pick = static_cast<int>(rng.below(static_cast<uint64_t>(num_valid)));
      for (int j = 0; j < k; ++j) {
        if (row[j] < 0) continue;
        if (pick-- == 0) {
          row[k] = row[j];
          break;
        }
      }
      continue;
    }
    int64_t first = 0, count = spec.num_experts;
    if (spec.routing == ProblemSpec::Routing::skewed_one_rank) {
      first = static_cast<int64_t>(spec.skew_rank) * num_local;
      count = num_local;
    }
    // Avoid repeating an expert of this row (a few tries; repeats stay possible when K > count).
    int64_t expert = first + static_cast<int64_t>(rng.below(static_cast<uint64_t>(count)));
    for (int attempt = 0; attempt < 8; ++attempt) {
      bool repeated = false;
      for (int j = 0; j < k; ++j) repeated = repeated || row[j] == expert;
      if (!repeated) break;
      expert = first + static_cast<int64_t>(rng.below(static_cast<uint64_t>(count)));
    }
    row[k] = expert;
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------
// Problem
// ---------------------------------------------------------------------------------------------------------

size_t Problem::row_bytes() const {
  return static_cast<size_t>(spec.hidden) * elem_size(spec.dtype);
}

Problem make_problem(const ProblemSpec& spec) {
  require(spec.num_ranks >= 1 && spec.num_ranks < kMaxTaggedRanks, "num_ranks must be in [1, 127]");
  require(spec.num_experts >= 1 && spec.num_experts % spec.num_ranks == 0,
          "num_experts must be a positive multiple of num_ranks");
  require(spec.num_topk >= 1, "num_topk must be >= 1");
  require(spec.hidden >= 1, "hidden must be >= 1");
  require(is_float_dtype(spec.dtype), "dtype must be bf16, f16 or f32");
  require(spec.min_tokens >= 0 && spec.min_tokens <= spec.max_tokens && spec.max_tokens < kMaxTaggedTokens,
          "need 0 <= min_tokens <= max_tokens < 2^21");
  require(spec.tokens_override.empty() || spec.tokens_override.size() == static_cast<size_t>(spec.num_ranks),
          "tokens_override must be empty or have num_ranks entries");
  for (int64_t t : spec.tokens_override)
    require(t >= 0 && t < kMaxTaggedTokens, "tokens_override out of range");
  require(spec.skew_rank >= 0 && spec.skew_rank < spec.num_ranks, "skew_rank out of range");

  Problem problem;
  problem.spec = spec;
  problem.ranks.resize(static_cast<size_t>(spec.num_ranks));
  const int64_t K = spec.num_topk;
  for (int s = 0; s < spec.num_ranks; ++s) {
    RankInputs& in = problem.ranks[static_cast<size_t>(s)];
    SplitMix64 token_rng(hash_mix(spec.seed, kStreamTokens, static_cast<uint64_t>(s)));
    in.num_tokens = spec.tokens_override.empty() ? token_rng.between(spec.min_tokens, spec.max_tokens)
                                                 : spec.tokens_override[static_cast<size_t>(s)];
    const int64_t T = in.num_tokens;

    in.topk_idx.assign(static_cast<size_t>(T * K), -1);
    SplitMix64 routing_rng(hash_mix(spec.seed, kStreamRouting, static_cast<uint64_t>(s)));
    for (int64_t t = 0; t < T; ++t)
      make_topk_row(spec, routing_rng, &in.topk_idx[static_cast<size_t>(t * K)]);

    in.topk_weights =
        make_random_weights(T * K, hash_mix(spec.seed, kStreamWeights, static_cast<uint64_t>(s)));
    in.x = make_payload(s, T, spec.hidden, spec.dtype, spec.random_bits, spec.seed);
  }
  return problem;
}

void validate_problem(const Problem& problem) {
  const ProblemSpec& spec = problem.spec;
  require(spec.num_ranks >= 1, "num_ranks must be >= 1");
  require(spec.num_experts >= 1 && spec.num_experts % spec.num_ranks == 0,
          "num_experts must be a positive multiple of num_ranks");
  require(spec.num_topk >= 1 && spec.hidden >= 1, "num_topk and hidden must be >= 1");
  require(problem.ranks.size() == static_cast<size_t>(spec.num_ranks), "ranks.size() != num_ranks");
  for (size_t s = 0; s < problem.ranks.size(); ++s) {
    const RankInputs& in = problem.ranks[s];
    const std::string where = "rank " + std::to_string(s) + ": ";
    const size_t pairs = static_cast<size_t>(in.num_tokens * spec.num_topk);
    require(in.num_tokens >= 0, where + "num_tokens < 0");
    require(in.topk_idx.size() == pairs, where + "topk_idx must have T*K entries");
    require(in.topk_weights.size() == pairs, where + "topk_weights must have T*K entries");
    require(in.x.size() == static_cast<size_t>(in.num_tokens) * problem.row_bytes(),
            where + "x must have T*H*elem_size bytes");
  }
}

// ---------------------------------------------------------------------------------------------------------
// Payloads
// ---------------------------------------------------------------------------------------------------------

float tag_value(int s, int64_t t, int64_t h) {
  if (h == 0) return static_cast<float>(s + 1);
  if (h <= 3) return static_cast<float>(((t >> (7 * (h - 1))) & 0x7F) + 1);
  const int64_t mix = (131 * int64_t{s} + 29 * t + 7 * h) % 255;
  return static_cast<float>(mix - 127);
}

void write_tagged_row(int s, int64_t t, int64_t hidden, DType dtype, uint8_t* out) {
  const size_t elem = elem_size(dtype);
  for (int64_t h = 0; h < hidden; ++h) store_exact(dtype, tag_value(s, t, h), out + h * elem);
}

std::optional<RowTag> decode_row_tag(const uint8_t* row, int64_t hidden, DType dtype) {
  if (!is_float_dtype(dtype) || hidden < 1) return std::nullopt;
  const float s_plus_1 = load_f32(dtype, row, 0);
  if (!(s_plus_1 >= 1.0f && s_plus_1 <= kMaxTaggedRanks)) return std::nullopt;
  const int s = static_cast<int>(s_plus_1) - 1;
  int64_t t = 0;
  for (int64_t h = 1; h <= 3 && h < hidden; ++h) {
    const float digit_plus_1 = load_f32(dtype, row, h);
    if (!(digit_plus_1 >= 1.0f && digit_plus_1 <= 128.0f)) return std::nullopt;
    t |= (static_cast<int64_t>(digit_plus_1) - 1) << (7 * (h - 1));
  }
  // Accept only an exact re-encoding: catches fractional values, column shifts and corrupted tails.
  const size_t elem = elem_size(dtype);
  std::vector<uint8_t> expect(static_cast<size_t>(hidden) * elem);
  write_tagged_row(s, t, hidden, dtype, expect.data());
  if (std::memcmp(expect.data(), row, expect.size()) != 0) return std::nullopt;
  return RowTag{s, t};
}

std::string describe_row_tag(const uint8_t* row, int64_t hidden, DType dtype) {
  const std::optional<RowTag> tag = decode_row_tag(row, hidden, dtype);
  if (!tag) return "untagged";
  return "(s=" + std::to_string(tag->rank) + ", t=" + std::to_string(tag->token) + ")";
}

std::vector<uint8_t> make_payload(int s, int64_t num_tokens, int64_t hidden, DType dtype, bool random_bits,
                                  uint64_t seed) {
  if (!is_float_dtype(dtype)) throw std::invalid_argument("make_payload: dtype must be bf16, f16 or f32");
  const size_t elem = elem_size(dtype);
  const size_t row = static_cast<size_t>(hidden) * elem;
  std::vector<uint8_t> x(static_cast<size_t>(num_tokens) * row);
  if (!random_bits) {
    for (int64_t t = 0; t < num_tokens; ++t) write_tagged_row(s, t, hidden, dtype, x.data() + t * row);
    return x;
  }
  SplitMix64 rng(hash_mix(seed, kStreamPayload, static_cast<uint64_t>(s)));
  for (size_t i = 0; i < x.size(); i += elem) {
    const uint64_t r = rng.next();
    uint32_t bits = static_cast<uint32_t>(r >> 32);
    if ((r & 7) == 0) bits = special_bits(dtype, r >> 3);
    std::memcpy(x.data() + i, &bits, elem);  // little-endian: the low elem bytes
  }
  return x;
}

float expert_output_value(uint64_t seed, int s, int64_t t, int k, int64_t h, DType dtype) {
  const uint64_t r = hash_mix(seed, static_cast<uint64_t>(s), static_cast<uint64_t>(t),
                              static_cast<uint64_t>(static_cast<int64_t>(k)), static_cast<uint64_t>(h));
  const uint32_t sign = static_cast<uint32_t>(r & 1) << 31;
  const uint32_t exponent = 127 - 3 + static_cast<uint32_t>((r >> 1) % 6);  // 2^-3 .. 2^2
  const uint32_t fraction = static_cast<uint32_t>(r >> 40) & 0x7FFFFF;
  uint8_t buf[4];
  store_rounded(dtype, f32_from_bits(sign | (exponent << 23) | fraction), buf);
  return load_f32(dtype, buf, 0);
}

std::vector<uint8_t> make_expert_output(uint64_t seed, const std::vector<int32_t>& src_rank,
                                        const std::vector<int32_t>& src_token,
                                        const std::vector<int32_t>& src_slot, DType dtype, int64_t hidden) {
  if (!is_float_dtype(dtype))
    throw std::invalid_argument("make_expert_output: dtype must be bf16, f16 or f32");
  if (src_token.size() != src_rank.size() || src_slot.size() != src_rank.size())
    throw std::invalid_argument("make_expert_output: source arrays differ in length");
  const size_t elem = elem_size(dtype);
  const size_t row = static_cast<size_t>(hidden) * elem;
  std::vector<uint8_t> out(src_rank.size() * row, 0xFF);
  for (size_t i = 0; i < src_rank.size(); ++i) {
    if (src_rank[i] < 0) continue;
    for (int64_t h = 0; h < hidden; ++h) {
      const float v = expert_output_value(seed, src_rank[i], src_token[i], src_slot[i], h, dtype);
      store_exact(dtype, v, out.data() + i * row + static_cast<size_t>(h) * elem);
    }
  }
  return out;
}

std::vector<uint8_t> make_random_rows(int64_t num_rows, int64_t hidden, DType dtype, uint64_t seed) {
  if (!is_float_dtype(dtype)) throw std::invalid_argument("make_random_rows: dtype must be bf16, f16 or f32");
  const size_t elem = elem_size(dtype);
  std::vector<uint8_t> out(static_cast<size_t>(num_rows * hidden) * elem);
  for (int64_t i = 0; i < num_rows; ++i)
    for (int64_t h = 0; h < hidden; ++h)
      store_exact(dtype, expert_output_value(seed, -2, i, -2, h, dtype),
                  out.data() + static_cast<size_t>(i * hidden + h) * elem);
  return out;
}

std::vector<float> make_random_weights(int64_t count, uint64_t seed) {
  SplitMix64 rng(seed);
  std::vector<float> w(static_cast<size_t>(count));
  for (float& v : w) {
    const uint64_t odd = ((rng.next() >> 41) << 1) | 1;  // < 2^24: exact in f32
    v = static_cast<float>(odd) * 0x1.0p-25f;
  }
  return w;
}

}  // namespace epcomm::testing

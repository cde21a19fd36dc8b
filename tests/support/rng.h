// support/rng.h — SplitMix64, the test suite's only random source: the same seed gives the same stream with
// every compiler and standard library (std::*_distribution does not).
#pragma once

#include <cstdint>

namespace epcomm::testing {

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}

  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n) for n >= 1 (modulo bias is irrelevant for test inputs).
  uint64_t below(uint64_t n) { return next() % n; }
  // Uniform in [lo, hi], lo <= hi.
  int64_t between(int64_t lo, int64_t hi) {
    return lo + static_cast<int64_t>(below(static_cast<uint64_t>(hi - lo) + 1));
  }
  // Uniform in [0, 1) with 53 random bits.
  double unit() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

 private:
  uint64_t state_;
};

// Stateless hash of a few integers, for values that must be a pure function of their coordinates.
inline uint64_t hash_mix(uint64_t a, uint64_t b = 0, uint64_t c = 0, uint64_t d = 0, uint64_t e = 0) {
  SplitMix64 g(a);
  uint64_t h = g.next();
  for (uint64_t v : {b, c, d, e}) {
    SplitMix64 step(h ^ (v * 0xD6E8FEB86659FD93ull));
    h = step.next();
  }
  return h;
}

}  // namespace epcomm::testing

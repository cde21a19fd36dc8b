// unit/copy_kernels_test.cc — copy_row and copy_row_to (engine/kernels.cc): every destination gets the
// source's bytes exactly, whatever the size (streaming body, 64-byte steps, memcpy tail, the plain path below
// the streaming threshold), the number of destinations and their alignment, and nothing outside the row is
// written.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "engine/kernels.h"
#include "support/rng.h"

namespace epcomm::engine {
namespace {

using testing::SplitMix64;

constexpr size_t kGuard = 128;  // bytes checked untouched on each side of every destination row
constexpr uint8_t kFill = 0xC3;

TEST(CopyKernels, EveryDestinationGetsTheRowAndNothingElse) {
  SplitMix64 rng(21);
  // Below the streaming threshold (2048), exactly at it, and sizes ending after the 256- and 64-byte steps.
  const size_t sizes[] = {0, 1, 63, 64, 200, 2047, 2048, 2048 + 64 + 5, 4096 + 255, 14336, 14336 + 100};
  for (size_t bytes : sizes)
    for (int n : {0, 1, 2, 3, 8})
      for (size_t misalign : {size_t{0}, size_t{8}, size_t{32}}) {  // of the last destination only
        std::vector<uint8_t> src(bytes + 1);
        for (auto& b : src) b = static_cast<uint8_t>(rng.below(256));
        const size_t stride = (bytes + 2 * kGuard + 64 + 63) / 64 * 64;
        std::vector<uint8_t> area(static_cast<size_t>(n) * stride + 128, kFill);
        uint8_t* base = area.data() + (64 - reinterpret_cast<uintptr_t>(area.data()) % 64) % 64;
        std::vector<uint8_t*> dsts;
        for (int j = 0; j < n; ++j) dsts.push_back(base + j * stride + kGuard + (j == n - 1 ? misalign : 0));
        copy_row_to(dsts.data(), n, src.data(), bytes);
        const std::string what = std::to_string(bytes) + " bytes to " + std::to_string(n) +
                                 " destinations, last misaligned by " + std::to_string(misalign);
        for (int j = 0; j < n; ++j) {
          ASSERT_EQ(0, std::memcmp(dsts[j], src.data(), bytes)) << what << ": destination " << j;
          for (size_t g = 1; g <= kGuard; ++g) {
            ASSERT_EQ(kFill, dsts[j][-static_cast<ptrdiff_t>(g)])
                << what << ": byte before destination " << j;
            ASSERT_EQ(kFill, dsts[j][bytes + g - 1]) << what << ": byte after destination " << j;
          }
        }
        if (n == 1) {  // copy_row is copy_row_to with one destination
          std::vector<uint8_t> again(bytes + 64, kFill);
          uint8_t* d = again.data() + (64 - reinterpret_cast<uintptr_t>(again.data()) % 64) % 64;
          copy_row(d, src.data(), bytes);
          ASSERT_EQ(0, std::memcmp(d, src.data(), bytes)) << what << ": copy_row";
        }
      }
}

}  // namespace
}  // namespace epcomm::engine

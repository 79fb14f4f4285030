// The split of a decode round's tensor-core tiles along K (src/cuda/experts/mma/split_plan.hpp,
// docs/design.md §4.1): the parts never take more CTA slots than the device has (each part's sums
// go to a slot of a buffer of that size), never fewer than kMinPartSlabs slabs each, and the
// parts' slabs cover a tile's K exactly once, in order.
#include "cuda/experts/mma/split_plan.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

namespace epmoe::cuda::experts::mma {
namespace {

TEST(SplitPlan, PartsStayWithinTheSlotsTheCapAndTheMinimumSlabs) {
  for (const std::uint32_t slots : {16u, 228u, 264u})
    for (std::uint32_t items = 0; items <= 600; ++items)
      for (std::uint32_t slabs = 1; slabs <= 64; ++slabs) {
        const std::uint32_t parts = split_parts(items, slabs, slots);
        const std::string at = "items=" + std::to_string(items) +
                               " slabs=" + std::to_string(slabs) +
                               " slots=" + std::to_string(slots);
        ASSERT_GE(parts, 1u) << at;
        ASSERT_LE(parts, kMaxParts) << at;
        if (parts > 1) {
          EXPECT_LE(items * parts, slots) << at;
          EXPECT_GE(slabs / parts, kMinPartSlabs) << at;
          EXPECT_LE(2 * items, slots) << at << ": a round filling over half the slots split";
        }
      }
}

TEST(SplitPlan, DecodeRoundsOfQwen3SplitInTwoAndLargerRoundsDoNot) {
  // qwen3-30b-a3b on an H200 (132 SMs, 264 slots), W = 1, T = 1: 8 experts x 12 FC1 tiles over
  // K = 2048 (32 slabs), 8 x 16 FC2 tiles over K = 768 (12 slabs).
  EXPECT_EQ(split_parts(96, 32, 264), 2u);
  EXPECT_EQ(split_parts(128, 12, 264), 2u);
  // One expert's rows (one chunk, 12 FC1 tiles): 4 parts, the cap.
  EXPECT_EQ(split_parts(12, 32, 264), 4u);
  // T = 16: about 100 experts x 12 tiles.
  EXPECT_EQ(split_parts(1200, 32, 264), 1u);
  // A K of one slab cannot split; no items, nothing to split.
  EXPECT_EQ(split_parts(1, 1, 264), 1u);
  EXPECT_EQ(split_parts(0, 32, 264), 1u);
}

TEST(SplitPlan, PartsCoverEverySlabOnceInOrder) {
  for (int slabs = 1; slabs <= 64; ++slabs)
    for (int parts = 1; parts <= static_cast<int>(kMaxParts) && parts <= slabs; ++parts) {
      int next = 0;
      for (int p = 0; p < parts; ++p) {
        const SlabRange r = part_slabs(p, parts, slabs);
        EXPECT_EQ(r.first, next) << "slabs=" << slabs << " parts=" << parts << " part " << p;
        EXPECT_GE(r.count, slabs / parts) << "slabs=" << slabs << " parts=" << parts;
        EXPECT_LE(r.count, slabs / parts + 1) << "slabs=" << slabs << " parts=" << parts;
        next = r.first + r.count;
      }
      EXPECT_EQ(next, slabs) << "slabs=" << slabs << " parts=" << parts;
    }
}

}  // namespace
}  // namespace epmoe::cuda::experts::mma

// The caps on the round's own grids per token bucket (src/cuda/round_grid_caps.hpp, docs/design.md
// I5): a CTA per token for dispatch and combine, a CTA per row every rank could send for route,
// a warp per such row for bucket; the prefill bucket's caps saturate instead of overflowing.
#include "cuda/round_grid_caps.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>

#include "epmoe/config.hpp"

namespace epmoe::cuda {
namespace {

TEST(RoundGridCaps, DecodeAndSmallBucketsCapEachKernelByTheWorkTheirLargestTCanBring) {
  const RoundGridCaps decode = round_grid_caps(bucket_max_tokens(TokenBucket::decode), 2, 256);
  EXPECT_EQ(decode.per_token, 16);
  EXPECT_EQ(decode.per_row, 32);
  EXPECT_EQ(decode.per_row_warp, 4);  // 32 rows, 8 warps a CTA
  const RoundGridCaps small = round_grid_caps(bucket_max_tokens(TokenBucket::small), 8, 256);
  EXPECT_EQ(small.per_token, 128);
  EXPECT_EQ(small.per_row, 1024);
  EXPECT_EQ(small.per_row_warp, 128);
  EXPECT_EQ(round_grid_caps(1024, 3, 256).per_row_warp, 384);  // 3072 rows
  EXPECT_EQ(round_grid_caps(1001, 1, 256).per_row_warp, 126);  // a partial CTA counts
}

TEST(RoundGridCaps, PerPairKernelsTakeWorldTimesTheLargestTTimesTopKPairs) {
  // decode, 2 ranks, top_k 8: 256 pairs; a warp per pair, 8 per CTA: 32 CTAs
  EXPECT_EQ(bucket_pairs(bucket_max_tokens(TokenBucket::decode), 2, 8), 256);
  EXPECT_EQ(ctas_for(256, 8), 32);
  EXPECT_EQ(ctas_for(256, 3), 86);  // a partial CTA counts
  EXPECT_EQ(ctas_for(1, 8), 1);
  // prefill saturates, whatever the world and top_k
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  EXPECT_EQ(bucket_pairs(bucket_max_tokens(TokenBucket::prefill), 64, 8), kMax);
  EXPECT_EQ(bucket_pairs(kMax / 4, 2, 8), kMax);
  EXPECT_GT(ctas_for(kMax, 8), std::int64_t{1} << 40);  // no wrap to a tiny grid
}

TEST(RoundGridCaps, ThePrefillBucketsCapsSaturateAndNeverBind) {
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  for (const int world : {1, 2, 8, 64}) {
    const RoundGridCaps caps = round_grid_caps(bucket_max_tokens(TokenBucket::prefill), world, 256);
    EXPECT_EQ(caps.per_token, kMax) << world;
    EXPECT_EQ(caps.per_row, kMax) << world;
    EXPECT_GT(caps.per_row_warp, std::int64_t{1} << 40) << world;  // no wrap to a tiny grid
  }
}

}  // namespace
}  // namespace epmoe::cuda

// Knobs the CUDA executor reads (docs/tuning.md#knobs), on 1 or 2 GPUs: num_sms (every kernel of
// the chain and the wgmma GEMMs' persistent grids) and the wgmma tile (block_m / block_n), each
// picked per launch from T's token bucket. Every output is checked against the emulating reference
// with the layer's rule (reference::check_output), and against the same layer with other knobs
// where the bits must not move:
//   * num_sms changes how many CTAs share the work, never the order of any sum (each tile, row or
//     pair is summed by one CTA in a fixed order; staged combine adds in slot order), so every math
//     gives the default knobs' bits;
//   * block_n 256 against 128 (wgmma's bf16 GEMMs): each output element is the same k16 WGMMA
//     steps over the same 64-deep k tiles in the same order, only more columns per instruction, so
//     the bits are expected to match too.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "epmoe/epmoe.hpp"
#include "harness/cluster.hpp"
#include "harness/device_batch.hpp"
#include "harness/problem.hpp"
#include "harness/rank_threads.hpp"
#include "support/captured_forward.hpp"
#include "support/watchdog.hpp"

namespace epmoe {
namespace {

using harness::Routing;
using reference::Batch;
using test::CapturedForward;
using test::within_seconds;

// H = 384 and 2I = 384: FC1's and FC2's N are one whole 256-wide tile and a half one; T = 1000
// puts 500 rows on an expert on average (several 128-row tiles and a partial one).
const LayerShape kShape{
    .hidden = 384, .intermediate = 192, .num_experts = 8, .top_k = 4, .max_tokens_per_rank = 1000};
// fp8_block128 needs H and I in whole 128-blocks.
const LayerShape kFp8Shape{
    .hidden = 384, .intermediate = 256, .num_experts = 8, .top_k = 4, .max_tokens_per_rank = 1000};

// One token count per bucket (decode with T = 0 and 1, small, medium).
const std::vector<std::int64_t> kTokenCounts{0, 1, 64, 1000};

// The same knobs in every bucket.
Cluster::Tune every_bucket(const Knobs& knobs) {
  return [knobs](const LayerConfig& c) { return with_knobs(c, knobs); };
}

// Knobs of the default table's decode entry with `edit` applied (the rest stays conflict-free).
template <class Edit>
Knobs knobs_with(const LayerShape& shape, Precision p, Edit edit) {
  Knobs k = default_knobs(p, 1, shape, TokenBucket::decode);
  edit(k);
  return k;
}

using Outputs = std::map<std::pair<int, std::int64_t>, std::vector<std::uint16_t>>;

// Every round of kTokenCounts on every rank of a cluster built with `tune`; each output checked
// against the reference with the layer's rule. Returns the outputs by (rank, T).
Outputs run_rounds(const LayerShape& shape, Precision p, ExpertMath math, const Cluster::Tune& tune,
                   const std::string& what, Combine combine = Combine::staged) {
  const int world = test::gpus_up_to(2);
  LayerOptions options;
  options.expert_math = math;
  options.combine = combine;
  options.timeout_ms = 20'000;
  const auto weights = harness::make_random_weights(shape, 41);
  Cluster cluster(shape, p, options, world, weights, Backend::cuda_nccl, {}, tune);
  Outputs out;
  std::mutex m;
  within_seconds(300, what.c_str(), [&] {
    run_on_rank_threads(world, [&](int rank) {
      for (std::size_t i = 0; i < kTokenCounts.size(); ++i) {
        const std::int64_t t = kTokenCounts[i];
        const Batch b = harness::make_random_batch(shape, world, t, Routing::uniform, 0,
                                                   50 * i + static_cast<std::uint64_t>(rank));
        const auto y = cluster.forward(rank, b);
        const auto ref = cluster.reference(0).forward(b);
        const reference::OutputCheck check =
            reference::check_output(y, ref, options.combine, math, p);
        EXPECT_TRUE(check.pass) << what << " rank " << rank << " T=" << t << " (" << check.rule
                                << "): " << check.stats.mismatches
                                << " elements outside, rel_l2=" << check.stats.rel_l2;
        const std::lock_guard<std::mutex> lock(m);
        out[{rank, t}] = y;
      }
    });
  });
  for (int r = 0; r < world; ++r) EXPECT_TRUE(cluster.layer(r).health().ok) << what;
  return out;
}

void expect_same_bits(const Outputs& a, const Outputs& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [key, y] : a) {
    const std::vector<std::uint16_t>& other = b.at(key);
    ASSERT_EQ(y.size(), other.size());
    std::size_t differ = 0;
    for (std::size_t i = 0; i < y.size(); ++i) differ += y[i] != other[i] ? 1 : 0;
    EXPECT_EQ(differ, 0u) << what << ": rank " << key.first << " T=" << key.second << ", " << differ
                          << " of " << y.size() << " elements differ";
  }
}

struct MathAndPrecision {
  ExpertMath math;
  Precision precision;
};

class GpuKnobsNumSms : public ::testing::TestWithParam<MathAndPrecision> {};

// num_sms = 8: every kernel of the chain on a grid of 8 SMs' occupancy, the wgmma GEMMs on 8
// persistent CTAs; the default knobs (num_sms = 0, all SMs) give the same bits.
TEST_P(GpuKnobsNumSms, EightSmsMatchTheReferenceAndTheDefaultKnobsBitForBit) {
  const auto [math, p] = GetParam();
  if (test::gpus_up_to(2) < 1) GTEST_SKIP() << "needs a GPU";
  const LayerShape& shape = p == Precision::fp8_block128 ? kFp8Shape : kShape;
  const Outputs all = run_rounds(shape, p, math, {}, "num_sms=0");
  const Outputs eight = run_rounds(
      shape, p, math,
      [](const LayerConfig& c) {
        LayerConfig out = c;
        for (int b = 0; b < kNumTokenBuckets; ++b) {  // each bucket keeps its own tile
          Knobs k = c.knobs(static_cast<TokenBucket>(b));
          k.num_sms = 8;
          out = with_knobs(out, k, static_cast<TokenBucket>(b));
        }
        return out;
      },
      "num_sms=8");
  expect_same_bits(all, eight, "num_sms=8 against num_sms=0");
}

std::vector<MathAndPrecision> num_sms_cases() {
  return {{ExpertMath::exact, Precision::mxfp8},
          {ExpertMath::tensor_core, Precision::nvfp4},
          {ExpertMath::wgmma, Precision::bf16},
          {ExpertMath::wgmma, Precision::mxfp8},
          {ExpertMath::wgmma, Precision::fp8_block128}};
}

INSTANTIATE_TEST_SUITE_P(Gpu, GpuKnobsNumSms, ::testing::ValuesIn(num_sms_cases()),
                         [](const auto& param_info) {
                           return std::string(to_string(param_info.param.math)) + "_" +
                                  to_string(param_info.param.precision);
                         });

class GpuKnobsWgmmaTile : public ::testing::TestWithParam<Precision> {};

// block_n = 256 (block_m = 128) runs wgmma's bf16 GEMMs on the 128 x 256 x 64 tile; the same layer
// on 128 x 128 gives the same bits. fp8_block128 ships 128 x 128 only: with_knobs moves 256 back.
// (mxfp8, nvfp4 and mxfp4 run the packed-weight GEMM, which reads no block_n: nothing to compare.)
TEST_P(GpuKnobsWgmmaTile, BlockN256MatchesTheReferenceAndThe128WideTileBitForBit) {
  const Precision p = GetParam();
  if (test::gpus_up_to(2) < 1) GTEST_SKIP() << "needs a GPU";
  const LayerShape& shape = p == Precision::fp8_block128 ? kFp8Shape : kShape;
  const Knobs wide = knobs_with(shape, p, [](Knobs& k) {
    k.block_m = 128;
    k.block_n = 256;
  });
  const Knobs narrow = knobs_with(shape, p, [](Knobs& k) {
    k.block_m = 128;
    k.block_n = 128;
  });
  LayerOptions options;
  options.expert_math = ExpertMath::wgmma;
  const LayerConfig tuned = with_knobs(make_config(shape, p, 0, 1, options), wide);
  EXPECT_EQ(tuned.knobs(TokenBucket::medium).block_n, p == Precision::fp8_block128 ? 128 : 256);
  const Outputs a = run_rounds(shape, p, ExpertMath::wgmma, every_bucket(narrow), "128x128");
  const Outputs b = run_rounds(shape, p, ExpertMath::wgmma, every_bucket(wide), "128x256");
  expect_same_bits(a, b, "block_n=256 against block_n=128");
}

INSTANTIATE_TEST_SUITE_P(Gpu, GpuKnobsWgmmaTile,
                         ::testing::Values(Precision::bf16, Precision::fp8_block128),
                         [](const auto& param_info) {
                           return std::string(to_string(param_info.param));
                         });

// mxfp8, mxfp4 and nvfp4 pick their packed GEMM per bucket: block_m 64 where an expert gets at
// most 16 rows (core::wgmma_16_row_tile; kShape's decode bucket: 8 at world 1, 16 at world 2) runs
// a 16-row tile, for mxfp8 and mxfp4 the E4M3 one (gather copies the wire rows, FC1's epilogue
// writes h as MXFP8; mxfp4's E2M1 codes converted to E4M3 in shared memory), for nvfp4 the decoding
// one with K split over two pairs of math warpgroups; 64 elsewhere (small, medium: 64 and 512
// rows), 128 and 256 decode the weights to bf16 (gather decodes MXFP8 wire rows). Each, in every
// bucket (T = 0, 1, 64, 1000), matches the reference; mixing them between rounds (the default
// table) too.
TEST(GpuKnobs, PackedPrecisionsRun16RowTilesOnFewRowsEachMatchingTheReference) {
  if (test::gpus_up_to(2) < 1) GTEST_SKIP() << "needs a GPU";
  for (const Precision p : {Precision::mxfp8, Precision::mxfp4, Precision::nvfp4}) {
    for (const std::int32_t rows : {64, 128, 256}) {
      const Knobs k = knobs_with(kShape, p, [rows](Knobs& kn) { kn.block_m = rows; });
      run_rounds(kShape, p, ExpertMath::wgmma, every_bucket(k),
                 std::string(to_string(p)) + " block_m=" + std::to_string(rows));
    }
    run_rounds(kShape, p, ExpertMath::wgmma, {}, std::string(to_string(p)) + " default knobs");
  }
}

// fp8_block128's block_m 64 runs the packed GEMM's E4M3 tile (16 token rows,
// core::wgmma_16_row_tile: the wire's FP8 rows times E4M3 weights, each k tile's sum promoted by
// both fp32 scales; FC1's sums to the activate kernel; FC2 sending the rows home,
// token_back=epilogue_warps, or leaving its sums to the home kernel, dispatch_warps) in every
// bucket, also where an expert gets 500 rows (T = 1000: 32 token tiles); 128 runs CUTLASS's
// blockwise GEMM. Each matches the reference in every bucket under both combines, and so does the
// default table (64 in decode only here); both token_back modes give the same bits staged (each
// result is bf16(sum + b2) of the same sum).
TEST(GpuKnobs, Fp8Block128RunsTheE4m3TileAtBlockM64MatchingTheReference) {
  if (test::gpus_up_to(2) < 1) GTEST_SKIP() << "needs a GPU";
  const Precision p = Precision::fp8_block128;
  LayerOptions options;
  options.expert_math = ExpertMath::wgmma;
  const LayerConfig defaults = make_config(kFp8Shape, p, 0, 1, options);
  EXPECT_EQ(defaults.knobs(TokenBucket::decode).block_m, 64);
  EXPECT_EQ(defaults.knobs(TokenBucket::medium).block_m, 128);
  EXPECT_FALSE(has_persistent_round(defaults, TokenBucket::decode))
      << "fp8_block128's E4M3 tile has no persistent round";
  Outputs out[2];
  for (const auto& [rows, mode] :
       {std::pair{64, TokenBack::epilogue_warps}, std::pair{64, TokenBack::dispatch_warps},
        std::pair{128, TokenBack::dispatch_warps}}) {
    const Knobs k = knobs_with(kFp8Shape, p, [rows, mode](Knobs& kn) {
      kn.block_m = rows;
      kn.token_back = mode;
    });
    EXPECT_EQ(with_knobs(defaults, k).knobs(TokenBucket::decode).token_back, mode);
    const std::string what =
        "fp8_block128 block_m=" + std::to_string(rows) + " token_back=" + to_string(mode);
    const Outputs staged = run_rounds(kFp8Shape, p, ExpertMath::wgmma, every_bucket(k), what);
    if (rows == 64) out[static_cast<int>(mode)] = staged;
    run_rounds(kFp8Shape, p, ExpertMath::wgmma, every_bucket(k), what + " in_kernel_reduce",
               Combine::in_kernel_reduce);
  }
  expect_same_bits(out[0], out[1], "fp8_block128: FC2 sending home against the home kernel");
  run_rounds(kFp8Shape, p, ExpertMath::wgmma, {}, "fp8_block128 default knobs");
}

// token_back in the E4M3 tile's buckets (mxfp8 and mxfp4, block_m 64; kShape's decode bucket):
// epilogue_warps, FC2's epilogue sends each row home (no home kernel), and dispatch_warps, FC2
// stores fp32 rows that the home kernel ships. Both match the reference under both combines and,
// staged, give the same bits (each result is bf16(sum + b2) of the same fp32 sum: mxfp8's and
// mxfp4's weights have no per-expert factor, so the home kernel's unscaling multiplies by 1; the
// in-kernel reduce's atomic adds have no fixed order).
TEST(GpuKnobs, E4m3TileSendsHomeFromFc2OrFromTheHomeKernelWithTheSameBits) {
  if (test::gpus_up_to(2) < 1) GTEST_SKIP() << "needs a GPU";
  for (const Precision p : {Precision::mxfp8, Precision::mxfp4}) {
    LayerOptions options;
    options.expert_math = ExpertMath::wgmma;
    const LayerConfig base = make_config(kShape, p, 0, 1, options);
    ASSERT_TRUE(has_persistent_round(base, TokenBucket::decode)) << "decode runs the E4M3 tile";
    Outputs out[2];
    for (const TokenBack mode : {TokenBack::epilogue_warps, TokenBack::dispatch_warps}) {
      const Knobs k = knobs_with(kShape, p, [mode](Knobs& kn) {
        kn.block_m = 64;
        kn.token_back = mode;
      });
      const LayerConfig tuned = with_knobs(base, k);
      EXPECT_EQ(tuned.knobs(TokenBucket::decode).token_back, mode);
      const std::string what = std::string(to_string(p)) + " token_back=" + to_string(mode);
      out[static_cast<int>(mode)] = run_rounds(kShape, p, ExpertMath::wgmma, every_bucket(k), what);
      run_rounds(kShape, p, ExpertMath::wgmma, every_bucket(k), what + " in_kernel_reduce",
                 Combine::in_kernel_reduce);
    }
    expect_same_bits(out[0], out[1],
                     std::string(to_string(p)) + ": FC2 sending home against the home kernel");
  }
}

// A graph captured at T = 1000 (medium: num_sms = 8 and the 128 x 256 tile there) keeps that
// bucket's launches when replayed between eager rounds at T = 5 (decode: the default knobs), and
// every round of both kinds matches the reference.
TEST(GpuKnobs, GraphKeepsItsCapturedBucketsKnobsBetweenEagerRoundsOfAnotherBucket) {
  const int world = test::gpus_up_to(2);
  if (world < 1) GTEST_SKIP() << "needs a GPU";
  const std::int64_t captured = 1000, eager = 5;
  LayerOptions options;
  options.expert_math = ExpertMath::wgmma;
  options.timeout_ms = 20'000;
  const auto weights = harness::make_random_weights(kShape, 43);
  const Cluster::Tune medium = [](const LayerConfig& c) {
    Knobs k = c.knobs(TokenBucket::medium);
    k.num_sms = 8;
    k.block_m = 128;
    k.block_n = 256;
    return with_knobs(c, k, TokenBucket::medium);
  };
  Cluster cluster(kShape, Precision::bf16, options, world, weights, Backend::cuda_nccl, {}, medium);
  ASSERT_EQ(cluster.layer(0).config().knobs_for(captured).block_n, 256);
  within_seconds(300, "graph and eager rounds", [&] {
    run_on_rank_threads(world, [&](int rank) {
      harness::DeviceBatch buf(rank, kShape);  // freed after the graph
      CapturedForward graph(cluster.layer(rank), buf, captured);
      ASSERT_TRUE(graph.ok());
      for (int round = 0; round < 10; ++round) {
        const bool replay = round % 2 == 0;
        const std::int64_t t = replay ? captured : eager;
        const Batch b = harness::make_random_batch(kShape, world, t, Routing::uniform, 0,
                                                   100 * round + static_cast<std::uint64_t>(rank));
        std::vector<std::uint16_t> y;
        if (replay) {
          buf.upload(b);
          ASSERT_EQ(graph.launch(), cudaSuccess);
          y = buf.download_y(t);
        } else {
          y = cluster.forward(rank, b);
        }
        const auto ref = cluster.reference(0).forward(b);
        const reference::OutputCheck check =
            reference::check_output(y, ref, options.combine, options.expert_math, Precision::bf16);
        EXPECT_TRUE(check.pass) << (replay ? "replay" : "eager") << " round " << round << " rank "
                                << rank << " (" << check.rule << "): " << check.stats.mismatches
                                << " elements outside, rel_l2=" << check.stats.rel_l2;
      }
    });
  });
  for (int r = 0; r < world; ++r)
    EXPECT_TRUE(cluster.layer(r).health().ok) << cluster.layer(r).health().what;
}

}  // namespace
}  // namespace epmoe

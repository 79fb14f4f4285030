// The persistent round (Knobs::megakernel, docs/design.md §4.3): one cooperative launch per
// forward, against the emulating reference with the tensor-core rule, on 1 and 2 GPUs; mixed with
// the chain round by round; under CUDA-graph replay; its faults named and recovered by reset();
// refused at creation where the backend has no persistent round; the wgmma backend's E4M3 tile
// (mxfp8, mxfp4) in one launch.
#include <cuda_runtime.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "epmoe/epmoe.hpp"
#include "epmoe/testing.hpp"
#include "harness/cluster.hpp"
#include "harness/device_batch.hpp"
#include "harness/problem.hpp"
#include "harness/rank_threads.hpp"
#include "support/captured_forward.hpp"
#include "support/matches_reference.hpp"
#include "support/random_pace.hpp"
#include "support/watchdog.hpp"

namespace epmoe {
namespace {

using harness::Routing;
using reference::Batch;
using test::within_seconds;
using ::testing::HasSubstr;

const LayerShape kShape{
    .hidden = 256, .intermediate = 128, .num_experts = 8, .top_k = 4, .max_tokens_per_rank = 1000};

// megakernel = true in the buckets `on` names (the other buckets keep the chain).
Cluster::Tune megakernel_in(std::vector<TokenBucket> on) {
  return [on](const LayerConfig& c) {
    LayerConfig out = c;
    for (TokenBucket b : on) {
      Knobs k = out.knobs(b);
      k.megakernel = true;
      out = with_knobs(out, k, b);
    }
    return out;
  };
}
const std::vector<TokenBucket> kEveryBucket{TokenBucket::decode, TokenBucket::small,
                                            TokenBucket::medium, TokenBucket::prefill};

LayerOptions tensor_core(Combine combine = Combine::staged, std::uint32_t timeout_ms = 20'000) {
  LayerOptions o;
  o.expert_math = ExpertMath::tensor_core;
  o.combine = combine;
  o.timeout_ms = timeout_ms;
  return o;
}

using test::expect_matches;

struct Scenario {
  Precision precision;
  Combine combine;
  int world;
};

class GpuPersistentMatchesReference : public ::testing::TestWithParam<Scenario> {};

// T = 0 (the idle round: route's barrier only), 1, 7, 64 and 1000 (chunks with remainders), and a
// last round with rank 0 idle while the others are full.
TEST_P(GpuPersistentMatchesReference, EveryTokenCountIncludingZero) {
  const Scenario sc = GetParam();
  if (cuda_device_count() < sc.world) GTEST_SKIP() << "needs " << sc.world << " GPUs";
  const auto weights = harness::make_random_weights(kShape, 3);
  Cluster cluster(kShape, sc.precision, tensor_core(sc.combine), sc.world, weights,
                  Backend::cuda_nccl, {}, megakernel_in(kEveryBucket));
  const std::vector<std::int64_t> token_counts{0, 1, 7, 64, 1000};
  within_seconds(300, "persistent rounds", [&] {
    run_on_rank_threads(sc.world, [&](int rank) {
      for (std::size_t i = 0; i < token_counts.size() + 1; ++i) {
        const std::int64_t t = i < token_counts.size()
                                   ? token_counts[i]
                                   : (rank == 0 ? 0 : kShape.max_tokens_per_rank);
        const Batch b = harness::make_random_batch(kShape, sc.world, t, Routing::uniform, 0,
                                                   100 * i + static_cast<std::uint64_t>(rank));
        expect_matches(cluster.forward(rank, b), b, cluster,
                       "rank " + std::to_string(rank) + " T=" + std::to_string(t));
      }
    });
  });
  for (int r = 0; r < sc.world; ++r) {
    EXPECT_TRUE(cluster.layer(r).health().ok) << cluster.layer(r).health().what;
    EXPECT_EQ(cluster.layer(r).next_round(), token_counts.size() + 2);
  }
}

std::vector<Scenario> persistent_scenarios() {
  std::vector<Scenario> out;
  for (int world : {1, 2})
    for (Precision p : {Precision::bf16, Precision::mxfp8, Precision::nvfp4, Precision::mxfp4})
      for (Combine c : {Combine::staged, Combine::in_kernel_reduce}) out.push_back({p, c, world});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Gpu, GpuPersistentMatchesReference,
                         ::testing::ValuesIn(persistent_scenarios()), [](const auto& param_info) {
                           return std::string(to_string(param_info.param.precision)) + "_" +
                                  to_string(param_info.param.combine) + "_world" +
                                  std::to_string(param_info.param.world);
                         });

// gpt-oss's expert (swiglu_oai, b13 and b2; H = 192: FC2's clamped last tile) and one expert
// taking every slot of every token (chunks of 64 with remainders), on the persistent round.
TEST(GpuPersistent, SwigluOaiWithBiasesAndOneExpertChunks) {
  const int world = test::gpus_up_to(2);
  if (world < 1) GTEST_SKIP() << "needs a GPU";
  const LayerShape shape{
      .hidden = 192, .intermediate = 192, .num_experts = 4, .top_k = 2, .max_tokens_per_rank = 96};
  auto weights = harness::make_random_weights(shape, 31);
  harness::add_random_biases(weights, shape, 32);
  for (Combine combine : {Combine::staged, Combine::in_kernel_reduce}) {
    LayerOptions options = tensor_core(combine);
    options.activation = Activation::swiglu_oai;
    options.swiglu_limit = 0.75f;
    Cluster cluster(shape, Precision::mxfp8, options, world, weights, Backend::cuda_nccl, {},
                    megakernel_in(kEveryBucket));
    within_seconds(300, "swiglu_oai persistent", [&] {
      run_on_rank_threads(world, [&](int rank) {
        for (const std::int64_t t : {std::int64_t{96}, std::int64_t{0}, std::int64_t{5}})
          for (Routing routing : {Routing::uniform, Routing::one_expert}) {
            const Batch b = harness::make_random_batch(shape, world, t, routing, 1,
                                                       90 + static_cast<std::uint64_t>(rank));
            expect_matches(cluster.forward(rank, b), b, cluster,
                           std::string(to_string(combine)) + " T=" + std::to_string(t));
          }
      });
    });
    for (int r = 0; r < world; ++r) EXPECT_TRUE(cluster.layer(r).health().ok);
  }
}

// Decode persistent, the other buckets chained: the two paths alternate round by round (one
// protocol, one round counter), with random pace and many idle ranks, no barrier between ranks.
TEST(GpuPersistent, MixedWithTheChainRandomPaceManyIdleRounds) {
  const int world = test::gpus_up_to(2);
  if (world < 1) GTEST_SKIP() << "needs a GPU";
  const LayerShape shape{256, 128, 8, 4, 64};
  const auto weights = harness::make_random_weights(shape, 9);
  Cluster cluster(shape, Precision::nvfp4, tensor_core(), world, weights, Backend::cuda_nccl, {},
                  megakernel_in({TokenBucket::decode}));
  test::PaceCounts n;
  within_seconds(300, "300 mixed rounds", [&] {
    n = test::run_at_random_pace(cluster, shape, world, 300, 7, [](harness::Rng& rng) {
      const double u = rng.uniform();  // idle, decode (persistent), small (chain)
      return u < 0.4 ? 0 : u < 0.7 ? 1 + rng.below(16) : 17 + rng.below(48);
    });
  });
  EXPECT_GE(n.idle * 10, n.total * 3) << "at least 30% zero-token rounds";
  for (int r = 0; r < world; ++r) EXPECT_EQ(cluster.layer(r).next_round(), 301u);
}

// One persistent launch captured in a CUDA graph, replayed with fresh routing (every tenth round
// drops every slot: no pair arrives, the idle path inside the graph).
TEST(GpuPersistent, GraphCapturedOnceReplaysWithFreshRouting) {
  const int world = test::gpus_up_to(2);
  if (world < 1) GTEST_SKIP() << "needs a GPU";
  const std::int64_t t = 8;  // decode bucket
  const auto weights = harness::make_random_weights(kShape, 12);
  Cluster cluster(kShape, Precision::mxfp8, tensor_core(), world, weights, Backend::cuda_nccl, {},
                  megakernel_in({TokenBucket::decode}));
  within_seconds(300, "persistent graph replays", [&] {
    run_on_rank_threads(world, [&](int rank) {
      harness::DeviceBatch buf(rank, kShape);
      test::CapturedForward graph(cluster.layer(rank), buf, t);
      ASSERT_TRUE(graph.ok());
      for (int replay = 0; replay < 60; ++replay) {
        const Routing routing = replay % 10 == 9 ? Routing::all_dropped : Routing::uniform;
        const Batch b =
            harness::make_random_batch(kShape, world, t, routing, 0, 1000 * replay + rank);
        buf.upload(b);
        ASSERT_EQ(graph.launch(), cudaSuccess);
        expect_matches(buf.download_y(t), b, cluster, "replay " + std::to_string(replay));
      }
    });
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_TRUE(cluster.layer(r).health().ok) << cluster.layer(r).health().what;
    EXPECT_EQ(cluster.layer(r).next_round(), 61u);
  }
}

// A rank that skips its launch is named by the persistent round of the other rank (the count
// wait, bounded), and a collective reset() brings both back.
TEST(GpuPersistent, SkippedLaunchIsNamedAndResetRecovers) {
  const int world = test::gpus_up_to(2);
  if (world < 2) GTEST_SKIP() << "needs 2 GPUs";
  const LayerShape shape{256, 128, 8, 4, 16};
  const auto weights = harness::make_random_weights(shape, 6);
  Cluster cluster(shape, Precision::bf16, tensor_core(Combine::staged, 500), world, weights,
                  Backend::cuda_nccl, {}, megakernel_in(kEveryBucket));
  testing::inject_fault(cluster.layer(1), {testing::Fault::skip_launch_when_idle});
  std::vector<Health> health(2);
  within_seconds(60, "skip-launch fault", [&] {
    run_on_rank_threads(world, [&](int rank) {
      cluster.forward(rank, harness::make_random_batch(shape, world, rank == 1 ? 0 : 8,
                                                       Routing::uniform, 0, 3));
      health[rank] = cluster.layer(rank).health();
    });
  });
  EXPECT_FALSE(health[0].ok);
  EXPECT_EQ(health[0].peer, 1) << health[0].what;
  EXPECT_EQ(health[0].phase, Phase::dispatch_counts) << health[0].what;
  EXPECT_THAT(health[0].what, HasSubstr("rank 1"));
  within_seconds(60, "reset", [&] { cluster.reset_all(); });
  within_seconds(60, "rounds after reset", [&] {
    run_on_rank_threads(world, [&](int rank) {
      for (int r = 0; r < 3; ++r) {
        const Batch b =
            harness::make_random_batch(shape, world, 5 + r, Routing::uniform, 0, 10 * r + rank);
        expect_matches(cluster.forward(rank, b), b, cluster, "after reset");
      }
    });
  });
  for (int r = 0; r < world; ++r) EXPECT_TRUE(cluster.layer(r).health().ok);
}

// A rank stalled before its launch: the other rank's count wait gives up and names it; the
// stalled rank's own round then sees the abort. reset() recovers.
TEST(GpuPersistent, StalledRankIsNamedAndResetRecovers) {
  const int world = test::gpus_up_to(2);
  if (world < 2) GTEST_SKIP() << "needs 2 GPUs";
  const LayerShape shape{256, 128, 8, 4, 16};
  const auto weights = harness::make_random_weights(shape, 6);
  Cluster cluster(shape, Precision::bf16, tensor_core(Combine::staged, 300), world, weights,
                  Backend::cuda_nccl, {}, megakernel_in(kEveryBucket));
  testing::inject_fault(cluster.layer(1), {testing::Fault::stall, 1500, 1});
  std::vector<Health> health(2);
  within_seconds(60, "stall fault", [&] {
    run_on_rank_threads(world, [&](int rank) {
      cluster.forward(rank, harness::make_random_batch(shape, world, 4, Routing::uniform, 0, 1));
      health[rank] = cluster.layer(rank).health();
    });
  });
  EXPECT_EQ(health[0].peer, 1) << health[0].what;
  EXPECT_EQ(health[0].phase, Phase::dispatch_counts) << health[0].what;
  EXPECT_FALSE(health[1].ok) << "the stalled rank learns its round was aborted";
  within_seconds(60, "reset", [&] { cluster.reset_all(); });
  within_seconds(60, "a round after reset", [&] {
    run_on_rank_threads(world, [&](int rank) {
      const Batch b = harness::make_random_batch(shape, world, 3, Routing::uniform, 0, 7 + rank);
      expect_matches(cluster.forward(rank, b), b, cluster, "after reset");
    });
  });
  for (int r = 0; r < world; ++r) EXPECT_TRUE(cluster.layer(r).health().ok);
}

// The wgmma backend's persistent round: mxfp8's and mxfp4's E4M3 tile (decode, block_m 64) in one
// launch, FC2 sending home from its epilogue (token_back=epilogue_warps) or staging its rows for
// every CTA's warps to send after a grid barrier (dispatch_warps), against the reference with the
// E4M3 rule; the other
// buckets chained in between (T = 64, 1000), so the two paths alternate; uniform routing and one
// expert taking every slot (several token tiles of one group); gpt-oss's activation with b13 and
// b2 (H = 192: FC2's partial weight block and an odd number of k tiles for the split-K pairs).
TEST(GpuPersistent, WgmmaE4m3TileInOneLaunchMatchesTheReference) {
  const int world = test::gpus_up_to(2);
  if (world < 1) GTEST_SKIP() << "needs a GPU";
  const auto decode_e4m3 = [](TokenBack token_back) {
    return [token_back](const LayerConfig& c) {
      Knobs k = c.knobs(TokenBucket::decode);
      k.megakernel = true;
      k.block_m = 64;
      k.token_back = token_back;
      const LayerConfig out = with_knobs(c, k, TokenBucket::decode);
      EXPECT_EQ(out.knobs(TokenBucket::decode).token_back, token_back);
      return out;
    };
  };
  const LayerShape oai_shape{
      .hidden = 192, .intermediate = 192, .num_experts = 4, .top_k = 2, .max_tokens_per_rank = 96};
  for (const bool oai : {false, true}) {
    const LayerShape& shape = oai ? oai_shape : kShape;
    auto weights = harness::make_random_weights(shape, oai ? 61 : 60);
    if (oai) harness::add_random_biases(weights, shape, 62);
    for (const Precision precision : {Precision::mxfp8, Precision::mxfp4})
      for (const Combine combine : {Combine::staged, Combine::in_kernel_reduce})
        for (const TokenBack token_back : {TokenBack::epilogue_warps, TokenBack::dispatch_warps}) {
          LayerOptions options;
          options.expert_math = ExpertMath::wgmma;
          options.combine = combine;
          options.timeout_ms = 20'000;
          if (oai) {
            options.activation = Activation::swiglu_oai;
            options.swiglu_limit = 0.75f;
          }
          const std::string what = std::string(to_string(precision)) + " " + to_string(combine) +
                                   " " + to_string(token_back) + (oai ? " swiglu_oai+biases" : "");
          Cluster cluster(shape, precision, options, world, weights, Backend::cuda_nccl, {},
                          decode_e4m3(token_back));
          const std::string hang = "wgmma persistent " + what;
          within_seconds(300, hang.c_str(), [&] {
            run_on_rank_threads(world, [&](int rank) {
              const std::vector<std::int64_t> token_counts{0, 1, 7, 16, 64, 16, 1, 0};
              for (std::size_t i = 0; i < token_counts.size(); ++i)
                for (const Routing routing : {Routing::uniform, Routing::one_expert}) {
                  const std::int64_t t = std::min(token_counts[i], shape.max_tokens_per_rank);
                  const Batch b = harness::make_random_batch(
                      shape, world, t, routing, 1, 1000 * i + static_cast<std::uint64_t>(rank));
                  expect_matches(
                      cluster.forward(rank, b), b, cluster,
                      what + " rank " + std::to_string(rank) + " T=" + std::to_string(t));
                }
            });
          });
          for (int r = 0; r < world; ++r)
            EXPECT_TRUE(cluster.layer(r).health().ok)
                << what << ": " << cluster.layer(r).health().what;
        }
  }
}

// exact (the float64 tile) has no persistent round, nor wgmma outside the E4M3 tile (bf16's
// CUTLASS GEMMs): a bucket asking for one is refused at creation, naming the knob and the way out.
TEST(GpuPersistent, RefusedWhereTheBackendHasNoPersistentRound) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  const auto weights = harness::make_random_weights(kShape, 1);
  for (ExpertMath math : {ExpertMath::exact, ExpertMath::wgmma}) {
    LayerOptions options;
    options.expert_math = math;
    try {
      Cluster cluster(kShape, Precision::bf16, options, 1, weights, Backend::cuda_nccl, {},
                      megakernel_in({TokenBucket::small}));
      ADD_FAILURE() << to_string(math) << ": megakernel=true was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::unsupported) << e.what();
      EXPECT_THAT(e.what(), HasSubstr("knobs.small.megakernel=true"));
      EXPECT_THAT(e.what(), HasSubstr("expert_math=tensor_core"));
    }
  }
}

}  // namespace
}  // namespace epmoe

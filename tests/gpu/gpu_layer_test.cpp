// The CUDA executor on 1, 2, 4 and 8 GPUs, as many as the machine has (run by tests/gpu/run.sh on a
// GPU machine; CI reports the GPU suite as skipped). Every check compares against the emulating
// reference forward with the rule of the layer's combine and expert math (reference::check_output):
// exact math with staged combine bit for bit, in-kernel reduce within one bf16 ulp, tensor cores to
// accumulation-order noise.
#include <cuda_runtime.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <future>
#include <limits>
#include <thread>

#include "cuda/experts/exact/exact_backend.hpp"
#include "cuda/experts/mma/mma_backend.hpp"
#include "epmoe/epmoe.hpp"
#include "epmoe/testing.hpp"
#include "formats/codec.hpp"
#include "harness/cluster.hpp"
#include "harness/device_batch.hpp"
#include "harness/problem.hpp"
#include "harness/rank_threads.hpp"
#include "math/quantize.hpp"
#include "support/captured_forward.hpp"
#include "support/device_vectors.hpp"
#include "support/exact_math.hpp"
#include "support/format_size.hpp"
#include "support/matches_reference.hpp"
#include "support/random_pace.hpp"
#include "support/watchdog.hpp"

namespace epmoe {
namespace {

using harness::Routing;
using reference::Batch;
using ::testing::HasSubstr;

const LayerShape kShape{
    .hidden = 256, .intermediate = 128, .num_experts = 8, .top_k = 4, .max_tokens_per_rank = 1000};

int gpus() {
  return cuda_device_count();
}

using test::within_seconds;

using test::expect_matches;

// Every expert backend: exact, mma.sync tensor cores, Hopper WGMMA grouped GEMMs.
constexpr ExpertMath kEveryMath[] = {ExpertMath::exact, ExpertMath::tensor_core, ExpertMath::wgmma};

struct Scenario {
  Precision precision;
  Combine combine;
  int world;
  ExpertMath math = ExpertMath::exact;
};

class GpuMatchesReference : public ::testing::TestWithParam<Scenario> {};

TEST_P(GpuMatchesReference, EveryTokenCountIncludingZero) {
  const Scenario sc = GetParam();
  if (gpus() < sc.world) GTEST_SKIP() << "needs " << sc.world << " GPUs";
  LayerOptions options;
  options.combine = sc.combine;
  options.expert_math = sc.math;
  options.timeout_ms = 20'000;
  const auto weights = harness::make_random_weights(kShape, 3);
  Cluster cluster(kShape, sc.precision, options, sc.world, weights, Backend::cuda_nccl);
  const std::vector<std::int64_t> token_counts{0, 1, 7, 24, 64, 1000};
  within_seconds(300, "rounds", [&] {
    run_on_rank_threads(sc.world, [&](int rank) {
      for (std::size_t i = 0; i < token_counts.size() + 1; ++i) {
        // The last round: rank 0 idle while the others are full.
        const std::int64_t t = i < token_counts.size()
                                   ? token_counts[i]
                                   : (rank == 0 ? 0 : kShape.max_tokens_per_rank);
        const Batch b = harness::make_random_batch(kShape, sc.world, t, Routing::uniform, 0,
                                                   100 * i + static_cast<std::uint64_t>(rank));
        const auto y = cluster.forward(rank, b);
        expect_matches(y, b, cluster, "rank " + std::to_string(rank) + " T=" + std::to_string(t));
      }
    });
  });
  for (int r = 0; r < sc.world; ++r) EXPECT_TRUE(cluster.layer(r).health().ok);
}

std::vector<Scenario> all_scenarios() {
  std::vector<Scenario> out;
  for (ExpertMath m : kEveryMath)
    for (int world : {1, 2, 4, 8})  // 4 and 8 skip, visibly, on machines with fewer GPUs
      for (Precision p : {Precision::bf16, Precision::mxfp8, Precision::nvfp4,
                          Precision::fp8_block128, Precision::mxfp4})
        for (Combine c : {Combine::staged, Combine::in_kernel_reduce})
          // fp8_block128 has no mma.sync backend (GpuWeights.TensorCoreRejectsFp8Block128...).
          if (!(p == Precision::fp8_block128 && m == ExpertMath::tensor_core))
            out.push_back({p, c, world, m});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Gpu, GpuMatchesReference, ::testing::ValuesIn(all_scenarios()),
                         [](const auto& param_info) {
                           return std::string(to_string(param_info.param.precision)) + "_" +
                                  to_string(param_info.param.combine) + "_world" +
                                  std::to_string(param_info.param.world) + "_" +
                                  to_string(param_info.param.math);
                         });

// gpt-oss's expert (swiglu_oai, b13 and b2) on both backends, world 1 and 2, both combines, every
// precision: H = 192 puts b2's last columns in FC2's clamped tile; a small clamp (0.75) clamps
// many gate and up values. Exact + staged stays bit-exact (the bias rule is math::biased).
class GpuSwigluOaiWithBiases : public ::testing::TestWithParam<Scenario> {};

TEST_P(GpuSwigluOaiWithBiases, MatchesTheReference) {
  const Scenario sc = GetParam();
  if (gpus() < sc.world) GTEST_SKIP() << "needs " << sc.world << " GPUs";
  const LayerShape shape{
      .hidden = 192, .intermediate = 192, .num_experts = 4, .top_k = 2, .max_tokens_per_rank = 96};
  auto weights = harness::make_random_weights(shape, 31);
  harness::add_random_biases(weights, shape, 32);
  LayerOptions options;
  options.combine = sc.combine;
  options.expert_math = sc.math;
  options.activation = Activation::swiglu_oai;
  options.swiglu_limit = 0.75f;
  options.timeout_ms = 20'000;
  Cluster cluster(shape, sc.precision, options, sc.world, weights, Backend::cuda_nccl);
  within_seconds(300, "swiglu_oai rounds", [&] {
    run_on_rank_threads(sc.world, [&](int rank) {
      for (const std::int64_t t : {std::int64_t{96}, std::int64_t{0}, std::int64_t{5}}) {
        const Batch b = harness::make_random_batch(shape, sc.world, t, Routing::uniform, 0,
                                                   90 + static_cast<std::uint64_t>(rank));
        const auto ref = cluster.reference(0).forward(b);
        const auto y = cluster.forward(rank, b);
        const reference::OutputCheck check =
            reference::check_output(y, ref, sc.combine, sc.math, sc.precision);
        EXPECT_TRUE(check.pass) << "rank " << rank << " T=" << t << " (" << check.rule
                                << "): " << check.stats.mismatches
                                << " elements outside, max_abs=" << check.stats.max_abs
                                << " rel_l2=" << check.stats.rel_l2;
      }
    });
  });
  for (int r = 0; r < sc.world; ++r) EXPECT_TRUE(cluster.layer(r).health().ok);
}

std::vector<Scenario> oai_scenarios() {
  std::vector<Scenario> out;
  for (ExpertMath m : kEveryMath)
    for (int world : {1, 2})
      for (Precision p : {Precision::bf16, Precision::mxfp8, Precision::nvfp4})
        for (Combine c : {Combine::staged, Combine::in_kernel_reduce})
          out.push_back({p, c, world, m});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Gpu, GpuSwigluOaiWithBiases, ::testing::ValuesIn(oai_scenarios()),
                         [](const auto& param_info) {
                           return std::string(to_string(param_info.param.precision)) + "_" +
                                  to_string(param_info.param.combine) + "_world" +
                                  std::to_string(param_info.param.world) + "_" +
                                  to_string(param_info.param.math);
                         });

TEST(Gpu, FiveHundredRoundsRandomPaceManyIdleRanksNoBarrier) {
  const int world = test::gpus_up_to(8);
  if (world < 2) GTEST_SKIP() << "needs 2 GPUs";
  const LayerShape shape{256, 128, 8, 4, 64};
  LayerOptions options = test::exact_math();
  options.timeout_ms = 20'000;
  const auto weights = harness::make_random_weights(shape, 9);
  Cluster cluster(shape, Precision::mxfp8, options, world, weights, Backend::cuda_nccl);
  test::PaceCounts n;
  within_seconds(300, "500 rounds", [&] {
    n = test::run_at_random_pace(cluster, shape, world, 500, 10, [&](harness::Rng& rng) {
      return rng.uniform() < 0.4 ? 0 : 1 + rng.below(shape.max_tokens_per_rank);
    });
  });
  EXPECT_GE(n.idle * 10, n.total * 3) << "at least 30% zero-token rounds";
  for (int r = 0; r < world; ++r) EXPECT_EQ(cluster.layer(r).next_round(), 501u);
}

TEST(Gpu, AllTokensToOneRanksExpertsAtMaxTokens) {
  const int world = test::gpus_up_to(8);
  if (world < 1) GTEST_SKIP() << "needs a GPU";
  const auto weights = harness::make_random_weights(kShape, 5);
  Cluster cluster(kShape, Precision::nvfp4, test::exact_math(), world, weights, Backend::cuda_nccl);
  within_seconds(300, "one-rank routing", [&] {
    run_on_rank_threads(world, [&](int rank) {
      const Batch b = harness::make_random_batch(kShape, world, kShape.max_tokens_per_rank,
                                                 Routing::one_rank, world - 1, 50 + rank);
      expect_matches(cluster.forward(rank, b), b, cluster, "one_rank");
    });
  });
}

// The expert step cuts an expert's rows into chunks of 64 and its columns into tiles: every slot
// of every token on one expert (duplicate ids: K pairs per row) at T = max gives that expert
// world x 1000 x 4 pairs, a last chunk with a remainder; T = 77 and T = 5 give remainders of their
// own, and T = 3 (world x 12 rows) the tensor-core tile's narrow form with two 8-row halves.
TEST(Gpu, ManyRowsOnOneExpertChunksWithRemainders) {
  const int world = test::gpus_up_to(8);
  if (world < 1) GTEST_SKIP() << "needs a GPU";
  const auto weights = harness::make_random_weights(kShape, 14);
  for (ExpertMath math : kEveryMath)
    for (Combine combine : {Combine::staged, Combine::in_kernel_reduce}) {
      LayerOptions options;
      options.combine = combine;
      options.expert_math = math;
      options.timeout_ms = 20'000;
      Cluster cluster(kShape, Precision::nvfp4, options, world, weights, Backend::cuda_nccl);
      within_seconds(300, "one-expert routing", [&] {
        run_on_rank_threads(world, [&](int rank) {
          for (const std::int64_t t :
               {kShape.max_tokens_per_rank, std::int64_t{77}, std::int64_t{5}, std::int64_t{3}}) {
            const Batch b = harness::make_random_batch(kShape, world, t, Routing::one_expert, 1,
                                                       60 + static_cast<std::uint64_t>(rank));
            expect_matches(cluster.forward(rank, b), b, cluster,
                           std::string(to_string(math)) + " " + to_string(combine) +
                               " T=" + std::to_string(t));
          }
        });
      });
      for (int r = 0; r < world; ++r) EXPECT_TRUE(cluster.layer(r).health().ok);
    }
}

// Hidden sizes that are multiples of 64 but not of 128 (gpt-oss: 2880): the last FC2 tile
// computes clamped columns it must never store, on both maths and every precision.
TEST(Gpu, HiddenSizeNotAMultipleOfTheColumnTile) {
  const int world = test::gpus_up_to(4);
  if (world < 1) GTEST_SKIP() << "needs a GPU";
  const LayerShape shape{
      .hidden = 192, .intermediate = 192, .num_experts = 4, .top_k = 2, .max_tokens_per_rank = 96};
  const auto weights = harness::make_random_weights(shape, 21);
  for (ExpertMath math : kEveryMath)
    for (Precision precision : {Precision::bf16, Precision::mxfp8, Precision::nvfp4,
                                Precision::fp8_block128, Precision::mxfp4}) {
      // fp8_block128: no mma.sync backend; wgmma's E4M3 GEMM takes K in whole 128-blocks.
      if (precision == Precision::fp8_block128 && math != ExpertMath::exact) continue;
      LayerOptions options;
      options.expert_math = math;
      options.timeout_ms = 20'000;
      // fp8_block128: a whole and a 64-wide 128-run per row, tiles 128 and 64 high.
      Cluster cluster(shape, precision, options, world, weights, Backend::cuda_nccl);
      within_seconds(300, "H = 192", [&] {
        run_on_rank_threads(world, [&](int rank) {
          for (const std::int64_t t : {std::int64_t{96}, std::int64_t{3}}) {
            const Batch b = harness::make_random_batch(shape, world, t, Routing::uniform, 0,
                                                       70 + static_cast<std::uint64_t>(rank));
            expect_matches(cluster.forward(rank, b), b, cluster,
                           std::string(to_string(math)) + " " + to_string(precision) +
                               " T=" + std::to_string(t));
          }
        });
      });
    }
}

// wgmma's nvfp4 activate holds an h row in a warp's registers, in two instantiations (up to 8 and
// up to 16 steps of 128 columns), and runs a RowGroup with the row in shared memory beyond
// (gpt-oss's 2880, Mixtral's 14336). Every other test's I takes the 8-step kernel; here I = 1088
// (the 16-step one, its last step 64 wide), 2048 (all 16 steps) and 2112 (the RowGroup, a 64-wide
// last step), against the reference.
TEST(Gpu, Nvfp4RowsOfEveryActivateKernelMatchTheReference) {
  const int world = test::gpus_up_to(2);
  if (world < 1) GTEST_SKIP() << "needs a GPU";
  for (const std::int64_t intermediate : {1088, 2048, 2112}) {
    const LayerShape shape{.hidden = 128,
                           .intermediate = intermediate,
                           .num_experts = 4,
                           .top_k = 2,
                           .max_tokens_per_rank = 64};
    const auto weights = harness::make_random_weights(shape, 22);
    for (Combine combine : {Combine::staged, Combine::in_kernel_reduce}) {
      LayerOptions options;
      options.expert_math = ExpertMath::wgmma;
      options.combine = combine;
      options.timeout_ms = 20'000;
      Cluster cluster(shape, Precision::nvfp4, options, world, weights, Backend::cuda_nccl);
      const std::string what = "I = " + std::to_string(intermediate);
      within_seconds(300, what.c_str(), [&] {
        run_on_rank_threads(world, [&](int rank) {
          for (const std::int64_t t : {std::int64_t{64}, std::int64_t{1}}) {
            const Batch b = harness::make_random_batch(shape, world, t, Routing::uniform, 0,
                                                       80 + static_cast<std::uint64_t>(rank));
            expect_matches(cluster.forward(rank, b), b, cluster,
                           what + " " + to_string(combine) + " T=" + std::to_string(t));
          }
        });
      });
    }
  }
}

TEST(Gpu, SkippedLaunchIsNamedOnTheOtherRankAndResetRecovers) {
  const int world = test::gpus_up_to(2);
  if (world < 2) GTEST_SKIP() << "needs 2 GPUs";
  LayerOptions options = test::exact_math();
  options.timeout_ms = 500;
  const LayerShape shape{256, 128, 8, 4, 16};
  const auto weights = harness::make_random_weights(shape, 6);
  Cluster cluster(shape, Precision::bf16, options, world, weights, Backend::cuda_nccl);
  testing::inject_fault(cluster.layer(1), {testing::Fault::skip_launch_when_idle});
  std::vector<Health> health(2);
  std::vector<double> seconds(2);
  within_seconds(60, "skip-launch fault", [&] {
    run_on_rank_threads(world, [&](int rank) {
      const auto start = std::chrono::steady_clock::now();
      const Batch b =
          harness::make_random_batch(shape, world, rank == 1 ? 0 : 8, Routing::uniform, 0, 3);
      cluster.forward(rank, b);  // the GPU path returns; the error shows in health()
      seconds[rank] =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      health[rank] = cluster.layer(rank).health();
    });
  });
  EXPECT_FALSE(health[0].ok);
  EXPECT_EQ(health[0].peer, 1) << health[0].what;
  EXPECT_EQ(health[0].phase, Phase::dispatch_counts) << health[0].what;
  EXPECT_EQ(health[0].round, 1u) << health[0].what;
  EXPECT_LT(seconds[0], 0.5 + 1.0);
  EXPECT_THAT(health[0].what, HasSubstr("rank 1"));
  // The next forward on rank 0 is refused without waiting; the CUDA context still works.
  const Batch b = harness::make_random_batch(shape, world, 2, Routing::uniform, 0, 4);
  EXPECT_THROW(cluster.forward(0, b), Error);
  EXPECT_EQ(cudaSetDevice(0), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  within_seconds(60, "reset", [&] { cluster.reset_all(); });
  within_seconds(60, "rounds after reset", [&] {
    run_on_rank_threads(world, [&](int rank) {
      for (int r = 0; r < 3; ++r) {
        const Batch bb =
            harness::make_random_batch(shape, world, 5 + r, Routing::uniform, 0, 10 * r + rank);
        expect_matches(cluster.forward(rank, bb), bb, cluster, "after reset");
      }
    });
  });
  for (int r = 0; r < world; ++r) EXPECT_TRUE(cluster.layer(r).health().ok);
}

TEST(Gpu, StalledRankIsNamedInTheDonePhase) {
  const int world = test::gpus_up_to(2);
  if (world < 2) GTEST_SKIP() << "needs 2 GPUs";
  LayerOptions options = test::exact_math();
  options.timeout_ms = 300;
  const LayerShape shape{256, 128, 8, 4, 16};
  const auto weights = harness::make_random_weights(shape, 6);
  Cluster cluster(shape, Precision::bf16, options, world, weights, Backend::cuda_nccl);
  testing::inject_fault(cluster.layer(1), {testing::Fault::stall, 1500, 1});
  std::vector<Health> health(2);
  within_seconds(60, "stall fault", [&] {
    run_on_rank_threads(world, [&](int rank) {
      cluster.forward(rank, harness::make_random_batch(shape, world, 4, Routing::uniform, 0, 1));
      health[rank] = cluster.layer(rank).health();
    });
  });
  EXPECT_EQ(health[0].peer, 1) << health[0].what;
  EXPECT_EQ(health[0].phase, Phase::expert_done) << health[0].what;
  EXPECT_FALSE(health[1].ok) << "the stalled rank learns its round was aborted";
  within_seconds(60, "reset", [&] { cluster.reset_all(); });
  for (int r = 0; r < world; ++r) EXPECT_TRUE(cluster.layer(r).health().ok);
}

TEST(Gpu, BadDeviceIdIsReportedByTheNextForwardAndTheLayerStaysUsable) {
  if (gpus() < 1) GTEST_SKIP() << "needs a GPU";
  const auto weights = harness::make_random_weights(kShape, 8);
  Cluster cluster(kShape, Precision::bf16, test::exact_math(), 1, weights, Backend::cuda_nccl);
  Batch b = harness::make_random_batch(kShape, 1, 4, Routing::uniform, 0, 2);
  b.topk_ids[5] = 99;
  cluster.forward(0, b);
  try {
    cluster.forward(0, b);
    FAIL() << "a bad id went unreported";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_THAT(std::string(e.what()), HasSubstr("topk_ids[1, 1]=99"));
  }
  b.topk_ids[5] = -1;
  expect_matches(cluster.forward(0, b), b, cluster, "after a bad id");
}

TEST(Gpu, GraphCapturedOnceReplaysHundredRoundsWithFreshRouting) {
  const int world = test::gpus_up_to(2);
  if (world < 1) GTEST_SKIP() << "needs a GPU";
  const std::int64_t t = 64;
  LayerOptions options = test::exact_math();
  options.timeout_ms = 20'000;
  const auto weights = harness::make_random_weights(kShape, 12);
  Cluster cluster(kShape, Precision::mxfp8, options, world, weights, Backend::cuda_nccl);
  within_seconds(300, "graph replays", [&] {
    run_on_rank_threads(world, [&](int rank) {
      harness::DeviceBatch buf(rank, kShape);  // freed after the graph
      test::CapturedForward graph(cluster.layer(rank), buf, t);
      ASSERT_TRUE(graph.ok());
      for (int replay = 0; replay < 110; ++replay) {
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
    EXPECT_EQ(cluster.layer(r).next_round(), 111u) << "the round advanced inside the graph";
  }
}

}  // namespace
}  // namespace epmoe

namespace epmoe {
namespace {

TEST(GpuCreation, DifferentConfigsOnDifferentRanksFailOnEveryRank) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs 2 GPUs";
  const std::vector<int> devices{0, 1};
  auto comms = make_nccl_communicators(devices);
  const auto weights = harness::make_random_weights(kShape, 1);
  std::vector<std::string> errors(2);
  within_seconds(60, "mismatched creation", [&] {
    run_on_rank_threads(2, [&](int rank) {
      LayerOptions options = test::exact_math();
      options.combine = rank == 0 ? Combine::staged : Combine::in_kernel_reduce;
      try {
        Layer layer(*comms[static_cast<std::size_t>(rank)],
                    make_config(kShape, Precision::bf16, rank, 2, options),
                    local_weight_views(weights, kShape, rank, 2));
      } catch (const Error& e) {
        errors[static_cast<std::size_t>(rank)] = e.what();
      }
    });
  });
  for (const auto& e : errors) EXPECT_THAT(e, HasSubstr("rank 1 was given a different config"));
  run_on_rank_threads(2, [&](int rank) { comms[static_cast<std::size_t>(rank)].reset(); });
}

TEST(GpuCreation, CommunicatorsFromOneUniqueIdRunALayer) {
  const int world = std::min(cuda_device_count(), 2);
  if (world < 1) GTEST_SKIP() << "needs a GPU";
  const UniqueId id = get_unique_id();  // what rank 0 broadcasts in a serving engine
  const LayerShape shape{256, 128, 8, 4, 32};
  const auto weights = harness::make_random_weights(shape, 2);
  reference::ReferenceModel ref(shape, Precision::bf16, test::exact_math(), weights);
  within_seconds(120, "unique-id communicators", [&] {
    run_on_rank_threads(world, [&](int rank) {  // one thread standing in for one process per GPU
      auto comm = make_nccl_communicator(id, rank, world, rank);
      {
        Layer layer(*comm, make_config(shape, Precision::bf16, rank, world, test::exact_math()),
                    local_weight_views(weights, shape, rank, world));
        harness::DeviceBatch buffers(rank, shape);
        const Batch b = harness::make_random_batch(shape, world, 9, Routing::uniform, 0, rank);
        const auto y = buffers.forward(layer, b);
        EXPECT_EQ(reference::compare_bf16_tolerant(y, ref.forward(b), 1, 1e-6).mismatches, 0);
      }
      comm.reset();
    });
  });
}

// After Communicator::abort() (a peer's process died) NCCL has unmapped the peers' windows: the
// layer refuses forward() and reset() before any launch, and both teardowns stay local.
TEST(GpuCreation, AbortedCommunicatorRefusesTheLayerAndTearsDownLocally) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  const LayerShape shape{256, 128, 8, 4, 32};
  const auto weights = harness::make_random_weights(shape, 4);
  const std::vector<int> devices{0};
  auto comms = make_nccl_communicators(devices);
  within_seconds(60, "abort", [&] {
    Layer layer(*comms[0], make_config(shape, Precision::bf16, 0, 1, test::exact_math()),
                local_weight_views(weights, shape, 0, 1));
    harness::DeviceBatch buffers(0, shape);
    const Batch b = harness::make_random_batch(shape, 1, 9, Routing::uniform, 0, 1);
    (void)buffers.forward(layer, b);
    EXPECT_TRUE(layer.health().ok);
    comms[0]->abort();
    comms[0]->abort();  // idempotent
    try {
      (void)buffers.forward(layer, b);
      ADD_FAILURE() << "forward after abort() did not throw";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::layer_unhealthy);
      EXPECT_THAT(e.what(), HasSubstr("the communicator was aborted"));
    }
    EXPECT_THROW(layer.reset(), Error);
  });  // the layer is destroyed after the abort: local
  comms.clear();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << "the CUDA context is still usable";
}

}  // namespace
}  // namespace epmoe

// Expert weights prepared on the device by each backend (docs/design.md §4.1) against the host's
// math::emulate_expert_weights / math::bf16_codes, bit for bit: every precision, both MXFP8 scale
// rules, bf16 and f32 input, on the host and on the GPU; the matrices include a tiny amax (NVFP4
// s_enc near and past the fp32 limit), an all-zero one, -0, subnormals and (expert 4) NaN and Inf.
namespace epmoe {
namespace {

const LayerShape kWeightShape{
    .hidden = 128, .intermediate = 64, .num_experts = 5, .top_k = 2, .max_tokens_per_rank = 8};

// Expert e's matrices (w13 then w2), each with its own character.
std::vector<float> special_weights(std::int64_t experts, std::int64_t per_expert, bool w2) {
  std::vector<float> w(static_cast<std::size_t>(experts * per_expert));
  std::uint64_t state = w2 ? 0x9e3779b97f4a7c15ull : 0x2545f4914f6cdd1dull;
  const auto uniform = [&] {  // [-1, 1)
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<float>(static_cast<double>(state >> 11) * 0x1.0p-53 * 2.0 - 1.0);
  };
  for (std::int64_t e = 0; e < experts; ++e)
    for (std::int64_t i = 0; i < per_expert; ++i) {
      float& v = w[static_cast<std::size_t>(e * per_expert + i)];
      switch (e) {
        case 0:  // wide range of magnitudes: blocks with very different scales
          v = uniform() * std::ldexp(1.0f, static_cast<int>(i % 29) - 14);
          break;
        case 1:  // tiny amax: NVFP4 s_enc = 2688 / amax overflows (w13) or nearly (w2)
          v = uniform() * (w2 ? 1e-34f : 1e-39f);
          break;
        case 2:  // all zero, one -0
          v = i == 5 ? -0.0f : 0.0f;
          break;
        case 3:  // ordinary, with -0 and exact ties of the formats
          v = i % 17 == 0 ? -0.0f : i % 13 == 0 ? 0.25f * static_cast<float>(i % 7) : uniform();
          break;
        default:  // NaN and Inf in some blocks
          v = i == 3     ? std::numeric_limits<float>::quiet_NaN()
              : i == 70  ? std::numeric_limits<float>::infinity()
              : i == 200 ? -std::numeric_limits<float>::infinity()
                         : uniform();
      }
    }
  return w;
}

using test::from_device;

// First index where the bits differ, with both values, or "" when identical.
template <class T>
std::string first_difference(const std::vector<T>& got, const std::vector<T>& want,
                             std::int64_t per_matrix) {
  if (got.size() != want.size()) return "sizes differ";
  for (std::size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      std::uint32_t g = 0, w = 0;
      std::memcpy(&g, &got[i], sizeof(T));
      std::memcpy(&w, &want[i], sizeof(T));
      char bits[64];
      std::snprintf(bits, sizeof bits, ": device bits 0x%x, host bits 0x%x", g, w);
      return "expert " + std::to_string(static_cast<std::int64_t>(i) / per_matrix) + " element " +
             std::to_string(static_cast<std::int64_t>(i) % per_matrix) + bits;
    }
  return "";
}

// fp8_block128's 128 x 128 tiles need more than one per matrix, and partial ones: w13 [384, 192]
// is 3 x 2 tiles (the second 64 wide), w2 [192, 192] 2 x 2 (the second row and column 64).
const LayerShape kTiledWeightShape{
    .hidden = 192, .intermediate = 192, .num_experts = 5, .top_k = 2, .max_tokens_per_rank = 8};

TEST(GpuWeights, DevicePreparationIsBitIdenticalToTheHostForEveryPrecisionAndBackend) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);

  struct Case {
    Precision precision;
    ScaleRounding rounding;
    LayerShape shape = kWeightShape;
  };
  for (const Case c :
       {Case{Precision::bf16, ScaleRounding::rceil}, Case{Precision::mxfp8, ScaleRounding::rceil},
        Case{Precision::mxfp8, ScaleRounding::ocp_floor},
        Case{Precision::nvfp4, ScaleRounding::rceil},
        Case{Precision::fp8_block128, ScaleRounding::rceil},
        Case{Precision::fp8_block128, ScaleRounding::rceil, kTiledWeightShape},
        Case{Precision::mxfp4, ScaleRounding::rceil},
        Case{Precision::mxfp4, ScaleRounding::ocp_floor}}) {
    const std::int64_t E = c.shape.num_experts, H = c.shape.hidden, I = c.shape.intermediate;
    const std::vector<float> w13_f32 = special_weights(E, 2 * I * H, false);
    const std::vector<float> w2_f32 = special_weights(E, H * I, true);
    std::vector<std::uint16_t> w13_bf16(w13_f32.size()), w2_bf16(w2_f32.size());
    for (std::size_t i = 0; i < w13_f32.size(); ++i)
      w13_bf16[i] = formats::float_to_bf16(w13_f32[i]);
    for (std::size_t i = 0; i < w2_f32.size(); ++i) w2_bf16[i] = formats::float_to_bf16(w2_f32[i]);
    for (const DType dtype : {DType::bf16, DType::f32})
      for (const bool on_gpu : {false, true})
        for (const ExpertMath math : {ExpertMath::exact, ExpertMath::tensor_core}) {
          const std::string where = std::string(to_string(c.precision)) + "/" +
                                    to_string(c.rounding) + " H=" + std::to_string(H) + " " +
                                    to_string(dtype) + " on " + (on_gpu ? "cuda:0" : "cpu") + ", " +
                                    to_string(math);
          SCOPED_TRACE(where);
          LayerOptions options;
          options.mxfp8_scale_rounding = c.rounding;
          options.expert_math = math;
          const LayerConfig config = make_config(c.shape, c.precision, 0, 1, options);
          if (c.precision == Precision::fp8_block128 && math == ExpertMath::tensor_core) {
            continue;  // no mma.sync backend (GpuWeights.TensorCoreRejectsFp8Block128...)
          }
          const void* w13_host = dtype == DType::f32 ? static_cast<const void*>(w13_f32.data())
                                                     : static_cast<const void*>(w13_bf16.data());
          const void* w2_host = dtype == DType::f32 ? static_cast<const void*>(w2_f32.data())
                                                    : static_cast<const void*>(w2_bf16.data());
          const ExpertWeights host{view(w13_host, dtype, {E, 2 * I, H}),
                                   view(w2_host, dtype, {E, H, I})};
          ExpertWeights given = host;
          void* w13_dev = nullptr;
          void* w2_dev = nullptr;
          if (on_gpu) {
            const std::size_t b13 = w13_f32.size() * dtype_bytes(dtype),
                              b2 = w2_f32.size() * dtype_bytes(dtype);
            ASSERT_EQ(cudaMalloc(&w13_dev, b13), cudaSuccess);
            ASSERT_EQ(cudaMalloc(&w2_dev, b2), cudaSuccess);
            ASSERT_EQ(cudaMemcpy(w13_dev, w13_host, b13, cudaMemcpyHostToDevice), cudaSuccess);
            ASSERT_EQ(cudaMemcpy(w2_dev, w2_host, b2, cudaMemcpyHostToDevice), cudaSuccess);
            given.w13 = view(w13_dev, dtype, {E, 2 * I, H}, Device{DeviceKind::cuda, 0});
            given.w2 = view(w2_dev, dtype, {E, H, I}, Device{DeviceKind::cuda, 0});
          }
          const math::EmulatedExperts want = math::emulate_expert_weights(config, host);
          auto backend = cuda::experts::make_expert_backend(config, 0);
          backend->prepare(given, nullptr);
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          // Resident in the precision: decoded, the reference's values bit for bit.
          if (math == ExpertMath::exact) {
            const auto& exact = dynamic_cast<cuda::experts::exact::ExactBackend&>(*backend);
            EXPECT_EQ(first_difference(exact.decoded_w13_on_host(), want.w13, 2 * I * H), "")
                << "w13";
            EXPECT_EQ(first_difference(exact.decoded_w2_on_host(), want.w2, H * I), "") << "w2";
          } else {
            const auto& mma = dynamic_cast<cuda::experts::mma::MmaBackend&>(*backend);
            EXPECT_EQ(first_difference(mma.decoded_on_host(mma.weights().w13), want.w13, 2 * I * H),
                      "")
                << "w13";
            EXPECT_EQ(first_difference(mma.decoded_on_host(mma.weights().w2), want.w2, H * I), "")
                << "w2";
          }
          test::expect_format_size(backend->weight_bytes(), c.precision, E * 3 * H * I, E);
          if (c.precision == Precision::nvfp4) {  // the tiny-amax matrices reach the clamp
            EXPECT_EQ(want.w13_s_enc[1], formats::kFloatMax) << "expert 1's w13 s_enc clamps";
            EXPECT_EQ(want.w13_s_enc[2], 1.0f) << "an all-zero matrix has s_enc 1";
          }
          cudaFree(w13_dev);
          cudaFree(w2_dev);
        }
  }
}

// The bf16 tensor-core backend cannot hold fp8_block128 weights exactly (an fp32 scale per 128 x
// 128 tile, not a power of two): the layer is refused with the reason, naming the field.
TEST(GpuWeights, TensorCoreRejectsFp8Block128NamingThePrecisionAndWgmmaTakesIt) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  LayerOptions options;
  for (const ExpertMath math : {ExpertMath::tensor_core}) {
    options.expert_math = math;
    const LayerConfig config = make_config(kWeightShape, Precision::fp8_block128, 0, 1, options);
    try {
      cuda::experts::make_expert_backend(config, 0);
      ADD_FAILURE() << to_string(math) << " accepted fp8_block128";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::unsupported);
      EXPECT_THAT(e.what(), ::testing::HasSubstr(std::string("expert_math=") + to_string(math) +
                                                 " cannot run this layer: precision=fp8_block128: "
                                                 "its fp32 block scales"));
    }
  }
  options.expert_math = ExpertMath::wgmma;  // wgmma takes it (E4M3 GEMMs with block scales)
  EXPECT_NE(cuda::experts::make_expert_backend(
                make_config(kShape, Precision::fp8_block128, 0, 1, options), 0),
            nullptr);
  options.expert_math = ExpertMath::exact;  // and exact math takes it
  EXPECT_NE(cuda::experts::make_expert_backend(
                make_config(kWeightShape, Precision::fp8_block128, 0, 1, options), 0),
            nullptr);
  for (const ExpertMath math : {ExpertMath::tensor_core, ExpertMath::wgmma}) {
    options.expert_math = math;  // as do the tensor-core backends with mxfp4
    EXPECT_NE(cuda::experts::make_expert_backend(
                  make_config(kWeightShape, Precision::mxfp4, 0, 1, options), 0),
              nullptr);
  }
}

// wgmma is the default math (docs/tuning.md#expert-math). Where it cannot run a layer (fp8_block128
// with I = 64, not whole 128-blocks) its refusal names the math that runs every layer.
TEST(GpuWeights, TheDefaultMathIsWgmmaAndItsRefusalNamesExact) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  const LayerConfig fp8 = make_config(kWeightShape, Precision::fp8_block128, 0, 1);
  ASSERT_EQ(fp8.options().expert_math, ExpertMath::wgmma);
  try {
    cuda::experts::make_expert_backend(fp8, 0);
    ADD_FAILURE() << "wgmma accepted fp8_block128 with intermediate=64";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::unsupported);
    EXPECT_THAT(e.what(), HasSubstr("Layer: expert_math=wgmma cannot run this layer: hidden=128, "
                                    "intermediate=64"));
    EXPECT_THAT(e.what(), HasSubstr("(expert_math=exact runs every layer)"));
  }
  EXPECT_NE(cuda::experts::make_expert_backend(make_config(kShape, Precision::bf16, 0, 1), 0),
            nullptr);  // the default runs a layer it can
}

// Biases on the device in bf16 (widened by a kernel) give the same bits as host f32 biases (copied
// up), and count in resident_weight_bytes.
TEST(GpuWeights, DeviceBf16BiasesGiveTheSameBitsAsHostF32Biases) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  auto weights = harness::make_random_weights(kShape, 41);
  harness::add_random_biases(weights, kShape, 42);
  std::vector<std::uint16_t> b13(weights.b13.size()), b2(weights.b2.size());
  for (std::size_t i = 0; i < b13.size(); ++i) b13[i] = formats::float_to_bf16(weights.b13[i]);
  for (std::size_t i = 0; i < b2.size(); ++i) b2[i] = formats::float_to_bf16(weights.b2[i]);
  void *b13_dev = nullptr, *b2_dev = nullptr;
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&b13_dev, b13.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&b2_dev, b2.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(b13_dev, b13.data(), b13.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(b2_dev, b2.data(), b2.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  for (const ExpertMath math : kEveryMath) {
    LayerOptions options;
    options.expert_math = math;
    options.activation = Activation::swiglu_oai;
    options.swiglu_limit = kSwigluOaiLimit;
    const std::vector<int> devices{0};
    auto comms = make_nccl_communicators(devices);
    const LayerConfig config = make_config(kShape, Precision::mxfp8, 0, 1, options);
    const ExpertWeights host = local_weight_views(weights, kShape, 0, 1);
    ExpertWeights device = host;
    device.b13 = view(b13_dev, DType::bf16, {kShape.num_experts, 2 * kShape.intermediate},
                      comms[0]->device());
    device.b2 = view(b2_dev, DType::bf16, {kShape.num_experts, kShape.hidden}, comms[0]->device());
    const Batch b = harness::make_random_batch(kShape, 1, 64, Routing::uniform, 0, 43);
    std::vector<std::uint16_t> y_host, y_device;
    {
      Layer layer(*comms[0], config, host);
      harness::DeviceBatch staging(0, kShape);
      y_host = staging.forward(layer, b);
      const std::size_t biases = (b13.size() + b2.size()) * sizeof(float);
      const std::size_t params =
          static_cast<std::size_t>(kShape.num_experts * 3 * kShape.intermediate * kShape.hidden);
      // resident in the precision (mxfp8), every backend
      test::expect_format_size(layer.resident_weight_bytes() - biases, Precision::mxfp8,
                               static_cast<std::int64_t>(params), kShape.num_experts);
    }
    {
      Layer layer(*comms[0], config, device);
      harness::DeviceBatch staging(0, kShape);
      y_device = staging.forward(layer, b);
    }
    EXPECT_EQ(y_host, y_device) << to_string(math);
  }
  cudaFree(b13_dev);
  cudaFree(b2_dev);
}

TEST(GpuWeights, LayerReportsItsResidentWeightBytes) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  for (const ExpertMath math : kEveryMath) {
    LayerOptions options;
    options.expert_math = math;
    const std::vector<int> devices{0};
    auto comms = make_nccl_communicators(devices);
    const LayerConfig config = make_config(kShape, Precision::nvfp4, 0, 1, options);
    const auto weights = harness::make_random_weights(kShape, 3);
    Layer layer(*comms[0], config,
                ExpertWeights{view(weights.w13.data(), DType::bf16,
                                   {kShape.num_experts, 2 * kShape.intermediate, kShape.hidden}),
                              view(weights.w2.data(), DType::bf16,
                                   {kShape.num_experts, kShape.hidden, kShape.intermediate})});
    const std::size_t params =
        static_cast<std::size_t>(kShape.num_experts * 3 * kShape.intermediate * kShape.hidden);
    // NVFP4 as it is, every backend: 0.5 B + an E4M3 per 16
    test::expect_format_size(layer.resident_weight_bytes(), Precision::nvfp4,
                             static_cast<std::int64_t>(params), kShape.num_experts);
  }
}

}  // namespace
}  // namespace epmoe

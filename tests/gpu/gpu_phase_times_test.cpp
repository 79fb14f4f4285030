// Per-phase timing on the GPU (docs/design.md §4.2, Layer::set_phase_timing): every phase of a
// round is stamped, each begins before it ends, the chain's phases follow one another, each wait
// lies inside its phase, and the whole round fits in the forward's CUDA-event time; on every
// expert backend, for idle rounds too, eager and under a CUDA graph.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <iterator>
#include <string>

#include "epmoe/epmoe.hpp"
#include "harness/cluster.hpp"
#include "harness/device_batch.hpp"
#include "harness/problem.hpp"
#include "harness/rank_threads.hpp"
#include "support/captured_forward.hpp"
#include "support/exact_math.hpp"
#include "support/watchdog.hpp"

namespace epmoe {
namespace {

using harness::Routing;
using reference::Batch;
using test::within_seconds;

const LayerShape kShape{
    .hidden = 256, .intermediate = 128, .num_experts = 8, .top_k = 4, .max_tokens_per_rank = 256};

// %globaltimer and CUDA events are different clocks, each with its own granularity (the global
// timer may tick in microseconds): the slack allowed between them.
constexpr double kClockSlackUs = 2.0;

constexpr RoundPhase kChain[] = {RoundPhase::dispatch, RoundPhase::route, RoundPhase::fc1,
                                 RoundPhase::fc2, RoundPhase::combine};

// One rank's phases of the round it just ran, against that forward's event time.
void expect_phases_of_a_round(const PhaseTimes& t, std::uint32_t round, double event_ms,
                              const std::string& where) {
  ASSERT_FALSE(t.empty()) << where << ": no phases recorded";
  EXPECT_EQ(t.round, round) << where;
  for (int p = 0; p < kRoundPhases; ++p) {
    const PhaseSpan& s = t.spans[static_cast<std::size_t>(p)];
    const std::string phase = to_string(static_cast<RoundPhase>(p));
    EXPECT_TRUE(s.stamped) << where << ": " << phase << " not stamped";
    EXPECT_GE(s.begin_us, 0.0) << where << ": " << phase << " begins before dispatch";
    EXPECT_LE(s.begin_us, s.end_us) << where << ": " << phase << " ends before it begins";
  }
  for (std::size_t i = 0; i + 1 < std::size(kChain); ++i)
    EXPECT_LE(t[kChain[i]].end_us, t[kChain[i + 1]].begin_us)
        << where << ": " << to_string(kChain[i + 1]) << " begins before " << to_string(kChain[i])
        << " ends";
  EXPECT_LE(t[RoundPhase::route].begin_us, t[RoundPhase::wait_counts].begin_us) << where;
  EXPECT_LE(t[RoundPhase::wait_counts].end_us, t[RoundPhase::route].end_us) << where;
  EXPECT_LE(t[RoundPhase::combine].begin_us, t[RoundPhase::wait_done].begin_us) << where;
  EXPECT_LE(t[RoundPhase::wait_done].end_us, t[RoundPhase::combine].end_us) << where;
  double chain_us = 0.0;
  for (RoundPhase p : kChain) chain_us += t[p].us();
  EXPECT_GT(t.total_us(), 0.0) << where;
  EXPECT_LE(chain_us, t.total_us()) << where << ": the chain's phases overlap";
  EXPECT_LE(t.total_us(), event_ms * 1e3 + kClockSlackUs)
      << where << ": the phases span more than the forward's CUDA-event time";
}

struct Scenario {
  ExpertMath math;
  Precision precision;
};

class GpuPhaseTimes : public ::testing::TestWithParam<Scenario> {};

// T = 0 on every rank first (an idle round does the protocol and reports every phase), then
// growing T, then rank 0 idle while the others are full.
TEST_P(GpuPhaseTimes, EveryPhaseStampedInChainOrderWithinTheForwardsEventTime) {
  const int world = test::gpus_up_to(2);
  if (world < 1) GTEST_SKIP() << "needs a GPU";
  LayerOptions options;
  options.expert_math = GetParam().math;
  options.timeout_ms = 20'000;
  Cluster cluster(kShape, GetParam().precision, options, world,
                  harness::make_random_weights(kShape, 5), Backend::cuda_nccl);
  for (int r = 0; r < world; ++r) cluster.layer(r).set_phase_timing(true);
  const std::int64_t token_counts[] = {0, 1, 64, 256, -1};
  within_seconds(300, "timed rounds", [&] {
    run_on_rank_threads(world, [&](int rank) {
      for (std::int64_t t : token_counts) {
        if (t < 0) t = rank == 0 ? 0 : kShape.max_tokens_per_rank;
        const Batch b = harness::make_random_batch(kShape, world, t, Routing::uniform, 0,
                                                   static_cast<std::uint64_t>(31 * t + rank));
        double ms = 0.0;
        cluster.forward(rank, b, &ms);
        Layer& layer = cluster.layer(rank);
        expect_phases_of_a_round(layer.last_phase_times(), layer.next_round() - 1, ms,
                                 "rank " + std::to_string(rank) + " T=" + std::to_string(t));
      }
    });
  });
  for (int r = 0; r < world; ++r) EXPECT_TRUE(cluster.layer(r).health().ok);
}

INSTANTIATE_TEST_SUITE_P(Gpu, GpuPhaseTimes,
                         ::testing::Values(Scenario{ExpertMath::exact, Precision::mxfp8},
                                           Scenario{ExpertMath::tensor_core, Precision::nvfp4},
                                           Scenario{ExpertMath::wgmma, Precision::bf16},
                                           Scenario{ExpertMath::wgmma, Precision::fp8_block128}),
                         [](const auto& param_info) {
                           return std::string(to_string(param_info.param.math)) + "_" +
                                  to_string(param_info.param.precision);
                         });

// Off by default, and off again after set_phase_timing(false): no record is read back.
TEST(GpuPhaseTimesSwitch, OffByDefaultOnWhenAskedAndOffAgain) {
  const int world = test::gpus_up_to(2);
  if (world < 1) GTEST_SKIP() << "needs a GPU";
  LayerOptions options = test::exact_math();
  options.timeout_ms = 20'000;
  Cluster cluster(kShape, Precision::bf16, options, world, harness::make_random_weights(kShape, 6),
                  Backend::cuda_nccl);
  const auto round_on_every_rank = [&](std::uint64_t seed) {
    within_seconds(120, "round", [&] {
      run_on_rank_threads(world, [&](int rank) {
        cluster.forward(rank, harness::make_random_batch(kShape, world, 8, Routing::uniform, 0,
                                                         seed + static_cast<std::uint64_t>(rank)));
      });
    });
  };
  round_on_every_rank(1);
  for (int r = 0; r < world; ++r) EXPECT_TRUE(cluster.layer(r).last_phase_times().empty());
  for (int r = 0; r < world; ++r) cluster.layer(r).set_phase_timing(true);
  for (int r = 0; r < world; ++r)
    EXPECT_TRUE(cluster.layer(r).last_phase_times().empty()) << "the last round was not timed";
  round_on_every_rank(2);
  for (int r = 0; r < world; ++r) {
    const PhaseTimes t = cluster.layer(r).last_phase_times();
    EXPECT_FALSE(t.empty());
    EXPECT_EQ(t.round, 2u);
  }
  for (int r = 0; r < world; ++r) cluster.layer(r).set_phase_timing(false);
  round_on_every_rank(3);
  for (int r = 0; r < world; ++r) EXPECT_TRUE(cluster.layer(r).last_phase_times().empty());
}

// The switch lives in device memory: a graph captured while timing was off stamps its replays once
// it is on, and each replay's record is that replay's round.
TEST(GpuPhaseTimesSwitch, GraphCapturedWithTimingOffStampsReplaysOnceItIsOn) {
  const int world = test::gpus_up_to(2);
  if (world < 1) GTEST_SKIP() << "needs a GPU";
  const std::int64_t t = 16;
  LayerOptions options = test::exact_math();
  options.timeout_ms = 20'000;
  Cluster cluster(kShape, Precision::mxfp8, options, world, harness::make_random_weights(kShape, 7),
                  Backend::cuda_nccl);
  within_seconds(300, "graph replays", [&] {
    run_on_rank_threads(world, [&](int rank) {
      Layer& layer = cluster.layer(rank);
      harness::DeviceBatch buf(rank, kShape);
      test::CapturedForward graph(layer, buf, t);
      ASSERT_TRUE(graph.ok());
      const cudaStream_t stream = graph.stream();
      buf.upload(harness::make_random_batch(kShape, world, t, Routing::uniform, 0, 40 + rank));
      layer.set_phase_timing(true);  // not collective: each rank its own
      cudaEvent_t start, stop;
      ASSERT_EQ(cudaEventCreate(&start), cudaSuccess);
      ASSERT_EQ(cudaEventCreate(&stop), cudaSuccess);
      for (int replay = 0; replay < 5; ++replay) {
        ASSERT_EQ(cudaEventRecord(start, stream), cudaSuccess);
        ASSERT_EQ(graph.launch(), cudaSuccess);
        ASSERT_EQ(cudaEventRecord(stop, stream), cudaSuccess);
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        float ms = 0.0f;
        ASSERT_EQ(cudaEventElapsedTime(&ms, start, stop), cudaSuccess);
        expect_phases_of_a_round(
            layer.last_phase_times(), static_cast<std::uint32_t>(replay + 1), ms,
            "rank " + std::to_string(rank) + " replay " + std::to_string(replay));
      }
      cudaEventDestroy(start);
      cudaEventDestroy(stop);
    });
  });
  for (int r = 0; r < world; ++r) EXPECT_TRUE(cluster.layer(r).health().ok);
}

}  // namespace
}  // namespace epmoe

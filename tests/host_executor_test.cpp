// The round protocol on the CPU executor: real threads, real atomics, no barrier between rounds.
// Every round of every rank is checked against the reference forward.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <future>
#include <thread>

#include "epmoe/epmoe.hpp"
#include "epmoe/testing.hpp"
#include "harness/cluster.hpp"
#include "harness/problem.hpp"
#include "harness/rank_threads.hpp"
#include "support/watchdog.hpp"

namespace epmoe {
namespace {

using harness::Routing;
using reference::Batch;
using ::testing::HasSubstr;

LayerShape small_shape(std::int64_t experts, std::int64_t hidden = 64,
                       std::int64_t intermediate = 64) {
  return LayerShape{.hidden = hidden,
                    .intermediate = intermediate,
                    .num_experts = experts,
                    .top_k = 3,
                    .max_tokens_per_rank = 12};
}

// A per-(round, rank) batch every thread can rebuild on its own: many T == 0, all routings.
Batch round_batch(const LayerShape& s, int world, std::uint32_t round, int rank,
                  std::uint64_t seed) {
  harness::Rng rng(seed * 1'000'003u + round * 131u + static_cast<std::uint64_t>(rank));
  const std::int64_t tokens = rng.uniform() < 0.4 ? 0 : 1 + rng.below(s.max_tokens_per_rank);
  const double pick = rng.uniform();
  const Routing routing = pick < 0.6    ? Routing::uniform
                          : pick < 0.75 ? Routing::one_rank
                          : pick < 0.9  ? Routing::one_expert
                                        : Routing::all_dropped;
  const std::int64_t target = rng.below(routing == Routing::one_rank ? world : s.num_experts);
  return harness::make_random_batch(s, world, tokens, routing, target, rng.next());
}

using test::within_seconds;

struct Scenario {
  Precision precision;
  Combine combine;
  int world;
  std::int64_t experts;
  std::int64_t hidden = 64;  // H = I; 192 gives fp8_block128 a whole and a partial 128-block
};

class ProtocolMatchesReference : public ::testing::TestWithParam<Scenario> {};

TEST_P(ProtocolMatchesReference, EveryRoundOfEveryRankAtItsOwnPace) {
  const Scenario sc = GetParam();
  const LayerShape shape = small_shape(sc.experts, sc.hidden, sc.hidden);
  LayerOptions options;
  options.combine = sc.combine;
  options.timeout_ms = 5'000;
  const auto weights = harness::make_random_weights(shape, 7);
  Cluster cluster(shape, sc.precision, options, sc.world, weights);
  const std::uint32_t rounds = 60;
  within_seconds(120, "the rounds", [&] {
    run_on_rank_threads(sc.world, [&](int rank) {
      harness::Rng delays(static_cast<std::uint64_t>(rank) + 99);
      for (std::uint32_t r = 1; r <= rounds; ++r) {
        const Batch batch = round_batch(shape, sc.world, r, rank, 5);
        if (delays.uniform() < 0.3)
          std::this_thread::sleep_for(std::chrono::microseconds(delays.below(400)));
        const auto y = cluster.forward(rank, batch);
        const auto check = reference::check_output(y, cluster.reference(rank).forward(batch),
                                                   sc.combine, options.expert_math, sc.precision);
        ASSERT_TRUE(check.pass) << "rank " << rank << " round " << r << " T=" << batch.tokens
                                << " mismatches=" << check.stats.mismatches
                                << " max_abs=" << check.stats.max_abs << " (" << check.rule << ")";
      }
    });
  });
  for (int rank = 0; rank < sc.world; ++rank) {
    EXPECT_TRUE(cluster.layer(rank).health().ok);
    EXPECT_EQ(cluster.layer(rank).next_round(), rounds + 1);
  }
}

INSTANTIATE_TEST_SUITE_P(
    HostExecutor, ProtocolMatchesReference,
    ::testing::Values(Scenario{Precision::bf16, Combine::staged, 1, 4},
                      Scenario{Precision::bf16, Combine::staged, 2, 8},
                      Scenario{Precision::mxfp8, Combine::staged, 3, 12},
                      Scenario{Precision::nvfp4, Combine::staged, 4, 8},
                      Scenario{Precision::bf16, Combine::in_kernel_reduce, 2, 8},
                      Scenario{Precision::mxfp8, Combine::in_kernel_reduce, 4, 8},
                      Scenario{Precision::nvfp4, Combine::in_kernel_reduce, 3, 6},
                      Scenario{Precision::mxfp8, Combine::staged, 8, 16},
                      Scenario{Precision::fp8_block128, Combine::staged, 2, 8, 192},
                      Scenario{Precision::fp8_block128, Combine::in_kernel_reduce, 3, 6, 192},
                      Scenario{Precision::fp8_block128, Combine::staged, 4, 8},
                      Scenario{Precision::mxfp4, Combine::staged, 2, 8, 192},
                      Scenario{Precision::mxfp4, Combine::in_kernel_reduce, 4, 8}),
    [](const auto& param_info) {
      return std::string(to_string(param_info.param.precision)) + "_" +
             to_string(param_info.param.combine) + "_world" +
             std::to_string(param_info.param.world) +
             (param_info.param.hidden == 64 ? "" : "_H" + std::to_string(param_info.param.hidden));
    });

TEST(HostExecutor, HundredsOfRoundsWithIdleRanksAndRandomDelays) {
  const LayerShape shape = small_shape(16);
  LayerOptions options;
  options.timeout_ms = 10'000;
  const auto weights = harness::make_random_weights(shape, 11);
  for (int world : {2, 8}) {
    Cluster cluster(shape, Precision::bf16, options, world, weights);
    const std::uint32_t rounds = world == 2 ? 400 : 200;
    std::atomic<std::int64_t> idle_rounds{0};
    within_seconds(240, "hundreds of rounds", [&] {
      run_on_rank_threads(world, [&](int rank) {
        harness::Rng delays(static_cast<std::uint64_t>(rank) * 7 + 3);
        for (std::uint32_t r = 1; r <= rounds; ++r) {
          const Batch batch = round_batch(shape, world, r, rank, 17);
          idle_rounds += batch.tokens == 0;
          if (delays.uniform() < 0.2)
            std::this_thread::sleep_for(std::chrono::microseconds(delays.below(300)));
          const auto y = cluster.forward(rank, batch);
          if (r % 4 == 0) {  // sample: the reference costs more than the round
            const auto err = reference::compare_bf16(y, cluster.reference(rank).forward(batch));
            ASSERT_EQ(err.mismatches, 0) << "world " << world << " rank " << rank << " round " << r;
          }
        }
      });
    });
    EXPECT_GT(idle_rounds.load(), static_cast<std::int64_t>(rounds * world) / 4);
  }
}

TEST(HostExecutor, AllTokensToOneRanksExpertsAtMaxTokens) {
  const LayerShape shape = small_shape(8);
  const int world = 4;
  const auto weights = harness::make_random_weights(shape, 3);
  Cluster cluster(shape, Precision::nvfp4, LayerOptions{}, world, weights);
  run_on_rank_threads(world, [&](int rank) {
    const Batch batch = harness::make_random_batch(shape, world, shape.max_tokens_per_rank,
                                                   Routing::one_rank, 2, 40 + rank);
    const auto y = cluster.forward(rank, batch);
    ASSERT_EQ(reference::compare_bf16(y, cluster.reference(rank).forward(batch)).mismatches, 0);
  });
}

TEST(HostExecutor, AcceptsInt64ExpertIds) {
  const LayerShape shape = small_shape(4);
  const auto weights = harness::make_random_weights(shape, 5);
  Cluster cluster(shape, Precision::bf16, LayerOptions{}, 2, weights);
  run_on_rank_threads(2, [&](int rank) {
    const Batch b = harness::make_random_batch(shape, 2, 5, Routing::uniform, 0, 8 + rank);
    std::vector<std::int64_t> ids(b.topk_ids.begin(), b.topk_ids.end());
    std::vector<std::uint16_t> y(static_cast<std::size_t>(5 * shape.hidden));
    cluster.layer(rank).forward(view(b.x.data(), DType::bf16, {5, shape.hidden}),
                                view(ids.data(), DType::i64, {5, shape.top_k}),
                                view(b.topk_weights.data(), DType::f32, {5, shape.top_k}),
                                view(y.data(), DType::bf16, {5, shape.hidden}));
    ASSERT_EQ(reference::compare_bf16(y, cluster.reference(rank).forward(b)).mismatches, 0);
  });
}

}  // namespace
}  // namespace epmoe

namespace epmoe {
namespace {

// Rounds count modulo 2^32 (a serving process may run for years): the waits compare distances,
// not values, so crossing 0xffffffff -> 0 -> 1 is just three more rounds.
TEST(HostExecutor, RoundNumbersWrapAroundTwoToTheThirtyTwo) {
  if (!testing::fault_injection_available()) GTEST_SKIP() << "built without test switches";
  const LayerShape shape = small_shape(8);
  const int world = 4;
  const auto weights = harness::make_random_weights(shape, 13);
  Cluster cluster(shape, Precision::mxfp8, LayerOptions{}, world, weights);
  const std::uint32_t first = 0xffffffffu - 4;
  for (int rank = 0; rank < world; ++rank) testing::start_rounds_at(cluster.layer(rank), first);
  within_seconds(60, "rounds across the wrap", [&] {
    run_on_rank_threads(world, [&](int rank) {
      for (std::uint32_t r = 0; r < 12; ++r) {  // 0xfffffffb ... 0xffffffff, 0, 1, ... 6
        const Batch batch = round_batch(shape, world, r, rank, 23);
        const auto y = cluster.forward(rank, batch);
        ASSERT_EQ(reference::compare_bf16(y, cluster.reference(rank).forward(batch)).mismatches, 0)
            << "rank " << rank << " round " << first + r;
      }
    });
  });
  for (int rank = 0; rank < world; ++rank) {
    EXPECT_TRUE(cluster.layer(rank).health().ok) << cluster.layer(rank).health().what;
    EXPECT_EQ(cluster.layer(rank).next_round(), first + 12u);  // wrapped: 7
  }
}

}  // namespace
}  // namespace epmoe

// Bounded waits and recovery (docs/design.md §3 I1, I3, I4) on the CPU executor: each fault must
// give every surviving rank a clear error naming the faulty rank, phase and round within the
// timeout, the layer must refuse work until a collective reset(), and rounds must be correct
// afterwards.
//
// Every scenario runs under a watchdog that exits the process if a rank is still waiting after
// the deadline, so a wait that lost its bound fails the test instead of hanging CI.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <future>
#include <optional>
#include <thread>

#include "epmoe/epmoe.hpp"
#include "epmoe/testing.hpp"
#include "harness/cluster.hpp"
#include "harness/problem.hpp"
#include "harness/rank_threads.hpp"
#include "host/host_group.hpp"
#include "protocol/atomics.hpp"
#include "protocol/message.hpp"
#include "protocol/wire.hpp"
#include "protocol/workspace.hpp"
#include "support/watchdog.hpp"

namespace epmoe {
namespace {

using harness::Routing;
using reference::Batch;
using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

constexpr std::uint32_t kTimeoutMs = 300;

const LayerShape kShape{
    .hidden = 64, .intermediate = 64, .num_experts = 6, .top_k = 2, .max_tokens_per_rank = 8};

using test::within_seconds;

struct Outcome {
  std::optional<Error> error;
  Health health;
  double seconds = 0.0;
};

class FaultTest : public ::testing::Test {
 protected:
  static constexpr int kWorld = 3;
  void SetUp() override {
    if (!testing::fault_injection_available()) GTEST_SKIP() << "built without fault switches";
    LayerOptions options;
    options.timeout_ms = kTimeoutMs;
    cluster_ = std::make_unique<Cluster>(kShape, Precision::bf16, options, kWorld, weights_);
  }

  Batch batch(int rank, std::int64_t tokens, std::uint64_t seed) const {
    return harness::make_random_batch(kShape, kWorld, tokens, Routing::uniform, 0,
                                      seed * 10 + static_cast<std::uint64_t>(rank));
  }

  // One round on every rank; `tokens_of(rank)` gives T. Returns what each rank saw.
  std::vector<Outcome> round(const std::function<std::int64_t(int)>& tokens_of,
                             std::uint64_t seed) {
    std::vector<Outcome> out(kWorld);
    within_seconds(20, "a faulty round", [&] {
      run_on_rank_threads(kWorld, [&](int rank) {
        auto& o = out[static_cast<std::size_t>(rank)];
        const auto start = Clock::now();
        try {
          const Batch b = batch(rank, tokens_of(rank), seed);
          const auto y = cluster_->forward(rank, b);
          EXPECT_EQ(reference::compare_bf16(y, cluster_->reference(rank).forward(b)).mismatches, 0);
        } catch (const Error& e) {
          o.error = e;
        }
        o.seconds = std::chrono::duration<double>(Clock::now() - start).count();
        o.health = cluster_->layer(rank).health();
      });
    });
    return out;
  }

  // After reset() on every rank, a few rounds are correct again.
  void expect_recovers() {
    within_seconds(20, "reset", [&] { cluster_->reset_all(); });
    for (int rank = 0; rank < kWorld; ++rank) EXPECT_TRUE(cluster_->layer(rank).health().ok);
    for (std::uint64_t s = 0; s < 3; ++s) {
      const auto outcomes = round([](int rank) { return std::int64_t{rank + 1}; }, 900 + s);
      for (int rank = 0; rank < kWorld; ++rank)
        EXPECT_FALSE(outcomes[static_cast<std::size_t>(rank)].error)
            << "rank " << rank << ": " << outcomes[static_cast<std::size_t>(rank)].error->what();
    }
  }

  const reference::LayerWeights weights_ = harness::make_random_weights(kShape, 21);
  std::unique_ptr<Cluster> cluster_;
};

TEST_F(FaultTest, SkippedLaunchWhenIdleIsNamedOnEverySurvivorWithinTheTimeout) {
  // Two healthy rounds, then rank 1 is idle and skips its launch (the bug epmoe exists to catch).
  round([](int) { return std::int64_t{3}; }, 1);
  round([](int) { return std::int64_t{2}; }, 2);
  testing::inject_fault(cluster_->layer(1), {testing::Fault::skip_launch_when_idle});
  const auto outcomes = round([](int rank) { return rank == 1 ? std::int64_t{0} : 4; }, 3);

  for (int rank : {0, 2}) {
    const Outcome& o = outcomes[static_cast<std::size_t>(rank)];
    ASSERT_TRUE(o.error) << "rank " << rank << " returned without noticing rank 1 skipped";
    EXPECT_TRUE(o.error->code() == ErrorCode::timeout ||
                o.error->code() == ErrorCode::peer_aborted);
    EXPECT_LT(o.seconds, kTimeoutMs / 1000.0 + 1.0) << "rank " << rank;
    EXPECT_FALSE(o.health.ok);
    EXPECT_EQ(o.health.peer, 1) << o.health.what;
    EXPECT_EQ(o.health.phase, Phase::dispatch_counts) << o.health.what;
    EXPECT_EQ(o.health.round, 3u) << o.health.what;
    EXPECT_THAT(std::string(o.error->what()), HasSubstr("rank 1"));
    EXPECT_THAT(std::string(o.error->what()), HasSubstr("round 3"));
  }
  EXPECT_FALSE(outcomes[1].error);  // the skipping rank itself returned "successfully"

  // Every rank now refuses work until reset(), the faulty one included.
  const auto refused = round([](int) { return std::int64_t{1}; }, 4);
  for (int rank = 0; rank < kWorld; ++rank) {
    const Outcome& o = refused[static_cast<std::size_t>(rank)];
    ASSERT_TRUE(o.error) << "rank " << rank << " accepted work after the failure";
    EXPECT_LT(o.seconds, 0.2) << "refusal must not wait";
  }
  expect_recovers();
}

TEST_F(FaultTest, StalledRankIsNamedInTheDonePhase) {
  testing::inject_fault(cluster_->layer(2), {testing::Fault::stall, 3 * kTimeoutMs, 1});
  const auto outcomes = round([](int) { return std::int64_t{3}; }, 5);
  for (int rank : {0, 1}) {
    const Outcome& o = outcomes[static_cast<std::size_t>(rank)];
    ASSERT_TRUE(o.error) << "rank " << rank;
    EXPECT_EQ(o.health.peer, 2) << o.health.what;
    EXPECT_EQ(o.health.phase, Phase::expert_done) << o.health.what;
    EXPECT_EQ(o.health.round, 1u) << o.health.what;
    EXPECT_LT(o.seconds, kTimeoutMs / 1000.0 + 1.0);
  }
  ASSERT_TRUE(outcomes[2].error) << "the stalled rank must learn its round was aborted";
  EXPECT_EQ(outcomes[2].error->code(), ErrorCode::peer_aborted);
  expect_recovers();
}

TEST_F(FaultTest, RoundCounterJumpIsAProtocolViolationNotAWait) {
  testing::inject_fault(cluster_->layer(0), {testing::Fault::round_jump});
  const auto outcomes = round([](int) { return std::int64_t{2}; }, 6);
  for (int rank = 0; rank < kWorld; ++rank) {
    const Outcome& o = outcomes[static_cast<std::size_t>(rank)];
    ASSERT_TRUE(o.error) << "rank " << rank;
    EXPECT_TRUE(o.error->code() == ErrorCode::protocol_violation ||
                o.error->code() == ErrorCode::peer_aborted)
        << o.error->what();
    EXPECT_LT(o.seconds, kTimeoutMs / 1000.0) << "I4: a violation is reported, not waited on";
    EXPECT_EQ(o.health.peer, 0) << "the rank whose counter jumped is named: " << o.health.what;
  }
  expect_recovers();
}

TEST_F(FaultTest, ResetWithoutEveryRankTimesOutInsteadOfHanging) {
  const auto start = Clock::now();
  try {
    cluster_->layer(0).reset();
    FAIL() << "reset() of one rank alone must not succeed";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::timeout);
    EXPECT_THAT(std::string(e.what()), HasSubstr("reset()"));
  }
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 2.0);
  expect_recovers();
}

// I4 on the receiving side: a count above max_tokens_per_rank (more rows than the sender's receive
// block holds) is a protocol violation named at once, never a read past the block. Rank 1 is played
// by the test: it joins the layer's windows, fills its receive block on rank 0 with valid rows plus
// one valid-looking row just past it, and announces one row too many. Read, those rows would be
// computed on and rank 0 would time out waiting for rank 1's done instead.
TEST(ReceivedCounts, CountAboveMaxTokensIsAViolationNamedAtOnceNotAReadPastTheBlock) {
  constexpr int kWorld = 2;
  constexpr std::uint32_t kRound = protocol::kFirstRound;
  LayerOptions options;
  options.timeout_ms = kTimeoutMs;
  const auto weights = harness::make_random_weights(kShape, 3);
  const LayerConfig config = make_config(kShape, Precision::bf16, 0, kWorld, options);
  const protocol::WorkspaceLayout layout = protocol::make_workspace_layout(config);
  auto group = make_host_group(kWorld);
  auto comm = make_host_communicator(group, 0);
  std::shared_ptr<HostLayerWindows> rank1;
  std::thread joining([&] {
    rank1 = group->join_layer(1, layout.total,
                              make_config(kShape, Precision::bf16, 1, kWorld, options).describe(),
                              std::chrono::milliseconds(10 * kTimeoutMs));
  });
  std::unique_ptr<Layer> layer;
  within_seconds(20, "layer creation", [&] {
    layer = std::make_unique<Layer>(*comm, config, local_weight_views(weights, kShape, 0, kWorld));
  });
  joining.join();

  auto* rank0_window = reinterpret_cast<std::uint8_t*>(rank1->windows[0]);
  const auto rows = static_cast<std::uint32_t>(kShape.max_tokens_per_rank + 1);
  ASSERT_LE(layout.recv_row(kRound, 1, rows - 1) + layout.row_bytes, layout.total);
  for (std::uint32_t r = 0; r < rows; ++r) {
    std::uint8_t* row = rank0_window + layout.recv_row(kRound, 1, r);
    std::memset(row, 0, layout.row_bytes);
    const protocol::WireRowHeader header{static_cast<std::int32_t>(r % 8), 1, 1.0f, kRound};
    const protocol::WireEntry entry{0, 0, 1.0f};
    std::memcpy(row, &header, sizeof header);
    std::memcpy(row + protocol::wire_entries_offset(), &entry, sizeof entry);
  }
  protocol::store_release(reinterpret_cast<std::uint64_t*>(rank0_window + layout.count_word(1)),
                          protocol::pack_inbox(kRound, rows));

  const Batch idle = harness::make_random_batch(kShape, kWorld, 0, Routing::uniform, 0, 5);
  std::vector<std::uint16_t> y;
  const auto start = Clock::now();
  std::optional<Error> error;
  within_seconds(20, "a round with a bad count", [&] {
    try {
      layer->forward(view(idle.x.data(), DType::bf16, {0, kShape.hidden}),
                     view(idle.topk_ids.data(), DType::i32, {0, kShape.top_k}),
                     view(idle.topk_weights.data(), DType::f32, {0, kShape.top_k}),
                     view(y.data(), DType::bf16, {0, kShape.hidden}));
    } catch (const Error& e) {
      error = e;
    }
  });
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();

  ASSERT_TRUE(error) << "rank 0 accepted a count of " << rows << " rows";
  EXPECT_EQ(error->code(), ErrorCode::protocol_violation) << error->what();
  EXPECT_LT(seconds, kTimeoutMs / 1000.0) << "I4: a violation is reported, not waited on";
  const Health h = layer->health();
  EXPECT_EQ(h.peer, 1) << h.what;
  EXPECT_EQ(h.phase, Phase::dispatch_counts) << h.what;
  EXPECT_EQ(h.round, kRound) << h.what;
  EXPECT_NE(h.what.find("breaks the wire rules"), std::string::npos) << h.what;
  // The sender is told too: rank 0's abort record is in its window, naming it.
  const std::uint64_t abort = protocol::load_acquire(
      reinterpret_cast<const std::uint64_t*>(rank1->windows[1] + layout.abort_word));
  ASSERT_TRUE(protocol::abort_raised(abort));
  EXPECT_EQ(protocol::unpack_abort(abort).culprit, 1u);
  EXPECT_EQ(protocol::unpack_abort(abort).reporter, 0u);
}

TEST(LayerCreation, DifferentConfigsOnDifferentRanksAreCaughtAtCreation) {
  const auto weights = harness::make_random_weights(kShape, 1);
  auto group = make_host_group(2);
  std::vector<std::string> errors(2);
  within_seconds(20, "layer creation", [&] {
    run_on_rank_threads(2, [&](int rank) {
      auto comm = make_host_communicator(group, rank);
      LayerOptions options;
      options.timeout_ms = 2'000;
      options.combine = rank == 0 ? Combine::staged : Combine::in_kernel_reduce;
      try {
        Layer layer(*comm, make_config(kShape, Precision::bf16, rank, 2, options),
                    local_weight_views(weights, kShape, rank, 2));
      } catch (const Error& e) {
        errors[static_cast<std::size_t>(rank)] = e.what();
      }
    });
  });
  for (const auto& e : errors) EXPECT_THAT(e, HasSubstr("rank 1 was given a different config"));
}

TEST(LayerCreation, WrongWeightShapeNamesTheArgument) {
  const auto weights = harness::make_random_weights(kShape, 1);
  auto group = make_host_group(1);
  auto comm = make_host_communicator(group, 0);
  ExpertWeights w = local_weight_views(weights, kShape, 0, 1);
  w.w2.shape = {kShape.num_experts, kShape.intermediate, kShape.hidden + 64};
  try {
    Layer layer(*comm, make_config(kShape, Precision::bf16, 0, 1), w);
    FAIL() << "accepted a bad w2";
  } catch (const Error& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("weights.w2 has shape"));
  }
}

}  // namespace
}  // namespace epmoe

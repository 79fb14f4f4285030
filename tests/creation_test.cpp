// Layer creation is bounded (docs/design.md §6.1) on the CPU executor, ranks as threads: a rank
// that never creates its layer is named on every other rank within the timeout, a late rank
// fails at once, and a rank that closed its layer and communicator while its peer creates the
// next layer (the issue "No hang anywhere") is named; afterwards the ranks create layers again and
// the rounds are exact. Then the creation meeting the CUDA executor runs on the GPU
// (protocol::CreationSession) on host threads over host windows.
//
// Every scenario runs under the watchdog: a creation that lost its bound fails the test instead of
// hanging CI.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <optional>

#include "epmoe/epmoe.hpp"
#include "harness/cluster.hpp"
#include "harness/problem.hpp"
#include "harness/rank_threads.hpp"
#include "host/host_platform.hpp"
#include "protocol/creation.hpp"
#include "support/layer_creation.hpp"
#include "support/watchdog.hpp"

namespace epmoe {
namespace {

using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;
using test::Creation;
using test::seconds_since;
using test::within_seconds;

constexpr std::uint32_t kTimeoutMs = 300;
constexpr double kSlackSeconds = 1.0;  // beyond the timeout, on 2 shared CI cores
const LayerShape kShape{
    .hidden = 64, .intermediate = 64, .num_experts = 6, .top_k = 2, .max_tokens_per_rank = 8};

LayerOptions options(std::uint32_t timeout_ms = kTimeoutMs) {
  LayerOptions o;
  o.timeout_ms = timeout_ms;
  return o;
}

Creation create(Communicator& comm, const reference::LayerWeights& weights,
                std::uint32_t timeout_ms = kTimeoutMs) {
  return test::create_layer(comm, kShape, weights, timeout_ms);
}

// One round of `rank`; returns the elements that differ from the reference.
std::int64_t round(Layer& layer, const reference::LayerWeights& weights, std::uint64_t seed) {
  const int rank = layer.config().rank(), world = layer.config().world();
  const reference::Batch b = harness::make_random_batch(
      kShape, world, 5, harness::Routing::uniform, 0, seed * 10 + static_cast<std::uint64_t>(rank));
  std::vector<std::uint16_t> y(static_cast<std::size_t>(b.tokens * kShape.hidden));
  layer.forward(view(b.x.data(), DType::bf16, {b.tokens, kShape.hidden}),
                view(b.topk_ids.data(), DType::i32, {b.tokens, kShape.top_k}),
                view(b.topk_weights.data(), DType::f32, {b.tokens, kShape.top_k}),
                view(y.data(), DType::bf16, {b.tokens, kShape.hidden}));
  reference::ReferenceModel reference(kShape, Precision::bf16, options(), weights);
  return reference::compare_bf16(y, reference.forward(b)).mismatches;
}

// Every rank of `comms` creates a layer and runs two rounds; all must be exact.
void expect_layers_work(std::vector<std::unique_ptr<Communicator>>& comms,
                        const reference::LayerWeights& weights) {
  within_seconds(30, "layer creation and rounds after the failure", [&] {
    run_on_rank_threads(static_cast<int>(comms.size()), [&](int rank) {
      Creation c = create(*comms[static_cast<std::size_t>(rank)], weights);
      ASSERT_FALSE(c.error) << "rank " << rank << ": " << c.error->what();
      for (std::uint64_t s = 1; s <= 2; ++s) EXPECT_EQ(round(*c.layer, weights, s), 0);
    });
  });
}

std::vector<std::unique_ptr<Communicator>> host_comms(int world) {
  auto group = make_host_group(world);
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < world; ++r) comms.push_back(make_host_communicator(group, r));
  return comms;
}

TEST(LayerCreationBounded, RankThatNeverCreatesItsLayerIsNamedOnEveryOtherRankWithinTheTimeout) {
  constexpr int kWorld = 3;
  const auto weights = harness::make_random_weights(kShape, 3);
  auto comms = host_comms(kWorld);
  std::vector<Creation> created(kWorld);
  within_seconds(20, "layer creation without rank 1", [&] {
    run_on_rank_threads(kWorld, [&](int rank) {
      if (rank != 1)
        created[static_cast<std::size_t>(rank)] =
            create(*comms[static_cast<std::size_t>(rank)], weights);
    });
  });
  for (int rank : {0, 2}) {
    const Creation& c = created[static_cast<std::size_t>(rank)];
    ASSERT_TRUE(c.error) << "rank " << rank << " created its layer without rank 1";
    EXPECT_EQ(c.error->code(), ErrorCode::timeout);
    EXPECT_THAT(c.error->what(), HasSubstr("Layer creation on rank " + std::to_string(rank) +
                                           ": rank(s) 1 did not create layer #0 within 300 ms"));
    EXPECT_GE(c.seconds, kTimeoutMs / 1000.0 / 2);  // it did wait
    EXPECT_LT(c.seconds, kTimeoutMs / 1000.0 + kSlackSeconds);
  }

  // The late rank does not wait: the others gave up on layer #0, and it says who.
  Creation late;
  within_seconds(20, "the late rank's creation", [&] { late = create(*comms[1], weights); });
  ASSERT_TRUE(late.error);
  EXPECT_EQ(late.error->code(), ErrorCode::peer_aborted);
  EXPECT_THAT(late.error->what(), HasSubstr("gave up creating layer #0"));
  EXPECT_LT(late.seconds, kTimeoutMs / 1000.0 / 2);

  // Every rank used up layer #0, so their counts are in step: the next layer works everywhere.
  expect_layers_work(comms, weights);
}

// The issue: rank 1 ran one forward fewer than rank 0 and went on to create its next layer, while
// rank 0, after its timeout naming rank 1, destroyed its layer and its communicator. Rank 1's
// creation must end within the timeout, naming rank 0; then both rebuild and run exact rounds.
TEST(LayerCreationBounded, PeerThatClosedWhileThisRankCreatesItsNextLayerIsNamed) {
  constexpr int kWorld = 2;
  const auto weights = harness::make_random_weights(kShape, 4);
  auto comms = host_comms(kWorld);
  std::optional<Error> forward_error;
  Creation next;
  within_seconds(20, "the issue's scenario", [&] {
    run_on_rank_threads(kWorld, [&](int rank) {
      Creation c = create(*comms[static_cast<std::size_t>(rank)], weights);
      ASSERT_FALSE(c.error) << c.error->what();
      if (rank == 0) {
        try {
          for (std::uint64_t s = 1; s <= 3; ++s) EXPECT_EQ(round(*c.layer, weights, s), 0);
        } catch (const Error& e) {
          forward_error = e;
        }
        c.layer.reset();  // rank 0 closes: its layer, then its communicator
        comms[0].reset();
      } else {
        for (std::uint64_t s = 1; s <= 2; ++s) EXPECT_EQ(round(*c.layer, weights, s), 0);
        // One forward fewer, then the next layer, still waiting when rank 0 closes.
        next = create(*comms[1], weights, 1'500);
      }
    });
  });
  ASSERT_TRUE(forward_error) << "rank 0's third round must time out waiting for rank 1";
  EXPECT_EQ(forward_error->code(), ErrorCode::timeout);
  ASSERT_TRUE(next.error) << "rank 1 created a layer without rank 0";
  EXPECT_EQ(next.error->code(), ErrorCode::timeout);
  EXPECT_THAT(
      next.error->what(),
      HasSubstr("Layer creation on rank 1: rank(s) 0 did not create layer #1 within 1500 ms"));
  EXPECT_LT(next.seconds, 1.5 + kSlackSeconds);

  comms = host_comms(kWorld);  // the recovery: a new group
  expect_layers_work(comms, weights);
}

// ---- the creation meeting of the CUDA executor (protocol/creation.hpp), on host threads ----

struct HostControlWindows {
  explicit HostControlWindows(int world) : layout{world} {
    for (int r = 0; r < world; ++r) {
      memory.emplace_back(layout.total() / sizeof(std::uint64_t), 0);
      bases.push_back(reinterpret_cast<std::uint8_t*>(memory.back().data()));
    }
  }
  std::uint8_t* window(int rank) const { return bases[static_cast<std::size_t>(rank)]; }

  protocol::CreationLayout layout;
  std::vector<std::vector<std::uint64_t>> memory;
  std::vector<std::uint8_t*> bases;
};

struct HostControlPeers {
  const HostControlWindows* w;
  std::uint8_t* window(int rank) const { return w->window(rank); }
};
using Session = protocol::CreationSession<HostControlPeers>;

std::vector<std::uint64_t> config_line(const std::string& text) {
  std::vector<std::uint64_t> line(protocol::kConfigLineBytes / sizeof(std::uint64_t), 0);
  std::memcpy(line.data(), text.data(), text.size());
  return line;
}

std::string line_of(int rank, std::uint32_t creation) {
  return "rank " + std::to_string(rank) + " creation " + std::to_string(creation);
}

// Says hello to `creation` and waits at most `ms` (0 = forever); gives up on a timeout, as the
// meeting kernel does.
protocol::WaitOutcome meet(const HostControlWindows& w, int rank, std::uint32_t creation,
                           std::uint32_t ms) {
  const Session s(w.layout, HostControlPeers{&w}, rank, creation);
  HostPlatform platform;
  s.say_hello(config_line(line_of(rank, creation)).data());
  const protocol::WaitOutcome o =
      s.await_hellos(protocol::deadline_after_ms(platform, ms), platform);
  if (o.status == protocol::WaitStatus::timeout) s.give_up(o.peer);
  return o;
}

TEST(CreationSession, EveryRankMeetsAndReadsEveryRanksConfigLineOfEachCreation) {
  constexpr int kWorld = 4;
  HostControlWindows w(kWorld);
  within_seconds(20, "creation meetings", [&] {
    run_on_rank_threads(kWorld, [&](int rank) {
      for (std::uint32_t creation = 1; creation <= 5; ++creation) {
        ASSERT_EQ(meet(w, rank, creation, 5'000).status, protocol::WaitStatus::ok);
        const Session s(w.layout, HostControlPeers{&w}, rank, creation);
        for (int src = 0; src < kWorld; ++src)
          EXPECT_EQ(std::string(s.config_line(src)), line_of(src, creation));
      }
    });
  });
}

TEST(CreationSession, MissingRankIsNamedAndALateRankFindsTheCreationGivenUp) {
  constexpr int kWorld = 3;
  HostControlWindows w(kWorld);
  std::vector<protocol::WaitOutcome> outcomes(kWorld);
  std::vector<double> seconds(kWorld);
  within_seconds(20, "a meeting without rank 2", [&] {
    run_on_rank_threads(kWorld, [&](int rank) {
      if (rank == 2) return;
      const auto start = Clock::now();
      outcomes[static_cast<std::size_t>(rank)] = meet(w, rank, 1, kTimeoutMs);
      seconds[static_cast<std::size_t>(rank)] = seconds_since(start);
    });
  });
  // Each survivor names rank 2: it timed out itself, or the other survivor gave up on rank 2 first.
  for (int rank : {0, 1}) {
    const protocol::WaitOutcome& o = outcomes[static_cast<std::size_t>(rank)];
    if (o.status == protocol::WaitStatus::timeout) {
      EXPECT_EQ(o.peer, 2);
      EXPECT_EQ(o.observed, 0u);
    } else {
      EXPECT_EQ(o.status, protocol::WaitStatus::aborted);
      EXPECT_EQ(o.peer, 1 - rank);
      EXPECT_EQ(Session::culprit_of(o.abort_word), 2);
    }
    EXPECT_LT(seconds[static_cast<std::size_t>(rank)], kTimeoutMs / 1000.0 + kSlackSeconds);
  }
  EXPECT_TRUE(outcomes[0].status == protocol::WaitStatus::timeout ||
              outcomes[1].status == protocol::WaitStatus::timeout);
  // The late rank finds the creation given up, waiting for it, even with no bound of its own.
  protocol::WaitOutcome late;
  within_seconds(20, "the late rank", [&] { late = meet(w, 2, 1, 0); });
  EXPECT_EQ(late.status, protocol::WaitStatus::aborted);
  EXPECT_EQ(Session::culprit_of(late.abort_word), 2);

  within_seconds(20, "the next creation", [&] {
    run_on_rank_threads(kWorld, [&](int rank) {
      EXPECT_EQ(meet(w, rank, 2, 5'000).status, protocol::WaitStatus::ok);
    });
  });
}

TEST(CreationSession, RankMoreThanOneCreationAheadIsReportedNotWaitedFor) {
  HostControlWindows w(2);
  const Session ahead(w.layout, HostControlPeers{&w}, 1, 3);
  ahead.say_hello(config_line(line_of(1, 3)).data());
  protocol::WaitOutcome o;
  within_seconds(20, "a rank two creations ahead", [&] { o = meet(w, 0, 1, 0); });
  EXPECT_EQ(o.status, protocol::WaitStatus::violation);
  EXPECT_EQ(o.peer, 1);
  EXPECT_EQ(o.observed, 3u);
}

}  // namespace
}  // namespace epmoe

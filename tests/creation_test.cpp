// The creation meeting of the CUDA executor's layers (protocol::CreationSession, docs/design.md
// §6.1) on host threads over host windows: every rank reads every rank's config line of each
// creation, a missing rank is named, a late rank finds the creation given up, and a rank too far
// ahead is reported instead of waited for. Every scenario runs under the watchdog.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "harness/rank_threads.hpp"
#include "host/host_platform.hpp"
#include "protocol/creation.hpp"
#include "support/watchdog.hpp"

namespace epmoe {
namespace {

using Clock = std::chrono::steady_clock;
using test::within_seconds;

constexpr std::uint32_t kTimeoutMs = 300;
constexpr double kSlackSeconds = 1.0;  // beyond the timeout, on 2 shared CI cores

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
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

// Per-phase timing's host side (docs/design.md §4.2): the device record of %globaltimer stamps
// turned into PhaseTimes (phase_times), and the CPU executor, which has no device clock, saying so.
// The stamps themselves are checked on a GPU (tests/gpu/gpu_phase_times_test.cpp).
#include <gtest/gtest.h>

#include "core/phase_record.hpp"
#include "epmoe/epmoe.hpp"
#include "harness/cluster.hpp"
#include "harness/problem.hpp"
#include "harness/rank_threads.hpp"

namespace epmoe {
namespace {

constexpr int slot(RoundPhase p) {
  return static_cast<int>(p);
}

// A record as a chain of kernels leaves it: each phase's [begin, end] in ns from `t0`.
PhaseRecord chain_record(std::uint64_t t0) {
  PhaseRecord r;
  clear_phase_record(r);
  const auto stamp = [&](RoundPhase p, std::uint64_t begin, std::uint64_t end) {
    r.begin[slot(p)] = t0 + begin;
    r.end[slot(p)] = t0 + end;
  };
  stamp(RoundPhase::dispatch, 0, 4'000);
  stamp(RoundPhase::route, 5'000, 9'000);
  stamp(RoundPhase::wait_counts, 5'100, 6'000);
  stamp(RoundPhase::fc1, 10'000, 30'000);
  stamp(RoundPhase::fc2, 31'000, 50'000);
  stamp(RoundPhase::combine, 51'000, 60'500);
  stamp(RoundPhase::wait_done, 51'200, 58'000);
  return r;
}

TEST(PhaseTimes, AreMicrosecondsFromTheStartOfDispatch) {
  const PhaseTimes t = phase_times(chain_record(1'700'000'000'123'456'789ull), 7);
  ASSERT_FALSE(t.empty());
  EXPECT_EQ(t.round, 7u);
  for (const PhaseSpan& s : t.spans) EXPECT_TRUE(s.stamped);
  EXPECT_DOUBLE_EQ(t[RoundPhase::dispatch].begin_us, 0.0);
  EXPECT_DOUBLE_EQ(t[RoundPhase::dispatch].us(), 4.0);
  EXPECT_DOUBLE_EQ(t[RoundPhase::wait_counts].begin_us, 5.1);
  EXPECT_DOUBLE_EQ(t[RoundPhase::fc1].us(), 20.0);
  EXPECT_DOUBLE_EQ(t[RoundPhase::wait_done].end_us, 58.0);
  EXPECT_DOUBLE_EQ(t.total_us(), 60.5);
}

// wgmma's FC2 starts with CUTLASS's GEMM, which stamps nothing; its home kernel stamps only the
// end.
TEST(PhaseTimes, PhaseWithOnlyAnEndBeginsWhereThePreviousPhaseEnded) {
  PhaseRecord r = chain_record(1'000'000);
  r.begin[slot(RoundPhase::fc2)] = kUnstampedBegin;
  const PhaseTimes t = phase_times(r, 3);
  ASSERT_TRUE(t[RoundPhase::fc2].stamped);
  EXPECT_DOUBLE_EQ(t[RoundPhase::fc2].begin_us, t[RoundPhase::fc1].end_us);
  EXPECT_DOUBLE_EQ(t[RoundPhase::fc2].end_us, 50.0);
}

// A wait is nested in its phase, not chained after the one before: with no begin it is unstamped
// (so is a phase that nothing stamped), while the others stay as they are.
TEST(PhaseTimes, UnstampedPhasesAndWaitsAreReportedAsSuch) {
  PhaseRecord r = chain_record(1'000'000);
  r.begin[slot(RoundPhase::wait_done)] = kUnstampedBegin;
  r.begin[slot(RoundPhase::fc1)] = kUnstampedBegin;
  r.end[slot(RoundPhase::fc1)] = 0;
  const PhaseTimes t = phase_times(r, 3);
  EXPECT_FALSE(t[RoundPhase::wait_done].stamped);
  EXPECT_FALSE(t[RoundPhase::fc1].stamped);
  EXPECT_TRUE(t[RoundPhase::fc2].stamped);
  EXPECT_DOUBLE_EQ(t[RoundPhase::fc2].begin_us, 31.0) << "fc2 has its own begin";
  r.begin[slot(RoundPhase::fc2)] = kUnstampedBegin;
  EXPECT_FALSE(phase_times(r, 3)[RoundPhase::fc2].stamped)
      << "fc1 left no end: fc2 has nothing to begin at";
  EXPECT_TRUE(t[RoundPhase::combine].stamped);
}

TEST(PhaseTimes, RecordWithoutDispatchOrRoundIsEmpty) {
  PhaseRecord cleared;
  clear_phase_record(cleared);
  EXPECT_TRUE(phase_times(cleared, 5).empty());
  EXPECT_TRUE(phase_times(chain_record(1'000), 0).empty());
  EXPECT_EQ(phase_times(cleared, 5).total_us(), 0.0);
}

TEST(PhaseTimes, EveryPhaseHasAName) {
  EXPECT_STREQ(to_string(RoundPhase::dispatch), "dispatch");
  EXPECT_STREQ(to_string(RoundPhase::wait_counts), "wait_counts");
  EXPECT_STREQ(to_string(RoundPhase::wait_done), "wait_done");
}

TEST(PhaseTimes, CpuExecutorRefusesTimingAndReportsNoPhases) {
  const LayerShape shape{64, 64, 4, 2, 8};
  Cluster cluster(shape, Precision::bf16, LayerOptions{}, 1, harness::make_random_weights(shape, 1),
                  Backend::cpu_threads);
  Layer& layer = cluster.layer(0);
  try {
    layer.set_phase_timing(true);
    FAIL() << "the CPU executor has no device clock";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::unsupported);
    EXPECT_NE(std::string(e.what()).find("CUDA executor only"), std::string::npos) << e.what();
  }
  layer.set_phase_timing(false);  // off is what it is already
  const auto batch =
      harness::make_random_batch(shape, 1, 3, harness::Routing::uniform, 0, /*seed=*/2);
  run_on_rank_threads(1, [&](int rank) { cluster.forward(rank, batch); });
  EXPECT_TRUE(layer.last_phase_times().empty());
}

}  // namespace
}  // namespace epmoe

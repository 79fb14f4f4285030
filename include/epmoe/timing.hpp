// Per-phase timing of a round on the GPU (docs/design.md §4.2): with Layer::set_phase_timing(true),
// the kernels of each phase stamp the GPU's %globaltimer when they start and when they end, into a
// record in device memory (no host synchronisation inside forward), and
// Layer::last_phase_times() reads the last finished round's record back.
#pragma once

#include <array>
#include <cstdint>

namespace epmoe {

// The phases of a round in chain order (by when they begin). The two waits lie inside the phase
// before them: wait_counts inside route (step 4), wait_done inside combine (step 7).
enum class RoundPhase : std::uint8_t {
  dispatch = 0,     // steps 1-3: rows to their owners, counts to every rank
  route = 1,        // steps 4-5: wait for the counts, check and stage the received rows, bucket
  wait_counts = 2,  // step 4: the bounded wait for every rank's count message
  fc1 = 3,          // step 5: FC1 + activation + FC2's input quantization (wgmma: plan, gather too)
  fc2 = 4,          // steps 5-6: FC2, results home (wgmma: home), done to every rank
  combine = 5,      // step 7: wait for the dones, finish y, advance the round
  wait_done = 6,    // step 7: the bounded wait for every rank's done message
};
inline constexpr int kRoundPhases = 7;

const char* to_string(RoundPhase phase);

// One phase: from the earliest stamp of its kernels' CTAs to the latest, in microseconds from the
// start of the round's dispatch on this rank's GPU.
struct PhaseSpan {
  bool stamped = false;  // false: no kernel of this phase recorded it
  double begin_us = 0.0;
  double end_us = 0.0;
  double us() const { return end_us - begin_us; }
};

// One round's phases on this rank. Empty (round 0) when timing is off, before the first timed
// round, and on the CPU executor.
struct PhaseTimes {
  std::uint32_t round = 0;  // the round these times belong to (Layer::next_round() - 1)
  std::array<PhaseSpan, kRoundPhases> spans{};

  bool empty() const { return round == 0; }
  const PhaseSpan& operator[](RoundPhase p) const { return spans[static_cast<std::size_t>(p)]; }
  // From the start of dispatch to the end of combine (0 when empty).
  double total_us() const { return empty() ? 0.0 : (*this)[RoundPhase::combine].end_us; }
};

}  // namespace epmoe

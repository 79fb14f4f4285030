// The device record of per-phase timing (docs/design.md §4.2) and how the host turns it into
// PhaseTimes. The CUDA kernels stamp it (cuda/phase_clock.cuh); this part is plain host code, so
// the CPU tests check it.
#pragma once

#include <cstdint>

#include "epmoe/timing.hpp"

namespace epmoe {

// One round's stamps in %globaltimer nanoseconds: begin[p] is the earliest start of a CTA of
// phase p's kernels (atomicMin), end[p] the latest end (atomicMax). Cleared, a begin is
// kUnstampedBegin and an end 0.
struct PhaseRecord {
  std::uint64_t begin[kRoundPhases];
  std::uint64_t end[kRoundPhases];
};
inline constexpr std::uint64_t kUnstampedBegin = ~std::uint64_t{0};

// constexpr: the device calls it too (built with --expt-relaxed-constexpr).
constexpr void clear_phase_record(PhaseRecord& r) {
  for (int p = 0; p < kRoundPhases; ++p) {
    r.begin[p] = kUnstampedBegin;
    r.end[p] = 0;
  }
}

// `r` as microseconds from the start of dispatch. A phase whose end is stamped but whose begin
// is not (the wgmma backend's FC2 starts with CUTLASS's GEMM, which stamps nothing) begins where
// the phase before it in chain order ended; waits have no phase before them here. Empty when
// dispatch has no stamps (timing was off for that round).
PhaseTimes phase_times(const PhaseRecord& r, std::uint32_t round);

}  // namespace epmoe

// Bounded waits (docs/design.md §3 I3, I4). Every wait has a deadline, watches the local abort
// word, and rejects a peer that is not exactly zero or one round behind. The platform supplies the
// clock and the backoff: %globaltimer + __nanosleep on the GPU, steady_clock + yield/sleep on the
// CPU.
#pragma once

#include <cstdint>

#include "protocol/atomics.hpp"
#include "protocol/message.hpp"

namespace epmoe::protocol {

enum class WaitStatus : std::uint32_t { ok, timeout, aborted, violation };

struct WaitOutcome {
  WaitStatus status = WaitStatus::ok;
  int peer = -1;                 // whom we waited for
  std::uint32_t observed = 0;    // the round we last saw from them
  std::uint64_t abort_word = 0;  // when aborted: the record raised by whoever gave up
};

// Deadline in the platform's nanoseconds; 0 = wait forever (timeout_ms = 0).
struct Deadline {
  std::uint64_t at_ns = 0;
  EPMOE_HD bool forever() const { return at_ns == 0; }
};

template <class Platform>
EPMOE_HD Deadline deadline_after_ms(Platform& platform, std::uint32_t timeout_ms) {
  if (timeout_ms == 0) return Deadline{0};
  return Deadline{platform.now_ns() + std::uint64_t{timeout_ms} * 1'000'000u};
}

// Waits until `*word` (written by `peer`) carries `round`.
template <class Platform>
EPMOE_HD WaitOutcome wait_for_round(const std::uint64_t* word, std::uint32_t round, int peer,
                                    const std::uint64_t* abort_word, Deadline deadline,
                                    Platform& platform) {
  for (std::uint32_t attempt = 0;; ++attempt) {
    // Abort first: once anyone gave up, this round is void even where its messages arrived.
    const std::uint64_t abort = load_acquire(abort_word);
    const std::uint32_t observed = inbox_round(load_acquire(word));
    if (abort_raised(abort)) return WaitOutcome{WaitStatus::aborted, peer, observed, abort};
    const std::uint32_t behind = rounds_behind(observed, round);
    if (behind == 0) return WaitOutcome{WaitStatus::ok, peer, observed, 0};
    if (behind != 1) return WaitOutcome{WaitStatus::violation, peer, observed, 0};
    if (!deadline.forever() && platform.now_ns() > deadline.at_ns)
      return WaitOutcome{WaitStatus::timeout, peer, observed, 0};
    platform.pause(attempt);
  }
}

}  // namespace epmoe::protocol

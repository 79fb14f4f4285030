// Failure records of the round protocol, built and worded the same way on both executors.
#pragma once

#include <cstdint>
#include <string>

#include "epmoe/errors.hpp"
#include "protocol/wait.hpp"

namespace epmoe {

// What a rank in `round` knows after a bounded wait in `phase` failed with `w`.
Health failure_from_wait(int rank, std::uint32_t round, Phase phase,
                         const protocol::WaitOutcome& w);

// A reset() that did not meet: `peer` never called it.
Health reset_timeout(int rank, std::uint32_t round, int peer);

// The one-line text of a record (its `what`), e.g. "rank 0 timed out after 500 ms in phase
// dispatch_counts of round 3 waiting for rank 1 (last saw its round 2, expected 3)".
std::string describe_failure(const Health& h, std::uint32_t timeout_ms);

}  // namespace epmoe

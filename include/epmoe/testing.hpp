// Fault switches for tests and `epmoe stress --fault` (docs/design.md §3 I1, I3). Compiled in only
// when the library is built with EPMOE_FAULT_INJECTION (test builds); otherwise inject_fault()
// throws Error(unsupported).
#pragma once

#include <cstdint>

#include "epmoe/layer.hpp"

namespace epmoe::testing {

enum class Fault : std::uint8_t {
  none,
  skip_launch_when_idle,  // forward() with T == 0 returns without running the round (the hang)
  stall,                  // sleep `stall_ms` inside the round, after dispatch
  round_jump,             // the round counter jumps ahead by 2 before the next round
};
const char* to_string(Fault f);

struct FaultSpec {
  Fault fault = Fault::none;
  std::uint32_t stall_ms = 0;
  std::uint32_t times = 1;  // how many rounds the fault fires; then it disarms itself
};

bool fault_injection_available();
void inject_fault(Layer& layer, const FaultSpec& spec);

// Starts this rank's rounds at `round` instead of 1, as if round - 1 had just completed on every
// rank: for testing the modulo-2^32 round arithmetic across its wrap. Call it on every rank of a
// fresh layer before its first forward(). CPU executor only.
void start_rounds_at(Layer& layer, std::uint32_t round);

}  // namespace epmoe::testing

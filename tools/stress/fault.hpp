// --fault KIND:RANK[:MS]: which rank misbehaves, how, and in which rounds.
#pragma once

#include <cstdint>
#include <string>

#include "epmoe/testing.hpp"

namespace epmoe::tools::stress {

using testing::Fault;
struct Options;

struct FaultPlan {
  Fault fault = Fault::none;
  int rank = -1;
  std::uint32_t stall_ms = 0;
  std::string text;   // as given, for the header
  bool kill = false;  // kill:RANK: the supervisor SIGKILLs the rank process mid-round
};

// Rejects a fault that cannot be detected (a stall within the timeout, an unbounded wait, one
// rank) or that the rank mode cannot run (kill:RANK needs processes, processes only kill).
FaultPlan parse_fault(const std::string& text, int ranks, std::uint32_t timeout_ms, bool processes);

// The round at which fault episode `episode` (0-based) of --fault-times fires: evenly spaced.
std::int64_t fault_round(const Options& o, int episode);

// The round at which kill episode `episode` arms: evenly spaced, jittered by the seed.
std::int64_t kill_round(const Options& o, int episode);

}  // namespace epmoe::tools::stress

// Ranks as threads of this process, on either executor (core/cluster.hpp): each rank thread runs
// its own rounds at its own pace, with no barrier between rounds, and reports failed rounds to the
// in-process Recovery.
#pragma once

#include "stress/options.hpp"

namespace epmoe::tools::stress {

// Runs the whole stress test and prints its summary; returns the exit status.
int run_threads(const Options& o, const Setup& s);

}  // namespace epmoe::tools::stress

// Ranks as processes (--processes) under a supervisor, the parent: it forks one process per rank,
// relays the NCCL unique ids and the round to resume at, SIGKILLs the doomed rank (--fault
// kill:RANK) mid-round and starts its replacement, watches the clock, and judges each kill.
#pragma once

#include "stress/options.hpp"

namespace epmoe::tools::stress {

// Runs the whole stress test and prints its summary; returns the exit status. Call it before any
// thread, layer or CUDA context exists: it forks.
int run_processes(const Options& o, const Setup& s);

}  // namespace epmoe::tools::stress

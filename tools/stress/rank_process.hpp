// One rank as a process (--processes): its own communicator and layer, over POSIX shared memory
// (CPU executor) or on GPU r (CUDA executor), running its rounds as a rank thread does, with the
// supervisor as the control plane.
#pragma once

#include <cstdint>
#include <string>

#include "stress/options.hpp"

namespace epmoe::tools::stress {

struct RankProcessStart {
  std::string group;  // the shared-memory group's name (CPU executor)
  int rank = 0;
  int up = -1;    // writes Msg to the supervisor
  int down = -1;  // reads Resume from the supervisor
  // A replacement for a process killed in round `replay_through` after `episodes_done` kill
  // episodes: it rejoins the survivors instead of starting the run.
  bool restarted = false;
  std::int64_t replay_through = 0;
  int episodes_done = 0;
};

// The body of a forked rank process; returns its exit status (a RankExit).
int rank_process(const Options& o, const Setup& s, const RankProcessStart& start);

}  // namespace epmoe::tools::stress

// The load each rank puts on the layer: T from an idle/busy Markov chain (with lulls in which every
// rank is idle), a routing pattern and a pacing sleep per round, all drawn from the seed so that a
// restarted rank process can replay them.
#pragma once

#include <cstdint>
#include <optional>

#include "epmoe/epmoe.hpp"
#include "harness/problem.hpp"
#include "stress/options.hpp"

namespace epmoe::tools::stress {

// One round's draws.
struct RoundDraw {
  std::int64_t tokens = 0;
  harness::Routing routing = harness::Routing::uniform;
  std::int64_t target = 0;  // the expert (one_expert) or rank (one_rank) the routing aims at
  std::uint32_t sleep_us = 0;
};

class Load {
 public:
  Load(const Options& o, const Setup& s, int rank);

  // The next round's draws; call it for every round in order, failed ones too.
  RoundDraw draw(std::int64_t round);

 private:
  bool in_lull(std::int64_t round) const;
  std::int64_t next_tokens(std::int64_t round);
  harness::Routing next_routing();
  std::uint32_t next_sleep_us();

  int ranks_;
  LayerShape shape_;
  std::optional<harness::Routing> fixed_routing_;
  std::uint32_t max_sleep_us_;
  std::uint64_t seed_;
  harness::Rng rng_;
  double run_ = 1.0, lull_ = 0.0, leave_idle_ = 0.0, enter_idle_ = 0.0;
  bool idle_ = false;
};

// The rank's batch of that round (seeded by round and rank alone).
reference::Batch round_batch(const Options& o, const LayerShape& shape, const RoundDraw& d,
                             std::int64_t round, int rank);

}  // namespace epmoe::tools::stress

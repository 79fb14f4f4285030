#include "stress/load.hpp"

#include <algorithm>

namespace epmoe::tools::stress {

Load::Load(const Options& o, const Setup& s, int rank)
    : ranks_(o.ranks),
      shape_(s.shape),
      fixed_routing_(s.fixed_routing),
      max_sleep_us_(o.max_sleep_us),
      seed_(o.seed),
      rng_(o.seed * 0x9e3779b97f4a7c15ull + static_cast<std::uint64_t>(rank) * 7919u + 17u) {
  const double f = std::clamp(o.idle_fraction, 0.0, 1.0);
  run_ = std::max(1.0, o.idle_run);
  // A quarter of the idle rounds are lulls in which every rank is idle (no requests anywhere);
  // the rest come from each rank's own Markov chain, with stationary idle fraction `own` and
  // mean idle-run length `run`: leave idle w.p. 1/run, enter idle w.p. own / (1 - own) / run.
  lull_ = f / 4;
  const double own = f >= 1.0 ? 1.0 : (f - lull_) / (1.0 - lull_);
  leave_idle_ = own >= 1.0 ? 0.0 : 1.0 / run_;
  enter_idle_ = own >= 1.0 ? 1.0 : std::min(1.0, leave_idle_ * own / (1.0 - own));
  idle_ = rng_.uniform() < own;
}

// Lulls are blocks of `run` rounds chosen from the seed alone, so every rank agrees on them
// without talking (and still agrees after a fault episode skipped some rounds).
bool Load::in_lull(std::int64_t round) const {
  harness::Rng block(seed_ * 0xd1b54a32d192ed03ull +
                     static_cast<std::uint64_t>(static_cast<double>(round) / run_) + 5);
  return block.uniform() < lull_;
}

std::int64_t Load::next_tokens(std::int64_t round) {
  const std::int64_t max_tokens = shape_.max_tokens_per_rank;
  idle_ = idle_ ? rng_.uniform() >= leave_idle_ : rng_.uniform() < enter_idle_;
  if (idle_ || in_lull(round)) return 0;
  if (rng_.uniform() < 0.1) return max_tokens;  // the edge
  return 1 + rng_.below(max_tokens);
}

harness::Routing Load::next_routing() {
  if (fixed_routing_) return *fixed_routing_;
  const double p = rng_.uniform();
  return p < 0.55   ? harness::Routing::uniform
         : p < 0.7  ? harness::Routing::one_expert
         : p < 0.85 ? harness::Routing::one_rank
                    : harness::Routing::all_dropped;
}

// Half the rounds go straight in, half sleep up to max_us, one in a hundred up to 10x that.
std::uint32_t Load::next_sleep_us() {
  const std::uint32_t max_us = max_sleep_us_;
  if (max_us == 0) return 0;
  const double p = rng_.uniform();
  if (p < 0.01) return static_cast<std::uint32_t>(rng_.below(10 * std::int64_t{max_us}));
  if (p < 0.5) return static_cast<std::uint32_t>(rng_.below(std::int64_t{max_us} + 1));
  return 0;
}

RoundDraw Load::draw(std::int64_t round) {
  RoundDraw d;
  d.tokens = next_tokens(round);
  d.routing = next_routing();
  d.target = rng_.below(d.routing == harness::Routing::one_rank ? ranks_ : shape_.num_experts);
  d.sleep_us = next_sleep_us();
  return d;
}

reference::Batch round_batch(const Options& o, const LayerShape& shape, const RoundDraw& d,
                             std::int64_t round, int rank) {
  return harness::make_random_batch(shape, o.ranks, d.tokens, d.routing, d.target,
                                    o.seed * 1'000'003u + static_cast<std::uint64_t>(round) * 131u +
                                        static_cast<std::uint64_t>(rank));
}

}  // namespace epmoe::tools::stress

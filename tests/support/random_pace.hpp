// The GPU tests' no-barrier load: every rank runs its rounds at its own pace. Each round draws T
// (draw_tokens), sends every slot to one random rank one round in five (else uniform routing),
// sleeps up to 2 ms first three rounds in ten, and every `check_every`-th output is checked
// against the reference (expect_matches). Call it from inside within_seconds.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>

#include "harness/cluster.hpp"
#include "harness/problem.hpp"
#include "harness/rank_threads.hpp"
#include "support/matches_reference.hpp"

namespace epmoe::test {

struct PaceCounts {
  int idle = 0;   // forwards with T = 0, over every rank
  int total = 0;  // forwards, over every rank
};

template <class DrawTokens>
PaceCounts run_at_random_pace(Cluster& cluster, const LayerShape& shape, int world, int rounds,
                              int check_every, DrawTokens draw_tokens) {
  std::atomic<int> idle{0}, total{0};
  run_on_rank_threads(world, [&](int rank) {
    harness::Rng rng(77 + static_cast<std::uint64_t>(rank));
    for (int r = 0; r < rounds; ++r) {
      const std::int64_t t = draw_tokens(rng);
      const harness::Routing routing =
          rng.uniform() < 0.2 ? harness::Routing::one_rank : harness::Routing::uniform;
      const reference::Batch b =
          harness::make_random_batch(shape, world, t, routing, rng.below(world), rng.next());
      if (rng.uniform() < 0.3)
        std::this_thread::sleep_for(std::chrono::microseconds(rng.below(2000)));
      idle += t == 0;
      ++total;
      const auto y = cluster.forward(rank, b);
      if (r % check_every == 0) expect_matches(y, b, cluster, "round " + std::to_string(r));
    }
  });
  return PaceCounts{idle.load(), total.load()};
}

}  // namespace epmoe::test

// How many CTAs the round's own kernels can use in a token bucket (docs/design.md I5,
// round_shapes in kernels.hpp): plain arithmetic, so the CPU tests check it
// (tests/round_grid_caps_test.cpp). dispatch and combine take a token per CTA; route a received
// row per CTA, at most world x the bucket's largest T (every rank sending that many); bucket a
// received row per thread. The prefill bucket has no largest T (the int64 maximum): its caps
// saturate and never bind.
#pragma once

#include <cstdint>
#include <limits>

namespace epmoe::cuda {

struct RoundGridCaps {
  std::int64_t per_token;       // dispatch, combine
  std::int64_t per_row;         // route
  std::int64_t per_row_thread;  // bucket, threads_per_cta rows per CTA
};

inline RoundGridCaps round_grid_caps(std::int64_t max_tokens, int world, int threads_per_cta) {
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  const std::int64_t rows = max_tokens > kMax / world ? kMax : max_tokens * world;
  return RoundGridCaps{max_tokens, rows,
                       rows / threads_per_cta + (rows % threads_per_cta != 0 ? 1 : 0)};
}

}  // namespace epmoe::cuda

// How many CTAs the round's own kernels can use in a token bucket (docs/design.md I5,
// round_shapes in kernels.hpp): plain arithmetic, so the CPU tests check it
// (tests/round_grid_caps_test.cpp). dispatch and combine take a token per CTA; route a received
// row per CTA, at most world x the bucket's largest T (every rank sending that many); bucket a
// received row per warp. An expert backend's per-pair kernels (wgmma's gather, activate and
// home) take a few (row, expert) pairs per CTA, at most world x the largest T x top_k of them
// (bucket_pairs). The prefill bucket has no largest T (the int64 maximum): its caps saturate and
// never bind. Every capped kernel strides over its work, so a cap that binds (a peer in a larger
// bucket sending more rows) slows it and never loses work.
#pragma once

#include <cstdint>
#include <limits>

namespace epmoe::cuda {

struct RoundGridCaps {
  std::int64_t per_token;     // dispatch, combine
  std::int64_t per_row;       // route
  std::int64_t per_row_warp;  // bucket, threads_per_cta / 32 rows per CTA
};

// a x b, or the int64 maximum where it would overflow (a, b >= 1)
inline std::int64_t saturating_product(std::int64_t a, std::int64_t b) {
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  return a > kMax / b ? kMax : a * b;
}
// CTAs for `items` at `per_cta` each (the last one partial)
inline std::int64_t ctas_for(std::int64_t items, std::int64_t per_cta) {
  return items / per_cta + (items % per_cta != 0 ? 1 : 0);
}

inline RoundGridCaps round_grid_caps(std::int64_t max_tokens, int world, int threads_per_cta) {
  const std::int64_t rows = saturating_product(max_tokens, world);
  return RoundGridCaps{max_tokens, rows, ctas_for(rows, threads_per_cta / 32)};
}

// The (row, expert) pairs a rank can receive in a token bucket, which bound an expert backend's
// per-pair kernels (ctas_for(bucket_pairs(...), pairs per CTA)): world x max_tokens x top_k
// (every rank sending its largest T, each token's top_k slots all to this rank's experts).
inline std::int64_t bucket_pairs(std::int64_t max_tokens, int world, int top_k) {
  return saturating_product(saturating_product(max_tokens, world), top_k);
}

}  // namespace epmoe::cuda

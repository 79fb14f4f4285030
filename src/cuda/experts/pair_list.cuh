// The pair list's device parts (docs/design.md §3 step 5): where a received row lies, and an entry
// of it appended to its local expert's part of the list. Route and bucket use them
// (route_steps.cuh), and so does a backend that groups the pairs itself while it copies the rows
// (ExpertBackend::buckets_pairs: the wgmma backend's gather, experts/wgmma/steps.cuh).
#pragma once

#include <cstdint>

#include "cuda/experts/inputs.hpp"

namespace epmoe::cuda::experts {

// Received row `item` of this round: which source rank, which of its rows.
__device__ inline void locate_row(const std::uint32_t* rows_from, std::uint32_t item, int& src,
                                  std::uint32_t& row) {
  src = 0;
  row = item;
  while (row >= rows_from[src]) row -= rows_from[src++];
}

// This round's received rows in all (route's counts per source rank, state->rows_from, once its
// wait passed; read there, not copied: a copy of kMaxWorld counts per thread took 256 bytes of
// local memory).
__device__ inline std::uint32_t received_rows(const RoundState* state, int world) {
  std::uint32_t total = 0;
  for (int src = 0; src < world; ++src) total += state->rows_from[src];
  return total;
}

// Entry `entry` of receive row `row` from `src`, whose local expert is `e`, appended to that
// expert's part of the pair list (the next of its pair_offset[e] .. places, in arrival order, which
// changes no result: a GEMM's rows are independent). Returns the pair's place.
__device__ inline std::uint32_t append_pair(const PairSink& sink, const std::uint32_t* pair_offset,
                                            int e, int src, int entry, std::uint32_t row) {
  const std::uint32_t at = pair_offset[e] + atomicAdd(&sink.expert_fill[e], 1u);
  sink.pairs[at] = pack_pair(src, entry, row);
  return at;
}

}  // namespace epmoe::cuda::experts

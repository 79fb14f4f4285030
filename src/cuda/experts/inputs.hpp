// What the round hands an expert backend (docs/design.md §4.1): the pairs route and bucket grouped
// by local expert, the rows route staged in the form the backend asked for, where FC2 sends each
// result, and the round state. All device pointers, fixed at layer creation; what changes per
// round lives in device memory, so a backend's launches never read the host and a captured graph
// replays correctly.
#pragma once

#include <cstdint>

#include "cuda/round_params.hpp"
#include "epmoe/config.hpp"
#include "formats/codec.hpp"  // EPMOE_HD
#include "protocol/workspace.hpp"

namespace epmoe::cuda::experts {

// Route cuts each expert's pairs into chunks of at most this many rows (chunk_offset); every
// backend's tile takes one chunk.
inline constexpr int kChunkRows = 64;

// Every pair a rank can receive in one round: each source rank's max_tokens rows, each with at
// most top_k entries here. (top_k, not min(top_k, E_local): duplicate ids in a token's top-k are
// legal input and each is a pair of its own.)
inline std::size_t max_pairs(const LayerConfig& config) {
  return static_cast<std::size_t>(config.world()) *
         static_cast<std::size_t>(config.shape().max_tokens_per_rank) *
         static_cast<std::size_t>(config.shape().top_k);
}

// A pair of the list: which source rank's row, which entry of it, which receive row.
EPMOE_HD std::uint32_t pack_pair(int src, int entry, std::uint32_t row) {
  return static_cast<std::uint32_t>(src) << 24 | static_cast<std::uint32_t>(entry) << 20 | row;
}
EPMOE_HD int pair_src(std::uint32_t pair) {
  return static_cast<int>(pair >> 24);
}
EPMOE_HD int pair_entry(std::uint32_t pair) {
  return static_cast<int>(pair >> 20 & 0xFu);
}
EPMOE_HD std::uint32_t pair_row(std::uint32_t pair) {
  return pair & 0xFFFFFu;
}
static_assert(kMaxWorld <= 64 && kMaxTopK <= 16 && kMaxTokensPerRank <= (1 << 20),
              "a pair packs src in 6 bits, entry in 4, receive row in 20");

// The round's expert inputs as route and bucket leave them (read-only to a backend).
struct ExpertInputs {
  const std::uint32_t* pair_offset;   // [E_local + 1] first pair of each expert; [E_local] = all
  const std::uint32_t* chunk_offset;  // [E_local + 1] first chunk of each expert; [E_local] = all
  const std::uint32_t* pairs;         // [max_pairs] packed pairs, grouped by expert
  std::int64_t max_tokens;            // receive rows per source: a pair's row in x below is
                                      // pair_src * max_tokens + pair_row
  const float* x;                     // StagedRows::fp32 only: [world * max_tokens, H] decoded
  const std::uint16_t* x16;           // StagedRows::bf16_codes only: bf16(x * x_scale), exact
  const float* x_scale;               // [world * max_tokens]
};

// Where FC2's epilogue sends each result (docs/design.md §4 "Combine modes"), and what the last
// CTA needs to tell every rank this rank's experts are done (§3 step 6): this rank's receive rows
// say each pair's token, top-k slot and router weight; the home rank's combine region takes the
// result.
struct TokenBackTarget {
  protocol::WorkspaceLayout layout;   // receive rows and combine rows
  std::uint8_t* const* peer_windows;  // [world] LSA base pointer of each rank's window
  int rank;                           // this rank
  Combine combine;
  std::int64_t top_k;
};

// The GEMM problem every backend solves, from the config.
struct ExpertProblem {
  std::int64_t hidden, intermediate, local_experts;
  Precision precision;     // of the weights and of FC2's input quantization point
  ScaleRounding rounding;  // MXFP8 block scales
  Activation activation;   // math::activation, between FC1 (+ b13) and FC2
  float swiglu_limit;      // the activation's clamp (0 = none, swiglu only)
};
inline ExpertProblem expert_problem(const LayerConfig& config) {
  const LayerOptions& o = config.options();
  return ExpertProblem{config.shape().hidden, config.shape().intermediate, config.local_experts(),
                       config.precision(),    o.mxfp8_scale_rounding,      o.activation,
                       o.swiglu_limit};
}

// Where the pair list is written (bucket's output): the list itself and each local expert's fill
// count, zeroed by dispatch every round. A backend that groups the pairs itself
// (ExpertBackend::buckets_pairs) writes them here, as bucket would.
struct PairSink {
  std::uint32_t* pairs;        // [max_pairs], ExpertInputs::pairs
  std::uint32_t* expert_fill;  // [E_local]
};

// Everything a backend's launches receive from the round.
struct ExpertStep {
  RoundState* state;  // the round number, the failed flag, the experts-done ticket
  ExpertInputs in;
  TokenBackTarget home;
  PairSink sink;
};

}  // namespace epmoe::cuda::experts

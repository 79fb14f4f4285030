// What the round's kernels share (docs/design.md §3, §4): a small params struct passed by value,
// the round state in device memory, and the health record in mapped pinned host memory.
#pragma once

#include <cstdint>

#include "core/phase_record.hpp"
#include "epmoe/config.hpp"
#include "protocol/workspace.hpp"

namespace epmoe::cuda {

inline constexpr int kMaxWorld = 64;

// What route stages per received row for the expert backend's FC1 (ExpertBackend::staged_rows).
enum class StagedRows : std::uint8_t {
  fp32,        // x: the decoded row in fp32
  bf16_codes,  // x16 / x_scale: the row as exact bf16 codes and its scale
  wire,        // nothing: the backend reads the checked rows' wire payloads itself
};

// Lives in device memory; advanced by the kernels themselves (never by the host), so a captured
// CUDA graph replays rounds correctly.
struct RoundState {
  std::uint32_t round;                 // the round the next forward runs
  std::uint32_t failed;                // set when a wait failed: later kernels do nothing
  std::uint32_t tickets[4];            // CTAs finished per kernel: the last one publishes
  std::uint32_t rows_to[kMaxWorld];    // dispatch: rows written to each rank this round
  std::uint32_t rows_from[kMaxWorld];  // counts received this round (written by the last waiter)
  // The persistent round kernel's grid barrier (persistent_round.cu): CTAs arrived at the current
  // barrier, and barriers passed (never reset; only its changes are watched). reset() zeroes
  // `arrived`, which a failed round may leave part-counted.
  std::uint32_t barrier_arrived;
  std::uint32_t barrier_generation;
  // Per-phase timing (docs/design.md §4.2), set by the host between rounds: when nonzero the
  // kernels stamp round r into phases[r % 2], and the last combine CTA clears the next round's.
  std::uint32_t timing;
  PhaseRecord phases[2];
};

// The diagnostic record of docs/design.md §3 I3, in mapped pinned host memory: the host reads it
// without synchronising the stream. `claimed` is taken with a CAS by the first writer; `published`
// is stored after every field, so the host never reads a half-written record.
struct HealthRecord {
  std::uint32_t claimed;
  std::uint32_t published;
  std::uint32_t code;  // ErrorCode
  std::int32_t rank;
  std::int32_t peer;
  std::uint32_t phase;  // Phase
  std::uint32_t round;
  std::uint32_t observed;
  std::uint32_t expected;
  std::int32_t reporter;   // peer_aborted: the rank that gave up
  std::int64_t bad_token;  // invalid_argument: first out-of-range topk_ids entry
  std::int64_t bad_slot;
  std::int64_t bad_value;
};

// Which ticket each kernel that has a "last CTA" step counts on.
enum Ticket : int {
  kDispatchTicket = 0,
  kExpertsDoneTicket = 1,
  kCombineTicket = 2,
  kRouteTicket = 3
};

// What route and bucket write each round for the expert backend (sliced by src/cuda/experts.cu
// from one allocation sized from the config maxima, so forward() never allocates and stays
// graph-capturable). The backend reads it through experts::ExpertInputs (experts/inputs.hpp).
struct RouteScratch {
  std::uint32_t* expert_rows;   // [E_local] pairs per local expert this round (zeroed per round)
  std::uint32_t* expert_fill;   // [E_local] bucketing cursor per local expert (zeroed per round)
  std::uint32_t* pair_offset;   // [E_local + 1] first pair of each expert; [E_local] = all pairs
  std::uint32_t* chunk_offset;  // [E_local + 1] first chunk of each expert; [E_local] = all chunks
  std::uint32_t* pairs;         // [max_pairs] (src, entry, row) of each pair, grouped by expert
  float* x;                     // [world * max_tokens, H] received rows, decoded (fp32 only)
  // StagedRows::bf16_codes only (nullptr otherwise): each row as bf16 codes, x * x_scale, exact
  // (NVFP4: code = e2m1 * block scale, scale = s_enc; else scale 1).
  std::uint16_t* x16;  // [world * max_tokens, H]
  float* x_scale;      // [world * max_tokens]
};

// What the round's kernels (dispatch, route, bucket, combine, reset) take, by value: the layer's
// window and peers, the round state and health record, the route scratch and this round's
// tensors. The expert GEMMs take their backend's own params instead (docs/design.md §4.1).
struct RoundParams {
  // The layer
  protocol::WorkspaceLayout layout;
  std::uint8_t* const* peer_windows;  // [world] LSA base pointer of each rank's window
  int rank;
  int world;
  std::int64_t hidden, top_k, local_experts, num_experts;
  Precision precision;  // wire rows
  Combine combine;
  ScaleRounding rounding;  // wire rows' MXFP8 scales
  std::uint32_t timeout_ms;
  RoundState* state;
  HealthRecord* health;  // device pointer of the mapped record
  RouteScratch scratch;
  StagedRows staged;  // what route stages per received row for the expert backend
  // This round's tensors
  std::int64_t tokens;
  const std::uint16_t* x;  // [T, H] bf16
  const void* topk_ids;    // [T, K] i32 or i64
  bool ids_are_i64;
  const float* topk_weights;  // [T, K]
  std::uint16_t* y;           // [T, H] bf16
};

}  // namespace epmoe::cuda

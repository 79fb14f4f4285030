// What the CUDA kernels of one forward() share: a small params struct passed by value, the
// round state in device memory, and the health record in mapped pinned host memory.
#pragma once

#include <cstdint>

#include "epmoe/config.hpp"
#include "protocol/workspace.hpp"

namespace epmoe::cuda {

inline constexpr int kMaxWorld = 64;

// Lives in device memory; advanced by the kernels themselves (never by the host), so a captured
// CUDA graph replays rounds correctly.
struct RoundState {
  std::uint32_t round;                 // the round the next forward runs
  std::uint32_t failed;                // set when a wait failed: later kernels do nothing
  std::uint32_t tickets[4];            // CTAs finished per kernel: the last one publishes
  std::uint32_t rows_to[kMaxWorld];    // dispatch: rows written to each rank this round
  std::uint32_t rows_from[kMaxWorld];  // counts received this round (written by the last waiter)
};

// The diagnostic record of DESIGN I3, in mapped pinned host memory: the host reads it without
// synchronising the stream. `claimed` is taken with a CAS by the first writer; `published` is
// stored after every field, so the host never reads a half-written record.
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

// Device scratch of the expert step (src/cuda/experts.cu slices it), allocated once per layer and
// sized from the config maxima, so forward() never allocates and stays graph-capturable.
struct ExpertScratch {
  std::uint32_t* expert_rows;   // [E_local] pairs per local expert this round (zeroed per round)
  std::uint32_t* expert_fill;   // [E_local] bucketing cursor per local expert (zeroed per round)
  std::uint32_t* pair_offset;   // [E_local + 1] first pair of each expert; [E_local] = all pairs
  std::uint32_t* chunk_offset;  // [E_local + 1] first chunk of each expert; [E_local] = all chunks
  std::uint32_t* pairs;         // [max_pairs] (src, entry, row) of each pair, grouped by expert
  float* x;                     // [world * max_tokens, H] received rows, decoded
  float* h;                     // [max_pairs, I] SwiGLU output per pair, quantized in place
  // Tensor-core math only (nullptr otherwise): the GEMM operands in bf16, each row a code row
  // times 1 / its scale (NVFP4: code = e2m1 * block scale, scale = s_enc; else scale 1), exact.
  std::uint16_t* x16;  // [world * max_tokens, H] bf16(x * x_scale)
  float* x_scale;      // [world * max_tokens]
  std::uint16_t* h16;  // [max_pairs, I] bf16(quantized h * h_scale)
  float* h_scale;      // [max_pairs]
};

struct ForwardParams {
  // The layer
  protocol::WorkspaceLayout layout;
  std::uint8_t* const* peer_windows;  // [world] LSA base pointer of each rank's window
  int rank;
  int world;
  std::int64_t hidden, intermediate, top_k, local_experts, num_experts;
  Precision precision;
  Combine combine;
  ScaleRounding rounding;
  float swiglu_limit;
  std::uint32_t timeout_ms;
  const float* w13;  // [E_local, 2I, H], quantization emulated (exact math)
  const float* w2;   // [E_local, H, I]
  // Tensor-core math: bf16 code weights and their per-matrix scales (value = code / scale).
  bool tensor_cores;
  const std::uint16_t* w13_16;  // [E_local, 2I, H]
  const std::uint16_t* w2_16;   // [E_local, H, I]
  const float* w13_scale;       // [E_local]
  const float* w2_scale;        // [E_local]
  RoundState* state;
  HealthRecord* health;  // device pointer of the mapped record
  ExpertScratch scratch;
  // This round's tensors
  std::int64_t tokens;
  const std::uint16_t* x;  // [T, H] bf16
  const void* topk_ids;    // [T, K] i32 or i64
  bool ids_are_i64;
  const float* topk_weights;  // [T, K]
  std::uint16_t* y;           // [T, H] bf16
};

}  // namespace epmoe::cuda

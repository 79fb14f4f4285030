// Private helpers of the knob table and with_knobs (docs/design.md §5): the shared-memory estimate,
// the adjustment of in-space knobs to caller-owned fields and hardware, and the real model shapes
// the default table has explicit entries for.
#pragma once

#include <epmoe/config.hpp>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace epmoe::core {

// K extent of one pipeline stage of the expert GEMMs (elements along the reduction dimension).
inline constexpr std::int64_t kKTile = 64;

// Shared memory one CTA may use on sm_90 (227 KiB).
inline constexpr std::int64_t kMaxSharedMemoryBytes = 227 * 1024;

// Estimated shared memory of one CTA of a block_m x block_n tile at the shallowest pipeline (two k
// tiles in flight) with its bf16 output tile (knob_table.cpp has the formula): with_knobs halves
// block_n while it exceeds kMaxSharedMemoryBytes. The kernels that run size their own pipelines
// (include/epmoe/config.hpp, above Knobs).
std::int64_t shared_memory_bytes(Precision precision, std::int32_t block_m, std::int32_t block_n);
inline std::int64_t shared_memory_bytes(Precision precision, const Knobs& knobs) {
  return shared_memory_bytes(precision, knobs.block_m, knobs.block_n);
}

// The precisions whose wgmma FC1 runs CUTLASS's GEMM with an activating epilogue of ours
// (grouped_gemm.hpp, Bf16GluGroupedGemm): bf16 only (MXFP8, MXFP4 and NVFP4 run the packed-weight
// GEMM, whose FC1 activates in its own epilogue for mxfp8 and mxfp4: packed_fc1_activates in
// src/cuda/experts/wgmma/steps.hpp). constexpr: the kernels ask it too.
constexpr bool wgmma_fc1_activates(Precision precision) {
  return precision == Precision::bf16;
}

// The precisions whose wgmma GEMMs have a tile of 256 token rows (block_m = 256): the packed-weight
// GEMM of mxfp8, nvfp4 and mxfp4 (each decoded weight used by 256 token rows).
constexpr bool wgmma_has_256_row_tile(Precision precision) {
  return precision == Precision::mxfp8 || precision == Precision::nvfp4 ||
         precision == Precision::mxfp4;
}

// mxfp8 and mxfp4 under wgmma: whether a bucket whose block_m is 64 runs the E4M3 tile (16 token
// rows, MXFP8 token rows times E4M3 weights, MXFP4's E2M1 codes taken as the E4M3 codes of the same
// values, nothing decoded to bf16) rather than the 64-row tile that decodes the weights to bf16:
// where an expert gets at most kWgmmaE4m3MaxRows rows per round with balanced routing (the bucket's
// representative T, as the table's other rules). The E4M3 tile promotes each k32 block's sums per
// token row, which costs more than the decode from a few tens of rows per expert (qwen3 at world 1
// on one H200, bench/RESULTS.md session 23: 7-17 % faster at up to 4 rows, 8 % slower at 32). The
// wgmma backend asks it per bucket; no knob sets it. fp8_block128 runs an E4M3 tile wherever its
// block_m is 64 (wgmma_16_row_tile), and this holds there too.
inline constexpr std::int64_t kWgmmaE4m3MaxRows = 16;
bool wgmma_e4m3_tokens(Precision precision, int world, const LayerShape& shape, TokenBucket bucket,
                       const Knobs& knobs);
// Where the packed GEMM runs 16 token rows: where the same rule holds for mxfp8, mxfp4 (the E4M3
// tile: wgmma_e4m3_tokens) and nvfp4 (whose 16-row tile decodes its weights, its CTA splitting K
// over two pairs of math warpgroups); and fp8_block128 wherever block_m is 64 (its E4M3 tile: the
// table picks 64 for it only where an expert gets at most kWgmmaE4m3MaxRows rows, and it has no
// 64-row tile; wgmma_e4m3_tokens holds there too). fp8_block128's FC1 stores its sums for the
// activate kernel, so its tile has no persistent round (has_persistent_round).
bool wgmma_16_row_tile(Precision precision, int world, const LayerShape& shape, TokenBucket bucket,
                       const Knobs& knobs);

// token_back's modes: where FC2's rows are written. epilogue_warps: the FC2 tile's epilogue stores
// each row into its home rank's window; dispatch_warps: FC2 leaves its rows in a local fp32 staging
// pool and copy warps ship them home afterwards (the wgmma chain's home kernel). The one mode a
// bucket's expert math runs, or nullopt where it runs either:
//   exact, tensor_core (the chain and the persistent round): epilogue_warps, their FC2 tiles send
//     home;
//   wgmma: dispatch_warps (CUTLASS's GEMMs and the packed GEMM's decoding tiles end in fp32), but
//     in the E4M3 tile's buckets (wgmma_e4m3_tokens), whose FC2 does either, in the chain and in
//     mxfp8's and mxfp4's persistent round.
std::optional<TokenBack> only_token_back(Precision precision, int world, const LayerShape& shape,
                                         TokenBucket bucket, const LayerOptions& options,
                                         const Knobs& knobs);

// The tiles the wgmma backend ships (src/cuda/experts/wgmma/grouped_gemm.hpp), as (block_m,
// block_n): 128 x 128 in every precision and 128 x 256 in its bf16 GEMMs (every precision but
// fp8_block128, whose E4M3 blockwise GEMM ships 128 x 128 x 128 only). block_m 128 runs the
// cooperative kernel (two consumer warpgroups of 64 rows); block_m 64 runs bf16's activating FC1
// on 64 x 128 ping-pong tiles (one warpgroup per tile, the other's epilogue overlapping its
// mainloop) and FC2 on 128 x block_n. The packed-weight GEMM (mxfp8, nvfp4, mxfp4) reads block_m
// as its token rows (64, 128 or 256) and no block_n (its 128 weight rows are fixed).
// fp8_block128's block_m 64 runs the packed GEMM's E4M3 tile of 16 token rows
// (wgmma_16_row_tile), 128 its blockwise GEMM; it reads no block_n.
bool wgmma_has_tile(Precision precision, std::int32_t block_m, std::int32_t block_n);

// True when every knob is inside kKnobSpace (num_sms: >= 0).
bool in_knob_space(const Knobs& knobs) noexcept;

// Throws Error(invalid_argument) naming the first knob outside kKnobSpace ("knobs.block_m=96: must
// be 64, 128 or 256").
void check_knob_space(const Knobs& knobs);

// Every knob as name=value fields, in the order and spelling of describe() and knob files
// (config.cpp); `block_m_mark` / `block_n_mark` follow those two where the backend does not read
// them.
std::string knob_fields(const Knobs& knobs, const std::string& block_m_mark = "",
                        const std::string& block_n_mark = "");

// Adjusts in-space knobs where they conflict with caller-owned fields or with the hardware; never
// throws for in-space knobs and changes nothing that does not conflict:
//   * block_n > 2 * intermediate -> halved until it is not (FC1 has 2I columns);
//   * expert_math=wgmma: (block_m, block_n) moved onto a tile it ships (wgmma_has_tile): block_m
//     256 -> 128 where not wgmma_has_256_row_tile (64 and 128 exist in every precision), block_n
//     64 -> 128, and 256 -> 128 for fp8_block128;
//   * block_n halved while shared_memory_bytes exceeds kMaxSharedMemoryBytes (bf16 256 x 256);
//   * token_back -> the bucket's one mode where it has one (only_token_back, after the tile
//     moves).
// `notes` (may be null) receives one line per change, for logs.
Knobs adjust_knobs(const Knobs& knobs, Precision precision, int world, const LayerShape& shape,
                   TokenBucket bucket, const LayerOptions& options,
                   std::vector<std::string>* notes = nullptr);

}  // namespace epmoe::core

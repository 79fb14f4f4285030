// The tensor-core backend's steps (docs/design.md §4.1) as device functions of the whole grid, each
// called by every thread of every CTA: run by the chain's kernels (bf16_fc1.cu, quantize_h.cu,
// bf16_fc2.cu: a kernel each) and by the persistent round kernel (persistent_round.cu), which
// separates them with grid barriers. Each opens with its own round prologue, so it does nothing
// when this rank's round already failed.
#pragma once

#include "cuda/experts/common.cuh"
#include "cuda/experts/fc2_input.cuh"
#include "cuda/experts/mma/bf16_mma_tile.cuh"
#include "cuda/experts/mma/params.hpp"
#include "math/activation.hpp"
#include "math/expert_row.hpp"  // math::biased

namespace epmoe::cuda::experts::mma {

// This CTA's work items, as for_each_chunk_tile (common.cuh) walks them, but a round whose items
// fill at most half of `slots` (the device's CTA slots, two per SM; a decode round: qwen3-30b-a3b
// at T = 1 has 96 FC1 items for 264) splits each item's K into up to kMaxParts parts of at least
// kMinPartSlabs slabs (split_parts, split_plan.hpp), a CTA each (SplitPart), so more of the GPU
// works and each CTA's chain of slabs is shorter. The split depends on the round's items and the
// device, never on the grid (Knobs::num_sms), so a knob does not change the sums' order.
// item(chunk, tile, part) for each.
template <class Item>
__device__ __forceinline__ void for_each_item_part(const ExpertInputs& in,
                                                   std::int64_t local_experts, std::uint32_t tiles,
                                                   std::int64_t k_total, std::uint32_t slots,
                                                   Item item) {
  const std::uint32_t items = in.chunk_offset[local_experts] * tiles;
  const std::uint32_t parts =
      split_parts(items, static_cast<std::uint32_t>(k_total / kSlabK), slots);
  for (std::uint32_t w = blockIdx.x; w < items * parts; w += gridDim.x) {
    const std::uint32_t i = w / parts;
    item(find_chunk(in, local_experts, i / tiles), i % tiles,
         SplitPart{static_cast<int>(w % parts), static_cast<int>(parts), i});
  }
}

// The split sums of one step of a round: stamped with the round and the step.
__device__ inline SplitSums split_sums(const Params& p, std::uint32_t round, int step) {
  return SplitSums{p.split_sums, p.split_arrivals, 2 * round + static_cast<std::uint32_t>(step)};
}

// The tensor-core backend's FC1 and SwiGLU (docs/design.md §4.1). Work items are (chunk of up to
// 64 rows of one expert, tile of 64 intermediate columns), tile fastest. The tile's 128 weight
// rows interleave gate and up of each column (weight row c is gate row j0 + c / 2 for even c, up
// row j0 + c / 2 for odd c, read in place from w13's [gate rows; up rows] layout), so one thread's
// C fragment holds both and the activation (after b13, when given) needs no exchange.
// Its kernels: two CTAs per SM (at most 110 KB of shared memory each), so at most 128 registers.
inline constexpr int kFc1ColumnsPerTile = kCols / 2;  // intermediate columns (gate + up each)

// FC1's epilogue where FC2's input quantization point is local (fc1_epilogue_quantizes): h's
// values of this CTA's tile (fc1_step's h[mi][half][ni]) go to h16 as FC2's bf16 codes, with
// h_scale 1, so there is no fp32 h and no quantize_h step. An MXFP8 block of 32 columns spans two
// warps' 16 (warp columns 0-1, 2-3): each quad of lanes holding a row's columns takes their amax
// (a max of |h|'s bit patterns, as the row codec does), and the two warps swap theirs through
// `amax` ([kRows][4] words of the tile's shared memory, free once every thread is past tile_sums;
// the next item's slab pipeline starts with a barrier). Called by every thread of the CTA.
__device__ inline void store_fc2_input(const Params& p, const Chunk& chunk, std::int64_t j0,
                                       const WarpTile& tile, const float (&h)[kMTiles][2][kNTiles],
                                       std::uint32_t* amax) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int group = tile.col0 / kWarpCols;  // the warp's 16 columns of the tile's 64
  __syncthreads();  // every thread has read its sums out of the tile's shared memory
  std::uint32_t row_amax[kMTiles][2];
  for_each_fragment_row(tile, [&](int mi, int half, int r) {
    std::uint32_t bits = 0;
#pragma unroll
    for (int ni = 0; ni < kNTiles; ++ni)
      bits = max(bits, formats::float_bits(h[mi][half][ni]) & formats::kF32AbsMask);
    bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, 1));
    bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, 2));
    row_amax[mi][half] = bits;
    if (lane % 4 == 0) amax[r * 4 + group] = bits;
  });
  __syncthreads();
  const std::int64_t inter = p.problem.intermediate;
  for_each_fragment_row(tile, [&](int mi, int half, int r) {
    const std::uint32_t block_amax = max(row_amax[mi][half], amax[r * 4 + (group ^ 1)]);
    if (r >= chunk.rows) return;
    const std::size_t pair = chunk.first_pair + r;
    std::uint16_t* row = p.h16 + pair * static_cast<std::size_t>(inter) + j0;
#pragma unroll
    for (int ni = 0; ni < kNTiles; ++ni)
      row[(tile.col0 + 8 * ni + 2 * (lane % 4)) / 2] =
          fc2_input_code(p.problem.precision, p.problem.rounding, h[mi][half][ni], block_amax);
    if (j0 == 0 && group == 0 && lane % 4 == 0) p.h_scale[pair] = 1.0f;
  });
}

// The activation and the weights' precision are template arguments: each kernel holds one
// activation's and one format's code (registers).
template <Activation kActivation, Precision P>
__device__ inline void fc1_step(const Params& p) {
  extern __shared__ __align__(16) std::uint8_t smem[];
  __shared__ std::uint32_t x_row_of[kRows];  // the chunk's rows in the staged x16 / x_scale

  const RoundStart start = join_round(p.step.state, RoundPhase::fc1);
  const PhaseEnd phase_end{start};
  if (start.skip) return;

  const ExpertInputs& in = p.step.in;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const std::int64_t hidden = p.problem.hidden, inter = p.problem.intermediate;
  const std::uint32_t tiles = static_cast<std::uint32_t>(inter / kFc1ColumnsPerTile);
  const SplitSums split = split_sums(p, start.round, 0);
  for_each_item_part(
      in, p.problem.local_experts, tiles, hidden, p.split_slots,
      [&](const Chunk chunk, std::uint32_t column_tile, const SplitPart& part) {
        const std::int64_t j0 = std::int64_t{column_tile} * kFc1ColumnsPerTile;
        stage_chunk_rows(in, chunk, x_row_of,
                         [&](std::uint32_t pair) { return x_row_of_pair(in, pair); });
        const auto h_of = [&](int r) {  // row r's part of h in this tile
          return p.h + (chunk.first_pair + r) * static_cast<std::size_t>(inter) + j0;
        };

        Accumulators acc;
        if (!tile_sums<P>(
                *reinterpret_cast<Smem<P>*>(smem), chunk.rows, hidden, part, split,
                [&](int r) { return in.x16 + static_cast<std::size_t>(x_row_of[r]) * hidden; },
                [&](int c) {
                  return weight_row<P>(p.weights.w13, chunk.expert,
                                       (c % 2 == 0 ? 0 : inter) + j0 + c / 2);
                },
                acc))
          return;  // another part of the tile runs the epilogue
        // Epilogue: v = 0, 1 are gate and up of one column, for row lane / 4; v = 2, 3 for row + 8.
        const WarpTile tile = warp_tile();
        const float w_divisor = p.weights.w13.divisor[chunk.expert];
        const float w_multiplier = p.weights.w13.multiplier[chunk.expert];
        // b13 as w13's rows: gate j0 + column, up I + j0 + column; added as math::biased does.
        const float* b13 =
            p.biases.b13 == nullptr
                ? nullptr
                : p.biases.b13 + static_cast<std::size_t>(chunk.expert) * 2 * inter + j0;
        // h[mi][half][ni]: the activation of row tile.row0 + 16 mi + lane / 4 + 8 half, column
        // (tile.col0 + 8 ni + 2 (lane % 4)) / 2 of the tile's 64; 0 past the chunk's rows, whose
        // activations are not computed: a decode chunk fills few of the 64 rows, and computing
        // them all (two divisions and an exp per value) made FC1 30-50 % slower (session 19).
        float h[kMTiles][2][kNTiles] = {};
        for_each_fragment_row(tile, [&](int mi, int half, int r) {
          if (r >= chunk.rows) return;
          // One scale at a time: the product of two NVFP4 s_enc (tiny-amax rows) can overflow.
          const float x_scale = in.x_scale[x_row_of[r]];
#pragma unroll
          for (int ni = 0; ni < kNTiles; ++ni) {
            const int column = (tile.col0 + 8 * ni + 2 * (lane % 4)) / 2;
            const float gate = math::biased(
                acc[mi][ni][2 * half] / x_scale / w_divisor * w_multiplier, b13, column);
            const float up =
                math::biased(acc[mi][ni][2 * half + 1] / x_scale / w_divisor * w_multiplier,
                             b13 == nullptr ? nullptr : b13 + inter, column);
            h[mi][half][ni] =
                static_cast<float>(math::activation(kActivation, gate, up, p.problem.swiglu_limit));
          }
        });
        if constexpr (fc1_epilogue_quantizes(P)) {
          store_fc2_input(p, chunk, j0, tile, h, reinterpret_cast<std::uint32_t*>(smem));
        } else {
          for_each_fragment_row(tile, [&](int mi, int half, int r) {
            if (r >= chunk.rows) return;
#pragma unroll
            for (int ni = 0; ni < kNTiles; ++ni)
              h_of(r)[(tile.col0 + 8 * ni + 2 * (lane % 4)) / 2] = h[mi][half][ni];
          });
        }
      });
}

// The tensor-core backend's FC2 input quantization point (fc2_input.cuh) on every h row of this
// round. A step of its own (a grid barrier after FC1) because an NVFP4 row scale needs the whole
// intermediate row, which FC1 spreads over tiles.
__device__ inline void quantize_h_step(const Params& p) {
  extern __shared__ __align__(16) std::uint8_t smem[];
  const ExpertProblem& problem = p.problem;
  const RoundStart start = join_round(p.step.state, RoundPhase::fc1);
  const PhaseEnd phase_end{start};
  if (start.skip) return;
  const std::uint32_t pairs = p.step.in.pair_offset[problem.local_experts];
  for (std::uint32_t pair = blockIdx.x; pair < pairs; pair += gridDim.x) {
    const std::size_t at = static_cast<std::size_t>(pair) * problem.intermediate;
    quantize_h_row(RowGroup::cta(), problem, smem, p.h + at, p.h16 + at, p.h_scale + pair);
  }
}

// The tensor-core backend's FC2 (docs/design.md §4.1, §3 steps 5-6) over the bf16 codes of the
// quantized h rows, each result sent home (send_home). Work items are (chunk of up to 64 rows of
// one expert, tile of 128 hidden columns), tile fastest; the last tile of a hidden size that is
// not a multiple of 128 (gpt-oss: 2880) computes clamped columns it never stores. fc2_round
// closes the step: the last CTA tells every rank this rank's experts are done.
// Its kernels: two CTAs per SM (at most 110 KB of shared memory each), so at most 128 registers.
template <Precision P>
__device__ inline void fc2_step(const Params& p) {
  extern __shared__ __align__(16) std::uint8_t smem[];
  __shared__ HomeSlot home_of[kRows];

  fc2_round(p.step, [&](std::uint32_t round) {
    const ExpertInputs& in = p.step.in;
    const int lane = static_cast<int>(threadIdx.x) & 31;
    const std::int64_t hidden = p.problem.hidden, inter = p.problem.intermediate;
    const auto tiles = static_cast<std::uint32_t>((hidden + kCols - 1) / kCols);
    const SplitSums split = split_sums(p, round, 1);
    for_each_item_part(
        in, p.problem.local_experts, tiles, inter, p.split_slots,
        [&](const Chunk chunk, std::uint32_t column_tile, const SplitPart& part) {
          const std::int64_t c0 = std::int64_t{column_tile} * kCols;
          stage_chunk_rows(in, chunk, home_of,
                           [&](std::uint32_t pair) { return home_slot(p.step.home, round, pair); });
          // Weight rows past the hidden size (gpt-oss: 2880) repeat the last one and are never
          // stored.
          const auto w_row = [&](int c) { return c0 + c < hidden ? c0 + c : hidden - 1; };

          Accumulators acc;
          if (!tile_sums<P>(
                  *reinterpret_cast<Smem<P>*>(smem), chunk.rows, inter, part, split,
                  [&](int r) {
                    return p.h16 + (chunk.first_pair + r) * static_cast<std::size_t>(inter);
                  },
                  [&](int c) { return weight_row<P>(p.weights.w2, chunk.expert, w_row(c)); }, acc))
            return;  // another part of the tile sends the rows home
          const WarpTile tile = warp_tile();
          const float w_divisor = p.weights.w2.divisor[chunk.expert];
          const float w_multiplier = p.weights.w2.multiplier[chunk.expert];
          // b2 added to each scaled sum as math::biased does, before it goes home.
          const float* b2 = p.biases.b2 == nullptr
                                ? nullptr
                                : p.biases.b2 + static_cast<std::size_t>(chunk.expert) * hidden;
          for_each_fragment_row(tile, [&](int mi, int half, int r) {
            if (r >= chunk.rows) return;
            // One scale at a time: the product of two NVFP4 s_enc (tiny-amax rows) can overflow.
            const float h_scale = p.h_scale[chunk.first_pair + r];
        // A fragment's two columns are consecutive, the first even: one 4-byte bf16 pair
        // (staged); H is even, so both or neither are past it.
#pragma unroll
            for (int ni = 0; ni < kNTiles; ++ni) {
              const std::int64_t c = c0 + tile.col0 + 8 * ni + 2 * (lane % 4);
              if (c >= hidden) continue;
              float out[2];
#pragma unroll
              for (int v = 0; v < 2; ++v)
                out[v] = math::biased(
                    acc[mi][ni][2 * half + v] / h_scale / w_divisor * w_multiplier, b2, c + v);
              send_home_n<2>(p.step.home, home_of[r], c / 2, out);
            }
          });
        });
  });
}

}  // namespace epmoe::cuda::experts::mma

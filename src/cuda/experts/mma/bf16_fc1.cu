// The tensor-core backend's FC1 and SwiGLU (docs/design.md §4.1). Work items are (chunk of up to
// 64 rows of one expert, tile of 64 intermediate columns), tile fastest. The tile's 128 weight
// rows interleave gate and up of each column (weight row c is gate row j0 + c / 2 for even c, up
// row j0 + c / 2 for odd c, read in place from w13's [gate rows; up rows] layout), so one thread's
// C fragment holds both and the activation (after b13, when given) needs no exchange.
// Two CTAs per SM (110 KB of shared memory each), so at most 128 registers.
#include "cuda/experts/mma/bf16_mma_tile.cuh"
#include "cuda/experts/mma/params.hpp"
#include "math/activation.hpp"
#include "math/expert_row.hpp"  // math::biased

namespace epmoe::cuda::experts::mma {
namespace {

inline constexpr int kColumnsPerTile = kCols / 2;  // intermediate columns (gate + up each)

// The activation is a template argument: each kernel holds one activation's code (registers).
template <Activation kActivation>
__global__ void __launch_bounds__(kThreads, 2) bf16_fc1_kernel(Params p) {
  extern __shared__ __align__(16) std::uint8_t smem[];
  __shared__ std::uint32_t x_row_of[kRows];  // the chunk's rows in the staged x16 / x_scale

  const RoundStart start = join_round(p.step.state, RoundPhase::fc1);
  const PhaseEnd phase_end{start};
  if (start.skip) return;

  const ExpertInputs& in = p.step.in;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const std::int64_t hidden = p.problem.hidden, inter = p.problem.intermediate;
  const std::uint32_t tiles = static_cast<std::uint32_t>(inter / kColumnsPerTile);
  for_each_chunk_tile(
      in, p.problem.local_experts, tiles, [&](const Chunk chunk, std::uint32_t column_tile) {
        const std::int64_t j0 = std::int64_t{column_tile} * kColumnsPerTile;
        stage_chunk_rows(in, chunk, x_row_of,
                         [&](std::uint32_t pair) { return x_row_of_pair(in, pair); });
        const auto h_of = [&](int r) {  // row r's part of h in this tile
          return p.h + (chunk.first_pair + r) * static_cast<std::size_t>(inter) + j0;
        };

        const std::uint16_t* w13 =
            p.weights.w13 + static_cast<std::size_t>(chunk.expert) * 2 * inter * hidden;
        Accumulators acc;
        tile_mma(
            *reinterpret_cast<Smem*>(smem), chunk.rows, hidden,
            [&](int r) { return in.x16 + static_cast<std::size_t>(x_row_of[r]) * hidden; },
            [&](int c) { return w13 + ((c % 2 == 0 ? 0 : inter) + j0 + c / 2) * hidden; }, acc);
        // Epilogue: v = 0, 1 are gate and up of one column, for row lane / 4; v = 2, 3 for row + 8.
        const WarpTile tile = warp_tile();
        const float w_scale = p.weights.w13_scale[chunk.expert];
        // b13 as w13's rows: gate j0 + column, up I + j0 + column; added as math::biased does.
        const float* b13 =
            p.biases.b13 == nullptr
                ? nullptr
                : p.biases.b13 + static_cast<std::size_t>(chunk.expert) * 2 * inter + j0;
#pragma unroll
        for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int r = tile.row0 + 16 * mi + lane / 4 + 8 * half;
            if (r >= chunk.rows) continue;
            // One scale at a time: the product of two NVFP4 s_enc (tiny-amax rows) can overflow.
            const float x_scale = in.x_scale[x_row_of[r]];
#pragma unroll
            for (int ni = 0; ni < kNTiles; ++ni) {
              const int column = (tile.col0 + 8 * ni + 2 * (lane % 4)) / 2;
              const float gate =
                  math::biased(acc[mi][ni][2 * half] / x_scale / w_scale, b13, column);
              const float up = math::biased(acc[mi][ni][2 * half + 1] / x_scale / w_scale,
                                            b13 == nullptr ? nullptr : b13 + inter, column);
              h_of(r)[column] = static_cast<float>(
                  math::activation(kActivation, gate, up, p.problem.swiglu_limit));
            }
          }
      });
}

}  // namespace

KernelShape fc1_shape(const ExpertProblem& problem, int device, int num_sms) {
  return with_activation(problem.activation, [&](auto activation) {
    return occupancy_shape(bf16_fc1_kernel<decltype(activation)::value>, kSmemBytes, device,
                           num_sms);
  });
}

void launch_fc1(const Params& p, const KernelShape& s, cudaStream_t stream) {
  with_activation(p.problem.activation, [&](auto activation) {
    launch_chained(bf16_fc1_kernel<decltype(activation)::value>, s, stream, p);
  });
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epmoe::cuda::experts::mma

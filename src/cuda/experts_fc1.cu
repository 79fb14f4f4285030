// Expert step, part 2: FC1 and SwiGLU. Work items are (chunk of up to 64 rows of one expert, tile
// of 64 intermediate columns), tile fastest, so the CTAs running at once share a chunk's x and an
// expert's weights in L2. A tile's 128 weight rows are 64 gate rows and the 64 up rows of the same
// columns, so lane l holds gate and up of columns l and l + 32 and SwiGLU needs no exchange.
// h = float(swiglu(float(gate), float(up))), as the reference computes it.
#include "cuda/cuda_check.hpp"
#include "cuda/experts.hpp"
#include "cuda/experts_gemm.cuh"
#include "cuda/experts_mma.cuh"
#include "math/activation.hpp"

namespace epmoe::cuda {
namespace {

using namespace experts;

inline constexpr int kColumnsPerTile = kTileCols / 2;  // intermediate columns (gate + up each)

// Exact math: float64 tile (experts_gemm.cuh); the tile's 128 weight rows are 64 gate rows then
// the 64 up rows of the same columns. Tensor cores: bf16 mma tile (experts_mma.cuh); the weight
// rows interleave gate and up of each column, so one thread's C fragment holds both.
// Tensor cores: two CTAs per SM (110 KB of shared memory each), so at most 128 registers.
template <bool kTensorCores>
__global__ void __launch_bounds__(kThreads, kTensorCores ? 2 : 1) fc1_kernel(ForwardParams p) {
  extern __shared__ __align__(16) std::uint8_t smem[];
  __shared__ std::uint32_t x_row_of[kTileRows];  // the chunk's rows in scratch.x / scratch.x16

  const RoundStart start = start_round(p);
  if (start.skip) return;

  const int lane = static_cast<int>(threadIdx.x) & 31;
  const std::int64_t hidden = p.hidden, inter = p.intermediate;
  const std::uint32_t tiles = static_cast<std::uint32_t>(inter / kColumnsPerTile);
  const std::uint32_t items = p.scratch.chunk_offset[p.local_experts] * tiles;
  for (std::uint32_t item = blockIdx.x; item < items; item += gridDim.x) {
    const Chunk chunk = find_chunk(p, item / tiles);
    const std::int64_t j0 = std::int64_t{item % tiles} * kColumnsPerTile;
    __syncthreads();  // the previous item's epilogue is done with x_row_of
    if (threadIdx.x < chunk.rows) {
      const std::uint32_t pair = p.scratch.pairs[chunk.first_pair + threadIdx.x];
      x_row_of[threadIdx.x] =
          static_cast<std::uint32_t>(pair_src(pair) * p.layout.max_tokens) + pair_row(pair);
    }
    __syncthreads();
    const auto h_of = [&](int r) {  // row r's part of h in this tile
      return p.scratch.h + (chunk.first_pair + r) * static_cast<std::size_t>(inter) + j0;
    };

    if constexpr (kTensorCores) {
      const std::uint16_t* w13 =
          p.w13_16 + static_cast<std::size_t>(chunk.expert) * 2 * inter * hidden;
      mma::Accumulators acc;
      mma::tile_mma(
          *reinterpret_cast<mma::Smem*>(smem), chunk.rows, hidden,
          [&](int r) { return p.scratch.x16 + static_cast<std::size_t>(x_row_of[r]) * hidden; },
          [&](int c) { return w13 + ((c % 2 == 0 ? 0 : inter) + j0 + c / 2) * hidden; }, acc);
      // Epilogue: v = 0, 1 are gate and up of one column, for row lane / 4; v = 2, 3 for row + 8.
      const mma::WarpTile tile = mma::warp_tile();
      const float w_scale = p.w13_scale[chunk.expert];
#pragma unroll
      for (int mi = 0; mi < mma::kMTiles; ++mi)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = tile.row0 + 16 * mi + lane / 4 + 8 * half;
          if (r >= chunk.rows) continue;
          // One scale at a time: the product of two NVFP4 s_enc (tiny-amax rows) can overflow.
          const float x_scale = p.scratch.x_scale[x_row_of[r]];
#pragma unroll
          for (int ni = 0; ni < mma::kNTiles; ++ni) {
            const int column = (tile.col0 + 8 * ni + 2 * (lane % 4)) / 2;
            h_of(r)[column] = static_cast<float>(
                math::swiglu(acc[mi][ni][2 * half] / x_scale / w_scale,
                             acc[mi][ni][2 * half + 1] / x_scale / w_scale, p.swiglu_limit));
          }
        }
    } else {
      const float* w13 = p.w13 + static_cast<std::size_t>(chunk.expert) * 2 * inter * hidden;
      const WarpRole role = warp_role(chunk.rows);
      Accumulators acc;
      tile_gemm(
          *reinterpret_cast<TileSmem*>(smem), role, chunk.rows, hidden,
          [&](int r) { return p.scratch.x + static_cast<std::size_t>(x_row_of[r]) * hidden; },
          [&](int c) {
            const std::int64_t row =
                c < kColumnsPerTile ? j0 + c : inter + j0 + c - kColumnsPerTile;
            return w13 + row * hidden;
          },
          acc);

      // Epilogue (k group 0 of each row group): SwiGLU of the float-rounded gate and up.
      if (role.k_group != 0) continue;
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const int r = role.row_group * kRowsPerWarp + i;
        if (r >= chunk.rows) break;
        for (int q = 0; q < kColsPerLane / 2; ++q)
          h_of(r)[lane + 32 * q] = static_cast<float>(math::swiglu(
              static_cast<float>(acc[i][q]), static_cast<float>(acc[i][q + 2]), p.swiglu_limit));
      }
    }
  }
}

}  // namespace

KernelShape fc1_shape(const ForwardParams& p, int device) {
  return tile_kernel_shape(p, fc1_kernel<false>, fc1_kernel<true>, device);
}

void launch_fc1(const ForwardParams& p, const KernelShape& s, cudaStream_t stream) {
  launch_tile_kernel(p, s, fc1_kernel<false>, fc1_kernel<true>, stream);
}

}  // namespace epmoe::cuda

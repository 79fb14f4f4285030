// Expert step, part 2: FC1 and SwiGLU. Work items are (chunk of up to 64 rows of one expert, tile
// of 64 intermediate columns), tile fastest, so the CTAs running at once share a chunk's x and an
// expert's weights in L2. A tile's 128 weight rows are 64 gate rows and the 64 up rows of the same
// columns, so lane l holds gate and up of columns l and l + 32 and SwiGLU needs no exchange.
// h = float(swiglu(float(gate), float(up))), as the reference computes it.
#include "cuda/cuda_check.hpp"
#include "cuda/experts.hpp"
#include "cuda/experts_gemm.cuh"
#include "reference/swiglu.hpp"

namespace epmoe::cuda {
namespace {

using namespace experts;

inline constexpr int kColumnsPerTile = kTileCols / 2;  // intermediate columns (gate + up each)

__global__ void __launch_bounds__(kThreads) fc1_kernel(ForwardParams p) {
  extern __shared__ __align__(16) std::uint8_t smem[];
  auto& s = *reinterpret_cast<TileSmem*>(smem);
  __shared__ std::uint32_t x_row_of[kTileRows];  // the chunk's rows in scratch.x

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

    const float* w13 = p.w13 + static_cast<std::size_t>(chunk.expert) * 2 * inter * hidden;
    const WarpRole role = warp_role(chunk.rows);
    Accumulators acc;
    tile_gemm(
        s, role, chunk.rows, hidden,
        [&](int r) { return p.scratch.x + static_cast<std::size_t>(x_row_of[r]) * hidden; },
        [&](int c) {
          const std::int64_t row = c < kColumnsPerTile ? j0 + c : inter + j0 + c - kColumnsPerTile;
          return w13 + row * hidden;
        },
        acc);

    // Epilogue (k group 0 of each row group): SwiGLU of the float-rounded gate and up.
    if (role.k_group != 0) continue;
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int r = role.row_group * kRowsPerWarp + i;
      if (r >= chunk.rows) break;
      float* h = p.scratch.h + (chunk.first_pair + r) * static_cast<std::size_t>(inter) + j0;
      for (int q = 0; q < kColsPerLane / 2; ++q)
        h[lane + 32 * q] = static_cast<float>(reference::swiglu(
            static_cast<float>(acc[i][q]), static_cast<float>(acc[i][q + 2]), p.swiglu_limit));
    }
  }
}

}  // namespace

KernelShape fc1_shape(const ForwardParams& /*p*/, int device) {
  return occupancy_shape(fc1_kernel, kTileSmemBytes, device);
}

void launch_fc1(const ForwardParams& p, const KernelShape& s, cudaStream_t stream) {
  fc1_kernel<<<s.grid, kThreads, s.smem, stream>>>(p);
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epmoe::cuda

// The tensor-core backend's FC2 (docs/design.md §4.1, §3 steps 5-6) over the bf16 codes of the
// quantized h rows, each result sent home (send_home). Work items are (chunk of up to 64 rows of
// one expert, tile of 128 hidden columns), tile fastest; the last tile of a hidden size that is
// not a multiple of 128 (gpt-oss: 2880) computes clamped columns it never stores. fc2_round
// closes the step: the last CTA tells every rank this rank's experts are done.
// Two CTAs per SM (at most 110 KB of shared memory each), so at most 128 registers.
#include "cuda/experts/mma/bf16_mma_tile.cuh"
#include "cuda/experts/mma/params.hpp"

namespace epmoe::cuda::experts::mma {
namespace {

template <Precision P>
__global__ void __launch_bounds__(kThreads, 2) bf16_fc2_kernel(Params p) {
  extern __shared__ __align__(16) std::uint8_t smem[];
  __shared__ HomeSlot home_of[kRows];

  fc2_round(p.step, [&](std::uint32_t round) {
    const ExpertInputs& in = p.step.in;
    const int lane = static_cast<int>(threadIdx.x) & 31;
    const std::int64_t hidden = p.problem.hidden, inter = p.problem.intermediate;
    const auto tiles = static_cast<std::uint32_t>((hidden + kCols - 1) / kCols);
    const std::uint32_t items = in.chunk_offset[p.problem.local_experts] * tiles;
    for (std::uint32_t item = blockIdx.x; item < items; item += gridDim.x) {
      const Chunk chunk = find_chunk(in, p.problem.local_experts, item / tiles);
      const std::int64_t c0 = std::int64_t{item % tiles} * kCols;
      __syncthreads();  // the previous item's epilogue is done with home_of
      if (threadIdx.x < chunk.rows)
        home_of[threadIdx.x] =
            home_slot(p.step.home, round, in.pairs[chunk.first_pair + threadIdx.x]);
      __syncthreads();
      // Weight rows c0 ... c0 + 127 in two groups of 64; past the hidden size (gpt-oss: 2880, a
      // multiple of 64) the second group repeats the first and is never stored.
      const WeightTile w2 =
          weight_tile<P>(p.weights.w2, chunk.expert, c0, c0 + 64 < hidden ? c0 + 64 : c0);
      const float w_scale = weight_s_enc<P>(p.weights.w2, chunk.expert);
      Accumulators acc;
      tile_mma<P, false>(
          *reinterpret_cast<Smem<P>*>(smem), chunk.rows, inter,
          [&](int r) { return p.h16 + (chunk.first_pair + r) * static_cast<std::size_t>(inter); },
          w2, w_scale, acc);
      const WarpTile tile = warp_tile();
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = tile.row0 + 16 * mi + lane / 4 + 8 * half;
          if (r >= chunk.rows) continue;
          // One scale at a time: the product of two NVFP4 s_enc (tiny-amax rows) can overflow.
          const float h_scale = p.h_scale[chunk.first_pair + r];
#pragma unroll
          for (int ni = 0; ni < kNTiles; ++ni)
#pragma unroll
            for (int v = 0; v < 2; ++v) {
              const std::int64_t c = c0 + tile.col0 + 8 * ni + 2 * (lane % 4) + v;
              if (c < hidden)
                send_home(p.step.home, home_of[r], c,
                          acc[mi][ni][2 * half + v] / h_scale / w_scale);
            }
        }
    }
  });
}

}  // namespace

KernelShape fc2_shape(Precision precision, int device) {
  switch (precision) {
    case Precision::bf16:
      return occupancy_shape(bf16_fc2_kernel<Precision::bf16>, kSmemBytes<Precision::bf16>, device);
    case Precision::mxfp8:
      return occupancy_shape(bf16_fc2_kernel<Precision::mxfp8>, kSmemBytes<Precision::mxfp8>,
                             device);
    case Precision::nvfp4:
      break;
  }
  return occupancy_shape(bf16_fc2_kernel<Precision::nvfp4>, kSmemBytes<Precision::nvfp4>, device);
}

void launch_fc2(const Params& p, const KernelShape& s, cudaStream_t stream) {
  switch (p.problem.precision) {
    case Precision::bf16:
      bf16_fc2_kernel<Precision::bf16><<<s.grid, kThreads, s.smem, stream>>>(p);
      break;
    case Precision::mxfp8:
      bf16_fc2_kernel<Precision::mxfp8><<<s.grid, kThreads, s.smem, stream>>>(p);
      break;
    case Precision::nvfp4:
      bf16_fc2_kernel<Precision::nvfp4><<<s.grid, kThreads, s.smem, stream>>>(p);
      break;
  }
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epmoe::cuda::experts::mma

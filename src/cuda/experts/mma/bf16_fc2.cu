// The tensor-core backend's FC2 (docs/design.md §4.1, §3 steps 5-6) over the bf16 codes of the
// quantized h rows, each result sent home (send_home). Work items are (chunk of up to 64 rows of
// one expert, tile of 128 hidden columns), tile fastest; the last tile of a hidden size that is
// not a multiple of 128 (gpt-oss: 2880) computes clamped columns it never stores. fc2_round
// closes the step: the last CTA tells every rank this rank's experts are done.
// Two CTAs per SM (110 KB of shared memory each), so at most 128 registers.
#include "cuda/experts/mma/bf16_mma_tile.cuh"
#include "cuda/experts/mma/params.hpp"
#include "math/expert_row.hpp"  // math::biased

namespace epmoe::cuda::experts::mma {
namespace {

__global__ void __launch_bounds__(kThreads, 2) bf16_fc2_kernel(Params p) {
  extern __shared__ __align__(16) std::uint8_t smem[];
  __shared__ HomeSlot home_of[kRows];

  fc2_round(p.step, [&](std::uint32_t round) {
    const ExpertInputs& in = p.step.in;
    const int lane = static_cast<int>(threadIdx.x) & 31;
    const std::int64_t hidden = p.problem.hidden, inter = p.problem.intermediate;
    const auto tiles = static_cast<std::uint32_t>((hidden + kCols - 1) / kCols);
    for_each_chunk_tile(
        in, p.problem.local_experts, tiles, [&](const Chunk chunk, std::uint32_t column_tile) {
          const std::int64_t c0 = std::int64_t{column_tile} * kCols;
          stage_chunk_rows(in, chunk, home_of,
                           [&](std::uint32_t pair) { return home_slot(p.step.home, round, pair); });
          // Weight rows past the hidden size (gpt-oss: 2880) repeat the last one and are never
          // stored.
          const auto w_row = [&](int c) { return c0 + c < hidden ? c0 + c : hidden - 1; };

          const std::uint16_t* w2 =
              p.weights.w2 + static_cast<std::size_t>(chunk.expert) * hidden * inter;
          Accumulators acc;
          tile_mma(
              *reinterpret_cast<Smem*>(smem), chunk.rows, inter,
              [&](int r) {
                return p.h16 + (chunk.first_pair + r) * static_cast<std::size_t>(inter);
              },
              [&](int c) { return w2 + w_row(c) * inter; }, acc);
          const WarpTile tile = warp_tile();
          const float w_scale = p.weights.w2_scale[chunk.expert];
          // b2 added to each scaled sum as math::biased does, before it goes home.
          const float* b2 = p.biases.b2 == nullptr
                                ? nullptr
                                : p.biases.b2 + static_cast<std::size_t>(chunk.expert) * hidden;
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
                  if (c < hidden) {
                    send_home(p.step.home, home_of[r], c,
                              math::biased(acc[mi][ni][2 * half + v] / h_scale / w_scale, b2, c));
                  }
                }
            }
        });
  });
}

}  // namespace

KernelShape fc2_shape(int device, int num_sms) {
  return occupancy_shape(bf16_fc2_kernel, kSmemBytes, device, num_sms);
}

void launch_fc2(const Params& p, const KernelShape& s, cudaStream_t stream) {
  launch_chained(bf16_fc2_kernel, s, stream, p);
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epmoe::cuda::experts::mma

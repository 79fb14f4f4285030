// The exact backend's FC2 (docs/design.md §4.1, §3 steps 5-6) over the quantized h rows, each
// result sent home (send_home: staged, the bf16 row into the home rank's [token, slot] combine
// row; in-kernel reduce, weight x row added into its fp32 accumulator), b2 added first. Work items
// are (chunk of up to 64 rows of one expert, tile of 128 hidden columns), tile fastest; the last
// tile of a hidden size that is not a multiple of 128 (gpt-oss: 2880) computes clamped columns it
// never stores. fc2_round closes the step: the last CTA tells every rank this rank's experts are
// done.
#include "cuda/experts/exact/f64_tile.cuh"
#include "cuda/experts/exact/params.hpp"
#include "math/expert_row.hpp"  // math::biased

namespace epmoe::cuda::experts::exact {
namespace {

template <Precision P>
__global__ void __launch_bounds__(kThreads, 1) f64_fc2_kernel(Params p) {
  extern __shared__ __align__(16) std::uint8_t smem[];
  __shared__ HomeSlot home_of[kTileRows];

  fc2_round(p.step, [&](std::uint32_t round) {
    const ExpertInputs& in = p.step.in;
    const int lane = static_cast<int>(threadIdx.x) & 31;
    const std::int64_t hidden = p.problem.hidden, inter = p.problem.intermediate;
    const auto tiles = static_cast<std::uint32_t>((hidden + kTileCols - 1) / kTileCols);
    for_each_chunk_tile(
        in, p.problem.local_experts, tiles, [&](const Chunk chunk, std::uint32_t column_tile) {
          const std::int64_t c0 = std::int64_t{column_tile} * kTileCols;
          stage_chunk_rows(in, chunk, home_of,
                           [&](std::uint32_t pair) { return home_slot(p.step.home, round, pair); });
          // Weight rows past the hidden size (gpt-oss: 2880) repeat the last one and are never
          // stored.
          const auto w_row = [&](int c) { return c0 + c < hidden ? c0 + c : hidden - 1; };

          const Matrices<P>& w2 = matrices<P>(p.weights.packed.w2, p.weights.fp8.w2);
          const WarpRole role = warp_role(chunk.rows);
          Accumulators acc;
          tile_gemm(
              *reinterpret_cast<TileSmem<P>*>(smem), role, chunk.rows, inter,
              [&](int r) { return p.h + (chunk.first_pair + r) * static_cast<std::size_t>(inter); },
              [&](int c) { return tile_weight_row<P>(w2, chunk.expert, w_row(c)); },
              matrix_factors<P>(w2, chunk.expert), acc);

          // Epilogue (k group 0 of each row group): each lane stores its columns, 32 apart, so a
          // warp's stores to a row are contiguous.
          // Each result is the float64 sum plus b2 (when given), rounded once (math::biased).
          if (role.k_group != 0) return;
          const float* b2 = p.biases.b2 == nullptr
                                ? nullptr
                                : p.biases.b2 + static_cast<std::size_t>(chunk.expert) * hidden;
          for (int i = 0; i < kRowsPerWarp; ++i) {
            const int r = role.row_group * kRowsPerWarp + i;
            if (r >= chunk.rows) break;
            for (int q = 0; q < kColsPerLane; ++q) {
              const std::int64_t c = c0 + lane + 32 * q;
              if (c >= hidden) break;
              send_home(p.step.home, home_of[r], c, math::biased(acc[i][q], b2, c));
            }
          }
        });
  });
}

}  // namespace

KernelShape fc2_shape(const ExpertProblem& problem, int device, int num_sms) {
  return with_precision(problem.precision, [&](auto precision) {
    constexpr Precision P = decltype(precision)::value;
    return occupancy_shape(f64_fc2_kernel<P>, kTileSmemBytes<P>, device, num_sms);
  });
}

void launch_fc2(const Params& p, const KernelShape& s, cudaStream_t stream) {
  with_precision(p.problem.precision, [&](auto precision) {
    launch_chained(f64_fc2_kernel<decltype(precision)::value>, s, stream, p);
  });
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epmoe::cuda::experts::exact

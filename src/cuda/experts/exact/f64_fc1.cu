// The exact backend's FC1 and SwiGLU (docs/design.md §4.1). Work items are (chunk of up to 64 rows
// of one expert, tile of 64 intermediate columns), tile fastest, so the CTAs running at once share
// a chunk's x and an expert's weights in L2. A tile's 128 weight rows are 64 gate rows then the 64
// up rows of the same columns, so lane l holds gate and up of columns l and l + 32 and SwiGLU
// needs no exchange. h = float(activation(biased(gate), biased(up))): each float64 sum plus its
// b13 (when given) rounded once to fp32, as the reference computes it (math::biased).
#include "cuda/experts/exact/f64_tile.cuh"
#include "cuda/experts/exact/params.hpp"
#include "math/activation.hpp"
#include "math/expert_row.hpp"  // math::biased

namespace epmoe::cuda::experts::exact {
namespace {

inline constexpr int kColumnsPerTile = kTileCols / 2;  // intermediate columns (gate + up each)

// The activation and the weights' precision are template arguments: each kernel holds one
// activation's and one format's code (registers).
template <Activation kActivation, Precision P>
__global__ void __launch_bounds__(kThreads, 1) f64_fc1_kernel(Params p) {
  extern __shared__ __align__(16) std::uint8_t smem[];
  __shared__ std::uint32_t x_row_of[kTileRows];  // the chunk's rows in the staged x

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

        const Matrices<P>& w13 = matrices<P>(p.weights.packed.w13, p.weights.fp8.w13);
        const WarpRole role = warp_role(chunk.rows);
        Accumulators acc;
        tile_gemm(
            *reinterpret_cast<TileSmem<P>*>(smem), role, chunk.rows, hidden,
            [&](int r) { return in.x + static_cast<std::size_t>(x_row_of[r]) * hidden; },
            [&](int c) {
              const std::int64_t row =
                  c < kColumnsPerTile ? j0 + c : inter + j0 + c - kColumnsPerTile;
              return tile_weight_row<P>(w13, chunk.expert, row);
            },
            matrix_factors<P>(w13, chunk.expert), acc);

        // Epilogue (k group 0 of each row group): the activation of the float-rounded (biased) gate
        // and up. b13 is indexed as w13's rows: gate j0 + column, up I + j0 + column.
        if (role.k_group != 0) return;
        const float* b13 =
            p.biases.b13 == nullptr
                ? nullptr
                : p.biases.b13 + static_cast<std::size_t>(chunk.expert) * 2 * inter + j0;
        for (int i = 0; i < kRowsPerWarp; ++i) {
          const int r = role.row_group * kRowsPerWarp + i;
          if (r >= chunk.rows) break;
          for (int q = 0; q < kColsPerLane / 2; ++q) {
            const int column = lane + 32 * q;
            const float gate = math::biased(acc[i][q], b13, column);
            const float up =
                math::biased(acc[i][q + 2], b13 == nullptr ? nullptr : b13 + inter, column);
            h_of(r)[column] =
                static_cast<float>(math::activation(kActivation, gate, up, p.problem.swiglu_limit));
          }
        }
      });
}

}  // namespace

KernelShape fc1_shape(const ExpertProblem& problem, int device, int num_sms) {
  return with_activation(problem.activation, [&](auto activation) {
    return with_precision(problem.precision, [&](auto precision) {
      constexpr Precision P = decltype(precision)::value;
      return occupancy_shape(f64_fc1_kernel<decltype(activation)::value, P>, kTileSmemBytes<P>,
                             device, num_sms);
    });
  });
}

void launch_fc1(const Params& p, const KernelShape& s, cudaStream_t stream) {
  with_activation(p.problem.activation, [&](auto activation) {
    with_precision(p.problem.precision, [&](auto precision) {
      launch_chained(f64_fc1_kernel<decltype(activation)::value, decltype(precision)::value>, s,
                     stream, p);
    });
  });
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epmoe::cuda::experts::exact

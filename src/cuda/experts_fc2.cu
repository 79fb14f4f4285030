// Expert step, part 4 (DESIGN §3 steps 5-6): FC2 over the quantized h rows, each result sent
// home as before: staged, the bf16 row into the home rank's [token, slot] combine row;
// in-kernel reduce, weight x row added into the home rank's fp32 accumulator. Work items are
// (chunk of up to 64 rows of one expert, tile of 128 hidden columns), tile fastest; the last
// tile of a hidden size that is not a multiple of 128 (gpt-oss: 2880) computes clamped columns
// it never stores. The last CTA tells every rank this rank's experts are done.
#include "cuda/cuda_check.hpp"
#include "cuda/experts.hpp"
#include "cuda/experts_gemm.cuh"
#include "cuda/experts_mma.cuh"
#include "protocol/token_back.hpp"
#include "protocol/wire.hpp"

namespace epmoe::cuda {
namespace {

using namespace experts;

using protocol::HomeSlot;

// One result element home (protocol/token_back.hpp): staged, bf16 into the home rank's
// [token, slot] combine row; in-kernel reduce, weight x out added into its fp32 accumulator.
__device__ inline void send_home(const ForwardParams& p, const HomeSlot& home, std::int64_t c,
                                 float out) {
  protocol::send_home(
      protocol::combine_buffer(p.peer_windows[home.rank], p.layout, p.top_k, p.combine), home, c,
      out);
}

// Exact math: float64 tile (experts_gemm.cuh); tensor cores: bf16 mma tile (experts_mma.cuh).
// Tensor cores: two CTAs per SM (110 KB of shared memory each), so at most 128 registers.
template <bool kTensorCores>
__global__ void __launch_bounds__(kThreads, kTensorCores ? 2 : 1) fc2_kernel(ForwardParams p) {
  extern __shared__ __align__(16) std::uint8_t smem[];
  __shared__ HomeSlot home_of[kTileRows];

  const RoundStart start = start_round(p);
  if (start.skip) return;

  const int lane = static_cast<int>(threadIdx.x) & 31;
  const std::int64_t hidden = p.hidden, inter = p.intermediate;
  const auto tiles = static_cast<std::uint32_t>((hidden + kTileCols - 1) / kTileCols);
  const std::uint32_t items = p.scratch.chunk_offset[p.local_experts] * tiles;
  const std::uint8_t* window = p.peer_windows[p.rank];
  for (std::uint32_t item = blockIdx.x; item < items; item += gridDim.x) {
    const Chunk chunk = find_chunk(p, item / tiles);
    const std::int64_t c0 = std::int64_t{item % tiles} * kTileCols;
    __syncthreads();  // the previous item's epilogue is done with home_of
    if (threadIdx.x < chunk.rows) {
      const std::uint32_t pair = p.scratch.pairs[chunk.first_pair + threadIdx.x];
      const std::uint8_t* row =
          window + p.layout.recv_row(start.round, pair_src(pair), pair_row(pair));
      const auto* entries =
          reinterpret_cast<const protocol::WireEntry*>(row + protocol::wire_entries_offset());
      home_of[threadIdx.x] = protocol::home_slot(
          pair_src(pair), *reinterpret_cast<const protocol::WireRowHeader*>(row),
          entries[pair_entry(pair)]);
    }
    __syncthreads();
    // Weight rows past the hidden size (gpt-oss: 2880) repeat the last one and are never stored.
    const auto w_row = [&](int c) { return c0 + c < hidden ? c0 + c : hidden - 1; };

    if constexpr (kTensorCores) {
      const std::uint16_t* w2 = p.w2_16 + static_cast<std::size_t>(chunk.expert) * hidden * inter;
      mma::Accumulators acc;
      mma::tile_mma(
          *reinterpret_cast<mma::Smem*>(smem), chunk.rows, inter,
          [&](int r) {
            return p.scratch.h16 + (chunk.first_pair + r) * static_cast<std::size_t>(inter);
          },
          [&](int c) { return w2 + w_row(c) * inter; }, acc);
      const mma::WarpTile tile = mma::warp_tile();
      const float w_scale = p.w2_scale[chunk.expert];
#pragma unroll
      for (int mi = 0; mi < mma::kMTiles; ++mi)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = tile.row0 + 16 * mi + lane / 4 + 8 * half;
          if (r >= chunk.rows) continue;
          // One scale at a time: the product of two NVFP4 s_enc (tiny-amax rows) can overflow.
          const float h_scale = p.scratch.h_scale[chunk.first_pair + r];
#pragma unroll
          for (int ni = 0; ni < mma::kNTiles; ++ni)
#pragma unroll
            for (int v = 0; v < 2; ++v) {
              const std::int64_t c = c0 + tile.col0 + 8 * ni + 2 * (lane % 4) + v;
              if (c < hidden)
                send_home(p, home_of[r], c, acc[mi][ni][2 * half + v] / h_scale / w_scale);
            }
        }
    } else {
      const float* w2 = p.w2 + static_cast<std::size_t>(chunk.expert) * hidden * inter;
      const WarpRole role = warp_role(chunk.rows);
      Accumulators acc;
      tile_gemm(
          *reinterpret_cast<TileSmem*>(smem), role, chunk.rows, inter,
          [&](int r) {
            return p.scratch.h + (chunk.first_pair + r) * static_cast<std::size_t>(inter);
          },
          [&](int c) { return w2 + w_row(c) * inter; }, acc);

      // Epilogue (k group 0 of each row group): each lane stores its columns, 32 apart, so a
      // warp's stores to a row are contiguous.
      if (role.k_group != 0) continue;
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const int r = role.row_group * kRowsPerWarp + i;
        if (r >= chunk.rows) break;
        for (int q = 0; q < kColsPerLane; ++q) {
          const std::int64_t c = c0 + lane + 32 * q;
          if (c >= hidden) break;
          send_home(p, home_of[r], c, static_cast<float>(acc[i][q]));
        }
      }
    }
  }

  // 6. The last CTA tells every rank this rank's experts are done.
  if (last_cta_done(&p.state->tickets[kExpertsDoneTicket])) {
    const DeviceSession session(p.layout, DevicePeers{p.peer_windows}, p.rank, start.round);
    for (int dest = 0; dest < p.world; ++dest) session.publish_done(dest);
  }
}

}  // namespace

KernelShape fc2_shape(const ForwardParams& p, int device) {
  return tile_kernel_shape(p, fc2_kernel<false>, fc2_kernel<true>, device);
}

void launch_fc2(const ForwardParams& p, const KernelShape& s, cudaStream_t stream) {
  launch_tile_kernel(p, s, fc2_kernel<false>, fc2_kernel<true>, stream);
}

}  // namespace epmoe::cuda

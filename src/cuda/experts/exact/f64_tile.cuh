// The exact backend's tile GEMM (docs/design.md §4.1), both expert matrices (FC1 over K = H, FC2
// over K = I), exact in the sense of the reference: every product of two floats is exact in
// float64 and summed in float64 (fma(x, w, acc) rounds once, like acc + x * w with an exact
// product), so an output differs from the reference's only by summation order. The oracle-grade
// path: the bf16 tensor-core backend (experts/mma/) is the fast one, and with the same item
// structure (one expert, a chunk of its rows, a tile of weight rows).
//
// One CTA computes a tile of kTileRows rows x kTileCols weight rows, looping over K in slabs of
// kSlabK through a kStages-deep cp.async pipeline (the weight slab is the big stream; three
// stages keep ~64 KB per SM in flight, enough to run HBM near peak when T is small and the step
// is bound by streaming weights). Each weight element is loaded once per chunk and used for every
// row of it; each x element is converted to float64 once per slab, not once per product
// (F2F.F64 runs at a quarter of the DFMA rate on Hopper).
//
// Warp roles: 8 warps = row groups x k groups, chosen per chunk from its row count. A warp owns
// 8 rows x 128 columns (4 per lane: lane, lane + 32, lane + 64, lane + 96) and one contiguous
// part of each slab's k. Few rows (decode) -> 1 row group x 8 k groups, so every warp streams
// and multiplies; many rows -> 8 row groups x 1 k group. k groups are summed through shared
// memory in a fixed order (k group 0 first), in float64.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/experts/common.cuh"
#include "cuda/kernels.hpp"

namespace epmoe::cuda::experts::exact {

inline constexpr int kTileRows = kChunkRows;  // rows (pairs of one expert) per chunk
inline constexpr int kTileCols = 128;         // weight rows (outputs) per tile
inline constexpr int kSlabK = 64;             // k per pipeline stage
inline constexpr int kStages = 3;             // slabs in flight
inline constexpr int kRowsPerWarp = 8;        // one row group
inline constexpr int kColsPerLane = kTileCols / 32;
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kSlabStride = kSlabK + 4;  // floats: rows stay 16-byte aligned, banks spread

static_assert(kWarps * kRowsPerWarp == kTileRows, "8 row groups of 8 rows cover a chunk");
static_assert(kColsPerLane == 4, "each lane owns 4 columns: gate/up pairs in FC1");
static_assert(kSlabK % 32 == 0 && kSlabK / kWarps % 4 == 0,
              "a k group takes whole float4s of a slab; H and I are multiples of 64");

// Shared memory of one CTA: ~185 KB, the same for every model (K is tiled), under the 227 KB an
// sm_90 CTA may use. The float64 k-group partials alias the stages once the pipeline is drained.
struct TileSmem {
  struct Stage {
    float w[kTileCols][kSlabStride];  // weight rows of the tile, slab of k
    float x[kTileRows][kSlabStride];  // input rows of the chunk, slab of k
  };
  union {
    Stage stage[kStages];
    double partial[kWarps][kRowsPerWarp][kTileCols];
  } u;
  double x64[kSlabK][kTileRows];  // this slab's x in float64, k-major: a warp's 8 rows side by side
};
static_assert(sizeof(double) * kWarps * kRowsPerWarp * kTileCols <=
                  sizeof(TileSmem::Stage) * kStages,
              "the k-group partials fit where the stages were");

inline constexpr std::size_t kTileSmemBytes = sizeof(TileSmem);

using Accumulators = double[kRowsPerWarp][kColsPerLane];

struct WarpRole {
  int row_group;    // rows [8 * row_group, 8 * row_group + 8) of the chunk
  int k_group;      // part k_group of each slab's k
  int k_groups;     // k groups per row group (8 / row groups)
  int active_rows;  // rows the CTA loads and multiplies: row groups x 8 >= the chunk's rows
};

__device__ inline WarpRole warp_role(int rows) {
  int row_groups = 1;
  while (row_groups * kRowsPerWarp < rows && row_groups < kWarps) row_groups *= 2;
  const int k_groups = kWarps / row_groups;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  return WarpRole{warp / k_groups, warp % k_groups, k_groups, row_groups * kRowsPerWarp};
}

// acc[i][q] = sum over k < k_total of x_row(row)[k] * w_row(col)[k], row = 8 * row_group + i,
// col = lane + 32 * q, in the warps whose k_group is 0 (the others hold nothing useful after).
// x_row(r) is called for r < rows only (rows past the chunk repeat its last row and are never
// stored); w_row(c) for every c < kTileCols, so the caller clamps columns past the matrix.
// Every thread of the CTA calls it; it starts and ends with a barrier, so `s` is free on return.
template <class XRow, class WRow>
__device__ __forceinline__ void tile_gemm(TileSmem& s, const WarpRole& role, int rows,
                                          std::int64_t k_total, XRow x_row, WRow w_row,
                                          Accumulators& acc) {
  constexpr int kChunksPerRow = kSlabK / 4;  // 16-byte copies per row of a slab
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int slabs = static_cast<int>(k_total / kSlabK);
  const int active_rows = role.active_rows;

  auto load_slab = [&](int slab, int buffer) {
    const std::int64_t k0 = std::int64_t{slab} * kSlabK;
    TileSmem::Stage& st = s.u.stage[buffer];
    for (int i = threadIdx.x; i < kTileCols * kChunksPerRow; i += kThreads) {
      const int c = i / kChunksPerRow, q = i % kChunksPerRow;
      cp_async_16(&st.w[c][4 * q], w_row(c) + k0 + 4 * q);
    }
    for (int i = threadIdx.x; i < active_rows * kChunksPerRow; i += kThreads) {
      const int r = i / kChunksPerRow, q = i % kChunksPerRow;
      cp_async_16(&st.x[r][4 * q], x_row(r < rows ? r : rows - 1) + k0 + 4 * q);
    }
  };

  for (int i = 0; i < kRowsPerWarp; ++i)
    for (int q = 0; q < kColsPerLane; ++q) acc[i][q] = 0.0;

  __syncthreads();  // the previous tile is done with `s`
  // NOTES: one commit per stage even when there is no slab left, so "all but kStages - 2 groups
  // done" always means "the slab about to be used has landed".
  for (int slab = 0; slab < kStages - 1; ++slab) {
    if (slab < slabs) load_slab(slab, slab);
    cp_async_commit();
  }

  const int k_per_group = kSlabK / role.k_groups;
  const int k_begin = role.k_group * k_per_group;
  const int row0 = role.row_group * kRowsPerWarp;
  for (int slab = 0; slab < slabs; ++slab) {
    const int buffer = slab % kStages;
    cp_async_wait<kStages - 2>();
    __syncthreads();  // slab landed for every thread; everyone is done with slab - 1's buffers
    if (slab + kStages - 1 < slabs) load_slab(slab + kStages - 1, (slab + kStages - 1) % kStages);
    cp_async_commit();

    // x to float64 once per slab (lanes take consecutive rows: the stores are conflict-free).
    const TileSmem::Stage& st = s.u.stage[buffer];
    for (int i = threadIdx.x; i < active_rows * kSlabK; i += kThreads) {
      const int r = i % active_rows, k = i / active_rows;
      s.x64[k][r] = static_cast<double>(st.x[r][k]);
    }
    __syncthreads();

    for (int k = k_begin; k < k_begin + k_per_group; k += 4) {
      double w[kColsPerLane][4];
#pragma unroll
      for (int q = 0; q < kColsPerLane; ++q) {
        const float4 v = *reinterpret_cast<const float4*>(&st.w[lane + 32 * q][k]);
        w[q][0] = v.x;
        w[q][1] = v.y;
        w[q][2] = v.z;
        w[q][3] = v.w;
      }
#pragma unroll
      for (int dk = 0; dk < 4; ++dk) {
#pragma unroll
        for (int i = 0; i < kRowsPerWarp; ++i) {
          const double x = s.x64[k + dk][row0 + i];  // the same address in every lane: broadcast
#pragma unroll
          for (int q = 0; q < kColsPerLane; ++q) acc[i][q] = fma(x, w[q][dk], acc[i][q]);
        }
      }
    }
  }
  cp_async_wait<0>();  // only empty groups can be left; drained before `s` is reused
  __syncthreads();

  if (role.k_groups > 1) {  // the same for every warp of the CTA: barriers stay uniform
    const int warp = static_cast<int>(threadIdx.x) / 32;
    for (int i = 0; i < kRowsPerWarp; ++i)
      for (int q = 0; q < kColsPerLane; ++q) s.u.partial[warp][i][lane + 32 * q] = acc[i][q];
    __syncthreads();
    if (role.k_group == 0)
      for (int g = 1; g < role.k_groups; ++g)
        for (int i = 0; i < kRowsPerWarp; ++i)
          for (int q = 0; q < kColsPerLane; ++q)
            acc[i][q] += s.u.partial[warp + g][i][lane + 32 * q];
    __syncthreads();
  }
}

}  // namespace epmoe::cuda::experts::exact

// The exact backend's tile GEMM (docs/design.md §4.1), both expert matrices (FC1 over K = H, FC2
// over K = I), exact in the sense of the reference: every product of two floats is exact in
// float64 and summed in float64 (fma(x, w, acc) rounds once, like acc + x * w with an exact
// product), so an output differs from the reference's only by summation order. The oracle-grade
// path: the bf16 tensor-core backend (experts/mma/) is the fast one, and with the same item
// structure (one expert, a chunk of its rows, a tile of weight rows).
//
// One CTA computes a tile of kTileRows rows x kTileCols weight rows, looping over K in slabs of
// kSlabK through a kStages-deep cp.async pipeline. Each weight element is loaded once per chunk
// and used for every row of it; each x element is converted to float64 once per slab, not once
// per product (F2F.F64 runs at a quarter of the DFMA rate on Hopper).
//
// How the weight operand flows: the weights stay resident in the layer's format (resident.hpp:
// bf16 2 B, MXFP8 1 B + an E8M0 per 32, NVFP4 0.5 B + an E4M3 per 16 and s_enc per matrix). The
// pipeline's cp.async copies a slab's compressed rows (the tile's two groups of 64 weight rows)
// and their scale records into the stage, 16 bytes at a time; after the slab has landed, every
// thread decodes one run of 32 elements of one row (decode_values: the codec's block decoders,
// so each value is the fp32 decode(encode(w)) of math::emulate_weight_matrix, bit for bit) into
// the one fp32 slab `w` that the float64 loop reads, next to the x conversion and before the
// barrier that already separated it from the products. So the loop and its numerics are the
// same as with fp32 weights, and HBM streams 2 / 1.03 / 0.56 bytes per weight instead of 4.
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
#include "cuda/experts/weight_slab.cuh"
#include "cuda/kernels.hpp"

namespace epmoe::cuda::experts::exact {

inline constexpr int kTileRows = kChunkRows;  // rows (pairs of one expert) per chunk
inline constexpr int kTileCols = kSlabRows;   // weight rows (outputs) per tile: 128
inline constexpr int kSlabK = kScaleSlab;     // k per pipeline stage: 64
inline constexpr int kStages = 4;             // slabs in flight
inline constexpr int kRowsPerWarp = 8;        // one row group
inline constexpr int kColsPerLane = kTileCols / 32;
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kSlabStride = kSlabK + 4;  // floats: rows stay 16-byte aligned, banks spread

static_assert(kWarps * kRowsPerWarp == kTileRows, "8 row groups of 8 rows cover a chunk");
static_assert(kColsPerLane == 4, "each lane owns 4 columns: gate/up pairs in FC1");
static_assert(kSlabK % 32 == 0 && kSlabK / kWarps % 4 == 0,
              "a k group takes whole float4s of a slab; H and I are multiples of 64");
static_assert(kTileCols * (kSlabK / kRun) == kThreads, "the decode step: one run per thread");

// Shared memory of one CTA (bf16 ~198 KB, mxfp8 ~167 KB, nvfp4 ~152 KB), the same for every model
// (K is tiled), under the 227 KB an sm_90 CTA may use. The float64 k-group partials alias the
// stages once the pipeline is drained.
template <Precision P>
struct TileSmem {
  struct Stage {
    RawSlab<P> w;                     // weight rows of the tile, slab of k, as resident
    float x[kTileRows][kSlabStride];  // input rows of the chunk, slab of k
  };
  union {
    Stage stage[kStages];
    double partial[kWarps][kRowsPerWarp][kTileCols];
  } u;
  float w[kTileCols][kSlabStride];  // this slab's weights, decoded
  double x64[kSlabK][kTileRows];  // this slab's x in float64, k-major: a warp's 8 rows side by side
};
static_assert(sizeof(double) * kWarps * kRowsPerWarp * kTileCols <=
                  sizeof(TileSmem<Precision::nvfp4>::Stage) * kStages,
              "the k-group partials fit where the stages were");

template <Precision P>
inline constexpr std::size_t kTileSmemBytes = sizeof(TileSmem<P>);

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

// acc[i][q] = sum over k < k_total of x_row(row)[k] * w(col, k), row = 8 * row_group + i,
// col = lane + 32 * q, in the warps whose k_group is 0 (the others hold nothing useful after);
// weight row col of the tile is raw row col of `w` (WeightTile: cols 0-63 the first group,
// 64-127 the second), s_enc its matrix's (weight_s_enc). x_row(r) is called for r < rows only (rows
// past the chunk repeat its last row and are never stored). Every thread of the CTA calls it; it
// starts and ends with a barrier, so `s` is free on return.
template <Precision P, class XRow>
__device__ __forceinline__ void tile_gemm(TileSmem<P>& s, const WarpRole& role, int rows,
                                          std::int64_t k_total, XRow x_row, const WeightTile& w,
                                          float s_enc, Accumulators& acc) {
  constexpr int kChunksPerRow = kSlabK / 4;  // 16-byte copies per row of an x slab
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int slabs = static_cast<int>(k_total / kSlabK);
  const int active_rows = role.active_rows;

  auto load_slab = [&](int slab, int buffer) {
    const std::int64_t k0 = std::int64_t{slab} * kSlabK;
    typename TileSmem<P>::Stage& st = s.u.stage[buffer];
    load_raw_slab<P, kThreads>(st.w, w, slab);
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
  // The decode step's run: row dcol of the tile, k [32 dhalf, 32 dhalf + 32) of the slab.
  const int dcol = static_cast<int>(threadIdx.x) / 2, dhalf = static_cast<int>(threadIdx.x) % 2;
  for (int slab = 0; slab < slabs; ++slab) {
    const int buffer = slab % kStages;
    cp_async_wait<kStages - 2>();
    __syncthreads();  // slab landed for every thread; everyone is done with slab - 1's buffers
    if (slab + kStages - 1 < slabs) load_slab(slab + kStages - 1, (slab + kStages - 1) % kStages);
    cp_async_commit();

    // x to float64 once per slab (lanes take consecutive rows: the stores are conflict-free).
    const typename TileSmem<P>::Stage& st = s.u.stage[buffer];
    for (int i = threadIdx.x; i < active_rows * kSlabK; i += kThreads) {
      const int r = i % active_rows, k = i / active_rows;
      s.x64[k][r] = static_cast<double>(st.x[r][k]);
    }
    // The weights to fp32 once per slab: one run per thread.
    {
      const auto bytes = load_run<run_bytes(P)>(st.w.run(dcol, dhalf));
      std::uint8_t scales[run_scales(P) > 0 ? run_scales(P) : 1];
      for (int j = 0; j < run_scales(P); ++j) scales[j] = st.w.run_scale(dcol, dhalf)[j];
      float v[kRun];
      decode_values<P>(bytes.b, scales, s_enc, v);
      auto* dst = reinterpret_cast<float4*>(&s.w[dcol][dhalf * kRun]);
#pragma unroll
      for (int i = 0; i < kRun / 4; ++i)
        dst[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
    }
    __syncthreads();

    for (int k = k_begin; k < k_begin + k_per_group; k += 4) {
      double wk[kColsPerLane][4];
#pragma unroll
      for (int q = 0; q < kColsPerLane; ++q) {
        const float4 v = *reinterpret_cast<const float4*>(&s.w[lane + 32 * q][k]);
        wk[q][0] = v.x;
        wk[q][1] = v.y;
        wk[q][2] = v.z;
        wk[q][3] = v.w;
      }
#pragma unroll
      for (int dk = 0; dk < 4; ++dk) {
#pragma unroll
        for (int i = 0; i < kRowsPerWarp; ++i) {
          const double x = s.x64[k + dk][row0 + i];  // the same address in every lane: broadcast
#pragma unroll
          for (int q = 0; q < kColsPerLane; ++q) acc[i][q] = fma(x, wk[q][dk], acc[i][q]);
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

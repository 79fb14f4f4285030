// The exact backend's tile GEMM (docs/design.md §4.1), both expert matrices (FC1 over K = H, FC2
// over K = I), exact in the sense of the reference: every product of two floats is exact in
// float64 and summed in float64 (fma(x, w, acc) rounds once, like acc + x * w with an exact
// product), so an output differs from the reference's only by summation order. The oracle-grade
// path: the bf16 tensor-core backend (experts/mma/) is the fast one, and with the same item
// structure (one expert, a chunk of its rows, a tile of weight rows).
//
// One CTA computes a tile of kTileRows rows x kTileCols weight rows, looping over K in slabs of
// kSlabK through a kStages-deep cp.async pipeline (the weight slab is the big stream). Weights are
// read as they are resident, in the layer's precision (packed_weights.hpp, fp8_block_weights.hpp):
// each slab's codes and block scales land in shared memory and are decoded there to fp32, each
// weight to the value the reference decodes (decode_half_row), before the float64 sums. Each weight
// element is loaded once per chunk and used for every row of it; each x element is converted to
// float64 once per slab, not once per product (F2F.F64 runs at a quarter of the DFMA rate on
// Hopper).
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
#include "cuda/experts/fp8_block_weights.hpp"
#include "cuda/experts/packed_weights.cuh"
#include "cuda/kernels.hpp"
#include "formats/quantized_weights.hpp"  // fp8_block128_tile

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
static_assert(kThreads == 2 * kTileCols, "a slab is decoded by a thread per half weight row");

// Calls f(std::integral_constant<Precision, P>) with the layer's precision.
template <class F>
decltype(auto) with_precision(Precision p, F f) {
  if (p == Precision::fp8_block128)
    return f(std::integral_constant<Precision, Precision::fp8_block128>{});
  return with_packed_precision(p, f);
}

// One FC's matrices as the tile reads them: packed, or E4M3 codes with 128 x 128 tile scales.
template <Precision P>
using Matrices = std::conditional_t<P == Precision::fp8_block128, Fp8BlockMatrices, PackedMatrices>;
// Bits per weight code.
template <Precision P>
inline constexpr int kCodeBits = [] {
  if constexpr (P == Precision::fp8_block128)
    return 8;
  else
    return PackedFormat<P>::kBits;
}();

// Weight row `row` of expert `expert`: its codes, and the bytes of its scales (fp8_block128: the
// fp32 scales of its row of 128 x 128 tiles).
template <Precision P>
__device__ inline WeightRow tile_weight_row(const Matrices<P>& m, std::int64_t expert,
                                            std::int64_t row) {
  if constexpr (P == Precision::fp8_block128) {
    const float* scales =
        m.scales + formats::fp8_block128_tile(m.rows, m.cols, expert, row * m.cols);
    return WeightRow{m.codes + (expert * m.rows + row) * m.cols,
                     reinterpret_cast<const std::uint8_t*>(scales)};
  } else {
    return weight_row<P>(m, expert, row);
  }
}
// The address of the scale codes of weight k of `w` (nullptr for bf16).
template <Precision P>
__device__ inline const std::uint8_t* scale_codes_address(const WeightRow& w, std::int64_t k) {
  if constexpr (P == Precision::fp8_block128)
    return w.scales + sizeof(float) * (k / formats::kFp8Block128);
  else if constexpr (PackedFormat<P>::kBlock == 0)
    return nullptr;
  else
    return w.scales + k / PackedFormat<P>::kBlock;
}
// NVFP4's per-matrix factors (decoded / divisor * multiplier, packed_weights.hpp); 1 otherwise.
struct MatrixFactors {
  float divisor = 1.0f, multiplier = 1.0f;
};
template <Precision P>
__device__ inline MatrixFactors matrix_factors(const Matrices<P>& m, std::int64_t expert) {
  if constexpr (P == Precision::nvfp4)
    return MatrixFactors{m.divisor[expert], m.multiplier[expert]};
  else
    return MatrixFactors{};
}

// NVFP4's weights take few values per matrix: a magnitude (3 bits of E2M1) times a block scale
// (8 bits of E4M3), divided by the matrix's divisor (and times its multiplier). A tile computes
// the 2048 of its matrix once (kNvfp4Values, 8 divisions per thread) and decodes by looking them
// up: one IEEE division per weight per slab made NVFP4's exact round 2-3x slower than MXFP4's
// (session 19). The value of nibble n with block scale code c is +-values[c << 3 | (n & 7)].
inline constexpr int kNvfp4Values = 256 << 3;
struct NoNvfp4Values {};
struct Nvfp4Values {
  float nvfp4_values[kNvfp4Values];
};
// Fills `values` (every thread of the CTA; a barrier must follow before they are read) with
// exactly what the reference decodes (formats::nvfp4_decode_value, then the multiplier).
__device__ inline void fill_nvfp4_values(float* values, MatrixFactors f) {
  for (int i = static_cast<int>(threadIdx.x); i < kNvfp4Values; i += kThreads) {
    float v = formats::nvfp4_decode_value(static_cast<std::uint8_t>(i & 7),
                                          static_cast<std::uint8_t>(i >> 3), f.divisor);
    if (f.multiplier != 1.0f) v *= f.multiplier;
    values[i] = v;
  }
}

// 32 weights of a row (half of a slab) from their codes in shared memory to fp32, each the value
// the reference decodes: the code times its block scale (decode8: exact for bf16 / MX;
// fp8_block128's e4m3 * scale rounds once, as fp8_block128_decode_value); NVFP4's from the
// matrix's values (fill_nvfp4_values). `scale_word`: the aligned 4-byte word holding the half
// row's first scale code, shifted down to it (fp8_block128: the fp32 scale's bits).
template <Precision P>
__device__ inline void decode_half_row(const std::uint8_t* codes, std::uint32_t scale_word,
                                       const float* nvfp4_values, float* out) {
  if constexpr (P == Precision::nvfp4) {
    const uint4 v = *reinterpret_cast<const uint4*>(codes);  // 32 E2M1: two blocks of 16
    const std::uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const std::uint32_t nibble = (words[j / 8] >> (4 * (j % 8))) & 0xFu;
      const std::uint32_t scale_code = (scale_word >> (8 * (j / 16))) & 0xFFu;
      const float value = nvfp4_values[scale_code << 3 | (nibble & 7u)];
      out[j] = nibble & 8u ? -value : value;
    }
  } else {
    constexpr Precision kDecodeAs = P == Precision::fp8_block128 ? Precision::mxfp8 : P;
    constexpr int kLoads = 32 * kCodeBits<P> / 8 / 16;
    constexpr int kGroups = kWeightsPer16B<kDecodeAs> / 8;
#pragma unroll
    for (int load = 0; load < kLoads; ++load) {
      const uint4 v = *reinterpret_cast<const uint4*>(codes + 16 * load);
#pragma unroll
      for (int g = 0; g < kGroups; ++g) {
        float w[8];
        const float scale = P == Precision::fp8_block128 ? __uint_as_float(scale_word)
                                                         : group_scale<kDecodeAs>(scale_word, g);
        decode8<kDecodeAs>(v, g, scale, w);
#pragma unroll
        for (int k = 0; k < 8; ++k) out[load * kWeightsPer16B<kDecodeAs> + 8 * g + k] = w[k];
      }
    }
  }
}

// Shared memory of one CTA (bf16 178,176 bytes, 8-bit codes 153,600, MXFP4 141,312, NVFP4
// 149,504), the same for every model (K is tiled), under the 227 KB an sm_90 CTA may use. The
// float64 k-group partials alias the stages once the pipeline is drained.
template <Precision P>
struct TileSmem : std::conditional_t<P == Precision::nvfp4, Nvfp4Values, NoNvfp4Values> {
  static constexpr int kCodeBytes = kSlabK * kCodeBits<P> / 8;  // a weight row's slab
  // An odd number of 16-byte units per row: the 8 rows a quarter warp decodes at once (decode_row)
  // fall in different banks.
  static constexpr int kCodeStride = kCodeBytes + 16;
  struct Stage {
    alignas(16) std::uint8_t w_codes[kTileCols][kCodeStride];  // weight rows' slab of k
    float x[kTileRows][kSlabStride];                           // input rows of the chunk, slab of k
    std::uint32_t scale_words[kThreads];  // each half weight row's scale codes (aligned word)
  };
  union {
    Stage stage[kStages];
    double partial[kWarps][kRowsPerWarp][kTileCols];
  } u;
  float w[kTileCols][kSlabStride];  // this slab's weights, decoded
  double x64[kSlabK][kTileRows];  // this slab's x in float64, k-major: a warp's 8 rows side by side
  static_assert(sizeof(double) * kWarps * kRowsPerWarp * kTileCols <= sizeof(Stage) * kStages,
                "the k-group partials fit where the stages were");
};

template <Precision P>
inline constexpr std::size_t kTileSmemBytes = sizeof(TileSmem<P>);
static_assert(kTileSmemBytes<Precision::bf16> == 178'176 &&
                  kTileSmemBytes<Precision::mxfp8> == 153'600 &&
                  kTileSmemBytes<Precision::mxfp4> == 141'312 &&
                  kTileSmemBytes<Precision::nvfp4> == 149'504,
              "the sizes the comment above gives");

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
// col = lane + 32 * q, with w(col, k) weight k of w_row(col) (a WeightRow, tile_weight_row) decoded
// with `factors`, in the warps whose k_group is 0 (the others hold nothing useful after).
// x_row(r) is called for r < rows only (rows past the chunk repeat its last row and are never
// stored); w_row(c) for every c < kTileCols, so the caller clamps columns past the matrix.
// Every thread of the CTA calls it; it starts and ends with a barrier, so `s` is free on return.
template <Precision P, class XRow, class WRow>
__device__ __forceinline__ void tile_gemm(TileSmem<P>& s, const WarpRole& role, int rows,
                                          std::int64_t k_total, XRow x_row, WRow w_row,
                                          MatrixFactors factors, Accumulators& acc) {
  using Smem = TileSmem<P>;
  constexpr int kChunksPerRow = kSlabK / 4;           // 16-byte copies per x row of a slab
  constexpr int kCodeCopies = Smem::kCodeBytes / 16;  // 16-byte copies per weight row
  constexpr bool kScaled = P != Precision::bf16;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int slabs = static_cast<int>(k_total / kSlabK);
  const int active_rows = role.active_rows;
  // This thread decodes half decode_half of weight row decode_row of every slab (a warp takes 32
  // rows, so its reads of the codes and its writes of the weights are free of bank conflicts).
  const int decode_row = static_cast<int>(threadIdx.x) % kTileCols;
  const int decode_half = static_cast<int>(threadIdx.x) / kTileCols;
  const WeightRow decoded = w_row(decode_row);
  const auto scale_codes_at = [&](int slab) {
    return scale_codes_address<P>(decoded, std::int64_t{slab} * kSlabK + 32 * decode_half);
  };

  auto load_slab = [&](int slab, int buffer) {
    const std::int64_t k0 = std::int64_t{slab} * kSlabK;
    typename Smem::Stage& st = s.u.stage[buffer];
    for (int i = threadIdx.x; i < kTileCols * kCodeCopies; i += kThreads) {
      const int c = i / kCodeCopies, q = i % kCodeCopies;
      cp_async_16(&st.w_codes[c][16 * q], w_row(c).codes + k0 * kCodeBits<P> / 8 + 16 * q);
    }
    // The aligned word holding the half row's first scale code (the scales' slices are 256-byte
    // aligned and padded, so the word is inside them).
    if constexpr (kScaled)
      cp_async_4(&st.scale_words[threadIdx.x],
                 reinterpret_cast<const void*>(
                     reinterpret_cast<std::uintptr_t>(scale_codes_at(slab)) & ~std::uintptr_t{3}));
    for (int i = threadIdx.x; i < active_rows * kChunksPerRow; i += kThreads) {
      const int r = i / kChunksPerRow, q = i % kChunksPerRow;
      cp_async_16(&st.x[r][4 * q], x_row(r < rows ? r : rows - 1) + k0 + 4 * q);
    }
  };

  for (int i = 0; i < kRowsPerWarp; ++i)
    for (int q = 0; q < kColsPerLane; ++q) acc[i][q] = 0.0;

  __syncthreads();  // the previous tile is done with `s`
  float* nvfp4_values = nullptr;
  if constexpr (P == Precision::nvfp4) {
    nvfp4_values = s.nvfp4_values;
    fill_nvfp4_values(nvfp4_values, factors);  // read after the first slab's barrier
  }
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

    // x to float64 once per slab (lanes take consecutive rows: the stores are conflict-free), and
    // the weights to fp32.
    const typename Smem::Stage& st = s.u.stage[buffer];
    for (int i = threadIdx.x; i < active_rows * kSlabK; i += kThreads) {
      const int r = i % active_rows, k = i / active_rows;
      s.x64[k][r] = static_cast<double>(st.x[r][k]);
    }
    const std::uint32_t scale_word =
        kScaled ? st.scale_words[threadIdx.x] >>
                      (8 * (reinterpret_cast<std::uintptr_t>(scale_codes_at(slab)) & 3))
                : 0u;
    decode_half_row<P>(&st.w_codes[decode_row][Smem::kCodeBytes / 2 * decode_half], scale_word,
                       nvfp4_values, &s.w[decode_row][32 * decode_half]);
    __syncthreads();

    for (int k = k_begin; k < k_begin + k_per_group; k += 4) {
      double w[kColsPerLane][4];
#pragma unroll
      for (int q = 0; q < kColsPerLane; ++q) {
        const float4 v = *reinterpret_cast<const float4*>(&s.w[lane + 32 * q][k]);
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

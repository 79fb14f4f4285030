// The packed-weight GEMM's device parts (packed_gemm.cu says how the kernels work): shared memory,
// the ring of stages, tile placement, the epilogues, and the E4M3 tile's roles as device functions
// (e4m3::gemm), so that a kernel other than packed_gemm.cu's own (the persistent round,
// docs/design.md §4.3) can run the same tiles.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>  // the E4M3 conversions of the activating epilogue

#include <cuda.h>  // CUtensorMap

#include <cub/block/block_scan.cuh>

#include "cuda/experts/common.cuh"  // cp_async_*
#include "cuda/experts/e2m1_bf16.hpp"
#include "cuda/experts/packed_weights.cuh"
#include "cuda/experts/wgmma/packed_gemm.hpp"
#include "cuda/pdl.cuh"
#include "cute/arch/copy_sm90_desc.hpp"  // TMA::CacheHintSm90, prefetch_tma_descriptor
#include "cute/arch/copy_sm90_tma.hpp"   // SM90_TMA_LOAD_3D / _5D
#include "cute/arch/mma_sm90.hpp"
#include "cute/atom/mma_atom.hpp"
#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"  // ClusterBarrier
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/cuda_host_adapter.hpp"  // cuTensorMapEncodeTiled through the runtime
#include "epmoe/errors.hpp"
#include "formats/codec.hpp"              // the MXFP8 block codec of FC2's input
#include "formats/quantized_weights.hpp"  // fp8_block128_tile
#include "math/activation.hpp"
#include "math/expert_row.hpp"  // math::biased
#include "protocol/wire.hpp"    // activation_format

namespace epmoe::cuda::experts::wgmma::packed {

using namespace cute;

constexpr int kRows = PackedGroupedGemm::kWeightRows;  // weight rows per tile (WGMMA's M)
constexpr int kTileK = 64;                             // one 128-byte swizzle atom of bf16
constexpr int kWarpgroup = 128;
constexpr int kProducerThreads = kWarpgroup;  // warpgroup 0
constexpr int kMathThreads = 2 * kWarpgroup;  // warpgroups 1 and 2: 64 weight rows each
constexpr int kGemmThreads = kProducerThreads + kMathThreads;
constexpr int kMaxGroups = 1024;  // the tile prefix in shared memory
static_assert(kProducerThreads == kRows, "a producer thread per weight row's scale word");

using Bf16 = cutlass::bfloat16_t;
using Atom = GMMA::Layout_K_SW128_Atom<Bf16>;  // 8 rows x 64 bf16, 128-byte swizzle

// What the token tile (WGMMA's N: 64, 128 or 256 token rows, PackedTokenTile) sets: the WGMMA, the
// token rows' stages and the ring's depth (as deep as shared memory allows for 64, 128 and 256;
// 16 rows take 12, the E4M3 tile's depth, of about 24 that would fit: deeper is unmeasured).
template <int kTokens>
struct TokenTile {
  static constexpr int kStages = kTokens == 16 ? 12 : kTokens == 64 ? 8 : kTokens == 128 ? 7 : 4;
  // 16 token rows (nvfp4's decode tile, t16): two pairs of math warpgroups split K, as the E4M3
  // tile's (e4m3::kSplitK); the wider tiles one pair
  static constexpr int kPairs = kTokens == 16 ? 2 : 1;
  static constexpr int kThreads = kProducerThreads + kPairs * 2 * kWarpgroup;
  using Op = decltype(SM90::GMMA::rs_op_selector<Bf16, Bf16, float, Shape<_64, Int<kTokens>, _64>,
                                                 GMMA::Major::K, GMMA::Major::K>());
  using TiledMma = decltype(make_tiled_mma(Op{}, Layout<Shape<_2, _1, _1>>{}));
  using LayoutX = decltype(tile_to_shape(Atom{}, Shape<Int<kTokens>, Int<kTileK>, Int<kStages>>{}));
};

// Element offset of (row, k) in a K-major 128-byte-swizzled tile of 64 bf16 per row (the layout
// of Atom tiled along rows; the swizzle XORs the 16-byte chunk index with row % 8).
__device__ __forceinline__ int swizzled(int row, int k) {
  return row * kTileK + ((((k >> 3) ^ row) & 7) << 3) + (k & 7);
}

template <Precision P, int kTokens, bool kActivates>
struct Smem {
  static constexpr int kStages = TokenTile<kTokens>::kStages;
  static constexpr int kCodeBytes = kTileK * PackedFormat<P>::kBits / 8;  // a weight row's k tile
  // A row's codes are read by the 4 threads that hold its k16 block's weights (one load each,
  // the same address); 16 bytes of padding per row put the 8 rows a warp reads on distinct banks.
  static constexpr int kCodeStride = kCodeBytes + 16;
  alignas(1024) Bf16 x[kStages][kTokens * kTileK];  // token rows
  alignas(16) std::uint8_t codes[kStages][kRows][kCodeStride];
  std::uint32_t scale_words[kStages][kRows];
  alignas(8) std::uint64_t full[kStages];   // the stage's copies landed (producer -> math)
  alignas(8) std::uint64_t empty[kStages];  // both math warpgroups are done with it
  int tile_end[kMaxGroups];                 // tiles of groups 0..g, inclusive prefix
  // The activating epilogue's block amax partials: [math warpgroup][token row][warp], |h| bits.
  alignas(16) std::uint32_t amax[kActivates ? 2 : 1][kActivates ? kTokens : 1][4];
  // split K (kPairs 2): pair 1's sums for pair 0 (hand_sums_to_pair_0)
  static constexpr int kPartial = TokenTile<kTokens>::kPairs == 2 ? kTokens / 2 : 1;
  float partial[2][kPartial][kWarpgroup];
};

using Args = PackedGemmArgs;

// The weight row of tile row t (0..127) of weight block `block`: n0 + t (rows past N are copies of
// row N - 1, never stored); for an activating FC1 (N = 2I), whose block covers the 64 outputs
// 64 block .. 64 block + 63, each warp's 16-row slab of WGMMA's C holds 8 gate rows (slab rows
// 0-7) and the up rows of the same 8 outputs (rows 8-15), since a thread's C fragment holds rows
// r and r + 8: both halves of each of its outputs. Warpgroup wg's slabs cover outputs 64 block +
// 32 wg .. + 31, one MXFP8 block.
template <bool kActivates>
__device__ __forceinline__ int weight_row(int t, int block, int n) {
  if constexpr (kActivates) {
    const int out = 64 * block + t / 16 * 8 + t % 8;
    return t % 16 < 8 ? out : n / 2 + out;
  } else {
    return min(kRows * block + t, n - 1);
  }
}

// The group holding `tile` (tile_end is nondecreasing; tile < tile_end[groups - 1]).
__device__ __forceinline__ int group_of(const int* tile_end, int groups, int tile) {
  int lo = 0, hi = groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (tile_end[mid] > tile)
      hi = mid;
    else
      lo = mid + 1;
  }
  return lo;
}

// Row `row` (< n) of group g's matrix of N rows of `row_bytes` each: its codes or block scales.
__device__ __forceinline__ const std::uint8_t* matrix_row(const std::uint8_t* base,
                                                          std::int64_t row_bytes, int g, int n,
                                                          int row) {
  return base + (static_cast<std::int64_t>(g) * n + row) * row_bytes;
}

// Where a tile sits: its group, first weight row (n0) and first token row (m0).
struct TilePlace {
  int g, n0, m0;
};
__device__ __forceinline__ TilePlace place_of(const int* tile_end, int groups, int weight_blocks,
                                              int tokens, int tile) {
  const int g = group_of(tile_end, groups, tile);
  const int local = tile - (g > 0 ? tile_end[g - 1] : 0);
  return {g, local % weight_blocks * kRows, local / weight_blocks * tokens};
}

// A position in the ring of stages: the stage and the parity of its current use.
struct RingPosition {
  int stage = 0;
  std::uint32_t phase = 0;
  template <int kStages>
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

__device__ __forceinline__ void warpgroup_barrier(int id) {  // 128 threads, ids 1 to 4
  asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(kWarpgroup) : "memory");
}
__device__ __forceinline__ void pair_barrier(int id) {  // two warpgroups, ids 5 to 8
  asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(2 * kWarpgroup) : "memory");
}

// The ring's stage and parity at position `at` (the CTA's k tiles counted over its tiles): split
// K's pairs each take every other k tile, and the converter follows the ring, so they find their
// stages by position.
template <int kStages>
__device__ __forceinline__ RingPosition ring_at(int at) {
  return RingPosition{at % kStages, static_cast<std::uint32_t>(at / kStages) & 1u};
}

// Split K's end of a tile, after both pairs' k loops: pair 1 (half 1) writes its sums into
// `partial` for pair 0, which adds them (barriers 5 + wg: written; 7 + wg: read, so the next
// tile's may be written). True for pair 0, which then runs the tile's epilogue.
template <int kN, class Accum>
__device__ __forceinline__ bool hand_sums_to_pair_0(float (&partial)[2][kN][kWarpgroup],
                                                    Accum& accum, int half, int wg, int wg_tid) {
  static_assert(decltype(size(accum))::value == kN, "a thread's sums");
  if (half == 1) {
#pragma unroll
    for (int i = 0; i < kN; ++i) partial[wg][i][wg_tid] = accum(i);
    pair_barrier(5 + wg);
    pair_barrier(7 + wg);
    return false;
  }
  pair_barrier(5 + wg);
#pragma unroll
  for (int i = 0; i < kN; ++i) accum(i) += partial[wg][i][wg_tid];
  pair_barrier(7 + wg);
  return true;
}

// An activating FC1's epilogue, per math warpgroup (PackedFc1Epilogue; weight_row's layout): each
// thread's outputs from its gate sums (tile row r, r % 16 < 8) and up sums (row r + 8), biased and
// activated as the activate kernel does; then FC2's input quantization point, MXFP8 per token over
// the warpgroup's 32 outputs, as the wire codec encodes and decodes a block (the block's amax from
// the |h| bits: over the 8 lanes of a warp that share a column, then the 4 warps through `amax`);
// stored as bf16 codes. The accumulator fragment of WGMMA m64nNk16 is ((2, 2, N / 8), 1, 1):
// index c + 2 h + 4 j is column 8 j + 2 (lane % 4) + c of the thread's row + 8 h, so the up sum of
// gate index i is i + 2. Each h overwrites its gate sum (no registers beside the accumulators).
// The sums are the values: an MX layer's rows have scale 1 and its weights no divisor or
// multiplier (the activate kernel's `unscaled` leaves them as they are).
// Both math warpgroups run it at once, with the tensor cores idle, so it is written for
// instruction-level parallelism over its columns: no branch per element (the activation chosen by
// the caller, each bias loaded once, E4M3 by the hardware's conversions, which the wire codec
// matches bit for bit), and columns of token rows past M_e skipped 16 at a time (decode fills few).
// kCodesOut (the E4M3 tile's FC1 of mxfp8 and mxfp4, t16_e4m3): h stored as MXFP8, its E4M3 codes
// and each token's block scale value, for FC2's E4M3 GEMM.
template <int kTokens, bool kCodesOut, class Activate, class Accum, class Coord>
__device__ __forceinline__ void activate_and_store(const Args& args,
                                                   std::uint32_t (&amax)[kTokens][4], Accum& accum,
                                                   const Coord& coord, const TilePlace& at, int m,
                                                   int wg, Activate activate) {
  using namespace formats;
  static_assert(decltype(size(accum))::value == kTokens / 2, "one m64 WGMMA per warpgroup");
  const int inter = args.n / 2;
  const int wg_tid = static_cast<int>(threadIdx.x) % kWarpgroup;
  const int warp = wg_tid / 32, lane = wg_tid % 32;
  const int out = at.n0 / 2 + get<0>(coord(0)) / 16 * 8 + get<0>(coord(0)) % 8;  // one per thread
  const int rows = m - at.m0;  // the tile's token rows that exist (columns 0 .. rows - 1)
  const float* b13 = args.arrays.b13[at.g];
  const float gate_bias = b13 == nullptr ? 0.0f : b13[out];
  const float up_bias = b13 == nullptr ? 0.0f : b13[inter + out];
  // j: 8 columns (2 per thread); a branch per 16 columns (2 j) leaves 4 columns' chains to overlap
#pragma unroll
  for (int j = 0; j < kTokens / 8; ++j) {
    if (j % 2 == 0 && 8 * j >= rows) break;  // uniform over the warpgroup
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int i = c + 4 * j, col = get<1>(coord(i));
      // math::biased with each bias loaded once (through the pointer, it was reloaded per element)
      accum(i) = activate(math::biased(accum(i), b13 != nullptr, gate_bias),
                          math::biased(accum(i + 2), b13 != nullptr, up_bias));
      std::uint32_t bits = float_bits(accum(i)) & kF32AbsMask;
#pragma unroll
      for (int offset = 4; offset < 32; offset *= 2)
        bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, offset));
      if (lane < 4) amax[col][warp] = bits;  // lanes 0-3 hold every column of the warp
    }
  }
  warpgroup_barrier(1 + wg);  // every warp's partials
  // Each column's block scale, once per column rather than by each of the 32 threads holding one
  // of its outputs: thread t takes columns t, t + 128, ... and leaves the scale's inverse and value
  // (fp32 bits) in the column's first two partials, which only it reads in between.
  const ScaleRounding rounding = args.epilogue.rounding;
#pragma unroll
  for (int col = wg_tid; col < kTokens; col += kWarpgroup) {
    const uint4 part = *reinterpret_cast<const uint4*>(amax[col]);
    const std::uint8_t code =
        mxfp8_scale_code(bits_float(max(max(part.x, part.y), max(part.z, part.w))), rounding);
    *reinterpret_cast<uint2*>(amax[col]) =
        make_uint2(float_bits(mxfp8_inverse_scale(code)), float_bits(e8m0_to_float(code)));
    if constexpr (kCodesOut) {
      // the block's scale value: the warpgroup's 32 outputs are block n0 / 64 + wg of the row
      if (col < rows)
        args.arrays.h8_scale[at.g][static_cast<std::int64_t>(at.m0 + col) * (inter / 32) +
                                   at.n0 / 64 + wg] = e8m0_to_float(code);
    }
  }
  warpgroup_barrier(1 + wg);
  const int first = get<1>(coord(0));  // the thread's first column: 2 (lane % 4)
  const std::int64_t h_at = static_cast<std::int64_t>(at.m0 + first) * inter + out;
  std::uint16_t* h16 = kCodesOut ? nullptr : args.arrays.h[at.g] + h_at;
  std::uint8_t* h8 = kCodesOut ? args.arrays.h8[at.g] + h_at : nullptr;
#pragma unroll
  for (int j = 0; j < kTokens / 8; ++j) {
    if (j % 2 == 0 && 8 * j >= rows) break;
    const int col = first + 8 * j;  // and col + 1: accumulators 4 j and 4 j + 1
    const uint2 scales[2] = {*reinterpret_cast<const uint2*>(amax[col]),
                             *reinterpret_cast<const uint2*>(amax[col + 1])};
    // e4m3(h / scale) (cvt.rn.satfinite, as float_to_e4m3), and back exactly (cvt to f16)
    const __nv_fp8x2_storage_t q =
        __nv_cvt_float2_to_fp8x2(make_float2(accum(4 * j) * bits_float(scales[0].x),
                                             accum(4 * j + 1) * bits_float(scales[1].x)),
                                 __NV_SATFINITE, __NV_E4M3);
    if constexpr (kCodesOut) {  // the codes; their value is the code times the block's scale
#pragma unroll
      for (int c = 0; c < 2; ++c)
        if (col + c < rows)
          h8[c * static_cast<std::int64_t>(inter)] = static_cast<std::uint8_t>(q >> (8 * c));
      h8 += static_cast<std::int64_t>(8) * inter;
      continue;
    }
    const float2 e4m3 = e4m3x2_to_float2(q);
    const float value[2] = {e4m3.x, e4m3.y};
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      // mxfp8_decode_value: a NaN-scale block (every element NaN) gives the quiet NaN; no other
      // element is NaN (a NaN or Inf element makes the block amax's scale NaN)
      const float scale = bits_float(scales[c].y);
      const float h = scale != scale ? quiet_nan() : value[c] * scale;
      if (col + c < rows) h16[c * static_cast<std::int64_t>(inter)] = float_to_bf16(h);
    }
    h16 += static_cast<std::int64_t>(8) * inter;
  }
}

// Where a math warpgroup thread's sums of a tile go (store_sums, store_rows, send_sums_home): its
// two output columns, col and col + 8 (h = 0, 1), which of them exist, its first token row of the
// tile (2 (lane % 4)), and how many of the tile's token rows exist.
struct ThreadOutputs {
  int col, token;
  bool stores[2];
  int rows;
};
template <class Coord>
__device__ __forceinline__ ThreadOutputs thread_outputs(const Coord& coord, const TilePlace& at,
                                                        int m, int n) {
  const int col = at.n0 + get<0>(coord(0));
  return ThreadOutputs{col, get<1>(coord(0)), {col < n, col + 8 < n}, m - at.m0};
}

// Walks a thread's token rows of a tile with one pointer stepped down them (8 rows per j) from D's
// element (its first row, col): row(pointer, row, index) for each of the tile's rows the thread
// holds, `index` its sums' fragment index at h = 0 (+ 2 for h = 1); both columns are stored from
// that pointer. An address computed per element made this ~1 500 instructions per tile at 256
// token rows.
template <int kTokens, class T, class Row>
__device__ __forceinline__ void for_each_token_row(T* d, const ThreadOutputs& o,
                                                   const TilePlace& at, int n, Row row) {
  T* row_ptr = d + static_cast<std::int64_t>(at.m0 + o.token) * n + o.col;
  const std::int64_t step = static_cast<std::int64_t>(8) * n;
#pragma unroll
  for (int j = 0; j < kTokens / 8; ++j) {
    if (8 * j >= o.rows) break;
#pragma unroll
    for (int c = 0; c < 2; ++c)
      row(row_ptr + c * static_cast<std::int64_t>(n), o.token + 8 * j + c, c + 4 * j);
    row_ptr += step;
  }
}

// A plain GEMM's epilogue, per math warpgroup: D[m0 + token, n0 + weight row] from the
// accumulators (index c + 2 h + 4 j: token 8 j + 2 (lane % 4) + c, the thread's weight row + 8 h,
// as activate_and_store reads them), rows past M_e and columns past N left alone; the columns of
// rows past M_e are skipped 8 at a time (uniform over the warpgroup).
template <int kTokens, class Accum, class Coord>
__device__ __forceinline__ void store_sums(float* d, const Accum& accum, const Coord& coord,
                                           const TilePlace& at, int m, int n) {
  static_assert(decltype(size(accum))::value == kTokens / 2, "one m64 WGMMA per warpgroup");
  const ThreadOutputs o = thread_outputs(coord, at, m, n);
  for_each_token_row<kTokens>(d, o, at, n, [&](float* out, int row, int index) {
    const bool row_exists = row < o.rows;
#pragma unroll
    for (int h = 0; h < 2; ++h)  // predicated stores, no branch
      if (row_exists & o.stores[h]) out[8 * h] = accum(index + 2 * h);
  });
}

// D as FC2's bf16 rows (GemmOutput::bf16_rows), per math warpgroup: as store_sums walks the
// accumulators, each result unscaled (its row's scale, the expert's weight factors) plus its b2,
// rounded to bf16: the value the home kernel would send from D (send_rows_home), which then only
// copies the rows.
template <int kTokens, class Accum, class Coord>
__device__ __forceinline__ void store_rows(const Args& args, const Accum& accum, const Coord& coord,
                                           const TilePlace& at, int m) {
  static_assert(decltype(size(accum))::value == kTokens / 2, "one m64 WGMMA per warpgroup");
  const int n = args.n;
  const ThreadOutputs o = thread_outputs(coord, at, m, n);
  const WeightFactors w = weight_factors(args.w, at.g);
  const float* b2 = args.arrays.bias[at.g];
  const float* row_scale = args.arrays.row_scale[at.g];
  float bias[2] = {0.0f, 0.0f};
#pragma unroll
  for (int h = 0; h < 2; ++h)
    if (b2 != nullptr && o.stores[h]) bias[h] = b2[o.col + 8 * h];
  for_each_token_row<kTokens>(
      args.arrays.d16[at.g], o, at, n, [&](std::uint16_t* out, int row, int index) {
        if (row >= o.rows) return;
        const float scale = row_scale != nullptr ? row_scale[at.m0 + row] : 1.0f;
#pragma unroll
        for (int h = 0; h < 2; ++h)
          if (o.stores[h])
            out[8 * h] = formats::float_to_bf16(
                math::biased(unscaled(accum(index + 2 * h), scale, w), b2 != nullptr, bias[h]));
      });
}

// FC2's epilogue that sends the results home (PackedFc2Home), per math warpgroup: as store_sums
// walks the accumulators, each result plus its b2 to its token row's home slot (`homes`, the
// tile's token rows'), as the home kernel sends it after D (the same fp32 sum and bias, so the same
// bits: an MX layer's sums are the values). The 8 lanes that share a token row store 8 consecutive
// outputs of it.
template <int kTokens, class Accum, class Coord>
__device__ __forceinline__ void send_sums_home(const PackedFc2Home& home,
                                               const protocol::HomeSlot* homes, const Accum& accum,
                                               const Coord& coord, const TilePlace& at, int m,
                                               int n) {
  static_assert(decltype(size(accum))::value == kTokens / 2, "one m64 WGMMA per warpgroup");
  const auto [col, token, stores, rows] = thread_outputs(coord, at, m, n);
  const bool has_bias = home.b2 != nullptr;
  float bias[2] = {0.0f, 0.0f};
#pragma unroll
  for (int h = 0; h < 2; ++h)
    if (has_bias && stores[h]) bias[h] = home.b2[static_cast<std::int64_t>(at.g) * n + col + 8 * h];
#pragma unroll
  for (int j = 0; j < kTokens / 8; ++j) {
    if (8 * j >= rows) break;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      if (token + 8 * j + c >= rows) continue;
      const protocol::HomeSlot slot = homes[token + 8 * j + c];
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (stores[h])
          send_home(home.step.home, slot, col + 8 * h,
                    math::biased(accum(c + 2 * h + 4 * j), has_bias, bias[h]));
    }
  }
}

// A tile's epilogue, per math warpgroup: an activating FC1's (activate_and_store, with the layer's
// activation chosen once), or D's (store_rows or store_sums, by args.output). Only the 16-row
// decoding tile compiles store_rows: the E4M3 tile (kCodesOut) stores sums (its few rows make D's
// bytes negligible, and store_rows' registers made the persistent E4M3 round spill), and so do the
// 64- to 256-row tiles, whose bf16 rows measured slower at T = 8192 (bench/RESULTS.md, session 32;
// the constructor refuses bf16_rows for them).
template <int kTokens, bool kActivates, bool kCodesOut, class Amax, class Accum, class Coord>
__device__ __forceinline__ void finish_tile(const Args& args, Amax& amax, Accum& accum,
                                            const Coord& coord, const TilePlace& at, int m,
                                            int wg) {
  if constexpr (kActivates) {
    const PackedFc1Epilogue& e = args.epilogue;
    if (e.activation == Activation::swiglu_oai)
      activate_and_store<kTokens, kCodesOut>(
          args, amax, accum, coord, at, m, wg,
          [&](float gate, float up) { return math::swiglu_oai(gate, up, e.swiglu_limit); });
    else
      activate_and_store<kTokens, kCodesOut>(
          args, amax, accum, coord, at, m, wg,
          [&](float gate, float up) { return math::swiglu(gate, up, e.swiglu_limit); });
  } else {
    if constexpr (kTokens == 16 && !kCodesOut)
      if (args.output == GemmOutput::bf16_rows) {  // (uniform over the launch)
        store_rows<kTokens>(args, accum, coord, at, m);
        return;
      }
    store_sums<kTokens>(args.arrays.d[at.g], accum, coord, at, m, args.n);
  }
}

// The kernel's shared memory S, 1024-byte aligned (the swizzles' period) by an offset from
// smem_raw, not through an integer cast: the compiler then still knows it is shared memory and
// emits LDS / STS, where a cast made every decode access a generic 64-bit LD / ST.
template <class S>
__device__ __forceinline__ S& aligned_smem() {
  extern __shared__ std::uint8_t smem_raw[];
  const std::uint32_t misaligned =
      static_cast<std::uint32_t>(__cvta_generic_to_shared(smem_raw)) & 1023u;
  return *reinterpret_cast<S*>(smem_raw + ((1024u - misaligned) & 1023u));
}

// The aligned 4-byte word holding the block scale codes at `scale_at` (a k tile's are in one word;
// the math warpgroups shift by scale_at's offset in it) into shared memory `word`.
__device__ __forceinline__ void copy_scale_word(std::uint32_t* word, const std::uint8_t* scale_at) {
  cp_async_4(word, reinterpret_cast<const void*>(reinterpret_cast<std::uintptr_t>(scale_at) &
                                                 ~std::uintptr_t{3}));
}

// What every role of a packed GEMM kernel knows once it has started (start_gemm).
struct GemmStart {
  int tid, n, k, groups;
  int weight_blocks;  // per group: N / 128 rounded up
  int tiles;          // of every group
};

// The groups' tile prefix (s.tile_end), from each group's M in device memory, by the whole CTA
// (kThreads: kGemmThreads, or the E4M3 kernel's e4m3::kThreads<kW>), made visible to every role
// with the ring's barriers initialized before it.
template <int kTokens, int kThreads, class S>
__device__ __forceinline__ GemmStart tile_prefix(S& s, const Args& args) {
  constexpr int kGroupsPerThread = (kMaxGroups + kThreads - 1) / kThreads;
  const int weight_blocks = (args.n + kRows - 1) / kRows;
  constexpr int tokens = kTokens;
  const int tid = static_cast<int>(threadIdx.x);
  const int groups = args.groups;
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan;
  int tiles[kGroupsPerThread];
#pragma unroll
  for (int i = 0; i < kGroupsPerThread; ++i) {
    const int g = kGroupsPerThread * tid + i;
    tiles[i] = g < groups ? weight_blocks * ((args.arrays.problems[g].m + tokens - 1) / tokens) : 0;
  }
  Scan(scan).InclusiveSum(tiles, tiles);
#pragma unroll
  for (int i = 0; i < kGroupsPerThread; ++i)
    if (kGroupsPerThread * tid + i < groups) s.tile_end[kGroupsPerThread * tid + i] = tiles[i];
  __syncthreads();  // the tile prefix and the barriers' initialization, for every role
  return GemmStart{tid, args.n, args.k, groups, weight_blocks, s.tile_end[groups - 1]};
}

// Every role's start of the bf16-decoding kernel: the ring's barriers initialized (`full`: a noinc
// arrival per producer thread; `empty`: one per math warpgroup), the previous kernel waited for
// (plan wrote the problems and pointers), and the tile prefix.
template <int kStages, int kTokens, int kThreads = kGemmThreads, class S>
__device__ __forceinline__ GemmStart start_gemm(S& s, const Args& args) {
  using Barrier = cutlass::arch::ClusterBarrier;
  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      Barrier::init(&s.full[i], kProducerThreads);
      Barrier::init(&s.empty[i], 2);  // one arrival per math warpgroup that reads the stage
    }
    cutlass::arch::fence_barrier_init();
  }
  wait_for_previous_kernel();
  return tile_prefix<kTokens, kThreads>(s, args);
}

// ---- the E4M3 tile of mxfp8, mxfp4 and fp8_block128 (t16_e4m3): E4M3 weights (mxfp4's
// converted from E2M1) times 16 MXFP8 token rows (fp8_block128: FP8 rows with an fp32 scale per
// 128), nothing decoded to bf16
//
// The same tiles and ring as packed_gemm_kernel, twice its math warpgroups; both operands are E4M3
// codes in shared memory (WGMMA SS; a 64-byte swizzle: a k tile is 64 codes) and the tensor cores
// multiply the codes: each k tile is two k32 WGMMAs, one MX block of both operands each, whose sums
// the math warpgroups add to fp32 sums times the weight row's block scale times the token's
// (promotion, as DeepGEMM's FP8 GEMMs do per 128). MX's block scales are powers of two, so that
// product is the exact product of the decoded values' sums but for WGMMA's FP8 accumulation within
// a block; fp8_block128's fp32 scales add one rounding of their product and one of the sum's.
//   producer  warpgroup 0: each k tile's 128 weight rows of codes by TMA (one thread issues it and
//             the `full` barrier counts its bytes; load_weight_codes), the tokens' rows of codes
//             (16-byte cp.async into the swizzled layout WGMMA reads), the 4-byte word holding
//             each weight row's block scale codes, each token row's two block scale values (8
//             bytes; fp8_block128: the tile's one fp32 weight scale of the k tile, by thread 0,
//             and each token row's one, 4 bytes); `full` completes when the TMA bytes and every
//             thread's copies have landed (mxfp4: the TMA load's E2M1 codes land in
//             Smem::e2m1, counted by `landed`)
//   converter mxfp4 only, the warpgroup after the producer: per landed k tile, each thread one
//             weight row's 64 E2M1 codes to the E4M3 codes of the same values (byte permutes,
//             e2m1x8_to_e4m3) into the stage's swizzled layout, then its arrival on `full`
//   math      the next four warpgroups, pair `half` and warpgroup wg of it: rows 64 wg .. + 63 over
//             the k tiles kt with kt % 2 == half (split K: two pairs of warpgroups at once); per
//             k tile both k32 blocks' WGMMAs into their own block sums (fp8_block128: into one),
//             waited for, then sums += block sums x weight scale x token scale (only the
//             8-column groups of token rows that exist); a stage goes back once the pair's next k
//             tile's WGMMAs have retired (every warp of the warpgroup issued them, so each is past
//             its promotion of the stage's scales); at the tile's end pair 1 hands its sums to pair
//             0 through shared memory, and pair 0 runs the same epilogues, an activating FC1
//             storing h as MXFP8 codes and scale values
namespace e4m3 {

constexpr int kBlockK = formats::kMxfp8Block;                      // an MX block: one k32 WGMMA
constexpr int kBlocks = kTileK / kBlockK;                          // per k tile
constexpr int kTilesPerBlock128 = formats::kFp8Block128 / kTileK;  // fp8_block128's 1 x 128
// Two pairs of math warpgroups split each tile's k tiles (even, odd), so four of them keep an SM's
// tensor cores and promotions busy (one pair at a time left them mostly waiting; bench/RESULTS.md,
// session 26); pair 1 hands its sums to pair 0 through shared memory for the epilogue.
constexpr int kSplitK = 2;
constexpr int kMathGroups = 2 * kSplitK;
// The weights' precision kW: mxfp8 (E4M3 codes, an E8M0 scale per 32 along K), mxfp4 (E2M1
// codes, the same scales: kE2m1) or fp8_block128 (E4M3 codes, an fp32 scale per 128 x 128 tile:
// kBlock128, whose token rows are FP8 with an fp32 scale per 128 along K, the wire's rows).
template <Precision kW>
inline constexpr bool kE2m1 = kW == Precision::mxfp4;
template <Precision kW>
inline constexpr bool kBlock128 = kW == Precision::fp8_block128;
// MXFP4 weights add a converter warpgroup after the producer: E2M1 codes to E4M3 codes.
template <Precision kW>
inline constexpr int kConverterThreads = kE2m1<kW> ? kWarpgroup : 0;
template <Precision kW>
inline constexpr int kThreads = kProducerThreads + kConverterThreads<kW> + kMathGroups* kWarpgroup;
using Code = cutlass::float_e4m3_t;
using Atom = GMMA::Layout_K_SW64_Atom<Code>;  // 8 rows x 64 codes, 64-byte swizzle

template <int kTokens, Precision kW>
struct Tile {
  static_assert(kTokens == 16, "t16_e4m3: 16 token rows");
  // ~165 KB at 16 token rows (20 measured 0-3 % slower); MXFP4's 4 KB of E2M1 codes more per
  // stage: 12 (~181 KB)
  static constexpr int kStages = kE2m1<kW> ? 12 : 16;
  using Op =
      decltype(SM90::GMMA::ss_op_selector<Code, Code, float, Shape<_64, Int<kTokens>, Int<kBlockK>>,
                                          GMMA::Major::K, GMMA::Major::K>());
  using TiledMma = decltype(make_tiled_mma(Op{}, Layout<Shape<_2, _1, _1>>{}));
  using LayoutW = decltype(tile_to_shape(Atom{}, Shape<Int<kRows>, Int<kTileK>, Int<kStages>>{}));
  using LayoutX = decltype(tile_to_shape(Atom{}, Shape<Int<kTokens>, Int<kTileK>, Int<kStages>>{}));
};

template <int kTokens, bool kActivates, Precision kW, bool kSendsHome>
struct Smem {
  static constexpr int kStages = Tile<kTokens, kW>::kStages;
  alignas(1024) std::uint8_t w[kStages][kRows * kTileK];  // weight codes (LayoutW)
  // MXFP4: the k tile's E2M1 codes as TMA lands them, [128 rows][32 bytes], and their barriers
  alignas(128) std::uint8_t e2m1[kE2m1<kW> ? kStages : 1][kE2m1<kW> ? kRows * kTileK / 2 : 16];
  alignas(8) std::uint64_t landed[kE2m1<kW> ? kStages : 1];
  alignas(1024) std::uint8_t x[kStages][kTokens * kTileK];  // token codes (LayoutX)
  // token row, block: the scale's value (fp8_block128: the k tile's one at [row][0])
  alignas(16) float x_scales[kStages][kTokens][kBlocks];
  // each weight row's word of scale codes (fp8_block128: the tile's fp32 scale at [0])
  std::uint32_t scale_words[kStages][kRows];
  alignas(8) std::uint64_t full[kStages];
  alignas(8) std::uint64_t empty[kStages];
  int tile_end[kMaxGroups];
  alignas(16) std::uint32_t amax[kActivates ? 2 : 1][kActivates ? kTokens : 1][4];
  float partial[2][kTokens / 2][kWarpgroup];  // pair 1's sums: weight rows 64 wg.., index, thread
  // FC2 sending home: the tile's token rows' home slots, [tile parity][math warpgroup][token row]
  protocol::HomeSlot homes[kSendsHome ? 2 : 1][2][kSendsHome ? kTokens : 1];
};

// The weights' codes as TMA sees them (weight_codes_map): [groups, N, K] bytes as {K, N, groups},
// 64-byte swizzled as LayoutW; a k tile of a tile's 128 weight rows is one load {64 codes, 128
// rows}, rows past N zeros (never stored). MXFP4's (kE2m1) are [groups, N, K / 2] bytes, a k tile
// {32 bytes, 128 rows} unswizzled into Smem::e2m1, and `k0` counts bytes. An activating FC1's tile
// rows interleave gate and up rows by 8 (weight_row), so its tensor is 5-D {K, 8 rows, gate | up,
// N / 16 row groups, groups} with byte strides {K, I K, 8 K, N K} and a load {64, 8, 2, 8, 1}:
// TMA fills the box's dimensions in order, so tile row t is row t % 8 of row group 8 block +
// t / 16, gate or up by t / 8 % 2, as weight_row (16 loads of 8 rows each measured 14-16 % slower
// at T = 16-128: bench/RESULTS.md, session 25).
template <bool kActivates>
__device__ __forceinline__ void load_weight_codes(const CUtensorMap* map, std::uint64_t* full,
                                                  void* stage, int k0, const TilePlace& at) {
  constexpr auto kHint = static_cast<std::uint64_t>(cute::TMA::CacheHintSm90::EVICT_FIRST);
  if constexpr (kActivates)
    cute::SM90_TMA_LOAD_5D::copy(map, full, kHint, stage, k0, 0, 0, at.n0 / kRows * 8, at.g);
  else
    cute::SM90_TMA_LOAD_3D::copy(map, full, kHint, stage, k0, at.n0, at.g);
}

// The TMA descriptor of load_weight_codes over `codes` ([groups, N, K] E4M3 codes, or with `e2m1`
// [groups, N, K / 2] bytes of two E2M1 codes each).
inline CUtensorMap weight_codes_map(std::uint8_t* codes, int groups, int n, int k, bool activates,
                                    bool e2m1) {
  CUtensorMap map{};
  const auto g = static_cast<cuuint64_t>(groups), rows = static_cast<cuuint64_t>(n),
             cols = static_cast<cuuint64_t>(e2m1 ? k / 2 : k);  // bytes
  const cuuint32_t box_cols = e2m1 ? kTileK / 2 : kTileK;
  const cuuint64_t plain_dims[3] = {cols, rows, g};
  const cuuint64_t plain_strides[2] = {cols, rows * cols};
  const cuuint32_t plain_box[3] = {box_cols, kRows, 1};
  const cuuint64_t glu_dims[5] = {cols, 8, 2, rows / 16, g};
  const cuuint64_t glu_strides[4] = {cols, rows / 2 * cols, 8 * cols, rows * cols};
  const cuuint32_t glu_box[5] = {box_cols, 8, 2, kRows / 16, 1};
  const cuuint32_t element_strides[5] = {1, 1, 1, 1, 1};
  const CUresult result = CUTLASS_CUDA_DRIVER_WRAPPER_CALL(cuTensorMapEncodeTiled)(
      &map, CU_TENSOR_MAP_DATA_TYPE_UINT8, activates ? 5 : 3, codes,
      activates ? glu_dims : plain_dims, activates ? glu_strides : plain_strides,
      activates ? glu_box : plain_box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      e2m1 ? CU_TENSOR_MAP_SWIZZLE_NONE : CU_TENSOR_MAP_SWIZZLE_64B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS)
    throw Error(ErrorCode::internal,
                "packed grouped GEMM: cuTensorMapEncodeTiled of the weight "
                "codes failed (CUresult " +
                    std::to_string(static_cast<int>(result)) + ")");
  return map;
}

}  // namespace e4m3

namespace e4m3 {

// The E4M3 tile's roles, one device function each (the kernel's branches: gemm below). Each gets
// the GEMM's start (tile_prefix) and the ring's position at its first k tile (`ring_start`: the
// CTA's k tiles through the ring before this GEMM), and leaves the ring after its last.

// ---- producer: every tile's k tiles into the ring, kStages ahead of the math warpgroups
template <int kTokens, bool kActivates, Precision kW, class S>
__device__ __forceinline__ void produce(const Args& args, const CUtensorMap* weight_codes, S& s,
                                        const GemmStart& g, int ring_start) {
  using T = Tile<kTokens, kW>;
  using Barrier = cutlass::arch::ClusterBarrier;
  constexpr int kStages = T::kStages;
  const auto [tid, n, k, groups, weight_blocks, tiles] = g;
  RingPosition ring = ring_at<kStages>(ring_start);
  const std::int64_t scale_row_bytes = k / kBlockK;  // MX weights: one E8M0 per block
  // the tokens' scales per row: one per MX block, or per 128 (fp8_block128)
  const std::int64_t token_scales = k / (kBlock128<kW> ? formats::kFp8Block128 : kBlockK);
  const int k_tiles = k / kTileK;
  constexpr int kChunksPerRow = kTileK / 16;  // a byte per code
  constexpr int kRowStep = kProducerThreads / kChunksPerRow;
  // 16-byte copies per thread of the token rows (16 rows: threads 0-63 copy one each)
  constexpr int kTokenChunks = (kTokens + kRowStep - 1) / kRowStep;
  const typename T::LayoutX layout_x{};
  const int unit = 16 * (tid % kChunksPerRow);  // this thread's 16 bytes of each row it copies
  for (int tile = static_cast<int>(blockIdx.x); tile < tiles; tile += static_cast<int>(gridDim.x)) {
    const TilePlace at = place_of(s.tile_end, groups, weight_blocks, kTokens, tile);
    const int rows = min(args.arrays.problems[at.g].m - at.m0, kTokens);
    // Each thread's sources at k tile 0 and places in stage 0, once per tile. Past N a weight
    // row's scales are row N - 1's (its codes TMA's zeros), never stored; token rows past the
    // tile's are not loaded.
    // (fp8_block128: the tile's scales along K, at [group][n0 / 128][0]; kActivates is not)
    const std::uint8_t* scale_src =
        kBlock128<kW> ? reinterpret_cast<const std::uint8_t*>(
                            reinterpret_cast<const float*>(args.w.scales) +
                            formats::fp8_block128_tile(n, k, at.g, at.n0 * std::int64_t{k}))
                      : matrix_row(args.w.scales, scale_row_bytes, at.g, n,
                                   weight_row<kActivates>(tid, at.n0 / kRows, n));
    const std::uint8_t* token_src =
        args.arrays.a8[at.g] + static_cast<std::int64_t>(at.m0 + tid / kChunksPerRow) * k + unit;
    int token_dst[kTokenChunks];
#pragma unroll
    for (int i = 0; i < kTokenChunks; ++i)
      token_dst[i] = layout_x(tid / kChunksPerRow + i * kRowStep, unit, 0);
    const int token_chunks =
        min(kTokenChunks, (rows - tid / kChunksPerRow + kRowStep - 1) / kRowStep);
    const float* token_scale_src =
        args.arrays.a8_scale[at.g] + static_cast<std::int64_t>(at.m0 + tid) * token_scales;
    for (int kt = 0; kt < k_tiles; ++kt) {
      Barrier::wait(&s.empty[ring.stage], ring.phase ^ 1u);  // a fresh barrier: at once
      if (tid == 0) {  // the weight codes: one TMA load, counted in bytes by `full` / `landed`
        using TxBarrier = cutlass::arch::ClusterTransactionBarrier;
        if constexpr (kE2m1<kW>) {
          TxBarrier::arrive_and_expect_tx(&s.landed[ring.stage], kRows * kTileK / 2);
          load_weight_codes<kActivates>(weight_codes, &s.landed[ring.stage], &s.e2m1[ring.stage][0],
                                        kt * kTileK / 2, at);
        } else {
          TxBarrier::arrive_and_expect_tx(&s.full[ring.stage], kRows * kTileK);
          load_weight_codes<kActivates>(weight_codes, &s.full[ring.stage], &s.w[ring.stage][0],
                                        kt * kTileK, at);
        }
      }
#pragma unroll
      for (int i = 0; i < kTokenChunks; ++i)
        if (i < token_chunks)
          cp_async_16(&s.x[ring.stage][token_dst[i]],
                      token_src + static_cast<std::int64_t>(i) * kRowStep * k + kt * kTileK);
      if constexpr (kBlock128<kW>) {
        // the k tile's 128-block: the tile's one weight scale (thread 0) and each token row's
        const int block = kt / kTilesPerBlock128;
        if (tid == 0)
          cp_async_4(&s.scale_words[ring.stage][0],
                     reinterpret_cast<const float*>(scale_src) + block);
        if (tid < rows) cp_async_4(&s.x_scales[ring.stage][tid][0], token_scale_src + block);
      } else {
        copy_scale_word(&s.scale_words[ring.stage][tid], scale_src + kt * kBlocks);
        if (tid < rows) cp_async_8(&s.x_scales[ring.stage][tid][0], token_scale_src + kt * kBlocks);
      }
      cutlass::arch::cpasync_barrier_arrive_noinc(&s.full[ring.stage]);
      ring.advance<kStages>();
    }
  }
  cp_async_wait<0>();
}

// ---- converter (mxfp4): each landed k tile's E2M1 codes of weight row `row` (32 bytes) to E4M3
// codes in the stage's LayoutW (4 chunks of 16), then the stage's `full` (after a proxy fence:
// WGMMA reads shared memory through the async proxy)
template <int kTokens, Precision kW, class S>
__device__ __forceinline__ void convert(S& s, const GemmStart& g, int ring_start) {
  using T = Tile<kTokens, kW>;
  using Barrier = cutlass::arch::ClusterBarrier;
  constexpr int kStages = T::kStages;
  const int tid = g.tid, tiles = g.tiles;
  const int k_tiles = g.k / kTileK;
  const int row = tid - kProducerThreads;
  const typename T::LayoutW layout_w{};
  int chunk_at[4];  // the row's 16-byte chunks in stage 0 (a stage is kRows x kTileK bytes)
#pragma unroll
  for (int c = 0; c < 4; ++c) chunk_at[c] = layout_w(row, 16 * c, 0);
  int position = ring_start;  // the CTA's k tiles through the ring so far
  for (int tile = static_cast<int>(blockIdx.x); tile < tiles; tile += static_cast<int>(gridDim.x)) {
    for (int kt = 0; kt < k_tiles; ++kt, ++position) {
      const RingPosition r = ring_at<kStages>(position);
      const int stage = r.stage;
      Barrier::wait(&s.landed[stage], r.phase);
      const uint4* codes = reinterpret_cast<const uint4*>(&s.e2m1[stage][row * kTileK / 2]);
      const uint4 lo = codes[0], hi = codes[1];
      const std::uint32_t words[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
      for (int c = 0; c < 4; ++c) {  // codes 16 c .. 16 c + 15: words 2 c and 2 c + 1
        std::uint32_t first[2], second[2];
        e2m1x8_to_e4m3(words[2 * c], first);
        e2m1x8_to_e4m3(words[2 * c + 1], second);
        *reinterpret_cast<uint4*>(&s.w[stage][chunk_at[c]]) =
            make_uint4(first[0], first[1], second[0], second[1]);
      }
      cutlass::arch::fence_view_async_shared();
      Barrier::arrive(&s.full[stage]);
    }
  }
}

// ---- math: warpgroup 1 + 2 half + wg (after the converter, if any) multiplies weight rows
// 64 wg .. 64 wg + 63 of each tile, over k tiles kt with kt % 2 == half; pair 0 runs the epilogue
template <int kTokens, bool kActivates, Precision kW, bool kSendsHome, class S>
__device__ __forceinline__ void multiply(const Args& args, S& s, const GemmStart& g,
                                         int ring_start) {
  using T = Tile<kTokens, kW>;
  using Barrier = cutlass::arch::ClusterBarrier;
  constexpr int kStages = T::kStages;
  const auto [tid, n, k, groups, weight_blocks, tiles] = g;
  const std::int64_t scale_row_bytes = k / kBlockK;  // weights: one E8M0 per block
  const int k_tiles = k / kTileK;
  const int math_tid = tid - kProducerThreads - kConverterThreads<kW>,
            math_wg = math_tid / kWarpgroup;
  const int wg = math_wg % 2, half = math_wg / 2;
  const int wg_tid = math_tid % kWarpgroup;
  const bool signals = wg_tid == 0;  // the warpgroup's arrival on `empty`
  typename T::TiledMma mma;
  const auto thr = mma.get_thread_slice(math_tid % (2 * kWarpgroup));
  Tensor sW =
      make_tensor(make_smem_ptr(reinterpret_cast<Code*>(&s.w[0][0])), typename T::LayoutW{});
  Tensor sX =
      make_tensor(make_smem_ptr(reinterpret_cast<Code*>(&s.x[0][0])), typename T::LayoutX{});
  Tensor tCrW = thr.make_fragment_A(thr.partition_A(sW));  // (MMA, MMA_M, MMA_K, stage)
  Tensor tCrX = thr.make_fragment_B(thr.partition_B(sX));  // (MMA, MMA_N, MMA_K, stage)
  Tensor accum = partition_fragment_C(mma, Shape<Int<kRows>, Int<kTokens>>{});
  Tensor sums = partition_fragment_C(mma, Shape<Int<kRows>, Int<kTokens>>{});   // block 0's
  Tensor sums1 = partition_fragment_C(mma, Shape<Int<kRows>, Int<kTokens>>{});  // block 1's
  Tensor coord = thr.partition_C(make_identity_tensor(Shape<Int<kRows>, Int<kTokens>>{}));
  static_assert(decltype(size(accum))::value == kTokens / 2, "one m64 WGMMA per warpgroup");
  // The thread's weight rows (row0, row0 + 8) and first token column (index c + 2 h + 4 j of the
  // sums is column col0 + 8 j + c of row row0 + 8 h, as activate_and_store reads them).
  const int row0 = get<0>(coord(0)), col0 = get<1>(coord(0));
  const auto release = [&](int stage) {
    if (signals) Barrier::arrive(&s.empty[stage]);
  };

  int k_tiles_before = ring_start;  // the ring's position at the tile's first k tile
  for (int tile = static_cast<int>(blockIdx.x); tile < tiles; tile += static_cast<int>(gridDim.x)) {
    const TilePlace at = place_of(s.tile_end, groups, weight_blocks, kTokens, tile);
    const int m = args.arrays.problems[at.g].m;
    const int rows = m - at.m0;
    // Sending home: pair 0's threads 0 .. 15 of each warpgroup load the home slots of the tile's
    // token rows now and store them after the k loop (the loads' latency behind it), double
    // buffered by the tile's parity (a warpgroup passes pair_barrier(5 + wg) of the next tile only
    // after its epilogue of this one).
    const int parity = (tile - static_cast<int>(blockIdx.x)) / static_cast<int>(gridDim.x) & 1;
    protocol::HomeSlot my_home{};
    if constexpr (kSendsHome)
      if (half == 0 && wg_tid < min(rows, kTokens))
        my_home = args.home.homes[args.home.step.in.pair_offset[at.g] + at.m0 + wg_tid];
    const std::uint8_t* scale_rows[2] = {};  // (MX: where each weight row's scale words start)
    if constexpr (!kBlock128<kW>) {
#pragma unroll
      for (int h = 0; h < 2; ++h)
        scale_rows[h] = matrix_row(args.w.scales, scale_row_bytes, at.g, n,
                                   weight_row<kActivates>(row0 + 8 * h, at.n0 / kRows, n));
    }
#pragma unroll
    for (int i = 0; i < size(accum); ++i) accum(i) = 0.0f;

    // WGMMA of block kb of the k tile in `stage` into `sums` (its own sums: ScaleOut::Zero; or
    // added to them: fp8_block128's second block, whose scales are the first's)
    const auto issue = [&](auto& sums, int stage, int kb, bool adds = false) {
      warpgroup_fence_operand(sums);
      warpgroup_arrive();
      mma.accumulate_ = adds ? GMMA::ScaleOut::One : GMMA::ScaleOut::Zero;
      cute::gemm(mma, tCrW(_, _, kb, stage), tCrX(_, _, kb, stage), sums);
      warpgroup_commit_batch();
    };
    // accum += a retired block's sums x its weight row's scale x its token's scale, over the
    // 8-column groups of token rows that exist (all of them in a full tile, without a test)
    const auto promote = [&](auto& sums, int stage, int kb, int kt) {
      warpgroup_fence_operand(sums);
      float weight_scale[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if constexpr (kBlock128<kW>) {  // the tile's one scale
          weight_scale[h] = formats::bits_float(s.scale_words[stage][0]);
        } else {
          const std::uintptr_t scale_at =
              reinterpret_cast<std::uintptr_t>(scale_rows[h] + kt * kBlocks);
          const std::uint32_t codes =
              s.scale_words[stage][row0 + 8 * h] >> (8 * (scale_at & 3) + 8 * kb);
          weight_scale[h] = formats::e8m0_to_float(static_cast<std::uint8_t>(codes));
        }
      }
      const auto columns = [&](int j) {  // token rows col0 + 8 j and + 1
        const float4 both = *reinterpret_cast<const float4*>(&s.x_scales[stage][col0 + 8 * j][0]);
        const float token_scale[2] = {kb == 0 || kBlock128<kW> ? both.x : both.y,
                                      kb == 0 || kBlock128<kW> ? both.z : both.w};
#pragma unroll
        for (int c = 0; c < 2; ++c)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int i = c + 2 * h + 4 * j;
            accum(i) = fmaf(sums(i), weight_scale[h] * token_scale[c], accum(i));
          }
      };
      if (rows >= kTokens) {
#pragma unroll
        for (int j = 0; j < kTokens / 8; ++j) columns(j);
      } else {
#pragma unroll
        for (int j = 0; j < kTokens / 8; ++j) {
          if (8 * j >= rows) break;  // uniform over the warpgroup
          columns(j);
        }
      }
    };
    // The stage of the CTA's k tile number `position` (counted over its tiles), once it is full.
    const auto full_stage = [&](int position) {
      const RingPosition r = ring_at<kStages>(position);
      Barrier::wait(&s.full[r.stage], r.phase);
      return r.stage;
    };

    // Both k32 blocks of a k tile in flight, each into its own sums, waited for together, then
    // promoted (as DeepGEMM's FP8 kernels wait before promoting; the two math warpgroups overlap
    // each other). At 16 token rows this compiles clean and measured 3-7 % faster than one block
    // at a time (bench/RESULTS.md, session 26); at 64 rows it had made ptxas serialize the WGMMAs
    // (C7514 / C7517, session 23). A k tile's stage goes back once the next k tile's WGMMAs have
    // retired: every warp of the warpgroup issued them, so each is past its reads of the stage's
    // scales. fp8_block128's two blocks share their scales: one sum of both, promoted once (as
    // DeepGEMM promotes per 128, WGMMA's FP8 sums over 64 here).
    static_assert(kBlocks == 2, "a k tile: two k32 blocks, both in flight");
    int previous = -1;  // the stage of this pair's k tile before
    for (int kt = half; kt < k_tiles; kt += kSplitK) {
      const int stage = full_stage(k_tiles_before + kt);
      issue(sums, stage, 0);
      if constexpr (kBlock128<kW>)
        issue(sums, stage, 1, true);
      else
        issue(sums1, stage, 1);
      warpgroup_wait<0>();
      if (previous >= 0) release(previous);
      promote(sums, stage, 0, kt);
      if constexpr (!kBlock128<kW>) promote(sums1, stage, 1, kt);
      previous = stage;
    }
    k_tiles_before += k_tiles;
    // The last k tile's stage: every warp of the warpgroup past its reads of it, then back.
    warpgroup_barrier(1 + math_wg);
    if (previous >= 0) release(previous);
    if constexpr (kSendsHome)
      if (half == 0 && wg_tid < kTokens) s.homes[parity][wg][wg_tid] = my_home;
    // Pair 1's sums to pair 0, which runs the epilogue.
    if (!hand_sums_to_pair_0(s.partial, accum, half, wg, wg_tid)) continue;
    if constexpr (kSendsHome)
      send_sums_home<kTokens>(args.home, s.homes[parity][wg], accum, coord, at, m, n);
    else
      finish_tile<kTokens, kActivates, true>(args, s.amax[wg], accum, coord, at, m, wg);
  }
}

// The ring's barriers, once per kernel (by thread 0; the first GEMM's tile_prefix makes them
// visible to every thread): `full`, a noinc arrival per producer thread and the TMA issuer's
// expect_tx (E4M3 codes) or each converter thread's arrival (E2M1 codes); `empty`, one arrival
// per math warpgroup that reads the stage; mxfp4's `landed`, the TMA issuer's expect_tx.
template <int kTokens, Precision kW, class S>
__device__ __forceinline__ void init_ring(S& s) {
  constexpr int kStages = Tile<kTokens, kW>::kStages;
  constexpr int kFullArrivals = kProducerThreads + (kE2m1<kW> ? kConverterThreads<kW> : 1);
  using Barrier = cutlass::arch::ClusterBarrier;
  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      Barrier::init(&s.full[i], kFullArrivals);
      Barrier::init(&s.empty[i], 2);
      if constexpr (kE2m1<kW>) Barrier::init(&s.landed[i], 1);
    }
    cutlass::arch::fence_barrier_init();
  }
}

// One GEMM of the E4M3 tile by the whole CTA, its ring initialized (init_ring) and the GEMM's
// inputs written (the previous kernel waited for, or a grid barrier passed): the tile prefix, then
// each role's branch. Returns the ring's position after it (the next GEMM's ring_start: a kernel
// may run FC1 and FC2 through one ring without initializing it again). kSendsHome: FC2's results
// go home (PackedFc2Home); the caller then runs finish_expert_step.
template <int kTokens, bool kActivates, Precision kW, bool kSendsHome, class S>
__device__ __forceinline__ int gemm(const Args& args, const CUtensorMap* weight_codes, S& s,
                                    int ring_start) {
  static_assert(!(kActivates && kSendsHome), "FC1 activates, FC2 sends home");
  static_assert(!(kActivates && kBlock128<kW>), "fp8_block128's FC1 leaves h to activate");
  const GemmStart g = tile_prefix<kTokens, kThreads<kW>>(s, args);
  if (g.tid < kProducerThreads)
    produce<kTokens, kActivates, kW>(args, weight_codes, s, g, ring_start);
  else if (g.tid < kProducerThreads + kConverterThreads<kW>)
    convert<kTokens, kW>(s, g, ring_start);
  else
    multiply<kTokens, kActivates, kW, kSendsHome>(args, s, g, ring_start);
  const int cta_tiles =
      g.tiles > static_cast<int>(blockIdx.x)
          ? (g.tiles - 1 - static_cast<int>(blockIdx.x)) / static_cast<int>(gridDim.x) + 1
          : 0;
  return ring_start + cta_tiles * (g.k / kTileK);
}

}  // namespace e4m3

}  // namespace epmoe::cuda::experts::wgmma::packed

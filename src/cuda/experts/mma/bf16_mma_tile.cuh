// The tile GEMM of the tensor-core backend (LayerOptions::expert_math = tensor_core, docs/design.md
// §4.1): the same items as the exact backend's (one expert, a chunk of up to 64 of its rows, a tile
// of 128 weight rows), computed with bf16 mma.sync (m16n8k16) and fp32 accumulation. Both
// operands are bf16 code rows (route's x16, this backend's h16 and weights), exact; the caller
// divides by the row and matrix scales in its epilogue. So the result differs from the reference
// only by fp32 accumulation order and rounding — accumulation-order noise (docs/design.md §6).
//
// Each 64-deep slab is summed by the tensor cores into a fresh fragment and then added into the
// fp32 accumulators with ordinary (round-to-nearest) adds, as DeepGEMM promotes its FP8 sums: a
// long chain of mma accumulations drifts further from the float64 reference (first 2x H200 run,
// qwen3 bf16: 17-35 of 2,048 outputs beyond the tolerance; with promotion, 0.02 % of elements
// and rel_l2 2e-4, at the same speed).
//
// One CTA: 8 warps as 2 (rows) x 4 (columns); a warp owns 32 rows x 32 columns = 2 x 4 mma tiles
// of 16 x 8. K runs in slabs of 64 through a kStages-deep cp.async pipeline; A (rows) and B
// (weight rows, K-contiguous: the "col" operand of mma.row.col) are staged [row][k] with 8
// elements of padding, so each ldmatrix phase hits 32 distinct banks.
//
// Weights are read in their resident format (packed_weights.hpp; the template argument P): bf16
// rows are copied into the B stage as they are; MXFP8, MXFP4 and NVFP4 rows are copied as codes
// (64 or 32 bytes per row per slab), and each slab's codes are decoded once, exactly, into one
// bf16 B tile (a thread per half row of a slab, its block scale loaded a slab ahead) that the
// warps' ldmatrix reads.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/experts/common.cuh"
#include "cuda/experts/packed_weights.cuh"
#include "cuda/kernels.hpp"

namespace epmoe::cuda::experts::mma {

inline constexpr int kRows = kChunkRows;  // 64: a chunk
inline constexpr int kCols = 128;         // weight rows (outputs) per tile
inline constexpr int kSlabK = 64;
inline constexpr int kStages = 4;
inline constexpr int kStride = kSlabK + 8;  // bf16 per staged row: 144 bytes
inline constexpr int kWarpRows = 32, kWarpCols = 32;
inline constexpr int kMTiles = kWarpRows / 16, kNTiles = kWarpCols / 8;

static_assert((kRows / kWarpRows) * (kCols / kWarpCols) == kThreads / 32, "2 x 4 warps");
static_assert(kThreads == 2 * kCols, "a packed slab is decoded by a thread per half weight row");

template <Precision P>
struct Smem {
  static constexpr bool kDirect = P == Precision::bf16;  // codes are the B operand
  static constexpr int kCodeBytes = kDirect ? 2 * kStride : kSlabK * PackedFormat<P>::kBits / 8;
  struct Stage {
    std::uint16_t a[kRows][kStride];
    alignas(16) std::uint8_t b_codes[kCols][kCodeBytes];  // a slab of each weight row
  };
  Stage stage[kStages];
  std::uint16_t b[kDirect ? 1 : kCols][kStride];  // packed: the slab decoded to bf16
};
// bf16 110,736; MXFP8 88,064; MXFP4 / NVFP4 71,680: two CTAs per SM.
template <Precision P>
inline constexpr std::size_t kSmemBytes = sizeof(Smem<P>);

// acc[mi][ni][v]: row = warp_row0 + 16 mi + lane / 4 + 8 (v / 2), col = warp_col0 + 8 ni +
// 2 (lane % 4) + v % 2 (the mma C fragment).
using Accumulators = float[kMTiles][kNTiles][4];

struct WarpTile {
  int row0, col0;
};
__device__ inline WarpTile warp_tile() {
  const int warp = static_cast<int>(threadIdx.x) / 32;
  return WarpTile{(warp / 4) * kWarpRows, (warp % 4) * kWarpCols};
}

__device__ inline std::uint32_t smem_address(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}
__device__ inline void ldmatrix_x4(std::uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(p)));
}
__device__ inline void mma_bf16(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Weights [32 half, 32 half + 32) of one weight row's slab (its codes in shared memory), with
// the block scale codes load_scale_codes gave for them, decoded exactly into bf16 in `out` (the
// row of the B tile). The values are bf16 values (packed_weights.hpp), so their fp32's top halves
// are their bf16 codes: one byte permute per pair, no conversion instruction. Exact but for
// values below bf16's normal range (2^-126, from MX block scales under about 2^-118), whose low
// bits are cut, as the bf16 codes the tile read before were rounded there.
__device__ inline std::uint32_t bf16x2_bits(float lo, float hi) {
  return __byte_perm(__float_as_uint(lo), __float_as_uint(hi), 0x7632);
}
template <Precision P>
__device__ inline void decode_half_row(const std::uint8_t* codes, int half,
                                       std::uint32_t scale_codes, std::uint16_t* out) {
  constexpr int kGroups = kWeightsPer16B<P> / 8;  // of 8 weights per load
  constexpr int kLoads = 32 / kWeightsPer16B<P>;
  const auto* src = reinterpret_cast<const uint4*>(codes) + half * kLoads;
  auto* dst = reinterpret_cast<uint4*>(out + 32 * half);
#pragma unroll
  for (int l = 0; l < kLoads; ++l) {
    const uint4 v = src[l];
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      float w[8];
      decode8<P>(v, g, group_scale<P>(scale_codes, l * kGroups + g), w);
      dst[l * kGroups + g] = make_uint4(bf16x2_bits(w[0], w[1]), bf16x2_bits(w[2], w[3]),
                                        bf16x2_bits(w[4], w[5]), bf16x2_bits(w[6], w[7]));
    }
  }
}

// acc = sum over k < k_total of a_row(r)[k] * w(b_row(c), k) for the warp's tile (see
// Accumulators), w the decoded weight scaled as packed_weights.hpp says. a_row(r) is called for
// r < rows only (rows past the chunk hold stale shared memory, so their sums are garbage and are
// never stored); b_row(c), a WeightRow, for every c < kCols (the caller clamps columns past the
// matrix). k_total is a multiple of kSlabK. Every thread of the CTA calls it; it starts and ends
// with a barrier.
template <Precision P, class ARow, class BRow>
__device__ __forceinline__ void tile_mma(Smem<P>& s, int rows, std::int64_t k_total, ARow a_row,
                                         BRow b_row, Accumulators& acc) {
  using Stage = typename Smem<P>::Stage;
  constexpr bool kDirect = Smem<P>::kDirect;
  constexpr int kCopiesPerRow = kSlabK * 2 / 16;  // 16-byte copies per staged A row
  constexpr int kCodeCopies = kSlabK * PackedFormat<P>::kBits / 8 / 16;  // per weight row
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int slabs = static_cast<int>(k_total / kSlabK);
  const WarpTile tile = warp_tile();

  auto load_slab = [&](int slab, int buffer) {
    const std::int64_t k0 = std::int64_t{slab} * kSlabK;
    Stage& st = s.stage[buffer];
    for (int i = threadIdx.x; i < kCols * kCodeCopies; i += kThreads) {
      const int c = i / kCodeCopies, q = i % kCodeCopies;
      cp_async_16(&st.b_codes[c][16 * q],
                  b_row(c).codes + k0 * PackedFormat<P>::kBits / 8 + 16 * q);
    }
    // Only the chunk's rows: rows past it keep whatever the buffer held (their sums are never
    // stored). Loading the last row again in their place made every CTA of a decode round read
    // one token's row 64 times per slab, all from one L2 slice.
    for (int i = threadIdx.x; i < rows * kCopiesPerRow; i += kThreads) {
      const int r = i / kCopiesPerRow, q = i % kCopiesPerRow;
      cp_async_16(&st.a[r][8 * q], a_row(r) + k0 + 8 * q);
    }
  };

  for (int mi = 0; mi < kMTiles; ++mi)
    for (int ni = 0; ni < kNTiles; ++ni)
      for (int v = 0; v < 4; ++v) acc[mi][ni][v] = 0.0f;

  __syncthreads();  // the previous tile is done with `s`
  // One commit per stage even when no slab is left, so "all but kStages - 2 groups done" always
  // means "the slab about to be used has landed".
  for (int slab = 0; slab < kStages - 1; ++slab) {
    if (slab < slabs) load_slab(slab, slab);
    cp_async_commit();
  }

  // ldmatrix addresses (lane-dependent parts): A x4 = rows 0-15 x k 0-15 of a 16 x 16 tile, as
  // mma's a0..a3; B x4 = two n8 tiles x k 0-15, as (b0, b1) of each.
  const int a_row_in = lane % 16, a_k_in = (lane / 16) * 8;
  const int b_col_in = (lane & 7) + ((lane >> 4) << 3), b_k_in = ((lane >> 3) & 1) * 8;
  // Packed: this thread decodes weight row decode_row's half decode_half of each slab.
  const int decode_row = static_cast<int>(threadIdx.x) / 2, decode_half = threadIdx.x % 2;
  const WeightRow decoded = kDirect ? WeightRow{} : b_row(decode_row);
  const auto scale_codes_of = [&](int slab) {
    return kDirect || slab >= slabs
               ? 0u
               : load_scale_codes<P>(decoded, std::int64_t{slab} * kSlabK + decode_half * 32);
  };
  std::uint32_t scale_codes = scale_codes_of(0);
  for (int slab = 0; slab < slabs; ++slab) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // slab landed for every thread; everyone is done with slab - 1's buffer
    if (slab + kStages - 1 < slabs) load_slab(slab + kStages - 1, (slab + kStages - 1) % kStages);
    cp_async_commit();

    const Stage& st = s.stage[slab % kStages];
    const std::uint16_t(*b)[kStride] =
        kDirect ? reinterpret_cast<const std::uint16_t(*)[kStride]>(st.b_codes) : s.b;
    if constexpr (!kDirect) {
      const std::uint32_t codes = scale_codes;
      scale_codes = scale_codes_of(slab + 1);  // in flight while this slab is decoded and summed
      decode_half_row<P>(st.b_codes[decode_row], decode_half, codes, s.b[decode_row]);
      __syncthreads();  // the B tile is whole
    }
    Accumulators part;  // this slab's sums, promoted below
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
      for (int ni = 0; ni < kNTiles; ++ni)
#pragma unroll
        for (int v = 0; v < 4; ++v) part[mi][ni][v] = 0.0f;
#pragma unroll
    for (int k = 0; k < kSlabK; k += 16) {
      std::uint32_t a[kMTiles][4], bf[kNTiles / 2][4];
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi)
        ldmatrix_x4(a[mi], &st.a[tile.row0 + 16 * mi + a_row_in][k + a_k_in]);
#pragma unroll
      for (int nj = 0; nj < kNTiles / 2; ++nj)
        ldmatrix_x4(bf[nj], &b[tile.col0 + 16 * nj + b_col_in][k + b_k_in]);
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
        for (int ni = 0; ni < kNTiles; ++ni)
          mma_bf16(part[mi][ni], a[mi], bf[ni / 2][2 * (ni % 2)], bf[ni / 2][2 * (ni % 2) + 1]);
    }
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
      for (int ni = 0; ni < kNTiles; ++ni)
#pragma unroll
        for (int v = 0; v < 4; ++v) acc[mi][ni][v] += part[mi][ni][v];
  }
  cp_async_wait<0>();  // only empty groups can be left; drained before `s` is reused
  __syncthreads();
}

// The decode form of the tile, for chunks of at most stream_rows<P>(k_total) rows (a decode round
// gives most experts one row): a few rows leave mma.sync's 64-row tile nearly empty, and its
// 64-deep slabs read each weight row 128 bytes at a time, 4 KB apart, so HBM sees scattered
// sectors. Here each warp streams its 16 weight rows with 16-byte loads, kStreamLoads per lane and
// row in flight, two rows per group of lanes: the whole warp for bf16, half-warps for MXFP8 (whose
// rows take half the loads), quarter-warps for MXFP4 / NVFP4, so a pass covers 2048 weights of
// 2, 4 or 8 rows and the fewer bytes of a packed format mean fewer passes. It decodes them
// (decode8) and sums the products with the chunk's rows (staged in shared memory) in fp32 FMAs; a
// reduction over the lane group per (row, weight row). The same sums as tile_mma in another
// order: accumulation-order noise, the tensor-core rule (docs/design.md §4.1). acc is filled in
// tile_mma's layout, so the callers' epilogues are the same.
inline constexpr int kStreamRowsMax = 4;
inline constexpr int kStreamLoads = 8;
inline constexpr std::size_t kStreamOutBytes = sizeof(float) * kStreamRowsMax * kCols;
template <Precision P>
inline constexpr int kStreamGroupLanes = 32 * 8 / kWeightsPer16B<P>;  // 32, 16 or 8
// Rows the decode form takes for a K of k_total: its rows' bf16 codes and the [rows][kCols]
// results fit the tile's shared memory.
template <Precision P>
__host__ __device__ inline int stream_rows(std::int64_t k_total) {
  const auto fit = static_cast<std::int64_t>((kSmemBytes<P> - kStreamOutBytes) / (2 * k_total));
  return static_cast<int>(fit < kStreamRowsMax ? fit : kStreamRowsMax);
}

// sum += w . x over 8 weights and a uint4 of 8 bf16 codes of a row.
__device__ inline void fma8(float& sum, const float (&w)[8], const uint4& x) {
  const std::uint32_t xv[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    sum = fmaf(w[2 * i], __uint_as_float(xv[i] << 16), sum);
    sum = fmaf(w[2 * i + 1], __uint_as_float(xv[i] & 0xFFFF0000u), sum);
  }
}

template <Precision P, class ARow, class BRow>
__device__ __forceinline__ void tile_stream(void* smem, int rows, std::int64_t k_total, ARow a_row,
                                            BRow b_row, Accumulators& acc) {
  constexpr int kGroupLanes = kStreamGroupLanes<P>;
  constexpr int kRowsPerPass = 2 * 32 / kGroupLanes;
  constexpr int kPer = kWeightsPer16B<P>;  // weights per load
  auto* out = static_cast<float*>(smem);   // [kStreamRowsMax][kCols]
  auto* a = reinterpret_cast<std::uint16_t*>(static_cast<std::uint8_t*>(smem) +
                                             kStreamOutBytes);  // [rows][k_total] bf16 codes
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) / 32;
  const int group = lane / kGroupLanes, group_lane = lane % kGroupLanes;
  const int n8 = static_cast<int>(k_total / 8);     // 16-byte groups per A row
  const int nq = static_cast<int>(k_total / kPer);  // 16-byte loads per weight row

  __syncthreads();  // the previous item is done with shared memory
  for (int i = threadIdx.x; i < rows * n8; i += kThreads) {
    const int r = i / n8, q = i % n8;
    reinterpret_cast<uint4*>(a + r * k_total)[q] = reinterpret_cast<const uint4*>(a_row(r))[q];
  }
  __syncthreads();

  constexpr int kRowsPerWarp = kCols / (kThreads / 32);  // 16
  static_assert(kRowsPerWarp % kRowsPerPass == 0);
  for (int c0 = warp * kRowsPerWarp; c0 < (warp + 1) * kRowsPerWarp; c0 += kRowsPerPass) {
    const int c = c0 + 2 * group;  // this lane group's weight rows c, c + 1
    const WeightRow w[2] = {b_row(c), b_row(c + 1)};
    float sum[2][kStreamRowsMax] = {};
    for (int base = 0; base < nq; base += kGroupLanes * kStreamLoads) {
      uint4 wv[2][kStreamLoads];
      std::uint32_t scales[2][kStreamLoads];
#pragma unroll
      for (int u = 0; u < kStreamLoads; ++u)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int q = base + kGroupLanes * u + group_lane;
          const bool in = q < nq;
          wv[j][u] =
              in ? __ldg(reinterpret_cast<const uint4*>(w[j].codes) + q) : make_uint4(0, 0, 0, 0);
          scales[j][u] = in ? load_scale_codes<P>(w[j], std::int64_t{q} * kPer) : 0u;
        }
#pragma unroll
      for (int u = 0; u < kStreamLoads; ++u) {
        const int q = base + kGroupLanes * u + group_lane;
        if (q >= nq) break;
#pragma unroll
        for (int g = 0; g < kPer / 8; ++g)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            float wf[8];
            decode8<P>(wv[j][u], g, group_scale<P>(scales[j][u], g), wf);
#pragma unroll
            for (int r = 0; r < kStreamRowsMax; ++r) {
              if (r >= rows) break;
              fma8(sum[j][r], wf,
                   reinterpret_cast<const uint4*>(a + r * k_total)[q * kPer / 8 + g]);
            }
          }
      }
    }
#pragma unroll
    for (int r = 0; r < kStreamRowsMax; ++r)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        float total = sum[j][r];
#pragma unroll
        for (int offset = kGroupLanes / 2; offset > 0; offset /= 2)
          total += __shfl_xor_sync(0xFFFFFFFFu, total, offset);
        if (group_lane == 0 && r < rows) out[r * kCols + c + j] = total;
      }
  }
  __syncthreads();

  const WarpTile tile = warp_tile();
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int ni = 0; ni < kNTiles; ++ni)
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        const int r = tile.row0 + 16 * mi + lane / 4 + 8 * (v / 2);
        const int c = tile.col0 + 8 * ni + 2 * (lane % 4) + v % 2;
        acc[mi][ni][v] = r < rows ? out[r * kCols + c] : 0.0f;
      }
}

// The tile of a chunk: its decode form when the chunk is that short, else tile_mma.
template <Precision P, class ARow, class BRow>
__device__ __forceinline__ void tile_sums(Smem<P>& s, int rows, std::int64_t k_total, ARow a_row,
                                          BRow b_row, Accumulators& acc) {
  if (rows <= stream_rows<P>(k_total))
    tile_stream<P>(&s, rows, k_total, a_row, b_row, acc);
  else
    tile_mma<P>(s, rows, k_total, a_row, b_row, acc);
}

}  // namespace epmoe::cuda::experts::mma

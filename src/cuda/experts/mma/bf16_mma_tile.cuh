// The tile GEMM of the tensor-core backend (LayerOptions::expert_math = tensor_core, docs/design.md
// §4.1): the same items as the exact backend's (one expert, a chunk of up to 64 of its rows, a tile
// of 128 weight rows), computed with bf16 mma.sync (m16n8k16) and fp32 accumulation. Both
// operands are bf16 code rows (route's x16, this backend's h16 and weights), exact; the caller
// divides by the row and matrix scales in its epilogue. So the result differs from the reference
// only by fp32 accumulation order and rounding — accumulation-order noise (DESIGN §6).
//
// Each 64-deep slab is summed by the tensor cores into a fresh fragment and then added into the
// fp32 accumulators with ordinary (round-to-nearest) adds, as DeepGEMM promotes its FP8 sums: a
// long chain of mma accumulations drifts further from the float64 reference (first 2x H200 run,
// qwen3 bf16: 17-35 of 2,048 outputs beyond the tolerance; with promotion, 0.02 % of elements
// and rel_l2 2e-4, at the same speed).
//
// One CTA: 8 warps as 2 (rows) x 4 (columns); a warp owns 32 rows x 32 columns = 2 x 4 mma tiles
// of 16 x 8. K runs in slabs of 64 through a kStages-deep cp.async pipeline; A (rows) and B
// (weight rows, K-contiguous: the "col" operand of mma.row.col) are read by ldmatrix from [row][k]
// with 8 elements of padding, so each ldmatrix phase hits 32 distinct banks.
//
// How the weight operand flows: the weights stay resident in the layer's format (resident.hpp).
// bf16: the resident codes are the operand already, so cp.async copies them straight into the
// stage's B, as before. MXFP8 (1 B + an E8M0 per 32) and NVFP4 (0.5 B + an E4M3 per 16): cp.async
// copies the compressed slab and its scale records into the stage (RawSlab, weight_slab.cuh);
// once the slab has landed, each thread decodes one run of 32 elements of one row into the one
// bf16 B slab that ldmatrix reads (decode_codes: bf16(value x s_enc), the code math::bf16_codes
// gives, bit for bit), then a barrier, then the mma loop as before. The decode buffer is single:
// the barrier that opens the next slab also means every warp is done with it. The stages being
// 2-4x smaller, MXFP8 keeps 5 and NVFP4 6 in flight, and all three stay under 113 KB: two CTAs per
// SM.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/experts/common.cuh"
#include "cuda/experts/weight_slab.cuh"
#include "cuda/kernels.hpp"

namespace epmoe::cuda::experts::mma {

inline constexpr int kRows = kChunkRows;    // 64: a chunk
inline constexpr int kCols = kSlabRows;     // weight rows (outputs) per tile: 128
inline constexpr int kSlabK = kScaleSlab;   // 64
inline constexpr int kStride = kSlabK + 8;  // bf16 per staged row: 144 bytes
inline constexpr int kWarpRows = 32, kWarpCols = 32;
inline constexpr int kMTiles = kWarpRows / 16, kNTiles = kWarpCols / 8;

static_assert((kRows / kWarpRows) * (kCols / kWarpCols) == kThreads / 32, "2 x 4 warps");
static_assert(kCols * (kSlabK / kRun) == kThreads, "the decode step: one run per thread");

template <Precision P>
inline constexpr int kStages = P == Precision::bf16    ? 4
                               : P == Precision::mxfp8 ? 5
                                                       : 6;
template <Precision P>
inline constexpr bool kDecodes = P != Precision::bf16;

template <Precision P>
struct Smem {
  struct Stage {
    std::uint16_t a[kRows][kStride];
    // bf16: the weight slab as bf16 codes, ldmatrix's B; otherwise as resident, for the decode.
    std::conditional_t<kDecodes<P>, RawSlab<P>, std::uint16_t[kCols][kStride]> w;
  };
  Stage stage[kStages<P>];
  std::uint16_t b[kDecodes<P> ? kCols : 1][kStride];  // the decoded slab, ldmatrix's B
};
// bf16 110,736, mxfp8 106,752, nvfp4 101,376 bytes: two CTAs per SM (<= 113 KB with the static
// shared memory of the kernels).
template <Precision P>
inline constexpr std::size_t kSmemBytes = sizeof(Smem<P>);
static_assert(kSmemBytes<Precision::bf16> <= 112 * 1024 &&
                  kSmemBytes<Precision::mxfp8> <= 112 * 1024 &&
                  kSmemBytes<Precision::nvfp4> <= 112 * 1024,
              "two CTAs per SM");

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

// acc = sum over k < k_total of a_row(r)[k] * w(c, k) for the warp's tile (see Accumulators),
// with w(c, k) the bf16 code of the weight times s_enc (weight_s_enc; 1 for bf16 and MXFP8):
// weight row c of the tile is raw row i of `w` (WeightTile) with c = 2 (i % 64) + i / 64 when
// Interleave (FC1: gate and up of one column side by side), else c = i. a_row(r) is called for
// r < rows only (rows past the chunk repeat its last row and are never stored). k_total is a
// multiple of kSlabK. Every thread of the CTA calls it; it starts and ends with a barrier.
template <Precision P, bool Interleave, class ARow>
__device__ __forceinline__ void tile_mma(Smem<P>& s, int rows, std::int64_t k_total, ARow a_row,
                                         const WeightTile& w, float s_enc, Accumulators& acc) {
  constexpr int kCopiesPerRow = kSlabK * 2 / 16;  // 16-byte copies per staged bf16 row
  constexpr int kStageCount = kStages<P>;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int slabs = static_cast<int>(k_total / kSlabK);
  const WarpTile tile = warp_tile();
  // B row of raw row i, and back.
  const auto tile_row = [](int i) { return Interleave ? 2 * (i % kRowGroup) + i / kRowGroup : i; };
  const auto raw_row = [](int c) { return Interleave ? (c % 2) * kRowGroup + c / 2 : c; };

  auto load_slab = [&](int slab, int buffer) {
    const std::int64_t k0 = std::int64_t{slab} * kSlabK;
    typename Smem<P>::Stage& st = s.stage[buffer];
    if constexpr (kDecodes<P>) {
      load_raw_slab<P, kThreads>(st.w, w, slab);
    } else {
      for (int i = threadIdx.x; i < kCols * kCopiesPerRow; i += kThreads) {
        const int c = i / kCopiesPerRow, q = i % kCopiesPerRow;  // B row c: raw row raw_row(c)
        cp_async_16(&st.w[c][8 * q], w.row(raw_row(c)) + k0 * 2 + 16 * q);
      }
    }
    for (int i = threadIdx.x; i < kRows * kCopiesPerRow; i += kThreads) {
      const int r = i / kCopiesPerRow, q = i % kCopiesPerRow;
      cp_async_16(&st.a[r][8 * q], a_row(r < rows ? r : rows - 1) + k0 + 8 * q);
    }
  };

  for (int mi = 0; mi < kMTiles; ++mi)
    for (int ni = 0; ni < kNTiles; ++ni)
      for (int v = 0; v < 4; ++v) acc[mi][ni][v] = 0.0f;

  __syncthreads();  // the previous tile is done with `s`
  // One commit per stage even when no slab is left, so "all but kStages - 2 groups done" always
  // means "the slab about to be used has landed".
  for (int slab = 0; slab < kStageCount - 1; ++slab) {
    if (slab < slabs) load_slab(slab, slab);
    cp_async_commit();
  }

  // ldmatrix addresses (lane-dependent parts): A x4 = rows 0-15 x k 0-15 of a 16 x 16 tile, as
  // mma's a0..a3; B x4 = two n8 tiles x k 0-15, as (b0, b1) of each.
  const int a_row_in = lane % 16, a_k_in = (lane / 16) * 8;
  const int b_col_in = (lane & 7) + ((lane >> 4) << 3), b_k_in = ((lane >> 3) & 1) * 8;
  for (int slab = 0; slab < slabs; ++slab) {
    cp_async_wait<kStageCount - 2>();
    __syncthreads();  // slab landed for every thread; everyone is done with slab - 1's buffers
    if (slab + kStageCount - 1 < slabs)
      load_slab(slab + kStageCount - 1, (slab + kStageCount - 1) % kStageCount);
    cp_async_commit();

    const typename Smem<P>::Stage& st = s.stage[slab % kStageCount];
    const std::uint16_t(*b)[kStride];
    if constexpr (kDecodes<P>) {
      // The decode step: raw row i's run `half` to bf16 codes, into B row tile_row(i), in two
      // halves of 16 (a block of NVFP4) so few registers are live next to the accumulators.
      const int i = static_cast<int>(threadIdx.x) / 2, half = static_cast<int>(threadIdx.x) % 2;
      constexpr int kHalf = kRun / 2;
#pragma unroll
      for (int part = 0; part < 2; ++part) {
        const std::uint8_t* raw = st.w.run(i, half) + part * run_bytes(P) / 2;
        alignas(16) std::uint8_t bytes[run_bytes(P) / 2];
        if constexpr (run_bytes(P) / 2 >= 16) {
          *reinterpret_cast<uint4*>(bytes) = *reinterpret_cast<const uint4*>(raw);
        } else {
          *reinterpret_cast<uint2*>(bytes) = *reinterpret_cast<const uint2*>(raw);
        }
        const std::uint8_t* scale = st.w.run_scale(i, half) + part * (run_scales(P) / 2);
        const std::uint8_t scales[1] = {scale[0]};
        std::uint16_t codes[kHalf];
        decode_codes<P, kHalf>(bytes, scales, s_enc, codes);
        auto* dst = reinterpret_cast<uint4*>(&s.b[tile_row(i)][half * kRun + part * kHalf]);
#pragma unroll
        for (int q = 0; q < kHalf / 8; ++q) {
          const auto pair = [&](int j) {
            return std::uint32_t{codes[8 * q + j]} | std::uint32_t{codes[8 * q + j + 1]} << 16;
          };
          dst[q] = make_uint4(pair(0), pair(2), pair(4), pair(6));
        }
      }
      __syncthreads();  // the decoded slab is complete
      b = s.b;
    } else {
      b = st.w;
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
      std::uint32_t af[kMTiles][4], bf[kNTiles / 2][4];
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi)
        ldmatrix_x4(af[mi], &st.a[tile.row0 + 16 * mi + a_row_in][k + a_k_in]);
#pragma unroll
      for (int nj = 0; nj < kNTiles / 2; ++nj)
        ldmatrix_x4(bf[nj], &b[tile.col0 + 16 * nj + b_col_in][k + b_k_in]);
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
        for (int ni = 0; ni < kNTiles; ++ni)
          mma_bf16(part[mi][ni], af[mi], bf[ni / 2][2 * (ni % 2)], bf[ni / 2][2 * (ni % 2) + 1]);
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

}  // namespace epmoe::cuda::experts::mma

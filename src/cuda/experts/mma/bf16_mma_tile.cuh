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
//
// A chunk of at most 16 rows takes the tile's narrow form (tile_narrow): the same slabs, with the
// weight rows as the mma's M side and the chunk's rows as its N side, so a decode round's few
// rows cost a slab's copy and decode rather than a 64-row tile of mma. In a round with few items
// its K may be split over several CTAs (SplitPart, SplitSums; steps.cuh, for_each_item_part).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/experts/common.cuh"
#include "cuda/experts/e2m1_bf16.hpp"
#include "cuda/experts/mma/split_plan.hpp"
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

// MXFP8 and MXFP4 hold one power-of-two scale per 32 weights, a half row of a slab, so the
// narrow form leaves it out of the decode and scales each 32-deep partial sum instead (exact: a
// power of two): one multiply per sum, not per weight.
template <Precision P>
inline constexpr bool kScaleApart = PackedFormat<P>::kBlock == 32;

// Whether a precision's block scale codes come through the slab pipeline (for_each_slab): MXFP8
// only. Its slabs waited for a plain load issued one slab ahead (session 18, one H200, qwen3 at
// T = 1: 1.1 us per slab against bf16's 0.8 with twice the bytes); through the pipeline its
// rounds took 7-12 % less. The FP4 formats' FC1 took 6-8 % more that way, their FC2 5 % less
// (bench/RESULTS.md): they keep the plain load.
template <Precision P>
inline constexpr bool kScalesInPipeline = P == Precision::mxfp8;

// Such a slab's block scale codes: one 4-byte word per thread, the aligned word holding the codes
// of the half weight row it decodes.
struct NoScaleWords {};
struct ScaleWords {
  std::uint32_t scale_words[kThreads];
};
// The shared memory of a tile: kDepth stages, each a slab of kARows rows and of the kCols weight
// rows' codes (and, kScalesInPipeline, their scale words), and for a packed precision the slab
// decoded to bf16.
template <Precision P, int kARows, int kDepth>
struct SlabSmem {
  static constexpr bool kDirect = P == Precision::bf16;  // codes are the B operand
  static constexpr int kCodeBytes = kDirect ? 2 * kStride : kSlabK * PackedFormat<P>::kBits / 8;
  static constexpr int kStages = kDepth;
  static constexpr int kRowsA = kARows;
  struct Stage : std::conditional_t<kScalesInPipeline<P>, ScaleWords, NoScaleWords> {
    std::uint16_t a[kARows][kStride];
    alignas(16) std::uint8_t b_codes[kCols][kCodeBytes];  // a slab of each weight row
  };
  Stage stage[kStages];
  std::uint16_t b[kDirect ? 1 : kCols][kStride];  // packed: the slab decoded to bf16
  // MX, narrow form: each half row's block scale, applied to the sums (kScaleApart).
  float half_row_scale[kScaleApart<P> ? kCols : 1][2];
};
template <Precision P>
using Smem = SlabSmem<P, kRows, kStages>;
// bf16 110,752; MXFP8 93,184; MXFP4 72,704; NVFP4 71,696.

// The narrow tile (tile_narrow) stages 16 rows, not 64, so it holds more stages: as many as fit in
// the largest 64-row tile's shared memory (bf16's, which runs two CTAs per SM), at most 8: bf16 5,
// MXFP8 7, MXFP4 / NVFP4 8, more bytes in flight for a decode round.
inline constexpr int kNarrowRows = 16;
template <Precision P>
inline constexpr int kNarrowStages = [] {
  using S = SlabSmem<P, kNarrowRows, 1>;
  const std::size_t decoded = sizeof(S) - sizeof(typename S::Stage);
  const auto fit =
      static_cast<int>((sizeof(Smem<Precision::bf16>) - decoded) / sizeof(typename S::Stage));
  return fit < 8 ? fit : 8;
}();
template <Precision P>
using NarrowSmem = SlabSmem<P, kNarrowRows, kNarrowStages<P>>;
static_assert(kNarrowStages<Precision::bf16> == 5 && kNarrowStages<Precision::mxfp8> == 7 &&
              kNarrowStages<Precision::mxfp4> == 8 && kNarrowStages<Precision::nvfp4> == 8);

// A kernel's dynamic shared memory: whichever form needs more (MXFP8: the narrow form's 100,096;
// the others: the tile's): two CTAs per SM.
template <Precision P>
inline constexpr std::size_t kSmemBytes = sizeof(Smem<P>) > sizeof(NarrowSmem<P>)
                                              ? sizeof(Smem<P>)
                                              : sizeof(NarrowSmem<P>);

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

// f(mi, half, r) for each row r of this thread's accumulators: acc[mi][ni][2 half + v].
template <class F>
__device__ __forceinline__ void for_each_fragment_row(const WarpTile& tile, F f) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int half = 0; half < 2; ++half) f(mi, half, tile.row0 + 16 * mi + lane / 4 + 8 * half);
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
// the block scale codes of that half row (for_each_slab's scale words), decoded exactly into bf16
// in `out` (the row of the B tile). The values are bf16 values (packed_weights.hpp), so their
// fp32's top halves are their bf16 codes: one byte permute per pair, no conversion instruction.
// Exact but for values below bf16's normal range (2^-126, from MX block scales under about 2^-118),
// whose low bits are cut, as the bf16 codes the tile read before were rounded there.
__device__ inline std::uint32_t bf16x2_bits(float lo, float hi) {
  return __byte_perm(__float_as_uint(lo), __float_as_uint(hi), 0x7632);
}
template <Precision P, bool kApplyScale = true>
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
      const float scale = kApplyScale ? group_scale<P>(scale_codes, l * kGroups + g) : 1.0f;
      if constexpr (PackedFormat<P>::kBits == 4) {
        // E2M1: byte-permute tables and a bf16x2 multiply (e2m1_bf16.hpp), exact, rounded to
        // nearest below 2^-126
        const std::uint32_t words[4] = {v.x, v.y, v.z, v.w};
        std::uint32_t o[4];
        e2m1x8_to_bf16<kApplyScale>(words[g], kApplyScale ? bf16x2_scale(scale) : 0u, o);
        dst[l * kGroups + g] = make_uint4(o[0], o[1], o[2], o[3]);
      } else {
        float w[8];
        decode8<P>(v, g, scale, w);
        dst[l * kGroups + g] = make_uint4(bf16x2_bits(w[0], w[1]), bf16x2_bits(w[2], w[3]),
                                          bf16x2_bits(w[4], w[5]), bf16x2_bits(w[6], w[7]));
      }
    }
  }
}

// Every slab of a tile's K.
__host__ __device__ inline SlabRange all_slabs(std::int64_t k_total) {
  return SlabRange{0, static_cast<int>(k_total / kSlabK)};
}

// The slab pipeline of the mma tiles (S: their SlabSmem): K in slabs of kSlabK through an
// S::kStages-deep cp.async pipeline; the rows a_row(r) go to the stage's A rows (r < rows only:
// rows past the chunk keep whatever the buffer held, and sums over them are never stored), the
// weight rows b_row(c), a WeightRow for every c < kCols (the caller clamps columns past the
// matrix), to its codes. consume(stage, b) runs once per slab on every thread, b the slab's bf16
// weight tile ([kCols][kStride]: the stage's own rows for bf16, else the slab's codes decoded into
// s.b; with kScaleInSums, for kScaleApart precisions, decoded without the block scale, which goes
// to s.half_row_scale), over slabs [range.first, range.first + range.count) of K. Every thread of
// the CTA calls it; it
// starts and ends with a barrier, so the shared memory is free afterwards.
template <Precision P, bool kScaleInSums = false, class S, class ARow, class BRow, class Consume>
__device__ __forceinline__ void for_each_slab(S& s, int rows, SlabRange range, ARow a_row,
                                              BRow b_row, Consume consume) {
  using Stage = typename S::Stage;
  constexpr bool kDirect = S::kDirect;
  constexpr int kDepth = S::kStages;
  constexpr int kCopiesPerRow = kSlabK * 2 / 16;  // 16-byte copies per staged A row
  constexpr int kCodeCopies = kSlabK * PackedFormat<P>::kBits / 8 / 16;  // per weight row
  const int slabs = range.count;

  // Each thread copies the same code and row pieces of every slab: their sources, found once.
  constexpr int kCodeCopiesPerThread = (kCols * kCodeCopies + kThreads - 1) / kThreads;
  constexpr int kRowCopiesPerThread = (S::kRowsA * kCopiesPerRow + kThreads - 1) / kThreads;
  const std::uint8_t* code_src[kCodeCopiesPerThread];
  const std::uint16_t* row_src[kRowCopiesPerThread];
#pragma unroll
  for (int j = 0; j < kCodeCopiesPerThread; ++j) {
    const int i = static_cast<int>(threadIdx.x) + j * kThreads;
    code_src[j] =
        i < kCols * kCodeCopies ? b_row(i / kCodeCopies).codes + 16 * (i % kCodeCopies) : nullptr;
  }
#pragma unroll
  for (int j = 0; j < kRowCopiesPerThread; ++j) {
    const int i = static_cast<int>(threadIdx.x) + j * kThreads;
    // Only the chunk's rows: rows past it keep whatever the buffer held. Loading the last row
    // again in their place made every CTA of a decode round read one token's row 64 times per
    // slab, all from one L2 slice.
    row_src[j] =
        i < rows * kCopiesPerRow ? a_row(i / kCopiesPerRow) + 8 * (i % kCopiesPerRow) : nullptr;
  }
  // Packed: this thread decodes weight row decode_row's half decode_half of each slab, with that
  // half row's block scale codes: with kScalesInPipeline, copied with the slab's codes as the
  // aligned 4-byte word holding them (the scales' slices are 256-byte aligned and padded, so the
  // word is inside them); otherwise loaded one slab ahead.
  const int decode_row = static_cast<int>(threadIdx.x) / 2, decode_half = threadIdx.x % 2;
  const WeightRow decoded = kDirect ? WeightRow{} : b_row(decode_row);
  constexpr int kScaleBlock = kDirect ? 1 : PackedFormat<P>::kBlock;
  const auto scale_codes_at = [&](int slab) {
    return decoded.scales +
           (std::int64_t{range.first + slab} * kSlabK + decode_half * 32) / kScaleBlock;
  };
  const auto scale_codes_of = [&](int slab) {
    return kDirect || slab >= slabs ? 0u : load_scale_codes<P>(scale_codes_at(slab));
  };
  auto load_slab = [&](int slab, int buffer) {
    const std::int64_t k0 = std::int64_t{range.first + slab} * kSlabK;
    Stage& st = s.stage[buffer];
    if constexpr (kScalesInPipeline<P>)
      cp_async_4(&st.scale_words[threadIdx.x],
                 reinterpret_cast<const void*>(
                     reinterpret_cast<std::uintptr_t>(scale_codes_at(slab)) & ~std::uintptr_t{3}));
#pragma unroll
    for (int j = 0; j < kCodeCopiesPerThread; ++j) {
      const int i = static_cast<int>(threadIdx.x) + j * kThreads;
      if (code_src[j] != nullptr)
        cp_async_16(&st.b_codes[i / kCodeCopies][16 * (i % kCodeCopies)],
                    code_src[j] + k0 * PackedFormat<P>::kBits / 8);
    }
#pragma unroll
    for (int j = 0; j < kRowCopiesPerThread; ++j) {
      const int i = static_cast<int>(threadIdx.x) + j * kThreads;
      if (row_src[j] != nullptr)
        cp_async_16(&st.a[i / kCopiesPerRow][8 * (i % kCopiesPerRow)], row_src[j] + k0);
    }
  };

  __syncthreads();  // the previous tile is done with `s`
  // One commit per stage even when no slab is left, so "all but kDepth - 2 groups done" always
  // means "the slab about to be used has landed".
  for (int slab = 0; slab < kDepth - 1; ++slab) {
    if (slab < slabs) load_slab(slab, slab);
    cp_async_commit();
  }

  std::uint32_t scale_codes = kScalesInPipeline<P> ? 0u : scale_codes_of(0);
  for (int slab = 0; slab < slabs; ++slab) {
    cp_async_wait<kDepth - 2>();
    __syncthreads();  // slab landed for every thread; everyone is done with slab - 1's buffer
    if (slab + kDepth - 1 < slabs) load_slab(slab + kDepth - 1, (slab + kDepth - 1) % kDepth);
    cp_async_commit();

    const Stage& st = s.stage[slab % kDepth];
    const std::uint16_t(*b)[kStride] =
        kDirect ? reinterpret_cast<const std::uint16_t(*)[kStride]>(st.b_codes) : s.b;
    if constexpr (!kDirect) {
      std::uint32_t codes = scale_codes;
      if constexpr (kScalesInPipeline<P>)
        codes = st.scale_words[threadIdx.x] >>
                (8 * (reinterpret_cast<std::uintptr_t>(scale_codes_at(slab)) & 3));
      else
        scale_codes = scale_codes_of(slab + 1);  // in flight while this slab is decoded and summed
      if constexpr (kScaleInSums) {
        decode_half_row<P, false>(st.b_codes[decode_row], decode_half, codes, s.b[decode_row]);
        s.half_row_scale[decode_row][decode_half] = group_scale<P>(codes, 0);
      } else {
        decode_half_row<P>(st.b_codes[decode_row], decode_half, codes, s.b[decode_row]);
      }
      __syncthreads();  // the B tile (and its scales) is whole
    }
    consume(st, b);
  }
  cp_async_wait<0>();  // only empty groups can be left; drained before `s` is reused
  __syncthreads();
}

// ldmatrix addresses (lane-dependent parts) of a [row][k] array: kMatrixA's x4 = rows 0-15 x
// k 0-15 of a 16 x 16 tile, as mma's a0..a3; kMatrixB's x4 = two n8 tiles (rows 0-7, 8-15) x
// k 0-15, as (b0, b1) of each.
struct LdmatrixLane {
  int a_row, a_k, b_row, b_k;
};
__device__ inline LdmatrixLane ldmatrix_lane() {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  return LdmatrixLane{lane % 16, (lane / 16) * 8, (lane & 7) + ((lane >> 4) << 3),
                      ((lane >> 3) & 1) * 8};
}

template <int M, int N>
__device__ inline void zero(float (&f)[M][N][4]) {
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
      for (int v = 0; v < 4; ++v) f[m][n][v] = 0.0f;
}
// acc += part: each slab's sums promoted into the fp32 accumulators with ordinary adds.
template <int M, int N>
__device__ inline void promote(float (&acc)[M][N][4], const float (&part)[M][N][4]) {
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
      for (int v = 0; v < 4; ++v) acc[m][n][v] += part[m][n][v];
}

// acc = sum over k < k_total of a_row(r)[k] * w(b_row(c), k) for the warp's tile (see
// Accumulators), w the decoded weight scaled as packed_weights.hpp says; rows, a_row, b_row and
// k_total as for_each_slab takes them.
template <Precision P, class ARow, class BRow>
__device__ __forceinline__ void tile_mma(Smem<P>& s, int rows, std::int64_t k_total, ARow a_row,
                                         BRow b_row, Accumulators& acc) {
  const WarpTile tile = warp_tile();
  const LdmatrixLane l = ldmatrix_lane();
  zero(acc);
  for_each_slab<P>(s, rows, all_slabs(k_total), a_row, b_row,
                   [&](const typename Smem<P>::Stage& st, const std::uint16_t(*b)[kStride]) {
                     Accumulators part;  // this slab's sums
                     zero(part);
#pragma unroll
                     for (int k = 0; k < kSlabK; k += 16) {
                       std::uint32_t a[kMTiles][4], bf[kNTiles / 2][4];
#pragma unroll
                       for (int mi = 0; mi < kMTiles; ++mi)
                         ldmatrix_x4(a[mi], &st.a[tile.row0 + 16 * mi + l.a_row][k + l.a_k]);
#pragma unroll
                       for (int nj = 0; nj < kNTiles / 2; ++nj)
                         ldmatrix_x4(bf[nj], &b[tile.col0 + 16 * nj + l.b_row][k + l.b_k]);
#pragma unroll
                       for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
                         for (int ni = 0; ni < kNTiles; ++ni)
                           mma_bf16(part[mi][ni], a[mi], bf[ni / 2][2 * (ni % 2)],
                                    bf[ni / 2][2 * (ni % 2) + 1]);
                     }
                     promote(acc, part);
                   });
}

// The tile's results as [rows][kCols] fp32 in shared memory `out`, into the warp's accumulators
// (tile_mma's layout, so the callers' epilogues are the same); rows past `rows` read 0.
__device__ inline void accumulators_from(const float* out, int rows, Accumulators& acc) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
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

// A share of one tile's K: part `index` of `count`, each a contiguous run of its slabs, for a
// round whose items would leave most of the grid idle (steps.cuh, for_each_item_part): each part
// is a CTA, so a decode round's item takes a shorter chain of slabs. count == 1: the whole tile.
struct SplitPart {
  int index = 0, count = 1;
  std::uint32_t item = 0;  // the tile's work item; its parts' sums are slots item * count + p
  __device__ SlabRange slabs(std::int64_t k_total) const {
    return part_slabs(index, count, static_cast<int>(k_total / kSlabK));
  }
};

// Where a split tile's parts meet: each part stores its [rows][kCols] sums in its slot and counts
// itself in the item's arrival word; the part that arrives last adds all parts' sums, in part
// order (so the result does not depend on arrival order), and runs the epilogue. An arrival word
// holds (stamp << 32) | parts arrived, stamp naming the round and step, so a word left part-counted
// by a failed round is simply stale: nothing needs a reset.
struct SplitSums {
  float* sums;                   // [slots][kNarrowRows][kCols]
  unsigned long long* arrivals;  // [slots]
  std::uint32_t stamp;

  // Whether this part is the last of its item to arrive: a CAS loop that retries only when another
  // part changed the word, so at most count + 1 tries.
  __device__ bool arrive(const SplitPart& part) const {
    unsigned long long* word = arrivals + part.item;
    unsigned long long seen = 0;
    for (;;) {
      const std::uint32_t arrived =
          static_cast<std::uint32_t>(seen >> 32) == stamp ? static_cast<std::uint32_t>(seen) : 0u;
      const unsigned long long next =
          (static_cast<unsigned long long>(stamp) << 32) | (arrived + 1);
      const unsigned long long old = atomicCAS(word, seen, next);
      if (old == seen) return arrived + 1 == static_cast<std::uint32_t>(part.count);
      seen = old;
    }
  }

  // Called by every thread of the CTA with this part's sums in `out` ([rows][kCols] in shared
  // memory, followed by room for one flag): stores them, counts the arrival and, for the last
  // part, leaves the sum of every part's sums in `out`. Returns whether this part was the last.
  __device__ bool gather(const SplitPart& part, int rows, float* out) const {
    const auto slot = [&](int p) {
      return sums + (static_cast<std::size_t>(part.item) * part.count + p) * kNarrowRows * kCols;
    };
    float* mine = slot(part.index);
    for (int i = threadIdx.x; i < rows * kCols; i += kThreads) mine[i] = out[i];
    __threadfence();  // this part's sums are visible before its arrival is
    __syncthreads();
    auto* last = reinterpret_cast<int*>(out + kNarrowRows * kCols);
    if (threadIdx.x == 0) *last = arrive(part) ? 1 : 0;
    __syncthreads();
    if (*last == 0) return false;
    __threadfence();  // the other parts' sums, published before their arrivals, are read after
    for (int i = threadIdx.x; i < rows * kCols; i += kThreads) {
      float total = 0.0f;
      for (int p = 0; p < part.count; ++p) total += p == part.index ? out[i] : __ldcg(slot(p) + i);
      out[i] = total;
    }
    __syncthreads();
    return true;
  }
};

// The narrow form of the tile, for chunks of at most kNarrowRows rows (a decode round gives most
// experts a few): the same slabs, decoded weight tile and promotion as tile_mma, with the operands
// swapped (out^T = W x^T): the 128 weight rows are the mma's M side, a 16 x 16 A tile per warp,
// and the chunk's rows its N side, one n8 tile per 8 rows. A few rows leave tile_mma's 64-row
// tile nearly empty; here a warp runs 1 or 2 mma per 16 of K instead of 8, so a slab costs little
// beyond its copy and decode. Each warp's sums go to shared memory and come back in tile_mma's
// layout. `smem` is the tile's shared memory (kSmemBytes<P>), laid out as NarrowSmem<P>.
// With part.count > 1 this CTA sums only its part's slabs (SplitPart); returns whether it holds
// the tile's sums in acc (the part that arrived last), else acc is unset.
template <Precision P, class ARow, class BRow>
__device__ __forceinline__ bool tile_narrow(void* smem, int rows, std::int64_t k_total,
                                            const SplitPart& part, const SplitSums& split,
                                            ARow a_row, BRow b_row, Accumulators& acc) {
  auto& s = *static_cast<NarrowSmem<P>*>(smem);
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) / 32;
  const int w0 = warp * (kCols / (kThreads / 32));  // the warp's 16 weight rows
  static_assert(kCols / (kThreads / 32) == 16, "a warp per 16 weight rows");
  const LdmatrixLane l = ldmatrix_lane();
  const bool second = rows > 8;  // rows 8..15: a second n8 tile
  float sums[1][2][4];           // [weight rows w0 + lane / 4 (+ 8)][rows 8 n + 2 (lane % 4)]
  zero(sums);
  constexpr bool kApart = kScaleApart<P>;
  for_each_slab<P, kApart>(
      s, rows, part.slabs(k_total), a_row, b_row,
      [&](const typename NarrowSmem<P>::Stage& st, const std::uint16_t(*b)[kStride]) {
        // kApart: a partial sum per 32 of K (a block), scaled by its weight row's block scale.
        float part[kApart ? 2 : 1][2][4];
        zero(part);
#pragma unroll
        for (int k = 0; k < kSlabK; k += 16) {
          const int block = kApart ? k / 32 : 0;
          std::uint32_t w[4], x[4];
          ldmatrix_x4(w, &b[w0 + l.a_row][k + l.a_k]);
          ldmatrix_x4(x, &st.a[l.b_row][k + l.b_k]);
          mma_bf16(part[block][0], w, x[0], x[1]);
          if (second) mma_bf16(part[block][1], w, x[2], x[3]);
        }
        if constexpr (kApart) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {  // weight row w0 + lane / 4 + 8 half
            const float* scale = s.half_row_scale[w0 + lane / 4 + 8 * half];
#pragma unroll
            for (int block = 0; block < 2; ++block)
#pragma unroll
              for (int n = 0; n < 2; ++n)
#pragma unroll
                for (int v = 2 * half; v < 2 * half + 2; ++v)
                  sums[0][n][v] = fmaf(part[block][n][v], scale[block], sums[0][n][v]);
          }
        } else {
#pragma unroll
          for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int v = 0; v < 4; ++v) sums[0][n][v] += part[0][n][v];
        }
      });
  // for_each_slab ended with a barrier: its shared memory is free to hold the [rows][kCols] sums.
  auto* out = static_cast<float*>(smem);
  static_assert(sizeof(NarrowSmem<P>) >= sizeof(float) * kNarrowRows * kCols + sizeof(int));
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const int r = 8 * n + 2 * (lane % 4) + v % 2, c = w0 + lane / 4 + 8 * (v / 2);
      if (r < rows) out[r * kCols + c] = sums[0][n][v];
    }
  __syncthreads();
  if (part.count > 1 && !split.gather(part, rows, out)) return false;
  accumulators_from(out, rows, acc);
  return true;
}

// The tile of a chunk, or a part of its K (SplitPart): its narrow form for chunks of at most
// kNarrowRows rows, else tile_mma (which never splits: part 0 sums the whole tile, the others
// nothing). Returns whether this CTA holds the tile's sums in acc; only it runs the epilogue.
template <Precision P, class ARow, class BRow>
__device__ __forceinline__ bool tile_sums(Smem<P>& s, int rows, std::int64_t k_total,
                                          const SplitPart& part, const SplitSums& split, ARow a_row,
                                          BRow b_row, Accumulators& acc) {
  if (rows <= kNarrowRows) return tile_narrow<P>(&s, rows, k_total, part, split, a_row, b_row, acc);
  if (part.index != 0) return false;
  tile_mma<P>(s, rows, k_total, a_row, b_row, acc);
  return true;
}

}  // namespace epmoe::cuda::experts::mma

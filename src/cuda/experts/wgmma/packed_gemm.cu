// The packed-weight grouped GEMM (packed_gemm.hpp): weights decoded to bf16 in shared memory and
// fed to WGMMA, so they stay resident in their format. Written by hand (with CuTe's WGMMA atoms and
// swizzled layouts) because CUTLASS 4's SM90 GEMMs cannot take MX's 32-wide or NVFP4's 16-wide
// block scales along K (packed_gemm.hpp).
//
// The weights are WGMMA's A operand (M = 128 weight rows: each of two warpgroups 64), the tokens
// its B operand (N = 64 or 128 token rows: PackedTokenTile), both K-major, so a decode round's few
// rows per expert fill a 64-wide N tile instead of a 128-row M tile, and every weight is decoded
// once per 64 or 128 rows (the decode's instructions per WGMMA FLOP halve with 128).
//
// Warp roles: none yet — all 8 warps load (cp.async, kStages deep), decode and multiply:
//   load      each k tile's packed codes (16-byte cp.async), the aligned 4-byte word holding each
//             weight row's block scale codes, and the token rows (those past M_e zeroed once per
//             tile; each thread's sources and destinations computed once per tile)
//   decode    tile k + 1's codes to bf16 into the other of two swizzled W buffers, while WGMMA
//             runs on tile k, exactly: MXFP8 by decode8 (the tensor_core tiles' decode), E2M1 by
//             byte-permute tables and a bf16x2 multiply (e2m1_bf16.hpp)
//   multiply  4 k16 WGMMAs per k tile per warpgroup, fp32 accumulators in registers
//   store     D[m, n] from the accumulators, rows past M_e and columns past N left alone
// A persistent grid walks the tiles of every group (weight block fastest, so CTAs running at once
// share a group's token rows); each CTA computes the groups' tile prefix from device memory once.
#include <cuda_bf16.h>

#include <cub/block/block_scan.cuh>

#include "cuda/cuda_check.hpp"
#include "cuda/experts/backend.hpp"  // ScratchCursor
#include "cuda/experts/common.cuh"   // cp_async_*
#include "cuda/experts/e2m1_bf16.hpp"
#include "cuda/experts/packed_weights.cuh"
#include "cuda/experts/wgmma/packed_gemm.hpp"
#include "cuda/kernels.hpp"  // launch_chained
#include "cuda/pdl.cuh"
#include "cute/arch/mma_sm90.hpp"
#include "cute/atom/mma_atom.hpp"
#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"  // fence_view_async_shared
#include "epmoe/errors.hpp"

namespace epmoe::cuda::experts::wgmma {
namespace {

using namespace cute;

constexpr int kRows = PackedGroupedGemm::kWeightRows;  // weight rows per tile (WGMMA's M)
constexpr int kTileK = 64;                             // one 128-byte swizzle atom of bf16
constexpr int kMaxGroups = 1024;  // the tile prefix in shared memory: 4 groups per thread
static_assert(kThreads == 256 && kMaxGroups == 4 * kThreads, "one warpgroup per 64 weight rows");

using Bf16 = cutlass::bfloat16_t;
using Atom = GMMA::Layout_K_SW128_Atom<Bf16>;  // 8 rows x 64 bf16, 128-byte swizzle
using LayoutW = decltype(tile_to_shape(Atom{}, Shape<Int<kRows>, Int<kTileK>, _2>{}));

// What the token tile (WGMMA's N: 64 or 128 token rows, PackedTokenTile) sets: the WGMMA, the
// token rows' stages and the pipeline's depth (as deep as shared memory allows: 6 k tiles in
// flight ahead of WGMMA's with 64 rows, 4 with 128).
template <int kTokens>
struct TokenTile {
  static constexpr int kStages = kTokens == 64 ? 8 : 6;
  using Op = decltype(SM90::GMMA::ss_op_selector<Bf16, Bf16, float, Shape<_64, Int<kTokens>, _64>,
                                                 GMMA::Major::K, GMMA::Major::K>());
  using TiledMma = decltype(make_tiled_mma(Op{}, Layout<Shape<_2, _1, _1>>{}));
  using LayoutX = decltype(tile_to_shape(Atom{}, Shape<Int<kTokens>, Int<kTileK>, Int<kStages>>{}));
};

// Element offset of (row, k) in a K-major 128-byte-swizzled tile of 64 bf16 per row (the layout
// of Atom tiled along rows; the swizzle XORs the 16-byte chunk index with row % 8).
__device__ __forceinline__ int swizzled(int row, int k) {
  return row * kTileK + ((((k >> 3) ^ row) & 7) << 3) + (k & 7);
}

template <Precision P, int kTokens>
struct Smem {
  static constexpr int kStages = TokenTile<kTokens>::kStages;
  static constexpr int kCodeBytes = kTileK * PackedFormat<P>::kBits / 8;  // a weight row's k tile
  alignas(1024) Bf16 w[2][kRows * kTileK];          // decoded weights, two buffers
  alignas(1024) Bf16 x[kStages][kTokens * kTileK];  // token rows
  alignas(16) std::uint8_t codes[kStages][kRows][kCodeBytes];
  std::uint32_t scale_words[kStages][kRows];
  int tile_end[kMaxGroups];  // tiles of groups 0..g, inclusive prefix
};

struct Args {
  PackedGemmArrays arrays;
  PackedMatrices w;
  int groups, n, k;
};

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

template <Precision P, int kTokens>
__global__ void __launch_bounds__(kThreads, 1) packed_gemm_kernel(Args args) {
  using S = Smem<P, kTokens>;
  using T = TokenTile<kTokens>;
  constexpr int kStages = T::kStages;
  extern __shared__ std::uint8_t smem_raw[];
  // 1024-byte aligned (the 128-byte swizzle's period) by an offset from smem_raw, not through an
  // integer cast: the compiler then still knows `s` is shared memory and emits LDS / STS, where a
  // cast made every decode access a generic 64-bit LD / ST.
  const std::uint32_t misaligned =
      static_cast<std::uint32_t>(__cvta_generic_to_shared(smem_raw)) & 1023u;
  S& s = *reinterpret_cast<S*>(smem_raw + ((1024u - misaligned) & 1023u));
  const int tid = static_cast<int>(threadIdx.x);
  wait_for_previous_kernel();  // the plan kernel wrote the problems and pointers

  const int n = args.n, k = args.k, groups = args.groups;
  const int weight_blocks = (n + kRows - 1) / kRows;
  {
    using Scan = cub::BlockScan<int, kThreads>;
    __shared__ typename Scan::TempStorage scan;
    int tiles[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int g = 4 * tid + i;
      tiles[i] =
          g < groups ? weight_blocks * ((args.arrays.problems[g].m + kTokens - 1) / kTokens) : 0;
    }
    Scan(scan).InclusiveSum(tiles, tiles);
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (4 * tid + i < groups) s.tile_end[4 * tid + i] = tiles[i];
  }
  __syncthreads();
  const int tiles = s.tile_end[groups - 1];

  typename T::TiledMma mma;
  const auto thr = mma.get_thread_slice(tid);
  Tensor sW = make_tensor(make_smem_ptr(&s.w[0][0]), LayoutW{});
  Tensor sX = make_tensor(make_smem_ptr(&s.x[0][0]), typename T::LayoutX{});
  Tensor tCrW = thr.make_fragment_A(thr.partition_A(sW));  // (MMA, MMA_M, MMA_K, buffer)
  Tensor tCrX = thr.make_fragment_B(thr.partition_B(sX));  // (MMA, MMA_N, MMA_K, stage)
  Tensor accum = partition_fragment_C(mma, Shape<Int<kRows>, Int<kTokens>>{});
  Tensor coord = thr.partition_C(make_identity_tensor(Shape<Int<kRows>, Int<kTokens>>{}));

  constexpr int kBlock = PackedFormat<P>::kBlock;
  constexpr int kChunksPerRow = S::kCodeBytes / 16;
  constexpr int kCodeChunks = kRows * kChunksPerRow / kThreads;  // 16-byte copies per thread
  constexpr int kTokenChunks = kTokens * 8 / kThreads;           // (8 per token row)
  static_assert(kCodeChunks >= 1 && kTokenChunks >= 1, "every thread copies codes and rows");
  const std::int64_t code_row_bytes = static_cast<std::int64_t>(k) * PackedFormat<P>::kBits / 8;
  const std::int64_t scale_row_bytes = k / kBlock;
  const int k_tiles = k / kTileK;
  // This thread's decode: half `half` (32 k) of weight row `decode_row` of each k tile.
  const int decode_row = tid / 2, half = tid % 2;

  for (int tile = static_cast<int>(blockIdx.x); tile < tiles; tile += static_cast<int>(gridDim.x)) {
    const int g = group_of(s.tile_end, groups, tile);
    const int local = tile - (g > 0 ? s.tile_end[g - 1] : 0);
    const int n0 = local % weight_blocks * kRows, m0 = local / weight_blocks * kTokens;
    const int m = args.arrays.problems[g].m;
    const int rows = min(m - m0, kTokens);  // token rows of this tile; the rest stay zero
    const std::uint16_t* a = args.arrays.a[g] + static_cast<std::int64_t>(m0) * k;
    const std::uint8_t* codes = args.w.codes + static_cast<std::int64_t>(g) * n * code_row_bytes;
    const std::uint8_t* scales = args.w.scales + static_cast<std::int64_t>(g) * n * scale_row_bytes;

    // Each thread's sources at k tile 0 (a k tile adds kt * its k bytes) and destinations,
    // once per tile. Past N a weight row is a copy of row N - 1, never stored.
    const std::uint8_t* code_src[kCodeChunks];
    int code_dst[kCodeChunks];
#pragma unroll
    for (int i = 0; i < kCodeChunks; ++i) {
      const int c = tid + i * kThreads, row = c / kChunksPerRow, unit = c % kChunksPerRow;
      code_src[i] = codes + min(n0 + row, n - 1) * code_row_bytes + 16 * unit;
      code_dst[i] = row * S::kCodeBytes + 16 * unit;
    }
    const std::uint8_t* scale_src = scales + min(n0 + tid % kRows, n - 1) * scale_row_bytes;
    const std::uint16_t* token_src[kTokenChunks];  // nullptr: a row past the tile's
    int token_dst[kTokenChunks];
#pragma unroll
    for (int i = 0; i < kTokenChunks; ++i) {
      const int c = tid + i * kThreads, row = c / 8, unit = c % 8;
      token_src[i] = row < rows ? a + static_cast<std::int64_t>(row) * k + 8 * unit : nullptr;
      token_dst[i] = swizzled(row, 8 * unit);
    }
    // Rows past the tile's are zero in every stage for the whole tile (no k tile writes them).
    if (rows < kTokens) {
      for (int c = tid; c < kStages * kTokens * 8; c += kThreads) {
        const int stage = c / (kTokens * 8), row = c / 8 % kTokens, unit = c % 8;
        if (row >= rows)
          *reinterpret_cast<uint4*>(&s.x[stage][swizzled(row, 8 * unit)]) = uint4{0, 0, 0, 0};
      }
    }
    const std::uint8_t* decode_scales = scales + min(n0 + decode_row, n - 1) * scale_row_bytes;

    // load: k tile `kt` into stage `stage` (no commit)
    const auto load = [&](int stage, int kt) {
#pragma unroll
      for (int i = 0; i < kCodeChunks; ++i)
        cp_async_16(&s.codes[stage][0][0] + code_dst[i], code_src[i] + kt * S::kCodeBytes);
      if (tid < kRows) {
        const std::uint8_t* at = scale_src + kt * (kTileK / kBlock);
        cp_async_4(&s.scale_words[stage][tid],
                   reinterpret_cast<const void*>(reinterpret_cast<std::uintptr_t>(at) & ~3ull));
      }
#pragma unroll
      for (int i = 0; i < kTokenChunks; ++i)
        if (token_src[i] != nullptr)
          cp_async_16(&s.x[stage][token_dst[i]], token_src[i] + kt * kTileK);
    };
    // decode: stage `stage`'s codes into W buffer `buffer`
    const auto decode = [&](int stage, int buffer, int kt) {
      const std::uintptr_t scale_at =
          reinterpret_cast<std::uintptr_t>(decode_scales + kt * (kTileK / kBlock));
      const std::uint32_t word = s.scale_words[stage][decode_row] >> (8 * (scale_at & 3));
      // this half's codes: MX one (byte `half`), NVFP4 two (bytes 2 half, 2 half + 1)
      const std::uint32_t half_scales = word >> (kBlock == 32 ? 8 * half : 16 * half);
      constexpr int kLoads = 32 * PackedFormat<P>::kBits / 8 / 16;  // 16-byte loads per half row
      constexpr int kGroups = kWeightsPer16B<P> / 8;                // groups of 8 per load
      // The half row's block scales, decoded once: MX one, NVFP4 two (its one load is the half
      // row, groups 0-1 and 2-3 of it).
      const float scale0 = group_scale<P>(half_scales, 0);
      const float scale1 = kBlock == 32 ? scale0 : group_scale<P>(half_scales, 2);
      const std::uint32_t scale0_bf16x2 = bf16x2_scale(scale0);
      const std::uint32_t scale1_bf16x2 = kBlock == 32 ? scale0_bf16x2 : bf16x2_scale(scale1);
#pragma unroll
      for (int load = 0; load < kLoads; ++load) {
        const uint4 v = *reinterpret_cast<const uint4*>(
            &s.codes[stage][decode_row][S::kCodeBytes / 2 * half + 16 * load]);
#pragma unroll
        for (int gi = 0; gi < kGroups; ++gi) {
          uint4 packed;
          if constexpr (PackedFormat<P>::kBits == 4) {
            // E2M1: byte-permute tables and a bf16x2 multiply (e2m1_bf16.hpp), exact
            const std::uint32_t words[4] = {v.x, v.y, v.z, v.w};
            std::uint32_t out[4];
            e2m1x8_to_bf16(words[gi], gi < 2 ? scale0_bf16x2 : scale1_bf16x2, out);
            packed = uint4{out[0], out[1], out[2], out[3]};
          } else {
            float f[8];
            decode8<P>(v, gi, gi < 2 ? scale0 : scale1, f);
            // exact values: the hardware's cvt.rn.bf16x2.f32 only packs them (NaN: its canonical)
            __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
            for (int j = 0; j < 4; ++j) pairs[j] = __floats2bfloat162_rn(f[2 * j], f[2 * j + 1]);
          }
          const int kk = 32 * half + kWeightsPer16B<P> * load + 8 * gi;
          *reinterpret_cast<uint4*>(&s.w[buffer][swizzled(decode_row, kk)]) = packed;
        }
      }
    };

    for (int stage = 0; stage < kStages - 1; ++stage) {
      if (stage < k_tiles) load(stage, stage);
      cp_async_commit();
    }
    cp_async_wait<kStages - 2>();  // k tile 0
    __syncthreads();
    decode(0, 0, 0);
    cutlass::arch::fence_view_async_shared();  // the W and X writes, before WGMMA reads them
    __syncthreads();

    mma.accumulate_ = GMMA::ScaleOut::Zero;
    for (int kt = 0; kt < k_tiles; ++kt) {
      warpgroup_fence_operand(accum);
      warpgroup_arrive();
#pragma unroll
      for (int kb = 0; kb < size<2>(tCrW); ++kb) {
        cute::gemm(mma, tCrW(_, _, kb, kt % 2), tCrX(_, _, kb, kt % kStages), accum);
        mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();

      // while it runs: k tile kt + 1 decoded into the other W buffer (WGMMA kt - 1 is done with
      // it), and k tile kt + kStages - 1 loaded into the stage WGMMA kt - 1 read
      cp_async_wait<kStages - 3>();  // k tile kt + 1
      __syncthreads();
      if (kt + 1 < k_tiles) decode((kt + 1) % kStages, (kt + 1) % 2, kt + 1);
      cutlass::arch::fence_view_async_shared();
      if (kt + kStages - 1 < k_tiles) load((kt + kStages - 1) % kStages, kt + kStages - 1);
      cp_async_commit();

      warpgroup_wait<0>();
      warpgroup_fence_operand(accum);
      __syncthreads();  // every warpgroup is done with W buffer kt % 2 and stage kt % kStages
    }

    float* d = args.arrays.d[g];
#pragma unroll
    for (int i = 0; i < size(accum); ++i) {
      const int col = n0 + get<0>(coord(i)), row = m0 + get<1>(coord(i));
      if (row < m && col < n) d[static_cast<std::int64_t>(row) * n + col] = accum(i);
    }
  }
  cp_async_wait<0>();
}

template <Precision P, int kTokens>
std::size_t smem_bytes() {
  return sizeof(Smem<P, kTokens>) + 1024;  // + the alignment of the dynamic allocation to 1024
}

// Calls f(integral_constant<Precision, P>, integral_constant<int, tokens>) with the GEMM's
// precision (with_packed_precision, whose bf16 case cannot_take has refused: no bf16 kernel is
// instantiated) and token rows.
template <class F>
void with_kernel(Precision p, PackedTokenTile tile, F f) {
  with_packed_precision(p, [&](auto precision) {
    if constexpr (decltype(precision)::value != Precision::bf16) {
      if (tile == PackedTokenTile::t64)
        f(precision, std::integral_constant<int, 64>{});
      else
        f(precision, std::integral_constant<int, 128>{});
    }
  });
}

}  // namespace

const char* PackedGroupedGemm::cannot_take(Precision precision, int groups, int n, int k) {
  if (!packed_with_block_scales(precision))
    return "precision must be mxfp8, mxfp4 or nvfp4 (packed weights with block scales)";
  if (groups < 1 || groups > kMaxGroups) return "groups must be 1..1024";
  if (n < 1) return "N must be positive";
  if (k < kTileK || k % kTileK != 0) return "K must be a positive multiple of 64 (the k tile)";
  return nullptr;
}

PackedGroupedGemm::PackedGroupedGemm(Precision precision, int groups, int n, int k, int sm_count,
                                     int device, PackedTokenTile tile)
    : precision_(precision), tile_(tile), groups_(groups), n_(n), k_(k), sm_count_(sm_count) {
  if (const char* why = cannot_take(precision, groups, n, k))
    throw Error(ErrorCode::unsupported, std::string("packed grouped GEMM: ") + why);
  int sms = 0;
  EPMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  sm_count_ = sm_count > 0 ? std::min(sm_count, sms) : sms;
  with_kernel(precision, tile, [&](auto p, auto tokens) {
    constexpr Precision kP = decltype(p)::value;
    constexpr int kTokens = decltype(tokens)::value;
    smem_ = smem_bytes<kP, kTokens>();
    EPMOE_CUDA_CHECK(cudaFuncSetAttribute(packed_gemm_kernel<kP, kTokens>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem_)));
  });
  // The arrays sliced from one allocation; with base == nullptr only measured (ScratchCursor).
  const auto slice = [g = static_cast<std::size_t>(groups)](std::uint8_t* base,
                                                            std::size_t* bytes) {
    ScratchCursor cursor{base};
    PackedGemmArrays arrays{cursor.take<GemmProblem>(g), cursor.take<const std::uint16_t*>(g),
                            cursor.take<float*>(g)};
    *bytes = cursor.used;
    return arrays;
  };
  slice(nullptr, &device_bytes_);
  EPMOE_CUDA_CHECK(cudaMalloc(&memory_, device_bytes_));
  arrays_ = slice(memory_, &device_bytes_);
  EPMOE_CUDA_CHECK(cudaMemset(memory_, 0, device_bytes_));
}

PackedGroupedGemm::~PackedGroupedGemm() {
  cudaFree(memory_);
}

void PackedGroupedGemm::run(const PackedMatrices& weights, cudaStream_t stream) const {
  const Args args{arrays_, weights, groups_, n_, k_};
  with_kernel(precision_, tile_, [&](auto p, auto tokens) {
    launch_chained(packed_gemm_kernel<decltype(p)::value, decltype(tokens)::value>,
                   KernelShape{sm_count_, smem_}, stream, args);
  });
}

}  // namespace epmoe::cuda::experts::wgmma

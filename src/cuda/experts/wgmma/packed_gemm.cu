// The packed-weight grouped GEMM (packed_gemm.hpp): weights decoded to bf16 in registers and fed
// to WGMMA as its register operand, so they stay resident in their format. Written by hand (with
// CuTe's WGMMA atoms and swizzled layouts) because CUTLASS 4's SM90 GEMMs cannot take MX's 32-wide
// or NVFP4's 16-wide block scales along K (packed_gemm.hpp). mxfp8's and mxfp4's E4M3 tile
// (t16_e4m3, packed_e4m3_gemm_kernel below) decodes nothing to bf16: E4M3 times E4M3 per MX block,
// its weight codes by TMA (mxfp4's E2M1 codes converted to E4M3 in shared memory).
//
// The weights are WGMMA's A operand (M = 128 weight rows: each of two warpgroups 64), the tokens
// its B operand (N = 64, 128 or 256 token rows: PackedTokenTile), both K-major, so a decode
// round's few rows per expert fill a 64-wide N tile instead of a 128-row M tile, and every weight
// is decoded once per 64, 128 or 256 rows (the decode's instructions per WGMMA FLOP halve with each
// doubling).
//
// Warp roles (three warpgroups, one role per branch of the kernel):
//   producer  warpgroup 0: each k tile's packed codes (16-byte cp.async), the aligned 4-byte word
//             holding each weight row's block scale codes (an activating FC1's rows in
//             weight_row's order), and the token rows (rows past M_e are not loaded: they only
//             reach output columns that are never stored) into a ring of kStages stages, each
//             signalled by a `full` mbarrier when its copies land
//             (cp.async.mbarrier.arrive.noinc); it runs ahead across tiles, so the next tile's
//             first k tiles load while the math warpgroups finish and store this one
//   math      warpgroups 1 and 2, 64 weight rows each: one k16 WGMMA at a time with A from
//             registers (at most 4 in flight, CUTLASS's mixed-input pipeline), each thread
//             decoding the next k16 block of its own A fragment (2 rows x 4 k: one shared-memory
//             load per row, the 4 threads of a row reading the same address) while the WGMMAs
//             run, exactly (MXFP8 by the hardware's E4M3 conversion times the block scale, as
//             decode8; E2M1 by byte-permute tables and a bf16x2 multiply, e2m1_bf16.hpp); fp32
//             accumulators in registers; a stage goes back to the producer (its `empty` mbarrier)
//             once the WGMMAs that read it have retired; then D[m, n] from the accumulators (rows
//             past M_e and columns past N left alone), or, for an activating FC1, h
//             (activate_and_store)
// The two math warpgroups synchronize only through the producer's stages, and decoded weights
// never pass through shared memory (session 21's kernel wrote them there: a store, a proxy fence
// and a warpgroup barrier per k tile, and a third of the shared-memory traffic).
// A persistent grid walks the tiles of every group (weight block fastest, so CTAs running at once
// share a group's token rows); each CTA computes the groups' tile prefix from device memory once.
#include "cuda/experts/wgmma/packed_gemm.cuh"

#include "cuda/cuda_check.hpp"
#include "cuda/experts/backend.hpp"  // ScratchCursor
#include "cuda/kernels.hpp"          // grid_sms, launch_chained
#include "epmoe/errors.hpp"

namespace epmoe::cuda::experts::wgmma {
namespace {

using namespace cute;
using namespace packed;

template <Precision P, int kTokens, bool kActivates>
__global__ void __launch_bounds__(TokenTile<kTokens>::kThreads, 1) packed_gemm_kernel(Args args) {
  using S = Smem<P, kTokens, kActivates>;
  using T = TokenTile<kTokens>;
  using Barrier = cutlass::arch::ClusterBarrier;
  constexpr int kStages = T::kStages;
  S& s = aligned_smem<S>();
  const auto [tid, n, k, groups, weight_blocks, tiles] =
      start_gemm<kStages, kTokens, T::kThreads>(s, args);

  constexpr int kBlock = PackedFormat<P>::kBlock;
  const std::int64_t code_row_bytes = static_cast<std::int64_t>(k) * PackedFormat<P>::kBits / 8;
  const std::int64_t scale_row_bytes = k / kBlock;
  const int k_tiles = k / kTileK;
  RingPosition ring;

  // 256 token rows need 128 accumulator registers per math thread: the producer gives registers
  // to the math warpgroups (72 + 2 x 216 per thread of a warpgroup fit the SM's 64 K).
  constexpr bool kMoveRegisters = kTokens == 256;
  if (tid < kProducerThreads) {
    // ---- producer: every tile's k tiles into the ring, kStages ahead of the math warpgroups
    if constexpr (kMoveRegisters) cutlass::arch::warpgroup_reg_dealloc<72>();
    constexpr int kChunksPerRow = S::kCodeBytes / 16;
    constexpr int kCodeChunks = kRows * kChunksPerRow / kProducerThreads;  // 16-byte copies
    constexpr int kTokenChunks = kTokens * 8 / kProducerThreads;           // (8 per token row)
    static_assert(kCodeChunks >= 1 && kTokenChunks >= 1, "every thread copies codes and rows");
    for (int tile = static_cast<int>(blockIdx.x); tile < tiles;
         tile += static_cast<int>(gridDim.x)) {
      const TilePlace at = place_of(s.tile_end, groups, weight_blocks, kTokens, tile);
      const int rows = min(args.arrays.problems[at.g].m - at.m0, kTokens);
      const std::uint16_t* a = args.arrays.a[at.g] + static_cast<std::int64_t>(at.m0) * k;
      // Each thread's sources at k tile 0 (a k tile adds kt * its k bytes), once per tile. Past
      // N a weight row is a copy of row N - 1, never stored.
      const std::uint8_t* code_src[kCodeChunks];
#pragma unroll
      for (int i = 0; i < kCodeChunks; ++i) {
        const int c = tid + i * kProducerThreads;
        const int row = weight_row<kActivates>(c / kChunksPerRow, at.n0 / kRows, n);
        code_src[i] =
            matrix_row(args.w.codes, code_row_bytes, at.g, n, row) + 16 * (c % kChunksPerRow);
      }
      const std::uint8_t* scale_src = matrix_row(args.w.scales, scale_row_bytes, at.g, n,
                                                 weight_row<kActivates>(tid, at.n0 / kRows, n));
      // Token chunk i of this thread: row tid / 8 + kRowStep i, 16 bytes at unit tid % 8; the
      // rows past the tile's are not loaded (i < token_chunks). Its swizzled place moves by
      // kRowStep rows per chunk (kRowStep is a multiple of the swizzle's 8-row period).
      constexpr int kRowStep = kProducerThreads / 8;
      const std::uint16_t* token_src = a + static_cast<std::int64_t>(tid / 8) * k + 8 * (tid % 8);
      const int token_dst = swizzled(tid / 8, 8 * (tid % 8));
      const int token_chunks = min(kTokenChunks, (rows - tid / 8 + kRowStep - 1) / kRowStep);
      // Where 16 chunks' 64-bit addresses spill the 72 registers of a 256-row tile's producer
      // (an activating FC1's, and mxfp8's plain one), the chunks are addressed by 32-bit offsets
      // (256 K < 2^31, cannot_take). The others keep them: an offset costs the producer an IMAD
      // per chunk, and its instructions take issue slots from the math warps (nvfp4, T = 8192:
      // 3 % slower; mxfp8's FC2 without its spill: 1.5 % faster, session 22).
      constexpr bool kOffsets32 = kActivates || (P == Precision::mxfp8 && kTokens == 256);
      const int row_step = kRowStep * k;
      for (int kt = 0; kt < k_tiles; ++kt) {
        Barrier::wait(&s.empty[ring.stage], ring.phase ^ 1u);  // a fresh barrier: at once
#pragma unroll
        for (int i = 0; i < kCodeChunks; ++i) {
          const int c = tid + i * kProducerThreads;
          cp_async_16(&s.codes[ring.stage][c / kChunksPerRow][16 * (c % kChunksPerRow)],
                      code_src[i] + kt * S::kCodeBytes);
        }
        copy_scale_word(&s.scale_words[ring.stage][tid], scale_src + kt * (kTileK / kBlock));
#pragma unroll
        for (int i = 0; i < kTokenChunks; ++i)
          if (i < token_chunks)
            cp_async_16(
                &s.x[ring.stage][token_dst + i * kRowStep * kTileK],
                kOffsets32 ? token_src + (i * row_step + kt * kTileK)
                           : token_src + static_cast<std::int64_t>(i) * kRowStep * k + kt * kTileK);
        cutlass::arch::cpasync_barrier_arrive_noinc(&s.full[ring.stage]);
        ring.advance<kStages>();
      }
    }
    cp_async_wait<0>();
    return;
  }

  // ---- math: warpgroup wg of pair `half` decodes and multiplies weight rows 64 wg .. 64 wg + 63
  // of each tile, over its k tiles kt with kt % kPairs == half (one pair: all of them)
  if constexpr (kMoveRegisters) cutlass::arch::warpgroup_reg_alloc<216>();
  const int math_tid = tid - kProducerThreads, math_wg = math_tid / kWarpgroup;
  const int wg = math_wg % 2, half = math_wg / 2, wg_tid = math_tid % kWarpgroup;
  const bool signals = wg_tid == 0;  // the warpgroup's arrival on `empty`
  typename T::TiledMma mma;
  const auto thr = mma.get_thread_slice(math_tid % (2 * kWarpgroup));
  Tensor sX = make_tensor(make_smem_ptr(&s.x[0][0]), typename T::LayoutX{});
  Tensor tCrX = thr.make_fragment_B(thr.partition_B(sX));  // (MMA, MMA_N, MMA_K, stage)
  // A, the weights, from registers: one k tile, 4 k16 blocks of 8 bf16 per thread. Value v of
  // block kb is weight row a_row + 8 ((v / 2) % 2), k 16 kb + a_k + (v % 2) + 8 (v / 4): as 32-bit
  // words, 4 kb + {0: row a_row, k a_k..+1; 1: row a_row + 8, the same k; 2: row a_row, k a_k +
  // 8..+9; 3: row a_row + 8, k a_k + 8..+9}, with a_k = 2 (lane % 4).
  Tensor tCrA = thr.partition_fragment_A(make_tensor(make_smem_ptr(static_cast<Bf16*>(nullptr)),
                                                     Layout<Shape<Int<kRows>, Int<kTileK>>>{}));
  static_assert(decltype(size(tCrA))::value == 32, "one k tile of 8 bf16 per k16 block");
  std::uint32_t* a_words = reinterpret_cast<std::uint32_t*>(tCrA.data());
  Tensor a_coord = thr.partition_A(make_identity_tensor(Shape<Int<kRows>, Int<kTileK>>{}));
  const int a_row = get<0>(a_coord(0)), a_k = get<1>(a_coord(0));
  Tensor accum = partition_fragment_C(mma, Shape<Int<kRows>, Int<kTokens>>{});
  Tensor coord = thr.partition_C(make_identity_tensor(Shape<Int<kRows>, Int<kTokens>>{}));
  // The bytes of this thread's weights in a row's k16 block of codes (byte_perm selectors): MXFP8
  // bytes a_k, a_k + 1 (of the block's first 8) and the same of its last 8; E2M1 bytes a_k / 2 and
  // a_k / 2 + 4 (two codes each).
  const std::uint32_t pick8 = static_cast<std::uint32_t>(a_k | (a_k + 1) << 4);
  const std::uint32_t pick4 = static_cast<std::uint32_t>(a_k / 2 | (a_k / 2 + 4) << 4);

  int k_tiles_before = 0;  // the ring's position at the tile's first k tile
  for (int tile = static_cast<int>(blockIdx.x); tile < tiles; tile += static_cast<int>(gridDim.x)) {
    const TilePlace at = place_of(s.tile_end, groups, weight_blocks, kTokens, tile);
    const int m = args.arrays.problems[at.g].m;
    const std::uint8_t* scale_rows[2];
#pragma unroll
    for (int i = 0; i < 2; ++i)
      scale_rows[i] = matrix_row(args.w.scales, scale_row_bytes, at.g, n,
                                 weight_row<kActivates>(a_row + 8 * i, at.n0 / kRows, n));

    // The k tile's block scales of both rows, decoded once per k tile (before its block 0): MXFP8
    // as fp32 bits, E2M1's as bf16 in both halves (bf16x2_scale); MX 2 blocks, NVFP4 4.
    constexpr int kTileBlocks = kTileK / kBlock;
    std::uint32_t tile_scales[2][kTileBlocks];
    const auto load_scales = [&](int stage, int kt) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const std::uintptr_t scale_at =
            reinterpret_cast<std::uintptr_t>(scale_rows[i] + kt * kTileBlocks);
        const std::uint32_t codes = s.scale_words[stage][a_row + 8 * i] >> (8 * (scale_at & 3));
#pragma unroll
        for (int b = 0; b < kTileBlocks; ++b) {
          const float scale = group_scale<P>(codes >> (8 * b), 0);
          tile_scales[i][b] =
              PackedFormat<P>::kBits == 4 ? bf16x2_scale(scale) : __float_as_uint(scale);
        }
      }
    };
    // decode: k16 block kb of the k tile in stage `stage` into A's words 4 kb .. 4 kb + 3, exactly
    // (MXFP8 by the hardware's E4M3 conversion times the block scale, as decode8; E2M1 by
    // byte-permute tables and a bf16x2 multiply, e2m1_bf16.hpp)
    const auto decode = [&](int stage, int kb) {
      const int block = 16 * kb / kBlock;  // the k16 block's scale block
      std::uint32_t* words = a_words + 4 * kb;
      if constexpr (PackedFormat<P>::kBits == 4) {
        std::uint32_t codes[2];  // the row's 4 codes in nibbles 0..3 (k a_k, +1, +8, +9)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const uint2 v = *reinterpret_cast<const uint2*>(&s.codes[stage][a_row + 8 * i][8 * kb]);
          codes[i] = __byte_perm(v.x, v.y, pick4);
        }
        std::uint32_t out[4];  // row a_row: k a_k.., a_k + 8..; row a_row + 8: the same
        e2m1x8_to_bf16<false>(__byte_perm(codes[0], codes[1], 0x5410u), 0u, out);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const std::uint32_t scale2 = tile_scales[i][block];
          words[i] = bf16x2_mul(out[2 * i], scale2);
          words[2 + i] = bf16x2_mul(out[2 * i + 1], scale2);
        }
      } else {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const float scale = __uint_as_float(tile_scales[i][block]);
          const uint4 v = *reinterpret_cast<const uint4*>(&s.codes[stage][a_row + 8 * i][16 * kb]);
          const std::uint32_t pairs[2] = {__byte_perm(v.x, v.y, pick8),
                                          __byte_perm(v.z, v.w, pick8)};
#pragma unroll
          for (int h = 0; h < 2; ++h)  // exact values: the bf16x2 conversion only packs them
            words[2 * h + i] = e4m3x2_scaled_to_bf16x2(static_cast<std::uint16_t>(pairs[h]), scale);
        }
      }
    };
    const auto release = [&](int stage) {  // after the WGMMAs that read `stage` retired
      if (signals) Barrier::arrive(&s.empty[stage]);
    };

    // The stage of the tile's k tile kt, once it is full.
    const int first_position = k_tiles_before;
    k_tiles_before += k_tiles;
    const auto full_stage = [&](int kt) {
      const RingPosition r = ring_at<kStages>(first_position + kt);
      Barrier::wait(&s.full[r.stage], r.phase);
      return r.stage;
    };
    // This pair's k tiles: half, half + kPairs, ... (split K; none for pair 1 of a 1-k-tile K,
    // whose sums stay zero)
    constexpr int kPairs = T::kPairs;
    const int own = (k_tiles - half + kPairs - 1) / kPairs;
    if constexpr (kPairs == 2) {
      if (own == 0) {
#pragma unroll
        for (int i = 0; i < size(accum); ++i) accum(i) = 0.0f;
        if (hand_sums_to_pair_0(s.partial, accum, half, wg, wg_tid))
          finish_tile<kTokens, kActivates, false>(args, s.amax[wg], accum, coord, at, m, wg);
        continue;
      }
    }

    // One k16 WGMMA per step, at most 4 in flight (CUTLASS's mixed-input pipeline): after issuing
    // block kb, the one issued 3 before it has retired, so block kb + 1 of this k tile (or block 0
    // of the pair's next) is decoded into the registers that one read. A stage goes back to the
    // producer once block 3 of its k tile has retired (known after block 2 of the pair's next k
    // tile is issued).
    int kt = half;
    int stage = full_stage(kt), previous = 0;
    load_scales(stage, kt);
    decode(stage, 0);
    mma.accumulate_ = GMMA::ScaleOut::Zero;
    // The accumulators are fenced only around the k loop: inside it a fence is a use of their
    // registers while a WGMMA is in flight, and ptxas would wait for that WGMMA there (as it
    // does at a join of paths that waited for different counts of WGMMAs).
    warpgroup_fence_operand(accum);
    const auto issue = [&](int kb, int on_stage) {  // block kb's WGMMA, reading stage `on_stage`
      warpgroup_fence_operand(tCrA);
      warpgroup_arrive();
      cute::gemm(mma, tCrA(_, _, kb), tCrX(_, _, kb, on_stage), accum);
      mma.accumulate_ = GMMA::ScaleOut::One;
      warpgroup_commit_batch();
      warpgroup_fence_operand(tCrA);
    };
    for (int j = 0; j + 1 < own; ++j, kt += kPairs) {  // every k tile of the pair's but the last
#pragma unroll
      for (int kb = 0; kb < 4; ++kb) {
        issue(kb, stage);
        warpgroup_wait<3>();
        if (kb == 2 && j > 0) release(previous);  // the pair's k tile before's last block retired
        if (kb < 3) {
          decode(stage, kb + 1);
        } else {
          previous = stage;
          stage = full_stage(kt + kPairs);
          load_scales(stage, kt + kPairs);
          decode(stage, 0);
        }
      }
    }
#pragma unroll
    for (int kb = 0; kb < 4; ++kb) {  // the pair's last k tile
      issue(kb, stage);
      if (kb < 3) {
        warpgroup_wait<3>();
        if (kb == 2 && own > 1) release(previous);
        decode(stage, kb + 1);
      }
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(accum);
    release(stage);

    bool epilogue = true;  // (pair 0's, under split K)
    if constexpr (kPairs == 2) epilogue = hand_sums_to_pair_0(s.partial, accum, half, wg, wg_tid);
    if (epilogue)
      finish_tile<kTokens, kActivates, false>(args, s.amax[wg], accum, coord, at, m, wg);
  }
}

// `weight_codes`: the TMA descriptor of the weights' codes (e4m3::weight_codes_map). kW: the
// weights' precision: mxfp8; mxfp4, whose E2M1 codes the converter warpgroup turns into the E4M3
// codes of the same values (exact: E2M1's are E4M3 values, and both formats scale blocks of 32 by
// an E8M0); or fp8_block128 (fp32 scales per 128 x 128 weights and 1 x 128 tokens). kSendsHome
// (FC2, args.home): the results go home instead of to D, and the kernel is the round's FC2 step
// (the home kernel's frame, fc2_round: it joins the round, and the last CTA publishes done).
template <int kTokens, bool kActivates, Precision kW, bool kSendsHome>
__global__ void __launch_bounds__(e4m3::kThreads<kW>, 1)
    packed_e4m3_gemm_kernel(Args args, const __grid_constant__ CUtensorMap weight_codes) {
  // Sending home, the kernel joins the round as the home kernel did: nothing at all when this
  // rank's round already failed; the fc2 phase's end stamped, its begin where fc1's ended.
  RoundStart start{};
  if constexpr (kSendsHome)
    start = join_round(args.home.step.state, RoundPhase::fc2, Stamps::end_only);
  const PhaseEnd phase_end{start};
  if (kSendsHome && start.skip) return;
  using S = e4m3::Smem<kTokens, kActivates, kW, kSendsHome>;
  S& s = aligned_smem<S>();
  if (threadIdx.x == 0) cute::prefetch_tma_descriptor(&weight_codes);
  e4m3::init_ring<kTokens, kW>(s);
  wait_for_previous_kernel();  // (plan wrote the problems and pointers)
  e4m3::gemm<kTokens, kActivates, kW, kSendsHome>(args, &weight_codes, s, 0);
  // Sending home, once every thread's results are on their way, the last CTA publishes done to
  // every rank (a CTA without a tile takes its ticket too).
  if constexpr (kSendsHome) finish_expert_step(args.home.step, start.round);
}

template <Precision P, int kTokens, bool kActivates, bool kE4m3, bool kSendsHome>
constexpr std::size_t smem_bytes() {
  std::size_t bytes = 1024;  // the dynamic allocation's alignment
  if constexpr (kE4m3)
    bytes += sizeof(e4m3::Smem<kTokens, kActivates, P, kSendsHome>);
  else
    bytes += sizeof(Smem<P, kTokens, kActivates>);
  return bytes;
}

// The kernel of a precision, token rows and epilogue, or the one that multiplies E4M3 codes (mxfp8,
// mxfp4), whose FC2 may send home.
template <Precision P, int kTokens, bool kActivates, bool kE4m3, bool kSendsHome>
constexpr auto kernel_of() {
  if constexpr (kE4m3)
    return packed_e4m3_gemm_kernel<kTokens, kActivates, P, kSendsHome>;
  else
    return packed_gemm_kernel<P, kTokens, kActivates>;
}

// Calls f(precision, token rows, activates, e4m3, sends home) with each as a compile-time
// constant; the E4M3 kernel only for t16_e4m3 (mxfp8, mxfp4, fp8_block128), the 16-row decoding
// tile only for nvfp4's t16, the decoding tiles only for the packed precisions (the constructor
// refuses the rest); sending home only on the E4M3 tile without an epilogue (run() refuses it
// elsewhere).
template <class F>
void with_kernel(Precision p, PackedTokenTile tile, bool activates, bool sends_home, F f) {
  const auto with_precision = [&](auto g) {
    if (p == Precision::fp8_block128)
      g(std::integral_constant<Precision, Precision::fp8_block128>{});
    else
      with_packed_precision(p, g);
  };
  with_precision([&](auto precision) {
    constexpr Precision kP = decltype(precision)::value;
    if constexpr (kP != Precision::bf16) {
      const auto with_tokens = [&](auto epilogue) {
        using std::integral_constant;
        if (tile == PackedTokenTile::t16_e4m3) {
          if constexpr (kP != Precision::nvfp4) {
            if constexpr (!decltype(epilogue)::value) {
              if (sends_home) {
                f(precision, integral_constant<int, 16>{}, epilogue, std::true_type{},
                  std::true_type{});
                return;
              }
            }
            f(precision, integral_constant<int, 16>{}, epilogue, std::true_type{},
              std::false_type{});
          }
        } else if constexpr (kP == Precision::fp8_block128) {
          return;  // (the E4M3 tile only)
        } else if (tile == PackedTokenTile::t16) {
          if constexpr (kP == Precision::nvfp4)
            f(precision, integral_constant<int, 16>{}, epilogue, std::false_type{},
              std::false_type{});
        } else if (tile == PackedTokenTile::t64) {
          f(precision, integral_constant<int, 64>{}, epilogue, std::false_type{},
            std::false_type{});
        } else if (tile == PackedTokenTile::t128) {
          f(precision, integral_constant<int, 128>{}, epilogue, std::false_type{},
            std::false_type{});
        } else {
          f(precision, integral_constant<int, 256>{}, epilogue, std::false_type{},
            std::false_type{});
        }
      };
      if constexpr (protocol::activation_format(kP) == Precision::mxfp8) {
        if (activates) {
          with_tokens(std::true_type{});
          return;
        }
      }
      with_tokens(std::false_type{});
    }
  });
}

}  // namespace

const char* PackedGroupedGemm::cannot_take(Precision precision, int groups, int n, int k) {
  if (!packed_with_block_scales(precision) && precision != Precision::fp8_block128)
    return "precision must be mxfp8, mxfp4, nvfp4 (packed weights with block scales) or "
           "fp8_block128 (E4M3 weights with 128 x 128 block scales)";
  if (precision == Precision::fp8_block128 && k % formats::kFp8Block128 != 0)
    return "fp8_block128 needs K a multiple of 128 (the tokens' 1 x 128 scales)";
  if (groups < 1 || groups > kMaxGroups) return "groups must be 1..1024";
  if (n < 1) return "N must be positive";
  if (k < kTileK || k % kTileK != 0) return "K must be a positive multiple of 64 (the k tile)";
  if (k > (1 << 22)) return "K must be at most 2^22 (a tile's token rows are 32-bit offsets)";
  return nullptr;
}

const char* PackedGroupedGemm::cannot_activate(Precision precision, int n) {
  if (!packed_with_block_scales(precision) ||
      protocol::activation_format(precision) != Precision::mxfp8)
    return "FC1 activates in the packed GEMM's epilogue only where FC2's input is MXFP8 (mxfp8, "
           "mxfp4)";
  if (n < 2 * 64 || n % (2 * 64) != 0)
    return "an activating FC1 needs N = 2I with I a positive multiple of 64";
  return nullptr;
}

PackedGroupedGemm::PackedGroupedGemm(Precision precision, int groups, int n, int k, int sm_count,
                                     int device, PackedTokenTile tile,
                                     const PackedFc1Epilogue* epilogue, GemmOutput output)
    : precision_(precision),
      tile_(tile),
      epilogue_(epilogue != nullptr ? std::optional(*epilogue) : std::nullopt),
      output_(output),
      groups_(groups),
      n_(n),
      k_(k),
      sm_count_(sm_count) {
  if (const char* why = cannot_take(precision, groups, n, k))
    throw Error(ErrorCode::unsupported, std::string("packed grouped GEMM: ") + why);
  if (const char* why = epilogue_ ? cannot_activate(precision, n) : nullptr)
    throw Error(ErrorCode::unsupported, std::string("packed grouped GEMM: ") + why);
  if ((epilogue_ || tile != PackedTokenTile::t16) && output == GemmOutput::bf16_rows)
    throw Error(
        ErrorCode::internal,
        "packed grouped GEMM: bf16 rows are FC2's on the 16-row decoding tile (t16) only (an "
        "activating FC1 stores h, the other tiles their sums)");
  if (tile == PackedTokenTile::t16_e4m3 && precision == Precision::nvfp4)
    throw Error(ErrorCode::unsupported,
                "packed grouped GEMM: the E4M3 tile (t16_e4m3) takes mxfp8, mxfp4 or fp8_block128 "
                "weights (nvfp4 runs t16)");
  if (precision == Precision::fp8_block128 && tile != PackedTokenTile::t16_e4m3)
    throw Error(ErrorCode::unsupported,
                "packed grouped GEMM: fp8_block128 runs the E4M3 tile (t16_e4m3) only (its other "
                "token counts run CUTLASS's blockwise GEMM)");
  if (tile == PackedTokenTile::t16 && precision != Precision::nvfp4)
    throw Error(
        ErrorCode::unsupported,
        "packed grouped GEMM: the 16-row decoding tile (t16) takes nvfp4 weights only (mxfp8 "
        "and mxfp4 run t16_e4m3)");
  sm_count_ = grid_sms(device, sm_count);
  // Both kernels of an E4M3 FC2 (D, or sending home: run() picks by its `home`)
  for (const bool sends_home : {false, true}) {
    if (sends_home && !sends_home_kernel()) break;
    with_kernel(precision, tile, epilogue_.has_value(), sends_home,
                [&](auto p, auto tokens, auto activating, auto e4m3, auto home) {
                  constexpr Precision kP = decltype(p)::value;
                  constexpr int kTokens = decltype(tokens)::value;
                  constexpr bool kActivates = decltype(activating)::value;
                  constexpr bool kE4m3 = decltype(e4m3)::value;
                  constexpr bool kHome = decltype(home)::value;
                  constexpr std::size_t kSmem = smem_bytes<kP, kTokens, kActivates, kE4m3, kHome>();
                  static_assert(kSmem <= 227 * 1024, "an SM's shared memory");
                  smem_[kHome] = kSmem;
                  EPMOE_CUDA_CHECK(cudaFuncSetAttribute(
                      kernel_of<kP, kTokens, kActivates, kE4m3, kHome>(),
                      cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem)));
                });
  }
  // The arrays sliced from one allocation; with base == nullptr only measured (ScratchCursor).
  const auto slice = [g = static_cast<std::size_t>(groups)](std::uint8_t* base,
                                                            std::size_t* bytes) {
    ScratchCursor cursor{base};
    // (a braced list evaluates left to right: the members in their order)
    PackedGemmArrays arrays{cursor.take<GemmProblem>(g),  cursor.take<const std::uint16_t*>(g),
                            cursor.take<float*>(g),       cursor.take<std::uint16_t*>(g),
                            cursor.take<const float*>(g), cursor.take<const std::uint8_t*>(g),
                            cursor.take<const float*>(g), cursor.take<std::uint8_t*>(g),
                            cursor.take<float*>(g),       cursor.take<std::uint16_t*>(g),
                            cursor.take<const float*>(g), cursor.take<const float*>(g)};
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

PackedGemmArgs PackedGroupedGemm::args(const PackedMatrices& weights,
                                       const PackedFc2Home* home) const {
  if (home != nullptr && !sends_home_kernel())
    throw Error(ErrorCode::internal,
                "packed grouped GEMM: only the E4M3 tile's FC2 (t16_e4m3, no FC1 epilogue) sends "
                "its rows home");
  return PackedGemmArgs{arrays_,
                        weights,
                        groups_,
                        n_,
                        k_,
                        epilogue_.value_or(PackedFc1Epilogue{}),
                        home != nullptr ? *home : PackedFc2Home{},
                        output_};
}

const CUtensorMap& PackedGroupedGemm::codes_map(const PackedMatrices& weights) const {
  if (!e4m3_tokens())
    throw Error(ErrorCode::internal, "packed grouped GEMM: only the E4M3 tile reads codes by TMA");
  if (codes_map_of_ != weights.codes) {  // (the weights change rarely, if ever)
    codes_map_ = e4m3::weight_codes_map(weights.codes, groups_, n_, k_, epilogue_.has_value(),
                                        precision_ == Precision::mxfp4);
    codes_map_of_ = weights.codes;
  }
  return codes_map_;
}

void PackedGroupedGemm::run(const PackedMatrices& weights, cudaStream_t stream,
                            const PackedFc2Home* home) const {
  const Args args = this->args(weights, home);
  with_kernel(
      precision_, tile_, epilogue_.has_value(), home != nullptr,
      [&](auto p, auto tokens, auto activating, auto e4m3, auto sends_home) {
        const auto kernel =
            kernel_of<decltype(p)::value, decltype(tokens)::value, decltype(activating)::value,
                      decltype(e4m3)::value, decltype(sends_home)::value>();
        const KernelShape shape{sm_count_, smem_[decltype(sends_home)::value],
                                decltype(e4m3)::value
                                    ? e4m3::kThreads<decltype(p)::value>
                                    : TokenTile<decltype(tokens)::value>::kThreads};
        if constexpr (decltype(e4m3)::value)
          launch_chained(kernel, shape, stream, args, codes_map(weights));
        else
          launch_chained(kernel, shape, stream, args);
      });
}

}  // namespace epmoe::cuda::experts::wgmma

// The persistent round of the wgmma backend's E4M3 tile (persistent_e4m3_round.hpp; docs/design.md
// §4.3): mxfp8's and mxfp4's decode round in one cooperative launch, one CTA per SM of the tile's
// warp roles (a producer warpgroup, mxfp4's converter, four math warpgroups), which every step of
// the round uses as plain threads of the CTA:
//
//   dispatch      rows to their owners; the last CTA publishes the counts
//   route         every CTA waits for every count; rows checked, counted
//   -- barrier -- (no pairs arrived: FC2's frame with no items, the done publication)
//   bucket        the pair list
//   -- barrier --
//   plan, gather  CTA 0: each expert's M and operand pointers; every CTA: the pairs' wire rows
//                 into FC1's operand, and their home slots
//   -- barrier --
//   FC1           the E4M3 tile, activating: h as MXFP8 codes and scales
//   -- barrier --
//   FC2           the E4M3 tile, each result sent home (token_back=epilogue_warps), or its rows
//                 staged (fp32, scratch d), -- barrier --, then sent home by every CTA's warps, a
//                 warp per pair (dispatch_warps: the chain's home kernel's step); the last CTA
//                 publishes done to every rank
//   combine       every CTA waits for every rank's done; y; the last CTA advances the round
//
// FC1 and FC2 run through one ring of stages, its barriers initialized once (e4m3::init_ring,
// after dispatch and route, whose shared memory the ring reuses): FC2 starts at the ring position
// FC1 left. The protocol, bounds and faults are the chain's (the same step functions), so this
// kernel and the chain alternate round by round in one layer.
//
// Written by hand (no CUTLASS) because it is the round itself: its GEMMs are packed_gemm.cuh's.
#include "cuda/cuda_check.hpp"
#include "cuda/dispatch_step.cuh"
#include "cuda/experts/wgmma/packed_gemm.cuh"
#include "cuda/experts/wgmma/steps.cuh"
#include "cuda/persistent_e4m3_round.hpp"
#include "cuda/persistent_round.cuh"

namespace epmoe::cuda {
namespace {

namespace e4m3 = experts::wgmma::packed::e4m3;
constexpr int kTokens = 16;  // the E4M3 tile's token rows

// Both GEMMs' shared memory in one layout: the activating FC1's block amax and FC2's home slots.
template <Precision kW>
using RoundSmem = e4m3::Smem<kTokens, true, kW, true>;

template <Precision kW>
constexpr std::size_t kTileSmem = sizeof(RoundSmem<kW>) + 1024;  // (its 1024-byte alignment)

// One CTA per SM (the tile's 640 or 768 threads and ~180 KB of shared memory). kW: the weights'
// precision (mxfp8, mxfp4); kSendsHome: FC2's epilogue sends its rows home
// (token_back=epilogue_warps).
template <Precision kW, bool kSendsHome>
__global__ void __launch_bounds__(e4m3::kThreads<kW>, 1)
    persistent_e4m3_round_kernel(RoundParams p, experts::wgmma::Params e,
                                 experts::wgmma::PackedGemmArgs fc1,
                                 experts::wgmma::PackedGemmArgs fc2,
                                 const __grid_constant__ CUtensorMap w13_codes,
                                 const __grid_constant__ CUtensorMap w2_codes) {
  if (threadIdx.x == 0) {
    cute::prefetch_tma_descriptor(&w13_codes);
    cute::prefetch_tma_descriptor(&w2_codes);
  }
  persistent_round(p, e.step, [&] {
    auto& s = experts::wgmma::packed::aligned_smem<RoundSmem<kW>>();
    int ring = 0;  // the CTA's k tiles through the ring: FC2 starts where FC1 left it
    {
      // the fc1 phase: plan, gather and FC1 (the chain's plan_and_gather kernel and FC1 GEMM),
      // stamped up to the barrier after FC1 (thread 0, which stamps, is a producer thread)
      const RoundStart start = join_round(e.step.state, RoundPhase::fc1);
      const PhaseEnd phase_end{start};
      if (blockIdx.x == 0) experts::wgmma::plan_gemms(e, start.skip);
      if (!start.skip) experts::wgmma::gather_rows<e4m3::kThreads<kW>, 1>(e, start.round);
      grid_barrier(p);
      // dispatch's row staging wrote this shared memory through the generic proxy; TMA and WGMMA
      // use it through the async proxy from here on
      cutlass::arch::fence_view_async_shared();
      e4m3::init_ring<kTokens, kW>(s);  // (made visible by the GEMM's tile prefix)
      ring = e4m3::gemm<kTokens, true, kW, false>(fc1, &w13_codes, s, ring);
      grid_barrier(p);
    }
    if constexpr (kSendsHome) {
      // FC2's frame (the chain's FC2 kernel's): each result home, then done to every rank
      experts::fc2_round(e.step, [&](std::uint32_t) {
        e4m3::gemm<kTokens, false, kW, true>(fc2, &w2_codes, s, ring);
      });
    } else {
      // FC2's rows staged and a barrier every CTA meets (as every grid_barrier here), also one
      // whose round failed; then each row home (the chain's home kernel's step), done to every
      // rank
      experts::fc2_round(
          e.step,
          [&](const RoundStart& start) {
            if (!start.skip) e4m3::gemm<kTokens, false, kW, false>(fc2, &w2_codes, s, ring);
            grid_barrier(p);
          },
          [&](std::uint32_t round) {
            experts::wgmma::send_rows_home<e4m3::kThreads<kW>, false>(e, round);
          });
    }
  });
}

// Calls f(kernel, its tile's shared memory, its threads) for the precision and token-back mode.
template <class F>
decltype(auto) with_kernel(Precision precision, bool sends_home, F f) {
  const auto pick = [&](auto weights) {
    constexpr Precision kW = decltype(weights)::value;
    return sends_home
               ? f(persistent_e4m3_round_kernel<kW, true>, kTileSmem<kW>, e4m3::kThreads<kW>)
               : f(persistent_e4m3_round_kernel<kW, false>, kTileSmem<kW>, e4m3::kThreads<kW>);
  };
  if (precision == Precision::mxfp4)
    return pick(std::integral_constant<Precision, Precision::mxfp4>{});
  return pick(std::integral_constant<Precision, Precision::mxfp8>{});
}

}  // namespace

KernelShape persistent_e4m3_shape(const RoundParams& base,
                                  const experts::wgmma::WgmmaBackend& backend, TokenBucket bucket,
                                  int device, int num_sms) {
  return with_kernel(backend.problem().precision, backend.fc2_sends_home(bucket),
                     [&](auto kernel, std::size_t tile_smem, int threads) {
                       const std::size_t smem = std::max(dispatch_smem(base), tile_smem);
                       return occupancy_shape(kernel, smem, device, num_sms, threads);
                     });
}

void launch_persistent_e4m3(const RoundParams& p, const experts::wgmma::WgmmaBackend& backend,
                            TokenBucket bucket, const KernelShape& shape, cudaStream_t stream) {
  const experts::wgmma::WgmmaBackend::E4m3Round r = backend.e4m3_round(expert_step(p), bucket);
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeCooperative;  // every CTA resident, or the launch fails
  attribute.val.cooperative = 1;
  with_kernel(backend.problem().precision, r.fc2_sends_home, [&](auto kernel, std::size_t, int) {
    launch_with(attribute, kernel, shape, stream, p, r.params, r.fc1, r.fc2, r.w13_codes,
                r.w2_codes);
  });
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epmoe::cuda

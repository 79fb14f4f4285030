// The persistent round kernel (persistent_round.hpp; docs/design.md §4.3). One CTA role: every CTA
// runs every step, grid-stride, as the chain's kernels do, and the CTAs meet at a grid barrier
// wherever the chain has a kernel boundary that carries data:
//
//   dispatch      rows to their owners; the last CTA publishes the counts
//   route         every CTA waits for every count (its own rank's too: so every CTA's dispatch
//                 stores and counter zeroing are done); rows checked, decoded, counted
//   -- barrier -- route's last CTA has written the offsets
//   (no pairs arrived: FC2's frame with no items, the done publication; an idle round meets
//   only here)
//   bucket        the pair list
//   -- barrier --
//   FC1           the backend's (experts/mma/steps.cuh)
//   -- barrier --
//   quantize h    FC2's input quantization point, one h row at a time
//   -- barrier --
//   FC2           results home; the last CTA publishes done to every rank
//   combine       every CTA waits for every rank's done; y; the last CTA advances the round
//
// The two waits on peers need no barrier around them: the last CTA of dispatch and of FC2 publishes
// only after every CTA's stores (last_cta_done), and every CTA waits for that publication itself.
//
// Written by hand (no CUTLASS) because it is the round itself, not a GEMM: the GEMM tiles are the
// tensor-core backend's, shared with its chain kernels.
#include <algorithm>

#include "cuda/cuda_check.hpp"
#include "cuda/dispatch_step.cuh"
#include "cuda/experts.hpp"
#include "cuda/experts/mma/mma_backend.hpp"
#include "cuda/experts/mma/steps.cuh"
#include "cuda/persistent_e4m3_round.hpp"
#include "cuda/persistent_round.cuh"
#include "cuda/persistent_round.hpp"

namespace epmoe::cuda {
namespace {

// Two CTAs per SM: the mma tile's at most 110 KB of shared memory each, so at most 128 registers.
// One kernel per activation and weight precision (the tile's format).
template <Activation kActivation, Precision P>
__global__ void __launch_bounds__(kThreads, 2)
    persistent_round_kernel(RoundParams p, experts::mma::Params e) {
  persistent_round(p, e.step, [&] {
    experts::mma::fc1_step<kActivation, P>(e);
    grid_barrier(p);
    if constexpr (!experts::fc1_epilogue_quantizes(P)) {  // NVFP4: the whole h row
      experts::mma::quantize_h_step(e);
      grid_barrier(p);
    }
    experts::mma::fc2_step<P>(e);
  });
}

// Calls f(kernel, the tile's shared memory bytes) for the problem's activation and precision.
template <class F>
decltype(auto) with_kernel(const experts::ExpertProblem& problem, F f) {
  return experts::with_activation(problem.activation, [&](auto activation) {
    return experts::with_packed_precision(problem.precision, [&](auto precision) {
      constexpr Precision P = decltype(precision)::value;
      return f(persistent_round_kernel<decltype(activation)::value, P>,
               experts::mma::kSmemBytes<P>);
    });
  });
}

}  // namespace

std::string PersistentRound::cannot_run(const experts::ExpertBackend& backend, TokenBucket bucket) {
  if (dynamic_cast<const experts::mma::MmaBackend*>(&backend) != nullptr) return {};
  if (const auto* w = dynamic_cast<const experts::wgmma::WgmmaBackend*>(&backend)) {
    if (w->runs_e4m3_tile(bucket)) return {};
    return std::string(
               "the wgmma backend has a persistent round only for mxfp8's and mxfp4's "
               "E4M3 tile (knobs.") +
           to_string(bucket) +
           ".block_m=64 and at most 16 rows per expert: docs/tuning.md), and this bucket runs "
           "kernels of the chain; use expert_math=tensor_core, or megakernel=false";
  }
  return std::string("the ") + backend.name() +
         " backend has no persistent round (its GEMMs run as kernels of the chain); the "
         "persistent round runs the tensor-core backend's tiles and the wgmma backend's E4M3 "
         "tile: use expert_math=tensor_core, or megakernel=false";
}

PersistentRound::PersistentRound(const RoundParams& base, const experts::ExpertBackend& backend,
                                 const LayerConfig& config, int device)
    : mma_(dynamic_cast<const experts::mma::MmaBackend*>(&backend)),
      wgmma_(dynamic_cast<const experts::wgmma::WgmmaBackend*>(&backend)) {
  if (wgmma_ != nullptr) {
    shapes_ = per_bucket(config, [&](const Knobs& k, TokenBucket bucket) {
      return wgmma_->runs_e4m3_tile(bucket)
                 ? persistent_e4m3_shape(base, *wgmma_, bucket, device, k.num_sms)
                 : KernelShape{};
    });
    return;
  }
  if (mma_ == nullptr)
    throw Error(ErrorCode::internal, std::string("PersistentRound: backend ") + backend.name() +
                                         " has no persistent round");
  const experts::ExpertProblem& problem = mma_->problem();
  shapes_ = per_bucket(config, [&](const Knobs& k) {
    return with_kernel(problem, [&](auto kernel, std::size_t tile_smem) {
      const std::size_t smem =
          std::max({dispatch_smem(base), tile_smem, experts::fc2_input_smem(problem)});
      return occupancy_shape(kernel, smem, device, k.num_sms);
    });
  });
}

void PersistentRound::launch(const RoundParams& p, TokenBucket bucket, cudaStream_t stream) const {
  const KernelShape& shape = shapes_[bucket_index(bucket)];
  if (wgmma_ != nullptr) {
    if (shape.grid == 0)
      throw Error(ErrorCode::internal, std::string("PersistentRound: bucket ") + to_string(bucket) +
                                           ": " + cannot_run(*wgmma_, bucket));
    launch_persistent_e4m3(p, *wgmma_, bucket, shape, stream);
    return;
  }
  const experts::mma::Params e = mma_->params(expert_step(p));
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeCooperative;  // every CTA resident, or the launch fails
  attribute.val.cooperative = 1;
  with_kernel(e.problem, [&](auto kernel, std::size_t) {
    launch_with(attribute, kernel, shape, stream, p, e);
  });
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epmoe::cuda

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

#include "cuda/combine_step.cuh"
#include "cuda/cuda_check.hpp"
#include "cuda/dispatch_step.cuh"
#include "cuda/experts.hpp"
#include "cuda/experts/mma/mma_backend.hpp"
#include "cuda/experts/mma/steps.cuh"
#include "cuda/persistent_round.hpp"
#include "cuda/route_steps.cuh"

namespace epmoe::cuda {
namespace {

// Every thread of every CTA calls it: returns once every CTA of the grid has called it, with every
// CTA's earlier stores visible (the fences of cooperative groups' grid sync). Bounded: a CTA that
// waits past timeout_ms (0: forever, as every wait) fails the round (Phase::grid_barrier, an
// internal fault: a cooperative launch has every CTA resident, and every step's waits are bounded),
// and a CTA whose rank's round has failed stops waiting (the steps after it do nothing then).
__device__ void grid_barrier(const RoundParams& p) {
  __syncthreads();
  if (threadIdx.x == 0) {
    RoundState* s = p.state;
    const ::cuda::atomic_ref<std::uint32_t, ::cuda::thread_scope_device> generation(
        s->barrier_generation);
    const std::uint32_t passed = generation.load(::cuda::std::memory_order_relaxed);
    __threadfence();  // this CTA's stores, and the read above, before its arrival
    if (atomicAdd(&s->barrier_arrived, 1u) == gridDim.x - 1) {
      atomicExch(&s->barrier_arrived, 0u);
      generation.store(passed + 1, ::cuda::std::memory_order_release);
    } else {
      DevicePlatform platform;
      const protocol::Deadline deadline = protocol::deadline_after_ms(platform, p.timeout_ms);
      for (std::uint32_t i = 1; generation.load(::cuda::std::memory_order_acquire) == passed; ++i) {
        if (round_failed(s)) break;
        if (i % 64 == 0 && !deadline.forever() && platform.now_ns() > deadline.at_ns) {
          const DeviceSession session(p.layout, DevicePeers{p.peer_windows}, p.rank, s->round);
          fail_round(p, session,
                     protocol::WaitOutcome{protocol::WaitStatus::timeout, p.rank, s->round, 0},
                     Phase::grid_barrier);
          break;
        }
        __nanosleep(32);
      }
    }
    __threadfence();
  }
  __syncthreads();
}

// After route's barrier, the same answer in every CTA: whether this round goes on to the GEMMs
// (it has not failed, and some pair arrived).
__device__ bool round_has_pairs(const RoundParams& p) {
  __shared__ bool has_pairs;
  if (threadIdx.x == 0)
    has_pairs = !round_failed(p.state) && __ldcg(&p.scratch.pair_offset[p.local_experts]) > 0;
  __syncthreads();
  return has_pairs;
}

// Two CTAs per SM: the mma tile's at most 110 KB of shared memory each, so at most 128 registers.
// One kernel per activation and weight precision (the tile's format).
template <Activation kActivation, Precision P>
__global__ void __launch_bounds__(kThreads, 2)
    persistent_round_kernel(RoundParams p, experts::mma::Params e) {
  dispatch_step(p);
  route_step(p);
  grid_barrier(p);
  if (!round_has_pairs(p)) {
    // No pair arrived on this rank: FC2's frame with no items, so done still goes to every rank.
    experts::fc2_round(e.step, [](std::uint32_t) {});
  } else {
    bucket_step(p);
    grid_barrier(p);
    experts::mma::fc1_step<kActivation, P>(e);
    grid_barrier(p);
    if constexpr (!experts::fc1_epilogue_quantizes(P)) {  // NVFP4: the whole h row
      experts::mma::quantize_h_step(e);
      grid_barrier(p);
    }
    experts::mma::fc2_step<P>(e);
  }
  combine_step(p);
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

const experts::mma::MmaBackend& mma_backend(const experts::ExpertBackend& backend) {
  const auto* mma = dynamic_cast<const experts::mma::MmaBackend*>(&backend);
  if (mma == nullptr)
    throw Error(ErrorCode::internal, std::string("PersistentRound: backend ") + backend.name() +
                                         ": " + PersistentRound::cannot_run(backend));
  return *mma;
}

}  // namespace

std::string PersistentRound::cannot_run(const experts::ExpertBackend& backend) {
  if (dynamic_cast<const experts::mma::MmaBackend*>(&backend) != nullptr) return {};
  return std::string("the ") + backend.name() +
         " backend has no persistent round (its GEMMs run as kernels of the chain); the "
         "persistent round runs the tensor-core backend's tiles: use expert_math=tensor_core, or "
         "megakernel=false";
}

PersistentRound::PersistentRound(const RoundParams& base, const experts::ExpertBackend& backend,
                                 const LayerConfig& config, int device)
    : backend_(mma_backend(backend)) {
  const experts::ExpertProblem& problem = backend_.problem();
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
  const experts::mma::Params e = backend_.params(expert_step(p));
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeCooperative;  // every CTA resident, or the launch fails
  attribute.val.cooperative = 1;
  with_kernel(e.problem, [&](auto kernel, std::size_t) {
    launch_with(attribute, kernel, shape, stream, p, e);
  });
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epmoe::cuda

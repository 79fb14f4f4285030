// The persistent round's frame (docs/design.md §4.3), shared by its kernels (persistent_round.cu:
// the tensor-core backend's tiles; persistent_e4m3_round.cu: the wgmma backend's E4M3 tile): the
// bounded grid barrier, the one answer every CTA reads after route, and the round around a
// backend's expert steps.
#pragma once

#include <cstdint>

#include "cuda/combine_step.cuh"
#include "cuda/device_common.cuh"
#include "cuda/dispatch_step.cuh"
#include "cuda/experts/common.cuh"  // fc2_round
#include "cuda/kernels.hpp"
#include "cuda/route_steps.cuh"

namespace epmoe::cuda {

// Every thread of every CTA calls it: returns once every CTA of the grid has called it, with every
// CTA's earlier stores visible (the fences of cooperative groups' grid sync). Bounded: a CTA that
// waits past timeout_ms (0: forever, as every wait) fails the round (Phase::grid_barrier, an
// internal fault: a cooperative launch has every CTA resident, and every step's waits are bounded),
// and a CTA whose rank's round has failed stops waiting (the steps after it do nothing then).
__device__ inline void grid_barrier(const RoundParams& p) {
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
__device__ inline bool round_has_pairs(const RoundParams& p) {
  __shared__ bool has_pairs;
  if (threadIdx.x == 0)
    has_pairs = !round_failed(p.state) && __ldcg(&p.scratch.pair_offset[p.local_experts]) > 0;
  __syncthreads();
  return has_pairs;
}

// The round around a backend's expert steps, called by every thread of every CTA: dispatch, route
// and the barrier after it; with no pair arrived on this rank, FC2's frame with no items (done
// still goes to every rank), else bucket, a barrier and `expert_steps()` (FC1 to FC2, which ends
// in the done publication); then combine.
template <class ExpertSteps>
__device__ __forceinline__ void persistent_round(const RoundParams& p,
                                                 const experts::ExpertStep& step,
                                                 ExpertSteps expert_steps) {
  dispatch_step(p);
  route_step(p);
  grid_barrier(p);
  if (!round_has_pairs(p)) {
    experts::fc2_round(step, [](std::uint32_t) {});
  } else {
    bucket_step(p);
    grid_barrier(p);
    expert_steps();
  }
  combine_step(p);
}

}  // namespace epmoe::cuda

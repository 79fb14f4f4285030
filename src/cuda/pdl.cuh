// Programmatic dependent launch, device side (docs/design.md §4): the one wait every kernel
// launched with the PDL attribute runs before its first global access — the chain kernels'
// prologues (device_common.cuh), the packed GEMM's and the wgmma backend's CUTLASS GEMMs
// (grouped_gemm_parts.cuh). No kernel triggers its dependents early
// (griddepcontrol.launch_dependents): the trigger is implicit at each kernel's end, so the next
// launch is already queued when a kernel completes. Early triggers first thing in every chain
// kernel were measured on an H200 (session 29, bench/RESULTS.md) and lost: the idle round
// 3-4 us slower, nvfp4 at T >= 4 13-20 us slower, nothing faster.
#pragma once

#include <cuda_runtime.h>

namespace epmoe::cuda {

// Wait until the previous kernel on the stream has completed and its memory is visible; a kernel
// launched without the attribute returns at once.
__device__ __forceinline__ void wait_for_previous_kernel() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

}  // namespace epmoe::cuda

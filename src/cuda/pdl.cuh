// Programmatic dependent launch, device side (docs/design.md §4): the one wait every kernel
// launched with the PDL attribute runs before its first global access — the chain kernels'
// prologues (device_common.cuh) and the wgmma backend's CUTLASS GEMMs (grouped_gemm_parts.cuh).
#pragma once

#include <cuda_runtime.h>

namespace epmoe::cuda {

// Wait until the previous kernel on the stream has completed and its memory is visible; a kernel
// launched without the attribute returns at once.
__device__ __forceinline__ void wait_for_previous_kernel() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

}  // namespace epmoe::cuda

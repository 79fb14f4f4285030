// Programmatic dependent launch, device side (docs/design.md §4): the one wait every kernel
// launched with the PDL attribute runs before its first global access — the chain kernels'
// prologues (device_common.cuh), the packed GEMM's and the wgmma backend's CUTLASS GEMMs
// (grouped_gemm_parts.cuh) — and the early trigger that lets the next kernel's CTAs be scheduled,
// called by every kernel of the chain whose next kernel is the layer's own.
#pragma once

#include <cuda_runtime.h>

namespace epmoe::cuda {

// Wait until the previous kernel on the stream has completed and its memory is visible; a kernel
// launched without the attribute returns at once.
__device__ __forceinline__ void wait_for_previous_kernel() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

// Lets the next kernel on the stream, when it was launched with the PDL attribute, be scheduled
// once every CTA of this grid has called this (or exited): its CTAs may become resident while this
// kernel runs and stop at their own wait_for_previous_kernel, which still returns only after this
// kernel has completed (which is after its own predecessor completed) and its memory is visible.
// So the next kernel's launch and CTA placement overlap this one instead of following its last
// CTA. Safe because every kernel the layer launches with the attribute waits before its first
// global access, and a grid's dependents start only once all of its CTAs are resident (no
// starvation). Called first by the chain's kernels whose next kernel is the layer's own (the
// GEMMs right after their wait), but by route only after its wait for its peers' counts (else the
// kernels after it would stack up resident through that wait), and not by combine nor the
// persistent rounds, whose next kernel on the stream may be the caller's (which would then sit
// resident through the round's waits).
__device__ __forceinline__ void allow_next_kernel() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

}  // namespace epmoe::cuda

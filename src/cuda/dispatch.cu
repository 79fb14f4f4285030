// The chain's first kernel: dispatch (dispatch_step.cuh), launched plainly (it is the first of a
// forward, so it has no predecessor to overlap with), with the bucket's Knobs::dispatch_warps warps
// per CTA (the step takes any CTA size: every loop strides by blockDim.x).
#include <algorithm>

#include "cuda/cuda_check.hpp"
#include "cuda/dispatch_step.cuh"
#include "cuda/kernels.hpp"

namespace epmoe::cuda {
namespace {

__global__ void __launch_bounds__(kKnobSpace.max_dispatch_warps * 32)
    dispatch_kernel(RoundParams p) {
  dispatch_step</*kFromCodes=*/true>(p);
}

}  // namespace

KernelShape dispatch_shape(const RoundParams& p, int device, int num_sms, int warps) {
  return occupancy_shape(
      dispatch_kernel, dispatch_smem(p), device, num_sms,
      32 * std::clamp(warps, kKnobSpace.min_dispatch_warps, kKnobSpace.max_dispatch_warps));
}

void launch_dispatch(const RoundParams& p, const KernelShape& s, cudaStream_t stream) {
  dispatch_kernel<<<s.grid, s.threads, s.smem, stream>>>(p);
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epmoe::cuda

// The chain's first kernel: dispatch (dispatch_step.cuh), launched plainly (it is the first of a
// forward, so it has no predecessor to overlap with).
#include "cuda/cuda_check.hpp"
#include "cuda/dispatch_step.cuh"
#include "cuda/kernels.hpp"

namespace epmoe::cuda {
namespace {

__global__ void __launch_bounds__(kThreads) dispatch_kernel(RoundParams p) {
  dispatch_step(p);
}

}  // namespace

KernelShape dispatch_shape(const RoundParams& p, int device, int num_sms) {
  return occupancy_shape(dispatch_kernel, dispatch_smem(p), device, num_sms);
}

void launch_dispatch(const RoundParams& p, const KernelShape& s, cudaStream_t stream) {
  dispatch_kernel<<<s.grid, kThreads, s.smem, stream>>>(p);
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epmoe::cuda

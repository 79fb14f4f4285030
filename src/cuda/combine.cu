// The chain's last kernel: combine (combine_step.cuh), launched after the expert step with
// programmatic dependent launch.
#include "cuda/combine_step.cuh"
#include "cuda/cuda_check.hpp"

namespace epmoe::cuda {
namespace {

__global__ void __launch_bounds__(kThreads) combine_kernel(RoundParams p) {
  combine_step(p);
}

}  // namespace

KernelShape combine_shape(const RoundParams& /*p*/, int device, int num_sms) {
  return occupancy_shape(combine_kernel, 0, device, num_sms);
}

void launch_combine(const RoundParams& p, const KernelShape& s, cudaStream_t stream) {
  launch_chained(combine_kernel, KernelShape{s.grid, 0}, stream, p);
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epmoe::cuda

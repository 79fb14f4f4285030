// The chain's quantize-h kernel of the tensor-core backend (quantize_h_step, steps.cuh).
#include "cuda/experts/mma/steps.cuh"

namespace epmoe::cuda::experts::mma {
namespace {

__global__ void __launch_bounds__(kThreads) quantize_h_kernel(Params p) {
  quantize_h_step(p);
}

}  // namespace

KernelShape quantize_h_shape(const ExpertProblem& problem, int device, int num_sms) {
  return occupancy_shape(quantize_h_kernel, fc2_input_smem(problem), device, num_sms);
}

void launch_quantize_h(const Params& p, const KernelShape& s, cudaStream_t stream) {
  launch_chained(quantize_h_kernel, s, stream, p);
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epmoe::cuda::experts::mma

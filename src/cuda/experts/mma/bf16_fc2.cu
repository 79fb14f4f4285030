// The chain's FC2 kernel of the tensor-core backend (fc2_step, steps.cuh).
#include "cuda/experts/mma/steps.cuh"

namespace epmoe::cuda::experts::mma {
namespace {

__global__ void __launch_bounds__(kThreads, 2) bf16_fc2_kernel(Params p) {
  fc2_step(p);
}

}  // namespace

KernelShape fc2_shape(int device, int num_sms) {
  return occupancy_shape(bf16_fc2_kernel, kSmemBytes, device, num_sms);
}

void launch_fc2(const Params& p, const KernelShape& s, cudaStream_t stream) {
  launch_chained(bf16_fc2_kernel, s, stream, p);
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epmoe::cuda::experts::mma

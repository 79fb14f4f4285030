// The chain's FC1 kernel of the tensor-core backend (fc1_step, steps.cuh).
#include "cuda/experts/mma/steps.cuh"

namespace epmoe::cuda::experts::mma {
namespace {

template <Activation kActivation>
__global__ void __launch_bounds__(kThreads, 2) bf16_fc1_kernel(Params p) {
  fc1_step<kActivation>(p);
}

}  // namespace

KernelShape fc1_shape(const ExpertProblem& problem, int device, int num_sms) {
  return with_activation(problem.activation, [&](auto activation) {
    return occupancy_shape(bf16_fc1_kernel<decltype(activation)::value>, kSmemBytes, device,
                           num_sms);
  });
}

void launch_fc1(const Params& p, const KernelShape& s, cudaStream_t stream) {
  with_activation(p.problem.activation, [&](auto activation) {
    launch_chained(bf16_fc1_kernel<decltype(activation)::value>, s, stream, p);
  });
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epmoe::cuda::experts::mma

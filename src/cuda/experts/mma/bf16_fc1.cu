// The chain's FC1 kernel of the tensor-core backend (fc1_step, steps.cuh).
#include "cuda/experts/mma/steps.cuh"

namespace epmoe::cuda::experts::mma {
namespace {

template <Activation kActivation, Precision P>
__global__ void __launch_bounds__(kThreads, 2) bf16_fc1_kernel(Params p) {
  fc1_step<kActivation, P>(p);
}

// Calls f(kernel, shared memory bytes) with the kernel of the problem's activation and precision.
template <class F>
decltype(auto) with_fc1_kernel(const ExpertProblem& problem, F f) {
  return with_activation(problem.activation, [&](auto activation) {
    return with_packed_precision(problem.precision, [&](auto precision) {
      constexpr Precision P = decltype(precision)::value;
      return f(bf16_fc1_kernel<decltype(activation)::value, P>, kSmemBytes<P>);
    });
  });
}

}  // namespace

KernelShape fc1_shape(const ExpertProblem& problem, int device, int num_sms) {
  return with_fc1_kernel(problem, [&](auto kernel, std::size_t smem) {
    return occupancy_shape(kernel, smem, device, num_sms);
  });
}

void launch_fc1(const Params& p, const KernelShape& s, cudaStream_t stream) {
  with_fc1_kernel(p.problem,
                  [&](auto kernel, std::size_t) { launch_chained(kernel, s, stream, p); });
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epmoe::cuda::experts::mma

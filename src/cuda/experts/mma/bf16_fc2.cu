// The chain's FC2 kernel of the tensor-core backend (fc2_step, steps.cuh).
#include "cuda/experts/mma/steps.cuh"

namespace epmoe::cuda::experts::mma {
namespace {

template <Precision P>
__global__ void __launch_bounds__(kThreads, 2) bf16_fc2_kernel(Params p) {
  fc2_step<P>(p);
}

}  // namespace

KernelShape fc2_shape(const ExpertProblem& problem, int device, int num_sms) {
  return with_packed_precision(problem.precision, [&](auto precision) {
    constexpr Precision P = decltype(precision)::value;
    return occupancy_shape(bf16_fc2_kernel<P>, kSmemBytes<P>, device, num_sms);
  });
}

void launch_fc2(const Params& p, const KernelShape& s, cudaStream_t stream) {
  with_packed_precision(p.problem.precision, [&](auto precision) {
    launch_chained(bf16_fc2_kernel<decltype(precision)::value>, s, stream, p);
  });
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epmoe::cuda::experts::mma

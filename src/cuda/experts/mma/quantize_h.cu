// The tensor-core backend's FC2 input quantization point (fc2_input.cuh) on every h row of this
// round. A kernel of its own because an NVFP4 row scale needs the whole intermediate row, which
// FC1 spreads over tiles.
#include "cuda/experts/common.cuh"
#include "cuda/experts/fc2_input.cuh"
#include "cuda/experts/mma/params.hpp"

namespace epmoe::cuda::experts::mma {
namespace {

__global__ void __launch_bounds__(kThreads) quantize_h_kernel(Params p) {
  extern __shared__ __align__(16) std::uint8_t smem[];
  const ExpertProblem& problem = p.problem;
  const RoundStart start = join_round(p.step.state, RoundPhase::fc1);
  const PhaseEnd phase_end{start};
  if (start.skip) return;
  const std::uint32_t pairs = p.step.in.pair_offset[problem.local_experts];
  for (std::uint32_t pair = blockIdx.x; pair < pairs; pair += gridDim.x) {
    const std::size_t at = static_cast<std::size_t>(pair) * problem.intermediate;
    quantize_h_row(RowGroup::cta(), problem, smem, p.h + at, p.h16 + at, p.h_scale + pair);
  }
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

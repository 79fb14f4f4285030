// The exact backend's FC2 input quantization point (docs/design.md §6 point 3: one row is one
// NVFP4 group), on every h row of this round, in place, with the same CTA-wide codec as the wire
// (quantize_row_block). A kernel of its own because an NVFP4 row scale needs the whole
// intermediate row, which FC1 spreads over many tiles; FC2 tiles then read h as plain floats.
#include "cuda/experts/common.cuh"
#include "cuda/experts/exact/params.hpp"
#include "cuda/row_codec.cuh"

namespace epmoe::cuda::experts::exact {
namespace {

// Shared memory: [quantization bytes of an I-row][scratch: one float per warp]
std::size_t quantize_h_smem(const ExpertProblem& problem) {
  return protocol::align16(protocol::wire_payload_bytes(problem.precision, problem.intermediate)) +
         32 * 4;
}

__global__ void __launch_bounds__(kThreads) quantize_h_kernel(Params p) {
  extern __shared__ __align__(16) std::uint8_t smem[];
  const ExpertProblem& problem = p.problem;
  std::uint8_t* bytes = smem;
  auto* scratch = reinterpret_cast<float*>(smem + protocol::align16(protocol::wire_payload_bytes(
                                                      problem.precision, problem.intermediate)));
  const RoundStart start = join_round(p.step.state, RoundPhase::fc1);
  const PhaseEnd phase_end{start};
  if (start.skip) return;
  const std::uint32_t pairs = p.step.in.pair_offset[problem.local_experts];
  for (std::uint32_t pair = blockIdx.x; pair < pairs; pair += gridDim.x) {
    float* h = p.h + static_cast<std::size_t>(pair) * problem.intermediate;
    quantize_row_block(RowGroup::cta(), h, problem.intermediate, problem.precision,
                       problem.rounding, bytes, scratch);
  }
}

}  // namespace

KernelShape quantize_h_shape(const ExpertProblem& problem, int device, int num_sms) {
  return occupancy_shape(quantize_h_kernel, quantize_h_smem(problem), device, num_sms);
}

void launch_quantize_h(const Params& p, const KernelShape& s, cudaStream_t stream) {
  launch_chained(quantize_h_kernel, s, stream, p);
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epmoe::cuda::experts::exact

// Expert step, part 3: FC2's input quantization point (DESIGN §6: one row is one NVFP4 group), on
// every h row of this round, in place, with the same CTA-wide codec as the wire
// (quantize_row_block). A kernel of its own because an NVFP4 row scale needs the whole
// intermediate row, which FC1 spreads over many tiles; FC2 tiles then read h as plain floats.
#include "cuda/cuda_check.hpp"
#include "cuda/experts.hpp"
#include "cuda/row_codec.cuh"

namespace epmoe::cuda {
namespace {

// Shared memory: [quantization bytes of an I-row][scratch: one float per warp]
std::size_t quantize_h_smem(const ForwardParams& p) {
  return protocol::align16(protocol::wire_payload_bytes(p.precision, p.intermediate)) + 32 * 4;
}

__global__ void __launch_bounds__(kThreads) quantize_h_kernel(ForwardParams p) {
  extern __shared__ __align__(16) std::uint8_t smem[];
  std::uint8_t* bytes = smem;
  auto* scratch = reinterpret_cast<float*>(
      smem + protocol::align16(protocol::wire_payload_bytes(p.precision, p.intermediate)));
  const RoundStart start = start_round(p);
  if (start.skip) return;
  const std::uint32_t pairs = p.scratch.pair_offset[p.local_experts];
  for (std::uint32_t pair = blockIdx.x; pair < pairs; pair += gridDim.x) {
    float* h = p.scratch.h + static_cast<std::size_t>(pair) * p.intermediate;
    const float s_enc =
        quantize_row_block(h, p.intermediate, p.precision, p.rounding, bytes, scratch);
    if (p.tensor_cores) {  // FC2's bf16 operand and its row scale
      to_bf16_codes(h, p.intermediate, s_enc,
                    p.scratch.h16 + static_cast<std::size_t>(pair) * p.intermediate);
      if (threadIdx.x == 0) p.scratch.h_scale[pair] = s_enc;
    }
  }
}

}  // namespace

KernelShape quantize_h_shape(const ForwardParams& p, int device) {
  return occupancy_shape(quantize_h_kernel, quantize_h_smem(p), device);
}

void launch_quantize_h(const ForwardParams& p, const KernelShape& s, cudaStream_t stream) {
  quantize_h_kernel<<<s.grid, kThreads, s.smem, stream>>>(p);
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epmoe::cuda

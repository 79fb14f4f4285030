// FC2's input quantization point (docs/design.md §6 point 3: one h row is one NVFP4 group) for the
// bf16 tensor-core backends, written once: a RowGroup (a CTA or a slice of one) quantizes one h row
// in place with the wire's codec (quantize_row_block), then stores its exact bf16 codes and scale,
// FC2's operand.
#pragma once

#include <cstdint>

#include "cuda/experts/fc2_input_code.hpp"
#include "cuda/experts/inputs.hpp"
#include "cuda/row_codec.cuh"
#include "protocol/wire.hpp"

namespace epmoe::cuda::experts {

// Shared memory a group needs: [quantization bytes of an I-row][one float per warp].
EPMOE_HD std::size_t fc2_input_smem(const ExpertProblem& problem) {
  return protocol::align16(protocol::wire_payload_bytes(problem.precision, problem.intermediate)) +
         32 * 4;
}

// Called by every thread of the group; `smem` holds fc2_input_smem(problem) bytes.
__device__ inline void quantize_h_row(const RowGroup& g, const ExpertProblem& problem,
                                      std::uint8_t* smem, float* h, std::uint16_t* h16,
                                      float* h_scale) {
  auto* scratch = reinterpret_cast<float*>(smem + protocol::align16(protocol::wire_payload_bytes(
                                                      problem.precision, problem.intermediate)));
  const float s_enc = quantize_row_block(g, h, problem.intermediate, problem.precision,
                                         problem.rounding, smem, scratch);
  to_bf16_codes(g, h, problem.intermediate, s_enc, h16);
  if (g.rank == 0) *h_scale = s_enc;
}

}  // namespace epmoe::cuda::experts

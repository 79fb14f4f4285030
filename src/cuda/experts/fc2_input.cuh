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

// fp8_block128's FC2 input for an E4M3 GEMM: the h row's wire encoding (the codes and their 1 x 128
// fp32 scales, decode(encode(h)) being the reference's quantization point) copied out as they are.
// Called by every thread of the group; `smem` holds fc2_input_smem(problem) bytes.
__device__ inline void encode_h_row_fp8(const RowGroup& g, const ExpertProblem& problem,
                                        std::uint8_t* smem, const float* h, std::uint8_t* codes,
                                        float* scales) {
  const std::int64_t n = problem.intermediate;
  auto* scratch = reinterpret_cast<float*>(
      smem + protocol::align16(protocol::wire_payload_bytes(problem.precision, n)));
  encode_row_block(g, h, n, problem.precision, problem.rounding, smem, scratch);
  g.sync();
  for (std::int64_t v = g.rank; v < n / 16; v += g.size)
    reinterpret_cast<uint4*>(codes)[v] = reinterpret_cast<const uint4*>(smem)[v];
  const auto* block_scales = reinterpret_cast<const float*>(smem + n);
  for (std::int64_t b = g.rank; b < n / formats::kFp8Block128; b += g.size)
    scales[b] = block_scales[b];
}

}  // namespace epmoe::cuda::experts

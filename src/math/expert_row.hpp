// One expert applied to one token row: FC1 (gate + up) [+ b13] -> activation -> FC2 [+ b2], with
// float64 accumulation, fp32 outputs of each GEMM (the fast path accumulates in fp32 registers) and
// the FC2 input quantized to the layer's precision. Used by the reference forward and by the CPU
// executor, whose job is the protocol around it.
#pragma once

#include <cstdint>
#include <vector>

#include "epmoe/config.hpp"
#include "epmoe/layer.hpp"
#include "math/activation.hpp"

namespace epmoe::math {

struct ExpertMatrices {
  const float* w13 = nullptr;  // [2I, H]: gate rows then up rows (already quantize-emulated)
  const float* w2 = nullptr;   // [H, I]
  const float* b13 = nullptr;  // [2I] or nullptr: gate biases then up biases (never quantized)
  const float* b2 = nullptr;   // [H] or nullptr
};

// The bias rule every path applies to a GEMM output: the float64 sum plus the fp32 bias, rounded
// once to fp32 (without a bias, the sum rounded as before). The exact backend's kernels call it
// with their float64 accumulators, so the CPU executor and the reference stay bit-exact with them.
EPMOE_HD float biased(double sum, const float* bias, std::int64_t i) {
  return static_cast<float>(bias == nullptr ? sum : sum + static_cast<double>(bias[i]));
}
// The same for an fp32 sum (the tensor-core backends' accumulators): without a bias, the sum
// itself; with one, the fp32 sum, which is the float64 sum rounded once to fp32 (rounding twice,
// to 53 bits and then 24, is innocuous for a sum since 53 >= 2 * 24 + 1), with no float64 round
// trip for the kernels to spend instructions on.
EPMOE_HD float biased(float sum, bool has_bias, float bias) {  // the bias already loaded
  return has_bias ? sum + bias : sum;
}
EPMOE_HD float biased(float sum, const float* bias, std::int64_t i) {
  return biased(sum, bias != nullptr, bias == nullptr ? 0.0f : bias[i]);
}

// An fp32 GEMM sum of codes back to its value: v / s1 / s2 (the row's and the weight's scales), one
// scale at a time as the other backends divide (the product of two NVFP4 s_enc of tiny-amax rows
// can overflow), skipping a division by a scale of 1 (exact; bf16, mxfp8 and fp8_block128 rows and
// weights have no such scale): those divisions left the wgmma kernels issue-bound.
EPMOE_HD float unscaled(float v, float s1, float s2) {
  if (s1 != 1.0f) v /= s1;
  if (s2 != 1.0f) v /= s2;
  return v;
}

// x: [H] input row after its wire quantization; out: [H] fp32 FC2 row.
// `scratch` is resized as needed (2I floats).
void expert_forward_row(const float* x, const ExpertMatrices& expert, const LayerShape& shape,
                        Precision precision, const LayerOptions& options, float* out,
                        std::vector<float>& scratch);

// A rank's optional biases in fp32 (bf16 widened exactly), contiguous over experts; empty when the
// caller gave none. `weights` must hold host tensors, validated.
struct ExpertBiases {
  std::vector<float> b13;  // [E_local, 2I] or empty
  std::vector<float> b2;   // [E_local, H] or empty
};
ExpertBiases load_expert_biases(const ExpertWeights& weights);

}  // namespace epmoe::math

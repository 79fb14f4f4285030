// One expert applied to one token row: FC1 (gate + up) -> SwiGLU -> FC2, with float64
// accumulation, fp32 outputs of each GEMM (the fast path accumulates in fp32 registers) and the
// FC2 input quantized to the layer's precision. Used by the reference forward and by the CPU
// executor, whose job is the protocol around it.
#pragma once

#include <cstdint>
#include <vector>

#include "epmoe/config.hpp"
#include "math/activation.hpp"

namespace epmoe::math {

struct ExpertMatrices {
  const float* w13 = nullptr;  // [2I, H]: gate rows then up rows (already quantize-emulated)
  const float* w2 = nullptr;   // [H, I]
};

// x: [H] input row after its wire quantization; out: [H] fp32 FC2 row.
// `scratch` is resized as needed (2I floats).
void expert_forward_row(const float* x, const ExpertMatrices& expert, const LayerShape& shape,
                        Precision precision, const LayerOptions& options, float* out,
                        std::vector<float>& scratch);

}  // namespace epmoe::math

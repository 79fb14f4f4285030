// Quantization points of the layer, emulated on the host: each returns what the fast path computes
// with after quantizing (decode(encode(x)) in float).
#pragma once

#include <cstdint>
#include <vector>

#include "epmoe/config.hpp"
#include "epmoe/layer.hpp"

namespace epmoe::reference {

// One activation row (a token on the wire, or the FC2 input): bf16 rounding, MXFP8 blocks of 32,
// or NVFP4 with the row as the group of the second-level scale.
void emulate_activation_row(float* row, std::int64_t n, Precision precision,
                            ScaleRounding rounding);

// One weight matrix [rows, cols] quantized along cols; NVFP4 uses one second-level scale for the
// whole matrix (per expert, per FC).
std::vector<float> emulate_weight_matrix(const float* w, std::int64_t rows, std::int64_t cols,
                                         Precision precision, ScaleRounding rounding);

// A rank's experts as the GEMMs see them: every local expert's w13 [2I, H] then w2 [H, I], each
// quantize-emulated, contiguous over experts. `weights` must be host tensors (bf16 or f32).
struct EmulatedExperts {
  std::vector<float> w13;  // [E_local, 2I, H]
  std::vector<float> w2;   // [E_local, H, I]
};
EmulatedExperts emulate_expert_weights(const LayerConfig& config, const ExpertWeights& weights);

}  // namespace epmoe::reference

// Quantization points of the layer, emulated on the host: each returns what the fast path computes
// with after quantizing (decode(encode(x)) in float).
#pragma once

#include <cstdint>
#include <vector>

#include "epmoe/config.hpp"
#include "epmoe/layer.hpp"

namespace epmoe::math {

// One activation row (a token on the wire, or the FC2 input), in the layer precision's
// activation_format (protocol/wire.hpp): bf16 rounding, MXFP8 blocks of 32 (mxfp8 and mxfp4
// layers), NVFP4 with the row as the group of the second-level scale, or FP8 with one fp32 scale
// per 1 x 128 run (fp8_block128).
void emulate_activation_row(float* row, std::int64_t n, Precision precision,
                            ScaleRounding rounding);

// One weight matrix [rows, cols] quantized along cols (the reduction dim): MXFP8 / MXFP4 blocks of
// 32, NVFP4 blocks of 16 with one second-level scale for the whole matrix (per expert, per FC), or
// fp8_block128 with one fp32 scale per 128 x 128 tile along (rows, cols), edge tiles partial.
// `s_enc` (optional) receives the NVFP4 second-level scale (1 for the other precisions): the
// decoded values are code / s_enc, with code = e2m1 * block scale exact in bf16.
std::vector<float> emulate_weight_matrix(const float* w, std::int64_t rows, std::int64_t cols,
                                         Precision precision, ScaleRounding rounding,
                                         float* s_enc = nullptr);

// A rank's experts as the GEMMs see them: every local expert's w13 [2I, H] then w2 [H, I], each
// quantize-emulated (or, when given pre-quantized, decoded), contiguous over experts. `weights`
// must be validated host tensors.
struct EmulatedExperts {
  std::vector<float> w13;        // [E_local, 2I, H]
  std::vector<float> w2;         // [E_local, H, I]
  std::vector<float> w13_s_enc;  // [E_local] NVFP4 second-level scale of each matrix, else 1
  std::vector<float> w2_s_enc;   // [E_local]
};
EmulatedExperts emulate_expert_weights(const LayerConfig& config, const ExpertWeights& weights);

// The tensor-core operand of emulated weights: bf16(value * s_enc of its matrix), exact (the
// value is code / s_enc with code = e2m1 * block scale, or already a bf16 value with s_enc = 1:
// MXFP8, MXFP4's e2m1 * 2^e). Not exact for fp8_block128 (e4m3 * an fp32 scale), which the
// tensor-core backend rejects.
// `values` holds s_enc.size() matrices of equal size, one after the other.
std::vector<std::uint16_t> bf16_codes(const std::vector<float>& values,
                                      const std::vector<float>& s_enc);

}  // namespace epmoe::math

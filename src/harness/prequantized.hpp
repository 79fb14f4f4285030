// Layer weights as a checkpoint in a precision ships them: every expert quantized with epmoe's
// public host codec (epmoe/formats.hpp) into the layouts Layer takes pre-quantized
// (ExpertWeights::w13_quantized / w2_quantized). A layer built from them must compute exactly
// what a layer built from the bf16 weights computes (the tests' bit-identity check).
#pragma once

#include <cstdint>
#include <vector>

#include "epmoe/config.hpp"
#include "epmoe/layer.hpp"
#include "reference/reference.hpp"

namespace epmoe::harness {

// One FC of every expert, [E, rows, cols] quantized along cols.
struct QuantizedFc {
  std::int64_t experts = 0, rows = 0, cols = 0;
  std::vector<std::uint8_t> codes;      // E4M3 [E, rows, cols] or E2M1 pairs [E, rows, cols / 2]
  std::vector<std::uint8_t> u8_scales;  // mxfp8, mxfp4: E8M0 [E, rows, cols/32]; nvfp4: E4M3 /16
  std::vector<float> f32_scales;        // fp8_block128: [E, ceil(rows/128), ceil(cols/128)]
  std::vector<float> s_enc;             // nvfp4: [E], what quantize_nvfp4 returns per matrix
  std::vector<float> global_scale;      // nvfp4: [E], 1 / s_enc (ModelOpt's weight_scale_2)
};

struct QuantizedLayerWeights {
  Precision precision = Precision::mxfp8;
  QuantizedFc w13, w2;
};

// `precision` must not be bf16. `rounding` is the layer's mxfp8_scale_rounding (MXFP8, MXFP4).
// `nvfp4_s_enc`: when > 0, NVFP4 matrices are quantized with this static s_enc
// (quantize_nvfp4_static) instead of their own amax's.
QuantizedLayerWeights quantize_layer_weights(const reference::LayerWeights& weights,
                                             const LayerShape& shape, Precision precision,
                                             ScaleRounding rounding, float nvfp4_s_enc = 0.0f);

// How an NVFP4 matrix's per-matrix scale is handed over.
enum class Nvfp4Scale : std::uint8_t { s_enc, global_scale };

// This rank's experts as Layer takes them pre-quantized (the biases of `weights`, when present,
// as local_weight_views gives them). `mxfp4_4d`: MXFP4 codes viewed as gpt-oss's
// [E, N, K/32, 16].
ExpertWeights local_quantized_views(const QuantizedLayerWeights& q,
                                    const reference::LayerWeights& weights, const LayerShape& shape,
                                    int rank, int world, Nvfp4Scale nvfp4 = Nvfp4Scale::s_enc,
                                    bool mxfp4_4d = false);

}  // namespace epmoe::harness

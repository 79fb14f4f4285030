// The expert activations (LayerOptions::activation) as every path computes them, in float64, from
// the FC1 outputs gate and up (b13 already added). __host__ __device__ so the kernels, the CPU
// executor and the reference evaluate the same expression.
#pragma once

#include <cmath>

#include "epmoe/config.hpp"
#include "formats/codec.hpp"  // EPMOE_HD

namespace epmoe::math {

// silu(gate) * up, with the gpt-oss clamp when limit > 0 (gate <= limit, |up| <= limit).
EPMOE_HD double swiglu(double gate, double up, float limit) {
  if (limit > 0.0f) {
    const double l = limit;
    gate = gate < l ? gate : l;
    up = up < -l ? -l : (up > l ? l : up);
  }
  return gate / (1.0 + exp(-gate)) * up;
}

// gpt-oss (transformers' GptOssExperts._apply_gate, 5.17):
//   gate = gate.clamp(max=limit); up = up.clamp(-limit, limit)
//   (up + 1) * (gate * sigmoid(gate * alpha)),  alpha = kSwigluOaiAlpha = 1.702
// The clamps keep NaN, as torch.clamp does; limit > 0 (make_config).
EPMOE_HD double swiglu_oai(double gate, double up, float limit) {
  const double l = limit;
  gate = gate > l ? l : gate;
  up = up < -l ? -l : (up > l ? l : up);
  const double glu = gate * (1.0 / (1.0 + exp(-(gate * kSwigluOaiAlpha))));
  return (up + 1.0) * glu;
}

// The layer's activation: one branch, uniform over a kernel.
EPMOE_HD double activation(Activation a, double gate, double up, float limit) {
  return a == Activation::swiglu_oai ? swiglu_oai(gate, up, limit) : swiglu(gate, up, limit);
}

}  // namespace epmoe::math

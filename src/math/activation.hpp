// SwiGLU as every path computes it: silu(gate) * up in float64, with the gpt-oss clamp when
// limit > 0 (gate <= limit, |up| <= limit). __host__ __device__ so the kernels and the reference
// evaluate the same expression.
#pragma once

#include <cmath>

#include "formats/codec.hpp"  // EPMOE_HD

namespace epmoe::math {

EPMOE_HD double swiglu(double gate, double up, float limit) {
  if (limit > 0.0f) {
    const double l = limit;
    gate = gate < l ? gate : l;
    up = up < -l ? -l : (up > l ? l : up);
  }
  return gate / (1.0 + exp(-gate)) * up;
}

}  // namespace epmoe::math

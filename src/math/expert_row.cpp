#include "math/expert_row.hpp"

#include <cmath>

#include "math/quantize.hpp"

namespace epmoe::math {

void expert_forward_row(const float* x, const ExpertMatrices& expert, const LayerShape& shape,
                        Precision precision, const LayerOptions& options, float* out,
                        std::vector<float>& scratch) {
  const auto h = static_cast<std::size_t>(shape.hidden);
  const auto inter = static_cast<std::size_t>(shape.intermediate);
  scratch.resize(2 * inter);
  float* fc1 = scratch.data();
  for (std::size_t j = 0; j < 2 * inter; ++j) {
    const float* w = expert.w13 + j * h;
    double acc = 0.0;
    for (std::size_t k = 0; k < h; ++k) acc += double{x[k]} * double{w[k]};
    fc1[j] = static_cast<float>(acc);
  }
  // The intermediate overwrites the gate half, then is quantized as FC2's input.
  for (std::size_t j = 0; j < inter; ++j)
    fc1[j] = static_cast<float>(swiglu(fc1[j], fc1[inter + j], options.swiglu_limit));
  emulate_activation_row(fc1, shape.intermediate, precision, options.mxfp8_scale_rounding);
  for (std::size_t n = 0; n < h; ++n) {
    const float* w = expert.w2 + n * inter;
    double acc = 0.0;
    for (std::size_t j = 0; j < inter; ++j) acc += double{fc1[j]} * double{w[j]};
    out[n] = static_cast<float>(acc);
  }
}

}  // namespace epmoe::math

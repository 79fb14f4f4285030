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
    fc1[j] = biased(acc, expert.b13, static_cast<std::int64_t>(j));
  }
  // The intermediate overwrites the gate half, then is quantized as FC2's input.
  for (std::size_t j = 0; j < inter; ++j)
    fc1[j] = static_cast<float>(
        activation(options.activation, fc1[j], fc1[inter + j], options.swiglu_limit));
  emulate_activation_row(fc1, shape.intermediate, precision, options.mxfp8_scale_rounding);
  for (std::size_t n = 0; n < h; ++n) {
    const float* w = expert.w2 + n * inter;
    double acc = 0.0;
    for (std::size_t j = 0; j < inter; ++j) acc += double{fc1[j]} * double{w[j]};
    out[n] = biased(acc, expert.b2, static_cast<std::int64_t>(n));
  }
}

namespace {

std::vector<float> widen(const TensorView& t) {
  if (!given(t)) return {};
  std::vector<float> out(static_cast<std::size_t>(t.numel()));
  for (std::size_t i = 0; i < out.size(); ++i)
    out[i] = t.dtype == DType::f32 ? t.as<const float>()[i]
                                   : formats::bf16_to_float(t.as<const std::uint16_t>()[i]);
  return out;
}

}  // namespace

ExpertBiases load_expert_biases(const ExpertWeights& weights) {
  return ExpertBiases{widen(weights.b13), widen(weights.b2)};
}

}  // namespace epmoe::math

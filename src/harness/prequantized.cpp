#include "harness/prequantized.hpp"

#include <stdexcept>

#include "epmoe/formats.hpp"
#include "formats/codec.hpp"
#include "harness/cluster.hpp"

namespace epmoe::harness {
namespace {

QuantizedFc quantize_fc(const std::vector<std::uint16_t>& bf16, std::int64_t experts,
                        std::int64_t rows, std::int64_t cols, Precision precision,
                        ScaleRounding rounding, float nvfp4_s_enc) {
  std::vector<float> x(bf16.size());
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = formats::bf16_to_float(bf16[i]);
  QuantizedFc q{experts, rows, cols, {}, {}, {}, {}, {}};
  const auto matrix = static_cast<std::size_t>(rows * cols);
  const auto n = static_cast<std::size_t>(experts) * matrix;
  switch (precision) {
    case Precision::mxfp8:
      q.codes.resize(n);
      q.u8_scales.resize(n / 32);
      quantize_mxfp8(x.data(), experts * rows, cols, q.codes.data(), q.u8_scales.data(), rounding);
      break;
    case Precision::mxfp4:
      q.codes.resize(n / 2);
      q.u8_scales.resize(n / 32);
      quantize_mxfp4(x.data(), experts * rows, cols, q.codes.data(), q.u8_scales.data(), rounding);
      break;
    case Precision::nvfp4:
      q.codes.resize(n / 2);
      q.u8_scales.resize(n / 16);
      q.s_enc.resize(static_cast<std::size_t>(experts));
      for (std::size_t e = 0; e < static_cast<std::size_t>(experts); ++e) {
        const float* w = x.data() + e * matrix;
        std::uint8_t* packed = q.codes.data() + e * matrix / 2;
        std::uint8_t* scales = q.u8_scales.data() + e * matrix / 16;
        if (nvfp4_s_enc > 0) {
          quantize_nvfp4_static(w, rows, cols, nvfp4_s_enc, packed, scales);
          q.s_enc[e] = nvfp4_s_enc;
        } else {
          quantize_nvfp4(w, rows, cols, Nvfp4ScaleGroup::per_tensor, packed, scales, &q.s_enc[e]);
        }
        q.global_scale.push_back(1.0f / q.s_enc[e]);
      }
      break;
    case Precision::fp8_block128: {
      const auto tiles = static_cast<std::size_t>(formats::fp8_block128_scale_count(rows) *
                                                  formats::fp8_block128_scale_count(cols));
      q.codes.resize(n);
      q.f32_scales.resize(static_cast<std::size_t>(experts) * tiles);
      for (std::size_t e = 0; e < static_cast<std::size_t>(experts); ++e)
        quantize_fp8_block128(x.data() + e * matrix, rows, cols, Fp8Blocks::tile_128x128,
                              q.codes.data() + e * matrix, q.f32_scales.data() + e * tiles);
      break;
    }
    case Precision::bf16:
      throw std::invalid_argument("quantize_layer_weights: bf16 weights are values, not codes");
  }
  return q;
}

// Experts [first, first + count) of one FC as Layer takes them.
QuantizedMatrices fc_views(const QuantizedFc& q, Precision precision, std::int64_t first,
                           std::int64_t count, Nvfp4Scale nvfp4, bool mxfp4_4d) {
  const auto slice = [&](const auto& v) {
    return v.data() +
           static_cast<std::size_t>(first) * (v.size() / static_cast<std::size_t>(q.experts));
  };
  const std::int64_t n = q.rows, k = q.cols;
  QuantizedMatrices m;
  switch (precision) {
    case Precision::mxfp8:
      m.codes = view(slice(q.codes), DType::u8, {count, n, k});
      m.scales = view(slice(q.u8_scales), DType::u8, {count, n, k / 32});
      break;
    case Precision::mxfp4:
      m.codes = mxfp4_4d ? view(slice(q.codes), DType::u8, {count, n, k / 32, 16})
                         : view(slice(q.codes), DType::u8, {count, n, k / 2});
      m.scales = view(slice(q.u8_scales), DType::u8, {count, n, k / 32});
      break;
    case Precision::nvfp4:
      m.codes = view(slice(q.codes), DType::u8, {count, n, k / 2});
      m.scales = view(slice(q.u8_scales), DType::u8, {count, n, k / 16});
      if (nvfp4 == Nvfp4Scale::s_enc)
        m.s_enc = view(slice(q.s_enc), DType::f32, {count});
      else
        m.global_scale = view(slice(q.global_scale), DType::f32, {count});
      break;
    case Precision::fp8_block128:
      m.codes = view(slice(q.codes), DType::u8, {count, n, k});
      m.scales =
          view(slice(q.f32_scales), DType::f32,
               {count, formats::fp8_block128_scale_count(n), formats::fp8_block128_scale_count(k)});
      break;
    case Precision::bf16:
      break;
  }
  return m;
}

}  // namespace

QuantizedLayerWeights quantize_layer_weights(const reference::LayerWeights& weights,
                                             const LayerShape& shape, Precision precision,
                                             ScaleRounding rounding, float nvfp4_s_enc) {
  const std::int64_t e = shape.num_experts, h = shape.hidden, i = shape.intermediate;
  return QuantizedLayerWeights{
      precision, quantize_fc(weights.w13, e, 2 * i, h, precision, rounding, nvfp4_s_enc),
      quantize_fc(weights.w2, e, h, i, precision, rounding, nvfp4_s_enc)};
}

ExpertWeights local_quantized_views(const QuantizedLayerWeights& q,
                                    const reference::LayerWeights& weights, const LayerShape& shape,
                                    int rank, int world, Nvfp4Scale nvfp4, bool mxfp4_4d) {
  ExpertWeights w = local_weight_views(weights, shape, rank, world);
  const std::int64_t count = shape.num_experts / world, first = rank * count;
  w.w13 = w.w2 = TensorView{};
  w.w13_quantized = fc_views(q.w13, q.precision, first, count, nvfp4, mxfp4_4d);
  w.w2_quantized = fc_views(q.w2, q.precision, first, count, nvfp4, mxfp4_4d);
  return w;
}

}  // namespace epmoe::harness

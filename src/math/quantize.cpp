#include "math/quantize.hpp"

#include <algorithm>
#include <thread>

#include "formats/codec.hpp"
#include "formats/quantized_weights.hpp"
#include "protocol/wire_codec.hpp"

namespace epmoe::math {

void emulate_activation_row(float* row, std::int64_t n, Precision precision,
                            ScaleRounding rounding) {
  std::vector<std::uint8_t> payload(protocol::wire_payload_bytes(precision, n));
  const float s_enc = protocol::encode_payload(row, n, precision, rounding, payload.data());
  protocol::decode_payload(payload.data(), n, precision, s_enc, row);
}

std::vector<float> emulate_weight_matrix(const float* w, std::int64_t rows, std::int64_t cols,
                                         Precision precision, ScaleRounding rounding,
                                         float* s_enc_out) {
  const auto c = static_cast<std::size_t>(cols);
  if (s_enc_out != nullptr) *s_enc_out = 1.0f;
  std::vector<float> out(static_cast<std::size_t>(rows) * c);
  switch (precision) {
    case Precision::bf16:
      for (std::size_t i = 0; i < out.size(); ++i) out[i] = formats::round_to_bf16(w[i]);
      break;
    case Precision::mxfp8: {
      std::vector<std::uint8_t> elements(c), scales(c / formats::kMxfp8Block);
      for (std::size_t r = 0; r < static_cast<std::size_t>(rows); ++r) {
        formats::mxfp8_encode_row(w + r * c, cols, rounding, elements.data(), scales.data());
        formats::mxfp8_decode_row(elements.data(), scales.data(), cols, out.data() + r * c);
      }
      break;
    }
    case Precision::nvfp4: {
      const float s_enc = formats::nvfp4_tensor_scale(formats::nvfp4_group_amax(w, rows * cols));
      if (s_enc_out != nullptr) *s_enc_out = s_enc;
      std::vector<std::uint8_t> packed(c / 2), scales(c / formats::kNvfp4Block);
      for (std::size_t r = 0; r < static_cast<std::size_t>(rows); ++r) {
        formats::nvfp4_encode_row(w + r * c, cols, s_enc, packed.data(), scales.data());
        formats::nvfp4_decode_row(packed.data(), scales.data(), s_enc, cols, out.data() + r * c);
      }
      break;
    }
    case Precision::fp8_block128: {
      // 128 x 128 tiles along (rows, cols): a tile's amax covers its rows too, so the matrix is
      // encoded tile by tile, then decoded row by row against its tile row's scales.
      constexpr std::int64_t kB = formats::kFp8Block128;
      const std::int64_t tile_cols = formats::fp8_block128_scale_count(cols);
      std::vector<std::uint8_t> elements(out.size());
      std::vector<float> scales(static_cast<std::size_t>(tile_cols));
      for (std::int64_t r0 = 0; r0 < rows; r0 += kB) {
        const int tile_rows = static_cast<int>(std::min(kB, rows - r0));
        for (std::int64_t j = 0; j < tile_cols; ++j) {
          const std::size_t at =
              static_cast<std::size_t>(r0) * c + static_cast<std::size_t>(j * kB);
          formats::fp8_block128_encode_tile(
              w + at, tile_rows, static_cast<int>(std::min(kB, cols - j * kB)), cols,
              elements.data() + at, scales.data() + static_cast<std::size_t>(j));
        }
        for (std::int64_t r = r0; r < r0 + tile_rows; ++r) {
          const std::size_t at = static_cast<std::size_t>(r) * c;
          formats::fp8_block128_decode_row(elements.data() + at, scales.data(), cols,
                                           out.data() + at);
        }
      }
      break;
    }
    case Precision::mxfp4: {
      std::vector<std::uint8_t> packed(static_cast<std::size_t>(formats::mxfp4_packed_bytes(cols)));
      std::vector<std::uint8_t> scales(static_cast<std::size_t>(formats::mxfp4_scale_count(cols)));
      for (std::size_t r = 0; r < static_cast<std::size_t>(rows); ++r) {
        formats::mxfp4_encode_row(w + r * c, cols, rounding, packed.data(), scales.data());
        formats::mxfp4_decode_row(packed.data(), scales.data(), cols, out.data() + r * c);
      }
      break;
    }
  }
  return out;
}

namespace {

std::vector<float> load_matrix(const TensorView& t, std::int64_t expert, std::int64_t rows,
                               std::int64_t cols) {
  const auto n = static_cast<std::size_t>(rows * cols);
  const std::size_t first = static_cast<std::size_t>(expert) * n;
  std::vector<float> out(n);
  for (std::size_t i = 0; i < n; ++i)
    out[i] = t.dtype == DType::f32 ? t.as<const float>()[first + i]
                                   : formats::bf16_to_float(t.as<const std::uint16_t>()[first + i]);
  return out;
}

// Matrix `expert` of one FC as the GEMMs see it: the caller's values quantize-emulated, or its
// pre-quantized matrices decoded as they are (the same decode functions, so a value encoded by
// epmoe's codec decodes to the same bits either way).
std::vector<float> expert_matrix(const TensorView& values, const QuantizedMatrices& quantized,
                                 std::int64_t expert, std::int64_t rows, std::int64_t cols,
                                 Precision precision, ScaleRounding rounding, float* s_enc) {
  if (!given(quantized))
    return emulate_weight_matrix(load_matrix(values, expert, rows, cols).data(), rows, cols,
                                 precision, rounding, s_enc);
  const formats::QuantizedMatrixData q =
      formats::quantized_matrix_data(quantized, precision, rows, cols);
  std::vector<float> out(static_cast<std::size_t>(rows * cols));
  for (std::int64_t at = 0; at < rows * cols; at += formats::kWeightBlock)
    *s_enc = formats::decode_weight_block(q, expert, at, out.data() + at);
  return out;
}

// fn(i) for i in [0, count), spread over the cores; each i's result must not depend on the thread.
template <class Fn>
void parallel_for(std::int64_t count, Fn fn) {
  const auto workers =
      static_cast<std::int64_t>(std::clamp<unsigned>(std::thread::hardware_concurrency(), 1u, 32u));
  std::vector<std::thread> pool;
  for (std::int64_t w = 0; w < std::min(workers, count); ++w)
    pool.emplace_back([&, w] {
      for (std::int64_t i = w; i < count; i += workers) fn(i);
    });
  for (auto& t : pool) t.join();
}

}  // namespace

std::vector<std::uint16_t> bf16_codes(const std::vector<float>& values,
                                      const std::vector<float>& s_enc) {
  std::vector<std::uint16_t> out(values.size());
  const std::size_t per_matrix = s_enc.empty() ? 0 : values.size() / s_enc.size();
  parallel_for(static_cast<std::int64_t>(s_enc.size()), [&](std::int64_t m) {
    const auto first = static_cast<std::size_t>(m) * per_matrix;
    const float scale = s_enc[static_cast<std::size_t>(m)];
    for (std::size_t i = first; i < first + per_matrix; ++i)
      out[i] = formats::float_to_bf16(values[i] * scale);
  });
  return out;
}

EmulatedExperts emulate_expert_weights(const LayerConfig& config, const ExpertWeights& weights) {
  const LayerShape& s = config.shape();
  const ScaleRounding rounding = config.options().mxfp8_scale_rounding;
  const auto w13_size = static_cast<std::size_t>(2 * s.intermediate * s.hidden);
  const auto w2_size = static_cast<std::size_t>(s.hidden * s.intermediate);
  const std::int64_t experts = config.local_experts();
  EmulatedExperts out;
  out.w13.resize(static_cast<std::size_t>(experts) * w13_size);
  out.w2.resize(static_cast<std::size_t>(experts) * w2_size);
  out.w13_s_enc.resize(static_cast<std::size_t>(experts));
  out.w2_s_enc.resize(static_cast<std::size_t>(experts));
  const auto one_expert = [&](std::int64_t e) {
    const auto i = static_cast<std::size_t>(e);
    const auto w13 = expert_matrix(weights.w13, weights.w13_quantized, e, 2 * s.intermediate,
                                   s.hidden, config.precision(), rounding, &out.w13_s_enc[i]);
    const auto w2 = expert_matrix(weights.w2, weights.w2_quantized, e, s.hidden, s.intermediate,
                                  config.precision(), rounding, &out.w2_s_enc[i]);
    std::copy(w13.begin(), w13.end(), out.w13.begin() + static_cast<std::ptrdiff_t>(e * w13_size));
    std::copy(w2.begin(), w2.end(), out.w2.begin() + static_cast<std::ptrdiff_t>(e * w2_size));
  };
  // Experts are independent: spread them over the cores (layer creation of a large model is
  // otherwise minutes of one thread).
  parallel_for(experts, one_expert);
  return out;
}

}  // namespace epmoe::math

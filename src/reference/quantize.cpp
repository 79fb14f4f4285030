#include "reference/quantize.hpp"

#include "formats/codec.hpp"
#include "protocol/wire_codec.hpp"

namespace epmoe::reference {

void emulate_activation_row(float* row, std::int64_t n, Precision precision,
                            ScaleRounding rounding) {
  std::vector<std::uint8_t> payload(protocol::wire_payload_bytes(precision, n));
  const float s_enc = protocol::encode_payload(row, n, precision, rounding, payload.data());
  protocol::decode_payload(payload.data(), n, precision, s_enc, row);
}

std::vector<float> emulate_weight_matrix(const float* w, std::int64_t rows, std::int64_t cols,
                                         Precision precision, ScaleRounding rounding) {
  const auto c = static_cast<std::size_t>(cols);
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
      std::vector<std::uint8_t> packed(c / 2), scales(c / formats::kNvfp4Block);
      for (std::size_t r = 0; r < static_cast<std::size_t>(rows); ++r) {
        formats::nvfp4_encode_row(w + r * c, cols, s_enc, packed.data(), scales.data());
        formats::nvfp4_decode_row(packed.data(), scales.data(), s_enc, cols, out.data() + r * c);
      }
      break;
    }
  }
  return out;
}

}  // namespace epmoe::reference

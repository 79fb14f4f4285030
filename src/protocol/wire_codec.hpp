// Encoding a row of activations into the wire payload of its precision and back (wire.hpp has the
// byte layout). The reference forward emulates a quantization point as decode(encode(x)), so the
// executors and the oracle cannot disagree on the format.
#pragma once

#include <cstdint>

#include "epmoe/config.hpp"
#include "formats/codec.hpp"
#include "protocol/wire.hpp"

namespace epmoe::protocol {

// `precision` is the layer's; the row is encoded in its activation_format (mxfp4 -> MXFP8).
// Returns the NVFP4 row scale s_enc (1 for the other precisions); the caller stores it with the
// row.
EPMOE_HD float encode_payload(const float* x, std::int64_t n, Precision precision,
                              ScaleRounding rounding, std::uint8_t* payload) {
  const auto count = static_cast<std::size_t>(n);
  switch (activation_format(precision)) {
    case Precision::bf16: {
      auto* out = reinterpret_cast<std::uint16_t*>(payload);
      for (std::size_t i = 0; i < count; ++i) out[i] = formats::float_to_bf16(x[i]);
      return 1.0f;
    }
    case Precision::mxfp8:
      formats::mxfp8_encode_row(x, n, rounding, payload, payload + count);
      return 1.0f;
    case Precision::nvfp4: {
      const float s_enc = formats::nvfp4_tensor_scale(formats::nvfp4_group_amax(x, n));
      formats::nvfp4_encode_row(x, n, s_enc, payload, payload + count / 2);
      return s_enc;
    }
    case Precision::fp8_block128:
      // NOTES: n is a multiple of 64, so the fp32 scales after n E4M3 bytes are 4-byte aligned.
      formats::fp8_block128_encode_row(x, n, payload, reinterpret_cast<float*>(payload + count));
      return 1.0f;
    case Precision::mxfp4:  // activation_format: never an activation format
      break;
  }
  return 1.0f;
}

EPMOE_HD void decode_payload(const std::uint8_t* payload, std::int64_t n, Precision precision,
                             float row_scale, float* out) {
  const auto count = static_cast<std::size_t>(n);
  switch (activation_format(precision)) {
    case Precision::bf16: {
      const auto* in = reinterpret_cast<const std::uint16_t*>(payload);
      for (std::size_t i = 0; i < count; ++i) out[i] = formats::bf16_to_float(in[i]);
      return;
    }
    case Precision::mxfp8:
      formats::mxfp8_decode_row(payload, payload + count, n, out);
      return;
    case Precision::nvfp4:
      formats::nvfp4_decode_row(payload, payload + count / 2, row_scale, n, out);
      return;
    case Precision::fp8_block128:
      formats::fp8_block128_decode_row(payload, reinterpret_cast<const float*>(payload + count), n,
                                       out);
      return;
    case Precision::mxfp4:  // activation_format: never an activation format
      return;
  }
}

}  // namespace epmoe::protocol

// FC2's input quantization point (docs/design.md §6 point 3) one element at a time, for the
// activation formats whose scales are local to a block of h (bf16, MXFP8): the arithmetic a
// tensor-core FC1 epilogue applies from registers (mma/steps.cuh, store_fc2_input), written for
// the host and the device so the CPU tests check it against the wire codec the reference uses
// (tests/fc2_input_code_test.cpp).
#pragma once

#include <cstdint>

#include "epmoe/config.hpp"
#include "formats/codec.hpp"
#include "protocol/wire.hpp"

namespace epmoe::cuda::experts {

// Whether FC2's input quantization point is local to 32 columns of h, so FC1's epilogue can apply
// it (activation formats bf16 and MXFP8: the layer's bf16, mxfp8 and mxfp4), or needs the whole
// row (NVFP4's row scale; fp8_block128's 1 x 128 runs): then a step of its own.
EPMOE_HD constexpr bool fc1_epilogue_quantizes(Precision precision) {
  const Precision f = protocol::activation_format(precision);
  return f == Precision::bf16 || f == Precision::mxfp8;
}

// One element of h at that point (fc1_epilogue_quantizes): the bf16 code of decode(encode(v)),
// as the row codec's quantize_h_row gives it, from v and the bit-pattern max of |x| over its MXFP8
// block of 32 (abs_max_bits; unused for bf16). The row scale of these formats is 1.
EPMOE_HD std::uint16_t fc2_input_code(Precision precision, ScaleRounding rounding, float v,
                                      std::uint32_t block_amax_bits) {
  using namespace formats;
  if (protocol::activation_format(precision) == Precision::bf16) return float_to_bf16(v);
  const std::uint8_t code = mxfp8_scale_code(bits_float(block_amax_bits), rounding);
  return float_to_bf16(
      mxfp8_decode_value(mxfp8_encode_value(v, code, mxfp8_inverse_scale(code)), code));
}

}  // namespace epmoe::cuda::experts

// NVFP4 weights of one block (16 E2M1 codes sharing an E4M3 scale) decoded to exactly what
// nvfp4_decode_value gives (then times the matrix's decode multiplier where it is not 1, as
// ModelOpt's checkpoints define it), with two divisions per block instead of one per weight: the
// exact backend's tile decodes every weight of every slab this way (src/cuda/experts/exact/).
//
// Why it is exact. An E2M1 magnitude m is 0, or 2^k or 1.5 * 2^k with k in [-1, 2], and m * s is
// exact in fp32, so the reference's fl(m * s / d) is fl(2^k * s / d) or fl(2^k * 1.5 s / d). In the
// normal range scaling by a power of two commutes with rounding: fl(2^k y) = 2^k fl(y) whenever
// fl(y) and 2^k fl(y) are normal. So with q1 = fl(s / d) and q3 = fl(1.5 s / d) (and, times the
// multiplier u, b = fl(q * u), where the same holds) every weight is +-2^k b1 or +-2^k b3, exactly,
// as long as each of q1, q3, b1, b3 is zero because s is, or lies in [2^-124, 2^125) (so that
// times 2^-1 .. 2^2 it stays normal and finite). A block outside that (a NaN or tiny scale, an
// extreme s_enc or multiplier) decodes each weight by the reference's own formula instead.
// tests/nvfp4_block_decode_test.cpp checks every code and scale against nvfp4_decode_value.
#pragma once

#include <cstdint>

#include "formats/codec.hpp"

namespace epmoe::formats {

struct Nvfp4BlockDecoder {
  float b1, b3;  // fl(fl(s / d) * u), fl(fl(1.5 s / d) * u): the values of magnitudes 1 and 1.5
  bool scaled;   // b1 and b3 are exact bases for every code (else each weight is divided)
  std::uint8_t scale_code;
  float divisor, multiplier;
};

// Whether 2^-1 .. 2^2 times x is normal and finite for x in [2^-124, 2^125).
EPMOE_HD bool nvfp4_base_in_range(float x) {
  const std::uint32_t e = (float_bits(x) >> 23) & 0xffu;
  return e >= 3u && e <= 251u;
}

EPMOE_HD Nvfp4BlockDecoder nvfp4_block_decoder(std::uint8_t scale_code, float divisor,
                                               float multiplier) {
  const float s = e4m3_to_float(scale_code);
  const float q1 = s / divisor, q3 = (1.5f * s) / divisor;  // 1.5 s is exact: s has 4 bits
  const float b1 = multiplier != 1.0f ? q1 * multiplier : q1;
  const float b3 = multiplier != 1.0f ? q3 * multiplier : q3;
  const bool zero = (scale_code & 0x7fu) == 0;  // s = +-0: every weight is a signed zero
  const bool scaled = zero || (nvfp4_base_in_range(q1) && nvfp4_base_in_range(q3) &&
                               nvfp4_base_in_range(b1) && nvfp4_base_in_range(b3));
  return Nvfp4BlockDecoder{b1, b3, scaled, scale_code, divisor, multiplier};
}

// The weight of E2M1 code `nibble` (sign in bit 3) in the decoder's block.
EPMOE_HD float nvfp4_block_decode(const Nvfp4BlockDecoder& block, std::uint32_t nibble) {
  const std::uint32_t c = nibble & 7u;  // 0, 0.5, 1, 1.5, 2, 3, 4, 6
  float v;
  if (block.scaled) {
    const float base = (c & 1u) != 0 && c > 1u ? block.b3 : block.b1;
    // 2^(c / 2 - 1) for c >= 1 (0.5, 1, 1, 2, 2, 4, 4), 0 for c = 0 (a signed zero, as m * s / d)
    const float power = c == 0 ? 0.0f : bits_float((126u + (c >> 1)) << 23);
    v = base * power;
    if ((nibble & 8u) != 0) v = -v;
  } else {
    v = nvfp4_decode_value(static_cast<std::uint8_t>(nibble & 0xfu), block.scale_code,
                           block.divisor);
    if (block.multiplier != 1.0f) v *= block.multiplier;
  }
  return v;
}

}  // namespace epmoe::formats

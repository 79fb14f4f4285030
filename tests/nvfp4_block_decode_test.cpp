// The exact backend's NVFP4 block decode (src/formats/nvfp4_block_decode.hpp) against the
// reference's per-weight formula, nvfp4_decode_value (then times the multiplier where it is not 1):
// every E2M1 code with every E4M3 block scale, for divisors and multipliers that keep the fast
// bases and ones that leave them (tiny and huge s_enc, extreme multipliers, zero scales).
#include "formats/nvfp4_block_decode.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace epmoe::formats {
namespace {

float reference(std::uint32_t nibble, std::uint8_t scale_code, float divisor, float multiplier) {
  float v = nvfp4_decode_value(static_cast<std::uint8_t>(nibble), scale_code, divisor);
  if (multiplier != 1.0f) v *= multiplier;
  return v;
}

// Mismatches over every code and scale for one (divisor, multiplier); counts the blocks that took
// the fast bases in *scaled.
std::string first_mismatch(float divisor, float multiplier, int* scaled) {
  for (int sc = 0; sc < 256; ++sc) {
    const auto code = static_cast<std::uint8_t>(sc);
    const Nvfp4BlockDecoder block = nvfp4_block_decoder(code, divisor, multiplier);
    *scaled += block.scaled ? 1 : 0;
    for (std::uint32_t nibble = 0; nibble < 16; ++nibble) {
      const float got = nvfp4_block_decode(block, nibble),
                  want = reference(nibble, code, divisor, multiplier);
      const bool same = std::isnan(want) ? std::isnan(got) : float_bits(got) == float_bits(want);
      if (!same)
        return "scale 0x" + std::to_string(sc) + " nibble " + std::to_string(nibble) + ": got " +
               std::to_string(got) + " want " + std::to_string(want);
    }
  }
  return "";
}

TEST(Nvfp4BlockDecode, EveryCodeAndScaleIsTheReferencesValueBitForBit) {
  const std::vector<float> divisors = {1.0f,     0.75f,       3.0f,         448.0f * 6.0f / 3.7f,
                                       2688.0f,  1e-3f,       7.0f / 13.0f, 0x1p-100f,
                                       0x1p100f, 0x1p-126f,   3e-39f,       kFloatMax,
                                       1e30f,    1.0f / 3.0f, -2.5f,        0x1.fffffep-1f};
  const std::vector<float> multipliers = {1.0f,   0.3f,  1.0f / 2688.0f, 3.0f,
                                          1e-30f, 1e30f, -0.7f,          0x1p-120f};
  int scaled = 0, blocks = 0;
  for (const float d : divisors)
    for (const float u : multipliers) {
      EXPECT_EQ(first_mismatch(d, u, &scaled), "") << "divisor " << d << " multiplier " << u;
      blocks += 256;
    }
  // Most blocks of ordinary divisors take the two-division path; the extremes fall back.
  EXPECT_GT(scaled, blocks / 2);
  EXPECT_LT(scaled, blocks);
}

TEST(Nvfp4BlockDecode, OrdinaryBlocksUseTheBasesAndNanOrTinyScalesFallBack) {
  EXPECT_TRUE(nvfp4_block_decoder(0x38, 1.0f, 1.0f).scaled);        // s = 1
  EXPECT_TRUE(nvfp4_block_decoder(0x00, 1.0f, 1.0f).scaled);        // s = 0: signed zeros
  EXPECT_FALSE(nvfp4_block_decoder(0x7f, 1.0f, 1.0f).scaled);       // NaN scale
  EXPECT_FALSE(nvfp4_block_decoder(0x01, 0x1p120f, 1.0f).scaled);   // s / d is subnormal
  EXPECT_FALSE(nvfp4_block_decoder(0x7e, 0x1p-118f, 1.0f).scaled);  // 448 * 2^118 * 4 overflows
}

}  // namespace
}  // namespace epmoe::formats

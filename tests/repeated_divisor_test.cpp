// RepeatedDivisor (src/cuda/repeated_divisor.hpp), the division nvfp4's activate, home and route
// repeat per element, on the host (the same __host__ __device__ arithmetic: an IEEE reciprocal,
// a product, two fused multiply-adds): the IEEE quotient bit for bit wherever that quotient is a
// normal float, over random operands and over every NVFP4 decoded product (E2M1 code x E4M3 block
// scale) for s_enc across the range nvfp4_in_reciprocal_range accepts; a divisor of 1 gives the
// dividend itself, signed zeros, subnormals, infinities and NaN included.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <random>

#include "cuda/repeated_divisor.hpp"
#include "formats/codec.hpp"

namespace epmoe {
namespace {

using cuda::RepeatedDivisor;
using formats::bits_float;
using formats::float_bits;

bool normal_or_zero(float x) {
  return x == 0.0f || std::fabs(x) >= FLT_MIN;
}

TEST(RepeatedDivisor, IsTheIeeeQuotientWhereverThatIsNormal) {
  std::mt19937_64 rng(34);
  std::uniform_int_distribution<int> exponent(-100, 100);
  std::uniform_int_distribution<std::uint32_t> mantissa(0, 0x7fffffu);
  long compared = 0;
  for (int i = 0; i < 4'000'000; ++i) {
    const float a = bits_float(static_cast<std::uint32_t>(rng()));
    const float b = bits_float((static_cast<std::uint32_t>(exponent(rng) + 127) << 23) |
                               mantissa(rng));  // positive, in [2^-100, 2^101)
    if (!std::isfinite(a)) continue;
    const float want = a / b;
    if (!normal_or_zero(want) || !std::isfinite(want) || std::fabs(a) < 0x1p-100f) continue;
    ASSERT_EQ(float_bits(RepeatedDivisor(b).divide(a)), float_bits(want))
        << std::hexfloat << a << " / " << b;
    ++compared;
  }
  EXPECT_GT(compared, 1'000'000) << "most samples have a normal quotient";
}

TEST(RepeatedDivisor, Nvfp4DecodedProductsOverSencInItsRangeAreTheIeeeQuotients) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> log2_s(-100.0, 100.0);
  int scales_seen = 0;
  for (int sample = 0; sample < 2000; ++sample) {
    const float s_enc = sample == 0   ? 0x1p-100f
                        : sample == 1 ? 0x1p100f
                                      : static_cast<float>(std::exp2(log2_s(rng)));
    ASSERT_TRUE(cuda::nvfp4_in_reciprocal_range(s_enc)) << s_enc;
    const RepeatedDivisor by_s_enc(s_enc);
    for (int scale = 0; scale < 256; ++scale) {
      if (formats::e4m3_is_nan(static_cast<std::uint8_t>(scale)) || scale >= 0x80) continue;
      scales_seen += sample == 0;
      const float scale_value = formats::e4m3_to_float(static_cast<std::uint8_t>(scale));
      for (int code = 0; code < 16; ++code) {
        const float product = formats::e2m1_to_float(static_cast<std::uint8_t>(code)) * scale_value;
        ASSERT_EQ(float_bits(by_s_enc.divide(product)), float_bits(product / s_enc))
            << "code " << code << ", scale " << scale << ", s_enc " << std::hexfloat << s_enc;
      }
    }
  }
  EXPECT_EQ(scales_seen, 127) << "every finite non-negative E4M3 block scale";
  EXPECT_FALSE(cuda::nvfp4_in_reciprocal_range(FLT_MAX));
  EXPECT_FALSE(cuda::nvfp4_in_reciprocal_range(0x1p-101f));
}

TEST(RepeatedDivisor, ADivisorOfOneGivesTheDividendItself) {
  const RepeatedDivisor by_one(1.0f);
  for (const float a : {0.0f, -0.0f, 1.0f, -3.5f, FLT_MIN, -FLT_MIN, 0x1p-149f, -0x1p-140f, FLT_MAX,
                        -FLT_MAX, HUGE_VALF, -HUGE_VALF, 0x1.234566p-3f})
    EXPECT_EQ(float_bits(by_one.divide(a)), float_bits(a)) << std::hexfloat << a;
  EXPECT_TRUE(std::isnan(by_one.divide(formats::quiet_nan())));
}

TEST(RepeatedDivisor, KeepsTheSignOfZerosAndTheInfinities) {
  const RepeatedDivisor by_three(3.0f);
  EXPECT_EQ(float_bits(by_three.divide(-0.0f)), float_bits(-0.0f));
  EXPECT_EQ(float_bits(by_three.divide(0.0f)), float_bits(0.0f));
  EXPECT_EQ(by_three.divide(HUGE_VALF), HUGE_VALF);
  EXPECT_EQ(by_three.divide(-HUGE_VALF), -HUGE_VALF);
  EXPECT_EQ(float_bits(by_three.divide(-0x1p-149f)), float_bits(-0.0f)) << "underflow to -0";
}

}  // namespace
}  // namespace epmoe

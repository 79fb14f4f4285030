// FC2's input quantization point one element at a time (src/cuda/experts/fc2_input_code.hpp), as
// a tensor-core FC1 epilogue applies it from registers: for every element, the bf16 code of the
// value the wire codec's decode(encode(row)) gives (math::emulate_activation_row, what the
// reference forward and the quantize_h step compute), from the element and its block's amax.
#include "cuda/experts/fc2_input_code.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "formats/codec.hpp"
#include "math/quantize.hpp"

namespace epmoe::cuda::experts {
namespace {

// Rows whose 32-blocks span many binades, with zeros, subnormals, ties of E4M3's grid and values
// near the scale's edges.
std::vector<float> test_row(std::mt19937& rng, std::int64_t n) {
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_int_distribution<int> binade(-40, 40), kind(0, 9);
  std::vector<float> row(static_cast<std::size_t>(n));
  for (std::int64_t b = 0; b < n; b += formats::kMxfp8Block) {
    const float scale = std::ldexp(1.0f, binade(rng));
    for (std::int64_t i = b; i < b + formats::kMxfp8Block; ++i) {
      float v = unit(rng) * scale;
      switch (kind(rng)) {
        case 0:
          v = 0.0f;
          break;
        case 1:
          v = std::ldexp(unit(rng), -140);
          break;  // fp32 subnormal
        case 2:
          v = std::ldexp(1.0f + 0.0625f, binade(rng));
          break;  // an E4M3 tie
        case 3:
          v = -std::ldexp(1.75f, binade(rng) / 2);
          break;  // a block's top value
        default:
          break;
      }
      row[static_cast<std::size_t>(i)] = v;
    }
  }
  return row;
}

TEST(Fc2InputCode, EveryElementIsTheBf16CodeOfTheRowCodecsQuantizationPoint) {
  constexpr std::int64_t n = 256;
  std::mt19937 rng(7);
  for (const Precision precision : {Precision::bf16, Precision::mxfp8, Precision::mxfp4})
    for (const ScaleRounding rounding : {ScaleRounding::rceil, ScaleRounding::ocp_floor})
      for (int trial = 0; trial < 200; ++trial) {
        const std::vector<float> row = test_row(rng, n);
        std::vector<float> want = row;
        math::emulate_activation_row(want.data(), n, precision, rounding);
        for (std::int64_t b = 0; b < n; b += formats::kMxfp8Block) {
          std::uint32_t amax = 0;
          for (std::int64_t i = b; i < b + formats::kMxfp8Block; ++i)
            amax = std::max(amax, formats::float_bits(row[i]) & formats::kF32AbsMask);
          for (std::int64_t i = b; i < b + formats::kMxfp8Block; ++i)
            ASSERT_EQ(fc2_input_code(precision, rounding, row[i], amax),
                      formats::float_to_bf16(want[i]))
                << "precision " << static_cast<int>(precision) << " rounding "
                << static_cast<int>(rounding) << " trial " << trial << " element " << i << " value "
                << row[i];
        }
      }
}

TEST(Fc2InputCode, OnlyBlockLocalFormatsQuantizeInTheFc1Epilogue) {
  EXPECT_TRUE(fc1_epilogue_quantizes(Precision::bf16));
  EXPECT_TRUE(fc1_epilogue_quantizes(Precision::mxfp8));
  EXPECT_TRUE(fc1_epilogue_quantizes(Precision::mxfp4));   // MXFP8 activations
  EXPECT_FALSE(fc1_epilogue_quantizes(Precision::nvfp4));  // a row scale over the whole row
  EXPECT_FALSE(fc1_epilogue_quantizes(Precision::fp8_block128));
}

}  // namespace
}  // namespace epmoe::cuda::experts

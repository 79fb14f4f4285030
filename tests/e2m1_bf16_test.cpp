// The packed GEMM's FP4 decode by byte permutes (src/cuda/experts/e2m1_bf16.hpp), on the host with
// CUDA's __byte_perm and bf16 multiply emulated: every E2M1 code in every position of a word, with
// every MX scale code and every E4M3 scale code, against the fp32 decode the GEMMs used before
// (code value times scale in fp32, rounded to bf16), bit for bit: an E2M1 value times a power of
// two or an E4M3 value has at most 6 significant bits, so both routes are exact down to 2^-128
// (MX's smallest product), and round the same way above bf16's range.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "cuda/experts/e2m1_bf16.hpp"
#include "formats/codec.hpp"

namespace epmoe {
namespace {

using cuda::experts::bf16x2_scale;
using cuda::experts::byte_perm;
using cuda::experts::e2m1x8_to_bf16;

// The bf16 the fp32 route gives for code `nibble` with block scale `scale`.
std::uint16_t fp32_route(std::uint32_t nibble, float scale) {
  return formats::float_to_bf16(formats::e2m1_to_float(static_cast<std::uint8_t>(nibble)) * scale);
}

bool is_nan_bf16(std::uint16_t b) {
  return (b & 0x7F80u) == 0x7F80u && (b & 0x7Fu) != 0;
}

// Words that put every code in every position: code c at position p, the other positions a
// rotating pattern; then random words.
std::vector<std::uint32_t> test_words() {
  std::vector<std::uint32_t> words;
  for (std::uint32_t p = 0; p < 8; ++p)
    for (std::uint32_t c = 0; c < 16; ++c) {
      std::uint32_t w = 0;
      for (std::uint32_t q = 0; q < 8; ++q) w |= (q == p ? c : (c + 3 * q + 5) & 0xFu) << (4 * q);
      words.push_back(w);
    }
  std::mt19937 rng(5);
  for (int i = 0; i < 512; ++i) words.push_back(static_cast<std::uint32_t>(rng()));
  return words;
}

// Every element of every word with scale `scale` against the fp32 route; returns how many differ.
std::size_t differences(float scale, const std::vector<std::uint32_t>& words) {
  const std::uint32_t scale2 = bf16x2_scale(scale);
  if (!std::isnan(scale)) {
    EXPECT_EQ(formats::bf16_to_float(static_cast<std::uint16_t>(scale2)), scale)
        << "the scale is a bf16 value";
  }
  std::size_t differ = 0;
  for (const std::uint32_t w : words) {
    std::uint32_t out[4];
    e2m1x8_to_bf16(w, scale2, out);
    for (int i = 0; i < 8; ++i) {
      const auto got = static_cast<std::uint16_t>(out[i / 2] >> (16 * (i % 2)));
      const std::uint16_t want = fp32_route((w >> (4 * i)) & 0xFu, scale);
      if (got == want || (is_nan_bf16(got) && is_nan_bf16(want))) continue;
      if (differ++ == 0)
        ADD_FAILURE() << "word " << std::hex << w << " element " << std::dec << i << " scale "
                      << scale << ": bf16 " << std::hex << got << ", fp32 route " << want;
    }
  }
  return differ;
}

TEST(E2m1Bf16, ByteTablesHoldEveryMagnitudesBf16Bits) {
  for (std::uint32_t m = 0; m < 8; ++m) {
    const std::uint32_t low =
        byte_perm(cuda::experts::kE2m1LowBytes0, cuda::experts::kE2m1LowBytes1, m) & 0xFFu;
    const std::uint32_t high =
        byte_perm(cuda::experts::kE2m1HighBytes0, cuda::experts::kE2m1HighBytes1, m) & 0xFFu;
    EXPECT_EQ(high << 8 | low,
              formats::float_to_bf16(formats::e2m1_to_float(static_cast<std::uint8_t>(m))))
        << "magnitude " << m;
  }
}

TEST(E2m1Bf16, EveryCodeWithEveryMxScaleMatchesTheFp32Decode) {
  const std::vector<std::uint32_t> words = test_words();
  for (int s = 0; s < 256; ++s)
    EXPECT_EQ(differences(formats::e8m0_to_float(static_cast<std::uint8_t>(s)), words), 0u)
        << "E8M0 scale code " << s;
}

TEST(E2m1Bf16, EveryCodeWithEveryE4m3ScaleMatchesTheFp32Decode) {
  const std::vector<std::uint32_t> words = test_words();
  for (int s = 0; s < 256; ++s)
    EXPECT_EQ(differences(formats::e4m3_to_float(static_cast<std::uint8_t>(s)), words), 0u)
        << "E4M3 scale code " << s;
}

// Unscaled (the tensor-core tile's narrow form applies MX scales to fp32 sums): the codes' own
// values, as scaled by 1.
TEST(E2m1Bf16, UnscaledIsScaledByOne) {
  for (const std::uint32_t w : test_words()) {
    std::uint32_t unscaled[4], by_one[4];
    e2m1x8_to_bf16<false>(w, 0u, unscaled);
    e2m1x8_to_bf16(w, bf16x2_scale(1.0f), by_one);
    for (int j = 0; j < 4; ++j) EXPECT_EQ(unscaled[j], by_one[j]) << std::hex << w;
  }
}

// A wrong table byte, selector or sign position is caught: flipping one table byte breaks the
// comparison for some code.
TEST(E2m1Bf16, ASignOrMagnitudeMistakeIsCaught) {
  std::uint32_t out[4];
  e2m1x8_to_bf16(0x0000000Fu, bf16x2_scale(1.0f), out);  // element 0: -6, the rest +0
  EXPECT_EQ(out[0] & 0xFFFFu, formats::float_to_bf16(-6.0f));
  EXPECT_EQ(out[0] >> 16, 0u);
  e2m1x8_to_bf16(0x90000000u, bf16x2_scale(0.5f), out);  // element 7: -0.5 * 0.5, element 6: 0
  EXPECT_EQ(out[3] >> 16, formats::float_to_bf16(-0.25f));
  EXPECT_EQ(out[3] & 0xFFFFu, 0u);
}

// The E4M3 tile's MXFP4 weights (e2m1x8_to_e4m3): every code in every position of a word is the
// E4M3 code of its value, bit for bit (so -0 is E4M3's -0, 0x80).
TEST(E2m1E4m3, EveryCodeInEveryPositionIsTheE4m3CodeOfItsValue) {
  std::size_t differ = 0;
  for (const std::uint32_t w : test_words()) {
    std::uint32_t out[2];
    cuda::experts::e2m1x8_to_e4m3(w, out);
    for (int i = 0; i < 8; ++i) {
      const auto got = static_cast<std::uint8_t>(out[i / 4] >> (8 * (i % 4)));
      const float value = formats::e2m1_to_float(static_cast<std::uint8_t>((w >> (4 * i)) & 0xFu));
      const std::uint8_t want = formats::float_to_e4m3(value);
      const bool same = got == want || (value == 0.0f && std::signbit(value) && got == 0x80u);
      if (!same && differ++ == 0)
        ADD_FAILURE() << "word " << std::hex << w << " element " << std::dec << i << ": E4M3 "
                      << std::hex << int{got} << ", want " << int{want} << " (" << value << ")";
      EXPECT_EQ(formats::e4m3_to_float(got), value) << "element " << i;
    }
  }
  EXPECT_EQ(differ, 0u);
  std::uint32_t out[2];
  cuda::experts::e2m1x8_to_e4m3(0x9000000Fu, out);  // element 0: -6, element 7: -0.5, the rest +0
  EXPECT_EQ(out[0], 0x000000CCu);
  EXPECT_EQ(out[1], 0xB0000000u);
}

}  // namespace
}  // namespace epmoe

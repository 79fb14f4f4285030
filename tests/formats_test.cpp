// MXFP8 / NVFP4 / fp8_block128 / MXFP4 codecs (src/formats/codec.hpp) and the host matrix API
// (epmoe/formats.hpp).
//
// Decode tables are checked against values computed from the bit fields with std::ldexp; encoders
// against the host paths of CUDA's own conversions (cuda_fp8.h, cuda_fp4.h) wherever CUDA defines
// the same rounding, over strided sweeps of all fp32 bit patterns and around every tie.
#include <cuda_fp4.h>
#include <cuda_fp8.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "epmoe/errors.hpp"
#include "epmoe/formats.hpp"
#include "formats/codec.hpp"
#include "support/nvfp4_inputs.hpp"

namespace epmoe::formats {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNan = std::numeric_limits<float>::quiet_NaN();

float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
std::uint32_t to_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
float next_up(float x, int steps = 1) {
  for (int i = 0; i < steps; ++i) x = std::nextafter(x, kInf);
  return x;
}
float next_down(float x, int steps = 1) {
  for (int i = 0; i < steps; ++i) x = std::nextafter(x, -kInf);
  return x;
}

// ---- CUDA references (host paths of cuda_fp8.h / cuda_fp4.h). ----
std::uint8_t cuda_e4m3(float x) {
  return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
}
float cuda_e4m3_value(std::uint8_t c) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(c, __NV_E4M3)));
}
std::uint8_t cuda_e2m1(float x) {
  return __nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest);
}
float cuda_e2m1_value(std::uint8_t c) {
  return __half2float(__half(__nv_cvt_fp4_to_halfraw(c, __NV_E2M1)));
}
std::uint8_t cuda_e8m0_up(float x) {
  return __nv_cvt_float_to_e8m0(x, __NV_SATFINITE, cudaRoundPosInf);
}
std::uint8_t cuda_e8m0_down(float x) {
  return __nv_cvt_float_to_e8m0(x, __NV_SATFINITE, cudaRoundZero);
}
float cuda_e8m0_value(std::uint8_t c) {
  const __nv_bfloat16_raw b = __nv_cvt_e8m0_to_bf16raw(c);
  return from_bits(std::uint32_t{b.x} << 16);
}

// Every fp32 bit pattern visited with a prime stride, plus the smallest and largest magnitudes.
// f returns false after reporting a failure; the sweep then stops.
template <class F>
void sweep_float_bits(std::uint32_t stride, F&& f) {
  for (std::uint64_t u = 0; u <= 0xffffffffull; u += stride) {
    if (!f(from_bits(static_cast<std::uint32_t>(u)))) return;
  }
  for (std::uint32_t u = 0; u < 64; ++u) {
    for (std::uint32_t bits : {u, 0x80000000u | u, 0x7f7fffffu - u, 0xff7fffffu - u}) {
      if (!f(from_bits(bits))) return;
    }
  }
}

// The positive finite values of a format, ascending, and each midpoint with a few fp32 neighbours.
std::vector<float> near_ties(const std::vector<float>& ascending) {
  std::vector<float> out;
  for (std::size_t i = 0; i + 1 < ascending.size(); ++i) {
    const float mid = (ascending[i] + ascending[i + 1]) / 2;  // exact: few significant bits
    for (int k = 0; k <= 3; ++k) {
      for (float v : {next_up(mid, k), next_down(mid, k), next_up(ascending[i], k),
                      next_down(ascending[i + 1], k)}) {
        out.push_back(v);
        out.push_back(-v);
      }
    }
  }
  return out;
}

std::vector<float> e4m3_positive_values() {
  std::vector<float> v;
  for (int c = 0; c <= 0x7e; ++c) v.push_back(e4m3_to_float(static_cast<std::uint8_t>(c)));
  v.push_back(480.0f);  // the next value E4M3 would have above 448: ties there saturate
  return v;
}

// ---------------------------------------------------------------------------------------------
// Decode tables
// ---------------------------------------------------------------------------------------------

TEST(FormatsDecode, E4m3AllCodesMatchBitFieldsAndCuda) {
  for (int c = 0; c < 256; ++c) {
    const int sign = c >> 7, exp = (c >> 3) & 15, man = c & 7;
    const float got = e4m3_to_float(static_cast<std::uint8_t>(c));
    if (exp == 15 && man == 7) {
      EXPECT_TRUE(std::isnan(got)) << "code " << c;
      EXPECT_TRUE(std::isnan(cuda_e4m3_value(static_cast<std::uint8_t>(c))));
      continue;
    }
    const double mag = exp == 0 ? std::ldexp(man / 8.0, -6) : std::ldexp(1.0 + man / 8.0, exp - 7);
    const double want = sign ? -mag : mag;
    EXPECT_EQ(static_cast<double>(got), want) << "code " << c;
    EXPECT_EQ(std::signbit(got), sign == 1) << "code " << c;
    EXPECT_EQ(got, cuda_e4m3_value(static_cast<std::uint8_t>(c))) << "code " << c;
  }
  EXPECT_EQ(e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));
}

TEST(FormatsDecode, E8m0AllCodesArePowersOfTwoAndMatchCuda) {
  for (int c = 0; c < 256; ++c) {
    const float got = e8m0_to_float(static_cast<std::uint8_t>(c));
    if (c == 255) {
      EXPECT_TRUE(std::isnan(got));
      EXPECT_TRUE(std::isnan(cuda_e8m0_value(0xff)));
      continue;
    }
    EXPECT_EQ(static_cast<double>(got), std::ldexp(1.0, c - 127)) << "code " << c;
    EXPECT_EQ(got, cuda_e8m0_value(static_cast<std::uint8_t>(c))) << "code " << c;
  }
}

TEST(FormatsDecode, E2m1AllCodesMatchBitFieldsAndCuda) {
  for (int c = 0; c < 16; ++c) {
    const int sign = c >> 3, exp = (c >> 1) & 3, man = c & 1;
    const double mag = exp == 0 ? man * 0.5 : std::ldexp(1.0 + man / 2.0, exp - 1);
    const float got = e2m1_to_float(static_cast<std::uint8_t>(c));
    EXPECT_EQ(static_cast<double>(got), sign ? -mag : mag) << "code " << c;
    EXPECT_EQ(std::signbit(got), sign == 1) << "code " << c;
    EXPECT_EQ(got, cuda_e2m1_value(static_cast<std::uint8_t>(c))) << "code " << c;
  }
  const float table[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (int c = 0; c < 8; ++c) EXPECT_EQ(e2m1_to_float(static_cast<std::uint8_t>(c)), table[c]);
}

// ---------------------------------------------------------------------------------------------
// Scalar encoders
// ---------------------------------------------------------------------------------------------

TEST(FormatsE4m3, EveryCodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    EXPECT_EQ(float_to_e4m3(e4m3_to_float(static_cast<std::uint8_t>(c))), c) << "code " << c;
  }
}

TEST(FormatsE4m3, HalfwayTiesRoundToEvenCode) {
  for (int c = 0; c < 0x7e; ++c) {
    const float lo = e4m3_to_float(static_cast<std::uint8_t>(c));
    const float hi = e4m3_to_float(static_cast<std::uint8_t>(c + 1));
    const float mid = (lo + hi) / 2;
    const int even = (c & 1) ? c + 1 : c;
    EXPECT_EQ(float_to_e4m3(mid), even) << "between codes " << c << " and " << c + 1;
    EXPECT_EQ(float_to_e4m3(-mid), 0x80 | even);
    EXPECT_EQ(float_to_e4m3(next_down(mid)), c);
    EXPECT_EQ(float_to_e4m3(next_up(mid)), c + 1);
  }
  // Named examples: 17 lies between 16 and 18 -> 16 (mantissa 000); 19 between 18 and 20 -> 20.
  EXPECT_EQ(e4m3_to_float(float_to_e4m3(17.0f)), 16.0f);
  EXPECT_EQ(e4m3_to_float(float_to_e4m3(19.0f)), 20.0f);
  EXPECT_EQ(e4m3_to_float(float_to_e4m3(1.0625f)), 1.0f);   // 1 | 1.125
  EXPECT_EQ(e4m3_to_float(float_to_e4m3(1.1875f)), 1.25f);  // 1.125 | 1.25
}

TEST(FormatsE4m3, SubnormalsAndUnderflowRoundToNearestEven) {
  const float sub = std::ldexp(1.0f, -9);  // the smallest E4M3 subnormal
  EXPECT_EQ(float_to_e4m3(sub), 0x01);
  EXPECT_EQ(float_to_e4m3(sub / 2), 0x00);           // tie 0 | 2^-9 -> 0
  EXPECT_EQ(float_to_e4m3(next_up(sub / 2)), 0x01);  // just above the tie
  EXPECT_EQ(float_to_e4m3(1.5f * sub), 0x02);        // tie 1 | 2 -> 2
  EXPECT_EQ(float_to_e4m3(2.5f * sub), 0x02);        // tie 2 | 3 -> 2
  EXPECT_EQ(float_to_e4m3(7.5f * sub), 0x08);        // tie 7 | 8 -> 8 = 2^-6, the min normal
  EXPECT_EQ(float_to_e4m3(-sub / 4), 0x80);          // underflow keeps the sign
  EXPECT_EQ(float_to_e4m3(from_bits(1)), 0x00);      // fp32 subnormals
  EXPECT_EQ(float_to_e4m3(from_bits(0x807fffffu)), 0x80);
  EXPECT_EQ(float_to_e4m3(-0.0f), 0x80);
}

TEST(FormatsE4m3, SaturatesFiniteAndInfiniteToMax448) {
  EXPECT_EQ(float_to_e4m3(1e6f), 0x7e);
  EXPECT_EQ(float_to_e4m3(-1e6f), 0xfe);
  EXPECT_EQ(float_to_e4m3(FLT_MAX), 0x7e);
  EXPECT_EQ(float_to_e4m3(kInf), 0x7e);
  EXPECT_EQ(float_to_e4m3(-kInf), 0xfe);
  EXPECT_EQ(float_to_e4m3(464.0f), 0x7e);  // the tie with the (absent) 480
  EXPECT_EQ(float_to_e4m3(next_up(448.0f)), 0x7e);
  EXPECT_EQ(float_to_e4m3(next_down(448.0f)), 0x7e);
  EXPECT_EQ(float_to_e4m3(next_down(432.0f)), 0x7d);  // 416 | 448 tie is 432 -> 448 (even)
}

TEST(FormatsE4m3, EveryNanEncodesAs0x7F) {
  EXPECT_EQ(float_to_e4m3(kNan), 0x7f);
  EXPECT_EQ(float_to_e4m3(-kNan), 0x7f);
  EXPECT_EQ(float_to_e4m3(from_bits(0x7f800001u)), 0x7f);  // signalling pattern
  EXPECT_EQ(float_to_e4m3(from_bits(0xffffffffu)), 0x7f);
}

bool e4m3_matches_cuda(float x) {
  const int got = float_to_e4m3(x);
  const int want = std::isnan(x) ? 0x7f : cuda_e4m3(x);  // CUDA's NaN code may carry the sign
  if (std::isnan(x)) {
    EXPECT_TRUE(e4m3_is_nan(cuda_e4m3(x)));
  }
  EXPECT_EQ(got, want) << "x = " << x << " bits 0x" << std::hex << to_bits(x);
  return got == want;
}

TEST(FormatsE4m3, MatchesCudaSatfiniteOnStridedSweepOfAllFloats) {
  sweep_float_bits(251, e4m3_matches_cuda);
}

TEST(FormatsE4m3, MatchesCudaSatfiniteAroundEveryTie) {
  for (float x : near_ties(e4m3_positive_values())) {
    if (!e4m3_matches_cuda(x)) return;
  }
}

TEST(FormatsE2m1, HalfwayTiesRoundToEvenCode) {
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(0.25f)), 0.0f);
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(0.75f)), 1.0f);
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(1.25f)), 1.0f);
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(1.75f)), 2.0f);
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(2.5f)), 2.0f);
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(3.5f)), 4.0f);
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(5.0f)), 4.0f);
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(-2.5f)), -2.0f);
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(next_up(0.25f))), 0.5f);
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(next_up(5.0f))), 6.0f);
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(next_down(2.5f))), 2.0f);
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(next_up(2.5f))), 3.0f);
}

TEST(FormatsE2m1, SaturatesAtSixAndMapsNanToPlusSix) {
  EXPECT_EQ(float_to_e2m1(1e6f), 0x7);
  EXPECT_EQ(float_to_e2m1(-1e6f), 0xf);
  EXPECT_EQ(float_to_e2m1(kInf), 0x7);
  EXPECT_EQ(float_to_e2m1(-kInf), 0xf);
  EXPECT_EQ(float_to_e2m1(kNan), 0x7);
  EXPECT_EQ(float_to_e2m1(-kNan), 0x7);
  EXPECT_EQ(float_to_e2m1(-0.0f), 0x8);
  EXPECT_EQ(float_to_e2m1(-0.1f), 0x8);  // underflow keeps the sign
}

bool e2m1_matches_cuda(float x) {
  const int got = float_to_e2m1(x), want = cuda_e2m1(x);
  EXPECT_EQ(got, want) << "x = " << x << " bits 0x" << std::hex << to_bits(x);
  return got == want;
}

TEST(FormatsE2m1, MatchesCudaRoundNearestOnStridedSweepOfAllFloats) {
  sweep_float_bits(251, e2m1_matches_cuda);
}

TEST(FormatsE2m1, MatchesCudaRoundNearestAroundEveryTie) {
  std::vector<float> values;
  for (int c = 0; c < 8; ++c) values.push_back(e2m1_to_float(static_cast<std::uint8_t>(c)));
  values.push_back(8.0f);  // ties above 6 saturate
  for (float x : near_ties(values)) {
    if (!e2m1_matches_cuda(x)) return;
  }
}

TEST(FormatsE2m1, EveryCodeRoundTripsNegativeZeroIncluded) {
  for (int c = 0; c < 16; ++c) {
    EXPECT_EQ(float_to_e2m1(e2m1_to_float(static_cast<std::uint8_t>(c))), c) << "code " << c;
  }
  EXPECT_TRUE(std::signbit(e2m1_to_float(0x8)));  // 0x8 is -0, not +0
  EXPECT_EQ(e2m1_to_float(0x8), 0.0f);
  EXPECT_FALSE(std::signbit(e2m1_to_float(0x0)));
}

// Every fp32 from 2^-3 (below it everything rounds to ±0) up to 16 (above 6 everything
// saturates), both signs: each tie, each subnormal (0.5) boundary and the saturation edge, bit for
// bit against cuda_fp4.h.
TEST(FormatsE2m1, MatchesCudaRoundNearestOnEveryFloatFromOneEighthToSixteen) {
  for (std::uint32_t sign : {0u, 0x80000000u}) {
    for (std::uint32_t u = 0x3e000000u; u < 0x41800000u; ++u) {
      const float x = from_bits(sign | u);
      if (float_to_e2m1(x) != cuda_e2m1(x) && !e2m1_matches_cuda(x)) return;
    }
  }
}

// A negative value that rounds to zero encodes as -0 (0x8), as CUDA's conversion gives: -0 itself,
// fp32 subnormals, the tie at -0.25 (to the even code, 0) and every fp32 in between at a stride.
TEST(FormatsE2m1, NegativeValuesThatRoundToZeroEncodeAsNegativeZeroLikeCuda) {
  const float named[] = {-0.0f,
                         from_bits(0x80000001u),
                         from_bits(0x807fffffu),
                         -FLT_MIN,
                         -1e-30f,
                         -0.1f,
                         -0.25f,
                         next_up(-0.25f),
                         -0.125f / 3.0f,
                         std::ldexp(-1.0f, -126)};
  for (float x : named) {
    EXPECT_EQ(float_to_e2m1(x), 0x8) << "x = " << x;
    EXPECT_EQ(cuda_e2m1(x), 0x8) << "x = " << x;
    EXPECT_TRUE(std::signbit(round_to_e2m1(x))) << "x = " << x;
  }
  EXPECT_EQ(float_to_e2m1(next_down(-0.25f)), 0x9);  // just past the tie: -0.5
  for (std::uint32_t u = 0x80000000u; u <= 0xbe800000u; u += 31) {
    const float x = from_bits(u);  // -0 ... -0.25
    if (float_to_e2m1(x) != 0x8 || !e2m1_matches_cuda(x)) {
      ADD_FAILURE() << "x = " << x << " bits 0x" << std::hex << u << " encodes as 0x"
                    << int{float_to_e2m1(x)};
      return;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// MXFP8 scale
// ---------------------------------------------------------------------------------------------

TEST(FormatsMxfp8Scale, EdgeCases) {
  for (ScaleRounding r : {ScaleRounding::rceil, ScaleRounding::ocp_floor}) {
    EXPECT_EQ(mxfp8_scale_code(0.0f, r), 0);
    EXPECT_EQ(mxfp8_scale_code(-0.0f, r), 0);
    EXPECT_EQ(mxfp8_scale_code(from_bits(1), r), 0);  // fp32 subnormal amax
    EXPECT_EQ(mxfp8_scale_code(kNan, r), 0xff);
    EXPECT_EQ(mxfp8_scale_code(kInf, r), 0xff);
    EXPECT_EQ(mxfp8_scale_code(-kInf, r), 0xff);
  }
  EXPECT_EQ(mxfp8_scale_code(448.0f, ScaleRounding::rceil), 127);           // 2^0
  EXPECT_EQ(mxfp8_scale_code(next_up(448.0f), ScaleRounding::rceil), 128);  // 2^1
  EXPECT_EQ(mxfp8_scale_code(1.0f, ScaleRounding::rceil), 127 - 8);         // 1/448 -> 2^-8
  EXPECT_EQ(mxfp8_scale_code(FLT_MAX, ScaleRounding::rceil), 127 + 120);    // ~2^128 / 448
  EXPECT_EQ(mxfp8_scale_code(448.0f, ScaleRounding::ocp_floor), 127);       // 2^(8-8)
  EXPECT_EQ(mxfp8_scale_code(511.0f, ScaleRounding::ocp_floor), 127);
  EXPECT_EQ(mxfp8_scale_code(512.0f, ScaleRounding::ocp_floor), 128);
  EXPECT_EQ(mxfp8_scale_code(FLT_MAX, ScaleRounding::ocp_floor), 127 + 119);
  // Clamped at 2^-127: the smallest amax with an unclamped rceil scale is 448 * 2^-127.
  EXPECT_EQ(mxfp8_scale_code(std::ldexp(448.0f, -127), ScaleRounding::rceil), 0);
  EXPECT_EQ(mxfp8_scale_code(next_up(std::ldexp(448.0f, -127)), ScaleRounding::rceil), 1);
  EXPECT_EQ(mxfp8_scale_code(std::ldexp(1.0f, -118), ScaleRounding::ocp_floor), 1);
  EXPECT_EQ(mxfp8_scale_code(std::ldexp(1.0f, -119), ScaleRounding::ocp_floor), 0);
  EXPECT_EQ(mxfp8_scale_code(std::ldexp(1.0f, -126), ScaleRounding::ocp_floor), 0);
}

// RCEIL: amax * 2^-e <= 448 (nothing saturates) and e is the smallest such exponent.
TEST(FormatsMxfp8Scale, RceilIsTheSmallestScaleThatAvoidsSaturation) {
  auto check = [](float amax) {
    if (!(std::isfinite(amax) && amax > 0)) return true;
    const int code = mxfp8_scale_code(amax, ScaleRounding::rceil);
    const int e = code - 127;
    const bool fits = code < 255 && std::ldexp(static_cast<double>(amax), -e) <= 448.0;
    const bool smallest = code == 0 || std::ldexp(static_cast<double>(amax), 1 - e) > 448.0;
    EXPECT_TRUE(fits && smallest) << "amax " << amax << " code " << code;
    return fits && smallest;
  };
  sweep_float_bits(4099, [&](float x) { return check(std::fabs(x)); });
  for (int k = -126; k <= 119; ++k) {
    const float edge = std::ldexp(448.0f, k);
    for (int s = 0; s <= 2; ++s) {
      if (!check(next_up(edge, s)) || !check(next_down(edge, s))) return;
    }
  }
}

// CUDA's e8m0 round-up of fp32 amax / 448 defines the same rule while the quotient is an fp32
// normal; below that our clamp at 2^-127 and the exact rule take over, and ±Inf (which CUDA's
// SATFINITE maps to 2^127) gives NaN (docs/formats.md).
TEST(FormatsMxfp8Scale, RceilMatchesCudaE8m0RoundUpOfAmaxOver448) {
  sweep_float_bits(997, [](float x) {
    const float amax = std::fabs(x);
    if (std::isinf(amax) || amax / 448.0f < std::ldexp(1.0f, -126)) return true;
    const int got = mxfp8_scale_code(amax, ScaleRounding::rceil);
    const int want = cuda_e8m0_up(amax / 448.0f);
    EXPECT_EQ(got, want) << "amax " << amax;
    return got == want;
  });
}

TEST(FormatsMxfp8Scale, OcpFloorMatchesCudaE8m0RoundDownOfAmaxMinus8) {
  sweep_float_bits(997, [](float x) {
    const float amax = std::fabs(x);
    const int want = std::isnan(amax) || std::isinf(amax)
                         ? 0xff
                         : std::max(0, static_cast<int>(cuda_e8m0_down(amax)) - 8);
    const int got = mxfp8_scale_code(amax, ScaleRounding::ocp_floor);
    EXPECT_EQ(got, want) << "amax " << amax;
    return got == want;
  });
}

// ---------------------------------------------------------------------------------------------
// MXFP8 blocks
// ---------------------------------------------------------------------------------------------

std::vector<float> random_block(std::mt19937& rng, int n, float log2_lo, float log2_hi) {
  std::uniform_real_distribution<float> mag(log2_lo, log2_hi);
  std::bernoulli_distribution neg(0.5);
  std::vector<float> x(static_cast<std::size_t>(n));
  for (float& v : x) v = (neg(rng) ? -1.0f : 1.0f) * std::exp2(mag(rng));
  return x;
}

TEST(FormatsMxfp8Block, EncodeMatchesCudaConversions) {
  std::mt19937 rng(1);
  for (ScaleRounding r : {ScaleRounding::rceil, ScaleRounding::ocp_floor}) {
    for (int trial = 0; trial < 4000; ++trial) {
      const float center = std::uniform_real_distribution<float>(-110.0f, 110.0f)(rng);
      std::vector<float> x = random_block(rng, kMxfp8Block, center - 12, center + 4);
      std::uint8_t el[kMxfp8Block], scale;
      mxfp8_encode_block(x.data(), kMxfp8Block, r, el, &scale);
      float amax = 0;
      for (float v : x) amax = std::max(amax, std::fabs(v));
      const int want_scale = r == ScaleRounding::rceil
                                 ? cuda_e8m0_up(amax / 448.0f)
                                 : std::max(0, static_cast<int>(cuda_e8m0_down(amax)) - 8);
      ASSERT_EQ(scale, want_scale) << "amax " << amax;
      for (int i = 0; i < kMxfp8Block; ++i) {
        const double scaled = std::ldexp(static_cast<double>(x[static_cast<std::size_t>(i)]),
                                         127 - want_scale);  // exact in double
        ASSERT_EQ(el[i], __nv_cvt_double_to_fp8(scaled, __NV_SATFINITE, __NV_E4M3))
            << "x " << x[static_cast<std::size_t>(i)];
      }
    }
  }
}

TEST(FormatsMxfp8Block, RoundTripErrorIsWithinHalfAnE4m3Step) {
  std::mt19937 rng(2);
  for (int trial = 0; trial < 2000; ++trial) {
    const float center = std::uniform_real_distribution<float>(-100.0f, 100.0f)(rng);
    std::vector<float> x = random_block(rng, kMxfp8Block, center - 20, center);
    std::uint8_t el[kMxfp8Block], scale;
    float y[kMxfp8Block];
    mxfp8_encode_block(x.data(), kMxfp8Block, ScaleRounding::rceil, el, &scale);
    mxfp8_decode_block(el, scale, kMxfp8Block, y);
    const double s = e8m0_to_float(scale);
    for (int i = 0; i < kMxfp8Block; ++i) {
      const double xi = x[static_cast<std::size_t>(i)];
      // Normal E4M3: relative half step 2^-4; subnormal: absolute half step 2^-10 * scale.
      const double bound = std::max(std::fabs(xi) * 0x1p-4, 0x1p-10 * s);
      ASSERT_LE(std::fabs(y[i] - xi), bound) << "x " << xi << " scale code " << int{scale};
    }
  }
}

TEST(FormatsMxfp8Block, OcpFloorSaturatesWhereRceilDoesNot) {
  std::vector<float> x(kMxfp8Block, 1.0f);
  x[0] = 500.0f;
  std::uint8_t el[kMxfp8Block], scale;
  mxfp8_encode_block(x.data(), kMxfp8Block, ScaleRounding::ocp_floor, el, &scale);
  EXPECT_EQ(scale, 127);   // 2^(floor(log2 500) - 8) = 2^0
  EXPECT_EQ(el[0], 0x7e);  // 500 saturates to 448
  EXPECT_EQ(el[1], 0x38);  // 1.0
  mxfp8_encode_block(x.data(), kMxfp8Block, ScaleRounding::rceil, el, &scale);
  EXPECT_EQ(scale, 128);   // 2^ceil(log2(500 / 448)) = 2^1
  EXPECT_EQ(el[0], 0x78);  // 250 -> 256 (neighbours 240, 256), no saturation
  EXPECT_EQ(el[1], 0x30);  // 0.5
  float y[kMxfp8Block];
  mxfp8_decode_block(el, scale, kMxfp8Block, y);
  EXPECT_EQ(y[0], 512.0f);
  EXPECT_EQ(y[1], 1.0f);
}

TEST(FormatsMxfp8Block, AllZeroBlockHasScale2PowMinus127AndZeroElements) {
  float x[kMxfp8Block] = {};
  x[3] = -0.0f;
  std::uint8_t el[kMxfp8Block], scale = 99;
  mxfp8_encode_block(x, kMxfp8Block, ScaleRounding::rceil, el, &scale);
  EXPECT_EQ(scale, 0);
  for (int i = 0; i < kMxfp8Block; ++i) EXPECT_EQ(el[i], i == 3 ? 0x80 : 0x00);
  float y[kMxfp8Block];
  mxfp8_decode_block(el, scale, kMxfp8Block, y);
  for (float v : y) EXPECT_EQ(v, 0.0f);
}

TEST(FormatsMxfp8Block, Fp32DenormalBlockEncodesWithSmallestScaleExactly) {
  float x[kMxfp8Block];
  for (int i = 0; i < kMxfp8Block; ++i) {
    x[i] = from_bits(static_cast<std::uint32_t>(i) << 18);  // fp32 subnormals up to ~2^-128
  }
  std::uint8_t el[kMxfp8Block], scale;
  mxfp8_encode_block(x, kMxfp8Block, ScaleRounding::rceil, el, &scale);
  EXPECT_EQ(scale, 0);
  float y[kMxfp8Block];
  mxfp8_decode_block(el, scale, kMxfp8Block, y);
  for (int i = 0; i < kMxfp8Block; ++i) {
    // x * 2^127 = i * 2^-4 has at most 5 significant bits; E4M3 keeps 4, so the error is at most
    // half a step.
    const double xi = x[i];
    EXPECT_LE(std::fabs(y[i] - xi), xi * 0x1p-4) << "i " << i;
    EXPECT_EQ(el[i], cuda_e4m3(static_cast<float>(i) * 0.0625f)) << "i " << i;
  }
  EXPECT_EQ(y[16], x[16]);  // 2^-127 * 1.0
}

TEST(FormatsMxfp8Block, E4m3SubnormalElementsKeepTheirValue) {
  float x[kMxfp8Block] = {};
  x[0] = 448.0f;                 // scale 2^0
  x[1] = std::ldexp(1.0f, -9);   // smallest E4M3 subnormal
  x[2] = std::ldexp(5.0f, -9);   // subnormal code 5
  x[3] = std::ldexp(1.0f, -11);  // below half the smallest subnormal -> 0
  std::uint8_t el[kMxfp8Block], scale;
  mxfp8_encode_block(x, kMxfp8Block, ScaleRounding::rceil, el, &scale);
  EXPECT_EQ(scale, 127);
  EXPECT_EQ(el[1], 0x01);
  EXPECT_EQ(el[2], 0x05);
  EXPECT_EQ(el[3], 0x00);
  float y[kMxfp8Block];
  mxfp8_decode_block(el, scale, kMxfp8Block, y);
  EXPECT_EQ(y[1], x[1]);
  EXPECT_EQ(y[2], x[2]);
}

TEST(FormatsMxfp8Block, NanOrInfAnywhereMakesOnlyThatBlockNan) {
  for (float bad : {kNan, kInf, -kInf}) {
    for (int pos : {0, 17, 31}) {
      std::vector<float> row(3 * kMxfp8Block, 1.5f);
      row[static_cast<std::size_t>(kMxfp8Block + pos)] = bad;
      std::uint8_t el[3 * kMxfp8Block], scales[3];
      mxfp8_encode_row(row.data(), 3 * kMxfp8Block, ScaleRounding::rceil, el, scales);
      EXPECT_EQ(scales[0], 127 - 8);
      EXPECT_EQ(scales[1], 0xff);
      EXPECT_EQ(scales[2], 127 - 8);
      std::vector<float> y(row.size());
      mxfp8_decode_row(el, scales, 3 * kMxfp8Block, y.data());
      for (int i = 0; i < 3 * kMxfp8Block; ++i) {
        if (i / kMxfp8Block == 1) {
          EXPECT_TRUE(std::isnan(y[static_cast<std::size_t>(i)])) << "i " << i;
          EXPECT_EQ(el[i], 0x7f);
        } else {
          EXPECT_EQ(y[static_cast<std::size_t>(i)], 1.5f) << "i " << i;
        }
      }
    }
  }
}

TEST(FormatsMxfp8Block, QuantizeDequantizeRowEqualsEncodeThenDecode) {
  std::mt19937 rng(3);
  std::vector<float> x = random_block(rng, 256, -30, 10);
  std::vector<std::uint8_t> el(256), scales(8);
  std::vector<float> y(256), z(256);
  mxfp8_encode_row(x.data(), 256, ScaleRounding::ocp_floor, el.data(), scales.data());
  mxfp8_decode_row(el.data(), scales.data(), 256, y.data());
  mxfp8_quantize_dequantize_row(x.data(), 256, ScaleRounding::ocp_floor, z.data());
  EXPECT_EQ(y, z);
  mxfp8_quantize_dequantize_row(x.data(), 256, ScaleRounding::ocp_floor, x.data());  // in place
  EXPECT_EQ(x, z);
}

TEST(FormatsSizes, RowBytes) {
  EXPECT_EQ(mxfp8_scale_count(7168), 224);
  EXPECT_EQ(mxfp8_row_bytes(7168), 7168 + 224);
  EXPECT_EQ(nvfp4_packed_bytes(7168), 3584);
  EXPECT_EQ(nvfp4_scale_count(7168), 448);
  EXPECT_EQ(nvfp4_row_bytes(7168), 3584 + 448);
  static_assert(mxfp8_row_bytes(32) == 33 && nvfp4_row_bytes(16) == 9);
}

// ---------------------------------------------------------------------------------------------
// NVFP4
// ---------------------------------------------------------------------------------------------

TEST(FormatsNvfp4Scale, TensorScaleEdgeCases) {
  EXPECT_EQ(nvfp4_tensor_scale(2688.0f), 1.0f);
  EXPECT_EQ(nvfp4_tensor_scale(6.0f), 448.0f);
  EXPECT_EQ(nvfp4_tensor_scale(3.0f), 2688.0f / 3.0f);
  EXPECT_EQ(nvfp4_tensor_scale(0.0f), 1.0f);
  EXPECT_EQ(nvfp4_tensor_scale(-0.0f), 1.0f);
  EXPECT_EQ(nvfp4_tensor_scale(kNan), 1.0f);
  EXPECT_EQ(nvfp4_tensor_scale(kInf), 1.0f);
  EXPECT_EQ(nvfp4_tensor_scale(from_bits(1)), FLT_MAX);  // 2688 / 2^-149 overflows
  EXPECT_EQ(nvfp4_tensor_scale(1e-36f), FLT_MAX);
}

TEST(FormatsNvfp4Scale, GroupAmaxSkipsNanAndInf) {
  const float x[6] = {1.0f, -7.5f, kNan, kInf, -kInf, 3.0f};
  EXPECT_EQ(nvfp4_group_amax(x, 6), 7.5f);
  const float bad[2] = {kNan, -kInf};
  EXPECT_EQ(nvfp4_group_amax(bad, 2), 0.0f);
  EXPECT_EQ(nvfp4_group_amax(x, 0), 0.0f);
}

// The reference: each step of docs/formats.md in fp32, rounded by CUDA's converters. A zero block
// scale scales every element by 0, as CUDA's NVFP4 quantize kernels do (their reciprocal scale of
// a zero block is 0). Finite x only.
void nvfp4_expected(const float* x, int n, float s_enc, std::uint8_t* codes, std::uint8_t* bs) {
  float amax = 0;
  for (int i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float t = amax / 6.0f;
  *bs = cuda_e4m3(t * s_enc);
  const float bsv = cuda_e4m3_value(*bs);
  for (int i = 0; i < n; ++i) {
    const float q = x[i] * s_enc;
    codes[i] = cuda_e2m1(bsv == 0.0f ? x[i] * 0.0f : q / bsv);
  }
}

TEST(FormatsNvfp4Block, EncodeMatchesCudaConversionsStepByStep) {
  std::mt19937 rng(4);
  for (int trial = 0; trial < 4000; ++trial) {
    const float center = std::uniform_real_distribution<float>(-60.0f, 60.0f)(rng);
    std::vector<float> row = random_block(rng, 4 * kNvfp4Block, center - 14, center + 2);
    const float s_enc = nvfp4_tensor_scale(nvfp4_group_amax(row.data(), 4 * kNvfp4Block));
    for (int b = 0; b < 4; ++b) {
      const float* x = row.data() + b * kNvfp4Block;
      std::uint8_t packed[8], bs, want_codes[kNvfp4Block], want_bs;
      nvfp4_encode_block(x, kNvfp4Block, s_enc, packed, &bs);
      nvfp4_expected(x, kNvfp4Block, s_enc, want_codes, &want_bs);
      ASSERT_EQ(bs, want_bs);
      for (int i = 0; i < kNvfp4Block; ++i) {
        ASSERT_EQ((packed[i / 2] >> (4 * (i % 2))) & 0xf, want_codes[i]) << "x " << x[i];
      }
    }
  }
}

// Near a tie the fp32 rounding of each step decides the code, so the order is part of the format:
// block scale (amax / 6) * s_enc, element (x * s_enc) / block_scale. Found by search.
TEST(FormatsNvfp4Block, FollowsTheDocumentedFp32OperationOrder) {
  const float s = from_bits(0x43ac139au);                              // 344.153137
  float x[kNvfp4Block] = {from_bits(0x40bb7392u)};                     // amax 5.8578577
  EXPECT_EQ(x[0] / 6.0f * s, 336.0f);                                  // E4M3 tie 320 | 352 -> 320
  EXPECT_EQ(float_to_e4m3(x[0] * (s / 6.0f)), float_to_e4m3(352.0f));  // the other order
  std::uint8_t packed[8], bs;
  nvfp4_encode_block(x, kNvfp4Block, s, packed, &bs);
  EXPECT_EQ(e4m3_to_float(bs), 320.0f);

  const float s2 = from_bits(0x43b819d2u);  // 368.201721
  float y[kNvfp4Block] = {from_bits(0x3afa4c2fu), 0.5625f * 6.0f / s2};
  ASSERT_EQ(float_to_e4m3(y[1] / 6.0f * s2), 0x31);  // block scale 0.5625
  EXPECT_GT(y[0] * s2 / 0.5625f, 1.25f);             // just above the tie 1 | 1.5
  EXPECT_EQ(y[0] * (s2 / 0.5625f), 1.25f);           // the other order lands on it
  nvfp4_encode_block(y, kNvfp4Block, s2, packed, &bs);
  EXPECT_EQ(bs, 0x31);
  EXPECT_EQ(packed[0] & 0xf, 0x3);  // 1.5
}

TEST(FormatsNvfp4Block, RoundTripErrorIsBoundedByHalfAnE2m1Step) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 2000; ++trial) {
    const float center = std::uniform_real_distribution<float>(-40.0f, 40.0f)(rng);
    std::vector<float> row = random_block(rng, 64, center - 6, center);
    const float s_enc = nvfp4_tensor_scale(nvfp4_group_amax(row.data(), 64));
    std::uint8_t packed[32], scales[4];
    float y[64];
    nvfp4_encode_row(row.data(), 64, s_enc, packed, scales);
    nvfp4_decode_row(packed, scales, s_enc, 64, y);
    for (int i = 0; i < 64; ++i) {
      const double xi = row[static_cast<std::size_t>(i)];
      const double unit = e4m3_to_float(scales[i / 16]) / static_cast<double>(s_enc);
      const double q = std::fabs(xi) / unit;  // the element before rounding, in E2M1 units
      // E2M1 half steps: 0.25 up to 2, then 0.5 up to 4, then 1; q may exceed 6 by the block
      // scale's own rounding (<= 6 * 2^-4) and saturate. Both fit max(0.25, q / 4).
      const double bound = std::max(0.25, q / 4) * unit * (1 + 1e-6);
      ASSERT_LE(std::fabs(y[i] - xi), bound) << "x " << xi;
    }
  }
}

TEST(FormatsNvfp4Block, WorkedExample) {
  // Group amax 6 -> s_enc = 448; block amax 3 -> block scale e4m3(3 / 6 * 448) = 224.
  const float x[kNvfp4Block] = {3.0f, -3.0f, 1.0f, 0.75f, 0.1f, 0.3f, 2.0f, -1.7f,
                                0.0f, 0.5f,  2.9f, -0.2f, 1.2f, 1.3f, 0.6f, 0.4f};
  const float s_enc = nvfp4_tensor_scale(6.0f);
  EXPECT_EQ(s_enc, 448.0f);
  std::uint8_t packed[8], bs;
  nvfp4_encode_block(x, kNvfp4Block, s_enc, packed, &bs);
  EXPECT_EQ(e4m3_to_float(bs), 224.0f);
  EXPECT_EQ(bs, 0x76);  // exponent 7 + bias 7 = 14, mantissa 0b110
  // Elements are x * 448 / 224 = 2x: 6, -6, 2, 1.5, 0.2->0, 0.6->0.5, 4, -3.4->-3, ...
  EXPECT_EQ(packed[0], 0xf7);  // element 0 = +6 (0x7) low, element 1 = -6 (0xf) high
  EXPECT_EQ(packed[1], 0x34);  // 2 (0x4) low, 1.5 (0x3) high
  EXPECT_EQ(packed[2], 0x10);  // 0 low, 0.5 high
  EXPECT_EQ(packed[3], 0xd6);  // 4 (0x6) low, -3 (0xd) high
  float y[kNvfp4Block];
  nvfp4_decode_block(packed, bs, s_enc, kNvfp4Block, y);
  const float want[kNvfp4Block] = {3.0f, -3.0f, 1.0f, 0.75f,  0.0f, 0.25f, 2.0f, -1.5f,
                                   0.0f, 0.5f,  3.0f, -0.25f, 1.0f, 1.5f,  0.5f, 0.5f};
  for (int i = 0; i < kNvfp4Block; ++i) EXPECT_EQ(y[i], want[i]) << "i " << i;
}

TEST(FormatsNvfp4Block, PacksElement2iInTheLowNibble) {
  float x[kNvfp4Block] = {};
  x[0] = 0.5f;  // with s_enc = 1 and block amax 6: block scale 1, elements as given
  x[1] = 6.0f;
  x[14] = -1.0f;
  x[15] = 3.0f;
  std::uint8_t packed[8], bs;
  nvfp4_encode_block(x, kNvfp4Block, 1.0f, packed, &bs);
  EXPECT_EQ(bs, 0x38);  // 1.0
  EXPECT_EQ(packed[0], 0x71);
  EXPECT_EQ(packed[7], 0x5a);
  for (int i = 1; i < 7; ++i) EXPECT_EQ(packed[i], 0);
}

TEST(FormatsNvfp4Block, AllZeroBlockHasZeroScaleAndDecodesToZero) {
  const float x[kNvfp4Block] = {};
  std::uint8_t packed[8], bs = 99;
  nvfp4_encode_block(x, kNvfp4Block, nvfp4_tensor_scale(0.0f), packed, &bs);
  EXPECT_EQ(bs, 0);
  for (std::uint8_t p : packed) EXPECT_EQ(p, 0);
  float y[kNvfp4Block];
  nvfp4_decode_block(packed, bs, 1.0f, kNvfp4Block, y);
  for (float v : y) EXPECT_EQ(v, 0.0f);
}

TEST(FormatsNvfp4Block, BlockScaleUnderflowGivesZeroElementsOfTheirOwnSign) {
  // Group amax 1e4 -> s_enc = 0.2688; a block of amax 1e-4 has block scale ~4.5e-6 < 2^-10 -> 0.
  const float s_enc = nvfp4_tensor_scale(1e4f);
  float x[kNvfp4Block];
  for (int i = 0; i < kNvfp4Block; ++i) x[i] = 1e-4f * static_cast<float>(i - 8) / 8.0f;
  std::uint8_t packed[8], bs;
  nvfp4_encode_block(x, kNvfp4Block, s_enc, packed, &bs);
  EXPECT_EQ(bs, 0);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(packed[i], 0x88) << "byte " << i;  // x[0..7] < 0: -0
  for (int i = 4; i < 8; ++i) EXPECT_EQ(packed[i], 0x00) << "byte " << i;  // x[8] = 0, rest > 0
  float y[kNvfp4Block];
  nvfp4_decode_block(packed, bs, s_enc, kNvfp4Block, y);
  for (int i = 0; i < kNvfp4Block; ++i) {
    EXPECT_EQ(y[i], 0.0f) << "i " << i;
    EXPECT_EQ(std::signbit(y[i]), i < 8) << "i " << i;
  }
}

// All-zero and underflowing blocks keep each element's sign, -0.0 included, exactly as the CUDA
// conversion of the element scaled by 0 does; the signed zero survives decoding.
TEST(FormatsNvfp4Block, ZeroBlockScaleEncodesEachElementAsCudaDoes) {
  const float tiny = 1e-30f;  // with s_enc = 1 the block scale e4m3(1e-30 / 6) is 0
  const float blocks[][kNvfp4Block] = {
      {0.0f, -0.0f, -0.0f, 0.0f, -0.0f},
      {-tiny, tiny, -tiny / 3, from_bits(0x80000001u), from_bits(1), -0.0f, 0.0f, -tiny},
  };
  for (const auto& x : blocks) {
    std::uint8_t packed[8], bs, want_codes[kNvfp4Block], want_bs;
    nvfp4_encode_block(x, kNvfp4Block, 1.0f, packed, &bs);
    nvfp4_expected(x, kNvfp4Block, 1.0f, want_codes, &want_bs);
    EXPECT_EQ(bs, 0);
    EXPECT_EQ(want_bs, 0);
    float y[kNvfp4Block];
    nvfp4_decode_block(packed, bs, 1.0f, kNvfp4Block, y);
    for (int i = 0; i < kNvfp4Block; ++i) {
      const int code = (packed[i / 2] >> (4 * (i % 2))) & 0xf;
      EXPECT_EQ(code, want_codes[i]) << "x " << x[i];
      EXPECT_EQ(code, std::signbit(x[i]) ? 0x8 : 0x0) << "x " << x[i];
      EXPECT_EQ(y[i], 0.0f);
      EXPECT_EQ(std::signbit(y[i]), std::signbit(x[i])) << "x " << x[i];
    }
  }
}

// Every input class of support/nvfp4_inputs.hpp (zero-scale blocks, ties, negatives that round to
// zero, rows of every magnitude), through the host API in both scale groups: every code equals
// CUDA's conversion of the documented steps. tests/gpu/ runs the same matrix on the device.
TEST(FormatsNvfp4Block, EncodeMatchesCudaConversionsOnEveryInputClass) {
  std::int64_t rows = 0;
  const std::vector<float> x = test::nvfp4_input_matrix(&rows);
  const std::int64_t cols = test::kNvfp4InputCols;
  for (Nvfp4ScaleGroup group : {Nvfp4ScaleGroup::per_tensor, Nvfp4ScaleGroup::per_row}) {
    std::vector<std::uint8_t> packed(x.size() / 2), scales(x.size() / kNvfp4Block);
    std::vector<float> s_enc(static_cast<std::size_t>(rows));
    quantize_nvfp4(x.data(), rows, cols, group, packed.data(), scales.data(), s_enc.data());
    int zero_scale_blocks = 0, negative_zeros = 0;
    for (std::int64_t b = 0; b < rows * cols / kNvfp4Block; ++b) {
      const std::int64_t row = b * kNvfp4Block / cols;
      const float s = s_enc[static_cast<std::size_t>(group == Nvfp4ScaleGroup::per_row ? row : 0)];
      std::uint8_t want_codes[kNvfp4Block], want_bs;
      nvfp4_expected(x.data() + b * kNvfp4Block, kNvfp4Block, s, want_codes, &want_bs);
      ASSERT_EQ(scales[static_cast<std::size_t>(b)], want_bs) << "block " << b;
      zero_scale_blocks += want_bs == 0;
      for (int i = 0; i < kNvfp4Block; ++i) {
        const std::size_t at = static_cast<std::size_t>(b * kNvfp4Block + i);
        ASSERT_EQ((packed[at / 2] >> (4 * (at % 2))) & 0xf, want_codes[i])
            << "x " << x[at] << " block " << b << " group " << to_string(group);
        negative_zeros += want_codes[i] == 0x8;
      }
    }
    // The input classes this test is for are there.
    EXPECT_GT(zero_scale_blocks, 10) << to_string(group);
    EXPECT_GT(negative_zeros, 100) << to_string(group);
  }
}

TEST(FormatsNvfp4Block, DenormalOnlyBlockUsesSubnormalBlockScale) {
  // Per-row scale of an all-fp32-denormal row saturates at FLT_MAX; the block scale stays finite.
  float x[kNvfp4Block];
  for (int i = 0; i < kNvfp4Block; ++i) x[i] = from_bits(static_cast<std::uint32_t>(i + 1) << 16);
  const float s_enc = nvfp4_tensor_scale(nvfp4_group_amax(x, kNvfp4Block));
  EXPECT_EQ(s_enc, FLT_MAX);
  std::uint8_t packed[8], bs, want_codes[kNvfp4Block], want_bs;
  nvfp4_encode_block(x, kNvfp4Block, s_enc, packed, &bs);
  nvfp4_expected(x, kNvfp4Block, s_enc, want_codes, &want_bs);
  EXPECT_EQ(bs, want_bs);
  EXPECT_NE(bs, 0);
  for (int i = 0; i < kNvfp4Block; ++i)
    EXPECT_EQ((packed[i / 2] >> (4 * (i % 2))) & 0xf, want_codes[i]);
  float y[kNvfp4Block];
  nvfp4_decode_block(packed, bs, s_enc, kNvfp4Block, y);
  // Decoding divides by FLT_MAX into the fp32 subnormals, still within the E2M1 rounding error.
  EXPECT_NEAR(y[kNvfp4Block - 1], x[kNvfp4Block - 1], x[kNvfp4Block - 1] * 0.25f);
}

TEST(FormatsNvfp4Block, NanOrInfMakesOnlyThatBlockNan) {
  for (float bad : {kNan, kInf, -kInf}) {
    std::vector<float> row(3 * kNvfp4Block, 0.75f);
    row[static_cast<std::size_t>(kNvfp4Block + 5)] = bad;
    const float s_enc = nvfp4_tensor_scale(nvfp4_group_amax(row.data(), 48));
    EXPECT_EQ(s_enc, 2688.0f / 0.75f);
    std::uint8_t packed[24], scales[3];
    nvfp4_encode_row(row.data(), 48, s_enc, packed, scales);
    EXPECT_EQ(scales[1], 0x7f);
    float y[48];
    nvfp4_decode_row(packed, scales, s_enc, 48, y);
    for (int i = 0; i < 48; ++i) {
      if (i / kNvfp4Block == 1) {
        EXPECT_TRUE(std::isnan(y[i])) << "i " << i;
      } else {
        EXPECT_FLOAT_EQ(y[i], 0.75f) << "i " << i;
      }
    }
  }
}

TEST(FormatsNvfp4Block, StaticScaleSmallerThanNeededSaturatesAtSix) {
  // s_enc from amax 1 applied to a block of amax 100: block scale saturates at 448, elements at 6.
  const float x[kNvfp4Block] = {100.0f, -100.0f, 1.0f};
  const float s_enc = nvfp4_tensor_scale(1.0f);
  std::uint8_t packed[8], bs;
  nvfp4_encode_block(x, kNvfp4Block, s_enc, packed, &bs);
  EXPECT_EQ(bs, 0x7e);
  EXPECT_EQ(packed[0], 0xf7);
}

// ---------------------------------------------------------------------------------------------
// Public host API
// ---------------------------------------------------------------------------------------------

TEST(FormatsApi, QuantizeMxfp8MatchesTheRowCodecAndRoundTrips) {
  std::mt19937 rng(6);
  const std::int64_t rows = 5, cols = 96;
  std::vector<float> x = random_block(rng, static_cast<int>(rows * cols), -10, 6);
  std::vector<std::uint8_t> el(rows * cols), sc(rows * cols / 32);
  epmoe::quantize_mxfp8(x.data(), rows, cols, el.data(), sc.data(), ScaleRounding::ocp_floor);
  std::vector<std::uint8_t> el_row(cols), sc_row(cols / 32);
  for (std::int64_t r = 0; r < rows; ++r) {
    mxfp8_encode_row(x.data() + r * cols, cols, ScaleRounding::ocp_floor, el_row.data(),
                     sc_row.data());
    for (std::int64_t c = 0; c < cols; ++c) ASSERT_EQ(el[r * cols + c], el_row[c]);
    for (std::int64_t j = 0; j < cols / 32; ++j) ASSERT_EQ(sc[r * cols / 32 + j], sc_row[j]);
  }
  std::vector<float> y(rows * cols), z(rows * cols);
  epmoe::dequantize_mxfp8(el.data(), sc.data(), rows, cols, y.data());
  for (std::int64_t r = 0; r < rows; ++r) {
    mxfp8_quantize_dequantize_row(x.data() + r * cols, cols, ScaleRounding::ocp_floor,
                                  z.data() + r * cols);
  }
  EXPECT_EQ(y, z);
  // The default rounding is rceil.
  epmoe::quantize_mxfp8(x.data(), rows, cols, el.data(), sc.data());
  mxfp8_encode_row(x.data(), cols, ScaleRounding::rceil, el_row.data(), sc_row.data());
  EXPECT_EQ(sc[0], sc_row[0]);
}

TEST(FormatsApi, QuantizeNvfp4PerRowScalesEachRowByItsOwnAmax) {
  const std::int64_t rows = 3, cols = 32;
  std::vector<float> x(rows * cols, 0.5f);
  x[5] = 12.0f;         // row 0 amax 12
  x[cols + 7] = -3.0f;  // row 1 amax 3
  std::vector<std::uint8_t> packed(rows * cols / 2), sc(rows * cols / 16);
  float ts[3];
  epmoe::quantize_nvfp4(x.data(), rows, cols, epmoe::Nvfp4ScaleGroup::per_row, packed.data(),
                        sc.data(), ts);
  EXPECT_EQ(ts[0], 2688.0f / 12.0f);
  EXPECT_EQ(ts[1], 2688.0f / 3.0f);
  EXPECT_EQ(ts[2], 2688.0f / 0.5f);
  std::vector<float> y(rows * cols);
  epmoe::dequantize_nvfp4(packed.data(), sc.data(), ts, rows, cols, epmoe::Nvfp4ScaleGroup::per_row,
                          y.data());
  EXPECT_EQ(y[5], 12.0f);
  EXPECT_EQ(y[cols + 7], -3.0f);
  EXPECT_EQ(y[2 * cols], 0.5f);
  for (std::int64_t r = 0; r < rows; ++r) {
    std::vector<float> z(cols);
    nvfp4_quantize_dequantize_row(x.data() + r * cols, cols, ts[r], z.data());
    for (std::int64_t c = 0; c < cols; ++c) ASSERT_EQ(y[r * cols + c], z[c]);
  }
}

TEST(FormatsApi, QuantizeNvfp4PerTensorUsesOneScaleForTheMatrix) {
  const std::int64_t rows = 2, cols = 16;
  std::vector<float> x(rows * cols, 1.0f);
  x[20] = kNan;  // ignored by the amax, poisons its block only
  x[3] = -6.0f;  // the matrix amax
  std::vector<std::uint8_t> packed(rows * cols / 2), sc(rows * cols / 16);
  float ts = 0;
  epmoe::quantize_nvfp4(x.data(), rows, cols, epmoe::Nvfp4ScaleGroup::per_tensor, packed.data(),
                        sc.data(), &ts);
  EXPECT_EQ(ts, 448.0f);
  EXPECT_EQ(sc[1], 0x7f);
  std::vector<float> y(rows * cols);
  epmoe::dequantize_nvfp4(packed.data(), sc.data(), &ts, rows, cols,
                          epmoe::Nvfp4ScaleGroup::per_tensor, y.data());
  EXPECT_EQ(y[3], -6.0f);
  EXPECT_EQ(y[0], 1.0f);
  EXPECT_TRUE(std::isnan(y[16]));
  // A static scale gives the same bytes when it equals the computed one.
  std::vector<std::uint8_t> packed2(packed.size()), sc2(sc.size());
  epmoe::quantize_nvfp4_static(x.data(), rows, cols, ts, packed2.data(), sc2.data());
  EXPECT_EQ(packed, packed2);
  EXPECT_EQ(sc, sc2);
}

template <class F>
std::string invalid_argument_message(F&& f) {
  try {
    f();
  } catch (const epmoe::Error& e) {
    EXPECT_EQ(e.code(), epmoe::ErrorCode::invalid_argument);
    return e.what();
  }
  ADD_FAILURE() << "no epmoe::Error thrown";
  return {};
}

TEST(FormatsApi, RejectsBadArgumentsNamingArgumentValueAndRule) {
  std::vector<float> x(64 * 2), y(64 * 2);
  std::vector<std::uint8_t> a(64 * 2), b(16);
  float ts[2];
  EXPECT_EQ(
      invalid_argument_message([&] { epmoe::quantize_mxfp8(x.data(), 2, 40, a.data(), b.data()); }),
      "quantize_mxfp8: cols=40 must be a multiple of 32");
  EXPECT_EQ(invalid_argument_message(
                [&] { epmoe::quantize_mxfp8(x.data(), -1, 32, a.data(), b.data()); }),
            "quantize_mxfp8: rows=-1 must be >= 0");
  EXPECT_EQ(
      invalid_argument_message([&] { epmoe::quantize_mxfp8(nullptr, 1, 32, a.data(), b.data()); }),
      "quantize_mxfp8: x=null must be non-null when rows * cols (1 * 32) > 0");
  EXPECT_EQ(invalid_argument_message(
                [&] { epmoe::dequantize_mxfp8(a.data(), nullptr, 1, 32, y.data()); }),
            "dequantize_mxfp8: scales=null must be non-null when rows * cols (1 * 32) > 0");
  EXPECT_EQ(invalid_argument_message([&] {
              epmoe::quantize_nvfp4(x.data(), 1, 24, epmoe::Nvfp4ScaleGroup::per_row, a.data(),
                                    b.data(), ts);
            }),
            "quantize_nvfp4: cols=24 must be a multiple of 16");
  EXPECT_EQ(invalid_argument_message([&] {
              epmoe::quantize_nvfp4(x.data(), 1, 16, epmoe::Nvfp4ScaleGroup::per_row, a.data(),
                                    b.data(), nullptr);
            }),
            "quantize_nvfp4: tensor_scales=null must be non-null (it receives the s_enc of each "
            "group)");
  EXPECT_EQ(invalid_argument_message(
                [&] { epmoe::quantize_nvfp4_static(x.data(), 1, 16, 0.0f, a.data(), b.data()); }),
            "quantize_nvfp4_static: tensor_scale=0.000000 must be finite and > 0");
  EXPECT_EQ(invalid_argument_message([&] {
              epmoe::dequantize_nvfp4(a.data(), b.data(), ts, 1, 16,
                                      static_cast<epmoe::Nvfp4ScaleGroup>(7), y.data());
            }),
            "dequantize_nvfp4: group=7 must be per_tensor or per_row");
  // Empty matrices accept null pointers.
  EXPECT_NO_THROW(epmoe::quantize_mxfp8(nullptr, 0, 32, nullptr, nullptr));
  EXPECT_NO_THROW(epmoe::dequantize_nvfp4(nullptr, nullptr, nullptr, 0, 16,
                                          epmoe::Nvfp4ScaleGroup::per_row, nullptr));
}

// ---------------------------------------------------------------------------------------------
// fp8_block128 (DeepSeek-V3/R1): scale = amax / 448 in fp32, element = e4m3(x / scale)
// ---------------------------------------------------------------------------------------------

// The reference: the documented steps in fp32, rounded by cuda_fp8.h. A zero scale scales every
// element by 0 (the zero of its sign). Finite x only.
float fp8_expected_scale(const float* x, int rows, int cols, std::int64_t stride) {
  float amax = 0;
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) amax = std::max(amax, std::fabs(x[r * stride + c]));
  return amax / 448.0f;
}
std::uint8_t fp8_expected_element(float x, float scale) {
  return cuda_e4m3(scale == 0.0f ? x * 0.0f : x / scale);
}

TEST(FormatsFp8Block128, ScaleIsAmaxOver448AndNanForNonFinite) {
  EXPECT_EQ(fp8_block128_scale(448.0f), 1.0f);
  EXPECT_EQ(fp8_block128_scale(1.0f), 1.0f / 448.0f);
  EXPECT_EQ(fp8_block128_scale(7.0f), 0.015625f);  // 7 / 448 = 2^-6, exact
  EXPECT_EQ(fp8_block128_scale(0.0f), 0.0f);
  EXPECT_EQ(fp8_block128_scale(from_bits(1)), 0.0f);  // 2^-149 / 448 underflows
  EXPECT_GT(fp8_block128_scale(std::ldexp(1.0f, -140)), 0.0f);
  EXPECT_TRUE(std::isnan(fp8_block128_scale(kNan)));
  EXPECT_TRUE(std::isnan(fp8_block128_scale(kInf)));
  EXPECT_EQ(fp8_block128_scale(FLT_MAX), FLT_MAX / 448.0f);
}

// Blocks of every magnitude, fp32 subnormals and saturation included, partial lengths too.
TEST(FormatsFp8Block128, EncodeMatchesCudaConversionsOnRandomBlocks) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 4000; ++trial) {
    const float center = std::uniform_real_distribution<float>(-150.0f, 124.0f)(rng);
    const int n = trial % 5 == 0 ? 1 + trial % 127 : kFp8Block128;
    std::vector<float> x = random_block(rng, n, center - 14, center + 3);
    std::uint8_t el[kFp8Block128];
    float scale;
    fp8_block128_encode_block(x.data(), n, el, &scale);
    const float want = fp8_expected_scale(x.data(), 1, n, n);
    ASSERT_EQ(to_bits(scale), to_bits(want)) << "trial " << trial;
    for (int i = 0; i < n; ++i) {
      ASSERT_EQ(el[i], fp8_expected_element(x[static_cast<std::size_t>(i)], scale))
          << "x " << x[static_cast<std::size_t>(i)] << " scale " << scale;
    }
  }
}

// Every E4M3 tie and its neighbours as x / scale, under a power-of-two scale and under scale 3.
TEST(FormatsFp8Block128, EncodeMatchesCudaAroundEveryE4m3Tie) {
  for (float amax : {448.0f, 1344.0f}) {  // scale 1, scale 3
    const float scale = fp8_block128_scale(amax);
    for (float t : near_ties(e4m3_positive_values())) {
      const float x = t * scale;
      if (std::fabs(x) > amax) continue;
      ASSERT_EQ(fp8_block128_encode_value(x, scale), fp8_expected_element(x, scale)) << "x " << x;
    }
  }
}

TEST(FormatsFp8Block128, SubnormalsNegativeZerosAndTheBlockAmaxAs448) {
  float x[kFp8Block128] = {};
  x[0] = -448.0f;                // scale 1
  x[1] = std::ldexp(1.0f, -9);   // smallest E4M3 subnormal
  x[2] = std::ldexp(3.0f, -10);  // tie 1 | 2 -> 2
  x[3] = std::ldexp(1.0f, -10);  // tie 0 | 1 -> 0
  x[4] = -1e-6f;                 // negative, rounds to zero: -0
  x[5] = -0.0f;
  x[6] = 17.0f;  // tie 16 | 18 -> 16
  std::uint8_t el[kFp8Block128];
  float scale;
  fp8_block128_encode_block(x, kFp8Block128, el, &scale);
  EXPECT_EQ(scale, 1.0f);
  const std::uint8_t want[7] = {0xfe, 0x01, 0x02, 0x00, 0x80, 0x80, 0x58};
  for (int i = 0; i < 7; ++i) EXPECT_EQ(el[i], want[i]) << "i " << i;
  for (int i = 7; i < kFp8Block128; ++i) EXPECT_EQ(el[i], 0x00);
  float y[kFp8Block128];
  fp8_block128_decode_block(el, scale, kFp8Block128, y);
  EXPECT_TRUE(std::signbit(y[4]) && std::signbit(y[5]) && y[4] == 0.0f);
  // Whatever the fp32 rounding of amax / 448, the block's largest value encodes as ±448.
  std::mt19937 rng(12);
  for (int trial = 0; trial < 20000; ++trial) {
    const float amax = std::exp2(std::uniform_real_distribution<float>(-120.0f, 127.0f)(rng));
    ASSERT_EQ(fp8_block128_encode_value(amax, fp8_block128_scale(amax)), 0x7e) << amax;
  }
}

TEST(FormatsFp8Block128, ZeroScaleBlocksKeepEachElementsSign) {
  const float tiny = std::ldexp(1.0f, -145);  // amax / 448 underflows to 0
  const float blocks[][8] = {{0.0f, -0.0f, 0.0f, -0.0f},
                             {tiny, -tiny, from_bits(0x80000001u), 0.0f, -0.0f, -tiny}};
  for (const auto& x : blocks) {
    std::uint8_t el[8];
    float scale = 1.0f;
    fp8_block128_encode_block(x, 8, el, &scale);
    EXPECT_EQ(to_bits(scale), 0u);
    float y[8];
    fp8_block128_decode_block(el, scale, 8, y);
    for (int i = 0; i < 8; ++i) {
      EXPECT_EQ(el[i], std::signbit(x[i]) ? 0x80 : 0x00) << "x " << x[i];
      EXPECT_EQ(el[i], fp8_expected_element(x[i], scale));
      EXPECT_EQ(y[i], 0.0f);
      EXPECT_EQ(std::signbit(y[i]), std::signbit(x[i]));
    }
  }
}

TEST(FormatsFp8Block128, NanOrInfMakesOnlyThatBlockNan) {
  for (float bad : {kNan, kInf, -kInf}) {
    std::vector<float> row(3 * kFp8Block128, 1.5f);
    row[kFp8Block128 + 77] = bad;
    std::uint8_t el[3 * kFp8Block128];
    float scales[3];
    fp8_block128_encode_row(row.data(), 3 * kFp8Block128, el, scales);
    EXPECT_EQ(scales[0], 1.5f / 448.0f);
    EXPECT_TRUE(std::isnan(scales[1]));
    EXPECT_EQ(scales[2], 1.5f / 448.0f);
    std::vector<float> y(row.size());
    fp8_block128_decode_row(el, scales, 3 * kFp8Block128, y.data());
    for (int i = 0; i < 3 * kFp8Block128; ++i) {
      if (i / kFp8Block128 == 1) {
        EXPECT_EQ(el[i], 0x7f);
        EXPECT_EQ(to_bits(y[static_cast<std::size_t>(i)]), kF32QuietNan) << "i " << i;
      } else {
        EXPECT_EQ(el[i], 0x7e);
        EXPECT_FLOAT_EQ(y[static_cast<std::size_t>(i)], 1.5f) << "i " << i;
      }
    }
  }
}

TEST(FormatsFp8Block128, RoundTripErrorIsWithinHalfAnE4m3Step) {
  std::mt19937 rng(13);
  for (int trial = 0; trial < 2000; ++trial) {
    const float center = std::uniform_real_distribution<float>(-100.0f, 100.0f)(rng);
    std::vector<float> x = random_block(rng, kFp8Block128, center - 20, center);
    std::vector<float> y(x.size());
    fp8_block128_quantize_dequantize_row(x.data(), kFp8Block128, y.data());
    const double s = fp8_block128_scale(bits_float(abs_max_bits(x.data(), kFp8Block128)));
    for (std::size_t i = 0; i < x.size(); ++i) {
      // Normal E4M3: half a step is 2^-4 relative; subnormal: 2^-10 * scale; plus the fp32
      // roundings of x / scale and of the decode product.
      const double bound = (std::fabs(x[i]) * 0x1p-4 + 0x1p-10 * s) * (1 + 1e-6);
      ASSERT_LE(std::fabs(static_cast<double>(y[i]) - x[i]), bound) << "x " << x[i];
    }
  }
}

// gpt-oss H = 2880 is not a multiple of 128: the last tile column and run are 64 wide; 200 rows
// leave a last tile row of 72. Every scale is the amax of exactly its region / 448.
TEST(FormatsFp8Block128, PartialTilesAndRunsCoverWhatIsThere) {
  const std::int64_t rows = 200, cols = 2880, sc = 23;
  std::mt19937 rng(14);
  std::vector<float> x = random_block(rng, static_cast<int>(rows * cols), -12, 4);
  x[199 * cols + 2879] = 1000.0f;  // only the last, partial tile sees it
  std::vector<std::uint8_t> el(x.size());
  std::vector<float> tiles(2 * sc), runs(rows * sc);
  epmoe::quantize_fp8_block128(x.data(), rows, cols, epmoe::Fp8Blocks::tile_128x128, el.data(),
                               tiles.data());
  for (std::int64_t i = 0; i < 2; ++i) {
    for (std::int64_t j = 0; j < sc; ++j) {
      const int n_rows = i == 1 ? 72 : 128, n_cols = j == sc - 1 ? 64 : 128;
      const float* at = x.data() + i * 128 * cols + j * 128;
      const float want = fp8_expected_scale(at, n_rows, n_cols, cols);
      ASSERT_EQ(to_bits(tiles[static_cast<std::size_t>(i * sc + j)]), to_bits(want))
          << "tile " << i << ", " << j;
      for (int r = 0; r < n_rows; ++r)
        for (int c = 0; c < n_cols; ++c) {
          const std::size_t k = static_cast<std::size_t>((i * 128 + r) * cols + j * 128 + c);
          ASSERT_EQ(el[k], fp8_expected_element(x[k], want)) << "x " << x[k];
        }
    }
  }
  EXPECT_EQ(tiles[2 * sc - 1], 1000.0f / 448.0f);
  std::vector<float> y(x.size()), z(cols);
  epmoe::dequantize_fp8_block128(el.data(), tiles.data(), rows, cols,
                                 epmoe::Fp8Blocks::tile_128x128, y.data());
  EXPECT_EQ(y[199 * cols + 2879], fp8_block128_decode_value(0x7e, 1000.0f / 448.0f));
  for (std::int64_t r : {0, 127, 128, 199}) {
    fp8_block128_decode_row(el.data() + r * cols, tiles.data() + r / 128 * sc, cols, z.data());
    for (std::int64_t c = 0; c < cols; ++c) ASSERT_EQ(y[r * cols + c], z[c]);
  }
  // Activations: one scale per 1 x 128 run, the last run of each row 64 long.
  epmoe::quantize_fp8_block128(x.data(), rows, cols, epmoe::Fp8Blocks::row_1x128, el.data(),
                               runs.data());
  std::vector<std::uint8_t> el_row(cols);
  std::vector<float> sc_row(sc);
  for (std::int64_t r = 0; r < rows; ++r) {
    fp8_block128_encode_row(x.data() + r * cols, cols, el_row.data(), sc_row.data());
    EXPECT_EQ(to_bits(sc_row[sc - 1]),
              to_bits(fp8_expected_scale(x.data() + r * cols + 2816, 1, 64, 64)));
    for (std::int64_t j = 0; j < sc; ++j) ASSERT_EQ(runs[r * sc + j], sc_row[j]);
    for (std::int64_t c = 0; c < cols; ++c) ASSERT_EQ(el[r * cols + c], el_row[c]);
  }
  epmoe::dequantize_fp8_block128(el.data(), runs.data(), rows, cols, epmoe::Fp8Blocks::row_1x128,
                                 y.data());
  fp8_block128_quantize_dequantize_row(x.data() + 5 * cols, cols, z.data());
  for (std::int64_t c = 0; c < cols; ++c) ASSERT_EQ(y[5 * cols + c], z[c]);
}

TEST(FormatsFp8Block128, WorkedExample) {
  float x[kFp8Block128] = {10.0f, 1.0f, -2.5f, 0.05f, 0.001f, -0.0001f, -0.0f, 7.0f};
  std::uint8_t el[kFp8Block128];
  float scale;
  fp8_block128_encode_block(x, kFp8Block128, el, &scale);
  EXPECT_EQ(to_bits(scale), 0x3cb6db6eu);  // 10 / 448 = 0.0223214291...
  // x / scale: 448, 44.8, -112, 2.24, 0.0448, -0.00448, -0, 313.6.
  const std::uint8_t want[8] = {0x7e, 0x63, 0xee, 0x41, 0x13, 0x82, 0x80, 0x7a};
  const float decoded[8] = {10.0f,          0.98214287f,     -2.5f, 0.050223216f,
                            0.00095912389f, -8.7193082e-05f, -0.0f, 7.1428576f};
  float y[8];
  fp8_block128_decode_block(el, scale, 8, y);
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(el[i], want[i]) << "i " << i;
    EXPECT_FLOAT_EQ(y[i], decoded[i]) << "i " << i;
  }
  for (int i = 8; i < kFp8Block128; ++i) EXPECT_EQ(el[i], 0);
}

// Every input class of support/nvfp4_inputs.hpp (zeros with -0, ties, fp32 subnormals, FLT_MAX,
// rows of every magnitude), both block shapes, against cuda_fp8.h. tests/gpu/ runs it on the
// device.
TEST(FormatsFp8Block128, EncodeMatchesCudaConversionsOnEveryInputClass) {
  std::int64_t rows = 0;
  const std::vector<float> x = test::nvfp4_input_matrix(&rows);
  const std::int64_t cols = test::kNvfp4InputCols;
  std::vector<std::uint8_t> el(x.size());
  std::vector<float> scales(static_cast<std::size_t>(rows));
  epmoe::quantize_fp8_block128(x.data(), rows, cols, epmoe::Fp8Blocks::row_1x128, el.data(),
                               scales.data());
  int zero_scales = 0, negative_zeros = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    const float want = fp8_expected_scale(x.data() + r * cols, 1, static_cast<int>(cols), cols);
    ASSERT_EQ(to_bits(scales[static_cast<std::size_t>(r)]), to_bits(want)) << "row " << r;
    zero_scales += want == 0.0f;
    for (std::int64_t c = 0; c < cols; ++c) {
      const std::size_t k = static_cast<std::size_t>(r * cols + c);
      ASSERT_EQ(el[k], fp8_expected_element(x[k], want)) << "x " << x[k] << " row " << r;
      negative_zeros += el[k] == 0x80;
    }
  }
  EXPECT_GE(zero_scales, 2);
  EXPECT_GT(negative_zeros, 100);
  // The same matrix as 128 x 128 tiles.
  std::vector<float> tiles(static_cast<std::size_t>(fp8_block128_scale_count(rows)));
  epmoe::quantize_fp8_block128(x.data(), rows, cols, epmoe::Fp8Blocks::tile_128x128, el.data(),
                               tiles.data());
  for (std::size_t i = 0; i < tiles.size(); ++i) {
    const int n_rows = static_cast<int>(std::min<std::int64_t>(128, rows - 128 * i));
    const float want = fp8_expected_scale(x.data() + 128 * i * cols, n_rows, 128, cols);
    ASSERT_EQ(to_bits(tiles[i]), to_bits(want));
    for (std::size_t k = 128 * i * cols; k < (128 * i + n_rows) * cols; ++k)
      ASSERT_EQ(el[k], fp8_expected_element(x[k], want)) << "x " << x[k];
  }
}

// ---------------------------------------------------------------------------------------------
// MXFP4 (gpt-oss): E2M1 elements, one E8M0 scale per 32
// ---------------------------------------------------------------------------------------------

TEST(FormatsMxfp4Scale, EdgeCases) {
  const auto rceil = ScaleRounding::rceil, floor = ScaleRounding::ocp_floor;
  EXPECT_EQ(mxfp4_scale_code(6.0f, rceil), 127);
  EXPECT_EQ(mxfp4_scale_code(next_up(6.0f), rceil), 128);
  EXPECT_EQ(mxfp4_scale_code(1.0f, rceil), 125);  // ceil(log2(1 / 6)) = -2
  EXPECT_EQ(mxfp4_scale_code(6.0f, floor), 127);  // floor(log2 6) - 2 = 0
  EXPECT_EQ(mxfp4_scale_code(next_down(8.0f), floor), 127);
  EXPECT_EQ(mxfp4_scale_code(8.0f, floor), 128);
  EXPECT_EQ(mxfp4_scale_code(1.0f, floor), 125);
  for (auto r : {rceil, floor}) {
    EXPECT_EQ(mxfp4_scale_code(0.0f, r), 0);
    EXPECT_EQ(mxfp4_scale_code(from_bits(0x007fffffu), r), 0);  // fp32 subnormal
    EXPECT_EQ(mxfp4_scale_code(FLT_MIN, r), 0);                 // e = -128, clamped
    EXPECT_EQ(mxfp4_scale_code(std::ldexp(1.0f, -124), r), 1);
    EXPECT_EQ(mxfp4_scale_code(kNan, r), 0xff);
    EXPECT_EQ(mxfp4_scale_code(kInf, r), 0xff);
  }
  EXPECT_EQ(mxfp4_scale_code(FLT_MAX, rceil), 253);  // 2^126: FLT_MAX / 2^126 < 4
  EXPECT_EQ(mxfp4_scale_code(FLT_MAX, floor), 252);
}

TEST(FormatsMxfp4Scale, RceilMatchesCudaE8m0RoundUpOfAmaxOver6) {
  sweep_float_bits(997, [](float amax) {
    if (!std::isfinite(amax) || amax <= 0.0f || amax / 6.0f < FLT_MIN) return true;
    const int got = mxfp4_scale_code(amax, ScaleRounding::rceil), want = cuda_e8m0_up(amax / 6.0f);
    EXPECT_EQ(got, want) << "amax " << amax;
    // And it is the smallest power of two that avoids saturation.
    EXPECT_LE(static_cast<double>(amax), 6.0 * std::ldexp(1.0, got - 127)) << "amax " << amax;
    EXPECT_GT(static_cast<double>(amax), 6.0 * std::ldexp(1.0, got - 128)) << "amax " << amax;
    return got == want;
  });
}

TEST(FormatsMxfp4Scale, OcpFloorMatchesCudaE8m0RoundDownOfAmaxMinus2) {
  sweep_float_bits(997, [](float amax) {
    if (!std::isfinite(amax) || amax < 0.0f) return true;
    const int got = mxfp4_scale_code(amax, ScaleRounding::ocp_floor);
    const int want = std::max(0, static_cast<int>(cuda_e8m0_down(amax)) - 2);
    EXPECT_EQ(got, want) << "amax " << amax;
    return got == want;
  });
}

// Elements against cuda_fp4.h of x * 2^-e (exact in double), scales against cuda_fp8.h's E8M0.
TEST(FormatsMxfp4Block, EncodeMatchesCudaConversions) {
  std::mt19937 rng(15);
  for (ScaleRounding r : {ScaleRounding::rceil, ScaleRounding::ocp_floor}) {
    for (int trial = 0; trial < 4000; ++trial) {
      const float center = std::uniform_real_distribution<float>(-110.0f, 110.0f)(rng);
      std::vector<float> x = random_block(rng, kMxfp8Block, center - 6, center + 2);
      std::uint8_t packed[16], scale;
      mxfp4_encode_block(x.data(), kMxfp8Block, r, packed, &scale);
      float amax = 0;
      for (float v : x) amax = std::max(amax, std::fabs(v));
      const int want_scale = r == ScaleRounding::rceil
                                 ? cuda_e8m0_up(amax / 6.0f)
                                 : std::max(0, static_cast<int>(cuda_e8m0_down(amax)) - 2);
      ASSERT_EQ(scale, want_scale) << "amax " << amax;
      for (int i = 0; i < kMxfp8Block; ++i) {
        const double scaled =
            std::ldexp(static_cast<double>(x[static_cast<std::size_t>(i)]), 127 - want_scale);
        ASSERT_EQ((packed[i / 2] >> (4 * (i % 2))) & 0xf,
                  __nv_cvt_double_to_fp4(scaled, __NV_E2M1, cudaRoundNearest))
            << "x " << x[static_cast<std::size_t>(i)];
      }
    }
  }
}

// With amax 6 the rceil scale is 1, so the elements are e2m1(x): every tie, saturation past the
// block's own values cannot happen, negatives that round to zero are -0 (0x8), as CUDA gives.
TEST(FormatsMxfp4Block, TiesAndNegativeZerosAreCudasWithScaleOne) {
  const float x[kMxfp8Block] = {6.0f, 0.25f,   0.75f, 1.25f,  1.75f, 2.5f,
                                3.5f, 5.0f,    -5.0f, -0.25f, -0.1f, -0.0f,
                                0.0f, -1e-30f, 5.5f,  -2.75f, 0.5f,  from_bits(0x80000001u)};
  std::uint8_t packed[16], scale;
  mxfp4_encode_block(x, kMxfp8Block, ScaleRounding::rceil, packed, &scale);
  EXPECT_EQ(scale, 127);
  const int want[18] = {0x7, 0x0, 0x2, 0x2, 0x4, 0x4, 0x6, 0x6, 0xe,
                        0x8, 0x8, 0x8, 0x0, 0x8, 0x7, 0xd, 0x1, 0x8};
  for (int i = 0; i < kMxfp8Block; ++i) {
    const int code = (packed[i / 2] >> (4 * (i % 2))) & 0xf;
    EXPECT_EQ(code, cuda_e2m1(x[i])) << "x " << x[i];
    if (i < 18) {
      EXPECT_EQ(code, want[i]) << "x " << x[i];
    }
  }
  float y[kMxfp8Block];
  mxfp4_decode_block(packed, scale, kMxfp8Block, y);
  EXPECT_TRUE(std::signbit(y[9]) && std::signbit(y[11]) && y[9] == 0.0f);
  EXPECT_FALSE(std::signbit(y[12]));
}

TEST(FormatsMxfp4Block, OcpFloorSaturatesWhereRceilDoesNot) {
  std::vector<float> x(kMxfp8Block, 1.0f);
  x[0] = 7.0f;
  std::uint8_t packed[16], scale;
  float y[kMxfp8Block];
  mxfp4_encode_block(x.data(), kMxfp8Block, ScaleRounding::ocp_floor, packed, &scale);
  EXPECT_EQ(scale, 127);       // 2^(floor(log2 7) - 2) = 2^0
  EXPECT_EQ(packed[0], 0x27);  // 7 saturates to 6 (0x7); 1.0 is 0x2
  mxfp4_decode_block(packed, scale, kMxfp8Block, y);
  EXPECT_EQ(y[0], 6.0f);
  mxfp4_encode_block(x.data(), kMxfp8Block, ScaleRounding::rceil, packed, &scale);
  EXPECT_EQ(scale, 128);       // 2^ceil(log2(7 / 6)) = 2^1
  EXPECT_EQ(packed[0], 0x16);  // 3.5 -> 4 (0x6, tie to even); 0.5 is 0x1
  mxfp4_decode_block(packed, scale, kMxfp8Block, y);
  EXPECT_EQ(y[0], 8.0f);
  EXPECT_EQ(y[1], 1.0f);
}

TEST(FormatsMxfp4Block, AllZeroAndFp32DenormalBlocksUseTheSmallestScale) {
  float zeros[kMxfp8Block] = {};
  zeros[3] = -0.0f;
  std::uint8_t packed[16], scale = 99;
  mxfp4_encode_block(zeros, kMxfp8Block, ScaleRounding::rceil, packed, &scale);
  EXPECT_EQ(scale, 0);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(packed[i], i == 1 ? 0x80 : 0x00) << "byte " << i;
  float x[kMxfp8Block];
  for (int i = 0; i < kMxfp8Block; ++i)
    x[i] = from_bits(static_cast<std::uint32_t>(i) << 18) * (i % 2 ? -1.0f : 1.0f);
  for (ScaleRounding r : {ScaleRounding::rceil, ScaleRounding::ocp_floor}) {
    mxfp4_encode_block(x, kMxfp8Block, r, packed, &scale);
    EXPECT_EQ(scale, 0);
    float y[kMxfp8Block];
    mxfp4_decode_block(packed, scale, kMxfp8Block, y);
    for (int i = 0; i < kMxfp8Block; ++i) {
      // x * 2^127 = ±i * 2^-4: under 2, so E2M1 keeps it to half a step (0.25) of 2^-127.
      EXPECT_EQ((packed[i / 2] >> (4 * (i % 2))) & 0xf, cuda_e2m1(std::ldexp(x[i], 127)))
          << "i " << i;
      EXPECT_LE(std::fabs(static_cast<double>(y[i]) - x[i]), std::ldexp(0.25, -127)) << "i " << i;
    }
  }
}

TEST(FormatsMxfp4Block, NanOrInfAnywhereMakesOnlyThatBlockNan) {
  for (float bad : {kNan, kInf, -kInf}) {
    std::vector<float> row(3 * kMxfp8Block, 1.5f);
    row[kMxfp8Block + 31] = bad;
    std::uint8_t packed[48], scales[3];
    mxfp4_encode_row(row.data(), 3 * kMxfp8Block, ScaleRounding::rceil, packed, scales);
    EXPECT_EQ(scales[0], 125);  // ceil(log2(1.5 / 6)) = -2; 1.5 * 2^2 = 6, no saturation
    EXPECT_EQ(scales[1], 0xff);
    for (int i = 16; i < 32; ++i) EXPECT_EQ(packed[i], 0) << "byte " << i;
    float y[3 * kMxfp8Block];
    mxfp4_decode_row(packed, scales, 3 * kMxfp8Block, y);
    for (int i = 0; i < 3 * kMxfp8Block; ++i) {
      if (i / kMxfp8Block == 1)
        EXPECT_EQ(to_bits(y[i]), kF32QuietNan) << "i " << i;
      else
        EXPECT_EQ(y[i], 1.5f) << "i " << i;
    }
  }
}

// The decoder as gpt-oss's loaders read *_blocks / *_scales: a 16-entry table of E2M1 values,
// element 2i from the low nibble, element 2i+1 from the high one, times 2^(scale - 127).
TEST(FormatsMxfp4Block, DecodesLikeAGptOssTableLookup) {
  const float lut[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                         -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  std::mt19937 rng(16);
  std::uniform_int_distribution<int> byte(0, 255);
  std::vector<std::uint8_t> packed(4 * 64), scales(4 * 4);
  for (auto& b : packed) b = static_cast<std::uint8_t>(byte(rng));
  for (auto& s : scales) s = static_cast<std::uint8_t>(byte(rng) % 255);  // 0xFF is NaN
  std::vector<float> y(4 * 128);
  epmoe::dequantize_mxfp4(packed.data(), scales.data(), 4, 128, y.data());
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < 128; ++c) {
      const std::uint8_t b = packed[static_cast<std::size_t>(r * 64 + c / 2)];
      const float want = std::ldexp(lut[c % 2 ? b >> 4 : b & 0xf],
                                    scales[static_cast<std::size_t>(r * 4 + c / 32)] - 127);
      ASSERT_EQ(to_bits(y[static_cast<std::size_t>(r * 128 + c)]), to_bits(want))
          << "row " << r << " col " << c;
    }
}

TEST(FormatsMxfp4Block, RoundTripErrorIsWithinHalfAnE2m1Step) {
  std::mt19937 rng(17);
  for (int trial = 0; trial < 2000; ++trial) {
    const float center = std::uniform_real_distribution<float>(-100.0f, 100.0f)(rng);
    std::vector<float> x = random_block(rng, 4 * kMxfp8Block, center - 8, center);
    std::vector<std::uint8_t> packed(64), scales(4);
    std::vector<float> y(x.size()), z(x.size());
    mxfp4_encode_row(x.data(), 4 * kMxfp8Block, ScaleRounding::rceil, packed.data(), scales.data());
    mxfp4_decode_row(packed.data(), scales.data(), 4 * kMxfp8Block, y.data());
    mxfp4_quantize_dequantize_row(x.data(), 4 * kMxfp8Block, ScaleRounding::rceil, z.data());
    ASSERT_EQ(y, z);
    for (std::size_t i = 0; i < x.size(); ++i) {
      const double unit = e8m0_to_float(scales[i / 32]);
      const double q = std::fabs(x[i]) / unit;  // never above 6 under rceil
      ASSERT_LE(q, 6.0);
      ASSERT_LE(std::fabs(static_cast<double>(y[i]) - x[i]), std::max(0.25, q / 4) * unit)
          << "x " << x[i];
    }
  }
}

TEST(FormatsMxfp4Block, WorkedExample) {
  const float x[kMxfp8Block] = {5.0f, -0.3f, 1.2f, 0.1f, -2.6f, 0.9f, 3.1f, -0.0f};
  std::uint8_t packed[16], scale;
  mxfp4_encode_block(x, kMxfp8Block, ScaleRounding::rceil, packed, &scale);
  EXPECT_EQ(scale, 127);       // amax 5: ceil(log2(5 / 6)) = 0
  EXPECT_EQ(packed[0], 0x96);  // 5 -> 4 (0x6, tie to even) low; -0.3 -> -0.5 (0x9) high
  EXPECT_EQ(packed[1], 0x02);  // 1.2 -> 1 (0x2); 0.1 -> 0
  EXPECT_EQ(packed[2], 0x2d);  // -2.6 -> -3 (0xd); 0.9 -> 1 (0x2)
  EXPECT_EQ(packed[3], 0x85);  // 3.1 -> 3 (0x5); -0 (0x8)
  mxfp4_encode_block(x, kMxfp8Block, ScaleRounding::ocp_floor, packed, &scale);
  EXPECT_EQ(scale, 127);  // floor(log2 5) - 2 = 0: the same here
  float y[8];
  mxfp4_decode_block(packed, scale, 8, y);
  const float want[8] = {4.0f, -0.5f, 1.0f, 0.0f, -3.0f, 1.0f, 3.0f, -0.0f};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(y[i], want[i]) << "i " << i;
}

// support/nvfp4_inputs.hpp's matrix (every magnitude, ties, subnormals, signed zeros) through the
// host API, both roundings, against cuda_fp8.h's E8M0 and cuda_fp4.h. tests/gpu/ on the device.
TEST(FormatsMxfp4Block, EncodeMatchesCudaConversionsOnEveryInputClass) {
  std::int64_t rows = 0;
  const std::vector<float> x = test::nvfp4_input_matrix(&rows);
  const std::int64_t cols = test::kNvfp4InputCols;
  for (ScaleRounding r : {ScaleRounding::rceil, ScaleRounding::ocp_floor}) {
    std::vector<std::uint8_t> packed(x.size() / 2), scales(x.size() / 32);
    epmoe::quantize_mxfp4(x.data(), rows, cols, packed.data(), scales.data(), r);
    int negative_zeros = 0;
    for (std::size_t b = 0; b < scales.size(); ++b) {
      float amax = 0;
      for (std::size_t i = 32 * b; i < 32 * b + 32; ++i) amax = std::max(amax, std::fabs(x[i]));
      const int floor_code = std::max(0, static_cast<int>(cuda_e8m0_down(amax)) - 2);
      if (r == ScaleRounding::ocp_floor) {
        ASSERT_EQ(scales[b], floor_code) << "amax " << amax;
      } else if (amax / 6.0f >= FLT_MIN) {
        ASSERT_EQ(scales[b], cuda_e8m0_up(amax / 6.0f)) << "amax " << amax;
      }
      for (std::size_t i = 32 * b; i < 32 * b + 32; ++i) {
        const int code = (packed[i / 2] >> (4 * (i % 2))) & 0xf;
        const double scaled = std::ldexp(static_cast<double>(x[i]), 127 - scales[b]);
        ASSERT_EQ(code, __nv_cvt_double_to_fp4(scaled, __NV_E2M1, cudaRoundNearest))
            << "x " << x[i];
        negative_zeros += code == 0x8;
      }
    }
    EXPECT_GT(negative_zeros, 100);
  }
}

TEST(FormatsApi, QuantizeMxfp4MatchesTheRowCodecAndRoundTrips) {
  std::mt19937 rng(18);
  const std::int64_t rows = 5, cols = 2880;  // gpt-oss H: 90 blocks of 32
  std::vector<float> x = random_block(rng, static_cast<int>(rows * cols), -10, 6);
  std::vector<std::uint8_t> packed(rows * cols / 2), sc(rows * cols / 32);
  epmoe::quantize_mxfp4(x.data(), rows, cols, packed.data(), sc.data(), ScaleRounding::ocp_floor);
  std::vector<std::uint8_t> p_row(cols / 2), s_row(cols / 32);
  for (std::int64_t r = 0; r < rows; ++r) {
    mxfp4_encode_row(x.data() + r * cols, cols, ScaleRounding::ocp_floor, p_row.data(),
                     s_row.data());
    for (std::int64_t c = 0; c < cols / 2; ++c) ASSERT_EQ(packed[r * cols / 2 + c], p_row[c]);
    for (std::int64_t j = 0; j < cols / 32; ++j) ASSERT_EQ(sc[r * cols / 32 + j], s_row[j]);
  }
  std::vector<float> y(rows * cols), z(rows * cols);
  epmoe::dequantize_mxfp4(packed.data(), sc.data(), rows, cols, y.data());
  for (std::int64_t r = 0; r < rows; ++r)
    mxfp4_quantize_dequantize_row(x.data() + r * cols, cols, ScaleRounding::ocp_floor,
                                  z.data() + r * cols);
  EXPECT_EQ(y, z);
  epmoe::quantize_mxfp4(x.data(), rows, cols, packed.data(), sc.data());  // rceil by default
  mxfp4_encode_row(x.data(), cols, ScaleRounding::rceil, p_row.data(), s_row.data());
  EXPECT_TRUE(std::equal(s_row.begin(), s_row.end(), sc.begin()));
}

TEST(FormatsSizes, Fp8Block128AndMxfp4RowBytes) {
  EXPECT_EQ(fp8_block128_scale_count(7168), 56);
  EXPECT_EQ(fp8_block128_row_bytes(7168), 7168 + 4 * 56);
  EXPECT_EQ(fp8_block128_scale_count(2880), 23);  // the last run is 64 long
  EXPECT_EQ(mxfp4_packed_bytes(2880), 1440);
  EXPECT_EQ(mxfp4_scale_count(2880), 90);
  EXPECT_EQ(mxfp4_row_bytes(2880), 1440 + 90);
  static_assert(fp8_block128_row_bytes(128) == 132 && mxfp4_row_bytes(32) == 17);
}

TEST(FormatsApi, RejectsBadFp8Block128AndMxfp4Arguments) {
  std::vector<float> x(64 * 2), y(64 * 2);
  std::vector<std::uint8_t> a(64 * 2), b(16);
  EXPECT_EQ(invalid_argument_message([&] {
              epmoe::quantize_fp8_block128(x.data(), -1, 64, epmoe::Fp8Blocks::row_1x128, a.data(),
                                           y.data());
            }),
            "quantize_fp8_block128: rows=-1 must be >= 0");
  EXPECT_EQ(invalid_argument_message([&] {
              epmoe::quantize_fp8_block128(x.data(), 1, 64, static_cast<epmoe::Fp8Blocks>(5),
                                           a.data(), y.data());
            }),
            "quantize_fp8_block128: blocks=5 must be tile_128x128 or row_1x128");
  EXPECT_EQ(invalid_argument_message([&] {
              epmoe::dequantize_fp8_block128(a.data(), nullptr, 2, 64,
                                             epmoe::Fp8Blocks::tile_128x128, y.data());
            }),
            "dequantize_fp8_block128: scales=null must be non-null when rows * cols (2 * 64) > 0");
  EXPECT_EQ(
      invalid_argument_message([&] { epmoe::quantize_mxfp4(x.data(), 2, 48, a.data(), b.data()); }),
      "quantize_mxfp4: cols=48 must be a multiple of 32");
  EXPECT_EQ(invalid_argument_message([&] {
              epmoe::quantize_mxfp4(x.data(), 1, 32, a.data(), b.data(),
                                    static_cast<ScaleRounding>(9));
            }),
            "quantize_mxfp4: rounding=9 must be rceil or ocp_floor");
  EXPECT_EQ(invalid_argument_message(
                [&] { epmoe::dequantize_mxfp4(nullptr, b.data(), 1, 32, y.data()); }),
            "dequantize_mxfp4: packed=null must be non-null when rows * cols (1 * 32) > 0");
  // Any cols for fp8_block128 (a partial last block); empty matrices accept null pointers.
  EXPECT_NO_THROW(epmoe::quantize_fp8_block128(x.data(), 1, 3, epmoe::Fp8Blocks::tile_128x128,
                                               a.data(), y.data()));
  EXPECT_NO_THROW(epmoe::quantize_mxfp4(nullptr, 0, 32, nullptr, nullptr));
  EXPECT_NO_THROW(
      epmoe::dequantize_fp8_block128(nullptr, nullptr, 0, 0, epmoe::Fp8Blocks::row_1x128, nullptr));
}

}  // namespace
}  // namespace epmoe::formats

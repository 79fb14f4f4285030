// Eight E2M1 codes to bf16 with integer byte permutes, then one bf16x2 multiply per pair by the
// block scale: the FP4 decode of the packed-weight GEMM (wgmma/packed_gemm.cu) and of the
// tensor-core tiles (mma/bf16_mma_tile.cuh, unscaled in their narrow form). The fp32 route
// (packed_weights.cuh decode8: a shift and two multiplies per weight, then a pack) cost about
// five instructions per weight; this one about three.
//
// Every E2M1 magnitude (0, 0.5, 1, 1.5, 2, 3, 4, 6) is a bf16 value, so its two bytes come from two
// 8-entry byte tables, looked up four codes at a time by PRMT (__byte_perm: each selector nibble
// picks one of eight bytes; the codes' magnitudes are the selectors). The sign bit of each code
// goes to bit 15 of its half. The scale multiply is exact whenever the product is a normal bf16: an
// E2M1 value has 2 significant bits, an E4M3 scale 4, an E8M0 scale 1, and bf16 holds 8. Products
// below 2^-126 (MX scales under about 2^-124) round once here where the fp32 decode rounds to
// fp32 first; tests/e2m1_bf16_test.cpp checks every code against decode8's values for every scale
// code and names the range where they may differ.
// Host and device compute the same bits: on the host __byte_perm and the bf16 multiply are
// emulated (for the CPU test).
#pragma once

#include <cstdint>

#include "formats/codec.hpp"

#ifdef __CUDACC__
#include <cuda_bf16.h>
#endif

namespace epmoe::cuda::experts {

// CUDA's __byte_perm(x, y, s): byte i of the result is byte (s >> 4i) & 7 of the 8 bytes y:x
// (x's bytes 0-3, y's 4-7); the selector's bit 3 (sign replication) is never set here.
EPMOE_HD std::uint32_t byte_perm(std::uint32_t x, std::uint32_t y, std::uint32_t s) {
#ifdef __CUDA_ARCH__
  return __byte_perm(x, y, s);
#else
  const std::uint64_t bytes = (std::uint64_t{y} << 32) | x;
  std::uint32_t out = 0;
  for (int i = 0; i < 4; ++i)
    out |= static_cast<std::uint32_t>((bytes >> (8 * ((s >> (4 * i)) & 7u))) & 0xFFu) << (8 * i);
  return out;
#endif
}

// Two bf16 (low half, high half) times the bf16 `scale` in both halves, rounded to nearest even
// (the hardware's mul.rn.bf16x2, subnormals kept; on the host: the exact fp32 product of two bf16,
// rounded once to bf16).
EPMOE_HD std::uint32_t bf16x2_mul(std::uint32_t v, std::uint32_t scale2) {
#ifdef __CUDA_ARCH__
  const __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&v),
                                   *reinterpret_cast<const __nv_bfloat162*>(&scale2));
  return *reinterpret_cast<const std::uint32_t*>(&r);
#else
  const float s = formats::bf16_to_float(static_cast<std::uint16_t>(scale2));
  const float lo = formats::bf16_to_float(static_cast<std::uint16_t>(v)) * s;  // exact: 16 bits
  const float hi = formats::bf16_to_float(static_cast<std::uint16_t>(v >> 16)) * s;
  return formats::float_to_bf16(lo) | static_cast<std::uint32_t>(formats::float_to_bf16(hi)) << 16;
#endif
}

// The bf16 bits of E2M1 magnitude m: high byte {00 3F 3F 3F 40 40 40 40}[m], low byte
// {00 00 80 C0 00 40 80 C0}[m], as the two 4-byte halves each PRMT table reads.
inline constexpr std::uint32_t kE2m1HighBytes0 = 0x3F3F3F00u, kE2m1HighBytes1 = 0x40404040u;
inline constexpr std::uint32_t kE2m1LowBytes0 = 0xC0800000u, kE2m1LowBytes1 = 0xC0804000u;

// Codes 0-7 of `codes` (element i in nibble i, sign in its bit 3) times `scale2` (the block scale
// as bf16 in both halves; kScaled = false: not multiplied, the codes' own values): out[j] holds
// elements 2j (low half) and 2j + 1.
template <bool kScaled = true>
EPMOE_HD void e2m1x8_to_bf16(std::uint32_t codes, std::uint32_t scale2, std::uint32_t (&out)[4]) {
  const std::uint32_t magnitudes = codes & 0x77777777u;
  // Each code's sign at bit 7 of a byte: elements 2j at byte j of `even_signs`, 2j + 1 of
  // `odd_signs`.
  const std::uint32_t even_signs = (codes << 4) & 0x80808080u;
  const std::uint32_t odd_signs = codes & 0x80808080u;
  for (int half = 0; half < 2; ++half) {  // elements 4 half .. 4 half + 3
    const std::uint32_t select = magnitudes >> (16 * half);
    const std::uint32_t low = byte_perm(kE2m1LowBytes0, kE2m1LowBytes1, select);
    const std::uint32_t high = byte_perm(kE2m1HighBytes0, kE2m1HighBytes1, select);
    for (int pair = 0; pair < 2; ++pair) {  // elements 4 half + 2 pair, + 1
      const int j = 2 * half + pair;
      // bytes: low(e), high(e), low(e + 1), high(e + 1) of this half's elements 2 pair, 2 pair + 1
      const std::uint32_t magnitude = byte_perm(low, high, pair == 0 ? 0x5140u : 0x7362u);
      // sign bytes to bytes 1 and 3 (bits 15 and 31)
      const std::uint32_t signs =
          byte_perm(even_signs, odd_signs, static_cast<std::uint32_t>((4 + j) << 12 | j << 4));
      const std::uint32_t value = magnitude | (signs & 0x80008000u);
      out[j] = kScaled ? bf16x2_mul(value, scale2) : value;
    }
  }
}

// The E4M3 code of E2M1 magnitude m: {00 30 38 3C 40 44 48 4C}[m] (0, 0.5, 1, 1.5, 2, 3, 4, 6 are
// all E4M3 values), as the two 4-byte halves a PRMT table reads.
inline constexpr std::uint32_t kE2m1E4m3Bytes0 = 0x3C383000u, kE2m1E4m3Bytes1 = 0x4C484440u;

// Codes 0-7 of `codes` (element i in nibble i, sign in its bit 3) as the E4M3 codes of the same
// values, exactly (a sign and 3 bits each): element i in byte i % 4 of out[i / 4]. The packed
// GEMM's E4M3 tile takes MXFP4 weights this way (the E8M0 block scale is MXFP8's).
EPMOE_HD void e2m1x8_to_e4m3(std::uint32_t codes, std::uint32_t (&out)[2]) {
  const std::uint32_t magnitudes = codes & 0x77777777u;
  // Each code's sign at bit 7 of a byte: elements 2j at byte j of `even_signs`, 2j + 1 of
  // `odd_signs`.
  const std::uint32_t even_signs = (codes << 4) & 0x80808080u;
  const std::uint32_t odd_signs = codes & 0x80808080u;
  for (int half = 0; half < 2; ++half) {  // elements 4 half .. 4 half + 3
    const std::uint32_t values =
        byte_perm(kE2m1E4m3Bytes0, kE2m1E4m3Bytes1, magnitudes >> (16 * half));
    // the signs of elements 4 half + 0, 1, 2, 3: even byte 2 half, odd 2 half, even, odd 2 half + 1
    const std::uint32_t signs = byte_perm(even_signs, odd_signs, half == 0 ? 0x5140u : 0x7362u);
    out[half] = values | signs;
  }
}

// A block scale as bf16 in both halves: 2^(s - 127) for MX's E8M0 code s (2^-127 is a bf16
// subnormal; 0xFF is NaN), the E4M3 value for NVFP4 (4 significant bits). Every block scale is a
// bf16 value, so its fp32 bits' high half is its bf16 (a NaN's too: the codecs' and the hardware's
// NaNs keep their top mantissa bit): one byte permute, where rounding cost the packed GEMM's NVFP4
// decode ~6 instructions per scale and 8 scales per k tile.
EPMOE_HD std::uint32_t bf16x2_scale(float scale) {
  return byte_perm(formats::float_bits(scale), 0u, 0x3232u);
}

}  // namespace epmoe::cuda::experts

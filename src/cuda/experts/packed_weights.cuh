// Packed weights (packed_weights.hpp) decoded inside a GEMM kernel, eight at a time, from the
// 16-byte loads the kernel made, into fp32 with the block scale. Every step is exact, so a weight
// is the value the reference decodes (GpuCodec.PackedWeightDecodeInTheGemmsMatchesTheHostCodec...
// checks every code with every scale).
#pragma once

#include <cuda_bf16.h>  // e4m3x2_scaled_to_bf16x2
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/experts/packed_weights.hpp"
#include "cuda/repeated_divisor.hpp"
#include "formats/codec.hpp"
#include "math/expert_row.hpp"  // math::unscaled

namespace epmoe::cuda::experts {

// Bits per code and weights per block scale (0: none) of each packed precision.
template <Precision P>
struct PackedFormat;
template <>
struct PackedFormat<Precision::bf16> {
  static constexpr int kBits = 16, kBlock = 0;
};
template <>
struct PackedFormat<Precision::mxfp8> {
  static constexpr int kBits = 8, kBlock = formats::kMxfp8Block;
};
template <>
struct PackedFormat<Precision::mxfp4> {
  static constexpr int kBits = 4, kBlock = formats::kMxfp8Block;
};
template <>
struct PackedFormat<Precision::nvfp4> {
  static constexpr int kBits = 4, kBlock = formats::kNvfp4Block;
};
// Weights in one 16-byte load.
template <Precision P>
inline constexpr int kWeightsPer16B = 128 / PackedFormat<P>::kBits;

// Calls f(std::integral_constant<Precision, P>) with the layer's packed precision.
template <class F>
decltype(auto) with_packed_precision(Precision p, F f) {
  switch (p) {
    case Precision::mxfp8:
      return f(std::integral_constant<Precision, Precision::mxfp8>{});
    case Precision::mxfp4:
      return f(std::integral_constant<Precision, Precision::mxfp4>{});
    case Precision::nvfp4:
      return f(std::integral_constant<Precision, Precision::nvfp4>{});
    default:
      return f(std::integral_constant<Precision, Precision::bf16>{});
  }
}

// One weight row: its codes and its block scales.
struct WeightRow {
  const std::uint8_t* codes;
  const std::uint8_t* scales;
};
template <Precision P>
__device__ inline WeightRow weight_row(const PackedMatrices& m, std::int64_t expert,
                                       std::int64_t row) {
  const std::int64_t r = expert * m.rows + row;
  const std::uint8_t* codes = m.codes + r * (m.cols * PackedFormat<P>::kBits / 8);
  if constexpr (PackedFormat<P>::kBlock == 0)
    return WeightRow{codes, nullptr};
  else
    return WeightRow{codes, m.scales + r * (m.cols / PackedFormat<P>::kBlock)};
}

// The block scale codes at `at` (a weight row's scales, at the block of the 16-byte load they
// scale): one byte, or two for NVFP4 (low byte first); 0 for bf16.
template <Precision P>
__device__ inline std::uint32_t load_scale_codes(const std::uint8_t* at) {
  if constexpr (P == Precision::nvfp4)
    return __ldg(reinterpret_cast<const std::uint16_t*>(at));
  else if constexpr (PackedFormat<P>::kBlock != 0)
    return __ldg(at);
  else
    return 0;
}

// The block scale of group g (8 weights) of a 16-byte load of a weight row, as a float, from the
// load's block scale codes (`scale_codes`: one byte, or two for NVFP4, low byte first). NVFP4's
// E4M3 scale goes through the hardware's cvt (exact, NaN stays NaN) rather than the codec's
// branchy software decode, which ran once per group of 8 weights (session 16: nvfp4's FC1 at
// T = 1 took 57 us against mxfp4's 46 with the same E2M1 codes; 43 us with the cvt, session 17).
template <Precision P>
__device__ inline float group_scale(std::uint32_t scale_codes, int g) {
  if constexpr (P == Precision::nvfp4)
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(
        static_cast<__nv_fp8_storage_t>(scale_codes >> (8 * (g / 2))), __NV_E4M3)));
  else if constexpr (PackedFormat<P>::kBlock != 0)
    return formats::e8m0_to_float(static_cast<std::uint8_t>(scale_codes));
  else
    return 1.0f;
}

// E2M1 to fp32 with integer operations (sm_90 has no E2M1 conversion): a nibble's 3 magnitude
// bits placed at fp32 bits 22..24 read as its value times 2^-126, normal or subnormal alike, and
// multiplying back is exact. E4M3 goes through the hardware's cvt.f16x2.e4m3x2 instead: the same
// trick for it (bits 20..26, times 2^-120, plus a NaN check) measured slower on one H200 (qwen3
// mxfp8 tensor_core T = 1: 127 against 98 us; bench/RESULTS.md, session 16).
__device__ inline float e2m1_times_2_pow_minus_126(std::uint32_t nibble) {
  return __uint_as_float(((nibble & 0x7u) << 22) | ((nibble & 0x8u) << 28));
}

// Two E4M3 codes (low byte first) as floats, by the hardware's cvt.f16x2.e4m3x2: exact, NaN stays
// NaN (the packed GEMM's decode and its activating epilogue's E4M3 round trip take it too).
__device__ __forceinline__ float2 e4m3x2_to_float2(std::uint16_t codes) {
  return __half22float2(
      __half2(__nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(codes), __NV_E4M3)));
}

// Two E4M3 codes (low byte first) times `scale`, as two bf16 (low half first): exact for an MX
// block's power-of-two scale, since the conversion is exact, the product one fp32 multiply and
// cvt.rn.bf16x2.f32 rounds to nearest even (a NaN: its canonical one, as the codec's float_to_bf16
// of the GPU's NaN product). The packed GEMM's MXFP8 decode and gather's MXFP8 rows take it.
__device__ __forceinline__ std::uint32_t e4m3x2_scaled_to_bf16x2(std::uint16_t codes, float scale) {
  const float2 f = e4m3x2_to_float2(codes);
  const __nv_bfloat162 b = __floats2bfloat162_rn(f.x * scale, f.y * scale);
  return *reinterpret_cast<const std::uint32_t*>(&b);
}

// The 8 weights of group g of a 16-byte load `v`, times `scale` (group_scale).
template <Precision P>
__device__ inline void decode8(const uint4& v, int g, float scale, float (&out)[8]) {
  const std::uint32_t words[4] = {v.x, v.y, v.z, v.w};
  if constexpr (P == Precision::bf16) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // g == 0: one load is 8 weights
      out[2 * j] = __uint_as_float(words[j] << 16);
      out[2 * j + 1] = __uint_as_float(words[j] & 0xFFFF0000u);
    }
  } else if constexpr (P == Precision::mxfp8) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // E4M3 pairs
      const std::uint32_t word = words[2 * g + j / 2];
      const float2 f = e4m3x2_to_float2(static_cast<std::uint16_t>(word >> (16 * (j % 2))));
      out[2 * j] = f.x * scale;
      out[2 * j + 1] = f.y * scale;
    }
  } else {
    const std::uint32_t word = words[g];
#pragma unroll
    for (int j = 0; j < 8; ++j)
      out[j] = e2m1_times_2_pow_minus_126(word >> (4 * j)) * 0x1p126f * scale;
  }
}

// Expert e's packed weights of one FC are its GEMM's operands over `divisor`, times `multiplier`:
// the codes (NVFP4: E2M1 x E4M3) over s_enc, times the decode multiplier (1 and 1 for MX).
struct WeightFactors {
  float divisor = 1.0f, multiplier = 1.0f;
};
__device__ inline WeightFactors weight_factors(const PackedMatrices& m, int e) {
  return WeightFactors{m.divisor[e], m.multiplier[e]};
}
// A GEMM's sum as the value it stands for: over the row's scale and the weights' factors (the
// home kernel's arithmetic and the packed FC2's bf16 rows', so they round the same value; the
// product rounded on its own, never contracted with a bias added after it).
__device__ inline float unscaled(float sum, float row_scale, const WeightFactors& w) {
  const float v = math::unscaled(sum, row_scale, w.divisor);
  return w.multiplier != 1.0f ? __fmul_rn(v, w.multiplier) : v;
}
// unscaled for the many sums of one row and expert (activate's, home's), with no branch and no
// IEEE division per sum: RepeatedDivisor's quotients, unscaled's wherever they are normal (a
// factor of 1 divides exactly; times a multiplier of 1 is the quotient itself).
struct RowUnscale {
  RepeatedDivisor by_row, by_weights;
  float multiplier;
  __device__ RowUnscale(float row_scale, const WeightFactors& w)
      : by_row(row_scale), by_weights(w.divisor), multiplier(w.multiplier) {}
  __device__ __forceinline__ float operator()(float sum) const {
    return __fmul_rn(by_weights.divide(by_row.divide(sum)), multiplier);
  }
};

}  // namespace epmoe::cuda::experts

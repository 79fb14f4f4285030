// MXFP8 / NVFP4 / BF16 codecs (DESIGN §6, docs/formats.md): one header of __host__ __device__ code,
// used by the CUDA kernels, the CPU executor and the reference forward alike.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define EPMOE_HD __host__ __device__ __forceinline__
#else
#define EPMOE_HD inline
#endif

namespace epmoe::formats {

inline constexpr int kMxfp8Block = 32;  // elements per E8M0 scale, along the reduction dim
inline constexpr int kNvfp4Block = 16;  // elements per E4M3 block scale
inline constexpr float kE4m3Max = 448.0f;
inline constexpr float kE2m1Max = 6.0f;

EPMOE_HD std::uint32_t float_bits(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
EPMOE_HD float bits_float(std::uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// ---- BF16: the top 16 bits of an IEEE float; rounding to nearest even, NaN kept quiet. ----
EPMOE_HD float bf16_to_float(std::uint16_t b) { return bits_float(std::uint32_t{b} << 16); }
EPMOE_HD std::uint16_t float_to_bf16(float x) {
  std::uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}
EPMOE_HD float round_to_bf16(float x) { return bf16_to_float(float_to_bf16(x)); }

}  // namespace epmoe::formats

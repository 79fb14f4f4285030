// MXFP8 / NVFP4 / BF16 codecs (docs/design.md §6, docs/formats.md): one header of __host__
// __device__ code, used by the CUDA kernels, the CPU executor and the reference forward alike.
#pragma once

#include <cstdint>
#include <cstring>

#include "epmoe/config.hpp"  // ScaleRounding

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
EPMOE_HD float bf16_to_float(std::uint16_t b) {
  return bits_float(std::uint32_t{b} << 16);
}
EPMOE_HD std::uint16_t float_to_bf16(float x) {
  std::uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}
EPMOE_HD float round_to_bf16(float x) {
  return bf16_to_float(float_to_bf16(x));
}

// Every function below is exact bit manipulation or a single IEEE fp32 operation per step, so the
// host and the device (without --use_fast_math / FTZ) produce identical bytes.

inline constexpr std::uint32_t kF32AbsMask = 0x7fffffffu;
inline constexpr std::uint32_t kF32InfBits = 0x7f800000u;
inline constexpr std::uint32_t kF32QuietNan = 0x7fc00000u;

EPMOE_HD float quiet_nan() {
  return bits_float(kF32QuietNan);
}
EPMOE_HD bool is_finite_bits(std::uint32_t u) {
  return (u & kF32AbsMask) < kF32InfBits;
}

// 2^e as an fp32 for e in [-149, 127] (fp32 subnormals included); exact.
EPMOE_HD float pow2f(int e) {
  if (e >= -126) return bits_float(static_cast<std::uint32_t>(e + 127) << 23);
  return bits_float(std::uint32_t{1} << (e + 149));
}

// ---- FP8 E4M3 (OCP "fn"): s eeee mmm, bias 7, no Inf, S.1111.111 = NaN, max ±448. ----
// Encoding: round to nearest even; finite magnitudes above 448 and ±Inf saturate to ±448
// (cuda_fp8.h __NV_SATFINITE); every NaN encodes as 0x7F. Underflow keeps the sign (-0 = 0x80).
inline constexpr std::uint8_t kE4m3Nan = 0x7f;
inline constexpr std::uint8_t kE4m3MaxCode = 0x7e;  // 448

EPMOE_HD bool e4m3_is_nan(std::uint8_t c) {
  return (c & 0x7f) == 0x7f;
}

EPMOE_HD float e4m3_to_float(std::uint8_t c) {
  const std::uint32_t sign = std::uint32_t{c & 0x80u} << 24;
  const std::uint32_t exp = (c >> 3) & 0xfu;
  const std::uint32_t man = c & 0x7u;
  if (exp == 0xfu && man == 0x7u) return quiet_nan();
  if (exp == 0) {  // subnormal: man * 2^-9, exact in fp32
    return bits_float(float_bits(static_cast<float>(man) * 0.001953125f) | sign);
  }
  return bits_float(sign | ((exp + 120u) << 23) | (man << 20));  // rebias 7 -> 127
}

EPMOE_HD std::uint8_t float_to_e4m3(float x) {
  const std::uint32_t u = float_bits(x);
  const std::uint32_t a = u & kF32AbsMask;
  const std::uint8_t sign = static_cast<std::uint8_t>((u >> 24) & 0x80u);
  if (a > kF32InfBits) return kE4m3Nan;
  if (a > 0x43e00000u) return static_cast<std::uint8_t>(sign | kE4m3MaxCode);  // |x| > 448, Inf
  std::uint32_t code;
  if (a >= 0x3c800000u) {  // |x| >= 2^-6: E4M3 normal; keep 3 of 23 mantissa bits
    code = (((a >> 23) - 120u) << 3) | ((a >> 20) & 0x7u);
    const std::uint32_t rest = a & 0xfffffu;
    if (rest > 0x80000u || (rest == 0x80000u && (code & 1u))) ++code;  // carry may bump exponent
  } else {  // E4M3 subnormal: code = round(|x| / 2^-9)
    const int exp = static_cast<int>(a >> 23) - 127;
    const int shift = 14 - exp;  // |x| * 2^9 = M * 2^-shift with M = 1.m * 2^23
    if (a < 0x00800000u || shift >= 25) {
      code = 0;  // |x| < 2^-10 (half the smallest subnormal): rounds to zero
    } else {
      const std::uint32_t m = (a & 0x7fffffu) | 0x800000u;
      code = m >> shift;
      const std::uint32_t rest = m & ((std::uint32_t{1} << shift) - 1u);
      const std::uint32_t half = std::uint32_t{1} << (shift - 1);
      if (rest > half || (rest == half && (code & 1u))) ++code;  // code 8 = 2^-6, the min normal
    }
  }
  return static_cast<std::uint8_t>(sign | code);
}

EPMOE_HD float round_to_e4m3(float x) {
  return e4m3_to_float(float_to_e4m3(x));
}

// ---- E8M0 (OCP MX scale): unsigned exponent only, 2^(c-127); 0xFF = NaN; code 0 = 2^-127. ----
inline constexpr std::uint8_t kE8m0Nan = 0xff;

EPMOE_HD float e8m0_to_float(std::uint8_t c) {  // selects, not branches: kernels decode with it
  const float value =
      bits_float(c == 0 ? 0x00400000u : std::uint32_t{c} << 23);  // 2^-127: subnormal
  return c == kE8m0Nan ? quiet_nan() : value;
}

// ---- FP4 E2M1: s ee m, bias 1, values ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}; no NaN, no Inf. ----
// Encoding: round to nearest even, saturating at ±6 (±Inf → ±6); NaN → +6 (0x7); underflow keeps
// the sign (-0 = 0x8): bit for bit __nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest).
// Blocks with NaN/Inf never reach this function (see nvfp4_encode_block).
EPMOE_HD float e2m1_to_float(std::uint8_t nibble) {
  const std::uint32_t exp = (nibble >> 1) & 0x3u;
  const std::uint32_t man = nibble & 0x1u;
  const float mag =
      exp == 0 ? 0.5f * static_cast<float>(man) : bits_float(((exp + 126u) << 23) | (man << 22));
  return (nibble & 0x8u) ? -mag : mag;
}

EPMOE_HD std::uint8_t float_to_e2m1(float x) {
  const std::uint32_t u = float_bits(x);
  const std::uint8_t sign = static_cast<std::uint8_t>((u >> 28) & 0x8u);
  const float a = bits_float(u & kF32AbsMask);
  // The code is the number of midpoints between neighbours below a; at a tie the even code (last
  // bit 0) wins. A sum of comparisons, not a chain of branches: a kernel encodes a value per lane
  // and element, and the branches split its per-element code into blocks (nvfp4's activate).
  const int code = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                   (a >= 3.5f) + (a > 5.0f);  // 6 and saturation above 5
  return (u & kF32AbsMask) > kF32InfBits ? std::uint8_t{0x7}
                                         : static_cast<std::uint8_t>(sign | code);
}

EPMOE_HD float round_to_e2m1(float x) {
  return e2m1_to_float(float_to_e2m1(x));
}

// ---- MXFP8 (OCP MX v1.0): 32 E4M3 elements share one E8M0 scale. ----
//
// mxfp8_scale_code: the exponent e of the block scale 2^e, as an E8M0 code (e + 127).
//   rceil:     e = ceil(log2(amax / 448)), the smallest e with amax <= 448 * 2^e: no element
//              saturates. Computed exactly from the bits of amax.
//   ocp_floor: e = floor(log2(amax)) - 8 (8 = exponent of 448); elements up to 2^9 * (1 - 2^-24)
//              may result and those above 448 saturate.
//   e is clamped to [-127, 127]; amax == 0 (or so small that e < -127) gives code 0 (2^-127);
//   NaN or ±Inf amax gives 0xFF (NaN).
// Written as selects, not early returns: a GEMM epilogue evaluates it for many columns at once.
EPMOE_HD std::uint8_t mxfp8_scale_code(float amax, ScaleRounding rounding) {
  const std::uint32_t a = float_bits(amax) & kF32AbsMask;
  const int exp = static_cast<int>(a >> 23) - 127;
  int e = exp - 8;
  // 448 = 1.75 * 2^8: amax / 448 = (1.m / 1.75) * 2^(exp-8) exceeds 2^(exp-8) iff 1.m > 1.75.
  e += rounding == ScaleRounding::rceil && (a & 0x7fffffu) > 0x600000u ? 1 : 0;
  e = e < -127 ? -127 : (e > 127 ? 127 : e);
  // zero or fp32 subnormal (e <= -134 under both rules): 0
  const std::uint8_t code = a < 0x00800000u ? 0 : static_cast<std::uint8_t>(e + 127);
  return a >= kF32InfBits ? kE8m0Nan : code;
}

// Largest |x| of n floats as fp32 bits; >= kF32InfBits when any value is NaN or ±Inf.
EPMOE_HD std::uint32_t abs_max_bits(const float* x, int n) {
  std::uint32_t m = 0;
  for (int i = 0; i < n; ++i) {
    const std::uint32_t a = float_bits(x[i]) & kF32AbsMask;
    m = a > m ? a : m;
  }
  return m;
}

// The encoder's multiplier 2^-e of a scale code (0 for the NaN code, which encodes no value).
// NOTES: 2^-e is a normal fp32 for every reachable e (e <= 120 since amax < 2^128), and x * 2^-e
// never overflows (|x| <= amax); a product below 2^-126 is an E4M3 zero either way.
EPMOE_HD float mxfp8_inverse_scale(std::uint8_t code) {
  return code == kE8m0Nan ? 0.0f : pow2f(127 - static_cast<int>(code));
}

// One element of a block, given the block's scale code and its mxfp8_inverse_scale: e4m3(x * 2^-e)
// (exact product, then RNE); every element of a NaN-scale block is 0x7F (NaN).
EPMOE_HD std::uint8_t mxfp8_encode_value(float x, std::uint8_t code, float inv_scale) {
  return code == kE8m0Nan ? kE4m3Nan : float_to_e4m3(x * inv_scale);
}

// Encodes n <= 32 values (mxfp8_scale_code of their amax, then mxfp8_encode_value each). A block
// with any NaN or ±Inf gets scale 0xFF and every element 0x7F (NaN).
EPMOE_HD void mxfp8_encode_block(const float* x, int n, ScaleRounding rounding,
                                 std::uint8_t* elements, std::uint8_t* scale_code) {
  const std::uint8_t code = mxfp8_scale_code(bits_float(abs_max_bits(x, n)), rounding);
  *scale_code = code;
  const float inv_scale = mxfp8_inverse_scale(code);
  for (int i = 0; i < n; ++i) elements[i] = mxfp8_encode_value(x[i], code, inv_scale);
}

// out = e4m3 * 2^e (exact whenever representable in fp32); scale 0xFF gives n NaNs. A NaN is
// always kF32QuietNan, never NaN * scale: GPU arithmetic returns its own canonical NaN
// (0x7fffffff) where the host's keeps the payload, and the two must agree bit for bit.
EPMOE_HD float mxfp8_decode_value(std::uint8_t element, std::uint8_t scale_code) {
  const bool nan = scale_code == kE8m0Nan || e4m3_is_nan(element);
  return nan ? quiet_nan() : e4m3_to_float(element) * e8m0_to_float(scale_code);
}
EPMOE_HD void mxfp8_decode_block(const std::uint8_t* elements, std::uint8_t scale_code, int n,
                                 float* out) {
  for (int i = 0; i < n; ++i) out[i] = mxfp8_decode_value(elements[i], scale_code);
}

// A row of n values (n a multiple of 32; a shorter last block is encoded as such): n elements,
// ceil(n / 32) scales.
EPMOE_HD void mxfp8_encode_row(const float* x, std::int64_t n, ScaleRounding rounding,
                               std::uint8_t* elements, std::uint8_t* scales) {
  for (std::int64_t b = 0; b * kMxfp8Block < n; ++b) {
    const std::int64_t off = b * kMxfp8Block;
    const int len = static_cast<int>(n - off < kMxfp8Block ? n - off : kMxfp8Block);
    mxfp8_encode_block(x + off, len, rounding, elements + off, scales + b);
  }
}

EPMOE_HD void mxfp8_decode_row(const std::uint8_t* elements, const std::uint8_t* scales,
                               std::int64_t n, float* out) {
  for (std::int64_t b = 0; b * kMxfp8Block < n; ++b) {
    const std::int64_t off = b * kMxfp8Block;
    const int len = static_cast<int>(n - off < kMxfp8Block ? n - off : kMxfp8Block);
    mxfp8_decode_block(elements + off, scales[b], len, out + off);
  }
}

// Encode then decode, as the reference forward emulates a quantization point. x == out allowed.
EPMOE_HD void mxfp8_quantize_dequantize_row(const float* x, std::int64_t n, ScaleRounding rounding,
                                            float* out) {
  std::uint8_t elements[kMxfp8Block];
  std::uint8_t scale;
  for (std::int64_t off = 0; off < n; off += kMxfp8Block) {
    const int len = static_cast<int>(n - off < kMxfp8Block ? n - off : kMxfp8Block);
    mxfp8_encode_block(x + off, len, rounding, elements, &scale);
    mxfp8_decode_block(elements, scale, len, out + off);
  }
}

// ---- NVFP4: 16 E2M1 elements share one E4M3 block scale; one fp32 scale per group. ----
//
// The fp32 encode scale s_enc = 448 * 6 / amax(group), rounded to fp32, maps the group's largest
// finite magnitude onto the top of the E4M3 block-scale range times the E2M1 range. amax == 0,
// NaN or ±Inf gives 1.0f; a quotient that overflows fp32 is clamped to FLT_MAX.
inline constexpr float kNvfp4ScaleNumerator = kE4m3Max * kE2m1Max;  // 2688
inline constexpr float kFloatMax = 3.40282346638528859812e+38f;

EPMOE_HD float nvfp4_tensor_scale(float amax) {
  const std::uint32_t a = float_bits(amax) & kF32AbsMask;
  if (a == 0 || a >= kF32InfBits) return 1.0f;
  const float s = kNvfp4ScaleNumerator / bits_float(a);
  return is_finite_bits(float_bits(s)) ? s : kFloatMax;
}

// Largest finite |x| (NaN and ±Inf are skipped); 0 when there is none.
EPMOE_HD float nvfp4_group_amax(const float* x, std::int64_t n) {
  std::uint32_t m = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::uint32_t a = float_bits(x[i]) & kF32AbsMask;
    if (a < kF32InfBits && a > m) m = a;
  }
  return bits_float(m);
}

// Encodes n <= 16 values into (n + 1) / 2 bytes, element 2i in the low nibble (a missing odd
// element is 0). Steps, each rounded to fp32:
//   block_scale = e4m3((amax(block) / 6) * s_enc)          RNE, saturating at 448
//   element     = e2m1((x * s_enc) / float(block_scale))   RNE, saturating at ±6
// A block with NaN or ±Inf (or a NaN block scale) gets block scale 0x7F (NaN) and elements 0. A
// block scale that rounds to zero gives element i = e2m1(x_i * 0), the zero of x_i's sign (0x8 for
// a negative x_i, -0 included): what cuda_fp4.h's conversion gives for the scaled element when the
// reciprocal of a zero block scale is taken as 0, as CUDA's NVFP4 quantize kernels do. So every
// element of a finite block is bit for bit __nv_cvt_float2_to_fp4x2 (RN) of its scaled value.
// s_enc must be positive and finite.
// The block scale of a block whose abs_max_bits is amax_bits (the first step above).
EPMOE_HD std::uint8_t nvfp4_block_scale(std::uint32_t amax_bits, float s_enc) {
  return amax_bits >= kF32InfBits ? kE4m3Nan
                                  : float_to_e4m3(bits_float(amax_bits) / kE2m1Max * s_enc);
}

// One finite element's E2M1 code (the second step) in a block of scale value bs_value
// (e4m3_to_float of a block scale that is not NaN).
EPMOE_HD std::uint8_t nvfp4_encode_value(float x, float s_enc, float bs_value) {
  // NOTES: x * 0 is written as the sign bit alone (x is finite here), so no compiler flag
  // (no-signed-zeros, fast math) can turn -0 into +0.
  const float scaled =
      bs_value == 0.0f ? bits_float(float_bits(x) & ~kF32AbsMask) : x * s_enc / bs_value;
  return float_to_e2m1(scaled);
}

EPMOE_HD void nvfp4_encode_block(const float* x, int n, float s_enc, std::uint8_t* packed,
                                 std::uint8_t* block_scale) {
  for (int i = 0; i < (n + 1) / 2; ++i) packed[i] = 0;
  const std::uint8_t bs = nvfp4_block_scale(abs_max_bits(x, n), s_enc);
  *block_scale = bs;
  if (e4m3_is_nan(bs)) return;
  const float bs_value = e4m3_to_float(bs);
  for (int i = 0; i < n; ++i) {
    const std::uint8_t q = nvfp4_encode_value(x[i], s_enc, bs_value);
    packed[i / 2] = static_cast<std::uint8_t>(packed[i / 2] | (q << ((i & 1) * 4)));
  }
}

// out = (e2m1 * block_scale) / s_enc; a NaN block scale gives n NaNs. Code 0x8 decodes to -0 (a
// zero block scale too: -0 * 0 / s_enc = -0), so a zero keeps its sign through a round trip.
EPMOE_HD float nvfp4_decode_value(std::uint8_t q, std::uint8_t block_scale, float s_enc) {
  return e4m3_is_nan(block_scale) ? quiet_nan()
                                  : e2m1_to_float(q) * e4m3_to_float(block_scale) / s_enc;
}
// Element i's E2M1 code in packed bytes (element 2j in the low nibble of byte j): NVFP4 and MXFP4.
EPMOE_HD std::uint8_t e2m1_code_at(const std::uint8_t* packed, std::int64_t i) {
  return static_cast<std::uint8_t>((packed[i / 2] >> ((i & 1) * 4)) & 0xfu);
}
EPMOE_HD void nvfp4_decode_block(const std::uint8_t* packed, std::uint8_t block_scale, float s_enc,
                                 int n, float* out) {
  for (int i = 0; i < n; ++i)
    out[i] = nvfp4_decode_value(e2m1_code_at(packed, i), block_scale, s_enc);
}

// out = (e2m1 * block_scale) * global_scale: NVFP4 as ModelOpt's checkpoints define it, with the
// decode multiplier weight_scale_2 instead of s_enc. e2m1 * block_scale is exact, so this is one
// fp32 rounding; it equals nvfp4_decode_block with s_enc = 1 / global_scale only where dividing
// and multiplying by the reciprocal agree (always when global_scale is a power of two). A NaN
// block scale gives n NaNs; any NaN result is kF32QuietNan (the device's own NaN differs).
EPMOE_HD void nvfp4_decode_block_global(const std::uint8_t* packed, std::uint8_t block_scale,
                                        float global_scale, int n, float* out) {
  const float bs_value = e4m3_to_float(block_scale);
  for (int i = 0; i < n; ++i) {
    const std::uint8_t q = e2m1_code_at(packed, i);
    const float v = e2m1_to_float(q) * bs_value * global_scale;
    out[i] = (float_bits(v) & kF32AbsMask) > kF32InfBits ? quiet_nan() : v;
  }
}

// A row of n values (n a multiple of 16): n / 2 bytes of elements, n / 16 block scales. The
// group's s_enc travels separately (nvfp4_tensor_scale(nvfp4_group_amax(row, n)) for a row group).
EPMOE_HD void nvfp4_encode_row(const float* x, std::int64_t n, float s_enc, std::uint8_t* packed,
                               std::uint8_t* scales) {
  for (std::int64_t b = 0; b * kNvfp4Block < n; ++b) {
    const std::int64_t off = b * kNvfp4Block;
    const int len = static_cast<int>(n - off < kNvfp4Block ? n - off : kNvfp4Block);
    nvfp4_encode_block(x + off, len, s_enc, packed + off / 2, scales + b);
  }
}

EPMOE_HD void nvfp4_decode_row(const std::uint8_t* packed, const std::uint8_t* scales, float s_enc,
                               std::int64_t n, float* out) {
  for (std::int64_t b = 0; b * kNvfp4Block < n; ++b) {
    const std::int64_t off = b * kNvfp4Block;
    const int len = static_cast<int>(n - off < kNvfp4Block ? n - off : kNvfp4Block);
    nvfp4_decode_block(packed + off / 2, scales[b], s_enc, len, out + off);
  }
}

// Encode then decode with a given s_enc. x == out allowed.
EPMOE_HD void nvfp4_quantize_dequantize_row(const float* x, std::int64_t n, float s_enc,
                                            float* out) {
  std::uint8_t packed[kNvfp4Block / 2];
  std::uint8_t scale;
  for (std::int64_t off = 0; off < n; off += kNvfp4Block) {
    const int len = static_cast<int>(n - off < kNvfp4Block ? n - off : kNvfp4Block);
    nvfp4_encode_block(x + off, len, s_enc, packed, &scale);
    nvfp4_decode_block(packed, scale, s_enc, len, out + off);
  }
}

// ---- FP8 with 128-blocks (DeepSeek-V3/R1 checkpoints): E4M3 elements, one fp32 scale per block.
// ----
//
// The scale is a *dequantization multiplier* (the checkpoints' weight_scale_inv): value = e4m3 *
// scale. Weights have one scale per 128 x 128 tile, activations one per 1 x 128 run of a row; a
// block at a matrix edge covers what is there (fewer rows or columns). The encoder is the one of
// DeepSeek-V3's reference (act_quant / weight_quant), each step one IEEE fp32 operation:
//   scale   = amax(block) / 448
//   element = e4m3(x / scale)          RNE, saturating at ±448 (__NV_SATFINITE)
// A block with NaN or ±Inf gets a NaN scale and NaN elements (0x7F). A block whose scale is 0 (all
// zero, or amax <= 448 * 2^-150 so that amax / 448 underflows) gets e4m3(x * 0), the zero of x's
// sign (0x00 / 0x80): scale 0 is what the rule gives, and 0 / 0 would make NaNs of zeros.
inline constexpr int kFp8Block128 = 128;  // elements per scale along a row; rows per weight tile

EPMOE_HD float fp8_block128_scale(float amax) {
  const std::uint32_t a = float_bits(amax) & kF32AbsMask;
  if (a >= kF32InfBits) return quiet_nan();
  return bits_float(a) / kE4m3Max;
}

// One element against its block's scale (a scale from fp8_block128_scale).
EPMOE_HD std::uint8_t fp8_block128_encode_value(float x, float scale) {
  const std::uint32_t s = float_bits(scale) & kF32AbsMask;
  if (s > kF32InfBits) return kE4m3Nan;
  // NOTES: x * 0 written as the sign bit alone, so no compiler flag can turn -0 into +0.
  if (s == 0) return static_cast<std::uint8_t>((float_bits(x) >> 24) & 0x80u);
  return float_to_e4m3(x / scale);
}

// e4m3 * scale, one fp32 rounding; any NaN result is kF32QuietNan (the device's own NaN differs).
EPMOE_HD float fp8_block128_decode_value(std::uint8_t element, float scale) {
  const float v = e4m3_to_float(element) * scale;
  return (float_bits(v) & kF32AbsMask) > kF32InfBits ? quiet_nan() : v;
}

// A 1 x n activation block (n <= 128): n elements and one scale.
EPMOE_HD void fp8_block128_encode_block(const float* x, int n, std::uint8_t* elements,
                                        float* scale) {
  const float s = fp8_block128_scale(bits_float(abs_max_bits(x, n)));
  *scale = s;
  for (int i = 0; i < n; ++i) elements[i] = fp8_block128_encode_value(x[i], s);
}

EPMOE_HD void fp8_block128_decode_block(const std::uint8_t* elements, float scale, int n,
                                        float* out) {
  for (int i = 0; i < n; ++i) out[i] = fp8_block128_decode_value(elements[i], scale);
}

// A row of n activations: n elements, ceil(n / 128) scales (a shorter last block covers the rest).
EPMOE_HD void fp8_block128_encode_row(const float* x, std::int64_t n, std::uint8_t* elements,
                                      float* scales) {
  for (std::int64_t b = 0; b * kFp8Block128 < n; ++b) {
    const std::int64_t off = b * kFp8Block128;
    const int len = static_cast<int>(n - off < kFp8Block128 ? n - off : kFp8Block128);
    fp8_block128_encode_block(x + off, len, elements + off, scales + b);
  }
}

// Also decodes row r of a weight matrix, given the scales of its tile row (scales + (r / 128) *
// ceil(cols / 128)).
EPMOE_HD void fp8_block128_decode_row(const std::uint8_t* elements, const float* scales,
                                      std::int64_t n, float* out) {
  for (std::int64_t b = 0; b * kFp8Block128 < n; ++b) {
    const std::int64_t off = b * kFp8Block128;
    const int len = static_cast<int>(n - off < kFp8Block128 ? n - off : kFp8Block128);
    fp8_block128_decode_block(elements + off, scales[b], len, out + off);
  }
}

// Encode then decode a row of activations. x == out allowed.
EPMOE_HD void fp8_block128_quantize_dequantize_row(const float* x, std::int64_t n, float* out) {
  std::uint8_t elements[kFp8Block128];
  float scale;
  for (std::int64_t off = 0; off < n; off += kFp8Block128) {
    const int len = static_cast<int>(n - off < kFp8Block128 ? n - off : kFp8Block128);
    fp8_block128_encode_block(x + off, len, elements, &scale);
    fp8_block128_decode_block(elements, scale, len, out + off);
  }
}

// A weight tile of rows x cols (each <= 128) whose rows are `stride` floats apart; its elements
// are written with the same stride. The amax is over the whole tile.
EPMOE_HD void fp8_block128_encode_tile(const float* x, int rows, int cols, std::int64_t stride,
                                       std::uint8_t* elements, float* scale) {
  std::uint32_t m = 0;
  for (int r = 0; r < rows; ++r) {
    const std::uint32_t a = abs_max_bits(x + r * stride, cols);
    m = a > m ? a : m;
  }
  const float s = fp8_block128_scale(bits_float(m));
  *scale = s;
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c)
      elements[r * stride + c] = fp8_block128_encode_value(x[r * stride + c], s);
}

// ---- MXFP4 (OCP MX v1.0; gpt-oss checkpoints): 32 E2M1 elements share one E8M0 scale. ----
//
// mxfp4_scale_code: the exponent e of the block scale 2^e, as an E8M0 code (e + 127).
//   rceil:     e = ceil(log2(amax / 6)), the smallest e with amax <= 6 * 2^e: no element
//              saturates (triton_kernels' downcast_to_mxfp ROUND_UP, its default).
//   ocp_floor: e = floor(log2(amax)) - 2 (2 = exponent of 6): elements up to 2^3 * (1 - 2^-24)
//              may result and those above 6 saturate.
//   e is clamped to [-127, 127]; amax == 0 (or so small that e < -127) gives code 0 (2^-127);
//   NaN or ±Inf amax gives 0xFF (NaN).
EPMOE_HD std::uint8_t mxfp4_scale_code(float amax, ScaleRounding rounding) {
  const std::uint32_t a = float_bits(amax) & kF32AbsMask;
  if (a >= kF32InfBits) return kE8m0Nan;
  if (a < 0x00800000u) return 0;  // zero or fp32 subnormal: e <= -128 under both rules
  int e = static_cast<int>(a >> 23) - 127 - 2;
  // 6 = 1.5 * 2^2: amax / 6 = (1.m / 1.5) * 2^(exp-2) exceeds 2^(exp-2) iff 1.m > 1.5.
  if (rounding == ScaleRounding::rceil && (a & 0x7fffffu) > 0x400000u) ++e;
  if (e < -127) e = -127;
  return static_cast<std::uint8_t>(e + 127);  // e <= 126 since amax < 2^128
}

// Encodes n <= 32 values into (n + 1) / 2 bytes, element 2i in the low nibble (a missing odd
// element is 0), as gpt-oss's *_blocks tensors hold them. Elements are e2m1(x * 2^-e) (exact
// product, then RNE, saturating at ±6; a negative value that rounds to zero is 0x8, -0). A block
// with NaN or ±Inf gets scale 0xFF (NaN) and elements 0: E2M1 has no NaN code.
EPMOE_HD void mxfp4_encode_block(const float* x, int n, ScaleRounding rounding,
                                 std::uint8_t* packed, std::uint8_t* scale_code) {
  for (int i = 0; i < (n + 1) / 2; ++i) packed[i] = 0;
  const std::uint8_t code = mxfp4_scale_code(bits_float(abs_max_bits(x, n)), rounding);
  *scale_code = code;
  if (code == kE8m0Nan) return;
  // NOTES: 2^-e is a normal fp32 (code <= 253), and |x| * 2^-e < 8 never overflows; a product
  // below 2^-126 may round but is an E2M1 zero of the same sign either way.
  const float inv_scale = pow2f(127 - static_cast<int>(code));
  for (int i = 0; i < n; ++i) {
    const std::uint8_t q = float_to_e2m1(x[i] * inv_scale);
    packed[i / 2] = static_cast<std::uint8_t>(packed[i / 2] | (q << ((i & 1) * 4)));
  }
}

// out = e2m1 * 2^e (exact, but for overflow to ±Inf past FLT_MAX); scale 0xFF gives n NaNs.
EPMOE_HD void mxfp4_decode_block(const std::uint8_t* packed, std::uint8_t scale_code, int n,
                                 float* out) {
  const float scale = e8m0_to_float(scale_code);
  for (int i = 0; i < n; ++i) {
    const std::uint8_t q = e2m1_code_at(packed, i);
    out[i] = scale_code == kE8m0Nan ? quiet_nan() : e2m1_to_float(q) * scale;
  }
}

// A row of n values (n a multiple of 32; a shorter last block is encoded as such): (n + 1) / 2
// bytes of elements, ceil(n / 32) scales.
EPMOE_HD void mxfp4_encode_row(const float* x, std::int64_t n, ScaleRounding rounding,
                               std::uint8_t* packed, std::uint8_t* scales) {
  for (std::int64_t b = 0; b * kMxfp8Block < n; ++b) {
    const std::int64_t off = b * kMxfp8Block;
    const int len = static_cast<int>(n - off < kMxfp8Block ? n - off : kMxfp8Block);
    mxfp4_encode_block(x + off, len, rounding, packed + off / 2, scales + b);
  }
}

EPMOE_HD void mxfp4_decode_row(const std::uint8_t* packed, const std::uint8_t* scales,
                               std::int64_t n, float* out) {
  for (std::int64_t b = 0; b * kMxfp8Block < n; ++b) {
    const std::int64_t off = b * kMxfp8Block;
    const int len = static_cast<int>(n - off < kMxfp8Block ? n - off : kMxfp8Block);
    mxfp4_decode_block(packed + off / 2, scales[b], len, out + off);
  }
}

// Encode then decode. x == out allowed.
EPMOE_HD void mxfp4_quantize_dequantize_row(const float* x, std::int64_t n, ScaleRounding rounding,
                                            float* out) {
  std::uint8_t packed[kMxfp8Block / 2];
  std::uint8_t scale;
  for (std::int64_t off = 0; off < n; off += kMxfp8Block) {
    const int len = static_cast<int>(n - off < kMxfp8Block ? n - off : kMxfp8Block);
    mxfp4_encode_block(x + off, len, rounding, packed, &scale);
    mxfp4_decode_block(packed, scale, len, out + off);
  }
}

// ---- Sizes of one encoded row of n values: fp8_block128 and mxfp4. ----
EPMOE_HD constexpr std::int64_t fp8_block128_scale_count(std::int64_t n) {
  return (n + kFp8Block128 - 1) / kFp8Block128;
}
// Elements and the fp32 scales of a row of activations.
EPMOE_HD constexpr std::int64_t fp8_block128_row_bytes(std::int64_t n) {
  return n + 4 * fp8_block128_scale_count(n);
}
EPMOE_HD constexpr std::int64_t mxfp4_packed_bytes(std::int64_t n) {
  return (n + 1) / 2;
}
EPMOE_HD constexpr std::int64_t mxfp4_scale_count(std::int64_t n) {
  return (n + kMxfp8Block - 1) / kMxfp8Block;
}
EPMOE_HD constexpr std::int64_t mxfp4_row_bytes(std::int64_t n) {
  return mxfp4_packed_bytes(n) + mxfp4_scale_count(n);
}

// ---- Sizes of one encoded row of n values (n a multiple of the block). ----
EPMOE_HD constexpr std::int64_t mxfp8_scale_count(std::int64_t n) {
  return (n + kMxfp8Block - 1) / kMxfp8Block;
}
EPMOE_HD constexpr std::int64_t mxfp8_row_bytes(std::int64_t n) {
  return n + mxfp8_scale_count(n);
}
EPMOE_HD constexpr std::int64_t nvfp4_packed_bytes(std::int64_t n) {
  return (n + 1) / 2;
}
EPMOE_HD constexpr std::int64_t nvfp4_scale_count(std::int64_t n) {
  return (n + kNvfp4Block - 1) / kNvfp4Block;
}
// Elements and block scales; the group's fp32 s_enc (4 bytes) is not included.
EPMOE_HD constexpr std::int64_t nvfp4_row_bytes(std::int64_t n) {
  return nvfp4_packed_bytes(n) + nvfp4_scale_count(n);
}

}  // namespace epmoe::formats

// Expert weights resident in their format (docs/formats.md "Resident weights", docs/design.md
// §4.1), shared by every backend: the layout, the encoder that prepares it (weights.cu) and the
// decoders the tiles run on each k slab. Host and device code (EPMOE_HD), built only on codec.hpp,
// so the host tests can check the decoders exhaustively (resident_decode_test.cpp).
//
// One FC of E_local experts, each matrix [rows, cols] quantized along cols (the reduction dim, K):
//   elements  [E][rows][cols * bits / 8]   bf16: the bf16 code (2 B); mxfp8: E4M3 (1 B);
//                                          nvfp4: E2M1, two per byte, even element in the low
//                                          nibble
//   scales    [E][rows / 64][cols / 64][64][64 / block]   mxfp8: E8M0 per 32; nvfp4: E4M3 per 16
//                                          (none for bf16): the scales of 64 consecutive rows for
//                                          one 64-deep k slab are one contiguous record of 128 B
//                                          (mxfp8) or 256 B (nvfp4), so a tile's cp.async takes
//                                          them in 16-byte copies like the elements
//   s_enc     [E] nvfp4 only: the matrix's fp32 encode scale
// Element bytes and scales are exactly what formats' host quantization of the same matrix gives
// (quantize_mxfp8 / quantize_nvfp4 per_tensor, the same codec.hpp block functions): the scale
// records only reorder the host API's [rows][cols / block] scale matrix.
//
// Decoding a run of 32 elements of one row gives, bit for bit:
//   decode_values  the fp32 value decode(encode(w)) of math::emulate_weight_matrix (exact backend)
//   decode_codes   the bf16 code bf16(value * s_enc) of math::bf16_codes (tensor-core backend)
#pragma once

#include <cstdint>

#include "epmoe/config.hpp"
#include "formats/codec.hpp"

namespace epmoe::cuda::experts {

inline constexpr int kRun = 32;        // elements one thread encodes or decodes at once
inline constexpr int kRowGroup = 64;   // rows of one scale record
inline constexpr int kScaleSlab = 64;  // k of one scale record (the tiles' slab)
static_assert(kRun == formats::kMxfp8Block && kRun == 2 * formats::kNvfp4Block &&
                  kScaleSlab % kRun == 0 && kShapeAlignment % kScaleSlab == 0 &&
                  kShapeAlignment % kRowGroup == 0,
              "H and I are multiples of 64: slabs hold whole runs and runs whole blocks");

EPMOE_HD constexpr int element_bits(Precision p) {
  return p == Precision::bf16 ? 16 : p == Precision::mxfp8 ? 8 : 4;
}
EPMOE_HD constexpr int scale_block(Precision p) {  // elements per scale; 0: no scales
  return p == Precision::bf16    ? 0
         : p == Precision::mxfp8 ? formats::kMxfp8Block
                                 : formats::kNvfp4Block;
}
EPMOE_HD constexpr int scales_per_slab_row(Precision p) {
  return p == Precision::bf16 ? 0 : kScaleSlab / scale_block(p);
}
EPMOE_HD constexpr int run_bytes(Precision p) {
  return kRun * element_bits(p) / 8;
}
EPMOE_HD constexpr int run_scales(Precision p) {
  return p == Precision::bf16 ? 0 : kRun / scale_block(p);
}

// One FC of this rank's experts, resident (device pointers).
struct ResidentMatrices {
  std::uint8_t* elements;
  std::uint8_t* scales;  // nullptr for bf16
  float* s_enc;          // nullptr unless nvfp4
  std::int64_t experts, rows, cols;
  Precision precision;

  EPMOE_HD std::int64_t row_bytes() const { return cols * element_bits(precision) / 8; }
  EPMOE_HD std::int64_t element_bytes() const { return experts * rows * row_bytes(); }
  EPMOE_HD std::int64_t scale_bytes() const {
    return precision == Precision::bf16 ? 0 : experts * rows * cols / scale_block(precision);
  }
  // The first byte of row `row` of expert `e`, at element k (k a multiple of kRun).
  EPMOE_HD std::uint8_t* run(std::int64_t e, std::int64_t row, std::int64_t k) const {
    return elements + (e * rows + row) * row_bytes() + k * element_bits(precision) / 8;
  }
  // The scale record of rows [64 g, 64 g + 64) of expert e for the k slab `slab`.
  EPMOE_HD std::uint8_t* scale_record(std::int64_t e, std::int64_t g, std::int64_t slab) const {
    return scales + ((e * (rows / kRowGroup) + g) * (cols / kScaleSlab) + slab) * kRowGroup *
                        scales_per_slab_row(precision);
  }
  // The first scale of the run at (row, k) of expert e.
  EPMOE_HD std::uint8_t* run_scale(std::int64_t e, std::int64_t row, std::int64_t k) const {
    return scale_record(e, row / kRowGroup, k / kScaleSlab) +
           (row % kRowGroup) * scales_per_slab_row(precision) +
           (k % kScaleSlab) / scale_block(precision);
  }
  EPMOE_HD float matrix_s_enc(std::int64_t e) const {
    return precision == Precision::nvfp4 ? s_enc[e] : 1.0f;
  }
};

struct ResidentWeights {
  ResidentMatrices w13;  // [E_local, 2I, H] gate rows then up rows
  ResidentMatrices w2;   // [E_local, H, I]
};

// ---- Encode: one run of 32 values of a row (weights.cu's preparation). ----
// `elements` and `scales` point at the run's first element byte and first scale; s_enc is the
// matrix's (nvfp4; ignored otherwise). Block for block what formats' host quantization writes.
template <Precision P>
EPMOE_HD void encode_run(const float (&v)[kRun], ScaleRounding rounding, float s_enc,
                         std::uint8_t* elements, std::uint8_t* scales) {
  if constexpr (P == Precision::bf16) {
    for (int i = 0; i < kRun; ++i) {
      const std::uint16_t c = formats::float_to_bf16(v[i]);
      elements[2 * i] = static_cast<std::uint8_t>(c & 0xffu);  // little endian, as a uint16_t
      elements[2 * i + 1] = static_cast<std::uint8_t>(c >> 8);
    }
  } else if constexpr (P == Precision::mxfp8) {
    formats::mxfp8_encode_block(v, kRun, rounding, elements, scales);
  } else {
    for (int half = 0; half < 2; ++half)
      formats::nvfp4_encode_block(v + half * formats::kNvfp4Block, formats::kNvfp4Block, s_enc,
                                  elements + half * formats::kNvfp4Block / 2, scales + half);
  }
}

// The decoders take N = 32 elements (a run) or N = 16 (half a run: one NVFP4 block) of one row:
// `elements` points at the first one's byte, `scales` at its scale (MXFP8: one for the run; NVFP4:
// scales[b] for elements [16 b, 16 b + 16)). A tile decodes a run as two halves to keep few
// registers live.

// ---- Decode to values: the exact backend's operand, decode(encode(w)) in fp32. ----
// The codec's own block decoders, so the arithmetic is the host's, step for step.
template <Precision P, int N = kRun>
EPMOE_HD void decode_values(const std::uint8_t* elements, const std::uint8_t* scales, float s_enc,
                            float (&out)[N]) {
  static_assert(N == kRun || N == kRun / 2, "a run or half a run");
  if constexpr (P == Precision::bf16) {
    for (int i = 0; i < N; ++i)
      out[i] = formats::bf16_to_float(static_cast<std::uint16_t>(
          elements[2 * i] | static_cast<std::uint16_t>(elements[2 * i + 1]) << 8));
  } else if constexpr (P == Precision::mxfp8) {
    formats::mxfp8_decode_block(elements, scales[0], N, out);
  } else {
    for (int b = 0; b < N / formats::kNvfp4Block; ++b)
      formats::nvfp4_decode_block(elements + b * formats::kNvfp4Block / 2, scales[b], s_enc,
                                  formats::kNvfp4Block, out + b * formats::kNvfp4Block);
  }
}

// ---- Decode to bf16 codes: the tensor-core backend's operand, bf16(value * s_enc). ----
//
// The general rule is math::bf16_codes on decode_values: float_to_bf16(value * s_enc), a NaN value
// kept as it is (the host's NaN * s_enc keeps the payload; a GPU product would not). Where that
// product is exact and normal the code is the top half of the exact fp32 product e4m3 x 2^e
// (mxfp8) or e2m1 x block scale (nvfp4), whose low 16 bits are zero; the shortcuts below are
// taken only inside those ranges, which resident_weights_test.cpp checks against the general rule
// for every element code x every scale code (and, for nvfp4, s_enc across its whole range).
EPMOE_HD std::uint16_t operand_code(float value, float s_enc) {
  return formats::float_to_bf16(value != value ? value : value * s_enc);
}

// mxfp8: e4m3 x 2^e is an exact fp32 normal for every finite element when e in [-117, 118]
// (2^-9 x 2^e >= 2^-126 and 448 x 2^e < 2^128): scale codes 10 ... 245.
EPMOE_HD bool mxfp8_codes_are_exact(std::uint8_t scale_code) {
  return scale_code >= 10 && scale_code <= 245;
}
// nvfp4: value = (e2m1 x bs) / s_enc and value x s_enc round back to the exact product p =
// e2m1 x bs (at most 6 significant bits, 2^-10 <= |p| <= 2688, or 0) when p / s_enc stays an fp32
// normal and finite: s_enc in [2^-115, 2^116].
EPMOE_HD bool nvfp4_codes_are_exact(float s_enc) {
  return s_enc >= 0x1.0p-115f && s_enc <= 0x1.0p116f;
}

// The general rule, two elements at a time (the codec's block decoders on pairs: the same
// arithmetic as whole blocks, with two values live instead of 32).
template <Precision P, int N = kRun>
EPMOE_HD void decode_codes_general(const std::uint8_t* elements, const std::uint8_t* scales,
                                   float s_enc, std::uint16_t (&out)[N]) {
  static_assert(N == kRun || N == kRun / 2, "a run or half a run");
  for (int i = 0; i < N; i += 2) {
    float v[2];
    if constexpr (P == Precision::bf16) {
      v[0] = formats::bf16_to_float(static_cast<std::uint16_t>(
          elements[2 * i] | static_cast<std::uint16_t>(elements[2 * i + 1]) << 8));
      v[1] = formats::bf16_to_float(static_cast<std::uint16_t>(
          elements[2 * i + 2] | static_cast<std::uint16_t>(elements[2 * i + 3]) << 8));
    } else if constexpr (P == Precision::mxfp8) {
      formats::mxfp8_decode_block(elements + i, scales[0], 2, v);
    } else {
      formats::nvfp4_decode_block(elements + i / 2, scales[i / formats::kNvfp4Block], s_enc, 2, v);
    }
    out[i] = operand_code(v[0], s_enc);
    out[i + 1] = operand_code(v[1], s_enc);
  }
}

template <Precision P, int N = kRun>
EPMOE_HD void decode_codes(const std::uint8_t* elements, const std::uint8_t* scales, float s_enc,
                           std::uint16_t (&out)[N]) {
  static_assert(N == kRun || N == kRun / 2, "a run or half a run");
  if constexpr (P == Precision::bf16) {
    // bf16(bf16 value x 1) is the code itself (a NaN code is already quiet).
    for (int i = 0; i < N; ++i)
      out[i] = static_cast<std::uint16_t>(elements[2 * i] |
                                          static_cast<std::uint16_t>(elements[2 * i + 1]) << 8);
  } else if constexpr (P == Precision::mxfp8) {
    if (!mxfp8_codes_are_exact(scales[0]))
      return decode_codes_general<P, N>(elements, scales, s_enc, out);
    const float scale = formats::e8m0_to_float(scales[0]);
    for (int i = 0; i < N; ++i)
      out[i] = formats::e4m3_is_nan(elements[i])
                   ? std::uint16_t{0x7fc0}  // bf16 of the codec's quiet NaN
                   : static_cast<std::uint16_t>(
                         formats::float_bits(formats::e4m3_to_float(elements[i]) * scale) >> 16);
  } else {
    bool exact = nvfp4_codes_are_exact(s_enc);
    for (int b = 0; b < N / formats::kNvfp4Block; ++b)
      exact = exact && !formats::e4m3_is_nan(scales[b]);
    if (!exact) return decode_codes_general<P, N>(elements, scales, s_enc, out);
    for (int b = 0; b < N / formats::kNvfp4Block; ++b) {
      const float bs = formats::e4m3_to_float(scales[b]);
      for (int i = 0; i < formats::kNvfp4Block; ++i) {
        const int at = b * formats::kNvfp4Block + i;
        const auto q = static_cast<std::uint8_t>((elements[at / 2] >> ((at & 1) * 4)) & 0xfu);
        out[at] =
            static_cast<std::uint16_t>(formats::float_bits(formats::e2m1_to_float(q) * bs) >> 16);
      }
    }
  }
}

}  // namespace epmoe::cuda::experts

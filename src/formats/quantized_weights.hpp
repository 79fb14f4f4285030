// Expert weights already in a layer's precision (ExpertWeights::w13_quantized / w2_quantized,
// docs/formats.md "Pre-quantized expert weights"), decoded block by block with the codec's own
// decode functions: the one header the CPU executor (on the host) and the CUDA weight preparation
// (in a kernel) both read them with, so both give the values a quantized bf16 weight would have.
#pragma once

#include <cstdint>

#include "epmoe/config.hpp"  // Precision
#include "epmoe/layer.hpp"   // QuantizedMatrices
#include "formats/codec.hpp"

namespace epmoe::formats {

// Values decoded per call: an MXFP8 / MXFP4 block, two NVFP4 blocks, a quarter of an fp8_block128
// tile's row (the K of every layer is a multiple of 64, so a call never straddles a row or a tile).
inline constexpr int kWeightBlock = 32;
static_assert(kWeightBlock == kMxfp8Block && kWeightBlock == 2 * kNvfp4Block &&
              kFp8Block128 % kWeightBlock == 0);

// Some experts' matrices [experts, rows, cols] of one FC in `precision` (cols = K, the reduction
// dim), checked by validate_weights; pointers to the first of these experts.
struct QuantizedMatrixData {
  Precision precision;
  const std::uint8_t* codes;  // E4M3 [rows, cols] or E2M1 pairs [rows, cols / 2] per matrix
  const void* scales;    // u8 [rows, cols / 32 or / 16] or f32 [ceil(rows/128), ceil(cols/128)]
  const float* global;   // nvfp4: one per matrix; nullptr otherwise
  bool global_is_s_enc;  // nvfp4: global holds s_enc (divide) rather than the decode multiplier
  std::int64_t rows, cols;
};

// `q` (validated) as data, from its first expert on.
inline QuantizedMatrixData quantized_matrix_data(const QuantizedMatrices& q, Precision precision,
                                                 std::int64_t rows, std::int64_t cols) {
  const bool s_enc = given(q.s_enc);
  return QuantizedMatrixData{precision,
                             q.codes.as<const std::uint8_t>(),
                             q.scales.data,
                             precision == Precision::nvfp4
                                 ? (s_enc ? q.s_enc : q.global_scale).as<const float>()
                                 : nullptr,
                             s_enc,
                             rows,
                             cols};
}

// fp8_block128: the index of the 128 x 128 tile (of all of this slice's matrices, row-major per
// matrix) that holds element `at` of matrix `e` (its scale's index in `scales`).
EPMOE_HD std::int64_t fp8_block128_tile(std::int64_t rows, std::int64_t cols, std::int64_t e,
                                        std::int64_t at) {
  const std::int64_t tile_cols = fp8_block128_scale_count(cols);
  return e * fp8_block128_scale_count(rows) * tile_cols + (at / cols) / kFp8Block128 * tile_cols +
         (at % cols) / kFp8Block128;
}

// The kWeightBlock values of matrix `e` from element `at` (row-major, at a multiple of 32) into v.
// Returns the matrix's NVFP4 s_enc (the tensor-core operand scale: value * s_enc is the exact
// e2m1 * block_scale; 1 / global for a decode multiplier), 1 for the other precisions.
EPMOE_HD float decode_weight_block(const QuantizedMatrixData& q, std::int64_t e, std::int64_t at,
                                   float* v) {
  const std::int64_t i = e * q.rows * q.cols + at;  // the first value's index in the slice
  const auto* u8_scales = static_cast<const std::uint8_t*>(q.scales);
  switch (q.precision) {
    case Precision::mxfp8:
      mxfp8_decode_block(q.codes + i, u8_scales[i / kMxfp8Block], kMxfp8Block, v);
      return 1.0f;
    case Precision::mxfp4:
      mxfp4_decode_block(q.codes + i / 2, u8_scales[i / kMxfp8Block], kMxfp8Block, v);
      return 1.0f;
    case Precision::nvfp4: {
      const float global = q.global[e];
      for (int half = 0; half < 2; ++half) {
        const std::int64_t at_half = i + half * kNvfp4Block;
        const std::uint8_t* packed = q.codes + at_half / 2;
        const std::uint8_t scale = u8_scales[at_half / kNvfp4Block];
        if (q.global_is_s_enc)
          nvfp4_decode_block(packed, scale, global, kNvfp4Block, v + half * kNvfp4Block);
        else
          nvfp4_decode_block_global(packed, scale, global, kNvfp4Block, v + half * kNvfp4Block);
      }
      if (q.global_is_s_enc) return global;
      // The bf16-code backends store v * (this scale): 1 / global makes the codes exact, except
      // where it does not exist in fp32 (global 0 or subnormal, a zero or dead matrix: 0 * Inf
      // would be NaN codes), where 1 keeps them exact (v is 0 or tiny: bf16(v) is what v decodes to
      // in the GEMM's exponent range).
      const float inverse = 1.0f / global;
      return inverse <= kFloatMax ? inverse : 1.0f;  // false for +Inf and NaN
    }
    case Precision::fp8_block128: {
      const std::int64_t tile = fp8_block128_tile(q.rows, q.cols, e, at);
      fp8_block128_decode_block(q.codes + i, static_cast<const float*>(q.scales)[tile],
                                kWeightBlock, v);
      return 1.0f;
    }
    case Precision::bf16:
      break;  // bf16 weights are values (ExpertWeights::w13), never codes
  }
  for (int k = 0; k < kWeightBlock; ++k) v[k] = quiet_nan();
  return 1.0f;
}

}  // namespace epmoe::formats

// The resident weight bytes a precision should take (issue 11: the format's size, within the
// layout's alignment), written from the formats' definitions rather than from the library's.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>

#include "epmoe/config.hpp"

namespace epmoe::test {

// `bytes` (a backend's weight_bytes, no biases) for `weights` weights of `experts` experts' two
// FCs: the codes, one block scale per 32 (MXFP8, MXFP4) or 16 (NVFP4), and two fp32 per matrix,
// plus at most 256 bytes of alignment per slice of the allocation.
inline void expect_format_size(std::size_t bytes, Precision precision, std::int64_t weights,
                               std::int64_t experts) {
  double code_bytes = 2, scale_bytes = 0;
  if (precision == Precision::mxfp8) code_bytes = 1, scale_bytes = 1.0 / 32;
  if (precision == Precision::mxfp4) code_bytes = 0.5, scale_bytes = 1.0 / 32;
  if (precision == Precision::nvfp4) code_bytes = 0.5, scale_bytes = 1.0 / 16;
  // fp8_block128: an fp32 per 128 x 128 tile (edge tiles of a size that is not a multiple of 128
  // add a little, inside the slack below), and no per-matrix divisor and multiplier.
  if (precision == Precision::fp8_block128) code_bytes = 1, scale_bytes = 4.0 / (128 * 128);
  const std::size_t per_matrix_floats = precision == Precision::fp8_block128 ? 0 : 2;
  const auto format =
      static_cast<std::size_t>(static_cast<double>(weights) * (code_bytes + scale_bytes)) +
      static_cast<std::size_t>(experts) * 2 * per_matrix_floats * sizeof(float);
  EXPECT_GE(bytes, format) << to_string(precision) << ": resident weight bytes";
  EXPECT_LE(bytes, format + 8 * 256) << to_string(precision) << ": resident weight bytes";
}

}  // namespace epmoe::test

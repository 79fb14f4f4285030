// The size of a weight matrix in its format (docs/formats.md "Resident weights"): what a layer's
// expert weights should take on the device, written once so the backends' allocations, the tests
// (GpuWeights.ResidentBytesAreTheFormatsSizeWithinOnePercent, ResidentBytes.*) and the docs agree.
#pragma once

#include <cstdint>

#include "epmoe/config.hpp"
#include "formats/codec.hpp"

namespace epmoe::formats {

// Bytes of one [rows, cols] matrix quantized along cols (cols a multiple of 64):
//   bf16   2 B per element
//   mxfp8  1 B E4M3 per element + one E8M0 per 32 elements
//   nvfp4  0.5 B E2M1 per element + one E4M3 per 16 elements + one fp32 s_enc for the matrix
EPMOE_HD constexpr std::int64_t format_matrix_bytes(Precision precision, std::int64_t rows,
                                                    std::int64_t cols) {
  switch (precision) {
    case Precision::bf16:
      return 2 * rows * cols;
    case Precision::mxfp8:
      return rows * mxfp8_row_bytes(cols);
    case Precision::nvfp4:
      return rows * nvfp4_row_bytes(cols) + 4;
  }
  return 0;
}

// A rank's expert weights in the layer's format: E_local x (w13 [2I, H] + w2 [H, I]).
inline std::int64_t format_expert_weight_bytes(const LayerConfig& config) {
  const LayerShape& s = config.shape();
  return config.local_experts() *
         (format_matrix_bytes(config.precision(), 2 * s.intermediate, s.hidden) +
          format_matrix_bytes(config.precision(), s.hidden, s.intermediate));
}

}  // namespace epmoe::formats

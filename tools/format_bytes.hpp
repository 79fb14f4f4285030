// Bytes of one expert weight in a layer's precision (codes and scales): what `epmoe bench`'s
// floors count and what `epmoe run` compares the resident weights with. Header-only, so
// `python -m epmoe run` (which compiles tools/run.cpp alone) has it too.
#pragma once

#include "epmoe/config.hpp"

namespace epmoe::tools {

inline double weight_bytes_per_param(Precision p) {
  switch (p) {
    case Precision::bf16:
      return 2.0;
    case Precision::mxfp8:
      return 1.0 + 1.0 / 32;  // E4M3 + one E8M0 per 32
    case Precision::nvfp4:
      return 0.5 + 1.0 / 16;  // E2M1 + one E4M3 per 16 (the fp32 tensor scale is noise)
    case Precision::fp8_block128:
      return 1.0 + 4.0 / (128 * 128);  // E4M3 + one fp32 per 128 x 128 tile
    case Precision::mxfp4:
      return 0.5 + 1.0 / 32;  // E2M1 + one E8M0 per 32
  }
  return 0.0;
}

}  // namespace epmoe::tools

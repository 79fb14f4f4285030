// Host matrix API over the codec (include/epmoe/formats.hpp): argument checks, then one codec row
// call per row.
#include "epmoe/formats.hpp"

#include <cmath>
#include <limits>
#include <string>

#include "epmoe/errors.hpp"
#include "formats/codec.hpp"

namespace epmoe {
namespace {

[[noreturn]] void reject(const char* fn, const std::string& rule) {
  throw Error(ErrorCode::invalid_argument, std::string(fn) + ": " + rule);
}

// rows >= 0, cols >= 0, cols a multiple of `block`, rows * cols representable.
void check_shape(const char* fn, std::int64_t rows, std::int64_t cols, int block) {
  if (rows < 0) reject(fn, "rows=" + std::to_string(rows) + " must be >= 0");
  if (cols < 0) reject(fn, "cols=" + std::to_string(cols) + " must be >= 0");
  if (cols % block != 0) {
    reject(fn, "cols=" + std::to_string(cols) + " must be a multiple of " + std::to_string(block));
  }
  if (cols > 0 && rows > std::numeric_limits<std::int64_t>::max() / cols) {
    reject(fn, "rows=" + std::to_string(rows) + " * cols=" + std::to_string(cols) +
                   " must fit in int64");
  }
}

void check_pointer(const char* fn, const void* p, const char* name, std::int64_t rows,
                   std::int64_t cols) {
  if (p == nullptr && rows * cols != 0) {
    reject(fn, std::string(name) + "=null must be non-null when rows * cols (" +
                   std::to_string(rows) + " * " + std::to_string(cols) + ") > 0");
  }
}

}  // namespace

const char* to_string(Nvfp4ScaleGroup group) {
  switch (group) {
    case Nvfp4ScaleGroup::per_tensor:
      return "per_tensor";
    case Nvfp4ScaleGroup::per_row:
      return "per_row";
  }
  return "unknown";
}

void quantize_mxfp8(const float* x, std::int64_t rows, std::int64_t cols, std::uint8_t* elements,
                    std::uint8_t* scales, ScaleRounding rounding) {
  constexpr const char* fn = "quantize_mxfp8";
  check_shape(fn, rows, cols, formats::kMxfp8Block);
  if (rounding != ScaleRounding::rceil && rounding != ScaleRounding::ocp_floor) {
    reject(fn, "rounding=" + std::to_string(static_cast<int>(rounding)) +
                   " must be rceil or ocp_floor");
  }
  check_pointer(fn, x, "x", rows, cols);
  check_pointer(fn, elements, "elements", rows, cols);
  check_pointer(fn, scales, "scales", rows, cols);
  const std::int64_t scale_cols = cols / formats::kMxfp8Block;
  for (std::int64_t r = 0; r < rows; ++r) {
    formats::mxfp8_encode_row(x + r * cols, cols, rounding, elements + r * cols,
                              scales + r * scale_cols);
  }
}

void dequantize_mxfp8(const std::uint8_t* elements, const std::uint8_t* scales, std::int64_t rows,
                      std::int64_t cols, float* out) {
  constexpr const char* fn = "dequantize_mxfp8";
  check_shape(fn, rows, cols, formats::kMxfp8Block);
  check_pointer(fn, elements, "elements", rows, cols);
  check_pointer(fn, scales, "scales", rows, cols);
  check_pointer(fn, out, "out", rows, cols);
  const std::int64_t scale_cols = cols / formats::kMxfp8Block;
  for (std::int64_t r = 0; r < rows; ++r) {
    formats::mxfp8_decode_row(elements + r * cols, scales + r * scale_cols, cols, out + r * cols);
  }
}

namespace {

void check_group(const char* fn, Nvfp4ScaleGroup group) {
  if (group != Nvfp4ScaleGroup::per_tensor && group != Nvfp4ScaleGroup::per_row) {
    reject(fn,
           "group=" + std::to_string(static_cast<int>(group)) + " must be per_tensor or per_row");
  }
}

void encode_nvfp4_rows(const float* x, std::int64_t rows, std::int64_t cols,
                       const float* row_scales, std::int64_t row_scale_stride, std::uint8_t* packed,
                       std::uint8_t* scales) {
  const std::int64_t packed_cols = cols / 2;
  const std::int64_t scale_cols = cols / formats::kNvfp4Block;
  for (std::int64_t r = 0; r < rows; ++r) {
    formats::nvfp4_encode_row(x + r * cols, cols, row_scales[r * row_scale_stride],
                              packed + r * packed_cols, scales + r * scale_cols);
  }
}

}  // namespace

void quantize_nvfp4(const float* x, std::int64_t rows, std::int64_t cols, Nvfp4ScaleGroup group,
                    std::uint8_t* packed, std::uint8_t* scales, float* tensor_scales) {
  constexpr const char* fn = "quantize_nvfp4";
  check_shape(fn, rows, cols, formats::kNvfp4Block);
  check_group(fn, group);
  check_pointer(fn, x, "x", rows, cols);
  check_pointer(fn, packed, "packed", rows, cols);
  check_pointer(fn, scales, "scales", rows, cols);
  if (tensor_scales == nullptr && (group == Nvfp4ScaleGroup::per_tensor || rows > 0)) {
    reject(fn, "tensor_scales=null must be non-null (it receives the s_enc of each group)");
  }
  if (group == Nvfp4ScaleGroup::per_tensor) {
    tensor_scales[0] = formats::nvfp4_tensor_scale(formats::nvfp4_group_amax(x, rows * cols));
    encode_nvfp4_rows(x, rows, cols, tensor_scales, 0, packed, scales);
  } else {
    for (std::int64_t r = 0; r < rows; ++r) {
      tensor_scales[r] = formats::nvfp4_tensor_scale(formats::nvfp4_group_amax(x + r * cols, cols));
    }
    encode_nvfp4_rows(x, rows, cols, tensor_scales, 1, packed, scales);
  }
}

void quantize_nvfp4_static(const float* x, std::int64_t rows, std::int64_t cols, float tensor_scale,
                           std::uint8_t* packed, std::uint8_t* scales) {
  constexpr const char* fn = "quantize_nvfp4_static";
  check_shape(fn, rows, cols, formats::kNvfp4Block);
  if (!(std::isfinite(tensor_scale) && tensor_scale > 0.0f)) {
    reject(fn, "tensor_scale=" + std::to_string(tensor_scale) + " must be finite and > 0");
  }
  check_pointer(fn, x, "x", rows, cols);
  check_pointer(fn, packed, "packed", rows, cols);
  check_pointer(fn, scales, "scales", rows, cols);
  encode_nvfp4_rows(x, rows, cols, &tensor_scale, 0, packed, scales);
}

void dequantize_nvfp4(const std::uint8_t* packed, const std::uint8_t* scales,
                      const float* tensor_scales, std::int64_t rows, std::int64_t cols,
                      Nvfp4ScaleGroup group, float* out) {
  constexpr const char* fn = "dequantize_nvfp4";
  check_shape(fn, rows, cols, formats::kNvfp4Block);
  check_group(fn, group);
  check_pointer(fn, packed, "packed", rows, cols);
  check_pointer(fn, scales, "scales", rows, cols);
  check_pointer(fn, out, "out", rows, cols);
  if (tensor_scales == nullptr && rows > 0) {
    reject(fn, "tensor_scales=null must be non-null when rows=" + std::to_string(rows) + " > 0");
  }
  const std::int64_t stride = group == Nvfp4ScaleGroup::per_row ? 1 : 0;
  const std::int64_t packed_cols = cols / 2;
  const std::int64_t scale_cols = cols / formats::kNvfp4Block;
  for (std::int64_t r = 0; r < rows; ++r) {
    formats::nvfp4_decode_row(packed + r * packed_cols, scales + r * scale_cols,
                              tensor_scales[r * stride], cols, out + r * cols);
  }
}

}  // namespace epmoe

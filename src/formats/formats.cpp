// The matrix API over the codec (include/epmoe/formats.hpp): argument checks, then one codec row
// call per row on the host, or the kernels of codec_device.cu for CUDA tensors.
#include "epmoe/formats.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "epmoe/errors.hpp"
#include "formats/codec.hpp"
#include "formats/codec_device.hpp"

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

void check_rounding(const char* fn, ScaleRounding rounding) {
  if (rounding != ScaleRounding::rceil && rounding != ScaleRounding::ocp_floor) {
    reject(fn, "rounding=" + std::to_string(static_cast<int>(rounding)) +
                   " must be rceil or ocp_floor");
  }
}

void check_group(const char* fn, Nvfp4ScaleGroup group) {
  if (group != Nvfp4ScaleGroup::per_tensor && group != Nvfp4ScaleGroup::per_row) {
    reject(fn,
           "group=" + std::to_string(static_cast<int>(group)) + " must be per_tensor or per_row");
  }
}

void check_static_scale(const char* fn, float tensor_scale) {
  if (!(std::isfinite(tensor_scale) && tensor_scale > 0.0f)) {
    reject(fn, "tensor_scale=" + std::to_string(tensor_scale) + " must be finite and > 0");
  }
}

void check_blocks(const char* fn, Fp8Blocks blocks) {
  if (blocks != Fp8Blocks::tile_128x128 && blocks != Fp8Blocks::row_1x128) {
    reject(fn, "blocks=" + std::to_string(static_cast<int>(blocks)) +
                   " must be tile_128x128 or row_1x128");
  }
}

}  // namespace

const char* to_string(Fp8Blocks blocks) {
  switch (blocks) {
    case Fp8Blocks::tile_128x128:
      return "tile_128x128";
    case Fp8Blocks::row_1x128:
      return "row_1x128";
  }
  return "unknown";
}

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
  check_rounding(fn, rounding);
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
  check_static_scale(fn, tensor_scale);
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

void quantize_fp8_block128(const float* x, std::int64_t rows, std::int64_t cols, Fp8Blocks blocks,
                           std::uint8_t* elements, float* scales) {
  constexpr const char* fn = "quantize_fp8_block128";
  constexpr std::int64_t kB = formats::kFp8Block128;
  check_shape(fn, rows, cols, 1);
  check_blocks(fn, blocks);
  check_pointer(fn, x, "x", rows, cols);
  check_pointer(fn, elements, "elements", rows, cols);
  check_pointer(fn, scales, "scales", rows, cols);
  const std::int64_t scale_cols = formats::fp8_block128_scale_count(cols);
  if (blocks == Fp8Blocks::row_1x128) {
    for (std::int64_t r = 0; r < rows; ++r) {
      formats::fp8_block128_encode_row(x + r * cols, cols, elements + r * cols,
                                       scales + r * scale_cols);
    }
    return;
  }
  for (std::int64_t i = 0; i * kB < rows; ++i) {
    for (std::int64_t j = 0; j * kB < cols; ++j) {
      const std::int64_t at = i * kB * cols + j * kB;
      formats::fp8_block128_encode_tile(x + at, static_cast<int>(std::min(kB, rows - i * kB)),
                                        static_cast<int>(std::min(kB, cols - j * kB)), cols,
                                        elements + at, scales + i * scale_cols + j);
    }
  }
}

void dequantize_fp8_block128(const std::uint8_t* elements, const float* scales, std::int64_t rows,
                             std::int64_t cols, Fp8Blocks blocks, float* out) {
  constexpr const char* fn = "dequantize_fp8_block128";
  check_shape(fn, rows, cols, 1);
  check_blocks(fn, blocks);
  check_pointer(fn, elements, "elements", rows, cols);
  check_pointer(fn, scales, "scales", rows, cols);
  check_pointer(fn, out, "out", rows, cols);
  const std::int64_t scale_cols = formats::fp8_block128_scale_count(cols);
  const std::int64_t rows_per_scale = blocks == Fp8Blocks::row_1x128 ? 1 : formats::kFp8Block128;
  for (std::int64_t r = 0; r < rows; ++r) {
    formats::fp8_block128_decode_row(elements + r * cols, scales + r / rows_per_scale * scale_cols,
                                     cols, out + r * cols);
  }
}

void quantize_mxfp4(const float* x, std::int64_t rows, std::int64_t cols, std::uint8_t* packed,
                    std::uint8_t* scales, ScaleRounding rounding) {
  constexpr const char* fn = "quantize_mxfp4";
  check_shape(fn, rows, cols, formats::kMxfp8Block);
  check_rounding(fn, rounding);
  check_pointer(fn, x, "x", rows, cols);
  check_pointer(fn, packed, "packed", rows, cols);
  check_pointer(fn, scales, "scales", rows, cols);
  const std::int64_t scale_cols = cols / formats::kMxfp8Block;
  for (std::int64_t r = 0; r < rows; ++r) {
    formats::mxfp4_encode_row(x + r * cols, cols, rounding, packed + r * (cols / 2),
                              scales + r * scale_cols);
  }
}

void dequantize_mxfp4(const std::uint8_t* packed, const std::uint8_t* scales, std::int64_t rows,
                      std::int64_t cols, float* out) {
  constexpr const char* fn = "dequantize_mxfp4";
  check_shape(fn, rows, cols, formats::kMxfp8Block);
  check_pointer(fn, packed, "packed", rows, cols);
  check_pointer(fn, scales, "scales", rows, cols);
  check_pointer(fn, out, "out", rows, cols);
  const std::int64_t scale_cols = cols / formats::kMxfp8Block;
  for (std::int64_t r = 0; r < rows; ++r) {
    formats::mxfp4_decode_row(packed + r * (cols / 2), scales + r * scale_cols, cols,
                              out + r * cols);
  }
}

// ---- TensorViews: the checks above plus dtype, layout, shape and device; then host or CUDA. ----

namespace {

std::string dims_string(const std::vector<std::int64_t>& dims) {
  std::string s = "[";
  for (std::size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// A tensor argument as the matrix [rows, cols] along its last dimension.
struct Matrix {
  void* data = nullptr;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
};

Matrix matrix_arg(const char* fn, const char* name, const TensorView& v, DType dtype) {
  const std::string arg(name);
  if (v.dtype != dtype)
    reject(fn, arg + " has dtype " + to_string(v.dtype) + ", expected " + to_string(dtype));
  if (v.shape.empty()) reject(fn, arg + " is 0-d; expected shape [..., cols]");
  for (const std::int64_t d : v.shape)
    if (d < 0) reject(fn, arg + " has shape " + dims_string(v.shape) + " with a negative size");
  if (!v.is_contiguous())
    reject(fn, arg + " is not contiguous (strides " + dims_string(v.strides) +
                   "); pass a contiguous row-major array");
  Matrix m{v.data, 1, v.shape.back()};
  for (std::size_t i = 0; i + 1 < v.shape.size(); ++i) {
    if (v.shape[i] != 0 && m.rows > std::numeric_limits<std::int64_t>::max() / v.shape[i])
      reject(fn, arg + " has shape " + dims_string(v.shape) + ": too many elements");
    m.rows *= v.shape[i];
  }
  return m;
}

// An argument whose shape follows from the first one's (`first`, named `first_name`): same
// device, that shape.
Matrix follower_arg(const char* fn, const char* name, const TensorView& v, DType dtype,
                    const std::vector<std::int64_t>& shape, const TensorView& first,
                    const char* first_name) {
  const std::string arg(name);
  if (v.dtype != dtype)
    reject(fn, arg + " has dtype " + to_string(v.dtype) + ", expected " + to_string(dtype));
  if (v.shape != shape)
    reject(fn, arg + " has shape " + dims_string(v.shape) + ", expected " + dims_string(shape));
  if (v.device != first.device)
    reject(fn, arg + " is on " + to_string(v.device) + ", expected " + to_string(first.device) +
                   " (where " + first_name + " is)");
  const Matrix m = matrix_arg(fn, name, v, dtype);
  check_pointer(fn, m.data, name, m.rows, m.cols);
  return m;
}

// The s_enc argument: `count` f32 values (1 or rows), contiguous, any shape.
void scales_arg(const char* fn, const TensorView& v, std::int64_t count, Nvfp4ScaleGroup group,
                const TensorView& first, const char* first_name) {
  if (v.dtype != DType::f32)
    reject(fn, "tensor_scales has dtype " + std::string(to_string(v.dtype)) + ", expected f32");
  if (v.numel() != count)
    reject(fn, "tensor_scales has " + std::to_string(v.numel()) + " elements, expected " +
                   std::to_string(count) + " for group=" + to_string(group));
  if (!v.is_contiguous())
    reject(fn, "tensor_scales is not contiguous (strides " + dims_string(v.strides) + ")");
  if (v.device != first.device)
    reject(fn, "tensor_scales is on " + to_string(v.device) + ", expected " +
                   to_string(first.device) + " (where " + first_name + " is)");
  check_pointer(fn, v.data, "tensor_scales", count, 1);
}

std::vector<std::int64_t> with_last(std::vector<std::int64_t> shape, std::int64_t last) {
  shape.back() = last;
  return shape;
}

bool on_host(const TensorView& v) {
  return v.device.kind == DeviceKind::cpu;
}

formats::CudaTarget cuda_target(const char* fn, const char* name, const TensorView& v,
                                Stream stream) {
  return formats::CudaTarget{fn, name, v.device.index, stream.handle};
}

}  // namespace

void quantize_mxfp8(const TensorView& x, const TensorView& elements, const TensorView& scales,
                    ScaleRounding rounding, Stream stream) {
  constexpr const char* fn = "quantize_mxfp8";
  const Matrix xm = matrix_arg(fn, "x", x, DType::f32);
  check_shape(fn, xm.rows, xm.cols, formats::kMxfp8Block);
  check_rounding(fn, rounding);
  check_pointer(fn, xm.data, "x", xm.rows, xm.cols);
  const Matrix em = follower_arg(fn, "elements", elements, DType::u8, x.shape, x, "x");
  const Matrix sm = follower_arg(fn, "scales", scales, DType::u8,
                                 with_last(x.shape, xm.cols / formats::kMxfp8Block), x, "x");
  const auto* xp = static_cast<const float*>(xm.data);
  auto* ep = static_cast<std::uint8_t*>(em.data);
  auto* sp = static_cast<std::uint8_t*>(sm.data);
  if (on_host(x)) return quantize_mxfp8(xp, xm.rows, xm.cols, ep, sp, rounding);
  formats::quantize_mxfp8_cuda(cuda_target(fn, "x", x, stream), xp, xm.rows, xm.cols, rounding, ep,
                               sp);
}

void dequantize_mxfp8(const TensorView& elements, const TensorView& scales, const TensorView& out,
                      Stream stream) {
  constexpr const char* fn = "dequantize_mxfp8";
  const Matrix em = matrix_arg(fn, "elements", elements, DType::u8);
  check_shape(fn, em.rows, em.cols, formats::kMxfp8Block);
  check_pointer(fn, em.data, "elements", em.rows, em.cols);
  const Matrix sm =
      follower_arg(fn, "scales", scales, DType::u8,
                   with_last(elements.shape, em.cols / formats::kMxfp8Block), elements, "elements");
  const Matrix om = follower_arg(fn, "out", out, DType::f32, elements.shape, elements, "elements");
  const auto* ep = static_cast<const std::uint8_t*>(em.data);
  const auto* sp = static_cast<const std::uint8_t*>(sm.data);
  auto* op = static_cast<float*>(om.data);
  if (on_host(elements)) return dequantize_mxfp8(ep, sp, em.rows, em.cols, op);
  formats::dequantize_mxfp8_cuda(cuda_target(fn, "elements", elements, stream), ep, sp, em.rows,
                                 em.cols, op);
}

namespace {

// quantize_nvfp4 and quantize_nvfp4_static: static_scale null = s_enc computed per group.
void quantize_nvfp4_views(const char* fn, const TensorView& x, Nvfp4ScaleGroup group,
                          const float* static_scale, const TensorView& packed,
                          const TensorView& scales, const TensorView& tensor_scales,
                          Stream stream) {
  const Matrix xm = matrix_arg(fn, "x", x, DType::f32);
  check_shape(fn, xm.rows, xm.cols, formats::kNvfp4Block);
  check_group(fn, group);
  if (static_scale) check_static_scale(fn, *static_scale);
  check_pointer(fn, xm.data, "x", xm.rows, xm.cols);
  const Matrix pm =
      follower_arg(fn, "packed", packed, DType::u8, with_last(x.shape, xm.cols / 2), x, "x");
  const Matrix sm = follower_arg(fn, "scales", scales, DType::u8,
                                 with_last(x.shape, xm.cols / formats::kNvfp4Block), x, "x");
  scales_arg(fn, tensor_scales, group == Nvfp4ScaleGroup::per_row ? xm.rows : 1, group, x, "x");
  const auto* xp = static_cast<const float*>(xm.data);
  auto* pp = static_cast<std::uint8_t*>(pm.data);
  auto* sp = static_cast<std::uint8_t*>(sm.data);
  auto* tp = tensor_scales.as<float>();
  if (!on_host(x)) {
    return formats::quantize_nvfp4_cuda(cuda_target(fn, "x", x, stream), xp, xm.rows, xm.cols,
                                        group, static_scale, pp, sp, tp);
  }
  if (static_scale == nullptr) return quantize_nvfp4(xp, xm.rows, xm.cols, group, pp, sp, tp);
  quantize_nvfp4_static(xp, xm.rows, xm.cols, *static_scale, pp, sp);
  tp[0] = *static_scale;
}

}  // namespace

void quantize_nvfp4(const TensorView& x, Nvfp4ScaleGroup group, const TensorView& packed,
                    const TensorView& scales, const TensorView& tensor_scales, Stream stream) {
  quantize_nvfp4_views("quantize_nvfp4", x, group, nullptr, packed, scales, tensor_scales, stream);
}

void quantize_nvfp4_static(const TensorView& x, float tensor_scale, const TensorView& packed,
                           const TensorView& scales, const TensorView& tensor_scales,
                           Stream stream) {
  quantize_nvfp4_views("quantize_nvfp4_static", x, Nvfp4ScaleGroup::per_tensor, &tensor_scale,
                       packed, scales, tensor_scales, stream);
}

void dequantize_nvfp4(const TensorView& packed, const TensorView& scales,
                      const TensorView& tensor_scales, Nvfp4ScaleGroup group, const TensorView& out,
                      Stream stream) {
  constexpr const char* fn = "dequantize_nvfp4";
  const Matrix pm = matrix_arg(fn, "packed", packed, DType::u8);
  const std::int64_t cols = pm.cols * 2;
  check_shape(fn, pm.rows, cols, formats::kNvfp4Block);
  check_group(fn, group);
  check_pointer(fn, pm.data, "packed", pm.rows, cols);
  const Matrix sm =
      follower_arg(fn, "scales", scales, DType::u8,
                   with_last(packed.shape, cols / formats::kNvfp4Block), packed, "packed");
  scales_arg(fn, tensor_scales, group == Nvfp4ScaleGroup::per_row ? pm.rows : 1, group, packed,
             "packed");
  const Matrix om =
      follower_arg(fn, "out", out, DType::f32, with_last(packed.shape, cols), packed, "packed");
  const auto* pp = static_cast<const std::uint8_t*>(pm.data);
  const auto* sp = static_cast<const std::uint8_t*>(sm.data);
  const auto* tp = tensor_scales.as<const float>();
  auto* op = static_cast<float*>(om.data);
  if (on_host(packed)) return dequantize_nvfp4(pp, sp, tp, pm.rows, cols, group, op);
  formats::dequantize_nvfp4_cuda(cuda_target(fn, "packed", packed, stream), pp, sp, tp, pm.rows,
                                 cols, group, op);
}

// ---- fp8_block128 and mxfp4 on TensorViews ----

namespace {

// The matrices of an fp8_block128 call: `batch` matrices of rows x cols (tile_128x128: the last
// two dimensions, each matrix tiled on its own; row_1x128: one matrix of every row), and the shape
// of its scales.
struct Fp8Stack {
  std::int64_t batch = 1;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::vector<std::int64_t> scale_shape;
};

Fp8Stack fp8_stack(const char* fn, const char* name, const TensorView& v, const Matrix& m,
                   Fp8Blocks blocks) {
  Fp8Stack st;
  st.cols = m.cols;
  st.scale_shape = with_last(v.shape, formats::fp8_block128_scale_count(m.cols));
  if (blocks == Fp8Blocks::row_1x128) {
    st.rows = m.rows;
    return st;
  }
  if (v.shape.size() < 2)
    reject(fn, std::string(name) + " has shape " + dims_string(v.shape) +
                   "; blocks=tile_128x128 needs matrices [..., rows, cols]");
  st.rows = v.shape[v.shape.size() - 2];
  st.batch = st.rows == 0 ? 0 : m.rows / st.rows;
  st.scale_shape[st.scale_shape.size() - 2] = formats::fp8_block128_scale_count(st.rows);
  return st;
}

std::int64_t fp8_scales_per_matrix(const Fp8Stack& st, Fp8Blocks blocks) {
  const std::int64_t scale_rows =
      blocks == Fp8Blocks::row_1x128 ? st.rows : formats::fp8_block128_scale_count(st.rows);
  return scale_rows * formats::fp8_block128_scale_count(st.cols);
}

}  // namespace

void quantize_fp8_block128(const TensorView& x, Fp8Blocks blocks, const TensorView& elements,
                           const TensorView& scales, Stream stream) {
  constexpr const char* fn = "quantize_fp8_block128";
  check_blocks(fn, blocks);
  const Matrix xm = matrix_arg(fn, "x", x, DType::f32);
  check_shape(fn, xm.rows, xm.cols, 1);
  check_pointer(fn, xm.data, "x", xm.rows, xm.cols);
  const Fp8Stack st = fp8_stack(fn, "x", x, xm, blocks);
  const Matrix em = follower_arg(fn, "elements", elements, DType::u8, x.shape, x, "x");
  const Matrix sm = follower_arg(fn, "scales", scales, DType::f32, st.scale_shape, x, "x");
  const auto* xp = static_cast<const float*>(xm.data);
  auto* ep = static_cast<std::uint8_t*>(em.data);
  auto* sp = static_cast<float*>(sm.data);
  if (!on_host(x)) {
    return formats::quantize_fp8_block128_cuda(cuda_target(fn, "x", x, stream), xp, st.batch,
                                               st.rows, st.cols, blocks, ep, sp);
  }
  const std::int64_t per_matrix = st.rows * st.cols, scales_per = fp8_scales_per_matrix(st, blocks);
  for (std::int64_t b = 0; b < st.batch; ++b) {
    quantize_fp8_block128(xp + b * per_matrix, st.rows, st.cols, blocks, ep + b * per_matrix,
                          sp + b * scales_per);
  }
}

void dequantize_fp8_block128(const TensorView& elements, const TensorView& scales, Fp8Blocks blocks,
                             const TensorView& out, Stream stream) {
  constexpr const char* fn = "dequantize_fp8_block128";
  check_blocks(fn, blocks);
  const Matrix em = matrix_arg(fn, "elements", elements, DType::u8);
  check_shape(fn, em.rows, em.cols, 1);
  check_pointer(fn, em.data, "elements", em.rows, em.cols);
  const Fp8Stack st = fp8_stack(fn, "elements", elements, em, blocks);
  const Matrix sm =
      follower_arg(fn, "scales", scales, DType::f32, st.scale_shape, elements, "elements");
  const Matrix om = follower_arg(fn, "out", out, DType::f32, elements.shape, elements, "elements");
  const auto* ep = static_cast<const std::uint8_t*>(em.data);
  const auto* sp = static_cast<const float*>(sm.data);
  auto* op = static_cast<float*>(om.data);
  if (!on_host(elements)) {
    return formats::dequantize_fp8_block128_cuda(cuda_target(fn, "elements", elements, stream), ep,
                                                 sp, st.batch, st.rows, st.cols, blocks, op);
  }
  const std::int64_t per_matrix = st.rows * st.cols, scales_per = fp8_scales_per_matrix(st, blocks);
  for (std::int64_t b = 0; b < st.batch; ++b) {
    dequantize_fp8_block128(ep + b * per_matrix, sp + b * scales_per, st.rows, st.cols, blocks,
                            op + b * per_matrix);
  }
}

void quantize_mxfp4(const TensorView& x, const TensorView& packed, const TensorView& scales,
                    ScaleRounding rounding, Stream stream) {
  constexpr const char* fn = "quantize_mxfp4";
  const Matrix xm = matrix_arg(fn, "x", x, DType::f32);
  check_shape(fn, xm.rows, xm.cols, formats::kMxfp8Block);
  check_rounding(fn, rounding);
  check_pointer(fn, xm.data, "x", xm.rows, xm.cols);
  const Matrix pm =
      follower_arg(fn, "packed", packed, DType::u8, with_last(x.shape, xm.cols / 2), x, "x");
  const Matrix sm = follower_arg(fn, "scales", scales, DType::u8,
                                 with_last(x.shape, xm.cols / formats::kMxfp8Block), x, "x");
  const auto* xp = static_cast<const float*>(xm.data);
  auto* pp = static_cast<std::uint8_t*>(pm.data);
  auto* sp = static_cast<std::uint8_t*>(sm.data);
  if (on_host(x)) return quantize_mxfp4(xp, xm.rows, xm.cols, pp, sp, rounding);
  formats::quantize_mxfp4_cuda(cuda_target(fn, "x", x, stream), xp, xm.rows, xm.cols, rounding, pp,
                               sp);
}

void dequantize_mxfp4(const TensorView& packed, const TensorView& scales, const TensorView& out,
                      Stream stream) {
  constexpr const char* fn = "dequantize_mxfp4";
  const Matrix pm = matrix_arg(fn, "packed", packed, DType::u8);
  const std::int64_t cols = pm.cols * 2;
  check_shape(fn, pm.rows, cols, formats::kMxfp8Block);
  check_pointer(fn, pm.data, "packed", pm.rows, cols);
  const Matrix sm =
      follower_arg(fn, "scales", scales, DType::u8,
                   with_last(packed.shape, cols / formats::kMxfp8Block), packed, "packed");
  const Matrix om =
      follower_arg(fn, "out", out, DType::f32, with_last(packed.shape, cols), packed, "packed");
  const auto* pp = static_cast<const std::uint8_t*>(pm.data);
  const auto* sp = static_cast<const std::uint8_t*>(sm.data);
  auto* op = static_cast<float*>(om.data);
  if (on_host(packed)) return dequantize_mxfp4(pp, sp, pm.rows, cols, op);
  formats::dequantize_mxfp4_cuda(cuda_target(fn, "packed", packed, stream), pp, sp, pm.rows, cols,
                                 op);
}

}  // namespace epmoe

// The codecs on CUDA memory (codec_device.cu, CUDA builds only): kernels that run codec.hpp's
// per-block functions, so the bytes are those of the host codec. The TensorView functions of
// formats.cpp check every argument first; these check only that the device can be used, then
// queue the kernels on the stream and return (no synchronisation, no allocation).
#pragma once

#include <cstdint>

#include "epmoe/config.hpp"
#include "epmoe/formats.hpp"

namespace epmoe::formats {

// Where a call runs, and what to name in its errors.
struct CudaTarget {
  const char* fn;   // "quantize_mxfp8", ...
  const char* arg;  // the argument whose device this is ("x", "elements", "packed")
  int device;       // CUDA device index
  void* stream;     // cudaStream_t
};

void quantize_mxfp8_cuda(const CudaTarget& target, const float* x, std::int64_t rows,
                         std::int64_t cols, ScaleRounding rounding, std::uint8_t* elements,
                         std::uint8_t* scales);
void dequantize_mxfp8_cuda(const CudaTarget& target, const std::uint8_t* elements,
                           const std::uint8_t* scales, std::int64_t rows, std::int64_t cols,
                           float* out);
// static_scale: the s_enc to use (and write to tensor_scales[0]); nullptr = computed per group.
void quantize_nvfp4_cuda(const CudaTarget& target, const float* x, std::int64_t rows,
                         std::int64_t cols, Nvfp4ScaleGroup group, const float* static_scale,
                         std::uint8_t* packed, std::uint8_t* scales, float* tensor_scales);
void dequantize_nvfp4_cuda(const CudaTarget& target, const std::uint8_t* packed,
                           const std::uint8_t* scales, const float* tensor_scales,
                           std::int64_t rows, std::int64_t cols, Nvfp4ScaleGroup group, float* out);

// fp8_block128 on `batch` matrices of rows x cols, stored one after the other (tile_128x128: each
// tiled on its own, its scales [ceil(rows/128), ceil(cols/128)] after the previous matrix's;
// row_1x128: scales [rows, ceil(cols/128)] per matrix).
void quantize_fp8_block128_cuda(const CudaTarget& target, const float* x, std::int64_t batch,
                                std::int64_t rows, std::int64_t cols, Fp8Blocks blocks,
                                std::uint8_t* elements, float* scales);
void dequantize_fp8_block128_cuda(const CudaTarget& target, const std::uint8_t* elements,
                                  const float* scales, std::int64_t batch, std::int64_t rows,
                                  std::int64_t cols, Fp8Blocks blocks, float* out);
void quantize_mxfp4_cuda(const CudaTarget& target, const float* x, std::int64_t rows,
                         std::int64_t cols, ScaleRounding rounding, std::uint8_t* packed,
                         std::uint8_t* scales);
void dequantize_mxfp4_cuda(const CudaTarget& target, const std::uint8_t* packed,
                           const std::uint8_t* scales, std::int64_t rows, std::int64_t cols,
                           float* out);

}  // namespace epmoe::formats

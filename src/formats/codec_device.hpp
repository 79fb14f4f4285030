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

}  // namespace epmoe::formats

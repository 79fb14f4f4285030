// A build without CUDA: the codecs on CUDA tensors say so at call time (as
// src/core/cuda_unavailable.cpp does for the CUDA executor). Host tensors are unaffected.
#include "formats/codec_device.hpp"

#if !defined(EPMOE_HAS_CUDA)
#include <string>

#include "epmoe/errors.hpp"

namespace epmoe::formats {
namespace {
[[noreturn]] void no_cuda(const CudaTarget& t) {
  throw Error(ErrorCode::unsupported,
              std::string(t.fn) + ": " + t.arg + " is on cuda:" + std::to_string(t.device) +
                  ", but epmoe was built without CUDA (nvcc was not found at "
                  "configure time, or -DEPMOE_ENABLE_CUDA=OFF): pass host arrays");
}
}  // namespace

void quantize_mxfp8_cuda(const CudaTarget& target, const float*, std::int64_t, std::int64_t,
                         ScaleRounding, std::uint8_t*, std::uint8_t*) {
  no_cuda(target);
}
void dequantize_mxfp8_cuda(const CudaTarget& target, const std::uint8_t*, const std::uint8_t*,
                           std::int64_t, std::int64_t, float*) {
  no_cuda(target);
}
void quantize_nvfp4_cuda(const CudaTarget& target, const float*, std::int64_t, std::int64_t,
                         Nvfp4ScaleGroup, const float*, std::uint8_t*, std::uint8_t*, float*) {
  no_cuda(target);
}
void dequantize_nvfp4_cuda(const CudaTarget& target, const std::uint8_t*, const std::uint8_t*,
                           const float*, std::int64_t, std::int64_t, Nvfp4ScaleGroup, float*) {
  no_cuda(target);
}
void quantize_fp8_block128_cuda(const CudaTarget& target, const float*, std::int64_t, std::int64_t,
                                std::int64_t, Fp8Blocks, std::uint8_t*, float*) {
  no_cuda(target);
}
void dequantize_fp8_block128_cuda(const CudaTarget& target, const std::uint8_t*, const float*,
                                  std::int64_t, std::int64_t, std::int64_t, Fp8Blocks, float*) {
  no_cuda(target);
}
void quantize_mxfp4_cuda(const CudaTarget& target, const float*, std::int64_t, std::int64_t,
                         ScaleRounding, std::uint8_t*, std::uint8_t*) {
  no_cuda(target);
}
void dequantize_mxfp4_cuda(const CudaTarget& target, const std::uint8_t*, const std::uint8_t*,
                           std::int64_t, std::int64_t, float*) {
  no_cuda(target);
}

}  // namespace epmoe::formats
#endif

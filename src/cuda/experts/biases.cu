#include <algorithm>
#include <cstdint>
#include <vector>

#include "cuda/cuda_check.hpp"
#include "cuda/experts/biases.hpp"
#include "formats/codec.hpp"

namespace epmoe::cuda::experts {
namespace {

__global__ void __launch_bounds__(256)
    widen_kernel(const void* src, DType dtype, std::int64_t n, float* out) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    out[i] = dtype == DType::f32
                 ? static_cast<const float*>(src)[i]
                 : formats::bf16_to_float(static_cast<const std::uint16_t*>(src)[i]);
}

// One bias tensor into a new fp32 device buffer (nullptr when not given).
float* upload(const TensorView& t, cudaStream_t stream) {
  if (!given(t)) return nullptr;
  const auto n = static_cast<std::size_t>(t.numel());
  float* out = nullptr;
  EPMOE_CUDA_CHECK(cudaMalloc(&out, n * sizeof(float)));
  if (t.device.kind == DeviceKind::cpu) {
    std::vector<float> host(n);
    for (std::size_t i = 0; i < n; ++i)
      host[i] = t.dtype == DType::f32 ? t.as<const float>()[i]
                                      : formats::bf16_to_float(t.as<const std::uint16_t>()[i]);
    EPMOE_CUDA_CHECK(
        cudaMemcpyAsync(out, host.data(), n * sizeof(float), cudaMemcpyHostToDevice, stream));
    EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream));  // `host` dies here
  } else if (n > 0) {
    const auto blocks = static_cast<unsigned>(std::min<std::size_t>((n + 255) / 256, 1024));
    widen_kernel<<<blocks, 256, 0, stream>>>(t.data, t.dtype, static_cast<std::int64_t>(n), out);
    EPMOE_CUDA_CHECK(cudaGetLastError());
  }
  return out;
}

}  // namespace

DeviceBiases::~DeviceBiases() {
  cudaFree(b13_);
  cudaFree(b2_);
}

void DeviceBiases::prepare(const ExpertWeights& local, cudaStream_t stream) {
  b13_ = upload(local.b13, stream);
  b2_ = upload(local.b2, stream);
  bytes_ = (given(local.b13) ? static_cast<std::size_t>(local.b13.numel()) : 0) +
           (given(local.b2) ? static_cast<std::size_t>(local.b2.numel()) : 0);
  bytes_ *= sizeof(float);
}

}  // namespace epmoe::cuda::experts

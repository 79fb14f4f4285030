// fp8_block128 expert weights as the E4M3 GEMM reads them (docs/design.md §4.1, §6): the E4M3
// codes in the caller's [expert][row][col] order (1 byte each) and one fp32 scale per 128 x 128
// tile, [expert][row tile][col tile] (DeepSeek-V3's weight_scale_inv layout, K-major blocks).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/experts/inputs.hpp"
#include "epmoe/layer.hpp"

namespace epmoe::cuda::experts::wgmma {

struct Fp8BlockWeights {
  std::uint8_t* w13;  // [E_local, 2I, H]
  std::uint8_t* w2;   // [E_local, H, I]
  float* w13_scale;   // [E_local, 2I / 128, H / 128]
  float* w2_scale;    // [E_local, H / 128, I / 128]
};

class DeviceFp8BlockWeights {
 public:
  explicit DeviceFp8BlockWeights(const ExpertProblem& problem);
  ~DeviceFp8BlockWeights();
  DeviceFp8BlockWeights(const DeviceFp8BlockWeights&) = delete;
  DeviceFp8BlockWeights& operator=(const DeviceFp8BlockWeights&) = delete;

  // This rank's experts (values through the weight quantization point, or pre-quantized codes
  // copied as they are), queued on `stream`.
  void prepare(const ExpertWeights& local, cudaStream_t stream);

  const Fp8BlockWeights& weights() const { return weights_; }
  std::size_t bytes() const { return bytes_; }

 private:
  ExpertProblem problem_;
  std::uint8_t* memory_ = nullptr;
  std::size_t bytes_ = 0;
  Fp8BlockWeights weights_{};
};

}  // namespace epmoe::cuda::experts::wgmma

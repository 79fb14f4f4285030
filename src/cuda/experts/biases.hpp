// The optional expert biases on the device (docs/design.md §4.1), shared by the backends: never
// quantized, held in fp32 (a bf16 bias widens exactly), added by FC1's epilogue before the
// activation and by FC2's before send_home.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "epmoe/layer.hpp"

namespace epmoe::cuda::experts {

// Device pointers for kernels; nullptr = no bias.
struct Biases {
  const float* b13;  // [E_local, 2I] gate biases then up biases
  const float* b2;   // [E_local, H]
};

// Owns the fp32 copies of one rank's biases.
class DeviceBiases {
 public:
  DeviceBiases() = default;
  ~DeviceBiases();
  DeviceBiases(const DeviceBiases&) = delete;
  DeviceBiases& operator=(const DeviceBiases&) = delete;

  // The given biases of `local` (validated; bf16 or f32, on the host or this GPU) into fp32 on
  // this GPU, queued on `stream`; a host tensor is widened on the host and copied synchronously.
  // Called once, from a backend's prepare().
  void prepare(const ExpertWeights& local, cudaStream_t stream);

  Biases biases() const { return Biases{b13_, b2_}; }
  std::size_t bytes() const { return bytes_; }

 private:
  float* b13_ = nullptr;
  float* b2_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace epmoe::cuda::experts

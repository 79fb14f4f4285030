// The exact backend (LayerOptions::expert_math = exact; docs/design.md §4.1): float64 sums of
// exact fp32 products on the CUDA cores (f64_tile.cuh), the oracle-grade path: with staged
// combine the layer is bit-exact against the reference. Weights are resident in the layer's
// precision (packed_weights.hpp; fp8_block128: fp8_block_weights.hpp), decoded in the tile.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "cuda/experts/backend.hpp"
#include "cuda/experts/exact/params.hpp"
#include "cuda/experts/fp8_block_weights.hpp"
#include "cuda/experts/packed_weights.hpp"

namespace epmoe::cuda::experts::exact {

class ExactBackend final : public ExpertBackend {
 public:
  // Empty, or why this backend cannot run `config` (naming the field).
  static std::string can_implement(const LayerConfig& config);

  ExactBackend(const LayerConfig& config, int device);
  ~ExactBackend() override;

  const char* name() const override { return "exact_f64"; }
  StagedRows staged_rows() const override { return StagedRows::fp32; }
  void prepare(const ExpertWeights& local, cudaStream_t stream) override;
  std::size_t weight_bytes() const override;
  std::size_t scratch_bytes() const override { return scratch_bytes_; }
  // FC1 + SwiGLU, then FC2's input quantization point.
  void launch_fc1(const ExpertStep& step, TokenBucket bucket, cudaStream_t stream) const override;
  void launch_fc2(const ExpertStep& step, TokenBucket bucket, cudaStream_t stream) const override;

  // The prepared w13 / w2 decoded on the host from a copy of the device bytes, [E_local, rows,
  // cols] in fp32: for tests against the reference's values.
  std::vector<float> decoded_w13_on_host() const;
  std::vector<float> decoded_w2_on_host() const;

 private:
  Params params(const ExpertStep& step) const;

  ExpertProblem problem_;
  // One of the two, by precision.
  std::unique_ptr<DevicePackedWeights> packed_;
  std::unique_ptr<DeviceFp8BlockWeights> fp8_;
  std::uint8_t* scratch_memory_ = nullptr;
  std::size_t scratch_bytes_ = 0;
  DeviceBiases biases_;
  float* h_ = nullptr;
  // Fixed tiles and pipeline (block_m / block_n are not read); grids per bucket from num_sms.
  struct Shapes {
    KernelShape fc1, quantize_h, fc2;
  };
  PerBucket<Shapes> shapes_{};
};

}  // namespace epmoe::cuda::experts::exact

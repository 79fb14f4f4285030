// The exact backend (LayerOptions::expert_math = exact; docs/design.md §4.1): float64 sums of
// exact fp32 products on the CUDA cores (f64_tile.cuh), the oracle-grade path: with staged
// combine the layer is bit-exact against the reference. Weights are held as fp32
// decode(encode(w)), 4 bytes each whatever the precision.
#pragma once

#include <string>

#include "cuda/experts/backend.hpp"
#include "cuda/experts/exact/params.hpp"

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
  std::size_t weight_bytes() const override { return weight_bytes_ + biases_.bytes(); }
  std::size_t scratch_bytes() const override { return scratch_bytes_; }
  // FC1 + SwiGLU, then FC2's input quantization point.
  void launch_fc1(const ExpertStep& step, TokenBucket bucket, cudaStream_t stream) const override;
  void launch_fc2(const ExpertStep& step, TokenBucket bucket, cudaStream_t stream) const override;

  // The prepared weights (device pointers), for tests that compare them with the host's.
  const Weights& weights() const { return weights_; }

 private:
  Params params(const ExpertStep& step) const {
    return Params{step, problem_, weights_, biases_.biases(), h_};
  }

  ExpertProblem problem_;
  std::uint8_t* weight_memory_ = nullptr;
  std::uint8_t* scratch_memory_ = nullptr;
  std::size_t weight_bytes_ = 0, scratch_bytes_ = 0;
  Weights weights_{};
  DeviceBiases biases_;
  float* h_ = nullptr;
  // Fixed tiles (block_m / block_n / stages are not read); grids per bucket from num_sms.
  struct Shapes {
    KernelShape fc1, quantize_h, fc2;
  };
  PerBucket<Shapes> shapes_{};
};

}  // namespace epmoe::cuda::experts::exact

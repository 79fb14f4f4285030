// The bf16 tensor-core backend (LayerOptions::expert_math = tensor_core; docs/design.md §4.1):
// bf16 mma.sync with fp32 accumulation (bf16_mma_tile.cuh) on exact bf16 codes of the rows and of
// the weights, agreeing with the reference to accumulation-order noise. Weights are held in the
// layer's precision (packed_weights.hpp: bf16 2 bytes, MXFP8 1 byte, MXFP4 / NVFP4 half a byte,
// plus their scales) and decoded exactly to bf16 inside the tiles; every precision but
// fp8_block128, whose block scales are not exact in bf16 (can_implement rejects it).
#pragma once

#include <string>
#include <vector>

#include "cuda/experts/backend.hpp"
#include "cuda/experts/mma/params.hpp"

namespace epmoe::cuda::experts::mma {

class MmaBackend final : public ExpertBackend {
 public:
  // Empty, or why this backend cannot run `config` (naming the field).
  static std::string can_implement(const LayerConfig& config);

  MmaBackend(const LayerConfig& config, int device);
  ~MmaBackend() override;

  const char* name() const override { return "bf16_mma"; }
  StagedRows staged_rows() const override { return StagedRows::bf16_codes; }
  void prepare(const ExpertWeights& local, cudaStream_t stream) override;
  std::size_t weight_bytes() const override { return weights_.bytes() + biases_.bytes(); }
  std::size_t scratch_bytes() const override { return scratch_bytes_; }
  // FC1 + SwiGLU, then FC2's input quantization point and its bf16 codes.
  void launch_fc1(const ExpertStep& step, TokenBucket bucket, cudaStream_t stream) const override;
  void launch_fc2(const ExpertStep& step, TokenBucket bucket, cudaStream_t stream) const override;

  // The prepared weights (device pointers), for tests that compare them with the host's.
  const Weights& weights() const { return weights_.weights(); }
  std::vector<float> decoded_on_host(const PackedMatrices& m) const {
    return weights_.decoded_on_host(m);
  }

  // What its steps take for a round (its kernels', and the persistent round kernel's).
  const ExpertProblem& problem() const { return problem_; }
  Params params(const ExpertStep& step) const {
    return Params{step, problem_, weights_.weights(), biases_.biases(), h_,
                  h16_, h_scale_, split_sums_,        split_arrivals_,  split_slots_};
  }

 private:
  ExpertProblem problem_;
  DevicePackedWeights weights_;
  std::uint8_t* scratch_memory_ = nullptr;
  std::size_t scratch_bytes_ = 0;
  DeviceBiases biases_;
  float* h_ = nullptr;
  std::uint16_t* h16_ = nullptr;
  float* h_scale_ = nullptr;
  float* split_sums_ = nullptr;
  unsigned long long* split_arrivals_ = nullptr;
  std::uint32_t split_slots_ = 0;
  // Fixed tiles and pipeline (block_m / block_n are not read); grids per bucket from num_sms.
  struct Shapes {
    KernelShape fc1, quantize_h, fc2;
  };
  PerBucket<Shapes> shapes_{};
};

}  // namespace epmoe::cuda::experts::mma

#include "cuda/experts/mma/mma_backend.hpp"

#include "cuda/cuda_check.hpp"
#include "cuda/experts/mma/bf16_mma_tile.cuh"
#include "cuda/experts/weights.hpp"

namespace epmoe::cuda::experts::mma {
namespace {

// The resident weights (weights.hpp), in code order (`base` nullptr: sizes only).
ResidentWeights slice_weights(std::uint8_t* base, const ExpertProblem& e, std::size_t* bytes) {
  ScratchCursor cursor{base};
  const ResidentWeights w = slice_resident_weights(cursor, e);
  *bytes = cursor.used;
  return w;
}

struct Scratch {
  float* h;
  std::uint16_t* h16;
  float* h_scale;
};
Scratch slice_scratch(std::uint8_t* base, const ExpertProblem& e, std::size_t pairs,
                      std::size_t* bytes) {
  ScratchCursor cursor{base};
  Scratch s{};
  s.h = cursor.take<float>(pairs * static_cast<std::size_t>(e.intermediate));
  s.h16 = cursor.take<std::uint16_t>(pairs * static_cast<std::size_t>(e.intermediate));
  s.h_scale = cursor.take<float>(pairs);
  *bytes = cursor.used;
  return s;
}

}  // namespace

std::string MmaBackend::can_implement(const LayerConfig& config) {
  const LayerShape& s = config.shape();
  if (s.hidden % kSlabK != 0)
    return "hidden=" + std::to_string(s.hidden) + ": the mma tile takes K in slabs of " +
           std::to_string(kSlabK);
  if (s.intermediate % kSlabK != 0 || s.intermediate % (kCols / 2) != 0)
    return "intermediate=" + std::to_string(s.intermediate) +
           ": FC1 tiles take 64 intermediate columns and FC2 slabs of 64";
  return {};
}

MmaBackend::MmaBackend(const LayerConfig& config, int device) : problem_(expert_problem(config)) {
  slice_weights(nullptr, problem_, &weight_bytes_);
  slice_scratch(nullptr, problem_, max_pairs(config), &scratch_bytes_);
  EPMOE_CUDA_CHECK(cudaMalloc(&weight_memory_, weight_bytes_));
  EPMOE_CUDA_CHECK(cudaMalloc(&scratch_memory_, scratch_bytes_));
  weights_ = slice_weights(weight_memory_, problem_, &weight_bytes_);
  const Scratch s = slice_scratch(scratch_memory_, problem_, max_pairs(config), &scratch_bytes_);
  h_ = s.h;
  h16_ = s.h16;
  h_scale_ = s.h_scale;
  fc1_ = mma::fc1_shape(problem_.precision, device);
  quantize_h_ = mma::quantize_h_shape(problem_, device);
  fc2_ = mma::fc2_shape(problem_.precision, device);
}

MmaBackend::~MmaBackend() {
  cudaFree(weight_memory_);
  cudaFree(scratch_memory_);
}

void MmaBackend::prepare(const ExpertWeights& local, cudaStream_t stream) {
  prepare_resident_weights(local, weights_, problem_.rounding, stream);
}

void MmaBackend::launch_fc1(const ExpertStep& step, cudaStream_t stream) const {
  const Params p = params(step);
  mma::launch_fc1(p, fc1_, stream);
  mma::launch_quantize_h(p, quantize_h_, stream);
}

void MmaBackend::launch_fc2(const ExpertStep& step, cudaStream_t stream) const {
  mma::launch_fc2(params(step), fc2_, stream);
}

}  // namespace epmoe::cuda::experts::mma

#include "cuda/experts/mma/mma_backend.hpp"

#include "cuda/cuda_check.hpp"
#include "cuda/experts/fc2_input.cuh"
#include "cuda/experts/mma/bf16_mma_tile.cuh"

namespace epmoe::cuda::experts::mma {
namespace {

struct Scratch {
  float* h;
  std::uint16_t* h16;
  float* h_scale;
  float* split_sums;
  unsigned long long* split_arrivals;
};
Scratch slice_scratch(std::uint8_t* base, const ExpertProblem& e, std::size_t pairs,
                      std::size_t split_slots, std::size_t* bytes) {
  ScratchCursor cursor{base};
  Scratch s{};
  // fp32 h only where a quantize_h step reads it (NVFP4); the others' FC1 writes h16 itself.
  if (!fc1_epilogue_quantizes(e.precision))
    s.h = cursor.take<float>(pairs * static_cast<std::size_t>(e.intermediate));
  s.h16 = cursor.take<std::uint16_t>(pairs * static_cast<std::size_t>(e.intermediate));
  s.h_scale = cursor.take<float>(pairs);
  s.split_sums = cursor.take<float>(split_slots * kNarrowRows * kCols);
  s.split_arrivals = cursor.take<unsigned long long>(split_slots);
  *bytes = cursor.used;
  return s;
}

}  // namespace

std::string MmaBackend::can_implement(const LayerConfig& config) {
  const LayerShape& s = config.shape();
  // NOTES: the bf16 operands must be exact codes times one scale per matrix (or row). MXFP4's
  // e2m1 * 2^e and MXFP8's e4m3 * 2^e are bf16 values; fp8_block128's e4m3 * fp32 scale is not,
  // and its scale changes every 128 along K, so it needs the partial sums of each 128-run promoted
  // in fp32 with their scales: the wgmma backend's E4M3 GEMMs (docs/design.md §4.1).
  if (config.precision() == Precision::fp8_block128)
    return "precision=fp8_block128: its fp32 block scales are not exact in bf16 and change every "
           "128 along K; the bf16 tensor cores would need per-128 scale promotion. Use "
           "expert_math=wgmma (E4M3 GEMMs with the block scales) or exact";
  if (s.hidden % kSlabK != 0)
    return "hidden=" + std::to_string(s.hidden) + ": the mma tile takes K in slabs of " +
           std::to_string(kSlabK);
  if (s.intermediate % kSlabK != 0 || s.intermediate % (kCols / 2) != 0)
    return "intermediate=" + std::to_string(s.intermediate) +
           ": FC1 tiles take 64 intermediate columns and FC2 slabs of 64";
  return {};
}

MmaBackend::MmaBackend(const LayerConfig& config, int device)
    : problem_(expert_problem(config)), weights_(problem_) {
  shapes_ = per_bucket(config, [&](const Knobs& k) {
    return Shapes{fc1_shape(problem_, device, k.num_sms),
                  quantize_h_shape(problem_, device, k.num_sms),
                  fc2_shape(problem_, device, k.num_sms)};
  });
  // A decode round's split tiles (steps.cuh, for_each_item_part): a slot per CTA the device runs
  // at once (two per SM, all SMs whatever num_sms says, so the split never depends on a knob).
  split_slots_ = static_cast<std::uint32_t>(2 * grid_sms(device, 0));
  slice_scratch(nullptr, problem_, max_pairs(config), split_slots_, &scratch_bytes_);
  EPMOE_CUDA_CHECK(cudaMalloc(&scratch_memory_, scratch_bytes_));
  const Scratch s =
      slice_scratch(scratch_memory_, problem_, max_pairs(config), split_slots_, &scratch_bytes_);
  h_ = s.h;
  h16_ = s.h16;
  h_scale_ = s.h_scale;
  split_sums_ = s.split_sums;
  split_arrivals_ = s.split_arrivals;
  EPMOE_CUDA_CHECK(cudaMemset(split_arrivals_, 0, sizeof(unsigned long long) * split_slots_));
}

MmaBackend::~MmaBackend() {
  cudaFree(scratch_memory_);
}

void MmaBackend::prepare(const ExpertWeights& local, cudaStream_t stream) {
  weights_.prepare(local, stream);
  biases_.prepare(local, stream);
}

void MmaBackend::launch_fc1(const ExpertStep& step, TokenBucket bucket, cudaStream_t stream) const {
  const Shapes& s = shapes_[bucket_index(bucket)];
  const Params p = params(step);
  mma::launch_fc1(p, s.fc1, stream);
  // NVFP4's row scale needs the whole h row: a step of its own; the others' FC1 applies it.
  if (!fc1_epilogue_quantizes(problem_.precision)) mma::launch_quantize_h(p, s.quantize_h, stream);
}

void MmaBackend::launch_fc2(const ExpertStep& step, TokenBucket bucket, cudaStream_t stream) const {
  mma::launch_fc2(params(step), shapes_[bucket_index(bucket)].fc2, stream);
}

}  // namespace epmoe::cuda::experts::mma

#include "cuda/experts/exact/exact_backend.hpp"

#include "cuda/cuda_check.hpp"
#include "cuda/experts/exact/f64_tile.cuh"

namespace epmoe::cuda::experts::exact {
namespace {

// The scratch in code order (`base` nullptr: sizes only).
float* slice_scratch(std::uint8_t* base, const ExpertProblem& e, std::size_t pairs,
                     std::size_t* bytes) {
  ScratchCursor cursor{base};
  float* h = cursor.take<float>(pairs * static_cast<std::size_t>(e.intermediate));
  *bytes = cursor.used;
  return h;
}

}  // namespace

std::string ExactBackend::can_implement(const LayerConfig& config) {
  const LayerShape& s = config.shape();
  if (s.hidden % kSlabK != 0)
    return "hidden=" + std::to_string(s.hidden) + ": the f64 tile takes K in slabs of " +
           std::to_string(kSlabK);
  if (s.intermediate % (kTileCols / 2) != 0)
    return "intermediate=" + std::to_string(s.intermediate) +
           ": FC1 tiles take 64 intermediate columns and FC2 slabs of 64";
  return {};
}

ExactBackend::ExactBackend(const LayerConfig& config, int device)
    : problem_(expert_problem(config)) {
  if (packable(problem_.precision))
    packed_ = std::make_unique<DevicePackedWeights>(problem_);
  else
    fp8_ = std::make_unique<DeviceFp8BlockWeights>(problem_);
  slice_scratch(nullptr, problem_, max_pairs(config), &scratch_bytes_);
  EPMOE_CUDA_CHECK(cudaMalloc(&scratch_memory_, scratch_bytes_));
  h_ = slice_scratch(scratch_memory_, problem_, max_pairs(config), &scratch_bytes_);
  shapes_ = per_bucket(config, [&](const Knobs& k) {
    return Shapes{fc1_shape(problem_, device, k.num_sms),
                  quantize_h_shape(problem_, device, k.num_sms),
                  fc2_shape(problem_, device, k.num_sms)};
  });
}

ExactBackend::~ExactBackend() {
  cudaFree(scratch_memory_);
}

void ExactBackend::prepare(const ExpertWeights& local, cudaStream_t stream) {
  if (packed_)
    packed_->prepare(local, stream);
  else
    fp8_->prepare(local, stream);
  biases_.prepare(local, stream);
}

std::size_t ExactBackend::weight_bytes() const {
  return (packed_ ? packed_->bytes() : fp8_->bytes()) + biases_.bytes();
}

Params ExactBackend::params(const ExpertStep& step) const {
  Weights w{};
  if (packed_)
    w.packed = packed_->weights();
  else
    w.fp8 = fp8_->weights();
  return Params{step, problem_, w, biases_.biases(), h_};
}

std::vector<float> ExactBackend::decoded_w13_on_host() const {
  return packed_ ? packed_->decoded_on_host(packed_->weights().w13)
                 : fp8_->decoded_on_host(fp8_->weights().w13);
}

std::vector<float> ExactBackend::decoded_w2_on_host() const {
  return packed_ ? packed_->decoded_on_host(packed_->weights().w2)
                 : fp8_->decoded_on_host(fp8_->weights().w2);
}

void ExactBackend::launch_fc1(const ExpertStep& step, TokenBucket bucket,
                              cudaStream_t stream) const {
  const Shapes& s = shapes_[bucket_index(bucket)];
  const Params p = params(step);
  exact::launch_fc1(p, s.fc1, stream);
  exact::launch_quantize_h(p, s.quantize_h, stream);
}

void ExactBackend::launch_fc2(const ExpertStep& step, TokenBucket bucket,
                              cudaStream_t stream) const {
  exact::launch_fc2(params(step), shapes_[bucket_index(bucket)].fc2, stream);
}

}  // namespace epmoe::cuda::experts::exact

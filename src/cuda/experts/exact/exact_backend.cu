#include "cuda/experts/exact/exact_backend.hpp"

#include "cuda/cuda_check.hpp"
#include "cuda/experts/exact/f64_tile.cuh"
#include "cuda/experts/weights.cuh"

namespace epmoe::cuda::experts::exact {
namespace {

// Weights as values: decode(encode(w)) in fp32, in the caller's [expert][row][col] order.
struct StoreValues {
  float* out;
  std::int64_t matrix_size;
  __device__ void operator()(std::int64_t expert, std::int64_t at, const float (&v)[kWeightBlock],
                             float /*s_enc*/) const {
    auto* dst = reinterpret_cast<float4*>(out + expert * matrix_size + at);  // 128 B aligned
#pragma unroll
    for (int i = 0; i < kWeightBlock / 4; ++i)
      dst[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
  }
};

// Slices of the weight allocation and of the scratch, in code order (`base` nullptr: sizes only).
Weights slice_weights(std::uint8_t* base, const ExpertProblem& e, std::size_t* bytes) {
  const auto experts = static_cast<std::size_t>(e.local_experts);
  const auto matrix = static_cast<std::size_t>(e.hidden * e.intermediate);
  ScratchCursor cursor{base};
  Weights w{};
  w.w13 = cursor.take<float>(experts * 2 * matrix);
  w.w2 = cursor.take<float>(experts * matrix);
  *bytes = cursor.used;
  return w;
}
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
  slice_weights(nullptr, problem_, &weight_bytes_);
  slice_scratch(nullptr, problem_, max_pairs(config), &scratch_bytes_);
  EPMOE_CUDA_CHECK(cudaMalloc(&weight_memory_, weight_bytes_));
  EPMOE_CUDA_CHECK(cudaMalloc(&scratch_memory_, scratch_bytes_));
  weights_ = slice_weights(weight_memory_, problem_, &weight_bytes_);
  h_ = slice_scratch(scratch_memory_, problem_, max_pairs(config), &scratch_bytes_);
  shapes_ = per_bucket(config, [&](const Knobs& k) {
    return Shapes{fc1_shape(problem_, device, k.num_sms),
                  quantize_h_shape(problem_, device, k.num_sms), fc2_shape(device, k.num_sms)};
  });
}

ExactBackend::~ExactBackend() {
  cudaFree(weight_memory_);
  cudaFree(scratch_memory_);
}

void ExactBackend::prepare(const ExpertWeights& local, cudaStream_t stream) {
  const std::int64_t h = problem_.hidden, i = problem_.intermediate;
  prepare_fc_weights(local.w13, local.w13_quantized, 2 * i, h, problem_.precision,
                     problem_.rounding, StoreValues{weights_.w13, 2 * i * h}, stream);
  prepare_fc_weights(local.w2, local.w2_quantized, h, i, problem_.precision, problem_.rounding,
                     StoreValues{weights_.w2, h * i}, stream);
  biases_.prepare(local, stream);
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

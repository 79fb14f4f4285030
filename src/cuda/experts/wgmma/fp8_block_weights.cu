#include "cuda/experts/backend.hpp"  // ScratchCursor
#include "cuda/experts/weights.cuh"
#include "cuda/experts/wgmma/fp8_block_weights.hpp"

namespace epmoe::cuda::experts::wgmma {
namespace {

// A block of 32 codes and its tile's scale into the layout above (every block of a tile writes the
// same scale).
struct StoreFp8Codes {
  std::uint8_t* codes;
  float* scales;
  std::int64_t rows, cols;
  __device__ void fp8_block128(std::int64_t expert, std::int64_t at, const std::uint8_t* in,
                               float scale) const {
    std::uint8_t* dst = codes + expert * rows * cols + at;
    for (int i = 0; i < kWeightBlock; ++i) dst[i] = in[i];
    if (at % formats::kFp8Block128 == 0)
      scales[formats::fp8_block128_tile(rows, cols, expert, at)] = scale;
  }
  // Never called for fp8_block128 weights (the member above takes them).
  __device__ void operator()(std::int64_t, std::int64_t, const float (&)[kWeightBlock],
                             float) const {}
};

Fp8BlockWeights slice(std::uint8_t* base, const ExpertProblem& e, std::size_t* bytes) {
  const auto experts = static_cast<std::size_t>(e.local_experts);
  const auto h = static_cast<std::size_t>(e.hidden), i = static_cast<std::size_t>(e.intermediate);
  ScratchCursor cursor{base};
  Fp8BlockWeights w{};
  w.w13 = cursor.take<std::uint8_t>(experts * 2 * i * h);
  w.w2 = cursor.take<std::uint8_t>(experts * h * i);
  w.w13_scale =
      cursor.take<float>(experts * (2 * i / formats::kFp8Block128) * (h / formats::kFp8Block128));
  w.w2_scale =
      cursor.take<float>(experts * (h / formats::kFp8Block128) * (i / formats::kFp8Block128));
  *bytes = cursor.used;
  return w;
}

}  // namespace

DeviceFp8BlockWeights::DeviceFp8BlockWeights(const ExpertProblem& problem) : problem_(problem) {
  slice(nullptr, problem_, &bytes_);
  EPMOE_CUDA_CHECK(cudaMalloc(&memory_, bytes_));
  weights_ = slice(memory_, problem_, &bytes_);
}

DeviceFp8BlockWeights::~DeviceFp8BlockWeights() {
  cudaFree(memory_);
}

void DeviceFp8BlockWeights::prepare(const ExpertWeights& local, cudaStream_t stream) {
  const std::int64_t h = problem_.hidden, i = problem_.intermediate;
  prepare_fc_weights(local.w13, local.w13_quantized, 2 * i, h, problem_.precision,
                     problem_.rounding, StoreFp8Codes{weights_.w13, weights_.w13_scale, 2 * i, h},
                     stream);
  prepare_fc_weights(local.w2, local.w2_quantized, h, i, problem_.precision, problem_.rounding,
                     StoreFp8Codes{weights_.w2, weights_.w2_scale, h, i}, stream);
}

}  // namespace epmoe::cuda::experts::wgmma

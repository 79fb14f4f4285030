#include "cuda/experts/backend.hpp"  // ScratchCursor
#include "cuda/experts/bf16_code_weights.hpp"
#include "cuda/experts/weights.cuh"
#include "epmoe/errors.hpp"

namespace epmoe::cuda::experts {
namespace {

// Weights as bf16 values (a bf16 layer's quantization point: s_enc is 1). A NaN keeps its payload.
// `interleave_rows` = I moves w13's row r (gate rows, then up rows) to 2r (gate) or 2(r - I) + 1
// (up): GateUp::interleaved; 0 keeps the caller's order.
struct StoreCodes {
  std::uint16_t* out;
  std::int64_t matrix_size;
  std::int64_t cols = 0;             // of a matrix row (for interleave_rows)
  std::int64_t interleave_rows = 0;  // I, or 0
  __device__ void operator()(std::int64_t expert, std::int64_t at, const float (&v)[kWeightBlock],
                             float) const {
    if (interleave_rows != 0) {  // a block never straddles rows (cols % kWeightBlock == 0)
      const std::int64_t row = at / cols;
      const std::int64_t to = row < interleave_rows ? 2 * row : 2 * (row - interleave_rows) + 1;
      at = to * cols + at % cols;
    }
    std::uint16_t* dst = out + expert * matrix_size + at;
#pragma unroll
    for (int i = 0; i < kWeightBlock; ++i) dst[i] = formats::float_to_bf16(v[i]);
  }
};

Bf16CodeWeights slice(std::uint8_t* base, const ExpertProblem& e, std::size_t* bytes) {
  const auto experts = static_cast<std::size_t>(e.local_experts);
  const auto matrix = static_cast<std::size_t>(e.hidden * e.intermediate);
  ScratchCursor cursor{base};
  Bf16CodeWeights w{};
  w.w13 = cursor.take<std::uint16_t>(experts * 2 * matrix);
  w.w2 = cursor.take<std::uint16_t>(experts * matrix);
  *bytes = cursor.used;
  return w;
}

}  // namespace

DeviceBf16CodeWeights::DeviceBf16CodeWeights(const ExpertProblem& problem, GateUp order)
    : problem_(problem), order_(order), memory_([&](std::uint8_t* base, std::size_t* bytes) {
        return slice(base, problem_, bytes);
      }) {
  if (problem.precision != Precision::bf16)
    throw Error(ErrorCode::internal, std::string("DeviceBf16CodeWeights: precision=") +
                                         to_string(problem.precision) + ": bf16 layers only");
}

void DeviceBf16CodeWeights::prepare(const ExpertWeights& local, cudaStream_t stream) {
  const std::int64_t h = problem_.hidden, i = problem_.intermediate;
  const std::int64_t interleave = order_ == GateUp::interleaved ? i : 0;
  prepare_fc_weights(local.w13, local.w13_quantized, 2 * i, h, problem_.precision,
                     problem_.rounding, StoreCodes{weights().w13, 2 * i * h, h, interleave},
                     stream);
  prepare_fc_weights(local.w2, local.w2_quantized, h, i, problem_.precision, problem_.rounding,
                     StoreCodes{weights().w2, h * i, i}, stream);
}

}  // namespace epmoe::cuda::experts

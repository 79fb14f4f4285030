#include "cuda/experts/fp8_block_weights.hpp"

#include "cuda/experts/backend.hpp"  // ScratchCursor
#include "cuda/experts/weights.cuh"

namespace epmoe::cuda::experts {
namespace {

// A block of 32 codes and its tile's scale into the layout above (every block of a tile writes the
// same scale).
struct StoreFp8Codes {
  Fp8BlockMatrices m;
  __device__ void fp8_block128(std::int64_t expert, std::int64_t at, const std::uint8_t* in,
                               float scale) const {
    std::uint8_t* dst = m.codes + expert * m.rows * m.cols + at;
    for (int i = 0; i < kWeightBlock; ++i) dst[i] = in[i];
    if (at % formats::kFp8Block128 == 0)
      m.scales[formats::fp8_block128_tile(m.rows, m.cols, expert, at)] = scale;
  }
  // Never called for fp8_block128 weights (the member above takes them).
  __device__ void operator()(std::int64_t, std::int64_t, const float (&)[kWeightBlock],
                             float) const {}
};

Fp8BlockMatrices slice_matrices(ScratchCursor& cursor, std::int64_t experts, std::int64_t rows,
                                std::int64_t cols) {
  Fp8BlockMatrices m{nullptr, nullptr, rows, cols};
  m.codes = cursor.take<std::uint8_t>(static_cast<std::size_t>(experts * rows * cols));
  m.scales = cursor.take<float>(static_cast<std::size_t>(experts * fp8_block128_tiles(rows, cols)));
  return m;
}

Fp8BlockWeights slice(std::uint8_t* base, const ExpertProblem& e, std::size_t* bytes) {
  ScratchCursor cursor{base};
  Fp8BlockWeights w{};
  w.w13 = slice_matrices(cursor, e.local_experts, 2 * e.intermediate, e.hidden);
  w.w2 = slice_matrices(cursor, e.local_experts, e.hidden, e.intermediate);
  *bytes = cursor.used;
  return w;
}

}  // namespace

DeviceFp8BlockWeights::DeviceFp8BlockWeights(const ExpertProblem& problem)
    : problem_(problem), memory_([&](std::uint8_t* base, std::size_t* bytes) {
        return slice(base, problem_, bytes);
      }) {}

void DeviceFp8BlockWeights::prepare(const ExpertWeights& local, cudaStream_t stream) {
  const std::int64_t h = problem_.hidden, i = problem_.intermediate;
  prepare_fc_weights(local.w13, local.w13_quantized, 2 * i, h, problem_.precision,
                     problem_.rounding, StoreFp8Codes{weights().w13}, stream);
  prepare_fc_weights(local.w2, local.w2_quantized, h, i, problem_.precision, problem_.rounding,
                     StoreFp8Codes{weights().w2}, stream);
}

std::vector<float> DeviceFp8BlockWeights::decoded_on_host(const Fp8BlockMatrices& m) const {
  const std::int64_t experts = problem_.local_experts, per_matrix = m.rows * m.cols;
  const auto codes = to_host(m.codes, static_cast<std::size_t>(experts * per_matrix));
  const auto scales =
      to_host(m.scales, static_cast<std::size_t>(experts * fp8_block128_tiles(m.rows, m.cols)));
  std::vector<float> out(codes.size());
  for (std::int64_t e = 0; e < experts; ++e)
    for (std::int64_t at = 0; at < per_matrix; ++at)
      out[e * per_matrix + at] = formats::fp8_block128_decode_value(
          codes[e * per_matrix + at], scales[formats::fp8_block128_tile(m.rows, m.cols, e, at)]);
  return out;
}

}  // namespace epmoe::cuda::experts

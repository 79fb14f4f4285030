#include "cuda/experts/packed_weights.hpp"

#include <cmath>

#include "cuda/experts/backend.hpp"         // ScratchCursor
#include "cuda/experts/packed_weights.cuh"  // PackedFormat
#include "cuda/experts/weights.cuh"
#include "epmoe/errors.hpp"

namespace epmoe::cuda::experts {

bool packable(Precision precision) {
  return precision != Precision::fp8_block128;
}

// From the kernels' table (PackedFormat, packed_weights.cuh), so host and device never disagree.
std::int64_t packed_row_bytes(Precision precision, std::int64_t n) {
  if (!packable(precision)) return 0;
  return with_packed_precision(
      precision, [&](auto p) { return n * PackedFormat<decltype(p)::value>::kBits / 8; });
}

int packed_block(Precision precision) {
  if (!packable(precision)) return 0;
  return with_packed_precision(precision,
                               [](auto p) { return PackedFormat<decltype(p)::value>::kBlock; });
}

namespace {

// Writes one matrix's codes where StoresBlockCodes hands them, and bf16 weights (values already
// rounded to bf16 by the quantization point) as their bits.
struct StorePacked {
  std::uint8_t* codes;
  std::uint8_t* scales;
  float* divisor;
  float* multiplier;
  std::int64_t matrix_bytes, matrix_scales;  // per expert
  int bits, block;                           // per code; weights per block scale (0: none)

  __device__ void operator()(std::int64_t expert, std::int64_t at, const float (&v)[kWeightBlock],
                             float) const {
    auto* dst = reinterpret_cast<std::uint16_t*>(codes + expert * matrix_bytes) + at;
#pragma unroll
    for (int i = 0; i < kWeightBlock; ++i) dst[i] = formats::float_to_bf16(v[i]);
    if (at == 0) divisor[expert] = multiplier[expert] = 1.0f;
  }
  __device__ void block_codes(std::int64_t expert, std::int64_t at, const std::uint8_t* c,
                              const std::uint8_t* s, float div, float mul) const {
    std::uint8_t* dst = codes + expert * matrix_bytes + at * bits / 8;
    for (int i = 0; i < kWeightBlock * bits / 8; ++i) dst[i] = c[i];
    std::uint8_t* scale_dst = scales + expert * matrix_scales + at / block;
    for (int i = 0; i < kWeightBlock / block; ++i) scale_dst[i] = s[i];
    if (at == 0) {
      divisor[expert] = div;
      multiplier[expert] = mul;
    }
  }
};

int code_bits(Precision precision) {
  return static_cast<int>(packed_row_bytes(precision, 8));
}

PackedWeights slice(std::uint8_t* base, const ExpertProblem& e, std::size_t* bytes) {
  const auto experts = static_cast<std::size_t>(e.local_experts);
  const std::int64_t h = e.hidden, i = e.intermediate;
  const int block = packed_block(e.precision);
  ScratchCursor cursor{base};
  PackedWeights w{e.precision, PackedMatrices{}, PackedMatrices{}};
  w.w13.codes = cursor.take<std::uint8_t>(experts * 2 * i * packed_row_bytes(e.precision, h));
  w.w2.codes = cursor.take<std::uint8_t>(experts * h * packed_row_bytes(e.precision, i));
  if (block != 0) {
    w.w13.scales = cursor.take<std::uint8_t>(experts * 2 * i * h / block);
    w.w2.scales = cursor.take<std::uint8_t>(experts * h * i / block);
  }
  for (PackedMatrices* m : {&w.w13, &w.w2}) {
    m->divisor = cursor.take<float>(experts);
    m->multiplier = cursor.take<float>(experts);
  }
  w.w13.rows = 2 * i, w.w13.cols = h;
  w.w2.rows = h, w.w2.cols = i;
  *bytes = cursor.used;
  return w;
}

}  // namespace

namespace {
const ExpertProblem& packable_problem(const ExpertProblem& problem) {
  if (!packable(problem.precision))
    throw Error(ErrorCode::internal, "DevicePackedWeights: fp8_block128 is not packed this way");
  return problem;
}
}  // namespace

DevicePackedWeights::DevicePackedWeights(const ExpertProblem& problem)
    : problem_(packable_problem(problem)), memory_([&](std::uint8_t* base, std::size_t* bytes) {
        return slice(base, problem_, bytes);
      }) {}

void DevicePackedWeights::prepare(const ExpertWeights& local, cudaStream_t stream) {
  const std::int64_t h = problem_.hidden, i = problem_.intermediate;
  const Precision p = problem_.precision;
  const int bits = code_bits(p), block = packed_block(p);
  const auto store = [&](const PackedMatrices& m) {
    return StorePacked{m.codes,
                       m.scales,
                       m.divisor,
                       m.multiplier,
                       m.rows * packed_row_bytes(p, m.cols),
                       block == 0 ? 0 : m.rows * m.cols / block,
                       bits,
                       block == 0 ? kWeightBlock : block};
  };
  prepare_fc_weights(local.w13, local.w13_quantized, 2 * i, h, p, problem_.rounding,
                     store(weights().w13), stream);
  prepare_fc_weights(local.w2, local.w2_quantized, h, i, p, problem_.rounding, store(weights().w2),
                     stream);
}

std::vector<float> DevicePackedWeights::decoded_on_host(const PackedMatrices& m) const {
  using namespace formats;
  const Precision p = problem_.precision;
  const auto experts = static_cast<std::size_t>(problem_.local_experts);
  const auto per_matrix = static_cast<std::size_t>(m.rows * m.cols);
  const int block = packed_block(p);
  const auto codes =
      to_host(m.codes, experts * static_cast<std::size_t>(m.rows * packed_row_bytes(p, m.cols)));
  const auto scales = to_host(m.scales, block == 0 ? 0 : experts * per_matrix / block);
  const auto divisor = to_host(m.divisor, experts);
  const auto multiplier = to_host(m.multiplier, experts);
  std::vector<float> out(experts * per_matrix);
  for (std::size_t e = 0; e < experts; ++e)
    for (std::size_t k = 0; k < per_matrix; ++k) {
      const std::size_t i = e * per_matrix + k;
      float v = 0;
      switch (p) {
        case Precision::bf16:
          v = bf16_to_float(static_cast<std::uint16_t>(codes[2 * i] | codes[2 * i + 1] << 8));
          break;
        case Precision::mxfp8:
          v = mxfp8_decode_value(codes[i], scales[i / block]);
          break;
        case Precision::mxfp4:
          v = scales[i / block] == kE8m0Nan
                  ? quiet_nan()
                  : e2m1_to_float(e2m1_code_at(codes.data(), static_cast<std::int64_t>(i))) *
                        e8m0_to_float(scales[i / block]);
          break;
        case Precision::nvfp4:
          v = nvfp4_decode_value(e2m1_code_at(codes.data(), static_cast<std::int64_t>(i)),
                                 scales[i / block], divisor[e]);
          if (multiplier[e] != 1.0f) v *= multiplier[e];
          if (std::isnan(v)) v = quiet_nan();
          break;
        case Precision::fp8_block128:
          break;
      }
      out[i] = v;
    }
  return out;
}

}  // namespace epmoe::cuda::experts

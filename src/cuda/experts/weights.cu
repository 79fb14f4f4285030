#include "cuda/experts/weights.hpp"

#include <algorithm>

#include "cuda/cuda_check.hpp"
#include "formats/codec.hpp"

namespace epmoe::cuda::experts {
namespace {

constexpr int kThreads = 256;
constexpr int kPartsPerMatrix = 64;  // CTAs per matrix (grid.x); grid.y = matrices

__device__ inline std::uint32_t max_u32(std::uint32_t a, std::uint32_t b) {
  return a > b ? a : b;
}

__device__ inline float raw_value(const RawMatrices& raw, std::int64_t i) {
  return raw.dtype == DType::f32
             ? static_cast<const float*>(raw.data)[i]
             : formats::bf16_to_float(static_cast<const std::uint16_t*>(raw.data)[i]);
}

// CTA (part, e) takes a grid stride through matrix e; one atomicMax per warp.
__global__ void __launch_bounds__(kThreads)
    matrix_amax_kernel(RawMatrices raw, std::uint32_t* amax_bits) {
  const std::int64_t n = raw.rows * raw.cols;
  const std::int64_t e = blockIdx.y;
  std::uint32_t m = 0;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const std::uint32_t a = formats::float_bits(raw_value(raw, e * n + i)) & formats::kF32AbsMask;
    if (a < formats::kF32InfBits) m = max_u32(m, a);  // skips NaN and Inf, as the host does
  }
  for (int offset = 16; offset > 0; offset /= 2)
    m = max_u32(m, __shfl_xor_sync(0xffffffffu, m, offset));
  if ((threadIdx.x & 31) == 0 && m != 0) atomicMax(&amax_bits[e], m);
}

// One thread per run of 32 weights along a matrix row: the run's values (f32 as they are, bf16
// decoded first, as math::emulate_weight_matrix takes them) through encode_run into the resident
// layout; matrix e's NVFP4 s_enc from its amax. Expert `first_expert + e` of `out`.
template <Precision P>
__global__ void __launch_bounds__(kThreads)
    encode_runs_kernel(RawMatrices raw, std::int64_t first_expert, ResidentMatrices out,
                       ScaleRounding rounding, const std::uint32_t* amax_bits) {
  const std::int64_t per_matrix = raw.rows * raw.cols / kRun;
  const std::int64_t runs = raw.experts * per_matrix;
  for (std::int64_t b = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < runs;
       b += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t e = b / per_matrix;
    const std::int64_t row = (b % per_matrix) * kRun / raw.cols;
    const std::int64_t k = (b % per_matrix) * kRun % raw.cols;
    float v[kRun];
    for (int i = 0; i < kRun; ++i) v[i] = raw_value(raw, b * kRun + i);
    float s_enc = 1.0f;
    if constexpr (P == Precision::nvfp4) {
      s_enc = formats::nvfp4_tensor_scale(formats::bits_float(amax_bits[e]));
      if (row == 0 && k == 0) out.s_enc[first_expert + e] = s_enc;
    }
    encode_run<P>(v, rounding, s_enc, out.run(first_expert + e, row, k),
                  P == Precision::bf16 ? nullptr : out.run_scale(first_expert + e, row, k));
  }
}

template <Precision P>
void launch_encode_runs(const RawMatrices& raw, std::int64_t first, const ResidentMatrices& out,
                        ScaleRounding rounding, const std::uint32_t* amax_bits,
                        cudaStream_t stream) {
  const std::int64_t runs = raw.experts * raw.rows * raw.cols / kRun;
  const auto grid = static_cast<unsigned>(std::clamp<std::int64_t>((runs + 255) / 256, 1, 65536));
  encode_runs_kernel<P><<<grid, kThreads, 0, stream>>>(raw, first, out, rounding, amax_bits);
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

// One FC (`t`: [E_local, rows, cols]) into `out`.
void prepare_matrices(const TensorView& t, const ResidentMatrices& out, ScaleRounding rounding,
                      cudaStream_t stream) {
  std::uint32_t* amax_bits = nullptr;  // NVFP4: [E_local]
  if (out.precision == Precision::nvfp4) {
    EPMOE_CUDA_CHECK(
        cudaMalloc(&amax_bits, std::max<std::size_t>(1, t.dim(0)) * sizeof(std::uint32_t)));
    EPMOE_CUDA_CHECK(cudaMemsetAsync(
        amax_bits, 0, static_cast<std::size_t>(t.dim(0)) * sizeof(std::uint32_t), stream));
  }
  for_each_device_slice(t, stream, [&](const RawMatrices& raw, std::int64_t first) {
    switch (out.precision) {
      case Precision::bf16:
        launch_encode_runs<Precision::bf16>(raw, first, out, rounding, nullptr, stream);
        break;
      case Precision::mxfp8:
        launch_encode_runs<Precision::mxfp8>(raw, first, out, rounding, nullptr, stream);
        break;
      case Precision::nvfp4:
        launch_matrix_amax(raw, amax_bits + first, stream);
        launch_encode_runs<Precision::nvfp4>(raw, first, out, rounding, amax_bits + first, stream);
        break;
    }
  });
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (amax_bits != nullptr) EPMOE_CUDA_CHECK(cudaFree(amax_bits));
}

// The test decoders: one thread per run.
template <Precision P, bool Codes, class T>
__global__ void __launch_bounds__(kThreads) decode_runs_kernel(ResidentMatrices m, T* out) {
  const std::int64_t per_matrix = m.rows * m.cols / kRun;
  const std::int64_t runs = m.experts * per_matrix;
  for (std::int64_t b = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < runs;
       b += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t e = b / per_matrix;
    const std::int64_t row = (b % per_matrix) * kRun / m.cols;
    const std::int64_t k = (b % per_matrix) * kRun % m.cols;
    const std::uint8_t* scales = P == Precision::bf16 ? nullptr : m.run_scale(e, row, k);
    T v[kRun];
    if constexpr (Codes)
      decode_codes<P>(m.run(e, row, k), scales, m.matrix_s_enc(e), v);
    else
      decode_values<P>(m.run(e, row, k), scales, m.matrix_s_enc(e), v);
    for (int i = 0; i < kRun; ++i) out[b * kRun + i] = v[i];
  }
}

template <bool Codes, class T>
void launch_decode(const ResidentMatrices& m, T* out, cudaStream_t stream) {
  const std::int64_t runs = m.experts * m.rows * m.cols / kRun;
  if (runs == 0) return;
  const auto grid = static_cast<unsigned>(std::clamp<std::int64_t>((runs + 255) / 256, 1, 65536));
  switch (m.precision) {
    case Precision::bf16:
      decode_runs_kernel<Precision::bf16, Codes><<<grid, kThreads, 0, stream>>>(m, out);
      break;
    case Precision::mxfp8:
      decode_runs_kernel<Precision::mxfp8, Codes><<<grid, kThreads, 0, stream>>>(m, out);
      break;
    case Precision::nvfp4:
      decode_runs_kernel<Precision::nvfp4, Codes><<<grid, kThreads, 0, stream>>>(m, out);
      break;
  }
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void for_each_device_slice(const TensorView& t, cudaStream_t stream,
                           const std::function<void(const RawMatrices&, std::int64_t)>& fn) {
  const std::int64_t experts = t.dim(0), rows = t.dim(1), cols = t.dim(2);
  if (t.device.kind == DeviceKind::cuda) {
    fn(RawMatrices{t.data, t.dtype, experts, rows, cols}, 0);
    return;
  }
  const std::size_t expert_bytes = static_cast<std::size_t>(rows * cols) * dtype_bytes(t.dtype);
  const std::int64_t per_slice = std::clamp<std::int64_t>(
      static_cast<std::int64_t>(kStagingBytes / std::max<std::size_t>(expert_bytes, 1)), 1,
      std::max<std::int64_t>(experts, 1));
  void* staging = nullptr;
  EPMOE_CUDA_CHECK(cudaMalloc(&staging, std::max<std::size_t>(1, per_slice * expert_bytes)));
  for (std::int64_t first = 0; first < experts; first += per_slice) {
    const std::int64_t count = std::min(per_slice, experts - first);
    EPMOE_CUDA_CHECK(
        cudaMemcpyAsync(staging, static_cast<const std::uint8_t*>(t.data) + first * expert_bytes,
                        count * expert_bytes, cudaMemcpyHostToDevice, stream));
    fn(RawMatrices{staging, t.dtype, count, rows, cols}, first);
  }
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  EPMOE_CUDA_CHECK(cudaFree(staging));
}

void launch_matrix_amax(const RawMatrices& raw, std::uint32_t* amax_bits, cudaStream_t stream) {
  if (raw.experts == 0) return;
  const dim3 grid(kPartsPerMatrix, static_cast<unsigned>(raw.experts));
  matrix_amax_kernel<<<grid, kThreads, 0, stream>>>(raw, amax_bits);
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

ResidentWeights slice_resident_weights(ScratchCursor& cursor, const ExpertProblem& problem) {
  const auto take = [&](std::int64_t rows, std::int64_t cols) {
    ResidentMatrices m{nullptr, nullptr, nullptr,          problem.local_experts,
                       rows,    cols,    problem.precision};
    m.elements = cursor.take<std::uint8_t>(static_cast<std::size_t>(m.element_bytes()));
    if (problem.precision != Precision::bf16)
      m.scales = cursor.take<std::uint8_t>(static_cast<std::size_t>(m.scale_bytes()));
    if (problem.precision == Precision::nvfp4)
      m.s_enc = cursor.take<float>(static_cast<std::size_t>(problem.local_experts));
    return m;
  };
  ResidentWeights w{};
  w.w13 = take(2 * problem.intermediate, problem.hidden);
  w.w2 = take(problem.hidden, problem.intermediate);
  return w;
}

void prepare_resident_weights(const ExpertWeights& local, const ResidentWeights& out,
                              ScaleRounding rounding, cudaStream_t stream) {
  prepare_matrices(local.w13, out.w13, rounding, stream);
  prepare_matrices(local.w2, out.w2, rounding, stream);
}

void launch_decode_values(const ResidentMatrices& m, float* values, cudaStream_t stream) {
  launch_decode<false>(m, values, stream);
}
void launch_decode_codes(const ResidentMatrices& m, std::uint16_t* codes, cudaStream_t stream) {
  launch_decode<true>(m, codes, stream);
}

}  // namespace epmoe::cuda::experts

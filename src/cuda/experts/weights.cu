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

// CTA (part, e) takes a grid stride through matrix e; one atomicMax per warp.
__global__ void __launch_bounds__(kThreads)
    matrix_amax_kernel(RawMatrices raw, std::uint32_t* amax_bits) {
  const std::int64_t n = raw.rows * raw.cols;
  const std::int64_t e = blockIdx.y;
  std::uint32_t m = 0;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const float w =
        raw.dtype == DType::f32
            ? static_cast<const float*>(raw.data)[e * n + i]
            : formats::bf16_to_float(static_cast<const std::uint16_t*>(raw.data)[e * n + i]);
    const std::uint32_t a = formats::float_bits(w) & formats::kF32AbsMask;
    if (a < formats::kF32InfBits) m = max_u32(m, a);  // skips NaN and Inf, as the host does
  }
  for (int offset = 16; offset > 0; offset /= 2)
    m = max_u32(m, __shfl_xor_sync(0xffffffffu, m, offset));
  if ((threadIdx.x & 31) == 0 && m != 0) atomicMax(&amax_bits[e], m);
}

// CTA (tj, ti, e) reduces tile (ti, tj) of matrix e: 256 threads over its at most 128 x 128
// values, one atomicMax per warp (the tile's slot is shared by its 8 warps only).
__global__ void __launch_bounds__(kThreads)
    tile_amax_kernel(RawMatrices raw, std::uint32_t* amax_bits) {
  constexpr std::int64_t kB = formats::kFp8Block128;
  const std::int64_t tj = blockIdx.x, ti = blockIdx.y, e = blockIdx.z;
  const std::int64_t r0 = ti * kB, c0 = tj * kB;
  const std::int64_t rows = raw.rows - r0 < kB ? raw.rows - r0 : kB;
  const std::int64_t cols = raw.cols - c0 < kB ? raw.cols - c0 : kB;
  const std::int64_t base = e * raw.rows * raw.cols;
  std::uint32_t m = 0;
  for (std::int64_t i = threadIdx.x; i < rows * cols; i += blockDim.x) {
    const std::int64_t at = base + (r0 + i / cols) * raw.cols + c0 + i % cols;
    const float w = raw.dtype == DType::f32
                        ? static_cast<const float*>(raw.data)[at]
                        : formats::bf16_to_float(static_cast<const std::uint16_t*>(raw.data)[at]);
    m = max_u32(m, formats::float_bits(w) & formats::kF32AbsMask);  // NaN and Inf kept
  }
  for (int offset = 16; offset > 0; offset /= 2)
    m = max_u32(m, __shfl_xor_sync(0xffffffffu, m, offset));
  const std::int64_t tile = (e * gridDim.y + ti) * gridDim.x + tj;
  if ((threadIdx.x & 31) == 0 && m != 0) atomicMax(&amax_bits[tile], m);
}

}  // namespace

void for_each_expert_slice(const std::vector<const TensorView*>& tensors, cudaStream_t stream,
                           const SliceFn& fn) {
  const std::int64_t experts = tensors.front()->dim(0);
  // Per tensor: bytes of one expert, and its offset per staged expert (16-byte aligned regions).
  std::vector<std::size_t> expert_bytes, staged_offset;
  std::size_t staged_per_expert = 0;
  for (const TensorView* t : tensors) {
    const std::size_t bytes =
        experts == 0 ? 0 : static_cast<std::size_t>(t->numel() / experts) * dtype_bytes(t->dtype);
    expert_bytes.push_back(bytes);
    staged_offset.push_back(staged_per_expert);
    if (t->device.kind != DeviceKind::cuda) staged_per_expert += (bytes + 15) / 16 * 16;
  }
  std::vector<const void*> data(tensors.size());
  if (staged_per_expert == 0) {
    for (std::size_t i = 0; i < tensors.size(); ++i) data[i] = tensors[i]->data;
    fn(data, 0, experts);
    return;
  }
  const std::int64_t per_slice =
      std::clamp<std::int64_t>(static_cast<std::int64_t>(kStagingBytes / staged_per_expert), 1,
                               std::max<std::int64_t>(experts, 1));
  std::uint8_t* staging = nullptr;
  EPMOE_CUDA_CHECK(cudaMalloc(&staging, static_cast<std::size_t>(per_slice) * staged_per_expert));
  for (std::int64_t first = 0; first < experts; first += per_slice) {
    const std::int64_t count = std::min(per_slice, experts - first);
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const auto* src = static_cast<const std::uint8_t*>(tensors[i]->data) +
                        static_cast<std::size_t>(first) * expert_bytes[i];
      if (tensors[i]->device.kind == DeviceKind::cuda) {
        data[i] = src;
        continue;
      }
      std::uint8_t* dst = staging + static_cast<std::size_t>(per_slice) * staged_offset[i];
      EPMOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<std::size_t>(count) * expert_bytes[i],
                                       cudaMemcpyHostToDevice, stream));
      data[i] = dst;
    }
    fn(data, first, count);
  }
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  EPMOE_CUDA_CHECK(cudaFree(staging));
}

void for_each_device_slice(const TensorView& t, cudaStream_t stream,
                           const std::function<void(const RawMatrices&, std::int64_t)>& fn) {
  for_each_expert_slice(
      {&t}, stream,
      [&](const std::vector<const void*>& data, std::int64_t first, std::int64_t count) {
        fn(RawMatrices{data[0], t.dtype, count, t.dim(1), t.dim(2)}, first);
      });
}

void launch_matrix_amax(const RawMatrices& raw, std::uint32_t* amax_bits, cudaStream_t stream) {
  if (raw.experts == 0) return;
  const dim3 grid(kPartsPerMatrix, static_cast<unsigned>(raw.experts));
  matrix_amax_kernel<<<grid, kThreads, 0, stream>>>(raw, amax_bits);
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

std::int64_t fp8_block128_tiles(std::int64_t rows, std::int64_t cols) {
  return formats::fp8_block128_scale_count(rows) * formats::fp8_block128_scale_count(cols);
}

void launch_tile_amax(const RawMatrices& raw, std::uint32_t* amax_bits, cudaStream_t stream) {
  if (raw.experts == 0) return;
  const dim3 grid(static_cast<unsigned>(formats::fp8_block128_scale_count(raw.cols)),
                  static_cast<unsigned>(formats::fp8_block128_scale_count(raw.rows)),
                  static_cast<unsigned>(raw.experts));
  tile_amax_kernel<<<grid, kThreads, 0, stream>>>(raw, amax_bits);
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epmoe::cuda::experts

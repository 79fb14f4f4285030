// The codecs of include/epmoe/formats.hpp on CUDA memory: one thread per format block (32 values
// for MXFP8 and MXFP4, 16 for NVFP4, a 1 x 128 run for fp8_block128; one CTA per fp8_block128
// 128 x 128 weight tile) running codec.hpp's block function, so the bytes are exactly the host
// codec's (codec.hpp is exact bit manipulation and single IEEE fp32 operations; this file is built
// without fast math, so no FTZ and correctly rounded division). Everything is queued on the
// caller's stream: memsets and kernels only, so a CUDA graph can capture it.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "epmoe/errors.hpp"
#include "formats/codec.hpp"
#include "formats/codec_device.hpp"

namespace epmoe::formats {
namespace {

constexpr int kThreads = 256;
constexpr std::int64_t kMaxGrid = 4096;  // grid-stride loops beyond this

__device__ std::int64_t first_index() {
  return static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ std::int64_t grid_stride() {
  return static_cast<std::int64_t>(gridDim.x) * blockDim.x;
}
__device__ std::uint32_t max_u32(std::uint32_t a, std::uint32_t b) {
  return a > b ? a : b;
}
__device__ std::uint32_t warp_max(std::uint32_t m) {
  for (int offset = 16; offset > 0; offset /= 2)
    m = max_u32(m, __shfl_xor_sync(0xffffffffu, m, offset));
  return m;
}

__global__ void mxfp8_encode_kernel(const float* x, std::int64_t nblocks, ScaleRounding rounding,
                                    std::uint8_t* elements, std::uint8_t* scales) {
  for (std::int64_t b = first_index(); b < nblocks; b += grid_stride())
    mxfp8_encode_block(x + b * kMxfp8Block, kMxfp8Block, rounding, elements + b * kMxfp8Block,
                       scales + b);
}

__global__ void mxfp8_decode_kernel(const std::uint8_t* elements, const std::uint8_t* scales,
                                    std::int64_t nblocks, float* out) {
  for (std::int64_t b = first_index(); b < nblocks; b += grid_stride())
    mxfp8_decode_block(elements + b * kMxfp8Block, scales[b], kMxfp8Block, out + b * kMxfp8Block);
}

// The largest finite |x| of the whole matrix, as fp32 bits, atomically into *amax_bits (zeroed
// before). The max of the blocks' nvfp4_group_amax is the matrix's: the same bits as the host.
__global__ void nvfp4_tensor_amax_kernel(const float* x, std::int64_t nblocks,
                                         std::uint32_t* amax_bits) {
  std::uint32_t m = 0;
  for (std::int64_t b = first_index(); b < nblocks; b += grid_stride())
    m = max_u32(m, float_bits(nvfp4_group_amax(x + b * kNvfp4Block, kNvfp4Block)));
  m = warp_max(m);
  if ((threadIdx.x & 31) == 0 && m != 0) atomicMax(reinterpret_cast<unsigned*>(amax_bits), m);
}

// *scale holds the amax of nvfp4_tensor_amax_kernel (a finite float >= 0: its bits are the
// amax's); it becomes s_enc, or `fixed` when use_fixed (a static scale).
__global__ void nvfp4_tensor_scale_kernel(float* scale, bool use_fixed, float fixed) {
  *scale = use_fixed ? fixed : nvfp4_tensor_scale(*scale);
}

// One CTA per row (grid-stride over rows): tensor_scales[r] = s_enc of row r.
__global__ void nvfp4_row_scale_kernel(const float* x, std::int64_t rows, std::int64_t cols,
                                       float* tensor_scales) {
  __shared__ std::uint32_t warp_maxes[kThreads / 32];
  const std::int64_t blocks = cols / kNvfp4Block;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* row = x + r * cols;
    std::uint32_t m = 0;
    for (std::int64_t b = threadIdx.x; b < blocks; b += blockDim.x)
      m = max_u32(m, float_bits(nvfp4_group_amax(row + b * kNvfp4Block, kNvfp4Block)));
    m = warp_max(m);
    if ((threadIdx.x & 31) == 0) warp_maxes[threadIdx.x / 32] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
      std::uint32_t all = 0;
      for (unsigned w = 0; w < blockDim.x / 32; ++w) all = max_u32(all, warp_maxes[w]);
      tensor_scales[r] = nvfp4_tensor_scale(bits_float(all));
    }
    __syncthreads();
  }
}

// Block b belongs to row b / blocks_per_row, whose s_enc is tensor_scales[row * stride]
// (stride 0: one s_enc for the whole matrix).
__global__ void nvfp4_encode_kernel(const float* x, std::int64_t nblocks,
                                    std::int64_t blocks_per_row, const float* tensor_scales,
                                    std::int64_t stride, std::uint8_t* packed,
                                    std::uint8_t* scales) {
  for (std::int64_t b = first_index(); b < nblocks; b += grid_stride())
    nvfp4_encode_block(x + b * kNvfp4Block, kNvfp4Block, tensor_scales[b / blocks_per_row * stride],
                       packed + b * (kNvfp4Block / 2), scales + b);
}

__global__ void nvfp4_decode_kernel(const std::uint8_t* packed, const std::uint8_t* scales,
                                    std::int64_t nblocks, std::int64_t blocks_per_row,
                                    const float* tensor_scales, std::int64_t stride, float* out) {
  for (std::int64_t b = first_index(); b < nblocks; b += grid_stride())
    nvfp4_decode_block(packed + b * (kNvfp4Block / 2), scales[b],
                       tensor_scales[b / blocks_per_row * stride], kNvfp4Block,
                       out + b * kNvfp4Block);
}

// ---- fp8_block128 ----

// One CTA per 128 x 128 tile (grid-stride over the tiles of `batch` matrices): the tile's amax as
// the max of fp32 bits (order-free, so the host's bits), then every element against its scale.
__global__ void fp8_block128_tile_encode_kernel(const float* x, std::int64_t batch,
                                                std::int64_t rows, std::int64_t cols,
                                                std::uint8_t* elements, float* scales) {
  __shared__ std::uint32_t warp_maxes[kThreads / 32];
  const std::int64_t tile_rows = fp8_block128_scale_count(rows);
  const std::int64_t tile_cols = fp8_block128_scale_count(cols);
  const std::int64_t tiles = batch * tile_rows * tile_cols;
  for (std::int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const std::int64_t b = t / (tile_rows * tile_cols);
    const std::int64_t i = t / tile_cols % tile_rows, j = t % tile_cols;
    const std::int64_t origin = b * rows * cols + i * kFp8Block128 * cols + j * kFp8Block128;
    const std::int64_t n_rows = std::min<std::int64_t>(kFp8Block128, rows - i * kFp8Block128);
    const std::int64_t n_cols = std::min<std::int64_t>(kFp8Block128, cols - j * kFp8Block128);
    std::uint32_t m = 0;
    for (std::int64_t k = threadIdx.x; k < n_rows * n_cols; k += blockDim.x)
      m = max_u32(m, float_bits(x[origin + k / n_cols * cols + k % n_cols]) & kF32AbsMask);
    m = warp_max(m);
    if ((threadIdx.x & 31) == 0) warp_maxes[threadIdx.x / 32] = m;
    __syncthreads();
    std::uint32_t all = 0;
    for (unsigned w = 0; w < blockDim.x / 32; ++w) all = max_u32(all, warp_maxes[w]);
    const float scale = fp8_block128_scale(bits_float(all));
    if (threadIdx.x == 0) scales[t] = scale;
    for (std::int64_t k = threadIdx.x; k < n_rows * n_cols; k += blockDim.x) {
      const std::int64_t at = origin + k / n_cols * cols + k % n_cols;
      elements[at] = fp8_block128_encode_value(x[at], scale);
    }
    __syncthreads();  // warp_maxes is reused by the next tile
  }
}

// One thread per 1 x 128 run of a row (the last run of a row may be shorter).
__global__ void fp8_block128_row_encode_kernel(const float* x, std::int64_t rows, std::int64_t cols,
                                               std::uint8_t* elements, float* scales) {
  const std::int64_t per_row = fp8_block128_scale_count(cols);
  for (std::int64_t s = first_index(); s < rows * per_row; s += grid_stride()) {
    const std::int64_t at = s / per_row * cols + s % per_row * kFp8Block128;
    const int n =
        static_cast<int>(std::min<std::int64_t>(kFp8Block128, cols - s % per_row * kFp8Block128));
    fp8_block128_encode_block(x + at, n, elements + at, scales + s);
  }
}

// One thread per 1 x 128 run of a row of `batch` matrices; its scale is its own (row_1x128) or
// its tile's (tile_128x128: rows_per_scale 128).
__global__ void fp8_block128_decode_kernel(const std::uint8_t* elements, const float* scales,
                                           std::int64_t batch, std::int64_t rows, std::int64_t cols,
                                           std::int64_t rows_per_scale, float* out) {
  const std::int64_t per_row = fp8_block128_scale_count(cols);
  const std::int64_t scale_rows = (rows + rows_per_scale - 1) / rows_per_scale;
  for (std::int64_t s = first_index(); s < batch * rows * per_row; s += grid_stride()) {
    const std::int64_t r = s / per_row, j = s % per_row;  // r: row of the whole stack
    const std::int64_t scale = (r / rows * scale_rows + r % rows / rows_per_scale) * per_row + j;
    const std::int64_t at = r * cols + j * kFp8Block128;
    const int n = static_cast<int>(std::min<std::int64_t>(kFp8Block128, cols - j * kFp8Block128));
    fp8_block128_decode_block(elements + at, scales[scale], n, out + at);
  }
}

// ---- mxfp4: one thread per block of 32 ----

__global__ void mxfp4_encode_kernel(const float* x, std::int64_t nblocks, ScaleRounding rounding,
                                    std::uint8_t* packed, std::uint8_t* scales) {
  for (std::int64_t b = first_index(); b < nblocks; b += grid_stride())
    mxfp4_encode_block(x + b * kMxfp8Block, kMxfp8Block, rounding, packed + b * (kMxfp8Block / 2),
                       scales + b);
}

__global__ void mxfp4_decode_kernel(const std::uint8_t* packed, const std::uint8_t* scales,
                                    std::int64_t nblocks, float* out) {
  for (std::int64_t b = first_index(); b < nblocks; b += grid_stride())
    mxfp4_decode_block(packed + b * (kMxfp8Block / 2), scales[b], kMxfp8Block,
                       out + b * kMxfp8Block);
}

unsigned grid_for(std::int64_t work) {
  return static_cast<unsigned>(
      std::clamp<std::int64_t>((work + kThreads - 1) / kThreads, 1, kMaxGrid));
}

std::string cuda_message(cudaError_t e) {
  return std::string(cudaGetErrorString(e)) + " (" + cudaGetErrorName(e) + ")";
}

// Makes the target's device current for the scope (the caller's device is restored), once it is
// known to be usable; then every launch is checked.
class OnDevice {
 public:
  explicit OnDevice(const CudaTarget& t) : t_(t) {
    const std::string where =
        std::string(t.fn) + ": " + t.arg + " is on cuda:" + std::to_string(t.device);
    int count = 0;
    if (const cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
      (void)cudaGetLastError();
      throw Error(ErrorCode::unsupported,
                  where + ", but this process has no usable CUDA device: " + cuda_message(e));
    }
    if (t.device < 0 || t.device >= count)
      throw Error(ErrorCode::invalid_argument,
                  where + ", but this process sees " + std::to_string(count) + " CUDA device(s)");
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != t.device) check(cudaSetDevice(t.device), "cudaSetDevice");
  }
  ~OnDevice() {
    if (previous_ >= 0 && previous_ != t_.device) (void)cudaSetDevice(previous_);
  }
  OnDevice(const OnDevice&) = delete;
  OnDevice& operator=(const OnDevice&) = delete;

  cudaStream_t stream() const { return static_cast<cudaStream_t>(t_.stream); }

  void check(cudaError_t e, const char* what) const {
    if (e == cudaSuccess) return;
    (void)cudaGetLastError();
    throw Error(ErrorCode::internal, std::string(t_.fn) + ": " + what + " on cuda:" +
                                         std::to_string(t_.device) + " failed: " + cuda_message(e));
  }
  void launched(const char* kernel) const { check(cudaGetLastError(), kernel); }

 private:
  const CudaTarget& t_;
  int previous_ = -1;
};

}  // namespace

void quantize_mxfp8_cuda(const CudaTarget& target, const float* x, std::int64_t rows,
                         std::int64_t cols, ScaleRounding rounding, std::uint8_t* elements,
                         std::uint8_t* scales) {
  const OnDevice on(target);
  const std::int64_t nblocks = rows * (cols / kMxfp8Block);
  if (nblocks == 0) return;
  mxfp8_encode_kernel<<<grid_for(nblocks), kThreads, 0, on.stream()>>>(x, nblocks, rounding,
                                                                       elements, scales);
  on.launched("mxfp8_encode_kernel");
}

void dequantize_mxfp8_cuda(const CudaTarget& target, const std::uint8_t* elements,
                           const std::uint8_t* scales, std::int64_t rows, std::int64_t cols,
                           float* out) {
  const OnDevice on(target);
  const std::int64_t nblocks = rows * (cols / kMxfp8Block);
  if (nblocks == 0) return;
  mxfp8_decode_kernel<<<grid_for(nblocks), kThreads, 0, on.stream()>>>(elements, scales, nblocks,
                                                                       out);
  on.launched("mxfp8_decode_kernel");
}

void quantize_nvfp4_cuda(const CudaTarget& target, const float* x, std::int64_t rows,
                         std::int64_t cols, Nvfp4ScaleGroup group, const float* static_scale,
                         std::uint8_t* packed, std::uint8_t* scales, float* tensor_scales) {
  const OnDevice on(target);
  const std::int64_t blocks_per_row = cols / kNvfp4Block;
  const std::int64_t nblocks = rows * blocks_per_row;
  const bool per_row = group == Nvfp4ScaleGroup::per_row && static_scale == nullptr;
  if (per_row) {
    if (rows == 0) return;
    nvfp4_row_scale_kernel<<<static_cast<unsigned>(std::min(rows, kMaxGrid)), kThreads, 0,
                             on.stream()>>>(x, rows, cols, tensor_scales);
    on.launched("nvfp4_row_scale_kernel");
  } else {  // one s_enc: static, or from the amax of the whole matrix (1.0 when it is empty)
    if (static_scale == nullptr) {
      on.check(cudaMemsetAsync(tensor_scales, 0, sizeof(float), on.stream()), "cudaMemsetAsync");
      if (nblocks > 0) {
        nvfp4_tensor_amax_kernel<<<grid_for(nblocks), kThreads, 0, on.stream()>>>(
            x, nblocks, reinterpret_cast<std::uint32_t*>(tensor_scales));
        on.launched("nvfp4_tensor_amax_kernel");
      }
    }
    nvfp4_tensor_scale_kernel<<<1, 1, 0, on.stream()>>>(tensor_scales, static_scale != nullptr,
                                                        static_scale ? *static_scale : 0.0f);
    on.launched("nvfp4_tensor_scale_kernel");
  }
  if (nblocks == 0) return;
  nvfp4_encode_kernel<<<grid_for(nblocks), kThreads, 0, on.stream()>>>(
      x, nblocks, blocks_per_row, tensor_scales, per_row ? 1 : 0, packed, scales);
  on.launched("nvfp4_encode_kernel");
}

void dequantize_nvfp4_cuda(const CudaTarget& target, const std::uint8_t* packed,
                           const std::uint8_t* scales, const float* tensor_scales,
                           std::int64_t rows, std::int64_t cols, Nvfp4ScaleGroup group,
                           float* out) {
  const OnDevice on(target);
  const std::int64_t blocks_per_row = cols / kNvfp4Block;
  const std::int64_t nblocks = rows * blocks_per_row;
  if (nblocks == 0) return;
  nvfp4_decode_kernel<<<grid_for(nblocks), kThreads, 0, on.stream()>>>(
      packed, scales, nblocks, blocks_per_row, tensor_scales,
      group == Nvfp4ScaleGroup::per_row ? 1 : 0, out);
  on.launched("nvfp4_decode_kernel");
}

void quantize_fp8_block128_cuda(const CudaTarget& target, const float* x, std::int64_t batch,
                                std::int64_t rows, std::int64_t cols, Fp8Blocks blocks,
                                std::uint8_t* elements, float* scales) {
  const OnDevice on(target);
  if (batch * rows * cols == 0) return;
  if (blocks == Fp8Blocks::row_1x128) {
    const std::int64_t runs = batch * rows * fp8_block128_scale_count(cols);
    fp8_block128_row_encode_kernel<<<grid_for(runs), kThreads, 0, on.stream()>>>(
        x, batch * rows, cols, elements, scales);
    on.launched("fp8_block128_row_encode_kernel");
    return;
  }
  const std::int64_t tiles =
      batch * fp8_block128_scale_count(rows) * fp8_block128_scale_count(cols);
  fp8_block128_tile_encode_kernel<<<static_cast<unsigned>(std::min(tiles, kMaxGrid)), kThreads, 0,
                                    on.stream()>>>(x, batch, rows, cols, elements, scales);
  on.launched("fp8_block128_tile_encode_kernel");
}

void dequantize_fp8_block128_cuda(const CudaTarget& target, const std::uint8_t* elements,
                                  const float* scales, std::int64_t batch, std::int64_t rows,
                                  std::int64_t cols, Fp8Blocks blocks, float* out) {
  const OnDevice on(target);
  if (batch * rows * cols == 0) return;
  const std::int64_t runs = batch * rows * fp8_block128_scale_count(cols);
  fp8_block128_decode_kernel<<<grid_for(runs), kThreads, 0, on.stream()>>>(
      elements, scales, batch, rows, cols, blocks == Fp8Blocks::row_1x128 ? 1 : kFp8Block128, out);
  on.launched("fp8_block128_decode_kernel");
}

void quantize_mxfp4_cuda(const CudaTarget& target, const float* x, std::int64_t rows,
                         std::int64_t cols, ScaleRounding rounding, std::uint8_t* packed,
                         std::uint8_t* scales) {
  const OnDevice on(target);
  const std::int64_t nblocks = rows * (cols / kMxfp8Block);
  if (nblocks == 0) return;
  mxfp4_encode_kernel<<<grid_for(nblocks), kThreads, 0, on.stream()>>>(x, nblocks, rounding, packed,
                                                                       scales);
  on.launched("mxfp4_encode_kernel");
}

void dequantize_mxfp4_cuda(const CudaTarget& target, const std::uint8_t* packed,
                           const std::uint8_t* scales, std::int64_t rows, std::int64_t cols,
                           float* out) {
  const OnDevice on(target);
  const std::int64_t nblocks = rows * (cols / kMxfp8Block);
  if (nblocks == 0) return;
  mxfp4_decode_kernel<<<grid_for(nblocks), kThreads, 0, on.stream()>>>(packed, scales, nblocks,
                                                                       out);
  on.launched("mxfp4_decode_kernel");
}

}  // namespace epmoe::formats

// Weight preparation on the device, shared by the backends (docs/design.md §4.1, §6): the caller's
// tensors reach the GPU as they are (raw bf16 or f32 values, or codes and scales already in the
// layer's precision; a host tensor is copied up in slices of whole experts), then a backend's
// kernels turn them into its own layout. Nothing here runs on
// the host per weight, so creating a large layer costs the copy and a few kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "cuda/cuda_check.hpp"
#include "epmoe/tensor.hpp"

namespace epmoe::cuda::experts {

// Some experts' matrices of one FC, on this device, as the caller passed them: [experts, rows,
// cols] of bf16 or f32, contiguous; quantization blocks run along cols (the reduction dim).
struct RawMatrices {
  const void* data;
  DType dtype;
  std::int64_t experts, rows, cols;
};

// Calls fn(data, first, count) over slices of experts [first, first + count) of `tensors` (each
// [E_local, ...], validated, with the same E_local; data[i] is tensors[i]'s expert `first` on this
// device): once with the tensors themselves when all are on the GPU, else for slices of whole
// experts whose host tensors are copied up raw through one staging buffer (at most kStagingBytes
// unless one expert is larger). Everything is queued on `stream`, so a slice is copied after the
// previous slice's kernels; when it staged, it synchronises `stream` before freeing the buffer.
inline constexpr std::size_t kStagingBytes = std::size_t{512} << 20;
using SliceFn = std::function<void(const std::vector<const void*>& data, std::int64_t first,
                                   std::int64_t count)>;
void for_each_expert_slice(const std::vector<const TensorView*>& tensors, cudaStream_t stream,
                           const SliceFn& fn);

// The same over one FC's raw values `t` ([E_local, rows, cols], bf16 or f32): fn(raw, first).
void for_each_device_slice(const TensorView& t, cudaStream_t stream,
                           const std::function<void(const RawMatrices&, std::int64_t)>& fn);

// NVFP4's per-matrix reduction: amax_bits[e] (zeroed before) = the largest finite |w| of matrix e
// of `raw` as fp32 bits, exactly formats::nvfp4_group_amax of the whole matrix (max is
// order-free, and bits of non-negative floats order like the floats).
void launch_matrix_amax(const RawMatrices& raw, std::uint32_t* amax_bits, cudaStream_t stream);

// fp8_block128's per-tile reduction: amax_bits[e * tiles + ti * tile_cols + tj] (zeroed before) =
// the largest |w| as fp32 bits of the 128 x 128 tile (ti, tj) of matrix e of `raw`, NaN and Inf
// included (a NaN's bits are above Inf's, so the tile's scale becomes NaN, as the host's
// formats::fp8_block128_encode_tile gives), with tile_cols = ceil(cols / 128) and tiles =
// ceil(rows / 128) * tile_cols; edge tiles cover what is there. Order-free, so bit-exact.
std::int64_t fp8_block128_tiles(std::int64_t rows, std::int64_t cols);
void launch_tile_amax(const RawMatrices& raw, std::uint32_t* amax_bits, cudaStream_t stream);

// One device allocation holding a weight layout's slices, for the backends' weight holders:
// slice(base, &bytes) cuts them from `base` (nullptr: sizes only) and returns the layout; it is
// called once to size the allocation and once to cut it.
template <class Layout>
class DeviceSlices {
 public:
  template <class Slice>
  explicit DeviceSlices(Slice slice) {
    slice(nullptr, &bytes_);
    EPMOE_CUDA_CHECK(cudaMalloc(&memory_, bytes_));
    layout_ = slice(memory_, &bytes_);
  }
  ~DeviceSlices() { cudaFree(memory_); }
  DeviceSlices(const DeviceSlices&) = delete;
  DeviceSlices& operator=(const DeviceSlices&) = delete;

  const Layout& layout() const { return layout_; }
  std::size_t bytes() const { return bytes_; }

 private:
  std::uint8_t* memory_ = nullptr;
  std::size_t bytes_ = 0;
  Layout layout_{};
};

// n elements of device memory `p`, copied to the host (synchronous): the weight holders' decodes
// on the host, for tests against the reference's values.
template <class T>
std::vector<T> to_host(const T* p, std::size_t n) {
  std::vector<T> v(n);
  if (n > 0) EPMOE_CUDA_CHECK(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

}  // namespace epmoe::cuda::experts

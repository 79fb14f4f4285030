// fp8_block128 expert weights resident in their format (docs/design.md §4.1, §6): the E4M3 codes
// in the caller's [expert][row][col] order (1 byte each) and one fp32 scale per 128 x 128 tile,
// [expert][row tile][col tile] (DeepSeek-V3's weight_scale_inv layout, K-major blocks; a matrix
// whose rows or cols are not a multiple of 128 has partial edge tiles, each with its scale).
// Weight (e, r, k) = e4m3(code) * scale, one fp32 rounding, as formats::fp8_block128_decode_value.
// The wgmma backend's E4M3 GEMM and the exact backend's tile read them.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cuda/experts/inputs.hpp"
#include "cuda/experts/weights.hpp"  // DeviceSlices
#include "epmoe/layer.hpp"

namespace epmoe::cuda::experts {

// One FC's matrices of this rank's experts, [E_local, rows, cols] (cols = K), on the device.
struct Fp8BlockMatrices {
  std::uint8_t* codes;  // [E_local, rows, cols]
  float* scales;        // [E_local, ceil(rows / 128), ceil(cols / 128)]
  std::int64_t rows, cols;
};

struct Fp8BlockWeights {
  Fp8BlockMatrices w13, w2;  // w13's rows: gate rows, then up rows, as the caller gave them
};

class DeviceFp8BlockWeights {
 public:
  explicit DeviceFp8BlockWeights(const ExpertProblem& problem);

  // This rank's experts (values through the weight quantization point, or pre-quantized codes
  // copied as they are), queued on `stream`.
  void prepare(const ExpertWeights& local, cudaStream_t stream);

  const Fp8BlockWeights& weights() const { return memory_.layout(); }
  std::size_t bytes() const { return memory_.bytes(); }

  // Every weight of `m` (one of weights()'s) decoded on the host from a copy of the device bytes,
  // [E_local, rows, cols] in fp32: for tests against the reference's values.
  std::vector<float> decoded_on_host(const Fp8BlockMatrices& m) const;

 private:
  ExpertProblem problem_;
  DeviceSlices<Fp8BlockWeights> memory_;
};

}  // namespace epmoe::cuda::experts

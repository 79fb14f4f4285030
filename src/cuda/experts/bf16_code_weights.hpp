// Expert weights as exact bf16 codes and one fp32 scale per matrix (docs/design.md §4.1, §6): the
// form the bf16 tensor-core backends (mma, wgmma) read. value = code / scale, exact for every
// precision whose decoded weights are bf16 values times one scale per matrix (NVFP4's s_enc; 1
// for the others) — all but fp8_block128, whose fp32 block scales are not.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/experts/inputs.hpp"
#include "cuda/experts/weights.hpp"  // DeviceSlices
#include "epmoe/layer.hpp"

namespace epmoe::cuda::experts {

// The order of w13's 2I rows: the caller's (gate rows, then up rows), or interleaved (row 2j =
// gate j, row 2j + 1 = up j) for a GEMM whose epilogue applies the activation (wgmma's FC1).
enum class GateUp : std::uint8_t { stacked, interleaved };

// Device pointers for kernels, in the caller's [expert][row][col] order but for GateUp.
struct Bf16CodeWeights {
  std::uint16_t* w13;  // [E_local, 2I, H] gate rows then up rows, or interleaved (GateUp)
  std::uint16_t* w2;   // [E_local, H, I]
  float* w13_scale;    // [E_local]
  float* w2_scale;     // [E_local]
};

// Owns one rank's weights in that form.
class DeviceBf16CodeWeights {
 public:
  explicit DeviceBf16CodeWeights(const ExpertProblem& problem, GateUp order = GateUp::stacked);

  // This rank's experts (validated; bf16 or f32, host or this GPU) through the weight
  // quantization point of the layer's precision into bf16 codes, queued on `stream`.
  void prepare(const ExpertWeights& local, cudaStream_t stream);

  const Bf16CodeWeights& weights() const { return memory_.layout(); }
  std::size_t bytes() const { return memory_.bytes(); }

 private:
  ExpertProblem problem_;
  GateUp order_;
  DeviceSlices<Bf16CodeWeights> memory_;
};

}  // namespace epmoe::cuda::experts

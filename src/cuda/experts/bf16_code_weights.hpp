// A bf16 layer's expert weights as bf16 values for wgmma's CUTLASS GEMMs (docs/design.md §4.1, §6),
// w13 optionally with gate and up rows interleaved for the FC1 whose epilogue activates. (The
// other precisions stay packed, packed_weights.hpp, or as E4M3 tiles, fp8_block_weights.hpp.)
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
};

// Owns one rank's weights in that form.
class DeviceBf16CodeWeights {
 public:
  // `problem.precision` must be bf16.
  explicit DeviceBf16CodeWeights(const ExpertProblem& problem, GateUp order = GateUp::stacked);

  // This rank's experts (validated; bf16 or f32, host or this GPU) rounded to bf16, queued on
  // `stream`.
  void prepare(const ExpertWeights& local, cudaStream_t stream);

  const Bf16CodeWeights& weights() const { return memory_.layout(); }
  std::size_t bytes() const { return memory_.bytes(); }

 private:
  ExpertProblem problem_;
  GateUp order_;
  DeviceSlices<Bf16CodeWeights> memory_;
};

}  // namespace epmoe::cuda::experts

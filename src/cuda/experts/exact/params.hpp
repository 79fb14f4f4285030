// The exact backend (docs/design.md §4.1): what its kernels take, and their launchers.
#pragma once

#include <cuda_runtime.h>

#include "cuda/experts/biases.hpp"
#include "cuda/experts/fp8_block_weights.hpp"
#include "cuda/experts/inputs.hpp"
#include "cuda/experts/packed_weights.hpp"
#include "cuda/kernels.hpp"

namespace epmoe::cuda::experts::exact {

// Its prepared weights, resident in the layer's precision: packed (bf16, MXFP8, MXFP4, NVFP4;
// packed_weights.hpp) or fp8_block128's codes and tile scales (fp8_block_weights.hpp); the other is
// unused. The tile decodes them per slab (f64_tile.cuh).
struct Weights {
  PackedWeights packed;
  Fp8BlockWeights fp8;
};
// One FC's matrices of precision P: `fp8` for fp8_block128, else `packed` (w13's or w2's of both).
template <Precision P>
__host__ __device__ inline const auto& matrices(const PackedMatrices& packed,
                                                const Fp8BlockMatrices& fp8) {
  if constexpr (P == Precision::fp8_block128)
    return fp8;
  else
    return packed;
}

struct Params {
  ExpertStep step;
  ExpertProblem problem;
  Weights weights;
  Biases biases;  // fp32, never quantized; nullptr = none
  float* h;       // [max_pairs, I] SwiGLU output per pair, FC2's input quantization point in place
};

// FC1 + SwiGLU per (expert, chunk of rows, tile of 64 intermediate columns) -> h.
KernelShape fc1_shape(const ExpertProblem& problem, int device, int num_sms);
void launch_fc1(const Params& p, const KernelShape& s, cudaStream_t stream);

// FC2's input quantization point, one h row at a time, in place.
KernelShape quantize_h_shape(const ExpertProblem& problem, int device, int num_sms);
void launch_quantize_h(const Params& p, const KernelShape& s, cudaStream_t stream);

// FC2 per (expert, chunk, tile of 128 hidden columns), results home; the last CTA publishes done.
KernelShape fc2_shape(const ExpertProblem& problem, int device, int num_sms);
void launch_fc2(const Params& p, const KernelShape& s, cudaStream_t stream);

}  // namespace epmoe::cuda::experts::exact

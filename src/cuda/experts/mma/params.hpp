// The bf16 tensor-core backend (docs/design.md §4.1): what its kernels take, and their launchers.
#pragma once

#include <cuda_runtime.h>

#include "cuda/experts/biases.hpp"
#include "cuda/experts/inputs.hpp"
#include "cuda/experts/packed_weights.hpp"
#include "cuda/kernels.hpp"

namespace epmoe::cuda::experts::mma {

// Its prepared weights: resident in the layer's precision (packed_weights.hpp).
using Weights = PackedWeights;

struct Params {
  ExpertStep step;
  ExpertProblem problem;
  Weights weights;
  Biases biases;       // fp32, never quantized; nullptr = none
  float* h;            // [max_pairs, I] SwiGLU output per pair, quantized in place (NVFP4;
                       // nullptr where FC1's epilogue quantizes: fc1_epilogue_quantizes)
  std::uint16_t* h16;  // [max_pairs, I] FC2's operand: bf16(quantized h * h_scale), exact
  float* h_scale;      // [max_pairs]
  // A decode round's split tiles (bf16_mma_tile.cuh, SplitSums): each part's sums, and each item's
  // arrival word; split_slots of each (two per SM of the device).
  float* split_sums;                   // [split_slots][16][128]
  unsigned long long* split_arrivals;  // [split_slots]
  std::uint32_t split_slots;
};

// FC1 + SwiGLU per (expert, chunk of rows, tile of 64 intermediate columns) -> h.
KernelShape fc1_shape(const ExpertProblem& problem, int device, int num_sms);
void launch_fc1(const Params& p, const KernelShape& s, cudaStream_t stream);

// FC2's input quantization point, one h row at a time, in place, and its bf16 codes.
KernelShape quantize_h_shape(const ExpertProblem& problem, int device, int num_sms);
void launch_quantize_h(const Params& p, const KernelShape& s, cudaStream_t stream);

// FC2 per (expert, chunk, tile of 128 hidden columns), results home; the last CTA publishes done.
KernelShape fc2_shape(const ExpertProblem& problem, int device, int num_sms);
void launch_fc2(const Params& p, const KernelShape& s, cudaStream_t stream);

}  // namespace epmoe::cuda::experts::mma

// The exact backend (docs/design.md §4.1): what its kernels take, and their launchers.
#pragma once

#include <cuda_runtime.h>

#include "cuda/experts/biases.hpp"
#include "cuda/experts/inputs.hpp"
#include "cuda/kernels.hpp"

namespace epmoe::cuda::experts::exact {

// Its prepared weights: decode(encode(w)) of every matrix, in fp32 (docs/design.md §6).
struct Weights {
  float* w13;  // [E_local, 2I, H] gate rows then up rows
  float* w2;   // [E_local, H, I]
};

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
KernelShape fc2_shape(int device, int num_sms);
void launch_fc2(const Params& p, const KernelShape& s, cudaStream_t stream);

}  // namespace epmoe::cuda::experts::exact

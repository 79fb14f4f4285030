// The kernels of the expert step (DESIGN §3 steps 4-6), in launch order; launch_experts
// (kernels.hpp) runs them on one stream, so each kernel boundary is the grid barrier between two
// phases. Every kernel does nothing when this rank's round already failed.
#pragma once

#include <cuda_runtime.h>

#include "cuda/forward_params.hpp"
#include "cuda/kernels.hpp"

namespace epmoe::cuda {

// Wait for counts, check and decode every received row, count pairs per expert, offsets.
KernelShape route_shape(const ForwardParams& p, int device);
void launch_route(const ForwardParams& p, const KernelShape& s, cudaStream_t stream);

// The pair list, grouped by expert.
KernelShape bucket_shape(const ForwardParams& p, int device);
void launch_bucket(const ForwardParams& p, const KernelShape& s, cudaStream_t stream);

// FC1 (gate and up) and SwiGLU per (expert, chunk of rows, tile of intermediate columns) -> h.
KernelShape fc1_shape(const ForwardParams& p, int device);
void launch_fc1(const ForwardParams& p, const KernelShape& s, cudaStream_t stream);

// FC2's input quantization point, one h row at a time, in place.
KernelShape quantize_h_shape(const ForwardParams& p, int device);
void launch_quantize_h(const ForwardParams& p, const KernelShape& s, cudaStream_t stream);

// FC2 per (expert, chunk, tile of hidden columns), results home; the last CTA publishes done.
KernelShape fc2_shape(const ForwardParams& p, int device);
void launch_fc2(const ForwardParams& p, const KernelShape& s, cudaStream_t stream);

}  // namespace epmoe::cuda

// The round's own kernels of the expert step (docs/design.md §3 steps 4-5), in launch order before
// the backend's: launch_experts (kernels.hpp) runs them on one stream, so each kernel boundary is
// the grid barrier between two phases. Every kernel does nothing when this rank's round already
// failed.
#pragma once

#include <cuda_runtime.h>

#include "cuda/kernels.hpp"
#include "cuda/round_params.hpp"

namespace epmoe::cuda {

// Wait for counts, check and decode every received row (staged as the backend asked), count pairs
// per expert, offsets.
KernelShape route_shape(const RoundParams& p, int device, int num_sms);
void launch_route(const RoundParams& p, const KernelShape& s, cudaStream_t stream);

// The pair list, grouped by expert.
KernelShape bucket_shape(const RoundParams& p, int device, int num_sms);
void launch_bucket(const RoundParams& p, const KernelShape& s, cudaStream_t stream);

}  // namespace epmoe::cuda

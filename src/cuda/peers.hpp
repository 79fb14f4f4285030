// LSA base pointers of every rank's window, computed once at layer creation.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdint>

struct ncclDevComm;

namespace epmoe::cuda {

// bases: device array [world]; throws when a rank is outside this GPU's NVLink domain.
void compute_peer_windows(ncclWindow_t window, const ncclDevComm& dev_comm, std::uint8_t** bases,
                          int world, cudaStream_t stream);

}  // namespace epmoe::cuda

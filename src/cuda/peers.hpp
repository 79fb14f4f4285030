// LSA base pointers of every rank's window, computed once at layer creation.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdint>

namespace epmoe::cuda {

// The window base of every rank as this GPU addresses it (NCCL LSA pointers), into the device
// array `bases` [world]. No ncclDevComm is needed: the protocol brings its own bounded waits
// instead of NCCL's barriers. Throws when a rank is outside this GPU's NVLink domain.
void compute_peer_windows(ncclComm_t comm, ncclWindow_t window, int rank, int world,
                          std::uint8_t** bases, cudaStream_t stream);

}  // namespace epmoe::cuda

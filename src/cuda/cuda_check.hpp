// CUDA and NCCL calls on the host: any failure becomes an epmoe::Error naming the call.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <string>

#include "epmoe/errors.hpp"

namespace epmoe::cuda {

inline void check_cuda(cudaError_t status, const char* call, const char* file, int line) {
  if (status != cudaSuccess)
    throw Error(ErrorCode::internal, std::string(call) + " failed: " + cudaGetErrorString(status) +
                                         " (" + file + ":" + std::to_string(line) + ")");
}
inline void check_nccl(ncclResult_t status, const char* call, const char* file, int line) {
  if (status != ncclSuccess && status != ncclInProgress)
    throw Error(ErrorCode::internal, std::string(call) + " failed: " + ncclGetErrorString(status) +
                                         " (" + file + ":" + std::to_string(line) + ")");
}

}  // namespace epmoe::cuda

#define EPMOE_CUDA_CHECK(call) ::epmoe::cuda::check_cuda((call), #call, __FILE__, __LINE__)
#define EPMOE_NCCL_CHECK(call) ::epmoe::cuda::check_nccl((call), #call, __FILE__, __LINE__)

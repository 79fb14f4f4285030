#include "cuda/nccl_comm.hpp"

#include <cuda_runtime.h>

#include <cstring>

#include "cuda/cuda_check.hpp"

namespace epmoe {

namespace cuda {
NcclCommunicator::~NcclCommunicator() {
  if (peer_missing_.load()) abort();
  if (aborted_.load()) return;
  cudaSetDevice(device_);
  ncclCommFinalize(comm_);
  ncclCommDestroy(comm_);
}

void NcclCommunicator::abort() noexcept {
  if (aborted_.exchange(true)) return;
  cudaSetDevice(device_);
  ncclCommAbort(comm_);  // local: frees this rank's resources, windows included, without peers
}
}  // namespace cuda

UniqueId get_unique_id() {
  ncclUniqueId id;
  EPMOE_NCCL_CHECK(ncclGetUniqueId(&id));
  UniqueId out;
  static_assert(sizeof(id) == sizeof(out.bytes));
  std::memcpy(out.bytes.data(), &id, sizeof id);
  return out;
}

std::unique_ptr<Communicator> make_nccl_communicator(const UniqueId& id, int rank, int world,
                                                     int device) {
  if (world < 1 || rank < 0 || rank >= world)
    throw Error(ErrorCode::invalid_argument,
                "make_nccl_communicator: rank=" + std::to_string(rank) +
                    " world=" + std::to_string(world) + ": need 0 <= rank < world");
  const int devices = cuda_device_count();
  if (device < 0 || device >= devices)
    throw Error(ErrorCode::invalid_argument,
                "make_nccl_communicator: device=" + std::to_string(device) +
                    ": this process sees " + std::to_string(devices) + " GPU(s)");
  EPMOE_CUDA_CHECK(cudaSetDevice(device));
  ncclUniqueId nccl_id;
  std::memcpy(&nccl_id, id.bytes.data(), sizeof nccl_id);
  ncclComm_t comm;
  EPMOE_NCCL_CHECK(ncclCommInitRank(&comm, world, nccl_id, rank));
  return std::make_unique<cuda::NcclCommunicator>(comm, rank, world, device);
}

std::vector<std::unique_ptr<Communicator>> make_nccl_communicators(std::span<const int> devices) {
  const int visible = cuda_device_count();
  for (int d : devices)
    if (d < 0 || d >= visible)
      throw Error(ErrorCode::invalid_argument,
                  "make_nccl_communicators: device " + std::to_string(d) +
                      " does not exist (this process sees " + std::to_string(visible) + " GPU(s))");
  const int n = static_cast<int>(devices.size());
  std::vector<ncclComm_t> comms(devices.size());
  EPMOE_NCCL_CHECK(ncclCommInitAll(comms.data(), n, devices.data()));
  std::vector<std::unique_ptr<Communicator>> out;
  for (int r = 0; r < n; ++r)
    out.push_back(std::make_unique<cuda::NcclCommunicator>(comms[static_cast<std::size_t>(r)], r, n,
                                                           devices[static_cast<std::size_t>(r)]));
  return out;
}

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

}  // namespace epmoe

// A rank of the CUDA executor: one NCCL communicator bound to one GPU.
#pragma once

#include <nccl.h>

#include <atomic>

#include "epmoe/comm.hpp"

namespace epmoe::cuda {

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, int rank, int world, int device)
      : comm_(comm), rank_(rank), world_(world), device_(device) {}
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int world() const override { return world_; }
  Backend backend() const override { return Backend::cuda_nccl; }
  Device device() const override { return Device{DeviceKind::cuda, device_}; }
  void abort() noexcept override;
  ncclComm_t nccl() const { return comm_; }
  int cuda_device() const { return device_; }
  // A layer's reset() found a peer missing (it may be dead): destruction aborts instead of
  // finalizing, which would wait on that peer. A later successful reset() clears it.
  void set_peer_missing(bool missing) { peer_missing_.store(missing); }
  bool aborted() const { return aborted_.load(); }

 private:
  ncclComm_t comm_;
  int rank_, world_, device_;
  std::atomic<bool> peer_missing_{false};
  std::atomic<bool> aborted_{false};
};

}  // namespace epmoe::cuda

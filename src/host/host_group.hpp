// The CPU executor's "NCCL": a group of ranks whose symmetric windows are host memory every rank
// can read and write, exactly as LSA peers do on the GPU. Two kinds: ranks as threads of one
// process (windows are plain allocations), and ranks as processes of one machine (windows are
// POSIX shared memory; a killed rank process can be restarted and rejoin).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "epmoe/comm.hpp"

namespace epmoe {

// The windows of one layer as this rank sees them: every rank's base address. Released with the
// layer.
struct HostLayerWindows {
  virtual ~HostLayerWindows() = default;
  std::vector<std::byte*> windows;
  std::size_t bytes = 0;
  // This rank's window already existed: a restarted rank process rejoining live peers. Its
  // contents were kept (peers may be writing into it); reset() brings the rank back in step.
  bool rejoined = false;
};

class HostGroup {
 public:
  virtual ~HostGroup() = default;
  virtual int world() const = 0;

  // Collective: the k-th layer created on each rank joins the k-th set of windows, waiting at
  // most `timeout` (0 = forever) for the others. Throws Error(timeout) naming the ranks that did
  // not arrive, Error(peer_aborted) when another rank already gave up on this layer, or
  // Error(invalid_argument) when the ranks' configs differ.
  virtual std::shared_ptr<HostLayerWindows> join_layer(int rank, std::size_t window_bytes,
                                                       const std::string& describe,
                                                       std::chrono::milliseconds timeout) = 0;
};

// Ranks are threads of this process.
class ThreadHostGroup final : public HostGroup {
 public:
  explicit ThreadHostGroup(int world);
  int world() const override { return world_; }
  std::shared_ptr<HostLayerWindows> join_layer(int rank, std::size_t window_bytes,
                                               const std::string& describe,
                                               std::chrono::milliseconds timeout) override;

 private:
  struct Windows;
  int world_;
  std::mutex mutex_;
  std::condition_variable arrivals_;
  std::vector<std::uint64_t> layers_created_;  // per rank
  std::map<std::uint64_t, std::shared_ptr<Windows>> joining_;
};

// Layer creation fails on every rank, naming the first rank whose config differs from rank 0's.
void check_same_config(const std::vector<std::string>& describes);

class HostCommunicator : public Communicator {
 public:
  HostCommunicator(std::shared_ptr<HostGroup> group, int rank);
  int rank() const override { return rank_; }
  int world() const override { return group_->world(); }
  Backend backend() const override { return Backend::cpu_threads; }
  Device device() const override { return Device{}; }
  HostGroup& group() const { return *group_; }

 private:
  std::shared_ptr<HostGroup> group_;
  int rank_;
};

}  // namespace epmoe

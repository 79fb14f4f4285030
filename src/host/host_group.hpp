// The CPU executor's "NCCL": a group of ranks in one process. Each rank's symmetric window is a
// host allocation that every rank thread can read and write, exactly as LSA peers do on the GPU.
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

// A barrier whose wait gives up after a timeout (0 = never), so no collective can hang.
class TimedBarrier {
 public:
  explicit TimedBarrier(int parties) : parties_(parties) {}
  // True when all parties arrived; false on timeout (this arrival is then withdrawn).
  bool arrive_and_wait(std::chrono::milliseconds timeout);

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  int parties_;
  int arrived_ = 0;
  std::uint64_t generation_ = 0;
};

// The windows of one layer, one per rank, zeroed, 4 KiB aligned; freed when every rank's layer is.
struct HostLayerWindows {
  explicit HostLayerWindows(int world)
      : windows(static_cast<std::size_t>(world)),
        describes(static_cast<std::size_t>(world)),
        barrier(world) {}
  ~HostLayerWindows();
  std::vector<std::byte*> windows;
  std::vector<std::string> describes;
  std::size_t bytes = 0;
  TimedBarrier barrier;  // layer creation
};

class HostGroup {
 public:
  explicit HostGroup(int world);
  int world() const { return world_; }

  // Collective: the k-th layer created on each rank joins the k-th windows object. Throws
  // Error(timeout) naming the ranks that did not arrive, or Error(invalid_argument) when the ranks'
  // configs differ.
  std::shared_ptr<HostLayerWindows> join_layer(int rank, std::size_t window_bytes,
                                               const std::string& describe,
                                               std::chrono::milliseconds timeout);

 private:
  int world_;
  std::mutex mutex_;
  std::vector<std::uint64_t> layers_created_;  // per rank
  std::map<std::uint64_t, std::shared_ptr<HostLayerWindows>> joining_;
  std::map<std::uint64_t, int> arrived_;
};

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

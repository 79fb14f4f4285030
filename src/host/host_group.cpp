#include "host/host_group.hpp"

#include <cstdlib>
#include <cstring>

#include "epmoe/errors.hpp"
#include "protocol/workspace.hpp"

namespace epmoe {

bool TimedBarrier::arrive_and_wait(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  const std::uint64_t generation = generation_;
  if (++arrived_ == parties_) {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
    return true;
  }
  const auto released = [&] { return generation_ != generation; };
  if (timeout.count() == 0) {
    cv_.wait(lock, released);
    return true;
  }
  if (cv_.wait_for(lock, timeout, released)) return true;
  --arrived_;
  return false;
}

// One layer's windows, allocated by each rank thread; freed when every rank's layer is.
struct ThreadHostGroup::Windows : HostLayerWindows {
  explicit Windows(int world) : describes(static_cast<std::size_t>(world)), barrier(world) {
    windows.resize(static_cast<std::size_t>(world));
  }
  ~Windows() override {
    for (std::byte* w : windows) std::free(w);
  }
  std::vector<std::string> describes;
  TimedBarrier barrier;  // layer creation
};

ThreadHostGroup::ThreadHostGroup(int world)
    : world_(world), layers_created_(static_cast<std::size_t>(world)) {
  if (world < 1)
    throw Error(ErrorCode::invalid_argument,
                "make_host_group: world=" + std::to_string(world) + ": must be >= 1");
}

std::shared_ptr<HostLayerWindows> ThreadHostGroup::join_layer(int rank, std::size_t window_bytes,
                                                              const std::string& describe,
                                                              std::chrono::milliseconds timeout) {
  std::shared_ptr<Windows> slot;
  std::uint64_t index = 0;
  {
    std::lock_guard lock(mutex_);
    index = layers_created_[static_cast<std::size_t>(rank)]++;
    auto& entry = joining_[index];
    if (!entry) entry = std::make_shared<Windows>(world_);
    slot = entry;
    const std::size_t bytes = (window_bytes + protocol::kWindowAlignment - 1) /
                              protocol::kWindowAlignment * protocol::kWindowAlignment;
    auto* window = static_cast<std::byte*>(std::aligned_alloc(protocol::kWindowAlignment, bytes));
    if (window == nullptr)
      throw Error(ErrorCode::invalid_argument, "Layer: cannot allocate a " + std::to_string(bytes) +
                                                   "-byte window on rank " + std::to_string(rank));
    std::memset(window, 0, bytes);
    slot->windows[static_cast<std::size_t>(rank)] = window;
    slot->describes[static_cast<std::size_t>(rank)] = describe;
    slot->bytes = bytes;
    if (++arrived_[index] == world_) {
      joining_.erase(index);
      arrived_.erase(index);
    }
  }
  if (!slot->barrier.arrive_and_wait(timeout)) {
    std::string missing;
    {
      std::lock_guard lock(mutex_);
      for (std::size_t r = 0; r < slot->windows.size(); ++r)
        if (slot->windows[r] == nullptr)
          missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    }
    throw Error(ErrorCode::timeout, "Layer creation on rank " + std::to_string(rank) +
                                        ": rank(s) " + missing + " did not create layer #" +
                                        std::to_string(index) + " within " +
                                        std::to_string(timeout.count()) + " ms");
  }
  check_same_config(slot->describes);
  return slot;
}

HostCommunicator::HostCommunicator(std::shared_ptr<HostGroup> group, int rank)
    : group_(std::move(group)), rank_(rank) {
  if (!group_) throw Error(ErrorCode::invalid_argument, "make_host_communicator: group is null");
  if (rank < 0 || rank >= group_->world())
    throw Error(ErrorCode::invalid_argument,
                "make_host_communicator: rank=" + std::to_string(rank) + ": must be in [0, " +
                    std::to_string(group_->world()) + ")");
}

void check_same_config(const std::vector<std::string>& describes) {
  for (std::size_t r = 1; r < describes.size(); ++r)
    if (describes[r] != describes[0])
      throw Error(ErrorCode::invalid_argument,
                  "Layer creation: rank " + std::to_string(r) + " was given a different config " +
                      "than rank 0:\n  rank 0: " + describes[0] + "\n  rank " + std::to_string(r) +
                      ": " + describes[r]);
}

std::shared_ptr<HostGroup> make_host_group(int world) {
  return std::make_shared<ThreadHostGroup>(world);
}

std::unique_ptr<Communicator> make_host_communicator(std::shared_ptr<HostGroup> group, int rank) {
  return std::make_unique<HostCommunicator>(std::move(group), rank);
}

}  // namespace epmoe

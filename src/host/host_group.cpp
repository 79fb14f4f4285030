#include "host/host_group.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "epmoe/errors.hpp"
#include "protocol/workspace.hpp"

namespace epmoe {

// One layer's windows, allocated by each rank thread; freed when every rank's layer is. The
// creation meeting's state is guarded by the group's mutex.
struct ThreadHostGroup::Windows : HostLayerWindows {
  explicit Windows(int world) : describes(static_cast<std::size_t>(world)) {
    windows.resize(static_cast<std::size_t>(world));
  }
  ~Windows() override {
    for (std::byte* w : windows) std::free(w);
  }
  std::vector<std::string> describes;
  int arrived = 0;
  int quitter = -1;             // the first rank that gave up waiting for the others (-1: none)
  std::vector<int> gave_up_on;  // the ranks it waited for in vain
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
  const std::size_t bytes = (window_bytes + protocol::kWindowAlignment - 1) /
                            protocol::kWindowAlignment * protocol::kWindowAlignment;
  auto* window = static_cast<std::byte*>(std::aligned_alloc(protocol::kWindowAlignment, bytes));
  if (window == nullptr)
    throw Error(ErrorCode::invalid_argument, "Layer: cannot allocate a " + std::to_string(bytes) +
                                                 "-byte window on rank " + std::to_string(rank));
  std::memset(window, 0, bytes);

  std::unique_lock lock(mutex_);
  const std::uint64_t index = layers_created_[static_cast<std::size_t>(rank)]++;
  auto& entry = joining_[index];
  if (!entry) entry = std::make_shared<Windows>(world_);
  const std::shared_ptr<Windows> slot = entry;
  slot->windows[static_cast<std::size_t>(rank)] = window;
  slot->describes[static_cast<std::size_t>(rank)] = describe;
  slot->bytes = bytes;
  if (++slot->arrived == world_) joining_.erase(index);  // the last rank to come
  arrivals_.notify_all();

  const std::string on = "Layer creation on rank " + std::to_string(rank) + ": ";
  const std::string layer = "layer #" + std::to_string(index);
  const auto list = [](const std::vector<int>& ranks) {
    std::string s;
    for (int r : ranks) s += (s.empty() ? "" : ", ") + std::to_string(r);
    return s;
  };
  const auto missing = [&] {
    std::vector<int> m;
    for (std::size_t r = 0; r < slot->windows.size(); ++r)
      if (slot->windows[r] == nullptr) m.push_back(static_cast<int>(r));
    return m;
  };
  const auto settled = [&] { return slot->arrived == world_ || slot->quitter >= 0; };
  if (timeout.count() == 0) {
    arrivals_.wait(lock, settled);
  } else if (!arrivals_.wait_for(lock, timeout, settled)) {
    // Give up, and say so: a rank that comes later fails at once instead of waiting, and every
    // rank has then used up this layer's number, so their layer counts stay in step.
    slot->quitter = rank;
    slot->gave_up_on = missing();
    arrivals_.notify_all();
    throw Error(ErrorCode::timeout, on + "rank(s) " + list(slot->gave_up_on) + " did not create " +
                                        layer + " within " + std::to_string(timeout.count()) +
                                        " ms");
  }
  if (slot->quitter >= 0) {
    const std::string quitter = "rank " + std::to_string(slot->quitter);
    const std::vector<int>& waited_for = slot->gave_up_on;
    if (std::find(waited_for.begin(), waited_for.end(), rank) != waited_for.end())
      throw Error(ErrorCode::peer_aborted,
                  on + quitter + " gave up creating " + layer + " waiting " +
                      std::to_string(timeout.count()) + " ms for rank(s) " + list(waited_for) +
                      ", this one among them; every rank can create the layer again");
    // Another rank gave up first on the rank(s) this one misses too: the same timeout.
    const std::vector<int> m = missing();
    throw Error(ErrorCode::timeout, on + "rank(s) " + list(m.empty() ? waited_for : m) +
                                        " did not create " + layer + " within " +
                                        std::to_string(timeout.count()) + " ms (" + quitter +
                                        " gave up first)");
  }
  lock.unlock();
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

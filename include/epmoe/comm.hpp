// Communicators: who the ranks of an expert-parallel group are and how their windows are shared.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "epmoe/tensor.hpp"

namespace epmoe {

enum class Backend { cpu_threads, cuda_nccl };
const char* to_string(Backend b);

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world() const = 0;
  virtual Backend backend() const = 0;
  virtual Device device() const = 0;  // where this rank's tensors must live

  // Tear this communicator down without talking to its peers, for when a peer's process is gone.
  // Afterwards its layers and it can only be destroyed (in any order; each is local). On the CUDA
  // executor this is ncclCommAbort; destroying a communicator whose layer's reset() failed aborts
  // on its own, so a dead peer never makes teardown wait. Idempotent; a no-op on the CPU executor,
  // whose teardown is always local.
  virtual void abort() noexcept {}
};

// The CPU executor: `world` ranks in one process, each rank driven by its own thread, each rank's
// window a host allocation every rank can see. Runs the same protocol code as the CUDA kernels.
class HostGroup;
std::shared_ptr<HostGroup> make_host_group(int world);
std::unique_ptr<Communicator> make_host_communicator(std::shared_ptr<HostGroup> group, int rank);

// The CPU executor with ranks as processes of one machine: every rank process attaches with the
// same `name` and `world` and makes its communicator with make_host_communicator. Windows are
// POSIX shared memory. A rank process that died can be restarted: its successor attaches the same
// way, creates its layer (which finds the old window, which the survivors still map) and joins
// the survivors' reset(). remove_shared_memory_group() deletes what killed ranks left behind.
std::shared_ptr<HostGroup> attach_shared_memory_group(const std::string& name, int world);
void remove_shared_memory_group(const std::string& name, int world, int layers = 16);

// The CUDA executor: one rank per GPU over NCCL 2.28 (symmetric windows, LSA pointers). These
// throw Error(unsupported) in a build without CUDA.
//
// One process per GPU: rank 0 calls get_unique_id(), the engine broadcasts the 128 bytes, then
// every process calls make_nccl_communicator(id, rank, world, device).
//
// `timeout_ms` bounds every NCCL call of the communicator (0 = wait forever, at most
// kMaxTimeoutMs): its creation (a rank that never joins makes every other rank's creation throw
// Error(timeout) once it passes), the NCCL steps of each layer creation after the ranks met
// (window registration), and its teardown (ncclCommFinalize; on expiry the destructor aborts
// instead). A creation that times out or fails has aborted what it made: make a fresh unique id
// and create the communicator on every rank again. Layer creation waits for the other ranks for
// the layer's own LayerOptions::timeout_ms and names a rank that does not come
// (docs/errors.md, "Creating the layer").
//
// A rank process that died breaks its NCCL communicator for good: the survivors' forward() names
// it within the timeout and their reset() fails naming it. Recovery is a rebuild: every survivor
// destroys its layers and its communicator (which then aborts, see abort()), and the survivors and
// the restarted process make a new communicator from a fresh unique id and new layers.
struct UniqueId {
  std::array<char, 128> bytes{};
};
inline constexpr std::uint32_t kDefaultNcclTimeoutMs = 60'000;
UniqueId get_unique_id();
std::unique_ptr<Communicator> make_nccl_communicator(
    const UniqueId& id, int rank, int world, int device,
    std::uint32_t timeout_ms = kDefaultNcclTimeoutMs);
// One process driving several GPUs (tools, tests): rank i runs on devices[i]. Each rank's Layer
// must then be created and driven from its own host thread.
std::vector<std::unique_ptr<Communicator>> make_nccl_communicators(
    std::span<const int> devices, std::uint32_t timeout_ms = kDefaultNcclTimeoutMs);
// GPUs visible to this process (0 when the CUDA runtime or driver is missing).
int cuda_device_count();

}  // namespace epmoe

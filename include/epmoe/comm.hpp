// Communicators: who the ranks of an expert-parallel group are and how their windows are shared.
#pragma once

#include <memory>

namespace epmoe {

enum class Backend { cpu_threads, cuda_nccl };
const char* to_string(Backend b);

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world() const = 0;
  virtual Backend backend() const = 0;
};

// The CPU executor: `world` ranks in one process, each rank driven by its own thread, each rank's
// window a host allocation every rank can see. Runs the same protocol code as the CUDA kernels.
class HostGroup;
std::shared_ptr<HostGroup> make_host_group(int world);
std::unique_ptr<Communicator> make_host_communicator(std::shared_ptr<HostGroup> group, int rank);

}  // namespace epmoe

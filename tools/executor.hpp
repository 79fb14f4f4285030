// Which executor a tool runs on: `--executor auto|cpu|cuda`. auto = the GPUs when this build has
// the CUDA executor and there is one GPU per rank, else the CPU executor.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>

#include "epmoe/comm.hpp"
#include "epmoe/errors.hpp"

namespace epmoe::tools {

inline Backend choose_backend(const std::string& executor, int ranks) {
  if (executor != "auto" && executor != "cpu" && executor != "cuda")
    throw Error(ErrorCode::invalid_argument,
                "--executor=" + executor + ": must be auto, cpu or cuda");
  const int gpus = cuda_device_count();
  const bool on_gpus = executor == "cuda" || (executor == "auto" && gpus >= ranks);
  if (on_gpus && gpus < ranks)
    throw Error(ErrorCode::invalid_argument, "--executor=cuda --ranks=" + std::to_string(ranks) +
                                                 ": needs one GPU per rank, " +
                                                 std::to_string(gpus) + " visible");
  return on_gpus ? Backend::cuda_nccl : Backend::cpu_threads;
}

inline std::string describe_backend(Backend backend, int ranks) {
  if (backend == Backend::cuda_nccl)
    return "cuda (" + std::to_string(ranks) + (ranks == 1 ? " GPU" : " GPUs, one rank each") +
           "; NCCL symmetric windows)";
  return "cpu (" + std::to_string(ranks) + " rank threads" +
         (cuda_device_count() == 0 ? std::string("; no GPU visible") : std::string()) + ")";
}

// Host memory available now (MemAvailable), 0 when unknown: the CPU executor holds every expert
// in host memory, so the tools check before they allocate.
inline std::int64_t available_host_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key, unit;
  std::int64_t kb = 0;
  while (meminfo >> key >> kb >> unit)
    if (key == "MemAvailable:") return kb * 1024;
  return 0;
}

}  // namespace epmoe::tools

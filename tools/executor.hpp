// Which executor a tool runs on: `--executor auto|cpu|cuda`. auto = the GPUs when this build has
// the CUDA executor and there is one GPU per rank, else the CPU executor.
#pragma once

#include <cstdint>
#include <fstream>
#include <optional>
#include <string>

#include "epmoe/comm.hpp"
#include "epmoe/config.hpp"
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

// The expert math a tool checks outputs under (reference::check_output): the CPU executor computes
// exactly whatever `expert_math` asks (docs/tuning.md#expert-math), so its outputs are held to
// exact's rule (bit-exact with staged combine), not to the looser one of the math they name.
inline ExpertMath checked_math(Backend backend, ExpertMath asked) {
  return backend == Backend::cpu_threads ? ExpertMath::exact : asked;
}
inline LayerOptions checked_options(Backend backend, LayerOptions options) {
  options.expert_math = checked_math(backend, options.expert_math);
  return options;
}

// `--megakernel` (run, stress, bench): the rounds of every token bucket that has a persistent round
// (has_persistent_round: each one under --math tensor_core, the E4M3 tile's under wgmma) in one
// launch per forward (docs/design.md §4.3); a layer with no such bucket is refused (unsupported).
// The CPU executor runs no kernels, so the option is refused there before anything is built.
inline bool any_persistent_round(const LayerConfig& config) {
  for (int b = 0; b < kNumTokenBuckets; ++b)
    if (has_persistent_round(config, static_cast<TokenBucket>(b))) return true;
  return false;
}
inline LayerConfig with_megakernel_everywhere(const LayerConfig& config) {
  if (!any_persistent_round(config))
    throw Error(ErrorCode::unsupported,
                std::string("--megakernel: no token bucket of this layer has a persistent round "
                            "(expert_math=") +
                    to_string(config.options().expert_math) +
                    ", precision=" + to_string(config.precision()) +
                    "): use --math tensor_core, or --math wgmma with mxfp8 or mxfp4");
  LayerConfig out = config;
  for (int b = 0; b < kNumTokenBuckets; ++b) {
    const auto bucket = static_cast<TokenBucket>(b);
    if (!has_persistent_round(out, bucket)) continue;
    Knobs k = out.knobs(bucket);
    k.megakernel = true;
    out = with_knobs(out, k, bucket);
  }
  return out;
}
// `--token-back` (bench): `mode` asked of every token bucket, which with_knobs keeps where the
// bucket runs either mode (wgmma's E4M3 tile) and moves onto the bucket's one mode elsewhere.
inline LayerConfig with_token_back_everywhere(const LayerConfig& config, TokenBack mode) {
  LayerConfig out = config;
  for (int b = 0; b < kNumTokenBuckets; ++b) {
    const auto bucket = static_cast<TokenBucket>(b);
    Knobs k = out.knobs(bucket);
    k.token_back = mode;
    out = with_knobs(out, k, bucket);
  }
  return out;
}
// The tools' knob options on a layer's config: `--token-back` (when given), then `--megakernel`.
inline LayerConfig with_tool_knobs(const LayerConfig& config, std::optional<TokenBack> token_back,
                                   bool megakernel) {
  const LayerConfig asked = token_back ? with_token_back_everywhere(config, *token_back) : config;
  return megakernel ? with_megakernel_everywhere(asked) : asked;
}
inline void check_megakernel_backend(bool megakernel, Backend backend) {
  if (megakernel && backend != Backend::cuda_nccl)
    throw Error(ErrorCode::invalid_argument,
                "--megakernel: the persistent round is a CUDA kernel; the CPU executor runs none "
                "(pass --executor cuda on a GPU machine)");
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

// The subcommands of the `epmoe` tool.
#pragma once

#include <cstdint>
#include <string>

namespace epmoe::tools {

struct RunOptions {
  std::string model = "qwen3-30b-a3b";
  int ranks = 2;
  std::int64_t tokens = 8;   // per rank
  std::int64_t experts = 0;  // 0 = the model's; fewer experts fit the CPU executor's memory
  std::string precision = "bf16";
  std::string combine = "staged";
  std::string math = "wgmma";     // exact | tensor_core | wgmma (LayerOptions::expert_math)
  std::string executor = "auto";  // auto | cpu | cuda
  int rounds = 2;
  std::int64_t check_tokens = -1;  // per rank per round; -1 = auto (kAutoCheckMacs)
  std::uint64_t seed = 1;
  std::uint32_t timeout_ms = 10'000;
  bool megakernel = false;  // every round as the persistent round (CUDA executor)
};

// --check-tokens auto: all tokens while the reference of a rank's round costs at most this many
// multiply-adds (K x 3 x H x I per token; qwen3-30b-a3b's 64 tokens are 2.4 G), else as many as
// fit (deepseek-v3: 11). Each is done twice (emulated and float64), spread over the cores.
inline constexpr double kAutoCheckMacs = 4e9;

int run_command(const RunOptions& options);

}  // namespace epmoe::tools

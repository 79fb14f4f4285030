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
  std::string math = "exact";     // exact | tensor_core | wgmma (LayerOptions::expert_math)
  std::string executor = "auto";  // auto | cpu | cuda
  int rounds = 2;
  std::uint64_t seed = 1;
  std::uint32_t timeout_ms = 10'000;
};

int run_command(const RunOptions& options);

}  // namespace epmoe::tools

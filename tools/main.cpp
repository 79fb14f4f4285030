// epmoe: run a real model's MoE layer end to end (`run`), time it (`bench`), hammer it with idle
// ranks and faults (`stress`), pick its knobs by measurement (`tune`).
#include <CLI/CLI.hpp>

#include <cstdio>
#include <functional>

#include "commands.hpp"
#include "epmoe/errors.hpp"
#include "subcommands.hpp"

int main(int argc, char** argv) {
  CLI::App app{"epmoe: expert-parallel MoE layer"};
  app.require_subcommand(1);

  epmoe::tools::RunOptions run;
  CLI::App* run_cmd =
      app.add_subcommand("run", "run one MoE layer of a real model on every rank and check it");
  run_cmd
      ->add_option("--model", run.model,
                   "qwen3-30b-a3b | deepseek-v3 | gpt-oss-120b | mixtral-8x7b")
      ->capture_default_str();
  run_cmd->add_option("--ranks", run.ranks, "expert-parallel ranks")->capture_default_str();
  run_cmd->add_option("--tokens", run.tokens, "tokens per rank per round")->capture_default_str();
  run_cmd
      ->add_option("--experts", run.experts,
                   "override the number of experts (0 = the model's); the CPU executor holds "
                   "every expert in host memory")
      ->capture_default_str();
  run_cmd->add_option("--precision", run.precision, "bf16 | mxfp8 | nvfp4 | fp8_block128 | mxfp4")
      ->capture_default_str();
  run_cmd->add_option("--combine", run.combine, "staged | in_kernel_reduce")->capture_default_str();
  run_cmd
      ->add_option(
          "--math", run.math,
          "expert math: exact | tensor_core | wgmma (tensor_core: bf16 mma.sync, fp32 "
          "accumulation; wgmma: Hopper TMA + WGMMA grouped GEMMs, bf16 operands or E4M3 for "
          "fp8_block128; CUDA executor only, the CPU executor always computes exactly)")
      ->capture_default_str();
  run_cmd->add_flag("--megakernel", run.megakernel,
                    "every round of a bucket that has one as the persistent round, one launch per "
                    "forward (CUDA executor; --math tensor_core, or wgmma's mxfp8 / mxfp4 E4M3 "
                    "tile; docs/design.md 4.3)");
  run_cmd->add_option("--executor", run.executor, "auto | cpu | cuda")->capture_default_str();
  run_cmd->add_option("--rounds", run.rounds, "rounds to run (each checked)")
      ->capture_default_str();
  run_cmd
      ->add_option("--check-tokens", run.check_tokens,
                   "tokens per rank per round checked against the references (the first N); -1 = "
                   "all while that stays quick on the host (<= 4 G multiply-adds per rank per "
                   "round), else as many as fit (deepseek-v3: 11)")
      ->capture_default_str();
  run_cmd->add_option("--seed", run.seed, "seed of weights, inputs and routing")
      ->capture_default_str();
  run_cmd->add_option("--timeout-ms", run.timeout_ms, "bounded-wait timeout, 0 = forever")
      ->capture_default_str();

  const epmoe::tools::Subcommand stress = epmoe::tools::add_stress_command(app);
  const epmoe::tools::Subcommand bench = epmoe::tools::add_bench_command(app);
  const epmoe::tools::Subcommand tune = epmoe::tools::add_tune_command(app, argc, argv);

  CLI11_PARSE(app, argc, argv);
  try {
    if (run_cmd->parsed()) return epmoe::tools::run_command(run);
    if (stress.app->parsed()) return stress.run();
    if (bench.app->parsed()) return bench.run();
    if (tune.app->parsed()) return tune.run();
  } catch (const epmoe::Error& e) {
    std::fprintf(stderr, "epmoe: error (%s): %s\n", epmoe::to_string(e.code()), e.what());
    return 2;
  }
  return 0;
}

// The subcommands of `epmoe` that live in their own files (bench.cpp, bench_gemm.cpp, stress.cpp,
// tune.cpp), as main.cpp sees them: the CLI11 subcommand (to ask whether it was parsed) and how to
// run it.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>

namespace epmoe::tools {

struct Subcommand {
  CLI::App* app = nullptr;
  std::function<int()> run;
};

Subcommand add_bench_command(CLI::App& parent);      // tools/bench.cpp (with `bench gemm`)
Subcommand add_bench_gemm_command(CLI::App& bench);  // tools/bench_gemm.cpp
Subcommand add_stress_command(CLI::App& parent);     // tools/stress.cpp
// tools/tune.cpp; argv: the command line, which the knob file records.
Subcommand add_tune_command(CLI::App& parent, int argc, char** argv);

}  // namespace epmoe::tools

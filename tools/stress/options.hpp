// `epmoe stress`'s command line: the options as given, their checks, and the run they describe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "epmoe/epmoe.hpp"
#include "harness/problem.hpp"
#include "stress/fault.hpp"

namespace CLI {
class App;
}

namespace epmoe::tools::stress {

// Exit status, as the --help footer states it (2, bad options, is main.cpp's).
constexpr int kExitPass = 0;
constexpr int kExitFail = 1;  // mismatch, error, or a fault not detected / not recovered from
constexpr int kExitHang = 3;  // the watchdog fired

struct Options {
  std::string shape = "tiny";
  std::string executor = "cpu";  // auto | cpu | cuda
  std::string model;             // a known model name; overrides --shape
  std::int64_t experts = 0;      // 0 = the model's / the shape's
  std::int64_t max_tokens = 16;
  int ranks = 4;
  std::int64_t rounds = 2000;
  std::string precision = "bf16";
  std::string combine = "staged";
  std::string math = "wgmma";  // exact | tensor_core | wgmma (LayerOptions::expert_math)
  std::string routing = "mixed";
  std::uint64_t seed = 1;
  double idle_fraction = 0.4;
  double idle_run = 8.0;
  std::uint32_t max_sleep_us = 200;
  std::uint32_t timeout_ms = 10'000;
  std::int64_t check_every = 1;
  std::uint32_t watchdog_s = 600;
  std::string fault;
  int fault_times = 1;
  double min_zero_fraction = 0.0;
  bool corrupt_check = false;
  bool processes = false;   // ranks as processes (CPU: POSIX shared memory; CUDA: one GPU each)
  bool megakernel = false;  // every round as the persistent round (CUDA executor)
  std::string token_back;   // empty: each bucket's table value
};

// Registers the options and the --help footer on the `stress` subcommand.
void add_options(CLI::App& cmd, Options& o);

// Bad options: Error(invalid_argument), which main.cpp turns into exit status 2.
[[noreturn]] void reject(const std::string& message);

// The run the options describe, checked before anything big is allocated.
struct Setup {
  LayerShape shape;
  std::string shape_name;  // tiny, or the --model
  Precision precision = Precision::bf16;
  LayerOptions layer_options;
  std::optional<harness::Routing> fixed_routing;  // none: --routing=mixed
  FaultPlan fault;
  // With --processes: cuda_nccl only for an explicit --executor=cuda (rank r on GPU r).
  Backend backend = Backend::cpu_threads;
  bool megakernel = false;  // --megakernel: with_megakernel_everywhere on every rank's config
  std::optional<TokenBack> token_back;  // --token-back: with_token_back_everywhere, first

  // layer_options under the math outputs are checked with (tools' checked_options: exact on the
  // CPU executor).
  LayerOptions checked_options() const;
};
Setup resolve(const Options& o);

}  // namespace epmoe::tools::stress

// `epmoe stress`: every rank of a group calls forward() at its own pace — random sleeps, random T
// with long runs of T == 0, a different routing pattern every round, no barrier between rounds —
// for many rounds, on the CPU or the CUDA executor; sampled rounds are checked against the
// emulating reference. With --fault, one rank misbehaves and every other rank must name it within
// the timeout; then every rank resets and the run goes on, so a --fault run is itself a test of
// detection and recovery. A wall-clock watchdog turns a hang into a report of who is stuck where.
//
// The parts, in tools/stress/: options (the command line and its checks), fault (--fault), load
// (what each rank sends), report (counts, summary, verdict), watchdog, recovery (the judge of
// fault episodes), threads (ranks as threads), and for --processes supervisor, rank_process and
// process_messages (what they say over their pipes).
#include <CLI/CLI.hpp>

#include <cstdio>
#include <functional>
#include <memory>
#include <string>

#include "executor.hpp"
#include "stress/options.hpp"
#include "stress/supervisor.hpp"
#include "stress/threads.hpp"
#include "subcommands.hpp"

namespace epmoe::tools {
namespace stress {
namespace {

std::string describe_ranks(const Options& o, const Setup& s) {
  if (!o.processes) return describe_backend(s.backend, o.ranks);
  return std::to_string(o.ranks) +
         (s.backend == Backend::cuda_nccl
              ? " rank processes (CUDA executor, rank r on GPU r, NCCL)"
              : " rank processes (CPU executor over POSIX shared memory)") +
         ", a supervisor";
}

void print_header(const Options& o, const Setup& s) {
  const LayerShape& shape = s.shape;
  std::printf(
      "epmoe stress: %s H=%lld I=%lld E=%lld K=%lld max_tokens=%lld  precision=%s combine=%s "
      "math=%s routing=%s\n",
      s.shape_name.c_str(), static_cast<long long>(shape.hidden),
      static_cast<long long>(shape.intermediate), static_cast<long long>(shape.num_experts),
      static_cast<long long>(shape.top_k), static_cast<long long>(shape.max_tokens_per_rank),
      to_string(s.precision), to_string(s.layer_options.combine),
      to_string(s.layer_options.expert_math), o.routing.c_str());
  const std::string fault =
      s.fault.fault == Fault::none ? "none" : s.fault.text + " x" + std::to_string(o.fault_times);
  std::printf(
      "executor: %s, no barrier between rounds  rounds=%lld seed=%llu "
      "idle-fraction=%.2f max-sleep-us=%u timeout-ms=%u check-every=%lld fault=%s\n",
      describe_ranks(o, s).c_str(), static_cast<long long>(o.rounds),
      static_cast<unsigned long long>(o.seed), o.idle_fraction, o.max_sleep_us, o.timeout_ms,
      static_cast<long long>(o.check_every), fault.c_str());
  std::fflush(stdout);
}

int run(const Options& o) {
  const Setup s = resolve(o);
  print_header(o, s);
  if (o.processes) return run_processes(o, s);  // forks now: no thread and no layer exists yet
  return run_threads(o, s);
}

}  // namespace
}  // namespace stress

Subcommand add_stress_command(CLI::App& parent) {
  auto o = std::make_shared<stress::Options>();
  CLI::App* cmd = parent.add_subcommand(
      "stress",
      "hammer a layer on the CPU or CUDA executor: ranks at their own pace, long runs of T == 0, "
      "mixed routing, optional faults; sampled rounds checked against the emulating reference");
  stress::add_options(*cmd, *o);
  return Subcommand{cmd, [o] { return stress::run(*o); }};
}

}  // namespace epmoe::tools

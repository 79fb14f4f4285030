#include "stress/options.hpp"

#include <CLI/CLI.hpp>

#include "epmoe/models.hpp"
#include "executor.hpp"

namespace epmoe::tools::stress {
namespace {

constexpr const char* kFooter =
    "Faults (--fault KIND:RANK[:MS]; needs a build with -DEPMOE_FAULT_INJECTION=ON):\n"
    "  skip_launch_when_idle:RANK  RANK returns from forward() without running the round the\n"
    "                              next time it has T == 0, then waits elsewhere (as an engine\n"
    "                              stuck in its next layer would)\n"
    "  stall:RANK:MS               RANK sleeps MS (> --timeout-ms) inside its next round\n"
    "  round_jump:RANK             RANK's round counter jumps ahead by 2 (a protocol violation)\n"
    "Each fault fires --fault-times times, at evenly spaced rounds. Every other rank must fail\n"
    "with an error naming RANK (Health.peer) within the timeout + 1 s; then every rank calls\n"
    "reset() and the run goes on. Exit 0 only if every fault was detected and recovered from.\n"
    "With --processes every rank is a process under a supervisor (CPU executor over POSIX\n"
    "shared memory, or with --executor=cuda rank r on GPU r), and the one fault is\n"
    "  kill:RANK                   at a round chosen from the seed RANK stalls inside its round\n"
    "                              and the supervisor SIGKILLs it, then starts a new RANK\n"
    "                              process that rejoins through reset(); the survivors must\n"
    "                              name RANK within the timeout + 1 s, then retry reset()\n"
    "                              until everyone (the new RANK too) meets, and go on\n"
    "                              With --executor=cuda (rank r on GPU r) a dead process breaks\n"
    "                              the NCCL communicator: the survivors' reset() must fail\n"
    "                              naming RANK, then every rank (the new RANK too) rebuilds its\n"
    "                              communicator from a fresh unique id and its layer, and goes "
    "on\n"
    "(kill:RANK needs --processes; the other faults run without it, on either executor.)\n"
    "Exit status: 0 pass, 1 mismatch / error / failed detection or recovery, 2 bad options,\n"
    "3 hang (the watchdog fired).";

// The layer under test and where it runs.
void add_layer_options(CLI::App& cmd, Options& o) {
  cmd.add_option("--executor", o.executor, "cpu | cuda | auto (cuda: one GPU per rank)")
      ->capture_default_str();
  cmd.add_option("--shape", o.shape, "built-in small shape: tiny = H=64 I=64 E=16 K=4")
      ->capture_default_str();
  cmd.add_option("--model", o.model,
                 "a real model's shape instead (qwen3-30b-a3b | deepseek-v3 | gpt-oss-120b | "
                 "mixtral-8x7b); slow on the CPU executor, use --experts");
  cmd.add_option("--experts", o.experts, "override the number of experts (0 = the shape's)")
      ->capture_default_str();
  cmd.add_option("--max-tokens", o.max_tokens, "max_tokens_per_rank; T is drawn in [0, this]")
      ->capture_default_str();
  cmd.add_option("--ranks", o.ranks,
                 "expert-parallel ranks (threads, or processes with --processes)")
      ->capture_default_str();
  cmd.add_option("--rounds", o.rounds, "rounds every rank runs")->capture_default_str();
  cmd.add_option("--precision", o.precision, "bf16 | mxfp8 | nvfp4 | fp8_block128 | mxfp4")
      ->capture_default_str();
  cmd.add_option("--combine", o.combine, "staged | in_kernel_reduce")->capture_default_str();
  cmd.add_option("--math", o.math,
                 "expert math: exact | tensor_core | wgmma (CUDA executor; the CPU executor always "
                 "computes exactly); picks the rule outputs are checked with")
      ->capture_default_str();
  cmd.add_flag("--megakernel", o.megakernel,
               "every round of a bucket that has one as the persistent round, one launch per "
               "forward (CUDA executor; --math tensor_core, or wgmma's mxfp8 / mxfp4 E4M3 tile; "
               "docs/design.md 4.3)");
  cmd.add_option("--token-back", o.token_back,
                 "epilogue_warps | dispatch_warps: asked of every bucket (kept where the bucket "
                 "runs either mode, wgmma's E4M3 tile; docs/tuning.md#knobs); empty: the table's");
}

// The load: routing, idle runs, pacing, and how much of it is checked.
void add_load_options(CLI::App& cmd, Options& o) {
  cmd.add_option("--routing", o.routing,
                 "mixed (a pattern per rank per round) | uniform | one_expert | one_rank | "
                 "all_dropped")
      ->capture_default_str();
  cmd.add_option("--seed", o.seed, "seed of weights, inputs, routing, T and sleeps")
      ->capture_default_str();
  cmd.add_option("--idle-fraction", o.idle_fraction,
                 "share of forwards with T == 0 (per-rank Markov chain idle/busy)")
      ->capture_default_str();
  cmd.add_option("--min-zero-fraction", o.min_zero_fraction,
                 "fail unless at least this share of forwards had T == 0 (for tests)")
      ->capture_default_str();
  cmd.add_option("--idle-run", o.idle_run, "mean length of a run of T == 0 rounds")
      ->capture_default_str();
  cmd.add_option("--max-sleep-us", o.max_sleep_us,
                 "before half the forwards sleep U(0, this) us; before 1% up to 10x this")
      ->capture_default_str();
  cmd.add_option("--timeout-ms", o.timeout_ms, "bounded-wait timeout of the layer, 0 = forever")
      ->capture_default_str();
  cmd.add_option("--check-every", o.check_every,
                 "check every N-th round of each rank against the reference (0 = never)")
      ->capture_default_str();
}

// The watchdog, the faults and the rank mode.
void add_fault_options(CLI::App& cmd, Options& o) {
  cmd.add_option("--watchdog-s", o.watchdog_s,
                 "wall-clock limit of the whole run; on expiry print who is stuck where and exit "
                 "3 (0 = none)")
      ->capture_default_str();
  cmd.add_option("--fault", o.fault,
                 "skip_launch_when_idle:RANK | stall:RANK:MS | round_jump:RANK | (with "
                 "--processes) kill:RANK (see below)");
  cmd.add_flag("--processes", o.processes,
               "run every rank as a process under a supervisor (CPU executor over POSIX shared "
               "memory, or with --executor=cuda rank r on GPU r); enables --fault kill:RANK");
  cmd.add_option("--fault-times", o.fault_times, "fault episodes in the run")
      ->capture_default_str();
  cmd.add_flag("--corrupt-check", o.corrupt_check,
               "flip one output bit before the first check (proves the checker can fail)")
      ->group("");
}

void resolve_shape(const Options& o, Setup& s) {
  if (!o.model.empty()) {
    s.shape = find_model(o.model).layer_shape(o.max_tokens);
    s.shape_name = o.model;
  } else if (o.shape == "tiny") {
    s.shape = LayerShape{.hidden = 64,
                         .intermediate = 64,
                         .num_experts = 16,
                         .top_k = 4,
                         .max_tokens_per_rank = o.max_tokens};
    s.shape_name = "tiny";
  } else {
    reject("--shape=" + o.shape + ": must be tiny (or pass --model)");
  }
  if (o.experts > 0) s.shape.num_experts = o.experts;
}

void check_counts(const Options& o) {
  if (o.rounds < 1) reject("--rounds=" + std::to_string(o.rounds) + ": must be >= 1");
  if (o.check_every < 0)
    reject("--check-every=" + std::to_string(o.check_every) + ": must be >= 0 (0 = never)");
  if (!(o.idle_fraction >= 0.0 && o.idle_fraction <= 1.0))
    reject("--idle-fraction=" + std::to_string(o.idle_fraction) + ": must be in [0, 1]");
  if (o.fault_times < 1)
    reject("--fault-times=" + std::to_string(o.fault_times) + ": must be >= 1");
}

// --processes forks before any CUDA call (a CUDA context does not survive fork): the rank
// processes find their GPUs themselves, and only an explicit --executor=cuda runs them there.
Backend choose_stress_backend(const Options& o) {
  if (o.processes) return o.executor == "cuda" ? Backend::cuda_nccl : Backend::cpu_threads;
  return choose_backend(o.executor, o.ranks);
}

// The CPU executor holds every expert in host memory: bf16 + the layers' and reference's copies.
void check_host_memory(const Setup& s) {
  const LayerShape& shape = s.shape;
  const std::int64_t params = shape.num_experts * 3 * shape.intermediate * shape.hidden;
  const std::int64_t need = params * (2 + 4 + 4);
  const std::int64_t have = available_host_bytes();
  if (s.backend == Backend::cpu_threads && have > 0 && need > have * 9 / 10)
    reject(s.shape_name + " with " + std::to_string(shape.num_experts) + " experts needs about " +
           std::to_string(need >> 30) + " GiB of host memory on the CPU executor and " +
           std::to_string(have >> 30) + " GiB are available; pass --experts with fewer experts");
}

}  // namespace

void add_options(CLI::App& cmd, Options& o) {
  cmd.footer(kFooter);
  add_layer_options(cmd, o);
  add_load_options(cmd, o);
  add_fault_options(cmd, o);
}

[[noreturn]] void reject(const std::string& message) {
  throw Error(ErrorCode::invalid_argument, message);
}

LayerOptions Setup::checked_options() const {
  return tools::checked_options(backend, layer_options);
}

Setup resolve(const Options& o) {
  Setup s;
  resolve_shape(o, s);
  s.precision = parse_precision(o.precision);
  s.layer_options.combine = parse_combine(o.combine);
  s.layer_options.expert_math = parse_expert_math(o.math, "--math");
  s.layer_options.timeout_ms = o.timeout_ms;
  if (o.routing != "mixed") s.fixed_routing = harness::parse_routing(o.routing);
  check_counts(o);
  s.fault = parse_fault(o.fault, o.ranks, o.timeout_ms, o.processes);
  if (s.fault.fault != Fault::none && !testing::fault_injection_available())
    throw Error(ErrorCode::unsupported,
                "--fault: this build has no fault switches (configure with "
                "-DEPMOE_FAULT_INJECTION=ON)");
  (void)make_config(s.shape, s.precision, 0, o.ranks,
                    s.layer_options);  // validates before allocating
  s.backend = choose_stress_backend(o);
  check_megakernel_backend(o.megakernel, s.backend);
  s.megakernel = o.megakernel;
  if (!o.token_back.empty()) s.token_back = parse_token_back(o.token_back, "--token-back");
  check_host_memory(s);
  return s;
}

}  // namespace epmoe::tools::stress

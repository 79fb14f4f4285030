// `epmoe run`: one MoE layer of a real model on every rank, random weights and inputs, each
// round checked against the emulating reference and compared with the float64 forward.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "commands.hpp"
#include "epmoe/epmoe.hpp"
#include "epmoe/models.hpp"
#include "executor.hpp"
#include "format_bytes.hpp"
#include "harness/cluster.hpp"
#include "harness/problem.hpp"
#include "harness/rank_threads.hpp"
#include "harness/reference_rows.hpp"
#include "progress.hpp"
#include "reference/reference.hpp"

namespace epmoe::tools {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// rel-L2 against the float64 forward that a healthy layer of each precision stays under
// (random U(-1,1) inputs, U(-1,1)/sqrt(fan_in) weights); far above what rounding alone gives.
double exact_error_bound(Precision p) {
  switch (p) {
    case Precision::bf16:
      return 0.02;
    case Precision::mxfp8:
      return 0.10;
    case Precision::nvfp4:
      return 0.35;
    case Precision::fp8_block128:
      return 0.10;
    case Precision::mxfp4:
      return 0.35;
  }
  return 0.0;
}

struct RankReport {
  std::int64_t tokens = 0;
  std::vector<double> latency_ms;
  // vs_reference: max_abs and rel_l2 the worst over rounds, mismatches summed over rounds.
  reference::ErrorStats vs_reference, vs_exact;
  int failed_rounds = 0;  // rounds that broke reference::check_output's rule
  std::string error;
};

}  // namespace

int run_command(const RunOptions& o) {
  const ModelShape& model = find_model(o.model);
  LayerShape shape = model.layer_shape(std::max<std::int64_t>(o.tokens, 1));
  if (o.experts > 0) shape.num_experts = o.experts;
  const Precision precision = parse_precision(o.precision);
  LayerOptions options;
  options.combine = parse_combine(o.combine);
  options.expert_math = parse_expert_math(o.math, "--math");
  options.timeout_ms = o.timeout_ms;
  if (o.tokens < 0)
    throw Error(ErrorCode::invalid_argument,
                "--tokens=" + std::to_string(o.tokens) + ": must be >= 0");
  if (o.rounds < 1)
    throw Error(ErrorCode::invalid_argument,
                "--rounds=" + std::to_string(o.rounds) + ": must be >= 1");
  if (o.check_tokens < -1)
    throw Error(ErrorCode::invalid_argument, "--check-tokens=" + std::to_string(o.check_tokens) +
                                                 ": must be >= 0, or -1 (auto)");
  const std::int64_t check_tokens = o.check_tokens < 0
                                        ? harness::tokens_within(shape, o.tokens, kAutoCheckMacs)
                                        : std::min(o.check_tokens, o.tokens);
  // Validates shape, ranks and options before anything big is allocated.
  const LayerConfig config0 = make_config(shape, precision, 0, o.ranks, options);

  const Backend backend = choose_backend(o.executor, o.ranks);
  const bool on_gpus = backend == Backend::cuda_nccl;
  check_megakernel_backend(o.megakernel, backend);

  // Host memory of the CPU executor: bf16 weights, the layers' quantized copies (fp32), the
  // reference's copies of the experts its checked tokens touch (fp32).
  const std::int64_t params = shape.num_experts * 3 * shape.intermediate * shape.hidden;
  const std::int64_t need =
      params * (2 + 4) + std::min(shape.num_experts, o.ranks * check_tokens * shape.top_k) * 3 *
                             shape.intermediate * shape.hidden * 4;
  const std::int64_t have = available_host_bytes();
  if (!on_gpus && have > 0 && need > have * 9 / 10) {
    const std::int64_t fit = std::max<std::int64_t>(
        o.ranks, shape.num_experts * (have * 8 / 10) / need / o.ranks * o.ranks);
    throw Error(ErrorCode::invalid_argument,
                o.model + " with " + std::to_string(shape.num_experts) + " experts needs about " +
                    std::to_string(need >> 30) + " GiB of host memory on the CPU executor and " +
                    std::to_string(have >> 30) + " GiB are available; pass --experts=" +
                    std::to_string(fit) + " (or fewer) to run a subset of the experts");
  }

  std::printf("epmoe run: %s  H=%lld I=%lld E=%lld K=%lld  precision=%s combine=%s math=%s%s\n",
              model.name, static_cast<long long>(shape.hidden),
              static_cast<long long>(shape.intermediate), static_cast<long long>(shape.num_experts),
              static_cast<long long>(shape.top_k), to_string(precision), to_string(options.combine),
              to_string(options.expert_math), o.megakernel ? " (persistent round)" : "");
  std::printf("executor: %s\n", describe_backend(backend, o.ranks).c_str());
  std::printf("ranks=%d tokens/rank=%lld rounds=%d seed=%llu  workspace %.1f MiB/rank\n", o.ranks,
              static_cast<long long>(o.tokens), o.rounds, static_cast<unsigned long long>(o.seed),
              static_cast<double>(config0.workspace_bytes()) / (1 << 20));
  std::printf(
      "check: the first %lld of %lld tokens per rank per round against the emulating "
      "reference and the float64 forward%s\n",
      static_cast<long long>(check_tokens), static_cast<long long>(o.tokens),
      check_tokens == o.tokens ? ""
      : o.check_tokens < 0     ? " (all of them would keep the host busy too long; --check-tokens)"
                               : " (--check-tokens)");
  std::fflush(stdout);

  auto t0 = Clock::now();
  std::fprintf(stderr, "[prepare] generating %.2f G bf16 weight parameters...\n",
               static_cast<double>(params) / 1e9);
  const reference::LayerWeights weights = harness::make_random_weights(shape, o.seed);
  std::fprintf(stderr,
               "[prepare] weights drawn in %.1f s; creating the layers (weights prepared per "
               "rank) for %lld experts on %d rank threads...\n",
               seconds_since(t0), static_cast<long long>(shape.num_experts), o.ranks);
  const auto t_create = Clock::now();
  Cluster cluster(shape, precision, options, o.ranks, weights, backend, {},
                  o.megakernel ? Cluster::Tune(with_megakernel_everywhere) : Cluster::Tune());
  std::fprintf(stderr, "[prepare] layers created in %.1f s (%.1f s in all)\n",
               seconds_since(t_create), seconds_since(t0));
  // The format's own size (issue 11: resident bytes should equal it within 1 %), for comparison.
  const double format_bytes = static_cast<double>(shape.num_experts / o.ranks) * 3.0 *
                              static_cast<double>(shape.hidden * shape.intermediate) *
                              weight_bytes_per_param(precision);
  for (int rank = 0; rank < o.ranks; ++rank) {  // as the layer's expert math holds them
    const std::size_t bytes = cluster.layer(rank).resident_weight_bytes();
    std::printf(
        "rank %d: expert weights resident %.1f MiB (%zu bytes; %.3fx the %s format's %.0f)\n", rank,
        static_cast<double>(bytes) / (1 << 20), bytes, static_cast<double>(bytes) / format_bytes,
        to_string(precision), format_bytes);
  }
  std::fflush(stdout);

  std::vector<RankReport> reports(static_cast<std::size_t>(o.ranks));
  // Each rank thread checks its rounds on its share of the cores.
  const unsigned check_threads =
      std::max(1u, std::thread::hardware_concurrency() / static_cast<unsigned>(o.ranks));
  Progress progress("rounds", o.rounds);
  std::atomic<int> rounds_done{0};
  // Rounds run back to back (inputs made first, checks after), so a rank's latency is the layer's
  // and not a peer's host-side checking; the ranks still call forward with no barrier between.
  run_on_rank_threads(o.ranks, [&](int rank) {
    RankReport& rep = reports[static_cast<std::size_t>(rank)];
    try {
      std::vector<reference::Batch> batches;
      std::vector<std::vector<std::uint16_t>> outputs;
      for (int r = 0; r < o.rounds; ++r)
        batches.push_back(harness::make_random_batch(
            shape, o.ranks, o.tokens, harness::Routing::uniform, 0,
            o.seed * 7919 + static_cast<std::uint64_t>(r * o.ranks + rank)));
      for (int r = 0; r < o.rounds; ++r) {
        const auto start = Clock::now();
        double device_ms = 0.0;
        outputs.push_back(cluster.forward(rank, batches[static_cast<std::size_t>(r)], &device_ms));
        rep.latency_ms.push_back(on_gpus ? device_ms : seconds_since(start) * 1e3);
      }
      for (int r = 0; r < o.rounds; ++r) {
        const reference::Batch& batch = batches[static_cast<std::size_t>(r)];
        rep.tokens = batch.tokens;
        const reference::Batch checked = harness::first_tokens(batch, shape, check_tokens);
        const auto& out = outputs[static_cast<std::size_t>(r)];
        const std::vector<std::uint16_t> y(
            out.begin(), out.begin() + static_cast<std::ptrdiff_t>(checked.x.size()));
        const harness::ReferenceOutputs ref = harness::reference_outputs(
            cluster.reference(rank), checked, shape, true, check_threads);
        const auto check = reference::check_output(y, ref.emulated, options.combine,
                                                   checked_math(backend, options.expert_math),
                                                   precision, shape.intermediate);
        const auto exact = reference::compare_exact(y, ref.exact);
        reference::ErrorStats& worst = rep.vs_reference;
        if (r == 0 || !(check.stats.max_abs <= worst.max_abs)) worst.max_abs = check.stats.max_abs;
        if (r == 0 || !(check.stats.rel_l2 <= worst.rel_l2)) worst.rel_l2 = check.stats.rel_l2;
        worst.mismatches += check.stats.mismatches;
        rep.failed_rounds += check.pass ? 0 : 1;
        if (r == 0 || exact.rel_l2 > rep.vs_exact.rel_l2) rep.vs_exact = exact;
        if (rank == 0) progress.update(++rounds_done, "checked against the references");
      }
    } catch (const Error& e) {
      rep.error = e.what();
    }
  });
  progress.finish();

  bool ok = true;
  std::printf("\n%-5s %-7s %-12s %-41s %-24s\n", "rank", "tokens", "latency ms",
              "vs emulating reference", "vs float64 forward");
  std::printf("%-5s %-7s %-12s %-12s %-10s %-10s %-6s %-12s %-10s\n", "", "", "(median)", "max_abs",
              "rel_l2", "mismatch", "failed", "max_abs", "rel_l2");
  for (int rank = 0; rank < o.ranks; ++rank) {
    RankReport& rep = reports[static_cast<std::size_t>(rank)];
    if (!rep.error.empty()) {
      std::printf("%-5d error: %s\n", rank, rep.error.c_str());
      ok = false;
      continue;
    }
    std::sort(rep.latency_ms.begin(), rep.latency_ms.end());
    const double median = rep.latency_ms[rep.latency_ms.size() / 2];
    std::printf("%-5d %-7lld %-12.2f %-12.3g %-10.3g %-10lld %-6d %-12.3g %-10.3g\n", rank,
                static_cast<long long>(rep.tokens), median, rep.vs_reference.max_abs,
                rep.vs_reference.rel_l2, static_cast<long long>(rep.vs_reference.mismatches),
                rep.failed_rounds, rep.vs_exact.max_abs, rep.vs_exact.rel_l2);
    ok &= rep.failed_rounds == 0 &&
          (check_tokens == 0 || rep.vs_exact.rel_l2 <= exact_error_bound(precision));
  }
  std::printf(
      "\n%s: %s (mismatch = elements outside the rule's per-element tolerance, over all rounds; "
      "failed = rounds that broke the rule: %s; float64 rel_l2 bound %.2f)\n",
      ok ? "PASS" : "FAIL", o.model.c_str(),
      reference::output_rule(options.combine, checked_math(backend, options.expert_math), precision,
                             shape.intermediate)
          .c_str(),
      exact_error_bound(precision));
  return ok ? 0 : 1;
}

}  // namespace epmoe::tools

// `epmoe bench gemm`: the expert GEMMs alone (FC1 + activation + FC2 over a rank's local experts),
// for each model shape x precision x expert math x R (rows per expert), next to the machine's HBM
// bandwidth and bf16 matmul rate measured in the same run.
//
// A point is a world-1 layer with balanced routing (harness::make_balanced_routing: T = E x R / K
// tokens, every local expert exactly R rows, no dropped slot), timed on the GPU with the layer's
// per-phase timing (Layer::set_phase_timing, docs/design.md §4.2): the expert step is the span from
// the first stamp of phase fc1 (for wgmma: plan, gather, the FC1 GEMM, activate) to the last of
// phase fc2 (FC2, the rows home), on the GPU clock, so dispatch, route and combine are not in it.
// The CPU executor has no GPU clock: there a point times the whole forward (wall clock) and says
// so (`timed: forward`). Rounds, the --max-point-s rule, the check and the ceilings are those of
// `epmoe bench` (tools/sweep.hpp); docs/bench.md defines every column.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "executor.hpp"
#include "progress.hpp"
#include "subcommands.hpp"
#include "sweep.hpp"

namespace epmoe::tools {

namespace {

using namespace sweep;  // NOLINT(google-build-using-namespace): the shared sweep (sweep.hpp)

struct GemmOptions : SweepOptions {
  std::string rows = "1,4,16,64,256,1024,4096";  // decode-like, then prefill-like
  GemmOptions() {
    models = "qwen3-30b-a3b,deepseek-v3,gpt-oss-120b,mixtral-8x7b";
    experts = 32;  // deepseek-v3's local experts at EP8; the GEMM figures hardly depend on it
    precisions = "bf16,fp8_block128,mxfp8,nvfp4,mxfp4";
    maths = "wgmma,tensor_core";
  }
};

struct GemmPoint {
  const Model* model = nullptr;
  Precision precision = Precision::bf16;
  ExpertMath math = ExpertMath::exact;
  std::int64_t rows = 0;           // R: rows per local expert
  std::int64_t tokens = 0;         // T = E x R / K
  std::string status = "pending";  // ok | skipped | error
  std::string note;
  std::string check = "skipped";
  int warmup = 0;
  std::vector<double> gemm_us;  // per timed round: the expert step (or the forward on the CPU)
  double gemm_p50 = kNaN, gemm_p90 = kNaN, gemm_min = kNaN;  // us
  double fc1_p50 = kNaN, fc2_p50 = kNaN, forward_p50_ms = kNaN;
  std::size_t resident_bytes = 0;  // Layer::resident_weight_bytes()

  double flops() const {  // 2 R E (2I H + H I)
    const LayerShape& s = model->shape;
    return 6.0 * double(rows) * double(s.num_experts) * double(s.intermediate) * double(s.hidden);
  }
  double weight_bytes() const {  // every local expert once, in the precision's format
    const LayerShape& s = model->shape;
    return 3.0 * double(s.num_experts) * double(s.intermediate) * double(s.hidden) *
           weight_bytes_per_param(precision);
  }
  double tflops() const { return flops() / (gemm_p50 * 1e-6) / 1e12; }
  double tbps() const { return weight_bytes() / (gemm_p50 * 1e-6) / 1e12; }
  double resident_tbps() const {
    return resident_bytes > 0 ? double(resident_bytes) / (gemm_p50 * 1e-6) / 1e12 : kNaN;
  }
};

// The floors of a point over the measured ceilings: its weights once at the HBM copy rate, its
// FLOPs at the bf16 matmul rate (for the FP8 precisions an upper bound: FP8 tensor cores run
// twice as fast).
struct GemmFloors {
  double hbm_us = kNaN, compute_us = kNaN, floor_us = kNaN;
  std::string bound;
};

GemmFloors floors_of(const GemmPoint& p, const Ceilings& c) {
  GemmFloors f;
  if (c.hbm_gbps > 0) f.hbm_us = p.weight_bytes() / (c.hbm_gbps * 1e9) * 1e6;
  if (c.matmul_tflops > 0) f.compute_us = p.flops() / (c.matmul_tflops * 1e12) * 1e6;
  for (const auto& [us, name] : {std::pair{f.hbm_us, "hbm"}, std::pair{f.compute_us, "mma"}})
    if (!std::isnan(us) && (std::isnan(f.floor_us) || us > f.floor_us)) {
      f.floor_us = us;
      f.bound = name;
    }
  return f;
}

// The expert step of one round from its phases: fc1's first stamp to fc2's last (the launch gap
// between them included). NaN when either phase was not stamped.
double expert_step_us(const PhaseTimes& t) {
  const PhaseSpan& fc1 = t[RoundPhase::fc1];
  const PhaseSpan& fc2 = t[RoundPhase::fc2];
  if (t.empty() || !fc1.stamped || !fc2.stamped) return kNaN;
  return fc2.end_us - fc1.begin_us;
}

struct GemmSweep : SweepRun {
  const GemmOptions* o = nullptr;
};

// One (model, precision, math): a world-1 layer at the largest R, then every R.
void run_gemm_config(GemmSweep& st, const Model& model, const ModelData& data, Precision precision,
                     ExpertMath math, std::vector<GemmPoint*>& points) {
  const GemmOptions& o = *st.o;
  const LayerShape& s = model.shape;
  ConfigPoints<GemmPoint> cp{st, points,
                             model.label() + " " + to_string(precision) + " " + to_string(math)};
  const std::string& what = cp.what;
  if (cp.over_budget(o, 0)) return;
  LayerOptions options;
  options.expert_math = math;
  options.timeout_ms = o.timeout_ms;
  const ConfigCluster made = make_cluster(s, precision, options, 1, data, st.backend);
  if (!made.cluster) {
    // A backend that cannot serve this precision or shape (tensor_core with fp8_block128, wgmma's
    // FP8 with H or I not whole 128-blocks) is a skip with its reason, not a failure.
    st.any_failure |= !made.unsupported;
    cp.skip_rest(0, made.unsupported ? "skipped" : "error", made.error);
    return;
  }
  Cluster* cluster = made.cluster.get();
  const std::string check = run_check(st, o, *cluster, s, precision, options, 1);
  const std::size_t resident = cluster->layer(0).resident_weight_bytes();
  std::fprintf(stderr, "[config] %s: layer ready in %.1f s (%.3f GB resident), check %s\n",
               what.c_str(), made.prep_s, double(resident) / 1e9, check.c_str());
  const bool phases = st.backend == Backend::cuda_nccl;
  if (phases) cluster->layer(0).set_phase_timing(true);

  double last_ms = kNaN;  // the previous R's forward p50, for the --max-point-s estimate
  std::int64_t last_rows = 0;
  for (std::size_t pi = 0; pi < points.size(); ++pi) {
    GemmPoint& pt = *points[pi];
    pt.check = check;
    pt.resident_bytes = resident;
    const std::optional<RoundPlan> planned =
        cp.plan(o, pi, last_ms, last_rows > 0 ? double(pt.rows) / double(last_rows) : 1.0);
    if (!planned) return;
    const RoundPlan& plan = *planned;
    try {
      const std::vector<Routing> routing(static_cast<std::size_t>(plan.warmup + plan.rounds),
                                         harness::make_balanced_routing(s, pt.rows));
      const RoundTimes times =
          time_rounds(*cluster, routing, data, TokenCounts{{pt.tokens}}, plan.warmup, plan.rounds,
                      o.max_point_s, st.backend, phases);
      pt.warmup = plan.warmup;
      std::vector<double> forward_ms, fc1_us, fc2_us;
      for (int i = plan.warmup; i < plan.warmup + times.timed; ++i) {
        const auto round = static_cast<std::size_t>(i);
        forward_ms.push_back(times.ms[0][round]);
        if (!phases) {
          pt.gemm_us.push_back(times.ms[0][round] * 1e3);
          continue;
        }
        const PhaseTimes& t = times.phases[0][round];
        const double us = expert_step_us(t);
        if (std::isnan(us))
          throw Error(ErrorCode::internal,
                      "round " + std::to_string(i) + ": phases fc1 / fc2 not stamped");
        pt.gemm_us.push_back(us);
        fc1_us.push_back(t[RoundPhase::fc1].us());
        fc2_us.push_back(t[RoundPhase::fc2].us());
      }
      pt.gemm_p50 = percentile(pt.gemm_us, 0.5);
      pt.gemm_p90 = percentile(pt.gemm_us, 0.9);
      pt.gemm_min = min_of(pt.gemm_us);
      pt.fc1_p50 = percentile(fc1_us, 0.5);
      pt.fc2_p50 = percentile(fc2_us, 0.5);
      pt.forward_p50_ms = percentile(forward_ms, 0.5);
      pt.status = "ok";
      if (times.timed < plan.rounds)
        pt.note = "stopped after " + std::to_string(times.timed) + " rounds (--max-point-s)";
      last_ms = pt.forward_p50_ms;
      last_rows = pt.rows;
      char detail[200];
      std::snprintf(detail, sizeof detail, "%s R=%lld: %.1f us, %.0f TFLOPS", what.c_str(),
                    static_cast<long long>(pt.rows), pt.gemm_p50, pt.tflops());
      cp.done(detail);
    } catch (const std::exception& e) {
      cp.fail(pi, e, "the layer failed at a smaller R of this config");
      return;
    }
  }
}

// ---- output ----

void print_gemm_table(const std::vector<GemmPoint>& points, const Ceilings& c, bool phases) {
  std::printf("\n%-22s %-12s %-11s %5s %6s %10s %10s %9s %9s %7s %6s %7s %9s %-5s %7s ", "model",
              "prec", "math", "R", "T", "gemm us", "p90 us", "fc1 us", "fc2 us", "TFLOPS", "TB/s",
              "res TB/s", "floor us", "bound", "x floor");
  std::printf("check\n");
  for (const GemmPoint& p : points) {
    std::printf("%-22s %-12s %-11s %5lld %6lld ", p.model->label().c_str(), to_string(p.precision),
                to_string(p.math), static_cast<long long>(p.rows),
                static_cast<long long>(p.tokens));
    if (print_unless_ok(p)) continue;
    const GemmFloors f = floors_of(p, c);
    std::printf("%10s %10s %9s %9s %7s %6s %7s %9s %-5s %7s ", fmt(p.gemm_p50, "%.1f").c_str(),
                fmt(p.gemm_p90, "%.1f").c_str(), fmt(p.fc1_p50, "%.1f").c_str(),
                fmt(p.fc2_p50, "%.1f").c_str(), fmt(p.tflops(), "%.1f").c_str(),
                fmt(p.tbps(), "%.2f").c_str(), fmt(p.resident_tbps(), "%.2f").c_str(),
                fmt(f.floor_us, "%.1f").c_str(), f.bound.empty() ? "-" : f.bound.c_str(),
                fmt(p.gemm_p50 / f.floor_us, "%.1f").c_str());
    print_check_note(p);
  }
  std::printf(
      "\nR = rows per local expert (balanced routing, world 1); T = E x R / K tokens; gemm us = "
      "%s, p50 (p90) over rounds; TFLOPS = 2 R E (2 I H + H I) / gemm; TB/s = the E experts' "
      "weights in the precision's format / gemm; res TB/s = the bytes the backend holds "
      "(Layer::resident_weight_bytes) / gemm; floor = max(weights at HBM %s GB/s, FLOPs at bf16 "
      "%s TFLOP/s)\n",
      phases ? "the expert step on the GPU clock (phase fc1's begin to phase fc2's end; fc1 us, "
               "fc2 us: each phase)"
             : "the whole forward, wall clock (CPU executor: no phases)",
      fmt(c.hbm_gbps > 0 ? c.hbm_gbps : kNaN, "%.0f").c_str(),
      fmt(c.matmul_tflops > 0 ? c.matmul_tflops : kNaN, "%.0f").c_str());
}

void write_gemm_json(const std::string& path, const GemmOptions& o, Backend backend,
                     const Ceilings& c, const std::vector<GemmPoint>& points, double total_s) {
  const bool phases = backend == Backend::cuda_nccl;
  const std::string settings =
      ", \"routing\": \"balanced: every local expert exactly R rows, world 1\", \"timed\": " +
      json_str(phases ? "expert step: phase fc1 begin to phase fc2 end (GPU clock)"
                      : "forward (CPU executor, wall clock)") +
      ", \"max_point_s\": " + json_num(o.max_point_s);
  write_json_file(
      path, "epmoe-bench-gemm/1", "epmoe bench gemm", backend, c, o, settings, total_s,
      points.size(), [&](std::ostream& f, std::size_t i) {
        const GemmPoint& p = points[i];
        const LayerShape& s = p.model->shape;
        const GemmFloors fl = floors_of(p, c);
        write_point_head(f, *p.model, p.precision);
        f << ", \"math\": " << json_str(to_string(p.math)) << ", \"world\": 1"
          << ", \"rows_per_expert\": " << p.rows << ", \"tokens_per_rank\": " << p.tokens
          << ", \"pairs\": " << p.rows * s.num_experts << ", \"status\": " << json_str(p.status)
          << ", \"note\": " << json_str(p.note) << ", \"check\": " << json_str(p.check)
          << ", \"timed\": " << json_str(phases ? "phases" : "forward")
          << ", \"warmup\": " << p.warmup << ", \"rounds\": " << p.gemm_us.size()
          << ", \"gemm_us_p50\": " << json_num(p.gemm_p50)
          << ", \"gemm_us_p90\": " << json_num(p.gemm_p90)
          << ", \"gemm_us_min\": " << json_num(p.gemm_min)
          << ", \"fc1_us_p50\": " << json_num(p.fc1_p50)
          << ", \"fc2_us_p50\": " << json_num(p.fc2_p50)
          << ", \"latency_ms_p50\": " << json_num(p.gemm_p50 * 1e-3)
          << ", \"latency_ms_p90\": " << json_num(p.gemm_p90 * 1e-3)
          << ", \"forward_ms_p50\": " << json_num(p.forward_p50_ms)
          << ", \"flops\": " << json_num(p.flops())
          << ", \"weight_bytes\": " << json_num(p.weight_bytes()) << ", \"resident_weight_bytes\": "
          << (p.resident_bytes > 0 ? std::to_string(p.resident_bytes) : std::string("null"))
          << ", \"eff_tflops\": " << json_num(p.tflops())
          << ", \"eff_tbps\": " << json_num(p.tbps())
          << ", \"resident_tbps\": " << json_num(p.resident_tbps())
          << ", \"hbm_floor_us\": " << json_num(fl.hbm_us)
          << ", \"compute_floor_us\": " << json_num(fl.compute_us)
          << ", \"floor_us\": " << json_num(fl.floor_us) << ", \"bound\": " << json_str(fl.bound)
          << ", \"gemm_us\": ";
        write_json_array(f, p.gemm_us);
        f << "}";
      });
}

int bench_gemm(const GemmOptions& o) {
  const auto start = Clock::now();
  validate_sweep_options(o);
  const std::vector<std::int64_t> rows =
      parse_counts(o.rows, "--rows", 1, "R", " (rows per expert)");
  std::vector<Model> models = parse_models(o);
  const std::vector<Precision> precisions = parse_precisions(o.precisions);
  const std::vector<ExpertMath> maths = parse_maths(o.maths);
  for (Model& m : models) {  // every (model, R) must balance; the layer fits the largest T
    for (std::int64_t r : rows) {
      try {
        harness::balanced_tokens(m.shape, r);
      } catch (const Error& e) {
        reject("--models " + m.label() + " --rows " + std::to_string(r) + ": " + e.what() +
               " (--experts or :EXPERTS changes E)");
      }
    }
    m.shape.max_tokens_per_rank = harness::balanced_tokens(m.shape, rows.back());
    make_config(m.shape, Precision::bf16, 0, 1);  // validate before any work
  }
  const Backend backend = choose_backend(o.executor, 1);  // auto: the GPU when there is one
  const Ceilings ceilings =
      start_sweep(o, backend,
                  "epmoe bench gemm: executor " + describe_backend(backend, 1) + "; " +
                      (backend == Backend::cuda_nccl
                           ? "timing the expert step (phases fc1 + fc2) on the GPU clock"
                           : "the CPU executor has no GPU clock: timing the whole forward"));

  // Points in the order they run: precision, math, model, R (a --budget-s cut drops the last
  // precisions of the list first).
  struct Config {
    std::size_t model;
    Precision precision;
    ExpertMath math;
    std::vector<std::size_t> points;
  };
  std::vector<GemmPoint> points;
  std::vector<Config> configs;
  for (Precision p : precisions)
    for (ExpertMath x : maths)
      for (std::size_t m = 0; m < models.size(); ++m) {
        Config cfg{m, p, x, {}};
        for (std::int64_t r : rows) {
          GemmPoint pt;
          pt.model = &models[m];
          pt.precision = p;
          pt.math = x;
          pt.rows = r;
          pt.tokens = harness::balanced_tokens(models[m].shape, r);
          cfg.points.push_back(points.size());
          points.push_back(pt);
        }
        configs.push_back(cfg);
      }

  ModelDataCache data(models, 1, o.seed);
  Progress progress("bench gemm", static_cast<std::int64_t>(points.size()));
  GemmSweep st{{backend, ceilings, start, &progress}, &o};
  for (Config& cfg : configs) {
    std::vector<GemmPoint*> pts = points_at(points, cfg.points);
    run_gemm_config(st, models[cfg.model], data.get(cfg.model), cfg.precision, cfg.math, pts);
  }
  progress.finish();
  const double total_s = seconds_since(start);
  print_gemm_table(points, ceilings, backend == Backend::cuda_nccl);
  std::printf("total %.0f s\n", total_s);
  if (!o.json.empty()) write_gemm_json(o.json, o, backend, ceilings, points, total_s);
  return st.any_failure ? 1 : 0;
}

}  // namespace

Subcommand add_bench_gemm_command(CLI::App& bench) {
  auto o = std::make_shared<GemmOptions>();
  CLI::App* cmd = bench.add_subcommand(
      "gemm",
      "time the expert GEMMs alone (FC1 + activation + FC2 over the local experts) over model "
      "shape x precision x expert math x R (rows per expert), next to this machine's HBM "
      "bandwidth and bf16 matmul rate measured in the same run");
  cmd->footer(
      "Each point: a world-1 layer, balanced routing (every local expert exactly R rows: T = E x "
      "R / K tokens),\n--warmup rounds, then --rounds timed ones; the expert step is timed with "
      "the layer's phase timing\n(phase fc1's begin to phase fc2's end, GPU clock); the CPU "
      "executor times the whole forward.\ndocs/bench.md defines every column. Exit status: 0 ok, "
      "1 a check failed or a point errored, 2 bad options.");
  add_sweep_options(*cmd, *o);
  cmd->add_option("--rows", o->rows,
                  "comma list of R, rows per local expert (decode-like 1-64, prefill-like "
                  "256-4096); K must divide E x R")
      ->capture_default_str();
  return Subcommand{cmd, [o] { return bench_gemm(*o); }};
}

}  // namespace epmoe::tools

// `epmoe bench`: latency of the layer against the floors of the machine it runs on.
//
// Sweeps model shape × precision × combine × expert math × world × T (tokens per rank). For every
// point: warm-up rounds, then timed rounds with uniform random top-k routing; a round's latency is
// the slowest rank's forward (CUDA events around forward() on each rank's stream; wall clock on the
// CPU executor), and a point reports the median and p90 of that over its rounds. Next to each
// latency: the bytes of the experts the round touched (in the layer's precision), the FLOPs, the
// bytes that crossed NVLink, and the floors those give over the HBM bandwidth, bf16 matmul rate and
// peer bandwidth measured at the start of the same run. With --phases, each rank's layer also
// stamps the phases of its rounds on the GPU (Layer::set_phase_timing) and a point reports the p50
// of each phase on the slowest rank. docs/bench.md has the definitions; tools/sweep.hpp holds what
// this file shares with `epmoe bench gemm` (tools/bench_gemm.cpp).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "epmoe/epmoe.hpp"
#include "executor.hpp"
#include "harness/cluster.hpp"
#include "harness/problem.hpp"
#include "progress.hpp"
#include "subcommands.hpp"
#include "sweep.hpp"

namespace epmoe::tools {

namespace {

using namespace sweep;  // NOLINT(google-build-using-namespace): the shared sweep (sweep.hpp)

// `epmoe bench`'s own options beside the shared ones; its defaults.
struct BenchOptions : SweepOptions {
  std::string tokens = "0,1,16,64,128,512,2048,8192";
  std::string combines = "staged,in_kernel_reduce";
  std::string worlds = "auto";
  bool phases = false;               // Layer::set_phase_timing on every rank; per-phase p50 columns
  std::string megakernel = "false";  // comma list of true / false, or auto: the persistent round
  std::string token_back = "table";  // comma list of table, epilogue_warps, dispatch_warps
  bool graph = false;                // time CUDA-graph replays of one captured forward
  BenchOptions() {
    models = "qwen3-30b-a3b,deepseek-v3";
    precisions = "bf16,mxfp8,nvfp4";
    maths = "wgmma,tensor_core";
  }
};

// ---- what a round must move, and its floors ----

struct Traffic {
  double weight_bytes = 0, flops = 0, pairs = 0, nvlink_bytes = 0;
  double dispatched_rows = 0, returned_rows = 0;
  double hbm_floor_ms = kNaN, compute_floor_ms = kNaN, nvlink_floor_ms = kNaN;
};

// One round: `ids[r]` is rank r's [T, K] routing.
Traffic round_traffic(const std::vector<const std::vector<std::int32_t>*>& ids, const LayerShape& s,
                      int world, Precision p, Combine c, const Ceilings& ceil) {
  const std::int64_t e_local = s.num_experts / world;
  const auto k = static_cast<std::size_t>(s.top_k);
  std::vector<char> touched(static_cast<std::size_t>(s.num_experts), 0);
  std::vector<double> pairs(static_cast<std::size_t>(world), 0.0),
      out(static_cast<std::size_t>(world), 0.0), in(static_cast<std::size_t>(world), 0.0);
  const double row = static_cast<double>(harness::wire_row_bytes(p, s.hidden, s.top_k));
  const double back = static_cast<double>(s.hidden) * (c == Combine::staged ? 2.0 : 4.0);
  Traffic t;
  std::vector<char> dest(static_cast<std::size_t>(world));
  for (int src = 0; src < world; ++src) {
    const auto& rids = *ids[static_cast<std::size_t>(src)];
    for (std::size_t tok = 0; tok < rids.size() / k; ++tok) {
      std::fill(dest.begin(), dest.end(), 0);
      for (std::size_t j = 0; j < k; ++j) {
        const std::int32_t e = rids[tok * k + j];
        if (e < 0) continue;
        touched[static_cast<std::size_t>(e)] = 1;
        const auto owner = static_cast<std::size_t>(e / e_local);
        pairs[owner] += 1;
        dest[owner] = 1;
        if (static_cast<int>(owner) != src) {  // the FC2 row (or its fp32 adds) comes home
          t.returned_rows += 1;
          out[owner] += back;
          in[static_cast<std::size_t>(src)] += back;
        }
      }
      for (int d = 0; d < world; ++d)
        if (d != src && dest[static_cast<std::size_t>(d)]) {  // once per destination rank
          t.dispatched_rows += 1;
          out[static_cast<std::size_t>(src)] += row;
          in[static_cast<std::size_t>(d)] += row;
        }
    }
  }
  const double expert_bytes =
      3.0 * static_cast<double>(s.intermediate * s.hidden) * weight_bytes_per_param(p);
  const double pair_flops = 6.0 * static_cast<double>(s.intermediate * s.hidden);
  double max_rank_bytes = 0, max_rank_pairs = 0, max_link = 0;
  for (int r = 0; r < world; ++r) {
    double n = 0;
    for (std::int64_t e = r * e_local; e < (r + 1) * e_local; ++e)
      n += touched[static_cast<std::size_t>(e)];
    t.weight_bytes += n * expert_bytes;
    max_rank_bytes = std::max(max_rank_bytes, n * expert_bytes);
    max_rank_pairs = std::max(max_rank_pairs, pairs[static_cast<std::size_t>(r)]);
    t.pairs += pairs[static_cast<std::size_t>(r)];
    max_link =
        std::max({max_link, out[static_cast<std::size_t>(r)], in[static_cast<std::size_t>(r)]});
  }
  t.flops = t.pairs * pair_flops;
  t.nvlink_bytes = t.dispatched_rows * row + t.returned_rows * back;
  if (ceil.hbm_gbps > 0) t.hbm_floor_ms = max_rank_bytes / (ceil.hbm_gbps * 1e9) * 1e3;
  if (ceil.matmul_tflops > 0)
    t.compute_floor_ms = max_rank_pairs * pair_flops / (ceil.matmul_tflops * 1e12) * 1e3;
  if (world == 1)
    t.nvlink_floor_ms = 0.0;
  else if (ceil.peer_gbps > 0)
    t.nvlink_floor_ms = max_link / (ceil.peer_gbps * 1e9) * 1e3;
  return t;
}

// ---- results ----

struct Point {
  const Model* model = nullptr;
  int world = 1;
  Precision precision = Precision::bf16;
  Combine combine = Combine::staged;
  ExpertMath math = ExpertMath::exact;
  TokenCounts counts;              // every rank's T, or each rank's (--tokens 0/64)
  std::string status = "pending";  // ok | skipped | error
  std::string note;
  std::string check = "skipped";  // pass | fail | skipped (per config, repeated on its points)
  int warmup = 0;
  std::vector<double> latency_ms;  // per timed round: the slowest rank
  double p50 = kNaN, p90 = kNaN, min = kNaN;
  Traffic traffic;                 // mean over the timed rounds
  std::size_t resident_bytes = 0;  // Layer::resident_weight_bytes() of rank 0 (every rank alike)
  bool megakernel = false;         // the knobs of T's bucket ran the persistent round (CUDA)
  TokenBack token_back = TokenBack::epilogue_warps;  // the knobs of T's bucket's (what ran)
  bool show_token_back = false;                      // --token-back named a mode: the table says
  double floor_ms = kNaN;
  std::string bound;
  // --phases: per phase, the p50 over timed rounds of its duration on the round's slowest rank
  // (Layer::last_phase_times); NaN where no round stamped it.
  std::array<double, kRoundPhases> phase_p50_us;
  Point() { phase_p50_us.fill(kNaN); }
};

void finish_point(Point& pt) {
  pt.p50 = percentile(pt.latency_ms, 0.5);
  pt.p90 = percentile(pt.latency_ms, 0.9);
  pt.min = min_of(pt.latency_ms);
  const Traffic& t = pt.traffic;
  double best = kNaN;
  const std::pair<double, const char*> floors[] = {
      {t.hbm_floor_ms, "hbm"}, {t.compute_floor_ms, "mma"}, {t.nvlink_floor_ms, "nvl"}};
  for (const auto& [ms, name] : floors)
    if (!std::isnan(ms) && ms > 0 && (std::isnan(best) || ms > best)) {  // 0: no bound
      best = ms;
      pt.bound = name;
    }
  pt.floor_ms = best;
}

// ---- one config (model, world, precision, combine, math): a cluster and its T sweep ----

struct SweepState : SweepRun {
  const BenchOptions* o = nullptr;
  std::map<std::string, double> prep_s;  // layer preparation time x world, per model/precision
};

void run_config(SweepState& st, const Model& model, const ModelData& data, int world,
                Precision precision, Combine combine, ExpertMath math, bool megakernel,
                std::optional<TokenBack> token_back, std::vector<Point*>& points) {
  const BenchOptions& o = *st.o;
  const LayerShape& s = model.shape;
  ConfigPoints<Point> cp{
      st, points,
      model.label() + " W=" + std::to_string(world) + " " + to_string(precision) + " " +
          to_string(combine) + " " + to_string(math) + (megakernel ? " persistent" : "") +
          (token_back ? std::string(" token_back=") + to_string(*token_back) : std::string())};
  const std::string& what = cp.what;
  // Preparing a layer (each rank copies its experts' bf16 weights up and prepares them on its
  // GPU) is a large part of a config's cost: skip it when the time the same model and precision
  // took before, scaled by the experts each rank prepares (1 / world), no longer fits the budget.
  const std::string prep_key = model.label() + "/" + to_string(precision);
  const double prep_est = st.prep_s.count(prep_key) ? st.prep_s[prep_key] / world : 0.0;
  if (cp.over_budget(o, 0, prep_est)) return;
  LayerOptions options;
  options.combine = combine;
  options.expert_math = math;
  options.timeout_ms = o.timeout_ms;
  const ConfigCluster made = make_cluster(
      s, precision, options, world, data, st.backend,
      [=](const LayerConfig& c) { return with_tool_knobs(c, token_back, megakernel); });
  if (!made.cluster) {
    st.any_failure = true;
    cp.skip_rest(0, "error", made.error);
    return;
  }
  Cluster* cluster = made.cluster.get();
  const double prep_s = made.prep_s;
  st.prep_s[prep_key] = prep_s * world;

  const std::string check = run_check(st, o, *cluster, s, precision, options, world);
  const std::size_t resident_bytes = cluster->layer(0).resident_weight_bytes();
  for (Point* p : points) {
    p->check = check;
    p->resident_bytes = resident_bytes;
    const Knobs& knobs = cluster->layer(0).config().knobs_for(p->counts.max());
    p->megakernel = st.backend == Backend::cuda_nccl && knobs.megakernel;
    p->token_back = knobs.token_back;
    p->show_token_back = token_back.has_value();
  }
  std::fprintf(stderr, "[config] %s: layer ready in %.1f s, check %s\n", what.c_str(), prep_s,
               check.c_str());
  if (o.phases)
    for (int r = 0; r < world; ++r) cluster->layer(r).set_phase_timing(true);

  double last_ms = kNaN;
  std::int64_t last_t = 0;
  for (std::size_t pi = 0; pi < points.size(); ++pi) {
    Point& pt = *points[pi];
    const std::int64_t T = pt.counts.max();  // the largest rank's
    // Estimate this point from the last one (latency grows at most linearly in T here).
    const std::optional<RoundPlan> plan =
        cp.plan(o, pi, last_ms, last_t > 0 ? double(T) / double(last_t) : double(T));
    if (!plan) return;
    const int warmup = plan->warmup, rounds = plan->rounds;
    const std::vector<Routing> routing =
        uniform_routing(s, pt.counts, world, warmup + rounds, o.seed);
    try {
      const RoundTimes times = time_rounds(*cluster, routing, data, pt.counts, warmup, rounds,
                                           o.max_point_s, st.backend, o.phases, o.graph);
      pt.warmup = warmup;
      std::vector<Traffic> per_round;
      std::array<std::vector<double>, kRoundPhases> phase_us;  // per phase, the timed rounds'
      for (int i = warmup; i < warmup + times.timed; ++i) {
        const auto round = static_cast<std::size_t>(i);
        const std::size_t slowest = slowest_rank(times, round);
        std::vector<const std::vector<std::int32_t>*> ids;
        for (int r = 0; r < world; ++r)
          ids.push_back(&routing[static_cast<std::size_t>(i * world + r)].topk_ids);
        pt.latency_ms.push_back(times.ms[slowest][round]);
        per_round.push_back(round_traffic(ids, s, world, precision, combine, st.ceilings));
        const PhaseTimes& phases = times.phases[slowest][round];
        for (std::size_t ph = 0; ph < phase_us.size(); ++ph)
          if (phases.spans[ph].stamped) phase_us[ph].push_back(phases.spans[ph].us());
      }
      for (std::size_t ph = 0; ph < phase_us.size(); ++ph)
        pt.phase_p50_us[ph] = percentile(phase_us[ph], 0.5);
      const double n = static_cast<double>(per_round.size());
      Traffic& m = pt.traffic;
      m.hbm_floor_ms = m.compute_floor_ms = m.nvlink_floor_ms = 0;
      for (const Traffic& t : per_round) {
        m.weight_bytes += t.weight_bytes / n;
        m.flops += t.flops / n;
        m.pairs += t.pairs / n;
        m.nvlink_bytes += t.nvlink_bytes / n;
        m.dispatched_rows += t.dispatched_rows / n;
        m.returned_rows += t.returned_rows / n;
        m.hbm_floor_ms += t.hbm_floor_ms / n;  // NaN (not measured) stays NaN
        m.compute_floor_ms += t.compute_floor_ms / n;
        m.nvlink_floor_ms += t.nvlink_floor_ms / n;
      }
      pt.status = "ok";
      if (times.timed < rounds)
        pt.note = "stopped after " + std::to_string(times.timed) + " rounds (--max-point-s)";
      finish_point(pt);
      last_ms = pt.p50;
      last_t = T;
      char detail[200];
      std::snprintf(detail, sizeof detail, "%s T=%s: %.3f ms", what.c_str(),
                    pt.counts.label().c_str(), pt.p50);
      cp.done(detail);
    } catch (const std::exception& e) {
      cp.fail(pi, e, "the layer failed at an earlier T of this config");
      return;
    }
  }
}

// The phase columns of --phases (p50 us), in RoundPhase order.
constexpr const char* kPhaseColumns[kRoundPhases] = {"disp", "route", "w.cnt", "fc1",
                                                     "fc2",  "comb",  "w.done"};

void print_table(const std::vector<Point>& points, bool phases) {
  std::printf("\n%-22s %2s %-5s %-16s %-11s %5s %9s %9s %8s %6s %7s %8s %9s %-5s %7s %8s ", "model",
              "W", "prec", "combine", "math", "T", "p50 ms", "p90 ms", "wt GB", "TB/s", "TFLOPS",
              "NVL MB", "floor ms", "bound", "x floor", "res GB");
  if (phases)
    for (const char* column : kPhaseColumns) std::printf("%7s ", column);
  std::printf("check\n");
  for (const Point& p : points) {
    // --token-back: " e" / " d", the mode T's bucket ran (epilogue_warps / dispatch_warps)
    const std::string math =
        std::string(to_string(p.math)) + (p.megakernel ? "*" : "") +
        (p.show_token_back ? (p.token_back == TokenBack::epilogue_warps ? " e" : " d") : "");
    std::printf("%-22s %2d %-5s %-16s %-11s %5s ", p.model->label().c_str(), p.world,
                to_string(p.precision), to_string(p.combine), math.c_str(),
                p.counts.label().c_str());
    if (print_unless_ok(p)) continue;
    const double sec = p.p50 * 1e-3;
    const double tbps = p.traffic.weight_bytes / p.world / sec / 1e12;
    const double tflops = p.traffic.flops / p.world / sec / 1e12;
    std::printf("%9s %9s %8s %6s %7s %8s %9s %-5s %7s %8s ", fmt(p.p50).c_str(), fmt(p.p90).c_str(),
                fmt(p.traffic.weight_bytes / 1e9, "%.3f").c_str(), fmt(tbps, "%.2f").c_str(),
                fmt(tflops, "%.1f").c_str(), fmt(p.traffic.nvlink_bytes / 1e6, "%.2f").c_str(),
                fmt(p.floor_ms).c_str(), p.bound.empty() ? "-" : p.bound.c_str(),
                fmt(p.p50 / p.floor_ms, "%.1f").c_str(),
                fmt(static_cast<double>(p.resident_bytes) / 1e9, "%.3f").c_str());
    if (phases)
      for (double us : p.phase_p50_us) std::printf("%7s ", fmt(us, "%.1f").c_str());
    print_check_note(p);
  }
}

// The knob file every layer of this process loaded ($EPMOE_KNOB_FILE), or "".
std::string knob_file_in_use() {
  const char* env = std::getenv(kKnobFileEnv);
  return env == nullptr ? "" : env;
}

// The JSON's T: "tokens_per_rank": T where every rank ran T; where the ranks ran different T
// (--tokens 0/64), null and "tokens_by_rank": [T0, T1, ...], so that no reader files such a
// round under one T.
std::string tokens_per_rank(const TokenCounts& t) {
  if (!t.per_rank()) return std::to_string(t.by_rank[0]);
  std::string out = "null, \"tokens_by_rank\": [";
  for (std::size_t r = 0; r < t.by_rank.size(); ++r)
    out += (r > 0 ? ", " : "") + std::to_string(t.by_rank[r]);
  return out + "]";
}

void write_json(const std::string& path, const BenchOptions& o, Backend backend, const Ceilings& c,
                const std::vector<Point>& points, double total_s) {
  const std::string settings = std::string(", \"routing\": \"uniform top-k, 5% slots dropped\"") +
                               ", \"max_point_s\": " + json_num(o.max_point_s) +
                               ", \"phases\": " + (o.phases ? "true" : "false") +
                               ", \"knob_file\": " + json_str(knob_file_in_use()) +
                               ", \"graph\": " + (o.graph ? "true" : "false");
  write_json_file(
      path, "epmoe-bench/1", "epmoe bench", backend, c, o, settings, total_s, points.size(),
      [&](std::ostream& f, std::size_t i) {
        const Point& p = points[i];
        const double sec = p.p50 * 1e-3;
        write_point_head(f, *p.model, p.precision);
        f << ", \"combine\": " << json_str(to_string(p.combine))
          << ", \"math\": " << json_str(to_string(p.math))
          << ", \"megakernel\": " << (p.megakernel ? "true" : "false")
          << ", \"token_back\": " << json_str(to_string(p.token_back))
          << ", \"graph\": " << (o.graph ? "true" : "false") << ", \"world\": " << p.world
          << ", \"tokens_per_rank\": " << tokens_per_rank(p.counts)
          << ", \"status\": " << json_str(p.status) << ", \"note\": " << json_str(p.note)
          << ", \"check\": " << json_str(p.check) << ", \"warmup\": " << p.warmup
          << ", \"rounds\": " << p.latency_ms.size() << ", \"latency_ms_p50\": " << json_num(p.p50)
          << ", \"latency_ms_p90\": " << json_num(p.p90)
          << ", \"latency_ms_min\": " << json_num(p.min)
          << ", \"weight_bytes\": " << json_num(p.traffic.weight_bytes)
          << ", \"resident_weight_bytes_per_rank\": "
          << (p.resident_bytes > 0 ? std::to_string(p.resident_bytes) : std::string("null"))
          << ", \"flops\": " << json_num(p.traffic.flops)
          << ", \"pairs\": " << json_num(p.traffic.pairs)
          << ", \"nvlink_bytes\": " << json_num(p.traffic.nvlink_bytes)
          << ", \"dispatched_rows\": " << json_num(p.traffic.dispatched_rows)
          << ", \"returned_rows\": " << json_num(p.traffic.returned_rows)
          << ", \"eff_tbps\": " << json_num(p.traffic.weight_bytes / p.world / sec / 1e12)
          << ", \"eff_tflops\": " << json_num(p.traffic.flops / p.world / sec / 1e12)
          << ", \"hbm_floor_ms\": " << json_num(p.traffic.hbm_floor_ms)
          << ", \"compute_floor_ms\": " << json_num(p.traffic.compute_floor_ms)
          << ", \"nvlink_floor_ms\": " << json_num(p.traffic.nvlink_floor_ms)
          << ", \"floor_ms\": " << json_num(p.floor_ms) << ", \"bound\": " << json_str(p.bound);
        if (o.phases) {
          f << ", \"phases_us_p50\": {";
          for (int ph = 0; ph < kRoundPhases; ++ph)
            f << (ph ? ", " : "") << json_str(to_string(static_cast<RoundPhase>(ph))) << ": "
              << json_num(p.phase_p50_us[static_cast<std::size_t>(ph)]);
          f << "}";
        }
        f << ", \"latency_ms\": ";
        write_json_array(f, p.latency_ms);
        f << "}";
      });
}

int bench(const BenchOptions& o) {
  const auto start = Clock::now();
  validate_sweep_options(o);

  const std::vector<TokenCounts> tokens = parse_token_counts(o.tokens, "--tokens", 0);
  const std::int64_t max_tokens = std::max<std::int64_t>(1, tokens.back().max());

  std::vector<Model> models = parse_models(o);
  const std::vector<Precision> precisions = parse_precisions(o.precisions);
  std::vector<Combine> combines;
  for (const auto& c : split(o.combines)) combines.push_back(parse_combine(c, "--combines"));
  if (combines.empty()) reject("--combines: empty list");
  const std::vector<ExpertMath> maths = parse_maths(o.maths);

  // Worlds: auto = 2 and 1 (largest first), clipped to the GPUs on the CUDA executor.
  std::vector<int> worlds;
  if (o.worlds == "auto") {
    worlds = {2, 1};
  } else {
    for (const auto& w : split(o.worlds)) {
      const std::int64_t v = parse_int(w, "--worlds");
      if (v < 1 || v > kMaxWorld) reject("--worlds: " + w + " must be in [1, 64]");
      worlds.push_back(static_cast<int>(v));
    }
  }
  if (worlds.empty()) reject("--worlds: give at least one world size");
  for (const TokenCounts& t : tokens)
    for (int w : worlds)
      if (t.per_rank() && static_cast<int>(t.by_rank.size()) != w)
        reject("--tokens: " + t.label() + " gives " + std::to_string(t.by_rank.size()) +
               " ranks' T, but --worlds has " + std::to_string(w) +
               ": a per-rank T needs exactly one count per rank of every world");
  const Backend backend = choose_backend(o.executor, 1);  // auto: the GPUs when there is one
  if (o.phases && backend != Backend::cuda_nccl)
    reject("--phases: per-phase timing stamps the GPU clock; the CPU executor has none");
  if (o.graph && backend != Backend::cuda_nccl)
    reject("--graph: CUDA-graph replay needs the CUDA executor; the CPU executor has no graphs");
  if (backend == Backend::cuda_nccl) {
    const int gpus = cuda_device_count();
    std::vector<int> fit;
    for (int w : worlds)
      if (w <= gpus)
        fit.push_back(w);
      else
        std::fprintf(stderr, "epmoe bench: world %d skipped: %d GPU(s) visible\n", w, gpus);
    worlds = fit;
    if (worlds.empty()) reject("--worlds: no world size fits the visible GPUs");
  }
  const int data_world = *std::max_element(worlds.begin(), worlds.end());

  for (Model& m : models) {
    m.shape.max_tokens_per_rank = max_tokens;
    for (int w : worlds) make_config(m.shape, Precision::bf16, 0, w);  // validate before work
  }

  const bool tensor_core =
      std::find(maths.begin(), maths.end(), ExpertMath::tensor_core) != maths.end();
  const bool wgmma = std::find(maths.begin(), maths.end(), ExpertMath::wgmma) != maths.end();
  const std::vector<bool> megakernels =
      parse_megakernel_values(o.megakernel, tensor_core && backend == Backend::cuda_nccl);
  if (std::find(megakernels.begin(), megakernels.end(), true) != megakernels.end()) {
    check_megakernel_backend(true, backend);
    if (!tensor_core && !wgmma)
      reject("--megakernel=" + o.megakernel +
             ": only --math tensor_core and wgmma (mxfp8's and mxfp4's E4M3 tile) have the "
             "persistent round; add one to --math");
  }
  // --token-back: table (each bucket's, empty) or a mode asked of every bucket
  std::vector<std::optional<TokenBack>> token_backs;
  for (const std::string& v : split(o.token_back))
    token_backs.push_back(v == "table" ? std::nullopt
                                       : std::optional(parse_token_back(v, "--token-back")));
  if (token_backs.empty()) reject("--token-back: give at least one value");
  const Ceilings ceilings =
      start_sweep(o, backend, "epmoe bench: executor " + describe_backend(backend, data_world));

  // Points, in the order they run: world (largest first), precision, combine, math, model, T. A
  // --budget-s cut therefore drops the least central configs first.
  struct Config {
    std::size_t model;
    int world;
    Precision precision;
    Combine combine;
    ExpertMath math;
    bool megakernel;
    std::optional<TokenBack> token_back;
    std::vector<std::size_t> points;
  };
  std::vector<Point> points;
  std::vector<Config> configs;
  for (int w : worlds)
    for (Precision p : precisions)
      for (Combine c : combines)
        for (ExpertMath x : maths)
          for (const bool mk : megakernels)
            for (const std::optional<TokenBack>& tb : token_backs)
              for (std::size_t m = 0; m < models.size(); ++m) {
                // The CUDA mma.sync backend refuses fp8_block128 (its fp32 block scales are not
                // exact in bf16; docs/formats.md): that config is left out, not failed. So are the
                // persistent round's configs of the maths that have none.
                if (backend == Backend::cuda_nccl && p == Precision::fp8_block128 &&
                    x == ExpertMath::tensor_core)
                  continue;
                if (mk) {  // (a config make_config refuses fails in run_config, as without mk)
                  LayerOptions options;
                  options.expert_math = x;
                  options.combine = c;
                  bool has_one = false;
                  try {
                    has_one = any_persistent_round(make_config(models[m].shape, p, 0, w, options));
                  } catch (const Error&) {
                  }
                  if (!has_one) continue;
                }
                Config cfg{m, w, p, c, x, mk, tb, {}};
                for (const TokenCounts& t : tokens) {
                  Point pt;
                  pt.model = &models[m];
                  pt.world = w;
                  pt.precision = p;
                  pt.combine = c;
                  pt.math = x;
                  pt.counts = t;
                  cfg.points.push_back(points.size());
                  points.push_back(pt);
                }
                configs.push_back(cfg);
              }

  ModelDataCache data(models, data_world, o.seed);
  Progress progress("bench", static_cast<std::int64_t>(points.size()));
  SweepState st{{backend, ceilings, start, &progress}, &o, {}};
  for (Config& cfg : configs) {
    std::vector<Point*> pts = points_at(points, cfg.points);
    run_config(st, models[cfg.model], data.get(cfg.model), cfg.world, cfg.precision, cfg.combine,
               cfg.math, cfg.megakernel, cfg.token_back, pts);
  }
  progress.finish();
  const double total_s = seconds_since(start);

  print_table(points, o.phases);
  std::printf(
      "\nW = ranks (GPUs); T = tokens per rank; p50/p90 over rounds of the slowest rank's forward; "
      "wt GB = expert weights the round touched (layer precision); TB/s, TFLOPS per GPU; NVL MB = "
      "bytes across ranks; floor = max(hbm, mma, nvl) floors; total %.0f s\n",
      total_s);
  if (o.graph) std::printf("every point: CUDA-graph replays of one captured forward (--graph)\n");
  if (std::any_of(points.begin(), points.end(), [](const Point& p) { return p.megakernel; }))
    std::printf("math* = the persistent round (--megakernel): one launch per forward\n");
  if (std::any_of(points.begin(), points.end(), [](const Point& p) { return p.show_token_back; }))
    std::printf(
        "math e / d = the token-back mode T's bucket ran (--token-back; where a bucket has one, "
        "its own): e = epilogue_warps (FC2 sends home), d = dispatch_warps (the home kernel)\n");
  if (o.phases)
    std::printf(
        "phases (--phases): p50 us over rounds on the round's slowest rank, from its GPU clock: "
        "disp = dispatch, route (holds w.cnt = the wait for counts), fc1, fc2, comb = combine "
        "(holds w.done = the wait for dones)\n");
  if (!o.json.empty()) write_json(o.json, o, backend, ceilings, points, total_s);
  return st.any_failure ? 1 : 0;
}

}  // namespace

Subcommand add_bench_command(CLI::App& parent) {
  auto o = std::make_shared<BenchOptions>();
  CLI::App* cmd = parent.add_subcommand(
      "bench",
      "time the layer over model shape x precision x combine x expert math x world x T, next to "
      "the floors of this machine (HBM, bf16 matmul, NVLink) measured in the same run");
  cmd->footer(
      "Each point: --warmup rounds, then --rounds timed rounds (uniform random top-k); a round's "
      "latency is the\nslowest rank's forward (CUDA events); p50/p90 over rounds. Points whose "
      "estimated time exceeds\n--max-point-s run fewer rounds or are skipped (and say so). "
      "docs/bench.md defines every column.\nExit status: 0 ok, 1 a check failed or a point "
      "errored, 2 bad options.");
  add_sweep_options(*cmd, *o);
  cmd->add_option("--tokens", o->tokens,
                  "comma list of T (tokens per rank), or of T0/T1/... (each rank's T: 0/64 is "
                  "rank 0 idle, rank 1 at 64; needs one count per rank of every --worlds)")
      ->capture_default_str();
  cmd->add_option("--combines", o->combines, "comma list of staged, in_kernel_reduce")
      ->capture_default_str();
  cmd->add_option("--worlds", o->worlds,
                  "comma list of ranks (GPUs); auto = 2,1 clipped to the visible GPUs")
      ->capture_default_str();
  cmd->add_option("--megakernel", o->megakernel,
                  "comma list of true / false, or auto (both with --math tensor_core on the CUDA "
                  "executor): the configs that have one (tensor_core; wgmma's mxfp8 and mxfp4, in "
                  "the buckets of its E4M3 tile) also or only as the persistent round, one launch "
                  "per forward (CUDA executor; docs/design.md 4.3); the table marks its math with "
                  "*")
      ->capture_default_str();
  cmd->add_option("--token-back", o->token_back,
                  "comma list of table, epilogue_warps, dispatch_warps: the token-back mode asked "
                  "of every bucket (with_knobs keeps it where the bucket runs either mode, wgmma's "
                  "E4M3 tile, and gives other buckets their one mode); the table marks the mode "
                  "that ran, the JSON has token_back")
      ->capture_default_str();
  cmd->add_flag("--graph", o->graph,
                "time CUDA-graph replays: each rank captures one forward per point, then each "
                "round copies its routing in and replays it (CUDA executor); the JSON says graph");
  cmd->add_flag("--phases", o->phases,
                "also time each phase of a round on the GPU (Layer::set_phase_timing): p50 us "
                "columns per phase on the slowest rank, and phases_us_p50 in the JSON (CUDA only)");
  // `epmoe bench gemm`: the expert GEMMs alone (tools/bench_gemm.cpp).
  const Subcommand gemm = add_bench_gemm_command(*cmd);
  return Subcommand{cmd, [o, gemm] { return gemm.app->parsed() ? gemm.run() : bench(*o); }};
}

}  // namespace epmoe::tools

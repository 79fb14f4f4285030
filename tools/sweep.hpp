// What `epmoe bench` (tools/bench.cpp: the whole layer) and `epmoe bench gemm`
// (tools/bench_gemm.cpp: the expert GEMMs alone) share: the options every sweep has, model
// shapes and their random data, the ceilings of the machine (HBM copy, peer copy, bf16 matmul)
// measured at the start of a run, the timed rounds of a cluster of rank threads (CUDA events, or
// wall clock on the CPU executor; per-phase GPU times with Layer::set_phase_timing), the one-round
// check against the emulating reference, the round-count rule of --max-point-s, and the helpers of
// the table and the JSON (schema epmoe-bench/1 and epmoe-bench-gemm/1 share their head).
#pragma once

#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "epmoe/epmoe.hpp"
#include "format_bytes.hpp"
#include "harness/cluster.hpp"
#include "harness/problem.hpp"
#include "progress.hpp"

namespace epmoe::tools::sweep {

using Clock = std::chrono::steady_clock;
inline constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

double seconds_since(Clock::time_point t);
[[noreturn]] void reject(const std::string& message);  // Error(invalid_argument)

// The options of every sweep; each command sets its own defaults before add_sweep_options.
struct SweepOptions {
  std::string models;
  std::int64_t experts = 0;  // cap on every model's experts (0 = none)
  std::string precisions;
  std::string maths;  // LayerOptions::expert_math
  std::string executor = "auto";
  int warmup = 2;
  int rounds = 10;
  double max_point_s = 8.0;
  double budget_s = 0.0;
  std::string check = "auto";
  bool no_check = false;
  std::int64_t check_tokens = 1;
  std::uint64_t seed = 1;
  std::uint32_t timeout_ms = 60'000;
  std::string json;
  double hbm_gbps = 0.0, peer_gbps = 0.0, matmul_tflops = 0.0;  // 0 = measure
  bool no_measure = false;
};
void add_sweep_options(CLI::App& cmd, SweepOptions& o);
// --warmup, --rounds and --check, or reject naming the option.
void validate_sweep_options(const SweepOptions& o);

std::vector<std::string> split(const std::string& text);  // comma list, empty items dropped
// `--megakernel` of tune and bench: a comma list of true / false, or auto (both where
// `auto_both`, else false). Rejects anything else, and an empty list.
std::vector<bool> parse_megakernel_values(const std::string& text, bool auto_both);
std::int64_t parse_int(const std::string& text, const std::string& what);
// A comma list of counts (--tokens, --rows), sorted and unique, each >= `min`, at least one, or
// reject: "OPTION: X must be >= MIN<unit>", "OPTION: give at least one NAME<unit>".
std::vector<std::int64_t> parse_counts(const std::string& text, const std::string& option,
                                       std::int64_t min, const std::string& name,
                                       const std::string& unit = "");

// A point's T: one count for every rank, or one count per rank ("0/64": rank 0 idle while rank 1
// runs 64 tokens, as ranks under DP attention do).
struct TokenCounts {
  std::vector<std::int64_t> by_rank;  // one entry: every rank's
  std::int64_t of(int rank) const {
    return by_rank.size() == 1 ? by_rank[0] : by_rank[static_cast<std::size_t>(rank)];
  }
  std::int64_t max() const;
  bool per_rank() const { return by_rank.size() > 1; }
  std::string label() const;  // "64", or "0/64"
};
// --tokens: a comma list of T, or of T0/T1/... (one per rank), each >= min; sorted by their
// largest T, then as written; duplicates dropped.
std::vector<TokenCounts> parse_token_counts(const std::string& text, const std::string& option,
                                            std::int64_t min);
std::vector<Precision> parse_precisions(const std::string& text);  // --precisions
std::vector<ExpertMath> parse_maths(const std::string& text);      // --math

// ---- models: NAME[:EXPERTS], NAME a known model or `tiny` ----

struct Model {
  std::string name;
  std::int64_t model_experts = 0;  // the real model's expert count
  LayerShape shape;                // num_experts possibly reduced; max_tokens set later
  std::string label() const;       // "deepseek-v3 E32/256" when reduced
};
Model parse_model(const std::string& spec, std::int64_t experts_cap);
std::vector<Model> parse_models(const SweepOptions& o);  // --models with --experts

// Weights (harness::make_random_weights) and x rows (U(-1, 1)) for each rank at the largest T;
// both kept for every config of the model.
struct ModelData {
  reference::LayerWeights weights;
  std::vector<std::vector<std::uint16_t>> x;  // per rank: [max_tokens, H]
};
// Draws them and prints a `[weights]` line.
std::unique_ptr<ModelData> make_model_data(const Model& m, int max_world, std::uint64_t seed);

// Each model's data, drawn when the first config of the model runs (seed + the model's index).
class ModelDataCache {
 public:
  ModelDataCache(const std::vector<Model>& models, int max_world, std::uint64_t seed)
      : models_(models), max_world_(max_world), seed_(seed) {}
  const ModelData& get(std::size_t model);

 private:
  const std::vector<Model>& models_;
  int max_world_;
  std::uint64_t seed_;
  std::map<std::size_t, std::unique_ptr<ModelData>> data_;
};

using tools::weight_bytes_per_param;  // format_bytes.hpp

// ---- ceilings: measured at the start of the run (CUDA executor), or given ----

struct Ceilings {
  double hbm_gbps = 0.0;       // device-to-device copy, bytes read + written
  double peer_gbps = 0.0;      // GPU 0 -> GPU 1, one direction
  double matmul_tflops = 0.0;  // bf16 x bf16 -> fp32 accumulate
  std::string hbm_how, peer_how, matmul_how;
};
Ceilings measure_ceilings(const SweepOptions& o, Backend backend);
void print_ceilings(const Ceilings& c);  // the `ceilings:` line on stdout
std::vector<std::string> gpu_names();

// The state of a running sweep that every config reads (executor, ceilings, start) and reports
// to (the progress line, points done, whether any failed).
struct SweepRun {
  Backend backend = Backend::cpu_threads;
  Ceilings ceilings;
  Clock::time_point start;
  Progress* progress = nullptr;
  std::int64_t done = 0;
  bool any_failure = false;
};

// The line naming the executor (`executor_line`, on stdout), then the ceilings, measured or
// given, and their line.
Ceilings start_sweep(const SweepOptions& o, Backend backend, const std::string& executor_line);

// ---- timing ----

double percentile(std::vector<double> v, double q);
double min_of(const std::vector<double>& v);  // NaN when empty

// Every rank runs `warmup + rounds` forwards of T tokens with a host barrier before each (so a
// rank's host work never counts against its peers); per-rank latencies per round.
using Routing = harness::RoutingTable;
struct RoundTimes {
  std::vector<std::vector<double>> ms;          // [rank][round]
  std::vector<std::vector<PhaseTimes>> phases;  // [rank][round] (phases; else empty times)
  int timed = 0;                                // rounds actually timed (may stop early: cap_s)
};
// `routing[round * W + rank]`; `phases`: read Layer::last_phase_times() after each round (CUDA).
// `graph` (CUDA): every rank captures one forward of T tokens into a CUDA graph first, and each
// round replays it (cudaGraphLaunch between the events) with that round's routing copied in.
RoundTimes time_rounds(Cluster& cluster, const std::vector<Routing>& routing, const ModelData& data,
                       const TokenCounts& tokens, int warmup, int rounds, double cap_s,
                       Backend backend, bool phases, bool graph = false);
// The rank whose forward took longest in `round` (the round's latency is that rank's).
std::size_t slowest_rank(const RoundTimes& times, std::size_t round);
// Uniform random top-k for `rounds` rounds of `world` ranks at their T, in time_rounds' order
// (routing[round * W + rank]), drawn as harness::make_random_batch draws it; each draw's seed
// depends on (seed, the rank's T, round, rank) only, so every config of a sweep sees the same
// rounds.
std::vector<Routing> uniform_routing(const LayerShape& s, const TokenCounts& tokens, int world,
                                     int rounds, std::uint64_t seed);

// How many rounds a point runs, from the previous point's p50 scaled linearly by `scale` (this
// point's size over the previous one's): all of them, fewer (at least 3 timed, 1 warm-up) to fit
// --max-point-s, or none (skip: `note` says why).
struct RoundPlan {
  int warmup = 0, rounds = 0;
  bool skip = false;
  std::string note;
};
RoundPlan plan_rounds(const SweepOptions& o, double last_ms, double scale);

// ---- one config: its cluster, its check, its points ----

// A config's cluster (a layer per rank), or why there is none: `error` ("layer creation: ..."),
// `unsupported` where the backend refuses the precision or shape (ErrorCode::unsupported).
struct ConfigCluster {
  std::unique_ptr<Cluster> cluster;
  std::string error;
  bool unsupported = false;
  double prep_s = 0.0;  // the time it took
};
// `tune`: Cluster's (each rank's config turned into the one its layer is created with).
ConfigCluster make_cluster(const LayerShape& s, Precision precision, const LayerOptions& options,
                           int world, const ModelData& data, Backend backend,
                           const Cluster::Tune& tune = {});

// The points of one config (P: a point type with `status` and `note`) and its label: every point
// that ends is counted on the progress line.
template <class P>
struct ConfigPoints {
  SweepRun& st;
  std::vector<P*>& points;
  std::string what;

  void done(const std::string& detail) { st.progress->update(++st.done, detail); }
  // Points [from, end): `status` with `note`.
  void skip_rest(std::size_t from, const std::string& status, const std::string& note) {
    for (std::size_t i = from; i < points.size(); ++i) {
      points[i]->status = status;
      points[i]->note = note;
      done(what);
    }
  }
  // Past --budget-s with `ahead_s` still to spend: points [from, end) skipped, and true.
  bool over_budget(const SweepOptions& o, std::size_t from, double ahead_s = 0.0) {
    if (o.budget_s <= 0 || seconds_since(st.start) + ahead_s <= o.budget_s) return false;
    skip_rest(from, "skipped", "over --budget-s");
    return true;
  }
  // Point pi's rounds (plan_rounds), or nullopt with [pi, end) skipped (budget or estimate).
  std::optional<RoundPlan> plan(const SweepOptions& o, std::size_t pi, double last_ms,
                                double scale) {
    if (over_budget(o, pi)) return std::nullopt;
    RoundPlan p = plan_rounds(o, last_ms, scale);
    if (!p.skip) return p;
    skip_rest(pi, "skipped", p.note);
    return std::nullopt;
  }
  // Point pi failed: an error, and so are the config's later points (`rest` says why).
  void fail(std::size_t pi, const std::exception& e, const std::string& rest) {
    st.any_failure = true;
    points[pi]->status = "error";
    points[pi]->note = e.what();
    done(what);
    skip_rest(pi + 1, "error", rest);
  }
};

// The points of `all` at `index`.
template <class P>
std::vector<P*> points_at(std::vector<P>& all, const std::vector<std::size_t>& index) {
  std::vector<P*> out;
  for (std::size_t i : index) out.push_back(&all[i]);
  return out;
}

// ---- the check: one round per config against the emulating reference ----

// Whether the check runs (--check, --no-check, --check-tokens; auto: only where the host
// reference is quick).
bool check_wanted(const SweepOptions& o, const LayerShape& s, int world);
// One round on `tokens` tokens per rank against the emulating reference, with the rule of the
// layer's combine and expert math (reference::check_output): "pass" or "fail (...)".
std::string check_config(Cluster& cluster, const LayerShape& s, Precision precision,
                         const LayerOptions& options, std::int64_t tokens, std::uint64_t seed);
// check_config on --check-tokens where check_wanted ("skipped" where not, "error: ..." where it
// threw); anything but "pass" marks the run failed.
std::string run_check(SweepRun& st, const SweepOptions& o, Cluster& cluster, const LayerShape& s,
                      Precision precision, const LayerOptions& options, int world);

// ---- table and JSON ----

std::string fmt(double v, const char* f = "%.3f");  // "-" for NaN
std::string json_num(double v);                     // null for NaN / inf
std::string json_str(const std::string& s);
// `{`, then schema, tool, executor, gpus and ceilings, each line ending with a comma.
void write_json_head(std::ostream& f, const char* schema, const char* tool, Backend backend,
                     const Ceilings& c);
// The whole document at `path` (or reject --json=PATH): the head; settings (warmup, rounds, seed,
// then `settings`: `, "key": value` pairs); total_s; the points, `point(f, i)` writing point i's
// object; then "wrote PATH" on stdout.
void write_json_file(const std::string& path, const char* schema, const char* tool, Backend backend,
                     const Ceilings& c, const SweepOptions& o, const std::string& settings,
                     double total_s, std::size_t points,
                     const std::function<void(std::ostream&, std::size_t)>& point);
// A point's object up to its precision: `{"impl": "epmoe", "model": ..., "precision": ...`.
void write_point_head(std::ostream& f, const Model& m, Precision precision);
// `[v, ...]` (json_num each).
void write_json_array(std::ostream& f, const std::vector<double>& values);

// A table row's end for a point that is not ok ("status: note", and true), else false.
template <class P>
bool print_unless_ok(const P& p) {
  if (p.status == "ok") return false;
  std::printf("%s: %s\n", p.status.c_str(), p.note.c_str());
  return true;
}
// An ok row's end: its check, then its note.
template <class P>
void print_check_note(const P& p) {
  std::printf("%s%s%s\n", p.check.c_str(), p.note.empty() ? "" : "  ", p.note.c_str());
}

}  // namespace epmoe::tools::sweep

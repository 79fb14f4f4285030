// `epmoe tune`: measures the knob candidates of one layer (model shape, precision, world, expert
// math) on the ranks at hand and writes the winners as a knob file (docs/tuning.md#epmoe-tune).
//
// For each candidate — the knobs the running code reads (num_sms; dispatch_warps and token_back
// where given; block_m / block_n under expert_math=wgmma; megakernel, both paths by default under
// tensor_core, true only where a bucket has a persistent round, as wgmma's E4M3 tile's), every
// value given, applied to every bucket through with_knobs and deduplicated after its adjustments —
// one cluster is created and checked once against the emulating reference, then each bucket's T is
// timed as `epmoe bench` times a point (warm-up rounds, then timed rounds of uniform random
// routing; a round's latency is the slowest rank's forward). A bucket's winner is the checked
// candidate with the lowest p50; knobs that are no candidate keep the table's values. The ranks are
// threads of this one process, so the winner is chosen once and every rank loads the same file. The
// file's comment lines say how each bucket was measured.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "epmoe/epmoe.hpp"
#include "executor.hpp"
#include "subcommands.hpp"
#include "sweep.hpp"

namespace epmoe::tools {

namespace {

using namespace sweep;  // NOLINT(google-build-using-namespace): the shared sweep (sweep.hpp)

struct TuneOptions {
  std::string model = "qwen3-30b-a3b";
  std::int64_t experts = 0;
  std::string precision = "bf16";
  std::string math = "wgmma";
  std::string combine = "staged";
  int ranks = 2;
  std::string executor = "auto";
  std::string tokens = "1,64,512,8192";
  std::string num_sms = "0";
  std::string block_m = "64,128,256";
  std::string block_n = "128,256";
  std::string dispatch_warps;  // empty: each bucket's table value
  std::string token_back;      // empty: each bucket's table value
  std::string megakernel = "auto";
  int warmup = 3;
  int rounds = 20;
  std::uint64_t seed = 1;
  std::uint32_t timeout_ms = 60'000;
  std::string out;
  std::string command;  // the command line, for the file's comment
};

// The knob fields a candidate sets; the rest of each bucket's knobs stay the table's.
struct Asked {
  std::int32_t block_m = 0, block_n = 0, num_sms = 0;
  std::int32_t dispatch_warps = 0;      // 0: the table's
  std::optional<TokenBack> token_back;  // empty: the table's
  bool megakernel = false;
};
struct Candidate {
  Asked asked;
  std::array<Knobs, kNumTokenBuckets> knobs{};  // what runs, after with_knobs' adjustments
  std::string check = "skipped";
  std::array<double, kNumTokenBuckets> p50{};  // NaN where the bucket was not timed
  std::string error;
};

std::string knob_label(const Knobs& k, ExpertMath math) {
  std::string s = "num_sms=" + std::to_string(k.num_sms) +
                  " dispatch_warps=" + std::to_string(k.dispatch_warps);
  if (math == ExpertMath::wgmma)
    s = "block_m=" + std::to_string(k.block_m) + " block_n=" + std::to_string(k.block_n) + " " + s +
        " token_back=" + to_string(k.token_back);
  if (k.megakernel) s += " megakernel=true";
  return s;
}

// `config` with the candidate's fields in every bucket (the bucket's other knobs kept); megakernel
// only where the bucket, with the candidate's tile, has a persistent round (has_persistent_round).
LayerConfig apply(const LayerConfig& config, const Asked& c) {
  LayerConfig out = config;
  for (int b = 0; b < kNumTokenBuckets; ++b) {
    const auto bucket = static_cast<TokenBucket>(b);
    Knobs k = out.knobs(bucket);
    k.block_m = c.block_m;
    k.block_n = c.block_n;
    k.num_sms = c.num_sms;
    if (c.dispatch_warps > 0) k.dispatch_warps = c.dispatch_warps;
    if (c.token_back) k.token_back = *c.token_back;  // kept only where a bucket runs either mode
    k.megakernel = false;
    out = with_knobs(out, k, bucket);
    if (c.megakernel && has_persistent_round(out, bucket)) {
      k = out.knobs(bucket);
      k.megakernel = true;
      out = with_knobs(out, k, bucket);
    }
  }
  return out;
}

std::vector<std::int32_t> parse_knob_values(const std::string& text, const std::string& option) {
  std::vector<std::int32_t> out;
  for (const auto& v : split(text)) out.push_back(static_cast<std::int32_t>(parse_int(v, option)));
  if (out.empty()) reject(option + ": give at least one value");
  return out;
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
  return buf;
}

int tune(const TuneOptions& o) {
  if (const char* env = std::getenv(kKnobFileEnv); env != nullptr && *env != '\0')
    reject(std::string("$") + kKnobFileEnv + "=" + env +
           " is set: every layer would load it over the candidates; unset it to tune");
  SweepOptions so;  // what tune shares with the sweeps: the round counts, and the check's settings
  so.warmup = o.warmup;
  so.rounds = o.rounds;
  so.seed = o.seed;
  so.check_tokens = 1;  // one token per rank, where the host reference is quick (check auto)
  validate_sweep_options(so);
  if (o.ranks < 1 || o.ranks > kMaxWorld)
    reject("--ranks=" + std::to_string(o.ranks) + ": must be in [1, 64]");
  const Precision precision = parse_precision(o.precision, "--precision");
  LayerOptions options;
  options.expert_math = parse_expert_math(o.math, "--math");
  options.combine = parse_combine(o.combine, "--combine");
  options.timeout_ms = o.timeout_ms;

  // One T per bucket.
  const std::vector<std::int64_t> tokens = parse_counts(o.tokens, "--tokens", 1, "T");
  std::array<std::int64_t, kNumTokenBuckets> bucket_t{};  // 0 = not tuned
  for (std::int64_t t : tokens) {
    const int b = static_cast<int>(token_bucket(t));
    if (bucket_t[static_cast<std::size_t>(b)] != 0)
      reject("--tokens: " + std::to_string(bucket_t[static_cast<std::size_t>(b)]) + " and " +
             std::to_string(t) + " are both in bucket " + to_string(static_cast<TokenBucket>(b)) +
             ": give one T per bucket (decode <= 16, small <= 128, medium <= 1024, prefill)");
    bucket_t[static_cast<std::size_t>(b)] = t;
  }

  Model model = parse_model(o.model, o.experts);
  model.shape.max_tokens_per_rank = tokens.back();
  const LayerConfig base = make_config(model.shape, precision, 0, o.ranks, options);
  const Backend backend = choose_backend(o.executor, o.ranks);
  const std::string out = o.out.empty() ? model.name + "-" + o.precision + "-w" +
                                              std::to_string(o.ranks) + "-" + o.math + ".knobs"
                                        : o.out;

  // Candidates: the read fields' values; block_m / block_n only where the expert math reads them.
  const bool tiles = options.expert_math == ExpertMath::wgmma;
  const Knobs& first = base.knobs(TokenBucket::decode);
  const std::vector<std::int32_t> ms =
      tiles ? parse_knob_values(o.block_m, "--block-m") : std::vector<std::int32_t>{first.block_m};
  const std::vector<std::int32_t> ns =
      tiles ? parse_knob_values(o.block_n, "--block-n") : std::vector<std::int32_t>{first.block_n};
  // megakernel: both paths where the CUDA executor has a persistent round (tensor_core), unless
  // given.
  const std::vector<bool> megakernels =
      parse_megakernel_values(o.megakernel, options.expert_math == ExpertMath::tensor_core);
  const std::vector<std::int32_t> dws =
      o.dispatch_warps.empty() ? std::vector<std::int32_t>{0}
                               : parse_knob_values(o.dispatch_warps, "--dispatch-warps");
  std::vector<std::optional<TokenBack>> tbs;
  for (const std::string& v : split(o.token_back))
    tbs.emplace_back(parse_token_back(v, "--token-back"));
  if (tbs.empty()) tbs.emplace_back();
  std::vector<Candidate> candidates;
  for (std::int32_t sms : parse_knob_values(o.num_sms, "--num-sms"))
    for (std::int32_t dw : dws)
      for (const std::optional<TokenBack>& tb : tbs)
        for (std::int32_t m : ms)
          for (std::int32_t n : ns)
            for (const bool mk : megakernels) {
              Candidate c;
              c.asked = {m, n, sms, dw, tb, mk};
              const LayerConfig applied =
                  apply(base, c.asked);  // rejects values outside kKnobSpace
              for (int b = 0; b < kNumTokenBuckets; ++b)
                c.knobs[static_cast<std::size_t>(b)] = applied.knobs(static_cast<TokenBucket>(b));
              c.p50.fill(kNaN);
              const bool seen = std::any_of(candidates.begin(), candidates.end(),
                                            [&](const Candidate& d) { return d.knobs == c.knobs; });
              if (!seen) candidates.push_back(c);
            }

  std::printf("epmoe tune: %s, precision %s, world %d, expert_math %s, combine %s; executor %s\n",
              model.label().c_str(), o.precision.c_str(), o.ranks, o.math.c_str(),
              o.combine.c_str(), describe_backend(backend, o.ranks).c_str());
  std::printf(
      "%zu candidate(s) (after with_knobs' adjustments), %d warm-up + %d timed rounds per "
      "bucket\n",
      candidates.size(), o.warmup, o.rounds);
  if (backend == Backend::cpu_threads)
    std::printf(
        "note: the CPU executor reads no knob: its candidates differ by noise only; the "
        "file it writes is valid but tunes nothing\n");

  const auto start = Clock::now();
  const std::unique_ptr<ModelData> data = make_model_data(model, o.ranks, o.seed);
  Progress progress("tune", static_cast<std::int64_t>(candidates.size()));
  SweepRun st{backend, {}, start, &progress};
  for (Candidate& c : candidates) {
    const ConfigCluster made =
        make_cluster(model.shape, precision, options, o.ranks, *data, backend,
                     [&](const LayerConfig& config) { return apply(config, c.asked); });
    if (!made.cluster) {
      c.error = made.error;
      progress.update(++st.done, "error");
      continue;
    }
    c.check = run_check(st, so, *made.cluster, model.shape, precision, options, o.ranks);
    for (int b = 0; b < kNumTokenBuckets && c.error.empty(); ++b) {
      const std::int64_t t = bucket_t[static_cast<std::size_t>(b)];
      if (t == 0) continue;
      try {
        const std::vector<Routing> routing =
            uniform_routing(model.shape, TokenCounts{{t}}, o.ranks, o.warmup + o.rounds, o.seed);
        const RoundTimes times = time_rounds(*made.cluster, routing, *data, TokenCounts{{t}},
                                             o.warmup, o.rounds, 1e9, backend, false);
        std::vector<double> ms_rounds;
        for (int i = o.warmup; i < o.warmup + times.timed; ++i) {
          const auto round = static_cast<std::size_t>(i);
          ms_rounds.push_back(times.ms[slowest_rank(times, round)][round]);
        }
        c.p50[static_cast<std::size_t>(b)] = percentile(ms_rounds, 0.5);
      } catch (const std::exception& e) {
        c.error = e.what();
      }
    }
    progress.update(++st.done, knob_label(c.knobs[0], options.expert_math));
  }
  progress.finish();

  // The table, and each bucket's winner among the candidates that ran and passed their check
  // (or were not checked).
  std::printf("\n%-40s %-8s", "candidate (every bucket)", "check");
  for (int b = 0; b < kNumTokenBuckets; ++b)
    if (bucket_t[static_cast<std::size_t>(b)] != 0)
      std::printf(" %8s T=%-6lld", to_string(static_cast<TokenBucket>(b)),
                  static_cast<long long>(bucket_t[static_cast<std::size_t>(b)]));
  std::printf("\n");
  std::array<int, kNumTokenBuckets> winner{};
  winner.fill(-1);
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    const Candidate& c = candidates[i];
    const bool eligible = c.error.empty() && (c.check == "pass" || c.check == "skipped");
    for (std::size_t b = 0; b < kNumTokenBuckets; ++b)
      if (eligible && !std::isnan(c.p50[b]) &&
          (winner[b] < 0 || c.p50[b] < candidates[static_cast<std::size_t>(winner[b])].p50[b]))
        winner[b] = static_cast<int>(i);
  }
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    const Candidate& c = candidates[i];
    std::printf("%-40s %-8s", knob_label(c.knobs[0], options.expert_math).c_str(),
                c.check.substr(0, 8).c_str());
    for (std::size_t b = 0; b < kNumTokenBuckets; ++b)
      if (bucket_t[b] != 0)
        std::printf(" %8s ms%s     ", fmt(c.p50[b]).c_str(),
                    winner[b] == static_cast<int>(i) ? "*" : " ");
    if (!c.error.empty()) std::printf("  error: %s", c.error.c_str());
    std::printf("\n");
  }
  std::printf("p50 over the timed rounds of the slowest rank's forward; * = the bucket's winner\n");

  // The file: the table's knobs, each tuned bucket's read fields from its winner.
  LayerConfig tuned = base;
  std::string notes =
      "# " + o.command + "\n# measured " + utc_now() + " on " + describe_backend(backend, o.ranks);
  for (const std::string& gpu : gpu_names()) notes += ", " + gpu;
  notes += "\n";
  bool missing = false;
  for (std::size_t b = 0; b < kNumTokenBuckets; ++b) {
    const auto bucket = static_cast<TokenBucket>(b);
    if (bucket_t[b] == 0) {
      notes += std::string("# ") + to_string(bucket) + ": not tuned (the built-in table's)\n";
      continue;
    }
    if (winner[b] < 0) {
      missing = true;
      notes += std::string("# ") + to_string(bucket) +
               ": no candidate ran and passed its check (the built-in table's)\n";
      continue;
    }
    const Candidate& w = candidates[static_cast<std::size_t>(winner[b])];
    tuned = with_knobs(tuned, w.knobs[b], bucket);
    double second = kNaN;
    for (std::size_t i = 0; i < candidates.size(); ++i)
      if (static_cast<int>(i) != winner[b] && !std::isnan(candidates[i].p50[b]) &&
          (std::isnan(second) || candidates[i].p50[b] < second))
        second = candidates[i].p50[b];
    char line[256];
    std::snprintf(line, sizeof line,
                  "# %s: T=%lld, p50 %s ms over %d rounds, %zu candidate(s)%s%s\n",
                  to_string(bucket), static_cast<long long>(bucket_t[b]), fmt(w.p50[b]).c_str(),
                  o.rounds, candidates.size(), std::isnan(second) ? "" : ", next best ",
                  std::isnan(second) ? "" : (fmt(second) + " ms").c_str());
    notes += line;
  }
  std::string text = knob_file_text(tuned);
  text.insert(text.find('\n') + 1, notes);
  {
    std::ofstream file(out);
    file << text;
    if (!file) reject("--out=" + out + ": cannot be written");
  }
  // What a layer will load from it is what was chosen.
  const LayerConfig loaded = with_knob_file(base, out);
  for (int b = 0; b < kNumTokenBuckets; ++b) {
    const auto bucket = static_cast<TokenBucket>(b);
    if (!(loaded.knobs(bucket) == tuned.knobs(bucket)))
      throw Error(ErrorCode::internal,
                  "epmoe tune: " + out + " reads back other knobs for bucket " + to_string(bucket));
  }
  std::printf("wrote %s (load it with %s=%s); %.0f s\n", out.c_str(), kKnobFileEnv, out.c_str(),
              seconds_since(start));
  return st.any_failure || missing ? 1 : 0;
}

}  // namespace

Subcommand add_tune_command(CLI::App& parent, int argc, char** argv) {
  auto o = std::make_shared<TuneOptions>();
  for (int i = 0; i < argc; ++i) o->command += (i ? " " : "") + std::string(argv[i]);
  CLI::App* cmd = parent.add_subcommand(
      "tune",
      "time the knob candidates of one layer on the ranks at hand and write the winners per token "
      "bucket as a knob file (load it with $EPMOE_KNOB_FILE)");
  cmd->footer(
      "Candidates: every combination of --num-sms, --dispatch-warps and --token-back (if given), "
      "and under --math wgmma --block-m x --block-n, "
      "applied with\nwith_knobs (duplicates after its adjustments dropped). Each is checked once "
      "against the emulating\nreference, then each T of --tokens (one per bucket) is timed; the "
      "lowest p50 of the slowest rank wins\nits bucket. docs/tuning.md#epmoe-tune. Exit status: 0 "
      "ok, 1 a check failed or a bucket has no winner,\n2 bad options.");
  cmd->add_option("--model", o->model,
                  "qwen3-30b-a3b | deepseek-v3 | gpt-oss-120b | mixtral-8x7b | tiny")
      ->capture_default_str();
  cmd->add_option("--experts", o->experts, "keep this many of the model's experts (0 = all)")
      ->capture_default_str();
  cmd->add_option("--precision", o->precision, "bf16 | mxfp8 | nvfp4 | fp8_block128 | mxfp4")
      ->capture_default_str();
  cmd->add_option("--math", o->math, "expert math: exact | tensor_core | wgmma")
      ->capture_default_str();
  cmd->add_option("--combine", o->combine, "staged | in_kernel_reduce")->capture_default_str();
  cmd->add_option("--ranks", o->ranks, "expert-parallel ranks (one GPU each on CUDA)")
      ->capture_default_str();
  cmd->add_option("--executor", o->executor, "auto | cpu | cuda")->capture_default_str();
  cmd->add_option("--tokens", o->tokens,
                  "comma list of T (tokens per rank), at most one per bucket: decode <= 16, small "
                  "<= 128, medium <= 1024, prefill")
      ->capture_default_str();
  cmd->add_option("--num-sms", o->num_sms, "comma list of num_sms candidates (0 = all SMs)")
      ->capture_default_str();
  cmd->add_option("--block-m", o->block_m, "comma list of block_m candidates (wgmma)")
      ->capture_default_str();
  cmd->add_option("--block-n", o->block_n, "comma list of block_n candidates (wgmma)")
      ->capture_default_str();
  cmd->add_option("--dispatch-warps", o->dispatch_warps,
                  "comma list of dispatch_warps candidates (1..16: the dispatch kernel's warps per "
                  "CTA); empty: each bucket's table value")
      ->capture_default_str();
  cmd->add_option("--token-back", o->token_back,
                  "comma list of token_back candidates (epilogue_warps, dispatch_warps: kept "
                  "where a bucket runs either mode, wgmma's E4M3 tile; other buckets run their "
                  "one); empty: each bucket's table value")
      ->capture_default_str();
  cmd->add_option("--megakernel", o->megakernel,
                  "comma list of megakernel candidates (true, false), or auto: both under "
                  "--math tensor_core (the persistent round), false otherwise; true applies to "
                  "the buckets that have a persistent round (under wgmma: mxfp8's and mxfp4's "
                  "E4M3 tile's)")
      ->capture_default_str();
  cmd->add_option("--warmup", o->warmup, "untimed rounds per bucket")->capture_default_str();
  cmd->add_option("--rounds", o->rounds, "timed rounds per bucket")->capture_default_str();
  cmd->add_option("--seed", o->seed, "seed of weights, inputs and routing")->capture_default_str();
  cmd->add_option("--timeout-ms", o->timeout_ms, "bounded-wait timeout of the layer")
      ->capture_default_str();
  cmd->add_option("--out", o->out,
                  "the knob file to write (default MODEL-PRECISION-wRANKS-MATH.knobs)");
  return Subcommand{cmd, [o] { return tune(*o); }};
}

}  // namespace epmoe::tools

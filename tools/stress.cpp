// `epmoe stress`: every rank of a CPU-executor group calls forward() at its own pace — random
// sleeps, random T with long runs of T == 0, a different routing pattern every round, no barrier
// between rounds — for many rounds; sampled rounds are checked against the emulating reference.
// With --fault, one rank misbehaves and every other rank must name it within the timeout; then
// every rank resets and the run goes on, so a --fault run is itself a test of detection and
// recovery. Its own wall-clock watchdog turns a hang into a report of who is stuck where.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/cluster.hpp"
#include "epmoe/epmoe.hpp"
#include "epmoe/models.hpp"
#include "epmoe/testing.hpp"
#include "executor.hpp"
#include "host/rank_threads.hpp"
#include "progress.hpp"
#include "reference/problem.hpp"

namespace epmoe::tools {

struct StressOptions {
  std::string shape = "tiny";
  std::string executor = "cpu";  // auto | cpu | cuda
  std::string model;             // a known model name; overrides --shape
  std::int64_t experts = 0;      // 0 = the model's / the shape's
  std::int64_t max_tokens = 16;
  int ranks = 4;
  std::int64_t rounds = 2000;
  std::string precision = "bf16";
  std::string combine = "staged";
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
};

// What main.cpp needs: the subcommand (to ask whether it was parsed) and how to run it.
struct StressCommand {
  CLI::App* app = nullptr;
  std::function<int()> run;
};
StressCommand add_stress_command(CLI::App& parent);

namespace {

using Clock = std::chrono::steady_clock;
using testing::Fault;

constexpr int kExitFail = 1;
constexpr int kExitHang = 3;

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

[[noreturn]] void reject(const std::string& message) {
  throw Error(ErrorCode::invalid_argument, message);
}

// ---- --fault KIND:RANK[:MS] ----

struct FaultPlan {
  Fault fault = Fault::none;
  int rank = -1;
  std::uint32_t stall_ms = 0;
  std::string text;
};

FaultPlan parse_fault(const std::string& text, int ranks, std::uint32_t timeout_ms) {
  FaultPlan plan;
  plan.text = text;
  if (text.empty() || text == "none") return plan;
  std::vector<std::string> parts;
  std::size_t start = 0;
  while (true) {
    const std::size_t colon = text.find(':', start);
    parts.push_back(text.substr(start, colon - start));
    if (colon == std::string::npos) break;
    start = colon + 1;
  }
  const std::string& kind = parts[0];
  if (kind == "kill" || kind == "killed" || kind == "kill_rank")
    reject("--fault=" + text +
           ": a killed rank process is a multi-process (CUDA executor) fault; the CPU executor "
           "runs every rank as a thread of one process. Use skip_launch_when_idle, stall or "
           "round_jump");
  if (kind == "skip_launch_when_idle")
    plan.fault = Fault::skip_launch_when_idle;
  else if (kind == "stall")
    plan.fault = Fault::stall;
  else if (kind == "round_jump")
    plan.fault = Fault::round_jump;
  else
    reject("--fault=" + text +
           ": must be skip_launch_when_idle:RANK, stall:RANK:MS or round_jump:RANK");
  const std::size_t want = plan.fault == Fault::stall ? 3 : 2;
  if (parts.size() != want)
    reject("--fault=" + text + ": expected " +
           (plan.fault == Fault::stall ? std::string("stall:RANK:MS") : kind + ":RANK"));
  try {
    std::size_t used = 0;
    plan.rank = std::stoi(parts[1], &used);
    if (used != parts[1].size()) throw std::invalid_argument("rank");
    if (plan.fault == Fault::stall) {
      const unsigned long ms = std::stoul(parts[2], &used);
      if (used != parts[2].size() || ms > kMaxTimeoutMs) throw std::invalid_argument("ms");
      plan.stall_ms = static_cast<std::uint32_t>(ms);
    }
  } catch (const std::logic_error&) {
    reject("--fault=" + text + ": RANK and MS must be non-negative integers");
  }
  if (plan.rank < 0 || plan.rank >= ranks)
    reject("--fault=" + text + ": rank " + std::to_string(plan.rank) + " is not in [0, " +
           std::to_string(ranks) + ")");
  if (ranks < 2) reject("--fault needs --ranks >= 2: someone has to notice");
  if (timeout_ms == 0)
    reject("--fault needs a bounded wait: --timeout-ms=0 waits forever, so a fault would hang");
  if (plan.fault == Fault::stall && plan.stall_ms <= timeout_ms)
    reject("--fault=" + text + ": a stall of " + std::to_string(plan.stall_ms) +
           " ms is not longer than --timeout-ms=" + std::to_string(timeout_ms) +
           ", so nobody would give up; stall longer than the timeout");
  return plan;
}

// ---- what each rank is doing, for the watchdog ----

enum class Doing : int { starting, sleeping, forward, checking, recovering, finished };
const char* to_string(Doing d) {
  switch (d) {
    case Doing::starting:
      return "starting";
    case Doing::sleeping:
      return "sleeping before";
    case Doing::forward:
      return "inside forward() of";
    case Doing::checking:
      return "checking";
    case Doing::recovering:
      return "recovering after";
    case Doing::finished:
      return "finished after";
  }
  return "?";
}

struct RankLive {
  std::atomic<std::int64_t> round{0};
  std::atomic<int> doing{static_cast<int>(Doing::starting)};
  std::atomic<std::int64_t> since_ns{0};
  void set(Doing d, std::int64_t r) {
    round.store(r, std::memory_order_relaxed);
    since_ns.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
    doing.store(static_cast<int>(d), std::memory_order_release);
  }
};

class Watchdog {
 public:
  Watchdog(std::uint32_t seconds, std::vector<RankLive>& live) : live_(live) {
    if (seconds == 0) return;
    thread_ = std::thread([this, seconds] {
      std::unique_lock lock(mutex_);
      if (cv_.wait_for(lock, std::chrono::seconds(seconds), [this] { return done_; })) return;
      std::fprintf(stderr, "\nepmoe stress: HANG: the run did not finish within --watchdog-s=%u\n",
                   seconds);
      const auto now = Clock::now().time_since_epoch().count();
      for (std::size_t r = 0; r < live_.size(); ++r) {
        const auto d = static_cast<Doing>(live_[r].doing.load(std::memory_order_acquire));
        std::fprintf(stderr, "  rank %zu: %s round %lld for %.1f s\n", r, to_string(d),
                     static_cast<long long>(live_[r].round.load(std::memory_order_relaxed)),
                     static_cast<double>(now - live_[r].since_ns.load()) * 1e-9);
      }
      std::printf("FAIL: hang (watchdog)\n");
      std::fflush(stdout);
      std::fflush(stderr);
      std::_Exit(kExitHang);
    });
  }
  ~Watchdog() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard lock(mutex_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::vector<RankLive>& live_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

// ---- errors, faults and the collective recovery ----

// How a rank left the round it could not finish.
struct Arrival {
  bool error = false;  // false: the faulty rank, which skipped its launch
  ErrorCode code = ErrorCode::internal;
  Health health;
  std::string what;
  std::int64_t round = 0;  // the stress round (1-based)
  Clock::time_point at;
};

struct Episode {
  int index = 0;
  bool fault = false;  // a fault fired in this episode
  int faulty = -1;
  std::int64_t fault_round = 0;
  std::vector<Arrival> arrivals;
  std::vector<double> latency_ms;  // error time - fault time, per rank
  std::vector<std::string> problems;
  double reset_ms = 0.0;
  std::int64_t resume = 0;
};

// The "engine control plane": when a round fails, every rank reports here; once all have, the
// episode is judged and every rank calls reset() on its own thread. Bounded like everything else.
class Recovery {
 public:
  Recovery(int world, const FaultPlan& plan, std::uint32_t timeout_ms)
      : world_(world), plan_(plan), timeout_ms_(timeout_ms) {}

  void fault_fired(int rank, std::int64_t round) {
    std::lock_guard lock(mutex_);
    firing_ = Firing{rank, round, Clock::now()};
  }

  // Returns the stress round every rank resumes at, or -1 when the run must stop.
  std::int64_t arrive(int rank, Arrival a) {
    std::unique_lock lock(mutex_);
    if (stop_) return -1;
    if (arrived_ == 0) {
      arrivals_.assign(static_cast<std::size_t>(world_), std::nullopt);
      // Everybody must report within a timeout (plus a stall) of the first one, and a margin.
      deadline_ = Clock::now() + std::chrono::milliseconds(2 * std::uint64_t{timeout_ms_} +
                                                           plan_.stall_ms + 5'000);
    }
    arrivals_[static_cast<std::size_t>(rank)] = std::move(a);
    const std::uint64_t generation = generation_;
    if (++arrived_ == world_) {
      judge();
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return resume_;
    }
    if (!cv_.wait_until(lock, deadline_, [&] { return generation_ != generation || stop_; })) {
      Episode e = new_episode();
      std::string missing;
      for (int r = 0; r < world_; ++r)
        if (!arrivals_[static_cast<std::size_t>(r)])
          missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      e.problems.push_back("rank(s) " + missing +
                           " never reported the failed round (no error within the timeout)");
      episodes_.push_back(std::move(e));
      stop_ = true;
      cv_.notify_all();
    }
    return stop_ ? -1 : resume_;
  }

  void reset_done(double ms) {
    std::lock_guard lock(mutex_);
    if (!episodes_.empty()) episodes_.back().reset_ms = std::max(episodes_.back().reset_ms, ms);
  }
  void reset_failed(int rank, const std::string& what) {
    std::lock_guard lock(mutex_);
    if (!episodes_.empty())
      episodes_.back().problems.push_back("rank " + std::to_string(rank) +
                                          ": reset() failed: " + what);
    stop_ = true;
    cv_.notify_all();
  }
  bool stopped() {
    std::lock_guard lock(mutex_);
    return stop_;
  }
  const std::vector<Episode>& episodes() const { return episodes_; }

 private:
  struct Firing {
    int rank;
    std::int64_t round;
    Clock::time_point at;
  };

  Episode new_episode() {
    Episode e;
    e.index = static_cast<int>(episodes_.size()) + 1;
    for (auto& a : arrivals_) e.arrivals.push_back(a ? *a : Arrival{});
    e.latency_ms.assign(static_cast<std::size_t>(world_), -1.0);
    return e;
  }

  void judge() {
    Episode e = new_episode();
    std::int64_t last = 0;
    for (const Arrival& a : e.arrivals) last = std::max(last, a.round);
    e.resume = resume_ = last + 1;
    if (!firing_) {
      for (int r = 0; r < world_; ++r)
        if (e.arrivals[static_cast<std::size_t>(r)].error)
          e.problems.push_back("rank " + std::to_string(r) + ": unexpected error (" +
                               to_string(e.arrivals[static_cast<std::size_t>(r)].code) +
                               "): " + e.arrivals[static_cast<std::size_t>(r)].what);
      episodes_.push_back(std::move(e));
      return;
    }
    e.fault = true;
    e.faulty = firing_->rank;
    e.fault_round = firing_->round;
    const double bound_ms = timeout_ms_ + 1000.0;
    for (int r = 0; r < world_; ++r) {
      const Arrival& a = e.arrivals[static_cast<std::size_t>(r)];
      const std::string who = "rank " + std::to_string(r);
      if (r == e.faulty) {
        // The skipping rank returned "successfully"; a stalled or jumped one learns of the abort.
        if (plan_.fault != Fault::skip_launch_when_idle && !a.error)
          e.problems.push_back(who + " (faulty) was never told its round failed");
        continue;
      }
      if (!a.error) {
        e.problems.push_back(who + " reported no error");
        continue;
      }
      const double ms = std::max(0.0, seconds_between(firing_->at, a.at) * 1e3);
      e.latency_ms[static_cast<std::size_t>(r)] = ms;
      if (a.code != ErrorCode::timeout && a.code != ErrorCode::peer_aborted &&
          a.code != ErrorCode::protocol_violation)
        e.problems.push_back(who + ": unexpected error code " + to_string(a.code) + ": " + a.what);
      if (a.health.ok)
        e.problems.push_back(who + ": forward threw but health() is ok");
      else if (a.health.peer != e.faulty)
        e.problems.push_back(who + " named rank " + std::to_string(a.health.peer) +
                             " instead of the faulty rank " + std::to_string(e.faulty) + ": " +
                             a.what);
      if (ms > bound_ms)
        e.problems.push_back(who + " noticed after " + std::to_string(static_cast<int>(ms)) +
                             " ms, more than the timeout + 1 s");
    }
    firing_.reset();
    episodes_.push_back(std::move(e));
  }

  int world_;
  FaultPlan plan_;
  std::uint32_t timeout_ms_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
  std::uint64_t generation_ = 0;
  std::int64_t resume_ = 0;
  bool stop_ = false;
  Clock::time_point deadline_;
  std::vector<std::optional<Arrival>> arrivals_;
  std::optional<Firing> firing_;
  std::vector<Episode> episodes_;
};

// ---- per-rank load: Markov chain idle/busy, routing, sleeps ----

struct Load {
  Load(const StressOptions& o, int rank)
      : seed(o.seed),
        rng(o.seed * 0x9e3779b97f4a7c15ull + static_cast<std::uint64_t>(rank) * 7919u + 17u) {
    const double f = std::clamp(o.idle_fraction, 0.0, 1.0);
    run = std::max(1.0, o.idle_run);
    // A quarter of the idle rounds are lulls in which every rank is idle (no requests anywhere);
    // the rest come from each rank's own Markov chain, with stationary idle fraction `own` and
    // mean idle-run length `run`: leave idle w.p. 1/run, enter idle w.p. own / (1 - own) / run.
    lull = f / 4;
    const double own = f >= 1.0 ? 1.0 : (f - lull) / (1.0 - lull);
    leave_idle = own >= 1.0 ? 0.0 : 1.0 / run;
    enter_idle = own >= 1.0 ? 1.0 : std::min(1.0, leave_idle * own / (1.0 - own));
    idle = rng.uniform() < own;
  }
  // Lulls are blocks of `run` rounds chosen from the seed alone, so every rank agrees on them
  // without talking (and still agrees after a fault episode skipped some rounds).
  bool in_lull(std::int64_t round) const {
    reference::Rng block(seed * 0xd1b54a32d192ed03ull +
                         static_cast<std::uint64_t>(static_cast<double>(round) / run) + 5);
    return block.uniform() < lull;
  }
  std::int64_t next_tokens(std::int64_t round, std::int64_t max_tokens) {
    idle = idle ? rng.uniform() >= leave_idle : rng.uniform() < enter_idle;
    if (idle || in_lull(round)) return 0;
    if (rng.uniform() < 0.1) return max_tokens;  // the edge
    return 1 + rng.below(max_tokens);
  }
  reference::Routing next_routing(const std::optional<reference::Routing>& fixed) {
    if (fixed) return *fixed;
    const double p = rng.uniform();
    return p < 0.55   ? reference::Routing::uniform
           : p < 0.7  ? reference::Routing::one_expert
           : p < 0.85 ? reference::Routing::one_rank
                      : reference::Routing::all_dropped;
  }
  std::uint32_t next_sleep_us(std::uint32_t max_us) {
    if (max_us == 0) return 0;
    const double p = rng.uniform();
    if (p < 0.01) return static_cast<std::uint32_t>(rng.below(10 * std::int64_t{max_us}));
    if (p < 0.5) return static_cast<std::uint32_t>(rng.below(std::int64_t{max_us} + 1));
    return 0;
  }

  std::uint64_t seed;
  reference::Rng rng;
  double run = 1.0, lull = 0.0, leave_idle = 0.0, enter_idle = 0.0;
  bool idle = false;
};

struct RankStats {
  std::int64_t forwards = 0, tokens = 0, zero = 0, checked = 0, mismatched_rounds = 0,
               mismatches = 0, aborted = 0;
  std::vector<float> wall_us;
  std::vector<std::uint8_t> idle;  // per stress round: 1 = T == 0
  float max_us = 0.0f;
  std::int64_t max_round = 0;
  std::vector<std::string> mismatch_notes;
};

double percentile(std::vector<float>& v, double q) {
  if (v.empty()) return 0.0;
  const auto i = static_cast<std::size_t>(q * static_cast<double>(v.size() - 1));
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(i), v.end());
  return v[i];
}

int stress(const StressOptions& o) {
  // ---- shape and options ----
  LayerShape shape;
  std::string shape_name;
  if (!o.model.empty()) {
    shape = find_model(o.model).layer_shape(o.max_tokens);
    shape_name = o.model;
  } else if (o.shape == "tiny") {
    shape = LayerShape{.hidden = 64,
                       .intermediate = 64,
                       .num_experts = 16,
                       .top_k = 4,
                       .max_tokens_per_rank = o.max_tokens};
    shape_name = "tiny";
  } else {
    reject("--shape=" + o.shape + ": must be tiny (or pass --model)");
  }
  if (o.experts > 0) shape.num_experts = o.experts;
  const Precision precision = parse_precision(o.precision);
  LayerOptions options;
  options.combine = parse_combine(o.combine);
  options.timeout_ms = o.timeout_ms;
  std::optional<reference::Routing> fixed_routing;
  if (o.routing != "mixed") fixed_routing = reference::parse_routing(o.routing);
  if (o.rounds < 1) reject("--rounds=" + std::to_string(o.rounds) + ": must be >= 1");
  if (o.check_every < 0)
    reject("--check-every=" + std::to_string(o.check_every) + ": must be >= 0 (0 = never)");
  if (!(o.idle_fraction >= 0.0 && o.idle_fraction <= 1.0))
    reject("--idle-fraction=" + std::to_string(o.idle_fraction) + ": must be in [0, 1]");
  if (o.fault_times < 1)
    reject("--fault-times=" + std::to_string(o.fault_times) + ": must be >= 1");
  const FaultPlan plan = parse_fault(o.fault, o.ranks, o.timeout_ms);
  if (plan.fault != Fault::none && !testing::fault_injection_available())
    throw Error(ErrorCode::unsupported,
                "--fault: this build has no fault switches (configure with "
                "-DEPMOE_FAULT_INJECTION=ON)");
  (void)make_config(shape, precision, 0, o.ranks, options);  // validates before allocating
  const Backend backend = choose_backend(o.executor, o.ranks);
  if (backend == Backend::cuda_nccl && plan.fault != Fault::none)
    reject(
        "--fault with --executor=cuda: the GPU fault cases live in tests/gpu (gpu_layer_test); "
        "stress injects faults on the CPU executor");

  const std::int64_t params = shape.num_experts * 3 * shape.intermediate * shape.hidden;
  const std::int64_t need = params * (2 + 4 + 4);  // bf16 + the layers' and reference's copies
  const std::int64_t have = available_host_bytes();
  if (backend == Backend::cpu_threads && have > 0 && need > have * 9 / 10)
    reject(shape_name + " with " + std::to_string(shape.num_experts) + " experts needs about " +
           std::to_string(need >> 30) + " GiB of host memory on the CPU executor and " +
           std::to_string(have >> 30) + " GiB are available; pass --experts with fewer experts");

  const bool staged = options.combine == Combine::staged;
  std::printf(
      "epmoe stress: %s H=%lld I=%lld E=%lld K=%lld max_tokens=%lld  precision=%s combine=%s "
      "routing=%s\n",
      shape_name.c_str(), static_cast<long long>(shape.hidden),
      static_cast<long long>(shape.intermediate), static_cast<long long>(shape.num_experts),
      static_cast<long long>(shape.top_k), static_cast<long long>(shape.max_tokens_per_rank),
      to_string(precision), to_string(options.combine), o.routing.c_str());
  std::printf(
      "executor: %s, no barrier between rounds  rounds=%lld seed=%llu "
      "idle-fraction=%.2f max-sleep-us=%u timeout-ms=%u check-every=%lld fault=%s\n",
      describe_backend(backend, o.ranks).c_str(), static_cast<long long>(o.rounds),
      static_cast<unsigned long long>(o.seed), o.idle_fraction, o.max_sleep_us, o.timeout_ms,
      static_cast<long long>(o.check_every),
      plan.fault == Fault::none ? "none"
                                : (plan.text + " x" + std::to_string(o.fault_times)).c_str());
  std::fflush(stdout);

  const reference::LayerWeights weights = reference::make_random_weights(shape, o.seed);
  Cluster cluster(shape, precision, options, o.ranks, weights, backend);

  // ---- the run ----
  std::vector<RankLive> live(static_cast<std::size_t>(o.ranks));
  std::vector<RankStats> stats(static_cast<std::size_t>(o.ranks));
  Recovery recovery(o.ranks, plan, o.timeout_ms);
  Progress progress("stress rounds", o.rounds);
  std::atomic<std::int64_t> zero_total{0}, forwards_total{0}, mismatch_total{0};
  const auto start = Clock::now();
  {
    Watchdog watchdog(o.watchdog_s, live);
    run_on_rank_threads(o.ranks, [&](int rank) {
      RankLive& me = live[static_cast<std::size_t>(rank)];
      RankStats& st = stats[static_cast<std::size_t>(rank)];
      st.wall_us.reserve(static_cast<std::size_t>(o.rounds));
      st.idle.assign(static_cast<std::size_t>(o.rounds) + 1, 0);
      Load load(o, rank);
      Layer& layer = cluster.layer(rank);
      const bool faulty = plan.fault != Fault::none && rank == plan.rank;
      int episodes_left = faulty ? o.fault_times : 0;
      bool armed = false;
      bool corrupt_pending = o.corrupt_check && rank == 0;
      std::int64_t round = 1;
      while (round <= o.rounds) {
        if (recovery.stopped()) break;
        const std::int64_t tokens = load.next_tokens(round, shape.max_tokens_per_rank);
        const reference::Routing routing = load.next_routing(fixed_routing);
        const std::int64_t target =
            load.rng.below(routing == reference::Routing::one_rank ? o.ranks : shape.num_experts);
        const reference::Batch batch = reference::make_random_batch(
            shape, o.ranks, tokens, routing, target,
            o.seed * 1'000'003u + static_cast<std::uint64_t>(round) * 131u +
                static_cast<std::uint64_t>(rank));
        // The faulty rank arms its fault at evenly spaced rounds (one episode each).
        const std::int64_t arm_at =
            o.rounds * (o.fault_times - episodes_left + 1) / (std::int64_t{o.fault_times} + 1);
        if (episodes_left > 0 && !armed && round >= arm_at) {
          testing::inject_fault(layer, {plan.fault, plan.stall_ms, 1});
          armed = true;
        }
        if (const std::uint32_t us = load.next_sleep_us(o.max_sleep_us); us > 0) {
          me.set(Doing::sleeping, round);
          std::this_thread::sleep_for(std::chrono::microseconds(us));
        }

        me.set(Doing::forward, round);
        const std::uint32_t layer_round = layer.next_round();
        if (armed && plan.fault != Fault::skip_launch_when_idle)
          recovery.fault_fired(rank, round);  // fires inside this very call
        std::optional<Arrival> failed;
        std::vector<std::uint16_t> y;
        const auto t0 = Clock::now();
        try {
          y = cluster.forward(rank, batch);
        } catch (const Error& e) {
          failed = Arrival{true, e.code(), layer.health(), e.what(), round, Clock::now()};
        } catch (const std::exception& e) {
          failed =
              Arrival{true, ErrorCode::internal, layer.health(), e.what(), round, Clock::now()};
        }
        const auto t1 = Clock::now();
        const auto us = static_cast<float>(seconds_between(t0, t1) * 1e6);
        if (!failed) {  // a failed forward's wait is reported with its fault episode
          st.wall_us.push_back(us);
          if (us > st.max_us) {
            st.max_us = us;
            st.max_round = round;
          }
        }
        ++st.forwards;
        st.tokens += tokens;
        if (tokens == 0) {
          ++st.zero;
          st.idle[static_cast<std::size_t>(round)] = 1;
          zero_total.fetch_add(1, std::memory_order_relaxed);
        }
        forwards_total.fetch_add(1, std::memory_order_relaxed);
        if (armed && plan.fault != Fault::skip_launch_when_idle) {
          armed = false;
          --episodes_left;
        }
        if (!failed && armed && tokens == 0 && layer.next_round() == layer_round) {
          // The launch was skipped: this rank now "waits elsewhere" (in a real engine: the next
          // layer, whose peers are still stuck in this one) until the others have noticed.
          recovery.fault_fired(rank, round);
          failed = Arrival{false, ErrorCode::internal, layer.health(), "skipped its launch",
                           round, Clock::now()};
          armed = false;
          --episodes_left;
        }

        if (failed) {
          ++st.aborted;
          me.set(Doing::recovering, round);
          const std::int64_t resume = recovery.arrive(rank, std::move(*failed));
          if (resume < 0) break;
          const auto r0 = Clock::now();
          try {
            layer.reset();
            if (faulty) testing::inject_fault(layer, {});
          } catch (const Error& e) {
            recovery.reset_failed(rank, e.what());
            break;
          }
          recovery.reset_done(seconds_between(r0, Clock::now()) * 1e3);
          round = resume;
          continue;
        }

        if (o.check_every > 0 && round % o.check_every == 0) {
          me.set(Doing::checking, round);
          if (corrupt_pending && !y.empty()) {
            y[0] ^= 0x4000;  // --corrupt-check: prove the checker can fail
            corrupt_pending = false;
          }
          const auto ref = cluster.reference(rank).forward(batch);
          const auto err = staged ? reference::compare_bf16(y, ref)
                                  : reference::compare_bf16_tolerant(y, ref, 1, 1e-6);
          ++st.checked;
          if (err.mismatches > 0) {
            ++st.mismatched_rounds;
            st.mismatches += err.mismatches;
            mismatch_total.fetch_add(err.mismatches, std::memory_order_relaxed);
            if (st.mismatch_notes.size() < 5) {
              char note[200];
              std::snprintf(note, sizeof note,
                            "rank %d round %lld T=%lld routing=%s: %lld elements differ, "
                            "max_abs=%.4g",
                            rank, static_cast<long long>(round), static_cast<long long>(tokens),
                            reference::to_string(routing), static_cast<long long>(err.mismatches),
                            err.max_abs);
              st.mismatch_notes.emplace_back(note);
            }
          }
        }
        if (rank == 0) {
          const double f = static_cast<double>(zero_total.load(std::memory_order_relaxed)) /
                           std::max<double>(1.0, static_cast<double>(forwards_total.load()));
          char detail[128];
          std::snprintf(detail, sizeof detail, "zero-token %.0f%%  mismatches %lld", 100.0 * f,
                        static_cast<long long>(mismatch_total.load()));
          progress.update(round, detail);
        }
        ++round;
      }
      me.set(Doing::finished, round - 1);
    });
  }
  const double wall_s = seconds_between(start, Clock::now());
  progress.finish();

  // ---- summary ----
  RankStats all;
  std::int64_t all_idle_rounds = 0, rounds_seen = 0;
  int max_rank = 0;
  for (int r = 0; r < o.ranks; ++r) {
    RankStats& s = stats[static_cast<std::size_t>(r)];
    all.forwards += s.forwards;
    all.tokens += s.tokens;
    all.zero += s.zero;
    all.checked += s.checked;
    all.mismatched_rounds += s.mismatched_rounds;
    all.mismatches += s.mismatches;
    all.aborted += s.aborted;
    all.wall_us.insert(all.wall_us.end(), s.wall_us.begin(), s.wall_us.end());
    if (s.max_us > all.max_us) {
      all.max_us = s.max_us;
      all.max_round = s.max_round;
      max_rank = r;
    }
  }
  for (std::int64_t round = 1; round <= o.rounds; ++round) {
    bool every = true;
    for (const RankStats& s : stats) every &= s.idle[static_cast<std::size_t>(round)] != 0;
    all_idle_rounds += every;
  }
  rounds_seen = stats[0].forwards;
  const double p50 = percentile(all.wall_us, 0.50), p99 = percentile(all.wall_us, 0.99);
  const auto pct = [](std::int64_t a, std::int64_t b) {
    return b > 0 ? 100.0 * static_cast<double>(a) / static_cast<double>(b) : 0.0;
  };

  std::printf("\nrounds            %lld per rank, %lld forwards on %d ranks\n",
              static_cast<long long>(rounds_seen), static_cast<long long>(all.forwards), o.ranks);
  std::printf("tokens            %lld (%.2f per forward)\n", static_cast<long long>(all.tokens),
              static_cast<double>(all.tokens) / std::max<double>(1.0, double(all.forwards)));
  std::printf("zero-token        %lld forwards (%.1f%%); every rank idle in %lld rounds (%.1f%%)\n",
              static_cast<long long>(all.zero), pct(all.zero, all.forwards),
              static_cast<long long>(all_idle_rounds), pct(all_idle_rounds, o.rounds));
  std::printf("checked           %lld forwards against the emulating reference (%s)\n",
              static_cast<long long>(all.checked),
              staged ? "staged: bit-exact" : "in_kernel_reduce: within 1 bf16 ulp");
  std::printf("mismatches        %lld elements in %lld forwards\n",
              static_cast<long long>(all.mismatches),
              static_cast<long long>(all.mismatched_rounds));
  for (const RankStats& s : stats)
    for (const std::string& note : s.mismatch_notes) std::printf("  %s\n", note.c_str());
  std::printf(
      "forward wall time p50 %.3f ms  p99 %.3f ms  max %.3f ms (rank %d, round %lld; completed "
      "forwards)\n",
      p50 * 1e-3, p99 * 1e-3, static_cast<double>(all.max_us) * 1e-3, max_rank,
      static_cast<long long>(all.max_round));
  std::printf("throughput        %.0f rounds/s (%.2f s wall)\n",
              static_cast<double>(rounds_seen) / wall_s, wall_s);

  std::int64_t errors = 0;
  bool fault_ok = true;
  int fault_episodes = 0;
  for (const Episode& e : recovery.episodes()) {
    fault_episodes += e.fault;
    if (!e.fault) {
      for (const Arrival& a : e.arrivals) errors += a.error;
    }
    if (!e.problems.empty()) fault_ok = false;
    if (e.fault) {
      std::printf("\nfault episode %d: %s on rank %d in round %lld\n", e.index,
                  testing::to_string(plan.fault), e.faulty, static_cast<long long>(e.fault_round));
    } else {
      std::printf("\nerror episode %d (no fault was injected)\n", e.index);
    }
    for (int r = 0; r < o.ranks; ++r) {
      const Arrival& a = e.arrivals[static_cast<std::size_t>(r)];
      const double ms = e.latency_ms.empty() ? -1.0 : e.latency_ms[static_cast<std::size_t>(r)];
      std::string when = ms >= 0 ? "after " + std::to_string(static_cast<int>(ms + 0.5)) + " ms"
                                 : std::string(r == e.faulty ? "(faulty)" : "");
      std::printf("  rank %d: %-14s %-10s %s\n", r, a.error ? to_string(a.code) : "-", when.c_str(),
                  a.what.c_str());
    }
    if (e.fault) {
      double worst = 0.0;
      for (double ms : e.latency_ms) worst = std::max(worst, ms);
      std::printf("  detected by every survivor within %.0f ms (bound: timeout %u ms + 1 s)\n",
                  worst, o.timeout_ms);
    }
    if (e.resume > 0)
      std::printf("  reset on every rank in %.1f ms; resumed at round %lld\n", e.reset_ms,
                  static_cast<long long>(e.resume));
    for (const std::string& p : e.problems) std::printf("  PROBLEM: %s\n", p.c_str());
  }
  if (plan.fault != Fault::none && fault_episodes != o.fault_times) {
    fault_ok = false;
    std::printf("\nPROBLEM: %d fault episode(s) expected, %d seen\n", o.fault_times,
                fault_episodes);
  }
  for (int r = 0; r < o.ranks; ++r)
    if (!cluster.layer(r).health().ok) {
      fault_ok = false;
      std::printf("PROBLEM: rank %d ended unhealthy: %s\n", r,
                  cluster.layer(r).health().what.c_str());
    }
  std::printf("errors            %lld unexpected\n", static_cast<long long>(errors));

  const bool complete = rounds_seen > 0 && !recovery.stopped();
  const bool idle_enough =
      static_cast<double>(all.zero) >= o.min_zero_fraction * static_cast<double>(all.forwards);
  if (!idle_enough)
    std::printf("PROBLEM: %.1f%% zero-token forwards, fewer than --min-zero-fraction=%.2f\n",
                pct(all.zero, all.forwards), o.min_zero_fraction);
  const bool ok = all.mismatches == 0 && errors == 0 && fault_ok && complete && idle_enough;
  std::string why;
  if (all.mismatches > 0) why += " mismatch";
  if (errors > 0) why += " errors";
  if (!fault_ok) why += plan.fault != Fault::none ? " fault-detection/recovery" : " recovery";
  if (!complete) why += " stopped-early";
  if (!idle_enough) why += " too-few-idle-rounds";
  std::printf("\n%s%s%s\n", ok ? "PASS" : "FAIL:", why.c_str(),
              plan.fault == Fault::none || !ok ? ""
                                               : " (every fault detected by every survivor and "
                                                 "recovered from)");
  return ok ? 0 : kExitFail;
}

}  // namespace

StressCommand add_stress_command(CLI::App& parent) {
  auto o = std::make_shared<StressOptions>();
  CLI::App* cmd = parent.add_subcommand(
      "stress",
      "hammer the CPU executor: ranks at their own pace, long runs of T == 0, mixed routing, "
      "optional faults; sampled rounds checked against the emulating reference");
  cmd->footer(
      "Faults (--fault KIND:RANK[:MS]; needs a build with -DEPMOE_FAULT_INJECTION=ON):\n"
      "  skip_launch_when_idle:RANK  RANK returns from forward() without running the round the\n"
      "                              next time it has T == 0, then waits elsewhere (as an engine\n"
      "                              stuck in its next layer would)\n"
      "  stall:RANK:MS               RANK sleeps MS (> --timeout-ms) inside its next round\n"
      "  round_jump:RANK             RANK's round counter jumps ahead by 2 (a protocol violation)\n"
      "Each fault fires --fault-times times, at evenly spaced rounds. Every other rank must fail\n"
      "with an error naming RANK (Health.peer) within the timeout + 1 s; then every rank calls\n"
      "reset() and the run goes on. Exit 0 only if every fault was detected and recovered from.\n"
      "A killed rank process is a multi-process (CUDA executor) fault and does not apply to the\n"
      "CPU executor, whose ranks are threads of one process.\n"
      "Exit status: 0 pass, 1 mismatch / error / failed detection or recovery, 2 bad options,\n"
      "3 hang (the watchdog fired).");
  cmd->add_option("--executor", o->executor, "cpu | cuda | auto (cuda: one GPU per rank)")
      ->capture_default_str();
  cmd->add_option("--shape", o->shape, "built-in small shape: tiny = H=64 I=64 E=16 K=4")
      ->capture_default_str();
  cmd->add_option("--model", o->model,
                  "a real model's shape instead (qwen3-30b-a3b | deepseek-v3 | gpt-oss-120b | "
                  "mixtral-8x7b); slow on the CPU executor, use --experts");
  cmd->add_option("--experts", o->experts, "override the number of experts (0 = the shape's)")
      ->capture_default_str();
  cmd->add_option("--max-tokens", o->max_tokens, "max_tokens_per_rank; T is drawn in [0, this]")
      ->capture_default_str();
  cmd->add_option("--ranks", o->ranks, "expert-parallel ranks (threads)")->capture_default_str();
  cmd->add_option("--rounds", o->rounds, "rounds every rank runs")->capture_default_str();
  cmd->add_option("--precision", o->precision, "bf16 | mxfp8 | nvfp4")->capture_default_str();
  cmd->add_option("--combine", o->combine, "staged | in_kernel_reduce")->capture_default_str();
  cmd->add_option("--routing", o->routing,
                  "mixed (a pattern per rank per round) | uniform | one_expert | one_rank | "
                  "all_dropped")
      ->capture_default_str();
  cmd->add_option("--seed", o->seed, "seed of weights, inputs, routing, T and sleeps")
      ->capture_default_str();
  cmd->add_option("--idle-fraction", o->idle_fraction,
                  "share of forwards with T == 0 (per-rank Markov chain idle/busy)")
      ->capture_default_str();
  cmd->add_option("--min-zero-fraction", o->min_zero_fraction,
                  "fail unless at least this share of forwards had T == 0 (for tests)")
      ->capture_default_str();
  cmd->add_option("--idle-run", o->idle_run, "mean length of a run of T == 0 rounds")
      ->capture_default_str();
  cmd->add_option("--max-sleep-us", o->max_sleep_us,
                  "before half the forwards sleep U(0, this) us; before 1% up to 10x this")
      ->capture_default_str();
  cmd->add_option("--timeout-ms", o->timeout_ms, "bounded-wait timeout of the layer, 0 = forever")
      ->capture_default_str();
  cmd->add_option("--check-every", o->check_every,
                  "check every N-th round of each rank against the reference (0 = never)")
      ->capture_default_str();
  cmd->add_option("--watchdog-s", o->watchdog_s,
                  "wall-clock limit of the whole run; on expiry print who is stuck where and exit "
                  "3 (0 = none)")
      ->capture_default_str();
  cmd->add_option("--fault", o->fault,
                  "skip_launch_when_idle:RANK | stall:RANK:MS | round_jump:RANK (see below)");
  cmd->add_option("--fault-times", o->fault_times, "fault episodes in the run")
      ->capture_default_str();
  cmd->add_flag("--corrupt-check", o->corrupt_check,
                "flip one output bit before the first check (proves the checker can fail)")
      ->group("");
  return StressCommand{cmd, [o] { return stress(*o); }};
}

}  // namespace epmoe::tools

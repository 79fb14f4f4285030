// `epmoe stress`: every rank of a CPU-executor group calls forward() at its own pace — random
// sleeps, random T with long runs of T == 0, a different routing pattern every round, no barrier
// between rounds — for many rounds; sampled rounds are checked against the emulating reference.
// With --fault, one rank misbehaves and every other rank must name it within the timeout; then
// every rank resets and the run goes on, so a --fault run is itself a test of detection and
// recovery. Its own wall-clock watchdog turns a hang into a report of who is stuck where.
#include <CLI/CLI.hpp>

#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "epmoe/epmoe.hpp"
#include "epmoe/models.hpp"
#include "epmoe/testing.hpp"
#include "executor.hpp"
#include "harness/cluster.hpp"
#include "harness/problem.hpp"
#include "harness/rank_threads.hpp"
#include "progress.hpp"

#if defined(EPMOE_HAS_CUDA)
#include "harness/device_batch.hpp"
#endif

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
  std::string math = "exact";  // exact | tensor_core (LayerOptions::expert_math)
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
  bool processes = false;  // ranks as processes (CPU: POSIX shared memory; CUDA: one GPU each)
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
  bool kill = false;  // kill:RANK: the supervisor SIGKILLs the rank process mid-round
};

FaultPlan parse_fault(const std::string& text, int ranks, std::uint32_t timeout_ms,
                      bool processes) {
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
  const bool kill = kind == "kill" || kind == "killed" || kind == "kill_rank";
  if (kill && !processes)
    reject("--fault=" + text +
           ": killing a rank process needs ranks as processes; add --processes (the thread "
           "mode runs every rank as a thread of one process)");
  if (!kill && processes)
    reject("--fault=" + text +
           ": with --processes only kill:RANK is supported; run skip_launch_when_idle, stall "
           "and round_jump without --processes");
  if (kill)
    plan.fault = Fault::stall;  // the doomed rank stalls in its round until it is killed
  else if (kind == "skip_launch_when_idle")
    plan.fault = Fault::skip_launch_when_idle;
  else if (kind == "stall")
    plan.fault = Fault::stall;
  else if (kind == "round_jump")
    plan.fault = Fault::round_jump;
  else
    reject("--fault=" + text +
           ": must be skip_launch_when_idle:RANK, stall:RANK:MS, round_jump:RANK or (with "
           "--processes) kill:RANK");
  const bool with_ms = plan.fault == Fault::stall && !kill;
  const std::size_t want = with_ms ? 3 : 2;
  if (parts.size() != want)
    reject("--fault=" + text + ": expected " +
           (with_ms ? std::string("stall:RANK:MS") : kind + ":RANK"));
  try {
    std::size_t used = 0;
    plan.rank = std::stoi(parts[1], &used);
    if (used != parts[1].size()) throw std::invalid_argument("rank");
    if (with_ms) {
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
  if (kill) {
    plan.kill = true;
    plan.stall_ms = 60'000;  // far beyond any --timeout-ms: only the SIGKILL ends it
    return plan;
  }
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
    harness::Rng block(seed * 0xd1b54a32d192ed03ull +
                       static_cast<std::uint64_t>(static_cast<double>(round) / run) + 5);
    return block.uniform() < lull;
  }
  std::int64_t next_tokens(std::int64_t round, std::int64_t max_tokens) {
    idle = idle ? rng.uniform() >= leave_idle : rng.uniform() < enter_idle;
    if (idle || in_lull(round)) return 0;
    if (rng.uniform() < 0.1) return max_tokens;  // the edge
    return 1 + rng.below(max_tokens);
  }
  harness::Routing next_routing(const std::optional<harness::Routing>& fixed) {
    if (fixed) return *fixed;
    const double p = rng.uniform();
    return p < 0.55   ? harness::Routing::uniform
           : p < 0.7  ? harness::Routing::one_expert
           : p < 0.85 ? harness::Routing::one_rank
                      : harness::Routing::all_dropped;
  }
  std::uint32_t next_sleep_us(std::uint32_t max_us) {
    if (max_us == 0) return 0;
    const double p = rng.uniform();
    if (p < 0.01) return static_cast<std::uint32_t>(rng.below(10 * std::int64_t{max_us}));
    if (p < 0.5) return static_cast<std::uint32_t>(rng.below(std::int64_t{max_us} + 1));
    return 0;
  }

  std::uint64_t seed;
  harness::Rng rng;
  double run = 1.0, lull = 0.0, leave_idle = 0.0, enter_idle = 0.0;
  bool idle = false;
};

// One round's draws, in the order both modes make them.
struct RoundDraw {
  std::int64_t tokens = 0;
  harness::Routing routing = harness::Routing::uniform;
  std::int64_t target = 0;
  std::uint32_t sleep_us = 0;
};
RoundDraw draw_round(Load& load, const StressOptions& o, const LayerShape& shape,
                     std::int64_t round, const std::optional<harness::Routing>& fixed) {
  RoundDraw d;
  d.tokens = load.next_tokens(round, shape.max_tokens_per_rank);
  d.routing = load.next_routing(fixed);
  d.target = load.rng.below(d.routing == harness::Routing::one_rank ? o.ranks : shape.num_experts);
  d.sleep_us = load.next_sleep_us(o.max_sleep_us);
  return d;
}
reference::Batch round_batch(const StressOptions& o, const LayerShape& shape, const RoundDraw& d,
                             std::int64_t round, int rank) {
  return harness::make_random_batch(shape, o.ranks, d.tokens, d.routing, d.target,
                                    o.seed * 1'000'003u + static_cast<std::uint64_t>(round) * 131u +
                                        static_cast<std::uint64_t>(rank));
}

struct RankStats {
  std::int64_t forwards = 0, tokens = 0, zero = 0, checked = 0, mismatched_rounds = 0,
               mismatches = 0, aborted = 0;
  std::vector<float> wall_us;
  std::vector<std::uint8_t> idle;  // per stress round: 1 = T == 0
  float max_us = 0.0f;
  std::int64_t max_round = 0;
  std::vector<std::string> mismatch_notes;
};

// Checks one round's output against the reference with reference::check_output (the rule of the
// layer's combine and expert math) and records it in `st` (both modes).
reference::OutputCheck record_check(RankStats& st, const std::vector<std::uint16_t>& y,
                                    const std::vector<std::uint16_t>& ref,
                                    const LayerOptions& options, int rank, std::int64_t round,
                                    const RoundDraw& draw) {
  reference::OutputCheck check =
      reference::check_output(y, ref, options.combine, options.expert_math);
  ++st.checked;
  st.mismatches += check.stats.mismatches;
  if (!check.pass) {
    ++st.mismatched_rounds;
    if (st.mismatch_notes.size() < 5) {
      char note[200];
      std::snprintf(note, sizeof note,
                    "rank %d round %lld T=%lld routing=%s: %lld elements outside tolerance, "
                    "max_abs=%.4g rel_l2=%.3g",
                    rank, static_cast<long long>(round), static_cast<long long>(draw.tokens),
                    harness::to_string(draw.routing),
                    static_cast<long long>(check.stats.mismatches), check.stats.max_abs,
                    check.stats.rel_l2);
      st.mismatch_notes.emplace_back(note);
    }
  }
  return check;
}

double percentile(std::vector<float>& v, double q) {
  if (v.empty()) return 0.0;
  const auto i = static_cast<std::size_t>(q * static_cast<double>(v.size() - 1));
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(i), v.end());
  return v[i];
}

// The load part of the summary (both modes); returns the totals, sets rounds_seen (rank 0's).
RankStats print_load_summary(std::vector<RankStats>& stats, const StressOptions& o,
                             const std::string& rule, double wall_s, std::int64_t& rounds_seen) {
  RankStats all;
  std::int64_t all_idle_rounds = 0;
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
              static_cast<long long>(all.checked), rule.c_str());
  std::printf(
      "mismatches        %lld elements outside the per-element tolerance; %lld forwards "
      "broke the rule\n",
      static_cast<long long>(all.mismatches), static_cast<long long>(all.mismatched_rounds));
  for (const RankStats& s : stats)
    for (const std::string& note : s.mismatch_notes) std::printf("  %s\n", note.c_str());
  std::printf(
      "forward wall time p50 %.3f ms  p99 %.3f ms  max %.3f ms (rank %d, round %lld; completed "
      "forwards)\n",
      p50 * 1e-3, p99 * 1e-3, static_cast<double>(all.max_us) * 1e-3, max_rank,
      static_cast<long long>(all.max_round));
  std::printf("throughput        %.0f rounds/s (%.2f s wall)\n",
              static_cast<double>(rounds_seen) / wall_s, wall_s);

  return all;
}

// ---- --processes: ranks as processes over POSIX shared memory, a supervisor parent ----

// Rank process -> supervisor, over the rank's own pipe. Fixed-size; a stats message is followed
// by its RankStats payload (see send_stats).
// unique_id: the CUDA executor's next communicator id, made by rank 0 at the start and by the
// lowest survivor after a kill (carried in `unique_id`, also on that survivor's arrival).
enum class MsgKind : std::int32_t { armed, arrival, stats, unique_id };
struct Msg {
  MsgKind kind = MsgKind::stats;
  std::int32_t rank = 0;
  std::int64_t round = 0;
  std::int64_t at_ns = 0;  // steady clock (CLOCK_MONOTONIC: the same in every process)
  std::int32_t code = 0;
  std::int32_t peer = -1;
  std::int32_t health_ok = 1;
  std::int32_t notes = 0;
  std::int64_t counts[7] = {};  // forwards tokens zero checked mismatched_rounds mismatches aborted
  std::int64_t max_round = 0;
  std::int64_t wall_n = 0;
  std::int64_t idle_n = 0;
  float max_us = 0.0f;
  char what[240] = {};
  std::int32_t has_id = 0;
  UniqueId unique_id;
};

// Supervisor -> rank process, over its down pipe: the round to go on from and, on the CUDA
// executor, the unique id of the communicator to (re)build.
struct Resume {
  std::int64_t round = 0;
  std::int32_t has_id = 0;
  UniqueId unique_id;
};

enum RankExit : int { kRankPass = 0, kRankResetFailed = 14, kRankError = 15 };

std::int64_t now_ns() {
  return Clock::now().time_since_epoch().count();
}

bool write_all(int fd, const void* data, std::size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<std::size_t>(w);
  }
  return true;
}

void send_msg(int fd, Msg m, const std::string& what = "") {
  std::snprintf(m.what, sizeof m.what, "%s", what.c_str());
  (void)write_all(fd, &m, sizeof m);
}

// Stats: the header, then idle bytes, wall times, notes (240 bytes each).
void send_stats(int fd, int rank, const RankStats& st) {
  Msg m;
  m.kind = MsgKind::stats;
  m.rank = rank;
  m.counts[0] = st.forwards;
  m.counts[1] = st.tokens;
  m.counts[2] = st.zero;
  m.counts[3] = st.checked;
  m.counts[4] = st.mismatched_rounds;
  m.counts[5] = st.mismatches;
  m.counts[6] = st.aborted;
  m.max_round = st.max_round;
  m.max_us = st.max_us;
  m.wall_n = static_cast<std::int64_t>(st.wall_us.size());
  m.idle_n = static_cast<std::int64_t>(st.idle.size());
  m.notes = static_cast<std::int32_t>(st.mismatch_notes.size());
  std::vector<char> out(sizeof m);
  std::memcpy(out.data(), &m, sizeof m);
  out.insert(out.end(), st.idle.begin(), st.idle.end());
  const auto* w = reinterpret_cast<const char*>(st.wall_us.data());
  out.insert(out.end(), w, w + st.wall_us.size() * sizeof(float));
  for (const std::string& note : st.mismatch_notes) {
    char buf[240] = {};
    std::snprintf(buf, sizeof buf, "%s", note.c_str());
    out.insert(out.end(), buf, buf + sizeof buf);
  }
  (void)write_all(fd, out.data(), out.size());
}

std::size_t stats_bytes(const Msg& m) {
  return sizeof m + static_cast<std::size_t>(m.idle_n) +
         static_cast<std::size_t>(m.wall_n) * sizeof(float) +
         static_cast<std::size_t>(m.notes) * 240u;
}

void merge_stats(RankStats& into, const Msg& m, const char* payload) {
  into.forwards += m.counts[0];
  into.tokens += m.counts[1];
  into.zero += m.counts[2];
  into.checked += m.counts[3];
  into.mismatched_rounds += m.counts[4];
  into.mismatches += m.counts[5];
  into.aborted += m.counts[6];
  if (m.max_us > into.max_us) {
    into.max_us = m.max_us;
    into.max_round = m.max_round;
  }
  for (std::int64_t i = 0; i < m.idle_n && static_cast<std::size_t>(i) < into.idle.size(); ++i)
    into.idle[static_cast<std::size_t>(i)] |= static_cast<std::uint8_t>(payload[i]);
  payload += m.idle_n;
  const std::size_t at = into.wall_us.size();
  into.wall_us.resize(at + static_cast<std::size_t>(m.wall_n));
  std::memcpy(into.wall_us.data() + at, payload,
              static_cast<std::size_t>(m.wall_n) * sizeof(float));
  payload += m.wall_n * static_cast<std::int64_t>(sizeof(float));
  for (int i = 0; i < m.notes; ++i, payload += 240)
    into.mismatch_notes.emplace_back(payload, strnlen(payload, 240));
}

// The round at which kill episode `episode` (0-based) arms: evenly spaced, jittered by the seed.
std::int64_t kill_round(const StressOptions& o, int episode) {
  const std::int64_t base = o.rounds * (episode + 1) / (std::int64_t{o.fault_times} + 1);
  const std::int64_t span = std::max<std::int64_t>(1, o.rounds / (4 * (o.fault_times + 1)));
  harness::Rng rng(o.seed * 0x2545f4914f6cdd1dull + static_cast<std::uint64_t>(episode) + 11);
  return std::clamp<std::int64_t>(base + rng.below(2 * span + 1) - span, 1, o.rounds);
}

struct ProcessSetup {
  std::string name;
  LayerShape shape;
  Precision precision;
  LayerOptions options;
  std::optional<harness::Routing> fixed_routing;
  FaultPlan plan;
  bool cuda = false;  // the CUDA executor, rank r on GPU r
};

bool read_resume(int fd, Resume& resume) {
  char* p = reinterpret_cast<char*>(&resume);
  std::size_t n = sizeof resume;
  while (n > 0) {
    const ssize_t r = ::read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<std::size_t>(r);
  }
  return resume.round > 0;
}

// A rank process's communicator and layer. CPU executor: made once over the shared-memory group;
// a restarted rank finds its old window and joins the survivors' reset(). CUDA executor: rank r on
// GPU r, built from a unique id the supervisor relays; a dead peer breaks the NCCL communicator,
// so after a kill the survivors' reset() fails naming it, and everyone rebuilds from a fresh id.
class RankLayer {
 public:
  RankLayer(const StressOptions& o, const ProcessSetup& ps, int rank,
            const reference::LayerWeights& weights)
      : o_(o), ps_(ps), rank_(rank), weights_(weights) {
    if (ps.cuda) {
      const int gpus = cuda_device_count();
      if (rank >= gpus)
        throw Error(ErrorCode::invalid_argument,
                    "--processes --executor=cuda: rank " + std::to_string(rank) + " runs on GPU " +
                        std::to_string(rank) + " and this machine has " + std::to_string(gpus) +
                        " GPU(s); pass --ranks <= " + std::to_string(gpus));
    } else {
      group_ = attach_shared_memory_group(ps.name, o.ranks);
    }
  }
  ~RankLayer() { teardown(); }

  // (Re)makes the communicator and the layer; `id` is the CUDA executor's unique id.
  void build(const UniqueId& id) {
    teardown();
    comm_ = ps_.cuda ? make_nccl_communicator(id, rank_, o_.ranks, rank_)
                     : make_host_communicator(group_, rank_);
    layer_ = std::make_unique<Layer>(
        *comm_, make_config(ps_.shape, ps_.precision, rank_, o_.ranks, ps_.options),
        local_weight_views(weights_, ps_.shape, rank_, o_.ranks));
#if defined(EPMOE_HAS_CUDA)
    if (ps_.cuda) device_ = std::make_unique<harness::DeviceBatch>(rank_, ps_.shape);
#endif
  }

  Layer& layer() {
    return *layer_;
  }

  // One round; throws Error on a failed round on either executor (on the GPU a failed round is
  // seen in health() once the stream has finished it).
  std::vector<std::uint16_t> forward(const reference::Batch& batch) {
#if defined(EPMOE_HAS_CUDA)
    if (ps_.cuda) {
      std::vector<std::uint16_t> y = device_->forward(*layer_, batch);
      const Health h = layer_->health();
      if (!h.ok) throw Error(h.code, h.what);
      return y;
    }
#endif
    const LayerShape& s = ps_.shape;
    std::vector<std::uint16_t> y(static_cast<std::size_t>(batch.tokens * s.hidden));
    layer_->forward(view(batch.x.data(), DType::bf16, {batch.tokens, s.hidden}),
                    view(batch.topk_ids.data(), DType::i32, {batch.tokens, s.top_k}),
                    view(batch.topk_weights.data(), DType::f32, {batch.tokens, s.top_k}),
                    view(y.data(), DType::bf16, {batch.tokens, s.hidden}));
    return y;
  }

 private:
  // The layer goes first: it uses the communicator (whose destruction aborts, without waiting on
  // anybody, once a reset() found a peer missing).
  void teardown() {
    layer_.reset();
#if defined(EPMOE_HAS_CUDA)
    device_.reset();
#endif
    comm_.reset();
  }

  const StressOptions& o_;
  const ProcessSetup& ps_;
  int rank_;
  const reference::LayerWeights& weights_;
  std::shared_ptr<HostGroup> group_;
  std::unique_ptr<Communicator> comm_;
  std::unique_ptr<Layer> layer_;
#if defined(EPMOE_HAS_CUDA)
  std::unique_ptr<harness::DeviceBatch> device_;
#endif
};

// The per-rank loop of one rank process (the thread mode's loop, with the supervisor as the
// control plane). `restarted`: this process replaces a killed one that died in round
// `replay_through` after `episodes_done` kill episodes.
int rank_process(const StressOptions& o, const ProcessSetup& ps, int rank, int up, int down,
                 bool restarted, std::int64_t replay_through, int episodes_done) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the supervisor
  const reference::LayerWeights weights = harness::make_random_weights(ps.shape, o.seed);
  reference::ReferenceModel reference(ps.shape, ps.precision, ps.options, weights);
  RankLayer rank_layer(o, ps, rank, weights);
  Resume resume;
  if (ps.cuda && rank == 0 && !restarted) {  // the first communicator's id, for everyone
    Msg m;
    m.kind = MsgKind::unique_id;
    m.rank = rank;
    m.has_id = 1;
    m.unique_id = get_unique_id();
    send_msg(up, m);
  }
  if (ps.cuda && !restarted && !read_resume(down, resume)) return kRankError;
  if (!restarted) rank_layer.build(resume.unique_id);
  Load load(o, rank);
  RankStats st;
  st.wall_us.reserve(static_cast<std::size_t>(o.rounds));
  st.idle.assign(static_cast<std::size_t>(o.rounds) + 1, 0);
  const bool faulty = ps.plan.kill && rank == ps.plan.rank;
  int episode = faulty ? episodes_done : o.fault_times;
  bool corrupt_pending = o.corrupt_check && rank == 0 && !restarted;

  bool restarted_now = restarted;
  // CPU executor: survivors and the restarted rank retry reset() until everybody has met there.
  // CUDA executor: the survivors' reset() must fail (the killed process cannot meet them; this
  // also marks the communicator so that its destruction aborts), then everyone rebuilds from the
  // id in `resume`.
  const auto recover = [&]() -> bool {
    if (ps.cuda) {
      if (!restarted_now) {
        try {
          rank_layer.layer().reset();
        } catch (const Error&) {
        }
      }
      if (resume.has_id == 0) return false;
      rank_layer.build(resume.unique_id);
      return true;
    }
    if (restarted_now) rank_layer.build(resume.unique_id);
    const auto give_up = Clock::now() + std::chrono::seconds(30);
    while (Clock::now() < give_up) {
      try {
        rank_layer.layer().reset();
        return true;
      } catch (const Error&) {
      }
    }
    return false;
  };

  std::int64_t round = 1;
  if (restarted) {
    for (std::int64_t r = 1; r <= replay_through; ++r)
      (void)draw_round(load, o, ps.shape, r, ps.fixed_routing);  // the same draws as before
    if (!read_resume(down, resume)) return kRankError;
    round = resume.round;
    if (!recover()) return kRankResetFailed;
    restarted_now = false;
  }
  while (round <= o.rounds) {
    const RoundDraw draw = draw_round(load, o, ps.shape, round, ps.fixed_routing);
    const reference::Batch batch = round_batch(o, ps.shape, draw, round, rank);
    if (faulty && episode < o.fault_times && round >= kill_round(o, episode)) {
      send_stats(up, rank, st);  // what this incarnation did; it will not live to report
      st = RankStats{};
      st.idle.assign(static_cast<std::size_t>(o.rounds) + 1, 0);
      testing::inject_fault(rank_layer.layer(), {Fault::stall, ps.plan.stall_ms, 1});
      Msg m;
      m.kind = MsgKind::armed;
      m.rank = rank;
      m.round = round;
      m.at_ns = now_ns();
      send_msg(up, m);
      ++episode;
      // No pacing sleep: go straight into the round the supervisor kills us in.
    } else if (draw.sleep_us > 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(draw.sleep_us));
    }
    std::vector<std::uint16_t> y;
    std::optional<Msg> failed;
    std::string what;
    const auto t0 = Clock::now();
    try {
      y = rank_layer.forward(batch);
    } catch (const std::exception& e) {
      Msg m;
      m.kind = MsgKind::arrival;
      m.rank = rank;
      m.round = round;
      m.at_ns = now_ns();
      const auto* err = dynamic_cast<const Error*>(&e);
      m.code = static_cast<std::int32_t>(err ? err->code() : ErrorCode::internal);
      const Health h = rank_layer.layer().health();
      m.peer = h.peer;
      m.health_ok = h.ok ? 1 : 0;
      // CUDA: the lowest survivor makes the next communicator's id (rank 0 unless it is the
      // rank named as the culprit).
      if (ps.cuda && rank == (h.peer == 0 ? 1 : 0)) {
        m.has_id = 1;
        m.unique_id = get_unique_id();
      }
      failed = m;
      what = e.what();
    }
    const auto us = static_cast<float>(seconds_between(t0, Clock::now()) * 1e6);
    ++st.forwards;
    st.tokens += draw.tokens;
    if (draw.tokens == 0) {
      ++st.zero;
      st.idle[static_cast<std::size_t>(round)] = 1;
    }
    if (failed) {
      ++st.aborted;
      send_msg(up, *failed, what);
      if (!read_resume(down, resume)) break;  // the supervisor gave up on the run
      round = resume.round;
      if (!recover()) {
        send_stats(up, rank, st);
        return kRankResetFailed;
      }
      continue;
    }
    st.wall_us.push_back(us);
    if (us > st.max_us) {
      st.max_us = us;
      st.max_round = round;
    }
    if (o.check_every > 0 && round % o.check_every == 0) {
      if (corrupt_pending && !y.empty()) {
        y[0] ^= 0x4000;
        corrupt_pending = false;
      }
      record_check(st, y, reference.forward(batch), ps.options, rank, round, draw);
    }
    ++round;
  }
  send_stats(up, rank, st);
  return rank_layer.layer().health().ok ? kRankPass : kRankError;
}

struct Incarnation {
  pid_t pid = -1;
  int up = -1;    // supervisor reads
  int down = -1;  // supervisor writes resume rounds
  std::vector<char> buffer;
  bool eof = false;
  bool exited = false;
  int status = 0;
  std::string last = "starting";
};

struct KillEpisode {
  int index = 0;
  std::int64_t round = 0;
  std::int64_t armed_ns = 0, killed_ns = 0;
  bool died_by_signal = false;
  std::vector<std::optional<Msg>> arrivals;
  std::vector<std::string> whats;
  std::int64_t resume = 0;
  std::vector<std::string> problems;
};

int stress_processes(const StressOptions& o, ProcessSetup ps) {
  ps.name = "epmoe-stress-" + std::to_string(getpid());
  remove_shared_memory_group(ps.name, o.ranks);
  const int world = o.ranks;
  std::vector<int> all_fds;  // every pipe end the supervisor holds, closed in each child
  std::vector<Incarnation> live(static_cast<std::size_t>(world));
  std::vector<RankStats> stats(static_cast<std::size_t>(world));
  for (RankStats& s : stats) s.idle.assign(static_cast<std::size_t>(o.rounds) + 1, 0);

  const auto spawn = [&](int rank, bool restarted, std::int64_t replay, int done) {
    int up[2], down[2];
    if (pipe(up) != 0 || pipe(down) != 0)
      throw Error(ErrorCode::internal, std::string("pipe: ") + std::strerror(errno));
    std::fflush(nullptr);
    const pid_t pid = fork();
    if (pid < 0) throw Error(ErrorCode::internal, std::string("fork: ") + std::strerror(errno));
    if (pid == 0) {
      for (int fd : all_fds) ::close(fd);
      ::close(up[0]);
      ::close(down[1]);
      int code = kRankError;
      try {
        code = rank_process(o, ps, rank, up[1], down[0], restarted, replay, done);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "epmoe stress: rank %d process: %s\n", rank, e.what());
      }
      std::fflush(nullptr);
      _exit(code);
    }
    ::close(up[1]);
    ::close(down[0]);
    all_fds.push_back(up[0]);
    all_fds.push_back(down[1]);
    Incarnation& in = live[static_cast<std::size_t>(rank)];
    in = Incarnation{};
    in.pid = pid;
    in.up = up[0];
    in.down = down[1];
    in.last = restarted ? "restarted, joining reset()" : "starting";
  };
  const auto drop_fds = [&](Incarnation& in) {
    for (int* fd : {&in.up, &in.down})
      if (*fd >= 0) {
        ::close(*fd);
        all_fds.erase(std::remove(all_fds.begin(), all_fds.end(), *fd), all_fds.end());
        *fd = -1;
      }
  };
  const auto kill_everyone = [&] {
    for (Incarnation& in : live)
      if (in.pid > 0 && !in.exited) {
        ::kill(in.pid, SIGKILL);
        ::waitpid(in.pid, &in.status, 0);
        in.exited = true;
      }
  };

  const auto start = Clock::now();
  for (int r = 0; r < world; ++r) spawn(r, false, 0, 0);

  std::vector<KillEpisode> episodes;
  std::int64_t kill_at_ns = 0;    // != 0: a doomed rank is inside its round
  std::int64_t arrivals_due = 0;  // != 0: survivors must report by then
  std::vector<std::string> problems;
  int kills = 0;
  bool stop = false;
  const auto watchdog_at = start + std::chrono::seconds(o.watchdog_s);

  while (true) {
    bool all_done = true;
    for (const Incarnation& in : live) all_done &= in.eof && in.exited;
    if (all_done || stop) break;
    const auto now = Clock::now();
    if (o.watchdog_s > 0 && now >= watchdog_at) {
      std::fprintf(stderr, "\nepmoe stress: HANG: the run did not finish within --watchdog-s=%u\n",
                   o.watchdog_s);
      for (int r = 0; r < world; ++r)
        std::fprintf(stderr, "  rank %d (pid %d): last heard: %s\n", r,
                     static_cast<int>(live[static_cast<std::size_t>(r)].pid),
                     live[static_cast<std::size_t>(r)].last.c_str());
      kill_everyone();
      remove_shared_memory_group(ps.name, world);
      std::printf("FAIL: hang (watchdog)\n");
      std::fflush(nullptr);
      return kExitHang;
    }
    // The doomed rank has been inside its round long enough: kill it, start its successor.
    if (kill_at_ns != 0 && now_ns() >= kill_at_ns) {
      kill_at_ns = 0;
      const int victim = ps.plan.rank;
      Incarnation& in = live[static_cast<std::size_t>(victim)];
      KillEpisode& e = episodes.back();
      ::kill(in.pid, SIGKILL);
      e.killed_ns = now_ns();
      ::waitpid(in.pid, &in.status, 0);
      e.died_by_signal = WIFSIGNALED(in.status) && WTERMSIG(in.status) == SIGKILL;
      if (!e.died_by_signal) e.problems.push_back("the doomed rank exited before it was killed");
      drop_fds(in);
      ++kills;
      spawn(victim, true, e.round, kills);
      arrivals_due = now_ns() + (2 * std::int64_t{o.timeout_ms} + 5'000) * 1'000'000;
    }
    if (arrivals_due != 0 && now_ns() > arrivals_due) {
      KillEpisode& e = episodes.back();
      std::string missing;
      for (int r = 0; r < world; ++r)
        if (r != ps.plan.rank && !e.arrivals[static_cast<std::size_t>(r)])
          missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      e.problems.push_back("rank(s) " + missing +
                           " never reported the failed round (no error within the timeout)");
      stop = true;
      break;
    }

    std::vector<pollfd> fds;
    std::vector<int> who;
    for (int r = 0; r < world; ++r) {
      const Incarnation& in = live[static_cast<std::size_t>(r)];
      if (in.up >= 0 && !in.eof) {
        fds.push_back({in.up, POLLIN, 0});
        who.push_back(r);
      }
    }
    const int n = ::poll(fds.data(), static_cast<nfds_t>(fds.size()), 5);
    for (std::size_t i = 0; n > 0 && i < fds.size(); ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      const int r = who[i];
      Incarnation& in = live[static_cast<std::size_t>(r)];
      char buf[65536];
      const ssize_t got = ::read(in.up, buf, sizeof buf);
      if (got <= 0) {
        in.eof = true;
        continue;
      }
      in.buffer.insert(in.buffer.end(), buf, buf + got);
      while (in.buffer.size() >= sizeof(Msg)) {
        Msg m;
        std::memcpy(&m, in.buffer.data(), sizeof m);
        std::size_t used = sizeof m;
        if (m.kind == MsgKind::stats) {
          used = stats_bytes(m);
          if (in.buffer.size() < used) break;
          merge_stats(stats[static_cast<std::size_t>(r)], m, in.buffer.data() + sizeof m);
          in.last = "reported its results";
        } else if (m.kind == MsgKind::unique_id) {  // CUDA: the first communicator
          Resume first;
          first.round = 1;
          first.has_id = 1;
          first.unique_id = m.unique_id;
          for (Incarnation& each : live)
            if (each.down >= 0) (void)write_all(each.down, &first, sizeof first);
          in.last = "made the communicator id";
        } else if (m.kind == MsgKind::armed) {
          KillEpisode e;
          e.index = static_cast<int>(episodes.size()) + 1;
          e.round = m.round;
          e.armed_ns = m.at_ns;
          e.arrivals.assign(static_cast<std::size_t>(world), std::nullopt);
          e.whats.assign(static_cast<std::size_t>(world), "");
          episodes.push_back(std::move(e));
          kill_at_ns = m.at_ns + 50'000'000;  // 50 ms: well inside its (60 s) stalled round
          in.last = "doomed, inside round " + std::to_string(m.round);
        } else {  // arrival
          in.last = "failed round " + std::to_string(m.round) + ", waiting to reset";
          if (episodes.empty() || episodes.back().resume > 0 || r == ps.plan.rank) {
            problems.push_back("rank " + std::to_string(r) + ": unexpected error in round " +
                               std::to_string(m.round) + " (" +
                               to_string(static_cast<ErrorCode>(m.code)) + "): " + m.what);
            stop = true;
          } else {
            KillEpisode& e = episodes.back();
            e.arrivals[static_cast<std::size_t>(r)] = m;
            e.whats[static_cast<std::size_t>(r)] = m.what;
          }
        }
        in.buffer.erase(in.buffer.begin(), in.buffer.begin() + static_cast<std::ptrdiff_t>(used));
      }
    }
    // Every survivor reported and the successor is running: tell everyone where to resume.
    if (!episodes.empty() && episodes.back().resume == 0 && episodes.back().killed_ns > 0) {
      KillEpisode& e = episodes.back();
      bool everyone = true;
      std::int64_t last = e.round;
      for (int r = 0; r < world; ++r)
        if (r != ps.plan.rank) {
          everyone &= e.arrivals[static_cast<std::size_t>(r)].has_value();
          if (e.arrivals[static_cast<std::size_t>(r)])
            last = std::max(last, e.arrivals[static_cast<std::size_t>(r)]->round);
        }
      if (everyone) {
        e.resume = last + 1;
        arrivals_due = 0;
        Resume resume;
        resume.round = e.resume;
        for (int r = 0; r < world && resume.has_id == 0; ++r)  // CUDA: the next communicator
          if (const auto& a = e.arrivals[static_cast<std::size_t>(r)]; a && a->has_id != 0) {
            resume.has_id = 1;
            resume.unique_id = a->unique_id;
          }
        if (ps.cuda && resume.has_id == 0) {
          e.problems.push_back("no survivor sent the id of the next communicator");
          stop = true;
          break;
        }
        for (Incarnation& in : live)
          if (in.down >= 0) (void)write_all(in.down, &resume, sizeof resume);
      }
    }
    for (Incarnation& in : live)  // a process that exited is drained to EOF on later turns
      if (in.pid > 0 && !in.exited && ::waitpid(in.pid, &in.status, WNOHANG) == in.pid)
        in.exited = true;
  }
  if (stop) kill_everyone();
  const double wall_s = seconds_between(start, Clock::now());
  for (Incarnation& in : live) drop_fds(in);
  remove_shared_memory_group(ps.name, world);

  // ---- summary ----
  std::int64_t rounds_seen = 0;
  const RankStats all = print_load_summary(
      stats, o, reference::output_rule(ps.options.combine, ps.options.expert_math), wall_s,
      rounds_seen);
  bool fault_ok = problems.empty();
  const double bound_ms = o.timeout_ms + 1000.0;
  for (KillEpisode& e : episodes) {
    std::printf("\nfault episode %d: rank %d process SIGKILLed in round %lld, %.0f ms into it\n",
                e.index, ps.plan.rank, static_cast<long long>(e.round),
                static_cast<double>(e.killed_ns - e.armed_ns) * 1e-6);
    double worst = 0.0;
    for (int r = 0; r < world; ++r) {
      if (r == ps.plan.rank) {
        std::printf("  rank %d: killed, restarted\n", r);
        continue;
      }
      const auto& a = e.arrivals[static_cast<std::size_t>(r)];
      const std::string who = "rank " + std::to_string(r);
      if (!a) {
        std::printf("  rank %d: -\n", r);
        continue;
      }
      const double ms = std::max(0.0, static_cast<double>(a->at_ns - e.killed_ns) * 1e-6);
      worst = std::max(worst, ms);
      std::printf("  rank %d: %-14s after %5.0f ms (peer %d) %s\n", r,
                  to_string(static_cast<ErrorCode>(a->code)), ms, a->peer,
                  e.whats[static_cast<std::size_t>(r)].c_str());
      const auto code = static_cast<ErrorCode>(a->code);
      if (code != ErrorCode::timeout && code != ErrorCode::peer_aborted &&
          code != ErrorCode::protocol_violation)
        e.problems.push_back(who + ": unexpected error code " + to_string(code));
      if (a->health_ok) e.problems.push_back(who + ": forward threw but health() is ok");
      if (a->peer != ps.plan.rank)
        e.problems.push_back(who + " named rank " + std::to_string(a->peer) +
                             " instead of the killed rank " + std::to_string(ps.plan.rank));
      if (ms > bound_ms)
        e.problems.push_back(who + " noticed after " + std::to_string(static_cast<int>(ms)) +
                             " ms, more than the timeout + 1 s");
    }
    std::printf(
        "  detected by every survivor within %.0f ms of the kill (bound: timeout %u ms + "
        "1 s)\n",
        worst, o.timeout_ms);
    if (e.resume > 0)
      std::printf(ps.cuda ? "  the survivors' reset() failed on the dead peer; every rank rebuilt "
                            "its communicator and layer, the restarted rank %d with them; "
                            "resumed at round %lld\n"
                          : "  the restarted rank %d rejoined through reset(); resumed at round "
                            "%lld\n",
                  ps.plan.rank, static_cast<long long>(e.resume));
    for (const std::string& p : e.problems) std::printf("  PROBLEM: %s\n", p.c_str());
    if (!e.problems.empty()) fault_ok = false;
  }
  for (const std::string& p : problems) std::printf("PROBLEM: %s\n", p.c_str());
  if (ps.plan.kill && static_cast<int>(episodes.size()) != o.fault_times) {
    fault_ok = false;
    std::printf("\nPROBLEM: %d kill episode(s) expected, %zu seen\n", o.fault_times,
                episodes.size());
  }
  bool exits_ok = true;
  for (int r = 0; r < world; ++r) {
    const Incarnation& in = live[static_cast<std::size_t>(r)];
    if (!WIFEXITED(in.status) || WEXITSTATUS(in.status) != kRankPass) {
      exits_ok = false;
      std::printf("PROBLEM: rank %d process %s %d%s\n", r,
                  WIFEXITED(in.status) ? "exited with" : "died of signal",
                  WIFEXITED(in.status) ? WEXITSTATUS(in.status) : WTERMSIG(in.status),
                  WIFEXITED(in.status) && WEXITSTATUS(in.status) == kRankResetFailed
                      ? " (reset() never met)"
                      : "");
    }
  }
  const bool complete = !stop && rounds_seen > 0;
  const bool idle_enough =
      static_cast<double>(all.zero) >= o.min_zero_fraction * static_cast<double>(all.forwards);
  if (!idle_enough) std::printf("PROBLEM: fewer zero-token forwards than --min-zero-fraction\n");
  const bool ok = all.mismatched_rounds == 0 && fault_ok && exits_ok && complete && idle_enough;
  std::string why;
  if (all.mismatched_rounds > 0) why += " mismatch";
  if (!fault_ok) why += ps.plan.kill ? " fault-detection/recovery" : " errors";
  if (!exits_ok) why += " rank-process-failed";
  if (!complete) why += " stopped-early";
  if (!idle_enough) why += " too-few-idle-rounds";
  std::printf("\n%s%s%s\n", ok ? "PASS" : "FAIL:", why.c_str(),
              !ps.plan.kill || !ok ? ""
                                   : " (every kill detected by every survivor; the restarted "
                                     "rank rejoined)");
  return ok ? 0 : kExitFail;
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
  options.expert_math = parse_expert_math(o.math, "--math");
  options.timeout_ms = o.timeout_ms;
  std::optional<harness::Routing> fixed_routing;
  if (o.routing != "mixed") fixed_routing = harness::parse_routing(o.routing);
  if (o.rounds < 1) reject("--rounds=" + std::to_string(o.rounds) + ": must be >= 1");
  if (o.check_every < 0)
    reject("--check-every=" + std::to_string(o.check_every) + ": must be >= 0 (0 = never)");
  if (!(o.idle_fraction >= 0.0 && o.idle_fraction <= 1.0))
    reject("--idle-fraction=" + std::to_string(o.idle_fraction) + ": must be in [0, 1]");
  if (o.fault_times < 1)
    reject("--fault-times=" + std::to_string(o.fault_times) + ": must be >= 1");
  const FaultPlan plan = parse_fault(o.fault, o.ranks, o.timeout_ms, o.processes);
  if (plan.fault != Fault::none && !testing::fault_injection_available())
    throw Error(ErrorCode::unsupported,
                "--fault: this build has no fault switches (configure with "
                "-DEPMOE_FAULT_INJECTION=ON)");
  (void)make_config(shape, precision, 0, o.ranks, options);  // validates before allocating
  // --processes forks before any CUDA call (a CUDA context does not survive fork): the rank
  // processes find their GPUs themselves, and only an explicit --executor=cuda runs them there.
  const bool cuda_processes = o.processes && o.executor == "cuda";
  const Backend backend = cuda_processes ? Backend::cuda_nccl
                          : o.processes  ? Backend::cpu_threads
                                         : choose_backend(o.executor, o.ranks);

  const std::int64_t params = shape.num_experts * 3 * shape.intermediate * shape.hidden;
  const std::int64_t need = params * (2 + 4 + 4);  // bf16 + the layers' and reference's copies
  const std::int64_t have = available_host_bytes();
  if (backend == Backend::cpu_threads && have > 0 && need > have * 9 / 10)
    reject(shape_name + " with " + std::to_string(shape.num_experts) + " experts needs about " +
           std::to_string(need >> 30) + " GiB of host memory on the CPU executor and " +
           std::to_string(have >> 30) + " GiB are available; pass --experts with fewer experts");

  std::printf(
      "epmoe stress: %s H=%lld I=%lld E=%lld K=%lld max_tokens=%lld  precision=%s combine=%s "
      "math=%s routing=%s\n",
      shape_name.c_str(), static_cast<long long>(shape.hidden),
      static_cast<long long>(shape.intermediate), static_cast<long long>(shape.num_experts),
      static_cast<long long>(shape.top_k), static_cast<long long>(shape.max_tokens_per_rank),
      to_string(precision), to_string(options.combine), to_string(options.expert_math),
      o.routing.c_str());
  std::printf(
      "executor: %s, no barrier between rounds  rounds=%lld seed=%llu "
      "idle-fraction=%.2f max-sleep-us=%u timeout-ms=%u check-every=%lld fault=%s\n",
      o.processes ? (std::to_string(o.ranks) +
                     (cuda_processes ? " rank processes (CUDA executor, rank r on GPU r, NCCL)"
                                     : " rank processes (CPU executor over POSIX shared memory)") +
                     ", a supervisor")
                        .c_str()
                  : describe_backend(backend, o.ranks).c_str(),
      static_cast<long long>(o.rounds), static_cast<unsigned long long>(o.seed), o.idle_fraction,
      o.max_sleep_us, o.timeout_ms, static_cast<long long>(o.check_every),
      plan.fault == Fault::none ? "none"
                                : (plan.text + " x" + std::to_string(o.fault_times)).c_str());
  std::fflush(stdout);

  if (o.processes)  // fork now: no thread and no layer exists yet
    return stress_processes(
        o, ProcessSetup{"", shape, precision, options, fixed_routing, plan, cuda_processes});

  const reference::LayerWeights weights = harness::make_random_weights(shape, o.seed);
  Cluster cluster(shape, precision, options, o.ranks, weights, backend);

  // ---- the run ----
  std::vector<RankLive> live(static_cast<std::size_t>(o.ranks));
  std::vector<RankStats> stats(static_cast<std::size_t>(o.ranks));
  Recovery recovery(o.ranks, plan, o.timeout_ms);
  Progress progress("stress rounds", o.rounds);
  std::atomic<std::int64_t> zero_total{0}, forwards_total{0}, failed_total{0};
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
        const RoundDraw draw = draw_round(load, o, shape, round, fixed_routing);
        const std::int64_t tokens = draw.tokens;
        const reference::Batch batch = round_batch(o, shape, draw, round, rank);
        // The faulty rank arms its fault at evenly spaced rounds (one episode each).
        const std::int64_t arm_at =
            o.rounds * (o.fault_times - episodes_left + 1) / (std::int64_t{o.fault_times} + 1);
        if (episodes_left > 0 && !armed && round >= arm_at) {
          testing::inject_fault(layer, {plan.fault, plan.stall_ms, 1});
          armed = true;
        }
        if (const std::uint32_t us = draw.sleep_us; us > 0) {
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
          // The CUDA executor's forward returns once its stream is done; a failed round shows in
          // health() (and would throw from the next forward).
          if (const Health h = layer.health(); !h.ok) throw Error(h.code, h.what);
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
          const auto check = record_check(st, y, cluster.reference(rank).forward(batch), options,
                                          rank, round, draw);
          if (!check.pass) failed_total.fetch_add(1, std::memory_order_relaxed);
        }
        if (rank == 0) {
          const double f = static_cast<double>(zero_total.load(std::memory_order_relaxed)) /
                           std::max<double>(1.0, static_cast<double>(forwards_total.load()));
          char detail[128];
          std::snprintf(detail, sizeof detail, "zero-token %.0f%%  failed checks %lld", 100.0 * f,
                        static_cast<long long>(failed_total.load()));
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
  std::int64_t rounds_seen = 0;
  const RankStats all = print_load_summary(
      stats, o, reference::output_rule(options.combine, options.expert_math), wall_s, rounds_seen);
  const auto pct = [](std::int64_t a, std::int64_t b) {
    return b > 0 ? 100.0 * static_cast<double>(a) / static_cast<double>(b) : 0.0;
  };

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
  const bool ok = all.mismatched_rounds == 0 && errors == 0 && fault_ok && complete && idle_enough;
  std::string why;
  if (all.mismatched_rounds > 0) why += " mismatch";
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
      "With --processes every rank is a process (POSIX shared memory) under a supervisor, and\n"
      "the one fault is\n"
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
  cmd->add_option("--ranks", o->ranks,
                  "expert-parallel ranks (threads, or processes with --processes)")
      ->capture_default_str();
  cmd->add_option("--rounds", o->rounds, "rounds every rank runs")->capture_default_str();
  cmd->add_option("--precision", o->precision, "bf16 | mxfp8 | nvfp4")->capture_default_str();
  cmd->add_option("--combine", o->combine, "staged | in_kernel_reduce")->capture_default_str();
  cmd->add_option("--math", o->math,
                  "expert math: exact | tensor_core (CUDA executor; the CPU executor always "
                  "computes exactly); picks the rule outputs are checked with")
      ->capture_default_str();
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
                  "skip_launch_when_idle:RANK | stall:RANK:MS | round_jump:RANK | (with "
                  "--processes) kill:RANK (see below)");
  cmd->add_flag("--processes", o->processes,
                "run every rank as a process under a supervisor (CPU executor over POSIX shared "
                "memory, or with --executor=cuda rank r on GPU r); enables --fault kill:RANK");
  cmd->add_option("--fault-times", o->fault_times, "fault episodes in the run")
      ->capture_default_str();
  cmd->add_flag("--corrupt-check", o->corrupt_check,
                "flip one output bit before the first check (proves the checker can fail)")
      ->group("");
  return StressCommand{cmd, [o] { return stress(*o); }};
}

}  // namespace epmoe::tools

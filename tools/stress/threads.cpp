#include "stress/threads.hpp"

#include <atomic>
#include <cstdio>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "executor.hpp"
#include "harness/cluster.hpp"
#include "harness/rank_threads.hpp"
#include "progress.hpp"
#include "stress/load.hpp"
#include "stress/recovery.hpp"
#include "stress/report.hpp"
#include "stress/watchdog.hpp"

namespace epmoe::tools::stress {
namespace {

// What the rank threads share.
struct ThreadRun {
  ThreadRun(const Options& options, const Setup& setup, Cluster& ranks)
      : o(options),
        s(setup),
        cluster(ranks),
        live(static_cast<std::size_t>(o.ranks)),
        stats(static_cast<std::size_t>(o.ranks)),
        recovery(o.ranks, s.fault, o.timeout_ms),
        progress("stress rounds", o.rounds) {}

  const Options& o;
  const Setup& s;
  Cluster& cluster;
  std::vector<RankLive> live;
  std::vector<RankStats> stats;
  Recovery recovery;
  Progress progress;
  std::atomic<std::int64_t> zero_total{0}, forwards_total{0}, failed_total{0};
};

// One forward() and how it went.
struct Attempt {
  std::vector<std::uint16_t> y;
  std::optional<Arrival> failed;
  float us = 0.0f;
  std::uint32_t layer_round = 0;  // the layer's next round before the call
};

// One rank thread's rounds: its load, its fault episodes (on the faulty rank), its checks.
class RankThread {
 public:
  RankThread(ThreadRun& run, int rank);
  void run();

 private:
  void arm_if_due(std::int64_t round);
  void pace(const RoundDraw& draw, std::int64_t round);
  Attempt forward(const reference::Batch& batch, std::int64_t round);
  void count(const RoundDraw& draw, std::int64_t round, const Attempt& a);
  void settle_fault(Attempt& a, const RoundDraw& draw, std::int64_t round);
  bool recover(Arrival failed, std::int64_t& round);
  void check(Attempt& a, const reference::Batch& batch, const RoundDraw& draw, std::int64_t round);
  void show_progress(std::int64_t round);

  ThreadRun& run_;
  const Options& o_;
  const FaultPlan& plan_;
  int rank_;
  RankLive& me_;
  RankStats& st_;
  Layer& layer_;
  Load load_;
  bool faulty_;
  int episodes_left_;
  bool armed_ = false;
  bool corrupt_pending_;
};

RankThread::RankThread(ThreadRun& run, int rank)
    : run_(run),
      o_(run.o),
      plan_(run.s.fault),
      rank_(rank),
      me_(run.live[static_cast<std::size_t>(rank)]),
      st_(run.stats[static_cast<std::size_t>(rank)]),
      layer_(run.cluster.layer(rank)),
      load_(run.o, run.s, rank),
      faulty_(plan_.fault != Fault::none && rank == plan_.rank),
      episodes_left_(faulty_ ? o_.fault_times : 0),
      corrupt_pending_(o_.corrupt_check && rank == 0) {
  st_ = RankStats(o_.rounds);
}

void RankThread::run() {
  std::int64_t round = 1;
  while (round <= o_.rounds && !run_.recovery.stopped()) {
    const RoundDraw draw = load_.draw(round);
    const reference::Batch batch = round_batch(o_, run_.s.shape, draw, round, rank_);
    arm_if_due(round);
    pace(draw, round);
    Attempt a = forward(batch, round);
    count(draw, round, a);
    settle_fault(a, draw, round);
    if (a.failed) {
      if (!recover(std::move(*a.failed), round)) break;
      continue;
    }
    check(a, batch, draw, round);
    show_progress(round);
    ++round;
  }
  me_.set(Doing::finished, round - 1);
}

// The faulty rank arms its fault at evenly spaced rounds (one episode each).
void RankThread::arm_if_due(std::int64_t round) {
  if (episodes_left_ <= 0 || armed_) return;
  if (round < fault_round(o_, o_.fault_times - episodes_left_)) return;
  testing::inject_fault(layer_, {plan_.fault, plan_.stall_ms, 1});
  armed_ = true;
}

void RankThread::pace(const RoundDraw& draw, std::int64_t round) {
  if (draw.sleep_us == 0) return;
  me_.set(Doing::sleeping, round);
  std::this_thread::sleep_for(std::chrono::microseconds(draw.sleep_us));
}

Attempt RankThread::forward(const reference::Batch& batch, std::int64_t round) {
  Attempt a;
  me_.set(Doing::forward, round);
  a.layer_round = layer_.next_round();
  if (armed_ && plan_.fault != Fault::skip_launch_when_idle)
    run_.recovery.fault_fired(rank_, round);  // fires inside this very call
  const auto t0 = Clock::now();
  try {
    a.y = run_.cluster.forward(rank_, batch);
    // The CUDA executor's forward returns once its stream is done; a failed round shows in
    // health() (and would throw from the next forward).
    if (const Health h = layer_.health(); !h.ok) throw Error(h.code, h.what);
  } catch (const Error& e) {
    a.failed = Arrival{true, e.code(), layer_.health(), e.what(), round, Clock::now()};
  } catch (const std::exception& e) {
    a.failed = Arrival{true, ErrorCode::internal, layer_.health(), e.what(), round, Clock::now()};
  }
  a.us = static_cast<float>(seconds_between(t0, Clock::now()) * 1e6);
  return a;
}

void RankThread::count(const RoundDraw& draw, std::int64_t round, const Attempt& a) {
  if (!a.failed) record_wall(st_, a.us, round);
  record_forward(st_, draw, round);
  if (draw.tokens == 0) run_.zero_total.fetch_add(1, std::memory_order_relaxed);
  run_.forwards_total.fetch_add(1, std::memory_order_relaxed);
}

// A stall or round jump fired inside the forward just made, ending its episode; a skip fires only
// in a round with T == 0, and shows as a layer whose round did not move.
void RankThread::settle_fault(Attempt& a, const RoundDraw& draw, std::int64_t round) {
  if (!armed_) return;
  if (plan_.fault != Fault::skip_launch_when_idle) {
    armed_ = false;
    --episodes_left_;
    return;
  }
  if (a.failed || draw.tokens != 0 || layer_.next_round() != a.layer_round) return;
  // The launch was skipped: this rank now "waits elsewhere" (in a real engine: the next layer,
  // whose peers are still stuck in this one) until the others have noticed.
  run_.recovery.fault_fired(rank_, round);
  a.failed = Arrival{false, ErrorCode::internal, layer_.health(), "skipped its launch",
                     round, Clock::now()};
  armed_ = false;
  --episodes_left_;
}

// Reports the failed round, waits for everyone, resets; false when the run must stop.
bool RankThread::recover(Arrival failed, std::int64_t& round) {
  ++st_.aborted;
  me_.set(Doing::recovering, round);
  const std::int64_t resume = run_.recovery.arrive(rank_, std::move(failed));
  if (resume < 0) return false;
  const auto r0 = Clock::now();
  try {
    layer_.reset();
    if (faulty_) testing::inject_fault(layer_, {});
  } catch (const Error& e) {
    run_.recovery.reset_failed(rank_, e.what());
    return false;
  }
  run_.recovery.reset_done(seconds_between(r0, Clock::now()) * 1e3);
  round = resume;
  return true;
}

void RankThread::check(Attempt& a, const reference::Batch& batch, const RoundDraw& draw,
                       std::int64_t round) {
  if (!check_due(o_, round)) return;
  me_.set(Doing::checking, round);
  corrupt_once(a.y, corrupt_pending_);
  const auto checked =
      record_check(st_, a.y, run_.cluster.reference(rank_).forward(batch), run_.s.precision,
                   run_.s.shape.intermediate, run_.s.checked_options(), rank_, round, draw);
  if (!checked.pass) run_.failed_total.fetch_add(1, std::memory_order_relaxed);
}

void RankThread::show_progress(std::int64_t round) {
  if (rank_ != 0) return;
  const double f = static_cast<double>(run_.zero_total.load(std::memory_order_relaxed)) /
                   std::max<double>(1.0, static_cast<double>(run_.forwards_total.load()));
  char detail[128];
  std::snprintf(detail, sizeof detail, "zero-token %.0f%%  failed checks %lld", 100.0 * f,
                static_cast<long long>(run_.failed_total.load()));
  run_.progress.update(round, detail);
}

// The summary after the run; returns the exit status.
int summarize(ThreadRun& run, double wall_s) {
  const Options& o = run.o;
  const FaultPlan& plan = run.s.fault;
  std::int64_t rounds_seen = 0;
  const RankStats all = print_load_summary(
      run.stats, o,
      reference::output_rule(run.s.layer_options.combine, run.s.checked_options().expert_math,
                             run.s.precision, run.s.shape.intermediate),
      wall_s, rounds_seen);
  const EpisodeTally tally = print_episodes(run.recovery.episodes(), plan, o.ranks, o.timeout_ms);
  bool fault_ok = !tally.problems;
  if (plan.fault != Fault::none && tally.fault_episodes != o.fault_times) {
    fault_ok = false;
    std::printf("\nPROBLEM: %d fault episode(s) expected, %d seen\n", o.fault_times,
                tally.fault_episodes);
  }
  for (int r = 0; r < o.ranks; ++r)
    if (const Health h = run.cluster.layer(r).health(); !h.ok) {
      fault_ok = false;
      std::printf("PROBLEM: rank %d ended unhealthy: %s\n", r, h.what.c_str());
    }
  std::printf("errors            %lld unexpected\n", static_cast<long long>(tally.errors));

  const bool complete = rounds_seen > 0 && !run.recovery.stopped();
  const bool idle_enough =
      static_cast<double>(all.zero) >= o.min_zero_fraction * static_cast<double>(all.forwards);
  if (!idle_enough)
    std::printf("PROBLEM: %.1f%% zero-token forwards, fewer than --min-zero-fraction=%.2f\n",
                percent(all.zero, all.forwards), o.min_zero_fraction);
  std::string why;
  if (all.mismatched_rounds > 0) why += " mismatch";
  if (tally.errors > 0) why += " errors";
  if (!fault_ok) why += plan.fault != Fault::none ? " fault-detection/recovery" : " recovery";
  if (!complete) why += " stopped-early";
  if (!idle_enough) why += " too-few-idle-rounds";
  return print_verdict(why, plan.fault == Fault::none ? ""
                                                      : " (every fault detected by every survivor "
                                                        "and recovered from)");
}

}  // namespace

int run_threads(const Options& o, const Setup& s) {
  const reference::LayerWeights weights = harness::make_random_weights(s.shape, o.seed);
  Cluster cluster(
      s.shape, s.precision, s.layer_options, o.ranks, weights, s.backend, {},
      [&s](const LayerConfig& c) { return with_tool_knobs(c, s.token_back, s.megakernel); });
  ThreadRun run(o, s, cluster);
  const auto start = Clock::now();
  {
    Watchdog watchdog(o.watchdog_s, run.live);
    run_on_rank_threads(o.ranks, [&](int rank) { RankThread(run, rank).run(); });
  }
  const double wall_s = seconds_between(start, Clock::now());
  run.progress.finish();
  return summarize(run, wall_s);
}

}  // namespace epmoe::tools::stress

#include "stress/recovery.hpp"

#include <algorithm>
#include <cstdio>

namespace epmoe::tools::stress {
namespace {

// The errors a bounded wait raises on noticing a faulty peer.
bool is_detection_code(ErrorCode code) {
  return code == ErrorCode::timeout || code == ErrorCode::peer_aborted ||
         code == ErrorCode::protocol_violation;
}

// Every survivor must notice within the timeout + 1 s of the fault.
void check_latency(const std::string& who, double ms, std::uint32_t timeout_ms,
                   std::vector<std::string>& problems) {
  const double bound_ms = timeout_ms + 1000.0;
  if (ms > bound_ms)
    problems.push_back(who + " noticed after " + std::to_string(static_cast<int>(ms)) +
                       " ms, more than the timeout + 1 s");
}

void print_episode(const Episode& e, const FaultPlan& plan, int ranks, std::uint32_t timeout_ms) {
  if (e.fault) {
    std::printf("\nfault episode %d: %s on rank %d in round %lld\n", e.index,
                testing::to_string(plan.fault), e.faulty, static_cast<long long>(e.fault_round));
  } else {
    std::printf("\nerror episode %d (no fault was injected)\n", e.index);
  }
  for (int r = 0; r < ranks; ++r) {
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
    std::printf("  detected by every survivor within %.0f ms (bound: timeout %u ms + 1 s)\n", worst,
                timeout_ms);
  }
  if (e.resume > 0)
    std::printf("  reset on every rank in %.1f ms; resumed at round %lld\n", e.reset_ms,
                static_cast<long long>(e.resume));
  for (const std::string& p : e.problems) std::printf("  PROBLEM: %s\n", p.c_str());
}

// Prints rank r's line of a kill episode and judges it; returns its detection latency (0 when it
// has none).
double judge_kill_survivor(KillEpisode& e, int r, std::uint32_t timeout_ms) {
  if (r == e.victim) {
    std::printf("  rank %d: killed, restarted\n", r);
    return 0.0;
  }
  const std::optional<Arrival>& a = e.arrivals[static_cast<std::size_t>(r)];
  if (!a) {
    std::printf("  rank %d: -\n", r);
    return 0.0;
  }
  const double ms = std::max(0.0, ms_between(e.killed_at, a->at));
  std::printf("  rank %d: %-14s after %5.0f ms (peer %d) %s\n", r, to_string(a->code), ms,
              a->health.peer, a->what.c_str());
  const std::string who = "rank " + std::to_string(r);
  if (!is_detection_code(a->code))
    e.problems.push_back(who + ": unexpected error code " + to_string(a->code));
  if (a->health.ok) e.problems.push_back(who + ": forward threw but health() is ok");
  if (a->health.peer != e.victim)
    e.problems.push_back(who + " named rank " + std::to_string(a->health.peer) +
                         " instead of the killed rank " + std::to_string(e.victim));
  check_latency(who, ms, timeout_ms, e.problems);
  return ms;
}

}  // namespace

void Recovery::fault_fired(int rank, std::int64_t round) {
  std::lock_guard lock(mutex_);
  firing_ = Firing{rank, round, Clock::now()};
}

std::int64_t Recovery::arrive(int rank, Arrival a) {
  std::unique_lock lock(mutex_);
  if (stop_) return -1;
  if (arrived_ == 0) {
    arrivals_.assign(static_cast<std::size_t>(world_), std::nullopt);
    // Everybody must report within a timeout (plus a stall) of the first one, and a margin.
    deadline_ = Clock::now() +
                std::chrono::milliseconds(2 * std::uint64_t{timeout_ms_} + plan_.stall_ms + 5'000);
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
  if (!cv_.wait_until(lock, deadline_, [&] { return generation_ != generation || stop_; }))
    give_up_on_missing();
  return stop_ ? -1 : resume_;
}

void Recovery::reset_done(double ms) {
  std::lock_guard lock(mutex_);
  if (!episodes_.empty()) episodes_.back().reset_ms = std::max(episodes_.back().reset_ms, ms);
}

void Recovery::reset_failed(int rank, const std::string& what) {
  std::lock_guard lock(mutex_);
  if (!episodes_.empty())
    episodes_.back().problems.push_back("rank " + std::to_string(rank) +
                                        ": reset() failed: " + what);
  stop_ = true;
  cv_.notify_all();
}

bool Recovery::stopped() {
  std::lock_guard lock(mutex_);
  return stop_;
}

Episode Recovery::new_episode() {
  Episode e;
  e.index = static_cast<int>(episodes_.size()) + 1;
  for (auto& a : arrivals_) e.arrivals.push_back(a ? *a : Arrival{});
  e.latency_ms.assign(static_cast<std::size_t>(world_), -1.0);
  return e;
}

// Some rank never reported the failed round: the episode ends the run.
void Recovery::give_up_on_missing() {
  Episode e = new_episode();
  std::vector<int> missing;
  for (int r = 0; r < world_; ++r)
    if (!arrivals_[static_cast<std::size_t>(r)]) missing.push_back(r);
  e.problems.push_back(never_reported(missing));
  episodes_.push_back(std::move(e));
  stop_ = true;
  cv_.notify_all();
}

// Every rank has reported: they resume after the last round any of them reached.
void Recovery::judge() {
  Episode e = new_episode();
  std::int64_t last = 0;
  for (const Arrival& a : e.arrivals) last = std::max(last, a.round);
  e.resume = resume_ = last + 1;
  if (!firing_) {
    for (int r = 0; r < world_; ++r)
      if (const Arrival& a = e.arrivals[static_cast<std::size_t>(r)]; a.error)
        e.problems.push_back("rank " + std::to_string(r) + ": unexpected error (" +
                             to_string(a.code) + "): " + a.what);
    episodes_.push_back(std::move(e));
    return;
  }
  e.fault = true;
  e.faulty = firing_->rank;
  e.fault_round = firing_->round;
  for (int r = 0; r < world_; ++r) judge_survivor(e, r);
  firing_.reset();
  episodes_.push_back(std::move(e));
}

void Recovery::judge_survivor(Episode& e, int r) const {
  const Arrival& a = e.arrivals[static_cast<std::size_t>(r)];
  const std::string who = "rank " + std::to_string(r);
  if (r == e.faulty) {
    // The skipping rank returned "successfully"; a stalled or jumped one learns of the abort.
    if (plan_.fault != Fault::skip_launch_when_idle && !a.error)
      e.problems.push_back(who + " (faulty) was never told its round failed");
    return;
  }
  if (!a.error) {
    e.problems.push_back(who + " reported no error");
    return;
  }
  const double ms = std::max(0.0, seconds_between(firing_->at, a.at) * 1e3);
  e.latency_ms[static_cast<std::size_t>(r)] = ms;
  if (!is_detection_code(a.code))
    e.problems.push_back(who + ": unexpected error code " + to_string(a.code) + ": " + a.what);
  if (a.health.ok)
    e.problems.push_back(who + ": forward threw but health() is ok");
  else if (a.health.peer != e.faulty)
    e.problems.push_back(who + " named rank " + std::to_string(a.health.peer) +
                         " instead of the faulty rank " + std::to_string(e.faulty) + ": " + a.what);
  check_latency(who, ms, timeout_ms_, e.problems);
}

std::string never_reported(const std::vector<int>& missing) {
  std::string ranks;
  for (int r : missing) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  return "rank(s) " + ranks + " never reported the failed round (no error within the timeout)";
}

EpisodeTally print_episodes(const std::vector<Episode>& episodes, const FaultPlan& plan, int ranks,
                            std::uint32_t timeout_ms) {
  EpisodeTally tally;
  for (const Episode& e : episodes) {
    tally.fault_episodes += e.fault;
    if (!e.fault)
      for (const Arrival& a : e.arrivals) tally.errors += a.error;
    tally.problems |= !e.problems.empty();
    print_episode(e, plan, ranks, timeout_ms);
  }
  return tally;
}

bool print_kill_episode(KillEpisode& e, std::uint32_t timeout_ms, bool cuda) {
  std::printf("\nfault episode %d: rank %d process SIGKILLed in round %lld, %.0f ms into it\n",
              e.index, e.victim, static_cast<long long>(e.round),
              ms_between(e.armed_at, e.killed_at));
  double worst = 0.0;
  for (int r = 0; r < static_cast<int>(e.arrivals.size()); ++r)
    worst = std::max(worst, judge_kill_survivor(e, r, timeout_ms));
  std::printf(
      "  detected by every survivor within %.0f ms of the kill (bound: timeout %u ms + "
      "1 s)\n",
      worst, timeout_ms);
  if (e.resume > 0)
    std::printf(cuda ? "  the survivors' reset() failed on the dead peer; every rank rebuilt "
                       "its communicator and layer, the restarted rank %d with them; "
                       "resumed at round %lld\n"
                     : "  the restarted rank %d rejoined through reset(); resumed at round "
                       "%lld\n",
                e.victim, static_cast<long long>(e.resume));
  for (const std::string& p : e.problems) std::printf("  PROBLEM: %s\n", p.c_str());
  return e.problems.empty();
}

}  // namespace epmoe::tools::stress

// The recovery judge. When a round fails, every rank must leave it with an error naming the
// faulty rank (Health.peer) within the timeout + 1 s; then every rank resets and the run goes on
// from one round all agree on. Rank threads report to Recovery, an in-process control plane; the
// supervisor of rank processes keeps a KillEpisode per killed process.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "epmoe/epmoe.hpp"
#include "stress/clock.hpp"
#include "stress/fault.hpp"

namespace epmoe::tools::stress {

// How a rank left the round it could not finish.
struct Arrival {
  bool error = false;  // false: the faulty rank, which skipped its launch (or no report at all)
  ErrorCode code = ErrorCode::internal;
  Health health;
  std::string what;
  std::int64_t round = 0;  // the stress round (1-based)
  Clock::time_point at;
};

// One failed round on the rank threads, judged.
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

// The "engine control plane" of rank threads: when a round fails, every rank reports here; once
// all have, the episode is judged and every rank calls reset() on its own thread. Bounded like
// everything else.
class Recovery {
 public:
  Recovery(int world, const FaultPlan& plan, std::uint32_t timeout_ms)
      : world_(world), plan_(plan), timeout_ms_(timeout_ms) {}

  // The faulty rank's fault fires now, in `round`: the survivors' detection latency counts from
  // here.
  void fault_fired(int rank, std::int64_t round);

  // Returns the stress round every rank resumes at, or -1 when the run must stop.
  std::int64_t arrive(int rank, Arrival a);

  void reset_done(double ms);
  void reset_failed(int rank, const std::string& what);
  bool stopped();
  const std::vector<Episode>& episodes() const { return episodes_; }

 private:
  struct Firing {
    int rank;
    std::int64_t round;
    Clock::time_point at;
  };

  Episode new_episode();
  void give_up_on_missing();
  void judge();
  void judge_survivor(Episode& e, int r) const;

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

// The problem of a failed round that ranks `missing` never reported.
std::string never_reported(const std::vector<int>& missing);

// The rank threads' episodes in the summary.
struct EpisodeTally {
  std::int64_t errors = 0;  // in episodes without a fault
  int fault_episodes = 0;
  bool problems = false;
};
EpisodeTally print_episodes(const std::vector<Episode>& episodes, const FaultPlan& plan, int ranks,
                            std::uint32_t timeout_ms);

// A rank process SIGKILLed by the supervisor (--processes --fault kill:RANK).
struct KillEpisode {
  int index = 0;
  int victim = -1;
  std::int64_t round = 0;  // the round the victim was killed in
  Clock::time_point armed_at, killed_at;
  bool killed = false;
  bool died_by_signal = false;
  std::vector<std::optional<Arrival>> arrivals;   // per rank; the victim's stays empty
  std::vector<std::optional<UniqueId>> next_ids;  // CUDA: the next communicator, per sender
  std::int64_t resume = 0;                        // 0 until every survivor has reported
  std::vector<std::string> problems;
};

// Judges a kill episode's survivors and prints it; false if it had a problem.
bool print_kill_episode(KillEpisode& e, std::uint32_t timeout_ms, bool cuda);

}  // namespace epmoe::tools::stress

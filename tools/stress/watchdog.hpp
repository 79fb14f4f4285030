// The run's wall-clock limit (--watchdog-s): a hang becomes a report of who is stuck where, and
// exit status 3, instead of a test killed by its harness with nothing said.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "stress/clock.hpp"

namespace epmoe::tools::stress {

// What a rank thread is doing, as the watchdog reports it.
enum class Doing : int { starting, sleeping, forward, checking, recovering, finished };
const char* to_string(Doing d);

// Written by its rank thread, read by the watchdog.
struct RankLive {
  std::atomic<std::int64_t> round{0};
  std::atomic<int> doing{static_cast<int>(Doing::starting)};
  std::atomic<std::int64_t> since_ns{0};
  void set(Doing d, std::int64_t r);
};

// Rank threads: a thread that, unless destroyed first, prints every rank's RankLive and ends the
// process. (The supervisor of rank processes watches the clock in its own loop.)
class Watchdog {
 public:
  Watchdog(std::uint32_t seconds, std::vector<RankLive>& live);  // 0 seconds: none
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

 private:
  [[noreturn]] void fire(std::uint32_t seconds);

  std::vector<RankLive>& live_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

// The first line of a hang report (stderr) and the verdict (stdout), in both rank modes.
void print_hang_banner(std::uint32_t seconds);
void print_hang_verdict();

}  // namespace epmoe::tools::stress

#include "stress/watchdog.hpp"

#include <cstdio>
#include <cstdlib>

#include "stress/options.hpp"

namespace epmoe::tools::stress {

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

void RankLive::set(Doing d, std::int64_t r) {
  round.store(r, std::memory_order_relaxed);
  since_ns.store(to_ns(Clock::now()), std::memory_order_relaxed);
  doing.store(static_cast<int>(d), std::memory_order_release);
}

Watchdog::Watchdog(std::uint32_t seconds, std::vector<RankLive>& live) : live_(live) {
  if (seconds == 0) return;
  thread_ = std::thread([this, seconds] {
    std::unique_lock lock(mutex_);
    if (cv_.wait_for(lock, std::chrono::seconds(seconds), [this] { return done_; })) return;
    fire(seconds);
  });
}

Watchdog::~Watchdog() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard lock(mutex_);
    done_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

// Ends the process from the watchdog thread: the rank threads are stuck, so nothing can join them.
void Watchdog::fire(std::uint32_t seconds) {
  print_hang_banner(seconds);
  const auto now = to_ns(Clock::now());
  for (std::size_t r = 0; r < live_.size(); ++r) {
    const auto d = static_cast<Doing>(live_[r].doing.load(std::memory_order_acquire));
    std::fprintf(stderr, "  rank %zu: %s round %lld for %.1f s\n", r, to_string(d),
                 static_cast<long long>(live_[r].round.load(std::memory_order_relaxed)),
                 static_cast<double>(now - live_[r].since_ns.load()) * 1e-9);
  }
  print_hang_verdict();
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(kExitHang);
}

void print_hang_banner(std::uint32_t seconds) {
  std::fprintf(stderr, "\nepmoe stress: HANG: the run did not finish within --watchdog-s=%u\n",
               seconds);
}

void print_hang_verdict() {
  std::printf("FAIL: hang (watchdog)\n");
}

}  // namespace epmoe::tools::stress

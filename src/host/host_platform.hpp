// Clock and backoff of the CPU executor's waits. CI has 2 cores and tests run up to 8 rank
// threads, so a waiting rank yields first and then sleeps, never starving the rank it waits for.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <thread>

namespace epmoe {

struct HostPlatform {
  std::uint64_t now_ns() const {
    return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                          std::chrono::steady_clock::now().time_since_epoch())
                                          .count());
  }
  void pause(std::uint32_t attempt) const {
    if (attempt < 16) {
      std::this_thread::yield();
      return;
    }
    // 10 us, doubling every 16 attempts, capped at 500 us.
    const std::uint32_t doublings = std::min<std::uint32_t>((attempt - 16) / 16, 6);
    std::this_thread::sleep_for(std::chrono::microseconds(std::min(10u << doublings, 500u)));
  }
};

}  // namespace epmoe

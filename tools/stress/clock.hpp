// The one clock of `epmoe stress`. steady_clock is CLOCK_MONOTONIC, the same in every process, so
// the timestamps a rank process sends compare with the supervisor's.
#pragma once

#include <chrono>
#include <cstdint>

namespace epmoe::tools::stress {

using Clock = std::chrono::steady_clock;

inline double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

inline double ms_between(Clock::time_point a, Clock::time_point b) {
  return static_cast<double>(std::chrono::duration_cast<std::chrono::nanoseconds>(b - a).count()) *
         1e-6;
}

// A time point as the integer that crosses a pipe, and back.
inline std::int64_t to_ns(Clock::time_point t) {
  return t.time_since_epoch().count();
}
inline Clock::time_point from_ns(std::int64_t ns) {
  return Clock::time_point(Clock::duration(ns));
}

}  // namespace epmoe::tools::stress

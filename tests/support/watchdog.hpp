// Tests of the protocol must fail, not hang, when a wait loses its bound: within_seconds runs the
// scenario and ends the whole test process with a HANG message if it is not done in time.
#pragma once

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <utility>

namespace epmoe::test {

template <class Fn>
void within_seconds(int seconds, const char* what, Fn&& fn) {
  auto done = std::async(std::launch::async, std::forward<Fn>(fn));
  if (done.wait_for(std::chrono::seconds(seconds)) != std::future_status::ready) {
    std::fprintf(stderr, "HANG: %s did not finish within %d s: a wait is unbounded\n", what,
                 seconds);
    std::fflush(stderr);
    std::_Exit(3);
  }
  done.get();
}

}  // namespace epmoe::test

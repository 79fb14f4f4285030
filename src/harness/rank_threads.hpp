// Runs one function per rank, each on its own thread, as the CPU executor's ranks need; waits for
// all of them and rethrows the first exception (by rank order).
#pragma once

#include <exception>
#include <thread>
#include <vector>

namespace epmoe {

template <class Fn>
void run_on_rank_threads(int world, Fn&& fn) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(world));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(world));
  for (int rank = 0; rank < world; ++rank)
    threads.emplace_back([&, rank] {
      try {
        fn(rank);
      } catch (...) {
        errors[static_cast<std::size_t>(rank)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace epmoe

// One rank's layer creation as the creation tests observe it: the layer or the error, and how
// long it took (the bound under test). Shared by the CPU-executor and GPU creation tests.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>

#include "epmoe/epmoe.hpp"
#include "harness/cluster.hpp"
#include "reference/reference.hpp"
#include "support/exact_math.hpp"

namespace epmoe::test {

using CreationClock = std::chrono::steady_clock;

inline double seconds_since(CreationClock::time_point start) {
  return std::chrono::duration<double>(CreationClock::now() - start).count();
}

struct Creation {
  std::unique_ptr<Layer> layer;
  std::optional<Error> error;
  double seconds = 0.0;
};

// A bf16 layer of `shape` on `comm`'s rank with this rank's slice of `weights`, waiting at most
// `timeout_ms` for the other ranks.
inline Creation create_layer(Communicator& comm, const LayerShape& shape,
                             const reference::LayerWeights& weights, std::uint32_t timeout_ms) {
  Creation c;
  const int rank = comm.rank(), world = comm.world();
  LayerOptions options = exact_math();
  options.timeout_ms = timeout_ms;
  const auto start = CreationClock::now();
  try {
    c.layer =
        std::make_unique<Layer>(comm, make_config(shape, Precision::bf16, rank, world, options),
                                local_weight_views(weights, shape, rank, world));
  } catch (const Error& e) {
    c.error = e;
  }
  c.seconds = seconds_since(start);
  return c;
}

}  // namespace epmoe::test

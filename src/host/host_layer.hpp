// The CPU executor's layer: one rank's forward() on its own thread, running docs/design.md §3 with
// the shared protocol code over host windows, and the experts with the reference's row math.
#pragma once

#include <memory>

#include "core/layer_impl.hpp"

namespace epmoe {

std::unique_ptr<LayerImpl> make_host_layer(Communicator& comm, const LayerConfig& config,
                                           const ExpertWeights& local_weights);

}  // namespace epmoe

// Every rank of a group in one process: the layers (created collectively, one thread per rank)
// and the reference model every rank thread checks its own rounds with. The CPU executor
// (ranks are threads) or the CUDA executor (rank r on GPU r, inputs staged through device
// buffers). Used by the tests and by `epmoe run` / `epmoe stress`.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "epmoe/layer.hpp"
#include "reference/reference.hpp"

namespace epmoe {

class Cluster {
 public:
  // `weights` holds every expert (all ranks) and must outlive the cluster; the reference is built
  // from it. `local_weights`, when given, is what rank r's layer is created from instead of its
  // slice of `weights` (pre-quantized views of the same weights, say); its tensors must outlive
  // the creation.
  // `tune`, when given, turns each rank's config into the one its layer is created with (knobs:
  // with_knobs; every rank must get the same knobs).
  using LocalWeights = std::function<ExpertWeights(int rank)>;
  using Tune = std::function<LayerConfig(const LayerConfig&)>;
  Cluster(const LayerShape& shape, Precision precision, const LayerOptions& options, int world,
          const reference::LayerWeights& weights, Backend backend = Backend::cpu_threads,
          const LocalWeights& local_weights = {}, const Tune& tune = {});
  ~Cluster();

  int world() const { return world_; }
  Layer& layer(int rank) { return *layers_[static_cast<std::size_t>(rank)]; }
  reference::ReferenceModel& reference(int /*rank*/) { return *reference_; }

  Backend backend() const { return backend_; }

  // One forward() of `rank` (call it from that rank's thread). Returns y [T, H] bf16.
  // `device_ms`: on the CUDA executor, the forward alone timed with CUDA events.
  std::vector<std::uint16_t> forward(int rank, const reference::Batch& batch,
                                     double* device_ms = nullptr);

  // Collective reset(): runs reset() on every rank's thread.
  void reset_all();

 private:
  int world_;
  Backend backend_;
  std::shared_ptr<HostGroup> group_;
  struct DeviceBuffers;  // CUDA executor only
  std::vector<std::unique_ptr<DeviceBuffers>> device_;
  std::vector<std::unique_ptr<Communicator>> comms_;
  std::vector<std::unique_ptr<Layer>> layers_;
  std::unique_ptr<reference::ReferenceModel> reference_;
};

// One forward() of a CPU-executor layer on a host batch (what Cluster::forward does there), for a
// rank that lives outside a Cluster. Returns y [T, H] bf16.
std::vector<std::uint16_t> host_forward(Layer& layer, const reference::Batch& batch);

// This rank's slice of the layer's weights, as the views Layer takes.
ExpertWeights local_weight_views(const reference::LayerWeights& weights, const LayerShape& shape,
                                 int rank, int world);

}  // namespace epmoe

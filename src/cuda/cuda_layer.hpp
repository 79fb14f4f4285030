// The CUDA executor's layer: NCCL symmetric window, LSA peers, the round's kernels on the
// caller's stream; no host synchronisation and no allocation inside forward().
#pragma once

#include <memory>

#include "core/layer_impl.hpp"

namespace epmoe::cuda {

std::unique_ptr<LayerImpl> make_cuda_layer(Communicator& comm, const LayerConfig& config,
                                           const ExpertWeights& local_weights);

}  // namespace epmoe::cuda

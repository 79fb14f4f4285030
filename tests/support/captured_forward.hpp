// What the GPU layer tests share about CUDA graphs and GPUs: how many GPUs a test can use, and one
// rank's forward captured into a CUDA graph (on its DeviceBatch's stream) for replays.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <memory>

#include "epmoe/epmoe.hpp"
#include "harness/device_batch.hpp"

namespace epmoe::test {

// The visible GPUs, at most `most`.
inline int gpus_up_to(int most) {
  return std::min(cuda_device_count(), most);
}

// harness::CapturedForward for tests: ok() is false (and the test has failed) where capture or
// instantiation did; launch() returns the replay's CUDA error instead of throwing. The graph is
// freed with the object, which must go before buf.
class CapturedForward {
 public:
  CapturedForward(Layer& layer, harness::DeviceBatch& buf, std::int64_t tokens) {
    try {
      graph_ = std::make_unique<harness::CapturedForward>(layer, buf, tokens);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "capturing the forward: " << e.what();
    }
  }

  bool ok() const { return graph_ != nullptr; }
  cudaError_t launch() const {
    try {
      graph_->launch();
      return cudaSuccess;
    } catch (const std::exception& e) {
      ADD_FAILURE() << e.what();
      return cudaErrorUnknown;
    }
  }
  cudaStream_t stream() const { return static_cast<cudaStream_t>(graph_->stream()); }

 private:
  std::unique_ptr<harness::CapturedForward> graph_;
};

}  // namespace epmoe::test

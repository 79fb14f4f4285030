// What the GPU layer tests share about CUDA graphs and GPUs: how many GPUs a test can use, and one
// rank's forward captured into a CUDA graph (on its DeviceBatch's stream) for replays.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>

#include "epmoe/epmoe.hpp"
#include "harness/device_batch.hpp"

namespace epmoe::test {

// The visible GPUs, at most `most`.
inline int gpus_up_to(int most) {
  return std::min(cuda_device_count(), most);
}

// `layer`'s forward of `tokens` tokens of `buf` (x, ids, weights in, y out) captured into a CUDA
// graph on buf's stream and instantiated; launch() replays it on that stream with whatever buf
// holds then. ok() is false (and the test has failed) where capture or instantiation did; the
// graph is freed with the object, which must go before buf.
class CapturedForward {
 public:
  CapturedForward(Layer& layer, harness::DeviceBatch& buf, std::int64_t tokens)
      : stream_(static_cast<cudaStream_t>(buf.stream())) {
    EXPECT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    layer.forward(buf.x(tokens), buf.topk_ids(tokens), buf.topk_weights(tokens), buf.y(tokens),
                  Stream{buf.stream()});
    EXPECT_EQ(cudaStreamEndCapture(stream_, &graph_), cudaSuccess);
    if (graph_ != nullptr) {
      EXPECT_EQ(cudaGraphInstantiate(&exec_, graph_, 0), cudaSuccess);
    }
  }
  ~CapturedForward() {
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
    if (graph_ != nullptr) cudaGraphDestroy(graph_);
  }
  CapturedForward(const CapturedForward&) = delete;
  CapturedForward& operator=(const CapturedForward&) = delete;

  bool ok() const { return exec_ != nullptr; }
  cudaError_t launch() const { return cudaGraphLaunch(exec_, stream_); }
  cudaStream_t stream() const { return stream_; }

 private:
  cudaStream_t stream_;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

}  // namespace epmoe::test

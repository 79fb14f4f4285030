// Device buffers of one rank for tools and tests: a host Batch goes in, y comes out, and the
// forward() in between is timed with CUDA events on the rank's own stream.
#pragma once

#include <cstdint>
#include <vector>

#include "epmoe/layer.hpp"
#include "reference/reference.hpp"

namespace epmoe::harness {

class DeviceBatch {
 public:
  DeviceBatch(int device, const LayerShape& shape);
  ~DeviceBatch();
  DeviceBatch(const DeviceBatch&) = delete;
  DeviceBatch& operator=(const DeviceBatch&) = delete;

  // Copies `batch` in, runs `layer.forward` on this rank's stream, copies y back (synchronising
  // the stream). `device_ms`: the forward alone, from CUDA events.
  std::vector<std::uint16_t> forward(Layer& layer, const reference::Batch& batch,
                                     double* device_ms = nullptr);

  void* stream() const { return stream_; }
  // Device views of the buffers for T tokens (for graph capture in tests).
  TensorView x(std::int64_t tokens) const;
  TensorView topk_ids(std::int64_t tokens) const;
  TensorView topk_weights(std::int64_t tokens) const;
  TensorView y(std::int64_t tokens) const;
  // Copies a batch's inputs into the device buffers on the stream (no forward).
  void upload(const reference::Batch& batch);
  std::vector<std::uint16_t> download_y(std::int64_t tokens);

 private:
  int device_;
  LayerShape shape_;
  void* stream_ = nullptr;
  void* start_ = nullptr;
  void* stop_ = nullptr;
  std::uint16_t* x_ = nullptr;
  std::int32_t* ids_ = nullptr;
  float* weights_ = nullptr;
  std::uint16_t* y_ = nullptr;
};

// `layer`'s forward of `tokens` tokens of `buf` (x, ids, weights in, y out) captured into a CUDA
// graph on buf's stream and instantiated; launch() replays it on that stream with whatever buf
// holds then (the round counter lives on the device, so each replay is the next round). Throws
// Error (from EPMOE_CUDA_CHECK) naming the CUDA call that failed. Must go before `buf`.
class CapturedForward {
 public:
  CapturedForward(Layer& layer, DeviceBatch& buf, std::int64_t tokens);
  ~CapturedForward();
  CapturedForward(const CapturedForward&) = delete;
  CapturedForward& operator=(const CapturedForward&) = delete;

  void launch() const;
  void* stream() const { return stream_; }

 private:
  void* stream_;
  void* graph_ = nullptr;
  void* exec_ = nullptr;
};

}  // namespace epmoe::harness

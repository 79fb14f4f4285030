#include "harness/device_batch.hpp"

#include <cuda_runtime.h>

#include "cuda/cuda_check.hpp"

namespace epmoe::harness {

DeviceBatch::DeviceBatch(int device, const LayerShape& shape) : device_(device), shape_(shape) {
  EPMOE_CUDA_CHECK(cudaSetDevice(device));
  cudaStream_t s;
  EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  stream_ = s;
  cudaEvent_t a, b;
  EPMOE_CUDA_CHECK(cudaEventCreate(&a));
  EPMOE_CUDA_CHECK(cudaEventCreate(&b));
  start_ = a;
  stop_ = b;
  const auto t = static_cast<std::size_t>(shape.max_tokens_per_rank);
  const auto h = static_cast<std::size_t>(shape.hidden), k = static_cast<std::size_t>(shape.top_k);
  EPMOE_CUDA_CHECK(cudaMalloc(&x_, t * h * 2));
  EPMOE_CUDA_CHECK(cudaMalloc(&ids_, t * k * 4));
  EPMOE_CUDA_CHECK(cudaMalloc(&weights_, t * k * 4));
  EPMOE_CUDA_CHECK(cudaMalloc(&y_, t * h * 2));
}

DeviceBatch::~DeviceBatch() {
  cudaSetDevice(device_);
  cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
  cudaFree(x_);
  cudaFree(ids_);
  cudaFree(weights_);
  cudaFree(y_);
  cudaEventDestroy(static_cast<cudaEvent_t>(start_));
  cudaEventDestroy(static_cast<cudaEvent_t>(stop_));
  cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

TensorView DeviceBatch::x(std::int64_t t) const {
  return view(x_, DType::bf16, {t, shape_.hidden}, Device{DeviceKind::cuda, device_});
}
TensorView DeviceBatch::topk_ids(std::int64_t t) const {
  return view(ids_, DType::i32, {t, shape_.top_k}, Device{DeviceKind::cuda, device_});
}
TensorView DeviceBatch::topk_weights(std::int64_t t) const {
  return view(weights_, DType::f32, {t, shape_.top_k}, Device{DeviceKind::cuda, device_});
}
TensorView DeviceBatch::y(std::int64_t t) const {
  return view(y_, DType::bf16, {t, shape_.hidden}, Device{DeviceKind::cuda, device_});
}

void DeviceBatch::upload(const reference::Batch& b) {
  EPMOE_CUDA_CHECK(cudaSetDevice(device_));
  auto s = static_cast<cudaStream_t>(stream_);
  EPMOE_CUDA_CHECK(cudaMemcpyAsync(x_, b.x.data(), b.x.size() * 2, cudaMemcpyHostToDevice, s));
  EPMOE_CUDA_CHECK(
      cudaMemcpyAsync(ids_, b.topk_ids.data(), b.topk_ids.size() * 4, cudaMemcpyHostToDevice, s));
  EPMOE_CUDA_CHECK(cudaMemcpyAsync(weights_, b.topk_weights.data(), b.topk_weights.size() * 4,
                                   cudaMemcpyHostToDevice, s));
}

std::vector<std::uint16_t> DeviceBatch::download_y(std::int64_t tokens) {
  std::vector<std::uint16_t> out(static_cast<std::size_t>(tokens * shape_.hidden));
  auto s = static_cast<cudaStream_t>(stream_);
  EPMOE_CUDA_CHECK(cudaMemcpyAsync(out.data(), y_, out.size() * 2, cudaMemcpyDeviceToHost, s));
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(s));
  return out;
}

std::vector<std::uint16_t> DeviceBatch::forward(Layer& layer, const reference::Batch& b,
                                                double* device_ms) {
  upload(b);
  auto s = static_cast<cudaStream_t>(stream_);
  EPMOE_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(start_), s));
  layer.forward(x(b.tokens), topk_ids(b.tokens), topk_weights(b.tokens), y(b.tokens),
                Stream{stream_});
  EPMOE_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(stop_), s));
  std::vector<std::uint16_t> out = download_y(b.tokens);
  if (device_ms != nullptr) {
    float ms = 0.0f;
    EPMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start_),
                                          static_cast<cudaEvent_t>(stop_)));
    *device_ms = ms;
  }
  return out;
}

CapturedForward::CapturedForward(Layer& layer, DeviceBatch& buf, std::int64_t tokens)
    : stream_(buf.stream()) {
  const auto s = static_cast<cudaStream_t>(stream_);
  EPMOE_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  cudaGraph_t graph = nullptr;
  try {
    layer.forward(buf.x(tokens), buf.topk_ids(tokens), buf.topk_weights(tokens), buf.y(tokens),
                  Stream{stream_});
  } catch (...) {
    cudaStreamEndCapture(s, &graph);  // leaves the stream usable
    if (graph != nullptr) cudaGraphDestroy(graph);
    throw;
  }
  EPMOE_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t instantiated = cudaGraphInstantiate(&exec, graph, 0);
  if (instantiated != cudaSuccess) cudaGraphDestroy(graph);  // the destructor will not run
  EPMOE_CUDA_CHECK(instantiated);
  graph_ = graph;
  exec_ = exec;
}

CapturedForward::~CapturedForward() {
  if (exec_ != nullptr) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
  if (graph_ != nullptr) cudaGraphDestroy(static_cast<cudaGraph_t>(graph_));
}

void CapturedForward::launch() const {
  EPMOE_CUDA_CHECK(
      cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_), static_cast<cudaStream_t>(stream_)));
}

}  // namespace epmoe::harness

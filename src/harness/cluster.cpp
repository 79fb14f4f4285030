#include "harness/cluster.hpp"

#include "harness/rank_threads.hpp"
#if defined(EPMOE_HAS_CUDA)
#include "harness/device_batch.hpp"
#endif

namespace epmoe {

ExpertWeights local_weight_views(const reference::LayerWeights& weights, const LayerShape& shape,
                                 int rank, int world) {
  const std::int64_t e = shape.num_experts / world;
  const std::int64_t h = shape.hidden, inter = shape.intermediate;
  const auto first = static_cast<std::size_t>(rank * e);
  ExpertWeights w;
  w.w13 = view(weights.w13.data() + first * static_cast<std::size_t>(2 * inter * h), DType::bf16,
               {e, 2 * inter, h});
  w.w2 = view(weights.w2.data() + first * static_cast<std::size_t>(h * inter), DType::bf16,
              {e, h, inter});
  if (!weights.b13.empty())
    w.b13 = view(weights.b13.data() + first * static_cast<std::size_t>(2 * inter), DType::f32,
                 {e, 2 * inter});
  if (!weights.b2.empty())
    w.b2 = view(weights.b2.data() + first * static_cast<std::size_t>(h), DType::f32, {e, h});
  return w;
}

#if defined(EPMOE_HAS_CUDA)
struct Cluster::DeviceBuffers : harness::DeviceBatch {
  using harness::DeviceBatch::DeviceBatch;
};
#else
struct Cluster::DeviceBuffers {};
#endif

Cluster::Cluster(const LayerShape& shape, Precision precision, const LayerOptions& options,
                 int world, const reference::LayerWeights& weights, Backend backend,
                 const LocalWeights& local_weights, const Tune& tune)
    : world_(world),
      backend_(backend),
      group_(backend == Backend::cpu_threads ? make_host_group(world) : nullptr),
      comms_(static_cast<std::size_t>(world)),
      layers_(static_cast<std::size_t>(world)),
      reference_(std::make_unique<reference::ReferenceModel>(shape, precision, options, weights)) {
  if (backend == Backend::cuda_nccl) {
    std::vector<int> devices;
    for (int d = 0; d < world; ++d) devices.push_back(d);
    comms_ = make_nccl_communicators(devices);
    device_.resize(static_cast<std::size_t>(world));
  }
  run_on_rank_threads(world, [&](int rank) {
    const auto r = static_cast<std::size_t>(rank);
    if (backend == Backend::cpu_threads) comms_[r] = make_host_communicator(group_, rank);
    const LayerConfig made = make_config(shape, precision, rank, world, options);
    const LayerConfig config = tune ? tune(made) : made;
    layers_[r] = std::make_unique<Layer>(
        *comms_[r], config,
        local_weights ? local_weights(rank) : local_weight_views(weights, shape, rank, world));
#if defined(EPMOE_HAS_CUDA)
    if (backend == Backend::cuda_nccl) device_[r] = std::make_unique<DeviceBuffers>(rank, shape);
#endif
  });
}

Cluster::~Cluster() {
  // Tearing down a layer (and an NCCL communicator) is collective: every rank at once.
  run_on_rank_threads(world_, [&](int rank) {
    const auto r = static_cast<std::size_t>(rank);
    layers_[r].reset();
    if (!device_.empty()) device_[r].reset();
    comms_[r].reset();
  });
}

std::vector<std::uint16_t> Cluster::forward(int rank, const reference::Batch& batch,
                                            double* device_ms) {
  Layer& l = layer(rank);
#if defined(EPMOE_HAS_CUDA)
  if (backend_ == Backend::cuda_nccl)
    return device_[static_cast<std::size_t>(rank)]->forward(l, batch, device_ms);
#endif
  (void)device_ms;
  return host_forward(l, batch);
}

std::vector<std::uint16_t> host_forward(Layer& layer, const reference::Batch& batch) {
  const LayerShape& s = layer.config().shape();
  std::vector<std::uint16_t> y(static_cast<std::size_t>(batch.tokens * s.hidden));
  layer.forward(view(batch.x.data(), DType::bf16, {batch.tokens, s.hidden}),
                view(batch.topk_ids.data(), DType::i32, {batch.tokens, s.top_k}),
                view(batch.topk_weights.data(), DType::f32, {batch.tokens, s.top_k}),
                view(y.data(), DType::bf16, {batch.tokens, s.hidden}));
  return y;
}

void Cluster::reset_all() {
  run_on_rank_threads(world_, [&](int rank) { layer(rank).reset(); });
}

}  // namespace epmoe

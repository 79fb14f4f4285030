#include "host/host_cluster.hpp"

#include "host/rank_threads.hpp"

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
  return w;
}

HostCluster::HostCluster(const LayerShape& shape, Precision precision, const LayerOptions& options,
                         int world, const reference::LayerWeights& weights)
    : world_(world),
      group_(make_host_group(world)),
      comms_(static_cast<std::size_t>(world)),
      layers_(static_cast<std::size_t>(world)),
      reference_(std::make_unique<reference::ReferenceModel>(shape, precision, options, weights)) {
  run_on_rank_threads(world, [&](int rank) {
    const auto r = static_cast<std::size_t>(rank);
    comms_[r] = make_host_communicator(group_, rank);
    const LayerConfig config = make_config(shape, precision, rank, world, options);
    layers_[r] = std::make_unique<Layer>(*comms_[r], config,
                                         local_weight_views(weights, shape, rank, world));
  });
}

HostCluster::~HostCluster() = default;

std::vector<std::uint16_t> HostCluster::forward(int rank, const reference::Batch& batch) {
  Layer& l = layer(rank);
  const LayerShape& s = l.config().shape();
  std::vector<std::uint16_t> y(static_cast<std::size_t>(batch.tokens * s.hidden));
  l.forward(view(batch.x.data(), DType::bf16, {batch.tokens, s.hidden}),
            view(batch.topk_ids.data(), DType::i32, {batch.tokens, s.top_k}),
            view(batch.topk_weights.data(), DType::f32, {batch.tokens, s.top_k}),
            view(y.data(), DType::bf16, {batch.tokens, s.hidden}));
  return y;
}

void HostCluster::reset_all() {
  run_on_rank_threads(world_, [&](int rank) { layer(rank).reset(); });
}

}  // namespace epmoe

#include "harness/problem.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <thread>

#include "epmoe/errors.hpp"
#include "formats/codec.hpp"
#include "protocol/wire.hpp"

namespace epmoe::harness {

const char* to_string(Routing r) {
  switch (r) {
    case Routing::uniform:
      return "uniform";
    case Routing::one_expert:
      return "one_expert";
    case Routing::one_rank:
      return "one_rank";
    case Routing::all_dropped:
      return "all_dropped";
  }
  return "unknown";
}

Routing parse_routing(const std::string& name) {
  for (Routing r : {Routing::uniform, Routing::one_expert, Routing::one_rank, Routing::all_dropped})
    if (name == to_string(r)) return r;
  throw Error(ErrorCode::invalid_argument,
              "routing=" + name + ": must be uniform, one_expert, one_rank or all_dropped");
}

std::uint64_t Rng::next() {
  std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
double Rng::uniform() {
  return static_cast<double>(next() >> 11) * 0x1.0p-53;
}
std::int64_t Rng::below(std::int64_t n) {
  return static_cast<std::int64_t>(next() % static_cast<std::uint64_t>(n));
}

namespace {

void fill_uniform(std::vector<std::uint16_t>& out, std::size_t n, double scale, Rng& rng) {
  out.resize(n);
  for (auto& v : out)
    v = formats::float_to_bf16(static_cast<float>((2.0 * rng.uniform() - 1.0) * scale));
}

}  // namespace

void fill_uniform_bf16(std::vector<std::uint16_t>& out, std::size_t n, double scale,
                       std::uint64_t seed) {
  out.resize(n);
  constexpr std::size_t kChunk = std::size_t{1} << 22;
  const std::size_t chunks = (n + kChunk - 1) / kChunk;
  const unsigned threads = std::max(
      1u, std::min<unsigned>(std::thread::hardware_concurrency(), static_cast<unsigned>(chunks)));
  std::atomic<std::size_t> next{0};
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t)
    pool.emplace_back([&] {
      for (std::size_t c = next++; c < chunks; c = next++) {
        Rng rng(seed * 0x9E3779B97F4A7C15ull + c);
        const std::size_t end = std::min(n, (c + 1) * kChunk);
        for (std::size_t i = c * kChunk; i < end; ++i)
          out[i] = formats::float_to_bf16(static_cast<float>((2.0 * rng.uniform() - 1.0) * scale));
      }
    });
  for (auto& t : pool) t.join();
}

std::int64_t wire_row_bytes(Precision precision, std::int64_t hidden, std::int64_t top_k) {
  return static_cast<std::int64_t>(protocol::wire_row_bytes(precision, hidden, top_k));
}

reference::LayerWeights make_random_weights(const LayerShape& shape, std::uint64_t seed) {
  const auto e = static_cast<std::size_t>(shape.num_experts);
  const auto h = static_cast<std::size_t>(shape.hidden);
  const auto inter = static_cast<std::size_t>(shape.intermediate);
  reference::LayerWeights w;
  fill_uniform_bf16(w.w13, e * 2 * inter * h, 1.0 / std::sqrt(double(shape.hidden)), seed * 3 + 1);
  fill_uniform_bf16(w.w2, e * h * inter, 1.0 / std::sqrt(double(shape.intermediate)), seed * 3 + 2);
  return w;
}

void add_random_biases(reference::LayerWeights& weights, const LayerShape& shape,
                       std::uint64_t seed) {
  Rng rng(seed ^ 0xB1A5B1A5ull);
  const auto e = static_cast<std::size_t>(shape.num_experts);
  std::vector<std::uint16_t> b13, b2;
  fill_uniform(b13, e * 2 * static_cast<std::size_t>(shape.intermediate), 1.0, rng);
  fill_uniform(b2, e * static_cast<std::size_t>(shape.hidden), 0.5, rng);
  weights.b13.resize(b13.size());
  weights.b2.resize(b2.size());
  for (std::size_t i = 0; i < b13.size(); ++i) weights.b13[i] = formats::bf16_to_float(b13[i]);
  for (std::size_t i = 0; i < b2.size(); ++i) weights.b2[i] = formats::bf16_to_float(b2[i]);
}

RoutingTable make_routing(const LayerShape& shape, int world, std::int64_t tokens, Routing routing,
                          std::int64_t target, Rng& rng) {
  const auto k = static_cast<std::size_t>(shape.top_k);
  const std::int64_t e_local = shape.num_experts / world;
  RoutingTable r;
  r.topk_ids.assign(static_cast<std::size_t>(tokens) * k, -1);
  r.topk_weights.assign(static_cast<std::size_t>(tokens) * k, 0.0f);
  for (std::size_t t = 0; t < static_cast<std::size_t>(tokens); ++t) {
    std::int32_t* ids = r.topk_ids.data() + t * k;
    for (std::size_t s = 0; s < k; ++s) {
      std::int64_t id = -1;
      switch (routing) {
        case Routing::uniform:
          if (rng.uniform() < 0.05) break;  // a dropped slot now and then
          do {
            id = rng.below(shape.num_experts);
          } while (std::find(ids, ids + s, id) != ids + s);
          break;
        case Routing::one_expert:
          id = target;
          break;
        case Routing::one_rank:
          if (s < static_cast<std::size_t>(e_local))
            id = (target % world) * e_local + std::int64_t(s);
          break;
        case Routing::all_dropped:
          break;
      }
      ids[s] = static_cast<std::int32_t>(id);
    }
    double sum = 0.0;
    for (std::size_t s = 0; s < k; ++s) {
      const double w = ids[s] >= 0 ? 0.1 + rng.uniform() : 0.0;
      r.topk_weights[t * k + s] = static_cast<float>(w);
      sum += w;
    }
    for (std::size_t s = 0; s < k && sum > 0.0; ++s)
      r.topk_weights[t * k + s] = static_cast<float>(r.topk_weights[t * k + s] / sum);
  }
  return r;
}

std::int64_t balanced_tokens(const LayerShape& shape, std::int64_t rows_per_expert) {
  const std::int64_t e = shape.num_experts, k = shape.top_k;
  const std::string what = "E=" + std::to_string(e) + ", K=" + std::to_string(k) +
                           ", rows per expert R=" + std::to_string(rows_per_expert);
  if (rows_per_expert < 1) throw Error(ErrorCode::invalid_argument, what + ": R must be >= 1");
  if (e < k)
    throw Error(ErrorCode::invalid_argument,
                what + ": balanced routing needs at least K experts (K distinct per token)");
  if ((e * rows_per_expert) % k != 0)
    throw Error(ErrorCode::invalid_argument,
                what + ": K must divide E x R (T = E x R / K tokens of K slots each)");
  return e * rows_per_expert / k;
}

RoutingTable make_balanced_routing(const LayerShape& shape, std::int64_t rows_per_expert) {
  const std::int64_t tokens = balanced_tokens(shape, rows_per_expert);
  const std::int64_t k = shape.top_k;
  RoutingTable r;
  r.topk_ids.resize(static_cast<std::size_t>(tokens * k));
  r.topk_weights.assign(static_cast<std::size_t>(tokens * k), 1.0f / static_cast<float>(k));
  for (std::int64_t i = 0; i < tokens * k; ++i)  // i = t x K + j
    r.topk_ids[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i % shape.num_experts);
  return r;
}

reference::Batch make_random_batch(const LayerShape& shape, int world, std::int64_t tokens,
                                   Routing routing, std::int64_t target, std::uint64_t seed) {
  Rng rng(seed);
  reference::Batch b;
  b.tokens = tokens;
  fill_uniform(b.x, static_cast<std::size_t>(tokens * shape.hidden), 1.0, rng);
  RoutingTable r = make_routing(shape, world, tokens, routing, target, rng);
  b.topk_ids = std::move(r.topk_ids);
  b.topk_weights = std::move(r.topk_weights);
  return b;
}

}  // namespace epmoe::harness

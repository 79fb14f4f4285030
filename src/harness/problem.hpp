// Random but reproducible layer problems: weights for every expert and one batch per rank per
// round, with the routing patterns a serving engine produces (and the nasty ones).
#pragma once

#include <cstdint>
#include <string>

#include "epmoe/config.hpp"
#include "reference/reference.hpp"

namespace epmoe::harness {

enum class Routing : std::uint8_t {
  uniform,     // distinct random experts per token, a few -1 slots
  one_expert,  // every slot of every token on one expert (maximally skewed)
  one_rank,    // every slot on experts of one rank
  all_dropped  // every slot is -1 (no expert)
};
const char* to_string(Routing r);
Routing parse_routing(const std::string& name);

// splitmix64: tiny, stateless-seedable, good enough for test data.
class Rng {
 public:
  explicit Rng(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next();
  double uniform();  // [0, 1)
  std::int64_t below(std::int64_t n);

 private:
  std::uint64_t state_;
};

// Weights ~ U(-1, 1) / sqrt(fan_in), rounded to bf16, drawn by every core (fill_uniform_bf16):
// deepseek-v3's 256 experts are 11.3 G values.
reference::LayerWeights make_random_weights(const LayerShape& shape, std::uint64_t seed);

// Biases for `weights` (gpt-oss style): b13 ~ U(-1, 1), b2 ~ U(-0.5, 0.5), each a bf16 value held
// in fp32 (so a layer given them as bf16 or as f32 computes the same).
void add_random_biases(reference::LayerWeights& weights, const LayerShape& shape,
                       std::uint64_t seed);

// `n` values ~ U(-scale, scale) in bf16, filled by every core in chunks of 4 Mi values, each
// chunk its own stream of `seed` (reproducible whatever the core count): the bench's full-size
// layers hold billions of weights.
void fill_uniform_bf16(std::vector<std::uint16_t>& out, std::size_t n, double scale,
                       std::uint64_t seed);

// Bytes of one token row on the wire (payload, scales, header, expert entries), for traffic
// models.
std::int64_t wire_row_bytes(Precision precision, std::int64_t hidden, std::int64_t top_k);

// Routing alone for T tokens (`target` picks the expert or rank of the skewed patterns): uniform
// = distinct random experts per token with a slot dropped (-1) now and then; weights 0.1 + U(0, 1)
// normalised over the valid slots.
struct RoutingTable {
  std::vector<std::int32_t> topk_ids;  // [T, K]
  std::vector<float> topk_weights;     // [T, K]
};
RoutingTable make_routing(const LayerShape& shape, int world, std::int64_t tokens, Routing routing,
                          std::int64_t target, Rng& rng);

// Routing that gives every expert of the layer exactly `rows_per_expert` (token, slot) pairs, for
// timing the expert GEMMs alone (`epmoe bench gemm`): T = E x R / K tokens, slot j of token t on
// expert (t x K + j) mod E (K consecutive experts, so distinct when K <= E), no dropped slot, every
// router weight 1 / K. Throws invalid_argument naming the rule when E < K or K does not divide
// E x R.
std::int64_t balanced_tokens(const LayerShape& shape, std::int64_t rows_per_expert);
RoutingTable make_balanced_routing(const LayerShape& shape, std::int64_t rows_per_expert);

// T tokens, x ~ U(-1, 1) in bf16, routing as asked (`target` picks the expert or rank of the
// skewed patterns), weights positive and summing to 1 over the valid slots.
reference::Batch make_random_batch(const LayerShape& shape, int world, std::int64_t tokens,
                                   Routing routing, std::int64_t target, std::uint64_t seed);

}  // namespace epmoe::harness

// MoE layer shapes of real models, for `epmoe run | bench | stress` and examples.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "epmoe/config.hpp"

namespace epmoe {

struct ModelShape {
  const char* name;
  std::int64_t hidden;
  std::int64_t intermediate;
  std::int64_t num_experts;
  std::int64_t top_k;

  LayerShape layer_shape(std::int64_t max_tokens_per_rank) const {
    return LayerShape{hidden, intermediate, num_experts, top_k, max_tokens_per_rank};
  }
};

std::span<const ModelShape> known_models();
// Throws Error(invalid_argument) listing the known names when `name` is not one of them.
const ModelShape& find_model(const std::string& name);

}  // namespace epmoe

#include "epmoe/models.hpp"

#include <array>

#include "epmoe/errors.hpp"

namespace epmoe {
namespace {

// hidden, moe intermediate, routed experts, experts per token (from each model's config.json).
constexpr std::array<ModelShape, 4> kModels{{
    {"qwen3-30b-a3b", 2048, 768, 128, 8},
    {"deepseek-v3", 7168, 2048, 256, 8},
    {"gpt-oss-120b", 2880, 2880, 128, 4},
    {"mixtral-8x7b", 4096, 14336, 8, 2},
}};

}  // namespace

std::span<const ModelShape> known_models() {
  return kModels;
}

const ModelShape& find_model(const std::string& name) {
  std::string names;
  for (const ModelShape& m : kModels) {
    if (name == m.name) return m;
    names += (names.empty() ? "" : ", ") + std::string(m.name);
  }
  throw Error(ErrorCode::invalid_argument, "model=" + name + ": must be one of " + names);
}

}  // namespace epmoe

#include "cuda/experts/backend.hpp"

#include "cuda/experts/exact/exact_backend.hpp"
#include "cuda/experts/mma/mma_backend.hpp"
#include "cuda/experts/wgmma/wgmma_backend.hpp"
#include "epmoe/errors.hpp"

namespace epmoe::cuda::experts {
namespace {

template <class Backend>
std::unique_ptr<ExpertBackend> make_if_implementable(const LayerConfig& config, int device) {
  if (const std::string why = Backend::can_implement(config); !why.empty()) {
    // wgmma is the default: a caller who never picked a math learns which one runs the layer.
    const char* instead = config.options().expert_math == ExpertMath::wgmma
                              ? " (expert_math=exact runs every layer)"
                              : "";
    throw Error(ErrorCode::unsupported, std::string("Layer: expert_math=") +
                                            to_string(config.options().expert_math) +
                                            " cannot run this layer: " + why + instead);
  }
  return std::make_unique<Backend>(config, device);
}

}  // namespace

// One line per backend.
std::unique_ptr<ExpertBackend> make_expert_backend(const LayerConfig& config, int device) {
  switch (config.options().expert_math) {
    case ExpertMath::exact:
      return make_if_implementable<exact::ExactBackend>(config, device);
    case ExpertMath::tensor_core:
      return make_if_implementable<mma::MmaBackend>(config, device);
    case ExpertMath::wgmma:
      return make_if_implementable<wgmma::WgmmaBackend>(config, device);
  }
  throw Error(ErrorCode::invalid_argument, "Layer: unknown expert_math");
}

}  // namespace epmoe::cuda::experts

#include "epmoe/layer.hpp"

#include <cstdlib>

#include "core/layer_impl.hpp"
#include "epmoe/testing.hpp"
#include "host/host_layer.hpp"
#if defined(EPMOE_HAS_CUDA)
#include "cuda/cuda_layer.hpp"
#endif

namespace epmoe {

const char* to_string(Backend b) {
  return b == Backend::cpu_threads ? "cpu_threads" : "cuda_nccl";
}

namespace {

// The layer's config with the knob file $EPMOE_KNOB_FILE names, when set and not empty.
LayerConfig with_env_knob_file(const LayerConfig& config) {
  const char* path = std::getenv(kKnobFileEnv);
  return path == nullptr || *path == '\0' ? config : with_knob_file(config, path);
}

}  // namespace

Layer::Layer(Communicator& comm, const LayerConfig& given, const ExpertWeights& local_weights) {
  const LayerConfig config = with_env_knob_file(given);
  if (comm.rank() != config.rank() || comm.world() != config.world())
    throw Error(ErrorCode::invalid_argument,
                "Layer: config is for rank " + std::to_string(config.rank()) + " of " +
                    std::to_string(config.world()) + " but the communicator is rank " +
                    std::to_string(comm.rank()) + " of " + std::to_string(comm.world()));
  switch (comm.backend()) {
    case Backend::cpu_threads:
      impl_ = make_host_layer(comm, config, local_weights);
      break;
    case Backend::cuda_nccl:
#if defined(EPMOE_HAS_CUDA)
      impl_ = cuda::make_cuda_layer(comm, config, local_weights);
#else
      throw Error(ErrorCode::unsupported, "Layer: this build of epmoe has no CUDA executor");
#endif
      break;
  }
}

Layer::~Layer() = default;
Layer::Layer(Layer&&) noexcept = default;
Layer& Layer::operator=(Layer&&) noexcept = default;

void Layer::forward(const TensorView& x, const TensorView& topk_ids, const TensorView& topk_weights,
                    const TensorView& y, Stream stream) {
  impl_->forward(x, topk_ids, topk_weights, y, stream);
}
Health Layer::health() const {
  return impl_->health();
}
void Layer::reset() {
  impl_->reset();
}
const LayerConfig& Layer::config() const {
  return impl_->config();
}
std::uint32_t Layer::next_round() const {
  return impl_->next_round();
}
std::size_t Layer::resident_weight_bytes() const {
  return impl_->resident_weight_bytes();
}
void Layer::set_phase_timing(bool on) {
  impl_->set_phase_timing(on);
}
PhaseTimes Layer::last_phase_times() const {
  return impl_->last_phase_times();
}

namespace testing {

const char* to_string(Fault f) {
  switch (f) {
    case Fault::none:
      return "none";
    case Fault::skip_launch_when_idle:
      return "skip_launch_when_idle";
    case Fault::stall:
      return "stall";
    case Fault::round_jump:
      return "round_jump";
  }
  return "unknown";
}

bool fault_injection_available() {
#if defined(EPMOE_FAULT_INJECTION)
  return true;
#else
  return false;
#endif
}

void inject_fault(Layer& layer, const FaultSpec& spec) {
  if (!fault_injection_available())
    throw Error(ErrorCode::unsupported,
                "inject_fault: this build has no fault switches (configure with "
                "-DEPMOE_FAULT_INJECTION=ON)");
  layer.impl().arm_fault(spec);
}

void start_rounds_at(Layer& layer, std::uint32_t round) {
  if (!fault_injection_available())
    throw Error(ErrorCode::unsupported,
                "start_rounds_at: this build has no test switches (configure with "
                "-DEPMOE_FAULT_INJECTION=ON)");
  layer.impl().start_rounds_at(round);
}

}  // namespace testing
}  // namespace epmoe

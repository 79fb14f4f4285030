// What an executor implements behind epmoe::Layer.
#pragma once

#include <cstdint>

#include "core/validate.hpp"
#include "epmoe/layer.hpp"
#include "epmoe/testing.hpp"

namespace epmoe {

class LayerImpl {
 public:
  explicit LayerImpl(const LayerConfig& config) : config_(config) {}
  virtual ~LayerImpl() = default;
  LayerImpl(const LayerImpl&) = delete;
  LayerImpl& operator=(const LayerImpl&) = delete;

  // Checks the tensors for this executor's device, then runs one round.
  virtual void forward(const TensorView& x, const TensorView& topk_ids,
                       const TensorView& topk_weights, const TensorView& y, Stream stream) = 0;
  virtual Health health() const = 0;
  virtual void reset() = 0;
  virtual std::uint32_t next_round() const = 0;
  // Bytes this rank holds for its prepared expert weights (scales included).
  virtual std::size_t resident_weight_bytes() const = 0;
  // Layer::set_phase_timing / last_phase_times (docs/design.md §4.2); executors without a device
  // clock keep these: on throws Error(unsupported), the times are empty.
  virtual void set_phase_timing(bool on) {
    if (on)
      throw Error(ErrorCode::unsupported,
                  "set_phase_timing: per-phase timing stamps the GPU clock; the CPU executor has "
                  "none (CUDA executor only)");
  }
  virtual PhaseTimes last_phase_times() const { return {}; }
  // testing::start_rounds_at; executors that cannot do it throw Error(unsupported).
  virtual void start_rounds_at(std::uint32_t round) = 0;

  const LayerConfig& config() const { return config_; }

  // Armed by testing::inject_fault; consumed by the executor. Returns true when `fault` fires now.
  bool fault_fires(testing::Fault fault) {
#if defined(EPMOE_FAULT_INJECTION)
    if (fault_.fault != fault || fault_.times == 0) return false;
    --fault_.times;
    return true;
#else
    (void)fault;
    return false;
#endif
  }
  // The bug this project exists to catch, on purpose (test builds only): an idle rank that does
  // not run its round. Every executor asks this before launching; nothing else may skip a round.
  bool fault_skips_idle_launch(std::int64_t tokens) {
    const bool idle = tokens == 0;
    return idle && fault_fires(testing::Fault::skip_launch_when_idle);
  }
  const testing::FaultSpec& fault() const {
    return fault_;
  }
  void arm_fault(const testing::FaultSpec& spec) {
    fault_ = spec;
  }

 private:
  LayerConfig config_;
  testing::FaultSpec fault_{};
};

}  // namespace epmoe

#include "cuda/experts/wgmma/wgmma_backend.hpp"

#include <algorithm>

#include "cuda/cuda_check.hpp"

namespace epmoe::cuda::experts::wgmma {
namespace {

Scratch slice_scratch(std::uint8_t* base, const ExpertProblem& e, std::size_t pairs,
                      std::size_t* bytes) {
  const auto h = static_cast<std::size_t>(e.hidden), i = static_cast<std::size_t>(e.intermediate);
  ScratchCursor cursor{base};
  Scratch s{};
  s.a1 = cursor.take<std::uint16_t>(pairs * h);
  s.d = cursor.take<float>(pairs * std::max(2 * i, h));
  s.h16 = cursor.take<std::uint16_t>(pairs * i);
  s.h_scale = cursor.take<float>(pairs);
  *bytes = cursor.used;
  return s;
}

int sm_count(int device) {
  int sms = 0;
  EPMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

}  // namespace

std::string WgmmaBackend::can_implement(const LayerConfig& config) {
  const LayerShape& s = config.shape();
  // The same operands as tensor_core (bf16_code_weights.hpp): fp8_block128 needs its per-128
  // scale promotion, which this backend does not do yet.
  if (config.precision() == Precision::fp8_block128)
    return "precision=fp8_block128: its fp32 block scales are not exact in bf16 and change every "
           "128 along K (per-128 promotion is not built yet). Use expert_math=exact";
  const int h = static_cast<int>(s.hidden), i = static_cast<int>(s.intermediate);
  if (const char* why = Bf16GroupedGemm::cannot_take(2 * i, h))
    return "hidden=" + std::to_string(h) + ", intermediate=" + std::to_string(i) + ": FC1: " + why;
  if (const char* why = Bf16GroupedGemm::cannot_take(h, i))
    return "hidden=" + std::to_string(h) + ", intermediate=" + std::to_string(i) + ": FC2: " + why;
  return {};
}

WgmmaBackend::WgmmaBackend(const LayerConfig& config, int device)
    : problem_(expert_problem(config)),
      weights_(problem_),
      fc1_(static_cast<int>(problem_.local_experts), static_cast<int>(2 * problem_.intermediate),
           static_cast<int>(problem_.hidden), sm_count(device), device),
      fc2_(static_cast<int>(problem_.local_experts), static_cast<int>(problem_.hidden),
           static_cast<int>(problem_.intermediate), sm_count(device), device) {
  slice_scratch(nullptr, problem_, max_pairs(config), &scratch_bytes_);
  EPMOE_CUDA_CHECK(cudaMalloc(&scratch_memory_, scratch_bytes_));
  scratch_ = slice_scratch(scratch_memory_, problem_, max_pairs(config), &scratch_bytes_);
  shapes_ = step_shapes(problem_, device);
}

WgmmaBackend::~WgmmaBackend() {
  cudaFree(scratch_memory_);
}

std::size_t WgmmaBackend::scratch_bytes() const {
  return scratch_bytes_ + fc1_.device_bytes() + fc2_.device_bytes();
}

void WgmmaBackend::prepare(const ExpertWeights& local, cudaStream_t stream) {
  weights_.prepare(local, stream);
  biases_.prepare(local, stream);
}

Params WgmmaBackend::params(const ExpertStep& step) const {
  return Params{step,     problem_,      weights_.weights(), biases_.biases(),
                scratch_, fc1_.arrays(), fc2_.arrays()};
}

void WgmmaBackend::launch_fc1(const ExpertStep& step, cudaStream_t stream) const {
  const Params p = params(step);
  launch_plan(p, stream);
  launch_gather(p, shapes_, stream);
  fc1_.run(stream);
  launch_activate(p, shapes_, stream);
}

void WgmmaBackend::launch_fc2(const ExpertStep& step, cudaStream_t stream) const {
  fc2_.run(stream);
  launch_home(params(step), shapes_, stream);
}

}  // namespace epmoe::cuda::experts::wgmma

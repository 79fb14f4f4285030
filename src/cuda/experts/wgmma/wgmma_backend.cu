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
  s.d = cursor.take<float>(pairs * std::max(2 * i, h));
  if (runs_e4m3(e)) {
    s.a8 = cursor.take<std::uint8_t>(pairs * h);
    s.a8_scale = cursor.take<float>(pairs * (h / formats::kFp8Block128));
    s.h8 = cursor.take<std::uint8_t>(pairs * i);
    s.h8_scale = cursor.take<float>(pairs * (i / formats::kFp8Block128));
  } else {
    s.a1 = cursor.take<std::uint16_t>(pairs * h);
    s.h16 = cursor.take<std::uint16_t>(pairs * i);
    s.h_scale = cursor.take<float>(pairs);
  }
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
  const int h = static_cast<int>(s.hidden), i = static_cast<int>(s.intermediate);
  const bool fp8 = runs_e4m3(expert_problem(config));
  const auto cannot_take =
      fp8 ? Fp8BlockwiseGroupedGemm::cannot_take : Bf16GroupedGemm::cannot_take;
  if (const char* why = cannot_take(2 * i, h))
    return "hidden=" + std::to_string(h) + ", intermediate=" + std::to_string(i) + ": FC1: " + why;
  if (const char* why = cannot_take(h, i))
    return "hidden=" + std::to_string(h) + ", intermediate=" + std::to_string(i) + ": FC2: " + why;
  return {};
}

WgmmaBackend::WgmmaBackend(const LayerConfig& config, int device)
    : problem_(expert_problem(config)) {
  const int experts = static_cast<int>(problem_.local_experts);
  const int h = static_cast<int>(problem_.hidden), i = static_cast<int>(problem_.intermediate);
  const int sms = sm_count(device);
  if (fp8()) {
    fp8_weights_ = std::make_unique<DeviceFp8BlockWeights>(problem_);
    fp8_fc1_ = std::make_unique<Fp8BlockwiseGroupedGemm>(experts, 2 * i, h, sms, device);
    fp8_fc2_ = std::make_unique<Fp8BlockwiseGroupedGemm>(experts, h, i, sms, device);
  } else {
    weights_ = std::make_unique<DeviceBf16CodeWeights>(problem_);
    fc1_ = std::make_unique<Bf16GroupedGemm>(experts, 2 * i, h, sms, device);
    fc2_ = std::make_unique<Bf16GroupedGemm>(experts, h, i, sms, device);
  }
  slice_scratch(nullptr, problem_, max_pairs(config), &scratch_bytes_);
  EPMOE_CUDA_CHECK(cudaMalloc(&scratch_memory_, scratch_bytes_));
  scratch_ = slice_scratch(scratch_memory_, problem_, max_pairs(config), &scratch_bytes_);
  shapes_ = step_shapes(problem_, device);
}

WgmmaBackend::~WgmmaBackend() {
  cudaFree(scratch_memory_);
}

std::size_t WgmmaBackend::weight_bytes() const {
  return (fp8() ? fp8_weights_->bytes() : weights_->bytes()) + biases_.bytes();
}

std::size_t WgmmaBackend::scratch_bytes() const {
  return scratch_bytes_ + (fp8() ? fp8_fc1_->device_bytes() + fp8_fc2_->device_bytes()
                                 : fc1_->device_bytes() + fc2_->device_bytes());
}

void WgmmaBackend::prepare(const ExpertWeights& local, cudaStream_t stream) {
  if (fp8())
    fp8_weights_->prepare(local, stream);
  else
    weights_->prepare(local, stream);
  biases_.prepare(local, stream);
}

Params WgmmaBackend::params(const ExpertStep& step) const {
  Params p{};
  p.step = step;
  p.problem = problem_;
  p.biases = biases_.biases();
  p.scratch = scratch_;
  if (p.fp8()) {
    p.fp8_weights = fp8_weights_->weights();
    p.fp8_fc1 = fp8_fc1_->arrays();
    p.fp8_fc2 = fp8_fc2_->arrays();
  } else {
    p.weights = weights_->weights();
    p.fc1 = fc1_->arrays();
    p.fc2 = fc2_->arrays();
  }
  return p;
}

void WgmmaBackend::launch_fc1(const ExpertStep& step, cudaStream_t stream) const {
  const Params p = params(step);
  launch_plan(p, stream);
  launch_gather(p, shapes_, stream);
  if (p.fp8())
    fp8_fc1_->run(stream);
  else
    fc1_->run(stream);
  launch_activate(p, shapes_, stream);
}

void WgmmaBackend::launch_fc2(const ExpertStep& step, cudaStream_t stream) const {
  if (fp8())
    fp8_fc2_->run(stream);
  else
    fc2_->run(stream);
  launch_home(params(step), shapes_, stream);
}

}  // namespace epmoe::cuda::experts::wgmma

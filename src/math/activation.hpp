// The expert activations (LayerOptions::activation) as every path computes them, from the FC1
// outputs gate and up (b13 already added): in float64 (activation), or in fp32 for the wgmma
// backend (activation_f32). __host__ __device__ so the kernels, the CPU executor and the reference
// evaluate the same expression.
#pragma once

#include <cmath>

#include "epmoe/config.hpp"
#include "formats/codec.hpp"  // EPMOE_HD

namespace epmoe::math {

// The float64 forms take IEEE exp and division. activation_f32 on the device takes the fast ones:
// __expf (ex2.approx) and the approximate reciprocal (rcp.approx, within 1 ulp) times the
// numerator, a few fp32 ulps from the float64 value, far inside the bf16 / FP8 quantization of h
// that follows; IEEE fp32 division and expf made the wgmma activate kernel issue-bound.
EPMOE_HD double exp_of(double x) {
  return exp(x);
}
EPMOE_HD float exp_of(float x) {
#if defined(__CUDA_ARCH__)
  return __expf(x);
#else
  return std::exp(x);
#endif
}
EPMOE_HD double divide(double a, double b) {
  return a / b;
}
EPMOE_HD float divide(float a, float b) {
#if defined(__CUDA_ARCH__)
  float reciprocal;  // no branch: __frcp_rn's slow path split the GEMM epilogues per element
  asm("rcp.approx.f32 %0, %1;" : "=f"(reciprocal) : "f"(b));
  return a * reciprocal;
#else
  return a * (1.0f / b);
#endif
}

// silu(gate) * up, with the gpt-oss clamp when limit > 0 (gate <= limit, |up| <= limit).
template <class Real>
EPMOE_HD Real swiglu(Real gate, Real up, float limit) {
  if (limit > 0.0f) {
    const Real l = limit;
    gate = gate < l ? gate : l;
    up = up < -l ? -l : (up > l ? l : up);
  }
  return divide(gate, Real(1) + exp_of(-gate)) * up;
}

// gpt-oss (transformers' GptOssExperts._apply_gate, 5.17):
//   gate = gate.clamp(max=limit); up = up.clamp(-limit, limit)
//   (up + 1) * (gate * sigmoid(gate * alpha)),  alpha = kSwigluOaiAlpha = 1.702
// The clamps keep NaN, as torch.clamp does; limit > 0 (make_config).
template <class Real>
EPMOE_HD Real swiglu_oai(Real gate, Real up, float limit) {
  const Real l = limit;
  gate = gate > l ? l : gate;
  up = up < -l ? -l : (up > l ? l : up);
  const Real glu =
      gate * divide(Real(1), Real(1) + exp_of(-(gate * static_cast<Real>(kSwigluOaiAlpha))));
  return (up + Real(1)) * glu;
}

// The layer's activation: one branch, uniform over a kernel. In float64: the reference, the CPU
// executor and the exact and tensor_core backends.
EPMOE_HD double activation(Activation a, double gate, double up, float limit) {
  return a == Activation::swiglu_oai ? swiglu_oai(gate, up, limit) : swiglu(gate, up, limit);
}

// The same expressions in fp32 (expf; within a few fp32 ulps of float(activation(...))), for the
// wgmma backend: float64's exp and division made its activate kernel compute-bound
// (docs/tuning.md).
EPMOE_HD float activation_f32(Activation a, float gate, float up, float limit) {
  return a == Activation::swiglu_oai ? swiglu_oai(gate, up, limit) : swiglu(gate, up, limit);
}

}  // namespace epmoe::math

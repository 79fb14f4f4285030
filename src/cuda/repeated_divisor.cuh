// Division by one value many times over, for kernels that divide every element of a row or block
// by its scale.
#pragma once

#include <cuda_runtime.h>

namespace epmoe::cuda {

// Division by one value many times over (a row's s_enc, a block's scale): its IEEE reciprocal
// once, then per quotient a product and Markstein's correction (q + (a - q b) / b with the
// reciprocal): the correctly rounded a / b wherever the quotient and a - q b stay normal, three
// instructions where an IEEE division is ten and a slow-path branch (nvfp4's activate had six per
// element: bench/RESULTS.md, session 34). The sign of a zero quotient is a's (b > 0); an infinite
// or NaN a keeps the product's quotient (the correction would be NaN).
struct RepeatedDivisor {
  float b, reciprocal;
  __device__ explicit RepeatedDivisor(float divisor) : b(divisor), reciprocal(1.0f / divisor) {}
  __device__ __forceinline__ float divide(float a) const {
    const float q = a * reciprocal;
    const float residual = fmaf(-q, b, a);
    return isfinite(residual) ? copysignf(fmaf(residual, reciprocal, q), a) : q;
  }
};

}  // namespace epmoe::cuda

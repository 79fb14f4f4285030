// Division by one value many times over, for kernels that divide every element of a row or block
// by its scale. __host__ __device__ (EPMOE_HD) so tests/repeated_divisor_test.cpp checks the same
// arithmetic against IEEE division on the host.
#pragma once

#include <cmath>

#include "formats/codec.hpp"  // EPMOE_HD

namespace epmoe::cuda {

// Division by one value many times over (a row's s_enc, a block's scale): its IEEE reciprocal
// once, then per quotient a product and Markstein's correction (q + (a - q b) / b with the
// reciprocal): the correctly rounded a / b wherever the quotient and a - q b stay normal, three
// instructions where an IEEE division is ten and a slow-path branch (nvfp4's activate had six per
// element: bench/RESULTS.md, session 34). The sign of a zero quotient is a's (b > 0); an infinite
// or NaN a keeps the product's quotient (the correction would be NaN).
struct RepeatedDivisor {
  float b, reciprocal;
  EPMOE_HD explicit RepeatedDivisor(float divisor) : b(divisor), reciprocal(1.0f / divisor) {}
  EPMOE_HD float divide(float a) const {
    const float q = a * reciprocal;
#if defined(__CUDA_ARCH__)
    const float residual = fmaf(-q, b, a);
    return isfinite(residual) ? copysignf(fmaf(residual, reciprocal, q), a) : q;
#else
    const float residual = std::fma(-q, b, a);
    return std::isfinite(residual) ? std::copysign(std::fma(residual, reciprocal, q), a) : q;
#endif
  }
};

// Whether RepeatedDivisor(s_enc)'s quotients of NVFP4's decoded products (E2M1 x E4M3: 0 or
// 2^-10 .. 2688) are nvfp4_decode_value's IEEE ones: s_enc in [2^-100, 2^100] keeps them normal
// (rows of finite amax below ~2^-88 or above ~2^111 fall outside).
EPMOE_HD bool nvfp4_in_reciprocal_range(float s_enc) {
  return s_enc >= 0x1p-100f && s_enc <= 0x1p100f;
}

}  // namespace epmoe::cuda

// Layer options with exact math, for the tests written for it: those that compare outputs bit for
// bit (or within 1 ulp) and those about the knob adjustments exact math makes (token_back only).
// The default math is wgmma (docs/tuning.md#expert-math).
#pragma once

#include "epmoe/config.hpp"

namespace epmoe::test {

inline LayerOptions exact_math() {
  LayerOptions o;
  o.expert_math = ExpertMath::exact;
  return o;
}

}  // namespace epmoe::test

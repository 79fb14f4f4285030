// One check the GPU tests share: a forward's y against the cluster's emulating reference, with the
// rule of the layer's combine, expert math and precision (reference::check_output).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "harness/cluster.hpp"
#include "harness/problem.hpp"

namespace epmoe::test {

inline void expect_matches(const std::vector<std::uint16_t>& y, const reference::Batch& b,
                           Cluster& c, const std::string& where) {
  const auto ref = c.reference(0).forward(b);
  const LayerConfig& config = c.layer(0).config();
  const reference::OutputCheck check = reference::check_output(
      y, ref, config.options().combine, config.options().expert_math, config.precision());
  EXPECT_TRUE(check.pass) << where << " (" << check.rule << "): " << check.stats.mismatches
                          << " elements outside, max_abs=" << check.stats.max_abs
                          << " rel_l2=" << check.stats.rel_l2;
}

}  // namespace epmoe::test

// The resident weight layout (src/cuda/experts/resident.hpp) built on the host from formats' public
// host API (quantize_mxfp8, quantize_nvfp4 per_tensor): what the device's preparation must equal
// byte for byte. Used by resident_weights_test.cpp (host) and the GpuWeights tests.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "cuda/experts/resident.hpp"
#include "epmoe/formats.hpp"
#include "formats/codec.hpp"

namespace epmoe::test {

struct HostResident {
  std::vector<std::uint8_t> elements;    // [E][rows][row bytes]
  std::vector<std::uint8_t> scales;      // in the resident record order
  std::vector<float> s_enc;              // [E], nvfp4 only
  cuda::experts::ResidentMatrices view;  // pointers into the vectors above

  HostResident() = default;
  HostResident(const HostResident&) = delete;
  HostResident& operator=(const HostResident&) = delete;
};

// `w`: [experts, rows, cols] fp32 values as the layer takes them (bf16 input decoded first).
inline void host_resident(const float* w, std::int64_t experts, std::int64_t rows,
                          std::int64_t cols, Precision precision, ScaleRounding rounding,
                          HostResident& out) {
  using cuda::experts::ResidentMatrices;
  ResidentMatrices m{nullptr, nullptr, nullptr, experts, rows, cols, precision};
  out.elements.assign(static_cast<std::size_t>(m.element_bytes()), 0);
  out.scales.assign(static_cast<std::size_t>(m.scale_bytes()), 0);
  out.s_enc.assign(precision == Precision::nvfp4 ? static_cast<std::size_t>(experts) : 0, 0.0f);
  m.elements = out.elements.data();
  m.scales = out.scales.empty() ? nullptr : out.scales.data();
  m.s_enc = out.s_enc.empty() ? nullptr : out.s_enc.data();
  out.view = m;
  const std::int64_t n = rows * cols;
  for (std::int64_t e = 0; e < experts; ++e) {
    const float* x = w + e * n;
    std::uint8_t* elements = m.run(e, 0, 0);
    std::vector<std::uint8_t> scales;  // the host API's [rows][cols / block]
    switch (precision) {
      case Precision::bf16:
        for (std::int64_t i = 0; i < n; ++i) {
          const std::uint16_t c = formats::float_to_bf16(x[i]);
          std::memcpy(elements + 2 * i, &c, 2);
        }
        continue;
      case Precision::mxfp8:
        scales.resize(static_cast<std::size_t>(n / formats::kMxfp8Block));
        quantize_mxfp8(x, rows, cols, elements, scales.data(), rounding);
        break;
      case Precision::nvfp4:
        scales.resize(static_cast<std::size_t>(n / formats::kNvfp4Block));
        quantize_nvfp4(x, rows, cols, Nvfp4ScaleGroup::per_tensor, elements, scales.data(),
                       &out.s_enc[static_cast<std::size_t>(e)]);
        break;
    }
    const int block = cuda::experts::scale_block(precision);
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t b = 0; b < cols / block; ++b)
        *m.run_scale(e, r, b * block) = scales[static_cast<std::size_t>(r * (cols / block) + b)];
  }
}

}  // namespace epmoe::test

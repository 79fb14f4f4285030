// A downstream project: find_package(epmoe), link epmoe::epmoe, make a config and run one round
// of a one-rank layer on the CPU executor.
#include <epmoe/epmoe.hpp>

#include <cstdint>
#include <cstdio>
#include <vector>

int main() {
  const epmoe::LayerShape shape{64, 64, 4, 2, 4};
  auto group = epmoe::make_host_group(1);
  auto comm = epmoe::make_host_communicator(group, 0);
  std::vector<std::uint16_t> w13(4 * 128 * 64, 0x3c00), w2(4 * 64 * 64, 0x3c00);  // 1/128 in bf16
  epmoe::Layer layer(*comm, epmoe::make_config(shape, epmoe::Precision::bf16, 0, 1),
                     {epmoe::view(w13.data(), epmoe::DType::bf16, {4, 128, 64}),
                      epmoe::view(w2.data(), epmoe::DType::bf16, {4, 64, 64})});
  std::vector<std::uint16_t> x(2 * 64, 0x3f80), y(2 * 64);  // 1.0
  std::vector<std::int32_t> ids{0, -1, 3, 1};
  std::vector<float> weights{1.0f, 0.0f, 0.5f, 0.5f};
  layer.forward(epmoe::view(x.data(), epmoe::DType::bf16, {2, 64}),
                epmoe::view(ids.data(), epmoe::DType::i32, {2, 2}),
                epmoe::view(weights.data(), epmoe::DType::f32, {2, 2}),
                epmoe::view(y.data(), epmoe::DType::bf16, {2, 64}));
  const bool ok = layer.health().ok && y[0] != 0 && y[0] == y[64];
  std::printf("%s: y[0]=0x%04x y[64]=0x%04x\n", ok ? "PASS" : "FAIL", y[0], y[64]);
  return ok ? 0 : 1;
}

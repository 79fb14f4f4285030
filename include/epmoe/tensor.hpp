// A non-owning view of a strided tensor, as DLPack describes one: what forward() and the weight
// loaders take. The library checks dtype, shape, device and strides against the rule of each
// argument and names the argument in any rejection.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace epmoe {

enum class DType : std::uint8_t { bf16, f32, f64, i32, i64, u8 };
const char* to_string(DType d);
std::size_t dtype_bytes(DType d);

enum class DeviceKind : std::uint8_t { cpu, cuda };

struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int index = 0;
  bool operator==(const Device&) const = default;
};
std::string to_string(const Device& d);

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;  // in elements; empty = contiguous row-major
  Device device{};

  std::int64_t dim(int i) const { return shape.at(static_cast<std::size_t>(i)); }
  std::int64_t numel() const;
  bool is_contiguous() const;
  std::string describe() const;  // e.g. "bf16[7, 2048] on cpu"

  template <class T>
  T* as() const {
    return static_cast<T*>(data);
  }
};

// A CUDA stream handle (cudaStream_t): where work on CUDA tensors is queued (Layer::forward of the
// CUDA executor, the codecs of formats.hpp); ignored for host tensors and by the CPU executor.
struct Stream {
  void* handle = nullptr;
};

// A contiguous host view: view(ptr, DType::bf16, {T, H}).
inline TensorView view(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                       Device device = {}) {
  return TensorView{data, dtype, std::vector<std::int64_t>(shape), {}, device};
}
inline TensorView view(const void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                       Device device = {}) {
  return view(const_cast<void*>(data), dtype, shape, device);
}

}  // namespace epmoe

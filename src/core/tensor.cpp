#include "epmoe/tensor.hpp"

#include <sstream>

namespace epmoe {

const char* to_string(DType d) {
  switch (d) {
    case DType::bf16:
      return "bf16";
    case DType::f32:
      return "f32";
    case DType::f64:
      return "f64";
    case DType::i32:
      return "i32";
    case DType::i64:
      return "i64";
    case DType::u8:
      return "u8";
  }
  return "unknown";
}

std::size_t dtype_bytes(DType d) {
  switch (d) {
    case DType::bf16:
      return 2;
    case DType::f32:
      return 4;
    case DType::f64:
      return 8;
    case DType::i32:
      return 4;
    case DType::i64:
      return 8;
    case DType::u8:
      return 1;
  }
  return 0;
}

std::string to_string(const Device& d) {
  return d.kind == DeviceKind::cpu ? std::string("cpu") : "cuda:" + std::to_string(d.index);
}

std::int64_t TensorView::numel() const {
  std::int64_t n = 1;
  for (auto s : shape) n *= s;
  return n;
}

bool TensorView::is_contiguous() const {
  if (strides.empty() || numel() == 0) return true;  // an empty tensor has no layout to break
  if (strides.size() != shape.size()) return false;
  std::int64_t expected = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    if (shape[i] != 1 && strides[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

std::string TensorView::describe() const {
  std::ostringstream s;
  s << to_string(dtype) << "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s << (i ? ", " : "") << shape[i];
  s << "] on " << to_string(device);
  if (!is_contiguous()) s << " (non-contiguous)";
  return s.str();
}

}  // namespace epmoe

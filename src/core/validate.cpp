#include "core/validate.hpp"

#include <sstream>

#include "epmoe/errors.hpp"

namespace epmoe {
namespace {

[[noreturn]] void reject(const std::string& message) {
  throw Error(ErrorCode::invalid_argument, message);
}

std::string shape_string(const std::vector<std::int64_t>& shape) {
  std::ostringstream s;
  s << "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s << (i ? ", " : "") << shape[i];
  s << "]";
  return s.str();
}

void check_tensor(const char* fn, const char* name, const TensorView& t,
                  std::initializer_list<DType> dtypes, const std::vector<std::int64_t>& shape,
                  Device device) {
  const std::string where = std::string(fn) + ": " + name;
  bool dtype_ok = false;
  std::string allowed;
  for (DType d : dtypes) {
    dtype_ok |= t.dtype == d;
    allowed += (allowed.empty() ? "" : " or ") + std::string(to_string(d));
  }
  if (!dtype_ok) reject(where + " has dtype " + to_string(t.dtype) + ", expected " + allowed);
  if (t.shape != shape)
    reject(where + " has shape " + shape_string(t.shape) + ", expected " + shape_string(shape));
  if (!(t.device == device))
    reject(where + " is on " + to_string(t.device) + ", expected " + to_string(device));
  if (!t.is_contiguous())
    reject(where + " is not contiguous (strides " + shape_string(t.strides) +
           "); pass a contiguous row-major tensor");
  if (t.numel() > 0 && t.data == nullptr) reject(where + " has a null data pointer");
  const auto alignment = dtype_bytes(t.dtype);
  if (reinterpret_cast<std::uintptr_t>(t.data) % alignment != 0)
    reject(where + " data pointer is not aligned to its element size (" +
           std::to_string(alignment) + " bytes)");
}

}  // namespace

ForwardArgs validate_forward(const LayerConfig& config, const TensorView& x,
                             const TensorView& topk_ids, const TensorView& topk_weights,
                             const TensorView& y, Device device, bool check_ids_on_host) {
  const LayerShape& s = config.shape();
  const char* fn = "forward";
  if (x.shape.size() != 2)
    reject(std::string(fn) + ": x has shape " + shape_string(x.shape) + ", expected [T, " +
           std::to_string(s.hidden) + "]");
  const std::int64_t tokens = x.shape[0];
  if (tokens < 0) reject("forward: x has a negative token count T=" + std::to_string(tokens));
  if (tokens > s.max_tokens_per_rank)
    reject("forward: x has T=" + std::to_string(tokens) +
           " tokens: must be <= max_tokens_per_rank=" + std::to_string(s.max_tokens_per_rank));
  check_tensor(fn, "x", x, {DType::bf16}, {tokens, s.hidden}, device);
  check_tensor(fn, "topk_ids", topk_ids, {DType::i32, DType::i64}, {tokens, s.top_k}, device);
  check_tensor(fn, "topk_weights", topk_weights, {DType::f32}, {tokens, s.top_k}, device);
  check_tensor(fn, "y", y, {DType::bf16}, {tokens, s.hidden}, device);

  ForwardArgs args;
  args.tokens = tokens;
  args.x = x.as<const std::uint16_t>();
  args.topk_ids = topk_ids.data;
  args.id_dtype = topk_ids.dtype;
  args.topk_weights = topk_weights.as<const float>();
  args.y = y.as<std::uint16_t>();
  if (check_ids_on_host) {
    for (std::int64_t t = 0; t < tokens; ++t)
      for (std::int64_t k = 0; k < s.top_k; ++k) {
        const std::int64_t id = topk_ids.dtype == DType::i32
                                    ? std::int64_t{args.expert_id(t, k, s.top_k)}
                                    : topk_ids.as<const std::int64_t>()[t * s.top_k + k];
        if (id < -1 || id >= s.num_experts)
          reject("forward: topk_ids[" + std::to_string(t) + ", " + std::to_string(k) +
                 "]=" + std::to_string(id) + ": must be -1 (no expert) or in [0, num_experts=" +
                 std::to_string(s.num_experts) + ")");
      }
  }
  return args;
}

void validate_weights(const LayerConfig& config, const ExpertWeights& weights, Device device) {
  const LayerShape& s = config.shape();
  const std::int64_t e = config.local_experts();
  check_tensor("Layer", "weights.w13", weights.w13, {DType::bf16, DType::f32},
               {e, 2 * s.intermediate, s.hidden}, device);
  check_tensor("Layer", "weights.w2", weights.w2, {DType::bf16, DType::f32},
               {e, s.hidden, s.intermediate}, device);
  if (given(weights.b13))
    check_tensor("Layer", "weights.b13", weights.b13, {DType::bf16, DType::f32},
                 {e, 2 * s.intermediate}, device);
  if (given(weights.b2))
    check_tensor("Layer", "weights.b2", weights.b2, {DType::bf16, DType::f32}, {e, s.hidden},
                 device);
}

}  // namespace epmoe

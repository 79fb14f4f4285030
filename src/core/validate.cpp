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

// `host_allowed`: the tensor may also live in host memory (weights of the CUDA executor). `rule`,
// when given, is added to a dtype or shape rejection: what the tensor holds.
void check_tensor(const char* fn, const std::string& name, const TensorView& t,
                  std::initializer_list<DType> dtypes, const std::vector<std::int64_t>& shape,
                  Device device, bool host_allowed = false, const std::string& rule = {}) {
  const std::string where = std::string(fn) + ": " + name;
  const std::string why = rule.empty() ? "" : " (" + rule + ")";
  bool dtype_ok = false;
  std::string allowed;
  for (DType d : dtypes) {
    dtype_ok |= t.dtype == d;
    allowed += (allowed.empty() ? "" : " or ") + std::string(to_string(d));
  }
  if (!dtype_ok) reject(where + " has dtype " + to_string(t.dtype) + ", expected " + allowed + why);
  if (t.shape != shape)
    reject(where + " has shape " + shape_string(t.shape) + ", expected " + shape_string(shape) +
           why);
  if (!(t.device == device) && !(host_allowed && t.device.kind == DeviceKind::cpu))
    reject(where + " is on " + to_string(t.device) + ", expected " +
           (host_allowed && device.kind != DeviceKind::cpu ? "cpu or " : "") + to_string(device));
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

namespace {

std::int64_t ceil_div(std::int64_t a, std::int64_t b) {
  return (a + b - 1) / b;
}

// One FC of [e, n, k]: values to quantize, or matrices already in the layer's precision (the
// table of epmoe/layer.hpp).
void check_fc(Precision precision, const std::string& name, const TensorView& values,
              const QuantizedMatrices& q, std::int64_t e, std::int64_t n, std::int64_t k,
              Device device, bool host_allowed) {
  const std::string fc = "weights." + name;
  if (!given(q)) {
    check_tensor("Layer", fc, values, {DType::bf16, DType::f32}, {e, n, k}, device, host_allowed);
    return;
  }
  const std::string qn = fc + "_quantized";
  const std::string p = to_string(precision);
  if (given(values))
    reject("Layer: " + fc + " and " + qn + " are both given; pass one: values to quantize, or " +
           "codes already in precision=" + p);
  if (precision == Precision::bf16)
    reject("Layer: " + qn + " is given, but precision=bf16 has no codes: pass bf16 or f32 " +
           "values as " + fc);
  const auto check = [&](const char* part, const TensorView& t, DType dtype,
                         const std::vector<std::int64_t>& shape, const char* rule) {
    check_tensor("Layer", qn + "." + part, t, {dtype}, shape, device, host_allowed,
                 p + ": " + rule);
  };
  switch (precision) {
    case Precision::mxfp8:
      check("codes", q.codes, DType::u8, {e, n, k}, "E4M3 codes");
      check("scales", q.scales, DType::u8, {e, n, k / 32}, "E8M0 scales, one per 32 along K");
      break;
    case Precision::nvfp4:
      check("codes", q.codes, DType::u8, {e, n, k / 2}, "E2M1 pairs, element 2j in the low nibble");
      check("scales", q.scales, DType::u8, {e, n, k / 16}, "E4M3 block scales, one per 16 along K");
      if (given(q.global_scale) == given(q.s_enc))
        reject("Layer: " + qn + " needs exactly one of global_scale (ModelOpt's weight_scale_2: " +
               "value = e2m1 * scale * global_scale) and s_enc (value = e2m1 * scale / s_enc), " +
               "f32 [" + std::to_string(e) + "]");
      if (given(q.global_scale))
        check("global_scale", q.global_scale, DType::f32, {e}, "one decode multiplier per matrix");
      else
        check("s_enc", q.s_enc, DType::f32, {e}, "one encode scale per matrix");
      break;
    case Precision::fp8_block128:
      check("codes", q.codes, DType::u8, {e, n, k}, "E4M3 codes");
      check("scales", q.scales, DType::f32, {e, ceil_div(n, 128), ceil_div(k, 128)},
            "weight_scale_inv, one per 128 x 128 tile");
      break;
    case Precision::mxfp4:
      // gpt-oss's *_blocks [E, N, K/32, 16] or the same bytes as [E, N, K/2].
      check("codes", q.codes, DType::u8,
            q.codes.shape.size() == 4 ? std::vector<std::int64_t>{e, n, k / 32, 16}
                                      : std::vector<std::int64_t>{e, n, k / 2},
            "E2M1 pairs, element 2j in the low nibble: [E, N, K/2] or [E, N, K/32, 16]");
      check("scales", q.scales, DType::u8, {e, n, k / 32}, "E8M0 scales, one per 32 along K");
      break;
    case Precision::bf16:
      break;
  }
  if (precision != Precision::nvfp4 && (given(q.global_scale) || given(q.s_enc)))
    reject("Layer: " + qn + "." + (given(q.global_scale) ? "global_scale" : "s_enc") +
           " is given, but precision=" + p + " has no per-matrix scale (only nvfp4 does)");
}

}  // namespace

void validate_weights(const LayerConfig& config, const ExpertWeights& weights, Device device,
                      bool host_allowed) {
  const LayerShape& s = config.shape();
  const std::int64_t e = config.local_experts();
  check_fc(config.precision(), "w13", weights.w13, weights.w13_quantized, e, 2 * s.intermediate,
           s.hidden, device, host_allowed);
  check_fc(config.precision(), "w2", weights.w2, weights.w2_quantized, e, s.hidden, s.intermediate,
           device, host_allowed);
  if (given(weights.b13))
    check_tensor("Layer", "weights.b13", weights.b13, {DType::bf16, DType::f32},
                 {e, 2 * s.intermediate}, device, host_allowed);
  if (given(weights.b2))
    check_tensor("Layer", "weights.b2", weights.b2, {DType::bf16, DType::f32}, {e, s.hidden},
                 device, host_allowed);
}

}  // namespace epmoe

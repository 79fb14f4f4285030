// epmoe._epmoe: the nanobind module behind `import epmoe` (python/epmoe/__init__.py wraps it).
//
// Tensors cross as DLPack (numpy, torch, cupy, jax, ...) without a copy: each argument becomes an
// epmoe::TensorView with its data pointer, dtype, shape, strides and device, and the library checks
// it, so a wrong tensor gets the same message from Python as from C++. Only what a TensorView
// cannot describe (a dtype or device epmoe has no name for, an object that is not a tensor) is
// rejected here, with a message in the same form. uint16 tensors are read as bf16 bits (numpy has
// no bfloat16).
//
// Collective calls (Layer construction, reset) and forward release the GIL: the CPU executor's
// ranks are threads of this process, and each must run while the others wait for it.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "commands.hpp"  // tools/: `epmoe run`, shared with `python -m epmoe run`
#include "epmoe/epmoe.hpp"
#include "epmoe/formats.hpp"
#include "epmoe/models.hpp"
#include "epmoe/testing.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace epmoe::python {
namespace {

[[noreturn]] void reject(const std::string& message) {
  throw Error(ErrorCode::invalid_argument, message);
}

std::string where(const char* fn, const char* name) {
  return std::string(fn) + ": " + name;
}

std::string shape_string(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// The ErrorCode's identifier (to_string gives prose: "invalid argument").
const char* code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::invalid_argument:
      return "invalid_argument";
    case ErrorCode::timeout:
      return "timeout";
    case ErrorCode::peer_aborted:
      return "peer_aborted";
    case ErrorCode::protocol_violation:
      return "protocol_violation";
    case ErrorCode::layer_unhealthy:
      return "layer_unhealthy";
    case ErrorCode::unsupported:
      return "unsupported";
    case ErrorCode::internal:
      return "internal";
  }
  return "unknown";
}

// ---- DLPack -> TensorView ----

// DLPack device types (dlpack.h, DLDeviceType).
constexpr int kDLCPU = 1;
constexpr int kDLCUDA = 2;
constexpr int kDLCUDAHost = 3;  // pinned host memory: host memory as far as epmoe is concerned

std::string dlpack_device_name(int type) {
  switch (type) {
    case 4:
      return "opencl";
    case 7:
      return "vulkan";
    case 8:
      return "metal";
    case 10:
      return "rocm";
    case 11:
      return "rocm_host";
    case 13:
      return "cuda_managed";
    case 14:
      return "oneapi";
    default:
      return "dlpack device type " + std::to_string(type);
  }
}

std::string dlpack_dtype_name(nb::dlpack::dtype d) {
  using Code = nb::dlpack::dtype_code;
  std::string kind;
  switch (static_cast<Code>(d.code)) {
    case Code::Int:
      kind = "int";
      break;
    case Code::UInt:
      kind = "uint";
      break;
    case Code::Float:
      kind = "float";
      break;
    case Code::Bfloat:
      kind = "bfloat";
      break;
    case Code::Complex:
      kind = "complex";
      break;
    case Code::Bool:
      kind = "bool";
      break;
    default:
      kind = "dlpack_code" + std::to_string(d.code) + "_bits";
      break;
  }
  std::string name = kind + std::to_string(d.bits);
  if (d.lanes != 1) name += "x" + std::to_string(d.lanes);
  return name;
}

std::optional<DType> to_dtype(nb::dlpack::dtype d) {
  using Code = nb::dlpack::dtype_code;
  if (d.lanes != 1) return std::nullopt;
  switch (static_cast<Code>(d.code)) {
    case Code::Int:
      if (d.bits == 32) return DType::i32;
      if (d.bits == 64) return DType::i64;
      break;
    case Code::UInt:
      if (d.bits == 8) return DType::u8;
      if (d.bits == 16) return DType::bf16;  // bf16 bits in a uint16 array (numpy)
      break;
    case Code::Float:
      if (d.bits == 32) return DType::f32;
      if (d.bits == 64) return DType::f64;
      break;
    case Code::Bfloat:
      if (d.bits == 16) return DType::bf16;
      break;
    default:
      break;
  }
  return std::nullopt;
}

using ReadArray = nb::ndarray<nb::ro>;
using WriteArray = nb::ndarray<>;

std::string python_type_name(nb::handle obj) {
  return Py_TYPE(obj.ptr())->tp_name;
}

// The object as an ndarray (no copy, never converted), or an Error naming the argument.
template <class Array>
Array import_array(const char* fn, const char* name, nb::handle obj) {
  Array a;
  if (nb::try_cast(obj, a, /*convert=*/false)) return a;
  if constexpr (!std::is_same_v<Array, ReadArray>) {
    ReadArray ro;
    if (nb::try_cast(obj, ro, false))
      reject(where(fn, name) + " is read-only; pass a writable tensor");
  }
  reject(where(fn, name) + " is a " + python_type_name(obj) +
         ", not a tensor epmoe can read (pass a DLPack tensor or an array with the buffer "
         "protocol: numpy, torch, cupy, jax, ...)");
}

template <class Array>
TensorView tensor_view(const char* fn, const char* name, const Array& a) {
  TensorView v;
  const std::optional<DType> dtype = to_dtype(a.dtype());
  if (!dtype)
    reject(where(fn, name) + " has dtype " + dlpack_dtype_name(a.dtype()) +
           ", which epmoe does not take (bf16, f32, f64, i32, i64, u8; a uint16 tensor is read as "
           "bf16 bits)");
  v.dtype = *dtype;
  switch (a.device_type()) {
    case kDLCPU:
    case kDLCUDAHost:
      v.device = Device{DeviceKind::cpu, 0};
      break;
    case kDLCUDA:
      v.device = Device{DeviceKind::cuda, a.device_id()};
      break;
    default:
      reject(where(fn, name) + " is on " + dlpack_device_name(a.device_type()) +
             ", which epmoe does not take (cpu or cuda)");
  }
  v.data = const_cast<void*>(static_cast<const void*>(a.data()));
  v.shape.resize(a.ndim());
  v.strides.resize(a.ndim());
  for (std::size_t i = 0; i < a.ndim(); ++i) {
    v.shape[i] = static_cast<std::int64_t>(a.shape(i));
    v.strides[i] = a.stride(i);
  }
  // An empty tensor has no layout (numpy exports np.zeros((0, H)) with strides [0, 0]).
  if (v.numel() == 0) v.strides.clear();
  return v;
}

template <class Array>
TensorView import_tensor(const char* fn, const char* name, nb::handle obj) {
  return tensor_view(fn, name, import_array<Array>(fn, name, obj));
}

// ---- host arrays for the codecs ----

// A contiguous host array of one dtype, as [rows, cols] along its last dimension.
struct HostMatrix {
  const void* data = nullptr;
  std::vector<std::int64_t> shape;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
};

HostMatrix host_matrix(const char* fn, const char* name, const ReadArray& a, DType want) {
  const TensorView v = tensor_view(fn, name, a);
  if (v.dtype != want)
    reject(where(fn, name) + " has dtype " + to_string(v.dtype) + ", expected " + to_string(want));
  if (v.device.kind != DeviceKind::cpu)
    reject(where(fn, name) + " is on " + to_string(v.device) +
           "; the codecs take host (cpu) arrays for now");
  if (!v.is_contiguous())
    reject(where(fn, name) + " is not contiguous (strides " + shape_string(v.strides) +
           "); pass a contiguous row-major array");
  if (v.shape.empty()) reject(where(fn, name) + " is 0-d; expected shape [..., cols]");
  HostMatrix m;
  m.data = v.data;
  m.shape = v.shape;
  m.cols = v.shape.back();
  m.rows = 1;
  for (std::size_t i = 0; i + 1 < v.shape.size(); ++i) m.rows *= v.shape[i];
  return m;
}

void expect_shape(const char* fn, const char* name, const HostMatrix& m,
                  const std::vector<std::int64_t>& shape) {
  if (m.shape != shape)
    reject(where(fn, name) + " has shape " + shape_string(m.shape) + ", expected " +
           shape_string(shape));
}

std::vector<std::int64_t> with_last(std::vector<std::int64_t> shape, std::int64_t last) {
  shape.back() = last;
  return shape;
}

// A new numpy array that owns its memory (freed when Python drops it).
template <class T>
struct OwnedArray {
  T* data = nullptr;
  nb::ndarray<nb::numpy, T> array;
};

template <class T>
OwnedArray<T> new_array(const std::vector<std::int64_t>& shape) {
  std::size_t n = 1;
  std::vector<std::size_t> dims;
  for (std::int64_t d : shape) {
    dims.push_back(static_cast<std::size_t>(d));
    n *= static_cast<std::size_t>(d);
  }
  OwnedArray<T> out;
  out.data = new T[n == 0 ? 1 : n]();
  nb::capsule owner(out.data, [](void* p) noexcept { delete[] static_cast<T*>(p); });
  out.array = nb::ndarray<nb::numpy, T>(out.data, dims.size(), dims.data(), owner);
  return out;
}

template <class Enum, std::size_t N>
Enum parse_enum(const std::string& name, const char* what, const Enum (&values)[N]) {
  std::string allowed;
  for (Enum e : values) {
    if (name == to_string(e)) return e;
    allowed += (allowed.empty() ? "" : " or ") + std::string(to_string(e));
  }
  reject(std::string(what) + "=" + name + ": must be " + allowed);
}

ScaleRounding parse_rounding(const std::string& name, const char* what) {
  return parse_enum(name, what, {ScaleRounding::rceil, ScaleRounding::ocp_floor});
}

Nvfp4ScaleGroup parse_group(const std::string& name, const char* what) {
  return parse_enum(name, what, {Nvfp4ScaleGroup::per_tensor, Nvfp4ScaleGroup::per_row});
}

using U8Array = nb::ndarray<nb::numpy, std::uint8_t>;
using F32Array = nb::ndarray<nb::numpy, float>;

std::tuple<U8Array, U8Array> quantize_mxfp8_py(nb::handle x_obj, const std::string& rounding_name) {
  constexpr const char* fn = "quantize_mxfp8";
  const ScaleRounding rounding = parse_rounding(rounding_name, "quantize_mxfp8: rounding");
  const ReadArray x_array = import_array<ReadArray>(fn, "x", x_obj);
  const HostMatrix x = host_matrix(fn, "x", x_array, DType::f32);
  auto elements = new_array<std::uint8_t>(x.shape);
  auto scales = new_array<std::uint8_t>(with_last(x.shape, x.cols / 32));
  {
    nb::gil_scoped_release release;
    quantize_mxfp8(static_cast<const float*>(x.data), x.rows, x.cols, elements.data, scales.data,
                   rounding);
  }
  return {elements.array, scales.array};
}

F32Array dequantize_mxfp8_py(nb::handle elements_obj, nb::handle scales_obj) {
  constexpr const char* fn = "dequantize_mxfp8";
  const ReadArray ea = import_array<ReadArray>(fn, "elements", elements_obj);
  const ReadArray sa = import_array<ReadArray>(fn, "scales", scales_obj);
  const HostMatrix elements = host_matrix(fn, "elements", ea, DType::u8);
  const HostMatrix scales = host_matrix(fn, "scales", sa, DType::u8);
  if (elements.cols % 32 == 0)  // otherwise the library names the rule
    expect_shape(fn, "scales", scales, with_last(elements.shape, elements.cols / 32));
  auto out = new_array<float>(elements.shape);
  {
    nb::gil_scoped_release release;
    dequantize_mxfp8(static_cast<const std::uint8_t*>(elements.data),
                     static_cast<const std::uint8_t*>(scales.data), elements.rows, elements.cols,
                     out.data);
  }
  return out.array;
}

std::tuple<U8Array, U8Array, F32Array> quantize_nvfp4_py(nb::handle x_obj,
                                                         const std::string& group_name,
                                                         std::optional<float> tensor_scale) {
  constexpr const char* fn = "quantize_nvfp4";
  const Nvfp4ScaleGroup group = parse_group(group_name, "quantize_nvfp4: group");
  const ReadArray x_array = import_array<ReadArray>(fn, "x", x_obj);
  const HostMatrix x = host_matrix(fn, "x", x_array, DType::f32);
  if (tensor_scale && group != Nvfp4ScaleGroup::per_tensor)
    reject(
        "quantize_nvfp4: tensor_scale is one static scale for the whole array; it needs "
        "group=per_tensor, not group=" +
        group_name);
  auto packed = new_array<std::uint8_t>(with_last(x.shape, x.cols / 2));
  auto scales = new_array<std::uint8_t>(with_last(x.shape, x.cols / 16));
  auto tensor_scales =
      new_array<float>({group == Nvfp4ScaleGroup::per_tensor ? std::int64_t{1} : x.rows});
  {
    nb::gil_scoped_release release;
    const auto* data = static_cast<const float*>(x.data);
    if (tensor_scale) {
      quantize_nvfp4_static(data, x.rows, x.cols, *tensor_scale, packed.data, scales.data);
      tensor_scales.data[0] = *tensor_scale;
    } else {
      quantize_nvfp4(data, x.rows, x.cols, group, packed.data, scales.data, tensor_scales.data);
    }
  }
  return {packed.array, scales.array, tensor_scales.array};
}

F32Array dequantize_nvfp4_py(nb::handle packed_obj, nb::handle scales_obj,
                             nb::handle tensor_scales_obj, std::optional<std::string> group_name) {
  constexpr const char* fn = "dequantize_nvfp4";
  const ReadArray pa = import_array<ReadArray>(fn, "packed", packed_obj);
  const ReadArray sa = import_array<ReadArray>(fn, "scales", scales_obj);
  const ReadArray ta = import_array<ReadArray>(fn, "tensor_scales", tensor_scales_obj);
  const HostMatrix packed = host_matrix(fn, "packed", pa, DType::u8);
  const HostMatrix scales = host_matrix(fn, "scales", sa, DType::u8);
  const HostMatrix tensor_scales = host_matrix(fn, "tensor_scales", ta, DType::f32);
  const std::int64_t cols = packed.cols * 2;
  if (cols % 16 == 0) expect_shape(fn, "scales", scales, with_last(packed.shape, cols / 16));
  const std::int64_t n_scales = tensor_scales.rows * tensor_scales.cols;
  Nvfp4ScaleGroup group;
  if (group_name) {
    group = parse_group(*group_name, "dequantize_nvfp4: group");
  } else if (n_scales == 1) {
    group = Nvfp4ScaleGroup::per_tensor;  // one scale: the whole array (same as per_row if 1 row)
  } else if (n_scales == packed.rows) {
    group = Nvfp4ScaleGroup::per_row;
  } else {
    reject("dequantize_nvfp4: tensor_scales has " + std::to_string(n_scales) +
           " elements, expected 1 (per_tensor) or rows=" + std::to_string(packed.rows) +
           " (per_row)");
  }
  const std::int64_t want = group == Nvfp4ScaleGroup::per_tensor ? 1 : packed.rows;
  if (n_scales != want)
    reject("dequantize_nvfp4: tensor_scales has " + std::to_string(n_scales) +
           " elements, expected " + std::to_string(want) + " for group=" + to_string(group));
  auto out = new_array<float>(with_last(packed.shape, cols));
  {
    nb::gil_scoped_release release;
    dequantize_nvfp4(static_cast<const std::uint8_t*>(packed.data),
                     static_cast<const std::uint8_t*>(scales.data),
                     static_cast<const float*>(tensor_scales.data), packed.rows, cols, group,
                     out.data);
  }
  return out.array;
}

// ---- Layer ----

std::uint32_t timeout_arg(std::int64_t timeout_ms) {
  if (timeout_ms < 0 || timeout_ms > std::numeric_limits<std::uint32_t>::max())
    reject("timeout_ms=" + std::to_string(timeout_ms) + ": must be in [0, " +
           std::to_string(kMaxTimeoutMs) + "] (0 = wait forever)");
  return static_cast<std::uint32_t>(timeout_ms);
}

LayerConfig make_config_py(const LayerShape& shape, const std::string& precision, int rank,
                           int world, const std::string& combine, bool deterministic,
                           std::int64_t timeout_ms, float swiglu_limit,
                           const std::string& mxfp8_scale_rounding) {
  LayerOptions options;
  options.combine = parse_combine(combine);
  options.deterministic = deterministic;
  options.timeout_ms = timeout_arg(timeout_ms);
  options.swiglu_limit = swiglu_limit;
  options.mxfp8_scale_rounding = parse_rounding(mxfp8_scale_rounding, "mxfp8_scale_rounding");
  return make_config(shape, parse_precision(precision), rank, world, options);
}

void layer_init(Layer* self, Communicator& comm, const LayerConfig& config, nb::handle w13_obj,
                nb::handle w2_obj) {
  const ReadArray w13 = import_array<ReadArray>("Layer", "weights.w13", w13_obj);
  const ReadArray w2 = import_array<ReadArray>("Layer", "weights.w2", w2_obj);
  const ExpertWeights weights{tensor_view("Layer", "weights.w13", w13),
                              tensor_view("Layer", "weights.w2", w2)};
  nb::gil_scoped_release release;  // collective: the other ranks' threads must run meanwhile
  new (self) Layer(comm, config, weights);
}

void layer_forward(Layer& layer, nb::handle x_obj, nb::handle ids_obj, nb::handle weights_obj,
                   nb::handle y_obj, std::uintptr_t stream) {
  constexpr const char* fn = "forward";
  // The arrays stay referenced (and their memory alive) until the end of this call.
  const ReadArray x = import_array<ReadArray>(fn, "x", x_obj);
  const ReadArray ids = import_array<ReadArray>(fn, "topk_ids", ids_obj);
  const ReadArray weights = import_array<ReadArray>(fn, "topk_weights", weights_obj);
  const WriteArray y = import_array<WriteArray>(fn, "y", y_obj);
  const TensorView xv = tensor_view(fn, "x", x);
  const TensorView iv = tensor_view(fn, "topk_ids", ids);
  const TensorView wv = tensor_view(fn, "topk_weights", weights);
  const TensorView yv = tensor_view(fn, "y", y);
  nb::gil_scoped_release release;
  layer.forward(xv, iv, wv, yv, Stream{reinterpret_cast<void*>(stream)});
}

nb::dict health_dict(const Health& h) {
  nb::dict d;
  d["ok"] = h.ok;
  d["code"] = h.ok ? nb::none() : nb::cast(std::string(code_name(h.code)));
  d["rank"] = h.rank;
  d["peer"] = h.peer;
  d["phase"] = std::string(to_string(h.phase));
  d["round"] = h.round;
  d["observed"] = h.observed;
  d["expected"] = h.expected;
  d["what"] = h.what;
  return d;
}

std::string describe_shape(const LayerShape& s) {
  return "LayerShape(hidden=" + std::to_string(s.hidden) +
         ", intermediate=" + std::to_string(s.intermediate) +
         ", num_experts=" + std::to_string(s.num_experts) + ", top_k=" + std::to_string(s.top_k) +
         ", max_tokens_per_rank=" + std::to_string(s.max_tokens_per_rank) + ")";
}

// ---- errors ----

PyObject* g_error_type = nullptr;

void translate_error(const std::exception_ptr& p, void* /*payload*/) {
  try {
    std::rethrow_exception(p);
  } catch (const Error& e) {
    nb::object error = nb::borrow(g_error_type)(nb::str(e.what()));
    error.attr("code") = nb::str(code_name(e.code()));
    PyErr_SetObject(g_error_type, error.ptr());
  }
}

// ---- fault switches (test builds only) ----

#if defined(EPMOE_FAULT_INJECTION)
void inject_fault_py(Layer& layer, const std::string& fault, std::int64_t stall_ms,
                     std::int64_t times) {
  using testing::Fault;
  testing::FaultSpec spec;
  spec.fault =
      parse_enum(fault, "inject_fault: fault",
                 {Fault::none, Fault::skip_launch_when_idle, Fault::stall, Fault::round_jump});
  if (stall_ms < 0 || stall_ms > std::numeric_limits<std::uint32_t>::max())
    reject("inject_fault: stall_ms=" + std::to_string(stall_ms) + ": must be >= 0");
  if (times < 0 || times > std::numeric_limits<std::uint32_t>::max())
    reject("inject_fault: times=" + std::to_string(times) + ": must be >= 0");
  spec.stall_ms = static_cast<std::uint32_t>(stall_ms);
  spec.times = static_cast<std::uint32_t>(times);
  testing::inject_fault(layer, spec);
}
#endif

}  // namespace
}  // namespace epmoe::python

NB_MODULE(_epmoe, m) {
  using namespace epmoe;
  using namespace epmoe::python;
  m.doc() = "epmoe: expert-parallel MoE layer (the compiled part; use `import epmoe`)";

  g_error_type = PyErr_NewExceptionWithDoc(
      "epmoe.Error",
      "An epmoe error: the C++ library's message, with `code` the ErrorCode name "
      "(invalid_argument, timeout, peer_aborted, protocol_violation, layer_unhealthy, "
      "unsupported, internal).",
      PyExc_RuntimeError, nullptr);
  m.attr("Error") = nb::handle(g_error_type);
  nb::register_exception_translator(translate_error);

  m.attr("fault_injection_available") = testing::fault_injection_available();
  m.attr("cuda_available") =
#if defined(EPMOE_HAS_CUDA)
      true;
#else
      false;
#endif

  nb::class_<LayerShape>(m, "LayerShape",
                         "The layer's shape: H, I, E, K and the largest T any forward may pass.")
      .def(nb::init<>())
      .def(
          "__init__",
          [](LayerShape* s, std::int64_t hidden, std::int64_t intermediate,
             std::int64_t num_experts, std::int64_t top_k, std::int64_t max_tokens_per_rank) {
            new (s) LayerShape{hidden, intermediate, num_experts, top_k, max_tokens_per_rank};
          },
          "hidden"_a, "intermediate"_a, "num_experts"_a, "top_k"_a, "max_tokens_per_rank"_a)
      .def_rw("hidden", &LayerShape::hidden)
      .def_rw("intermediate", &LayerShape::intermediate)
      .def_rw("num_experts", &LayerShape::num_experts)
      .def_rw("top_k", &LayerShape::top_k)
      .def_rw("max_tokens_per_rank", &LayerShape::max_tokens_per_rank)
      .def(
          "__eq__",
          [](const LayerShape& a, const LayerShape& b) {
            return a.hidden == b.hidden && a.intermediate == b.intermediate &&
                   a.num_experts == b.num_experts && a.top_k == b.top_k &&
                   a.max_tokens_per_rank == b.max_tokens_per_rank;
          },
          nb::is_operator())
      .def("__repr__", &describe_shape);

  nb::class_<LayerConfig>(m, "LayerConfig", "An immutable, validated layer configuration.")
      .def_prop_ro("shape", &LayerConfig::shape)
      .def_prop_ro("precision",
                   [](const LayerConfig& c) { return std::string(to_string(c.precision())); })
      .def_prop_ro("rank", &LayerConfig::rank)
      .def_prop_ro("world", &LayerConfig::world)
      .def_prop_ro("local_experts", &LayerConfig::local_experts)
      .def_prop_ro("combine",
                   [](const LayerConfig& c) { return std::string(to_string(c.options().combine)); })
      .def_prop_ro("deterministic", [](const LayerConfig& c) { return c.options().deterministic; })
      .def_prop_ro("timeout_ms", [](const LayerConfig& c) { return c.options().timeout_ms; })
      .def_prop_ro("swiglu_limit", [](const LayerConfig& c) { return c.options().swiglu_limit; })
      .def_prop_ro("mxfp8_scale_rounding",
                   [](const LayerConfig& c) {
                     return std::string(to_string(c.options().mxfp8_scale_rounding));
                   })
      .def("expert_owner", &LayerConfig::expert_owner, "expert"_a)
      .def("workspace_bytes", &LayerConfig::workspace_bytes,
           "Bytes of the symmetric window one rank registers for this layer.")
      .def("describe", &LayerConfig::describe)
      .def("__repr__", [](const LayerConfig& c) { return "LayerConfig(" + c.describe() + ")"; });

  m.def("make_config", &make_config_py, "shape"_a, "precision"_a = "bf16", "rank"_a = 0,
        "world"_a = 1, nb::kw_only(), "combine"_a = "staged", "deterministic"_a = false,
        "timeout_ms"_a = 10'000, "swiglu_limit"_a = 0.0f, "mxfp8_scale_rounding"_a = "rceil",
        "Validates everything (raises epmoe.Error naming the field, its value and the rule).");

  nb::class_<ModelShape>(m, "ModelShape", "The MoE layer shape of a real model.")
      .def_prop_ro("name", [](const ModelShape& s) { return std::string(s.name); })
      .def_ro("hidden", &ModelShape::hidden)
      .def_ro("intermediate", &ModelShape::intermediate)
      .def_ro("num_experts", &ModelShape::num_experts)
      .def_ro("top_k", &ModelShape::top_k)
      .def("layer_shape", &ModelShape::layer_shape, "max_tokens_per_rank"_a)
      .def("__repr__", [](const ModelShape& s) {
        return std::string("ModelShape(") + s.name + ", hidden=" + std::to_string(s.hidden) +
               ", intermediate=" + std::to_string(s.intermediate) +
               ", num_experts=" + std::to_string(s.num_experts) +
               ", top_k=" + std::to_string(s.top_k) + ")";
      });
  m.def("known_models", [] {
    std::vector<ModelShape> models;
    for (const ModelShape& s : known_models()) models.push_back(s);
    return models;
  });
  m.def("find_model", &find_model, "name"_a, nb::rv_policy::copy);

  nb::class_<Health>(m, "Health",
                     "A layer's health (DESIGN I3): who gave up waiting for whom, where, when.")
      .def_ro("ok", &Health::ok)
      .def_prop_ro("code",
                   [](const Health& h) -> std::optional<std::string> {
                     if (h.ok) return std::nullopt;
                     return std::string(code_name(h.code));
                   })
      .def_ro("rank", &Health::rank)
      .def_ro("peer", &Health::peer)
      .def_prop_ro("phase", [](const Health& h) { return std::string(to_string(h.phase)); })
      .def_ro("round", &Health::round)
      .def_ro("observed", &Health::observed)
      .def_ro("expected", &Health::expected)
      .def_ro("what", &Health::what)
      .def("as_dict", &health_dict)
      .def("__repr__", [](const Health& h) {
        if (h.ok) return std::string("Health(ok=True)");
        return std::string("Health(ok=False, code=") + code_name(h.code) +
               ", rank=" + std::to_string(h.rank) + ", peer=" + std::to_string(h.peer) +
               ", phase=" + to_string(h.phase) + ", round=" + std::to_string(h.round) +
               ", observed=" + std::to_string(h.observed) +
               ", expected=" + std::to_string(h.expected) + ", what=" + h.what + ")";
      });

  nb::class_<Communicator>(m, "Communicator", "Who the ranks of an expert-parallel group are.")
      .def_prop_ro("rank", &Communicator::rank)
      .def_prop_ro("world", &Communicator::world)
      .def_prop_ro("backend",
                   [](const Communicator& c) { return std::string(to_string(c.backend())); });

  struct HostGroupHandle {
    std::shared_ptr<HostGroup> group;
    int world;
  };
  nb::class_<HostGroupHandle>(m, "HostGroup",
                              "The CPU executor's group: `world` ranks, each driven by its own "
                              "thread of this process.")
      .def(
          "__init__",
          [](HostGroupHandle* self, int world) {
            new (self) HostGroupHandle{make_host_group(world), world};
          },
          "world"_a)
      .def_ro("world", &HostGroupHandle::world)
      .def(
          "communicator",
          [](const HostGroupHandle& g, int rank) { return make_host_communicator(g.group, rank); },
          "rank"_a, "This rank's communicator (use it, and the layer, from this rank's thread).");

  nb::class_<Layer>(m, "_Layer", "The C++ layer; use epmoe.Layer.")
      .def("__init__", &layer_init, "comm"_a, "config"_a, "w13"_a, "w2"_a, nb::keep_alive<1, 2>())
      .def("_forward", &layer_forward, "x"_a, "topk_ids"_a, "topk_weights"_a, "y"_a, "stream"_a = 0)
      .def("health", &Layer::health)
      .def(
          "reset",
          [](Layer& l) {
            nb::gil_scoped_release release;
            l.reset();
          },
          "Collective: every rank calls it (from its own thread); rounds then restart.")
      .def_prop_ro("config", &Layer::config)
      .def_prop_ro("next_round", &Layer::next_round);

  m.def("quantize_mxfp8", &quantize_mxfp8_py, "x"_a, "rounding"_a = "rceil");
  m.def("dequantize_mxfp8", &dequantize_mxfp8_py, "elements"_a, "scales"_a);
  m.def("quantize_nvfp4", &quantize_nvfp4_py, "x"_a, "group"_a = "per_tensor",
        "tensor_scale"_a = nb::none());
  m.def("dequantize_nvfp4", &dequantize_nvfp4_py, "packed"_a, "scales"_a, "tensor_scales"_a,
        "group"_a = nb::none());

  m.def(
      "_run_command",
      [](const std::string& model, int ranks, std::int64_t tokens, std::int64_t experts,
         const std::string& precision, const std::string& combine, const std::string& executor,
         int rounds, std::uint64_t seed, std::int64_t timeout_ms) {
        tools::RunOptions o;
        o.model = model;
        o.ranks = ranks;
        o.tokens = tokens;
        o.experts = experts;
        o.precision = precision;
        o.combine = combine;
        o.executor = executor;
        o.rounds = rounds;
        o.seed = seed;
        o.timeout_ms = timeout_arg(timeout_ms);
        nb::gil_scoped_release release;
        const int rc = tools::run_command(o);
        std::fflush(stdout);
        std::fflush(stderr);
        return rc;
      },
      "model"_a, "ranks"_a, "tokens"_a, "experts"_a, "precision"_a, "combine"_a, "executor"_a,
      "rounds"_a, "seed"_a, "timeout_ms"_a,
      "`epmoe run` (tools/run.cpp): prints its report, returns the exit status.");

#if defined(EPMOE_FAULT_INJECTION)
  nb::module_ t = m.def_submodule("_testing", "Fault switches (test builds only).");
  t.def("inject_fault", &inject_fault_py, "layer"_a, "fault"_a, "stall_ms"_a = 0, "times"_a = 1,
        "Arms a fault on this rank's layer: none, skip_launch_when_idle, stall, round_jump.");
#endif
}

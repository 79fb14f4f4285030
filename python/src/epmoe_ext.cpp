// epmoe._epmoe: the nanobind module behind `import epmoe` (python/epmoe/__init__.py wraps it).
//
// Tensors cross without a copy: each argument becomes an epmoe::TensorView with its data pointer,
// dtype, shape, strides and device, and the library checks it, so a wrong tensor gets the same
// message from Python as from C++. Only what a TensorView cannot describe (a dtype or device epmoe
// has no name for, an object that is not a tensor) is rejected here, with a message in the same
// form. uint16 tensors are read as bf16 bits (numpy has no bfloat16).
//
// torch tensors are read through their own attributes (data_ptr, shape, stride, dtype, device),
// never through DLPack: torch's __dlpack__() makes its default stream wait on the current stream
// (an event record and a cross-stream wait on every call), which breaks CUDA graph capture, and it
// refuses tensors that require grad. Reading attributes launches nothing and synchronises nothing.
// Every other tensor (numpy, cupy, jax, ...) goes through DLPack or the buffer protocol. A CUDA
// array (__dlpack_device__ says kDLCUDA) is exported with __dlpack__(stream=S), S the stream the
// call's work is queued on (1 for the legacy default stream, as DLPack spells it): the producer
// then orders S after the array's pending work (nothing when S is its own current stream) instead
// of making the legacy default stream wait, which would serialise the device and break CUDA graph
// capture.
//
// Collective calls (Layer construction, close, reset; communicator creation and close) and forward
// release the GIL: the ranks of a one-process group (CPU executor, nccl_communicators) are threads
// of this process, and each must run while the others wait for it. Destroying a layer or a
// communicator is collective on the CUDA executor (NCCL window deregistration, ncclCommFinalize),
// so their handles release the GIL in their destructors too, also when garbage collection drops
// them.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
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

// A CUDA array's DLPack capsule, exported for the consumer stream `stream` (the top of this
// file); an invalid object for anything else (host arrays, objects without DLPack).
nb::object cuda_dlpack_capsule(const char* fn, const char* name, nb::handle obj,
                               std::uintptr_t stream) {
  if (!nb::hasattr(obj, "__dlpack__") || !nb::hasattr(obj, "__dlpack_device__")) return {};
  const nb::object device = obj.attr("__dlpack_device__")();
  if (nb::cast<int>(device[0]) != kDLCUDA) return {};
  const std::uintptr_t consumer = stream == 0 ? 1 : stream;  // DLPack: 0 is not a CUDA stream
  try {
    return obj.attr("__dlpack__")("stream"_a = nb::int_(consumer));
  } catch (const nb::python_error& e) {
    reject(where(fn, name) + ": __dlpack__(stream=" + std::to_string(consumer) +
           ") failed: " + e.what());
  }
}

// The object as an ndarray (no copy, never converted), or an Error naming the argument.
// `stream`: the stream the call's work goes on, for CUDA arrays (nullopt: DLPack's default, the
// legacy default stream).
template <class Array>
Array import_array(const char* fn, const char* name, nb::handle obj,
                   std::optional<std::uintptr_t> stream = std::nullopt) {
  Array a;
  const nb::object capsule = stream ? cuda_dlpack_capsule(fn, name, obj, *stream) : nb::object();
  if (nb::try_cast(capsule.is_valid() ? nb::handle(capsule) : obj, a, /*convert=*/false)) return a;
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

// ---- torch tensors, read directly (see the top of this file) ----

struct TorchTypes {
  PyObject* tensor = nullptr;   // torch.Tensor
  PyObject* strided = nullptr;  // torch.strided (the dense layout)
  std::vector<std::pair<PyObject*, DType>> dtypes;
};

// torch's types once torch has been imported; nullptr before (then no torch tensor can exist, and
// this never imports torch). The references are kept for the life of the process.
const TorchTypes* torch_types() {
  static TorchTypes types;
  if (types.tensor != nullptr) return &types;
  PyObject* torch = PyImport_GetModule(nb::str("torch").ptr());
  if (torch == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  nb::object module = nb::steal(torch);
  if (!nb::hasattr(module, "Tensor") || !nb::hasattr(module, "strided"))
    return nullptr;  // torch is still being imported
  const std::pair<const char*, DType> names[] = {
      {"bfloat16", DType::bf16}, {"float32", DType::f32}, {"float64", DType::f64},
      {"int32", DType::i32},     {"int64", DType::i64},   {"uint8", DType::u8},
      {"uint16", DType::bf16},  // bf16 bits, as for numpy (torch >= 2.3 has uint16)
  };
  const auto keep = [&](const char* name) { return nb::object(module.attr(name)).release().ptr(); };
  for (const auto& [name, dtype] : names)
    if (nb::hasattr(module, name)) types.dtypes.emplace_back(keep(name), dtype);
  types.strided = keep("strided");
  types.tensor = keep("Tensor");
  return &types;
}

// The view of a torch.Tensor (any subclass: nn.Parameter too), or nullopt for anything else.
std::optional<TensorView> torch_tensor_view(const char* fn, const char* name, nb::handle obj) {
  const TorchTypes* torch = torch_types();
  if (torch == nullptr) return std::nullopt;
  const int is_tensor = PyObject_IsInstance(obj.ptr(), torch->tensor);
  if (is_tensor < 0) throw nb::python_error();
  if (is_tensor == 0) return std::nullopt;
  TensorView v;
  const nb::object dtype = obj.attr("dtype");
  bool known = false;
  for (const auto& [type, d] : torch->dtypes)
    if (dtype.ptr() == type) {
      v.dtype = d;
      known = true;
    }
  if (!known)
    reject(where(fn, name) + " has dtype " + nb::str(dtype).c_str() +
           ", which epmoe does not take (torch.bfloat16, float32, float64, int32, int64, uint8; "
           "a uint16 tensor is read as bf16 bits)");
  const nb::object layout = obj.attr("layout");
  if (!layout.is(nb::handle(torch->strided)))
    reject(where(fn, name) + " has layout " + nb::str(layout).c_str() +
           "; pass a dense (torch.strided) tensor");
  const nb::object device = obj.attr("device");
  const std::string type = nb::cast<std::string>(device.attr("type"));
  if (type == "cpu") {
    v.device = Device{DeviceKind::cpu, 0};
  } else if (type == "cuda") {
    v.device = Device{DeviceKind::cuda, nb::cast<int>(device.attr("index"))};
  } else {
    reject(where(fn, name) + " is on " + type + ", which epmoe does not take (cpu or cuda)");
  }
  v.data = reinterpret_cast<void*>(nb::cast<std::uintptr_t>(obj.attr("data_ptr")()));
  v.shape = nb::cast<std::vector<std::int64_t>>(obj.attr("shape"));
  v.strides = nb::cast<std::vector<std::int64_t>>(obj.attr("stride")());
  if (v.numel() == 0) v.strides.clear();  // as for DLPack tensors: an empty tensor has no layout
  return v;
}

// A tensor argument as the library sees it, with what keeps a DLPack import referenced until the
// end of the call (nothing for a torch tensor: the caller's argument keeps it alive).
struct Imported {
  TensorView view;
  std::optional<ReadArray> read;
  std::optional<WriteArray> write;
};

// `stream`: where the call's work is queued (see import_array).
Imported import_read(const char* fn, const char* name, nb::handle obj,
                     std::optional<std::uintptr_t> stream = std::nullopt) {
  Imported t;
  if (std::optional<TensorView> v = torch_tensor_view(fn, name, obj)) {
    t.view = std::move(*v);
    return t;
  }
  t.read = import_array<ReadArray>(fn, name, obj, stream);
  t.view = tensor_view(fn, name, *t.read);
  return t;
}

Imported import_write(const char* fn, const char* name, nb::handle obj,
                      std::optional<std::uintptr_t> stream = std::nullopt) {
  Imported t;
  if (std::optional<TensorView> v = torch_tensor_view(fn, name, obj)) {
    t.view = std::move(*v);
    return t;
  }
  t.write = import_array<WriteArray>(fn, name, obj, stream);
  t.view = tensor_view(fn, name, *t.write);
  return t;
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

Fp8Blocks parse_blocks(const std::string& name, const char* what) {
  return parse_enum(name, what, {Fp8Blocks::tile_128x128, Fp8Blocks::row_1x128});
}

// ---- the codecs: inputs and outputs (allocated by python/epmoe/__init__.py) on one device ----

Stream stream_arg(std::uintptr_t stream) {
  return Stream{reinterpret_cast<void*>(stream)};
}

void quantize_mxfp8_py(nb::handle x_obj, nb::handle elements_obj, nb::handle scales_obj,
                       const std::string& rounding_name, std::uintptr_t stream) {
  constexpr const char* fn = "quantize_mxfp8";
  const ScaleRounding rounding = parse_rounding(rounding_name, "quantize_mxfp8: rounding");
  const Imported x = import_read(fn, "x", x_obj, stream);
  const Imported elements = import_write(fn, "elements", elements_obj, stream);
  const Imported scales = import_write(fn, "scales", scales_obj, stream);
  nb::gil_scoped_release release;
  quantize_mxfp8(x.view, elements.view, scales.view, rounding, stream_arg(stream));
}

void dequantize_mxfp8_py(nb::handle elements_obj, nb::handle scales_obj, nb::handle out_obj,
                         std::uintptr_t stream) {
  constexpr const char* fn = "dequantize_mxfp8";
  const Imported elements = import_read(fn, "elements", elements_obj, stream);
  const Imported scales = import_read(fn, "scales", scales_obj, stream);
  const Imported out = import_write(fn, "out", out_obj, stream);
  nb::gil_scoped_release release;
  dequantize_mxfp8(elements.view, scales.view, out.view, stream_arg(stream));
}

void quantize_nvfp4_py(nb::handle x_obj, nb::handle packed_obj, nb::handle scales_obj,
                       nb::handle tensor_scales_obj, const std::string& group_name,
                       std::optional<float> tensor_scale, std::uintptr_t stream) {
  constexpr const char* fn = "quantize_nvfp4";
  const Nvfp4ScaleGroup group = parse_group(group_name, "quantize_nvfp4: group");
  if (tensor_scale && group != Nvfp4ScaleGroup::per_tensor)
    reject(
        "quantize_nvfp4: tensor_scale is one static scale for the whole array; it needs "
        "group=per_tensor, not group=" +
        group_name);
  const Imported x = import_read(fn, "x", x_obj, stream);
  const Imported packed = import_write(fn, "packed", packed_obj, stream);
  const Imported scales = import_write(fn, "scales", scales_obj, stream);
  const Imported tensor_scales = import_write(fn, "tensor_scales", tensor_scales_obj, stream);
  nb::gil_scoped_release release;
  if (tensor_scale) {
    quantize_nvfp4_static(x.view, *tensor_scale, packed.view, scales.view, tensor_scales.view,
                          stream_arg(stream));
  } else {
    quantize_nvfp4(x.view, group, packed.view, scales.view, tensor_scales.view, stream_arg(stream));
  }
}

void dequantize_nvfp4_py(nb::handle packed_obj, nb::handle scales_obj, nb::handle tensor_scales_obj,
                         nb::handle out_obj, std::optional<std::string> group_name,
                         std::uintptr_t stream) {
  constexpr const char* fn = "dequantize_nvfp4";
  const Imported packed = import_read(fn, "packed", packed_obj, stream);
  const Imported scales = import_read(fn, "scales", scales_obj, stream);
  const Imported tensor_scales = import_read(fn, "tensor_scales", tensor_scales_obj, stream);
  const Imported out = import_write(fn, "out", out_obj, stream);
  // The group, when not given, is what tensor_scales' size says (a 0-d `packed` is rejected by
  // the library).
  Nvfp4ScaleGroup group = Nvfp4ScaleGroup::per_tensor;
  const std::vector<std::int64_t>& shape = packed.view.shape;
  if (group_name) {
    group = parse_group(*group_name, "dequantize_nvfp4: group");
  } else if (!shape.empty()) {
    std::int64_t rows = 1;
    for (std::size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
    const std::int64_t n_scales = tensor_scales.view.numel();
    if (n_scales == 1) {
      group = Nvfp4ScaleGroup::per_tensor;  // one scale: the whole array (= per_row if 1 row)
    } else if (n_scales == rows) {
      group = Nvfp4ScaleGroup::per_row;
    } else {
      reject("dequantize_nvfp4: tensor_scales has " + std::to_string(n_scales) +
             " elements, expected 1 (per_tensor) or rows=" + std::to_string(rows) + " (per_row)");
    }
  }
  nb::gil_scoped_release release;
  dequantize_nvfp4(packed.view, scales.view, tensor_scales.view, group, out.view,
                   stream_arg(stream));
}

void quantize_fp8_block128_py(nb::handle x_obj, nb::handle elements_obj, nb::handle scales_obj,
                              const std::string& blocks_name, std::uintptr_t stream) {
  constexpr const char* fn = "quantize_fp8_block128";
  const Fp8Blocks blocks = parse_blocks(blocks_name, "quantize_fp8_block128: blocks");
  const Imported x = import_read(fn, "x", x_obj, stream);
  const Imported elements = import_write(fn, "elements", elements_obj, stream);
  const Imported scales = import_write(fn, "scales", scales_obj, stream);
  nb::gil_scoped_release release;
  quantize_fp8_block128(x.view, blocks, elements.view, scales.view, stream_arg(stream));
}

void dequantize_fp8_block128_py(nb::handle elements_obj, nb::handle scales_obj, nb::handle out_obj,
                                std::optional<std::string> blocks_name, std::uintptr_t stream) {
  constexpr const char* fn = "dequantize_fp8_block128";
  const Imported elements = import_read(fn, "elements", elements_obj, stream);
  const Imported scales = import_read(fn, "scales", scales_obj, stream);
  const Imported out = import_write(fn, "out", out_obj, stream);
  // The blocks, when not given, are what scales' shape says: [..., ceil(rows/128), ceil(cols/128)]
  // tile_128x128, [..., rows, ceil(cols/128)] row_1x128 (both, when rows <= 1, decode alike).
  Fp8Blocks blocks = Fp8Blocks::row_1x128;
  const std::vector<std::int64_t>& shape = elements.view.shape;
  if (blocks_name) {
    blocks = parse_blocks(*blocks_name, "dequantize_fp8_block128: blocks");
  } else if (shape.size() >= 2 && scales.view.shape.size() == shape.size()) {
    const std::int64_t rows = shape[shape.size() - 2];
    const std::int64_t tile_rows = (rows + 127) / 128;
    if (scales.view.shape[shape.size() - 2] == tile_rows && tile_rows != rows)
      blocks = Fp8Blocks::tile_128x128;
  }
  nb::gil_scoped_release release;
  dequantize_fp8_block128(elements.view, scales.view, blocks, out.view, stream_arg(stream));
}

void quantize_mxfp4_py(nb::handle x_obj, nb::handle packed_obj, nb::handle scales_obj,
                       const std::string& rounding_name, std::uintptr_t stream) {
  constexpr const char* fn = "quantize_mxfp4";
  const ScaleRounding rounding = parse_rounding(rounding_name, "quantize_mxfp4: rounding");
  const Imported x = import_read(fn, "x", x_obj, stream);
  const Imported packed = import_write(fn, "packed", packed_obj, stream);
  const Imported scales = import_write(fn, "scales", scales_obj, stream);
  nb::gil_scoped_release release;
  quantize_mxfp4(x.view, packed.view, scales.view, rounding, stream_arg(stream));
}

void dequantize_mxfp4_py(nb::handle packed_obj, nb::handle scales_obj, nb::handle out_obj,
                         std::uintptr_t stream) {
  constexpr const char* fn = "dequantize_mxfp4";
  const Imported packed = import_read(fn, "packed", packed_obj, stream);
  const Imported scales = import_read(fn, "scales", scales_obj, stream);
  const Imported out = import_write(fn, "out", out_obj, stream);
  nb::gil_scoped_release release;
  dequantize_mxfp4(packed.view, scales.view, out.view, stream_arg(stream));
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
                           std::int64_t timeout_ms, std::optional<float> swiglu_limit,
                           const std::string& mxfp8_scale_rounding, const std::string& expert_math,
                           const std::string& activation) {
  LayerOptions options;
  options.combine = parse_combine(combine);
  options.expert_math = parse_expert_math(expert_math);
  options.activation = parse_activation(activation);
  options.deterministic = deterministic;
  options.timeout_ms = timeout_arg(timeout_ms);
  // None: the activation's default clamp (swiglu: none; swiglu_oai: gpt-oss's 7).
  options.swiglu_limit =
      swiglu_limit.value_or(options.activation == Activation::swiglu_oai ? kSwigluOaiLimit : 0.0f);
  options.mxfp8_scale_rounding = parse_rounding(mxfp8_scale_rounding, "mxfp8_scale_rounding");
  return make_config(shape, parse_precision(precision), rank, world, options);
}

// ---- communicators and layers: handles that can be closed ----

// Destroys `owned`, with the GIL released when this thread holds it: destroying a CUDA layer or an
// NCCL communicator waits for the other ranks, and in a one-process group those are threads of
// this interpreter that need the GIL to get there. (CPython's own file objects release the GIL
// while closing in their destructors too.)
template <class T>
void destroy_releasing_gil(std::unique_ptr<T>& owned) noexcept {
  if (!owned) return;
  if (PyGILState_Check()) {
    nb::gil_scoped_release release;
    owned.reset();
  } else {
    owned.reset();
  }
}

// epmoe.Communicator: owns one rank's communicator until close() or garbage collection.
struct CommHandle {
  std::unique_ptr<Communicator> comm;
  int open_layers = 0;  // layers created on it and not closed (they hold a reference to it)

  explicit CommHandle(std::unique_ptr<Communicator> c) : comm(std::move(c)) {}
  CommHandle(CommHandle&&) noexcept = default;
  CommHandle& operator=(CommHandle&&) = delete;
  ~CommHandle() { destroy_releasing_gil(comm); }

  Communicator& get(const char* fn) const {
    if (!comm)
      throw Error(ErrorCode::invalid_argument,
                  std::string(fn) + ": the communicator is closed (close() was called)");
    return *comm;
  }
  void close() {
    if (open_layers > 0)
      reject("Communicator.close(): " + std::to_string(open_layers) +
             " layer(s) created on it are still open; close them first (on every rank)");
    destroy_releasing_gil(comm);
  }
};

// epmoe.NcclCommunicator: a CommHandle whose communicator is the CUDA executor's.
struct NcclCommHandle : CommHandle {
  using CommHandle::CommHandle;
};

std::string describe_comm(const CommHandle& h) {
  if (!h.comm) return "Communicator(closed)";
  const Communicator& c = *h.comm;
  return std::string(c.backend() == Backend::cuda_nccl ? "NcclCommunicator" : "Communicator") +
         "(rank=" + std::to_string(c.rank()) + ", world=" + std::to_string(c.world()) +
         ", backend=" + to_string(c.backend()) + ", device=" + to_string(c.device()) + ")";
}

UniqueId unique_id_arg(const nb::bytes& bytes) {
  UniqueId id;
  if (bytes.size() != id.bytes.size())
    reject("NcclCommunicator: unique_id has " + std::to_string(bytes.size()) + " bytes, expected " +
           std::to_string(id.bytes.size()) + " (the bytes of epmoe.get_unique_id() on rank 0)");
  std::memcpy(id.bytes.data(), bytes.c_str(), id.bytes.size());
  return id;
}

// epmoe._Layer: owns one rank's layer until close() or garbage collection, and keeps the
// communicator it was created on alive (and open) until then.
struct LayerHandle {
  std::unique_ptr<Layer> layer;
  CommHandle* comm = nullptr;
  nb::object comm_object;
  int calls = 0;  // calls of this layer running with the GIL released (other threads)

  LayerHandle() = default;
  LayerHandle(const LayerHandle&) = delete;
  LayerHandle& operator=(const LayerHandle&) = delete;
  ~LayerHandle() { release(); }

  Layer& get(const char* fn) const {
    if (!layer)
      throw Error(ErrorCode::invalid_argument,
                  std::string(fn) + ": the layer is closed (close() was called)");
    return *layer;
  }
  void close() {
    if (calls > 0)
      reject(
          "Layer.close(): a call of this layer (forward, reset, ...) is running on another "
          "thread");
    release();
  }

 private:
  void release() noexcept {
    if (!layer) return;
    destroy_releasing_gil(layer);  // collective on the CUDA executor
    comm->open_layers -= 1;
    comm_object.reset();
  }
};

// Marks a call of `layer` as running while the GIL is released (close() refuses meanwhile).
// Constructed before the gil_scoped_release, so it ends after the GIL is taken back.
class Running {
 public:
  explicit Running(LayerHandle& h) : h_(h) { ++h_.calls; }
  ~Running() { --h_.calls; }
  Running(const Running&) = delete;
  Running& operator=(const Running&) = delete;

 private:
  LayerHandle& h_;
};

// One FC given pre-quantized: None, or the tuple (codes, scales, global_scale, s_enc) that
// epmoe.Layer builds (None for an absent tensor). `imports` keeps each DLPack import referenced
// until the layer is built.
QuantizedMatrices import_quantized(const char* fc, nb::handle obj, std::vector<Imported>& imports) {
  QuantizedMatrices q;
  if (obj.is_none()) return q;
  const auto parts = nb::cast<nb::tuple>(obj);
  TensorView* const fields[] = {&q.codes, &q.scales, &q.global_scale, &q.s_enc};
  const char* const names[] = {"codes", "scales", "global_scale", "s_enc"};
  if (parts.size() != 4)
    reject(std::string("Layer: weights.") + fc + "_quantized: expected 4 parts");
  for (std::size_t i = 0; i < 4; ++i) {
    if (parts[i].is_none()) continue;
    const std::string name = std::string("weights.") + fc + "_quantized." + names[i];
    imports.push_back(import_read("Layer", name.c_str(), parts[i]));
    *fields[i] = imports.back().view;
  }
  return q;
}

void layer_init(LayerHandle* self, nb::handle comm_object, const LayerConfig& config,
                nb::handle w13_obj, nb::handle w2_obj, nb::handle b13_obj, nb::handle b2_obj,
                nb::handle w13_quantized_obj, nb::handle w2_quantized_obj) {
  CommHandle* comm = nullptr;
  if (!nb::try_cast(comm_object, comm, false) || comm == nullptr)
    reject("Layer: comm is a " + python_type_name(comm_object) +
           ", not an epmoe.Communicator (HostGroup.communicator, NcclCommunicator, "
           "nccl_communicators, init_from_torch_distributed)");
  Communicator& c = comm->get("Layer");
  // Every tensor: None = not given (a default TensorView).
  std::vector<Imported> imports;
  imports.reserve(12);
  const auto optional = [&](const char* name, nb::handle obj) {
    if (obj.is_none()) return TensorView{};
    imports.push_back(import_read("Layer", name, obj));
    return imports.back().view;
  };
  ExpertWeights weights;
  weights.w13 = optional("weights.w13", w13_obj);
  weights.w2 = optional("weights.w2", w2_obj);
  weights.b13 = optional("weights.b13", b13_obj);
  weights.b2 = optional("weights.b2", b2_obj);
  weights.w13_quantized = import_quantized("w13", w13_quantized_obj, imports);
  weights.w2_quantized = import_quantized("w2", w2_quantized_obj, imports);
  std::unique_ptr<Layer> layer;
  comm->open_layers += 1;  // the communicator cannot be closed while the layer is being created
  try {
    nb::gil_scoped_release release;  // collective: the other ranks' threads must run meanwhile
    layer = std::make_unique<Layer>(c, config, weights);
  } catch (...) {
    comm->open_layers -= 1;
    throw;
  }
  new (self) LayerHandle();
  self->layer = std::move(layer);
  self->comm = comm;
  self->comm_object = nb::borrow(comm_object);
}

void layer_forward(LayerHandle& self, nb::handle x_obj, nb::handle ids_obj, nb::handle weights_obj,
                   nb::handle y_obj, std::uintptr_t stream) {
  constexpr const char* fn = "forward";
  Layer& layer = self.get(fn);
  // DLPack imports stay referenced (and their memory alive) until the end of this call.
  const Imported x = import_read(fn, "x", x_obj, stream);
  const Imported ids = import_read(fn, "topk_ids", ids_obj, stream);
  const Imported weights = import_read(fn, "topk_weights", weights_obj, stream);
  const Imported y = import_write(fn, "y", y_obj, stream);
  const Running running(self);
  nb::gil_scoped_release release;
  layer.forward(x.view, ids.view, weights.view, y.view, Stream{reinterpret_cast<void*>(stream)});
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
void inject_fault_py(LayerHandle& layer, const std::string& fault, std::int64_t stall_ms,
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
  testing::inject_fault(layer.get("inject_fault"), spec);
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
  // The libnccl this module was linked against at build time ("" without CUDA).
  m.attr("nccl_library") =
#if defined(EPMOE_PY_NCCL_LIBRARY)
      EPMOE_PY_NCCL_LIBRARY;
#else
      "";
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
      .def_prop_ro(
          "activation",
          [](const LayerConfig& c) { return std::string(to_string(c.options().activation)); })
      .def_prop_ro("swiglu_limit", [](const LayerConfig& c) { return c.options().swiglu_limit; })
      .def_prop_ro("mxfp8_scale_rounding",
                   [](const LayerConfig& c) {
                     return std::string(to_string(c.options().mxfp8_scale_rounding));
                   })
      .def_prop_ro(
          "expert_math",
          [](const LayerConfig& c) { return std::string(to_string(c.options().expert_math)); })
      .def("expert_owner", &LayerConfig::expert_owner, "expert"_a)
      .def("workspace_bytes", &LayerConfig::workspace_bytes,
           "Bytes of the symmetric window one rank registers for this layer.")
      .def("describe", &LayerConfig::describe,
           "One stable line with every field but rank (shape, precision, world, options, the knobs "
           "of every token bucket), compared across ranks at layer creation. block_m / block_n "
           "are marked \"(not read by expert_math=...)\" where the backend does not read them "
           "(docs/tuning.md#knobs).")
      .def("__repr__", [](const LayerConfig& c) { return "LayerConfig(" + c.describe() + ")"; });

  m.def("make_config", &make_config_py, "shape"_a, "precision"_a = "bf16", "rank"_a = 0,
        "world"_a = 1, nb::kw_only(), "combine"_a = "staged", "deterministic"_a = false,
        "timeout_ms"_a = 10'000, "swiglu_limit"_a = nb::none(), "mxfp8_scale_rounding"_a = "rceil",
        "expert_math"_a = "wgmma", "activation"_a = "swiglu",
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

  nb::class_<Health>(
      m, "Health",
      "A layer's health (docs/design.md §3 I3): who gave up waiting for whom, where, when.")
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

  nb::class_<CommHandle>(m, "Communicator",
                         "Who the ranks of an expert-parallel group are (one rank's view).")
      .def_prop_ro("rank", [](const CommHandle& h) { return h.get("Communicator.rank").rank(); })
      .def_prop_ro("world", [](const CommHandle& h) { return h.get("Communicator.world").world(); })
      .def_prop_ro("backend",
                   [](const CommHandle& h) {
                     return std::string(to_string(h.get("Communicator.backend").backend()));
                   })
      .def_prop_ro(
          "device",
          [](const CommHandle& h) { return to_string(h.get("Communicator.device").device()); },
          "Where this rank's tensors must live: 'cpu' or 'cuda:N' (a torch.device string).")
      .def_prop_ro("closed", [](const CommHandle& h) { return !h.comm; })
      .def("close", &CommHandle::close,
           "Destroys the communicator now (collective on the CUDA executor: every rank closes "
           "its own, each from its own thread or process). Its layers must be closed first. "
           "Releases the GIL; closing twice does nothing.")
      .def(
          "abort", [](CommHandle& h) { h.get("Communicator.abort").abort(); },
          "After a peer's process died: tears the communicator down without talking to its "
          "peers (ncclCommAbort on the CUDA executor; nothing on the CPU executor). Afterwards "
          "close its layers and it, and rebuild from a fresh unique id. Closing a communicator "
          "whose layer's reset() failed aborts on its own.")
      .def("__enter__", [](nb::handle self) { return nb::borrow(self); })
      .def("__exit__", [](CommHandle& h, const nb::args&) { h.close(); })
      .def("__repr__", &describe_comm);

  nb::class_<NcclCommHandle, CommHandle>(
      m, "NcclCommunicator",
      "The CUDA executor's communicator of one rank: one GPU, NCCL 2.28 symmetric windows.")
      .def(
          "__init__",
          [](NcclCommHandle* self, const nb::bytes& unique_id, int rank, int world, int device,
             std::int64_t timeout_ms) {
            const UniqueId id = unique_id_arg(unique_id);
            const std::uint32_t timeout = timeout_arg(timeout_ms);
            std::unique_ptr<Communicator> comm;
            {
              nb::gil_scoped_release release;  // waits until every rank has joined (bounded)
              comm = make_nccl_communicator(id, rank, world, device, timeout);
            }
            new (self) NcclCommHandle(std::move(comm));
          },
          "unique_id"_a, "rank"_a, "world"_a, "device"_a,
          "timeout_ms"_a = std::int64_t{kDefaultNcclTimeoutMs},
          "Collective: every rank of the group calls it with the same unique_id (the 128 bytes of "
          "get_unique_id() on rank 0) and its own rank; waits until all have joined (the GIL is "
          "released meanwhile). `device` is the CUDA device index of this rank's GPU. "
          "`timeout_ms` bounds every NCCL call of the communicator (0 = wait forever): its "
          "creation raises epmoe.Error (timeout) when a rank has not joined by then (make a fresh "
          "unique id and try again on every rank); layer window registration and close() are "
          "bounded by it too.");

  m.def(
      "get_unique_id",
      [] {
        UniqueId id;
        {
          nb::gil_scoped_release release;
          id = get_unique_id();
        }
        return nb::bytes(id.bytes.data(), id.bytes.size());
      },
      "NCCL's unique id (128 bytes): rank 0 makes it, the engine broadcasts it to every rank.");
  m.def(
      "nccl_communicators",
      [](const std::vector<int>& devices, std::int64_t timeout_ms) {
        const std::uint32_t timeout = timeout_arg(timeout_ms);
        std::vector<std::unique_ptr<Communicator>> comms;
        {
          nb::gil_scoped_release release;
          comms = make_nccl_communicators(devices, timeout);
        }
        std::vector<NcclCommHandle> out;
        out.reserve(comms.size());
        for (auto& c : comms) out.emplace_back(std::move(c));
        return out;
      },
      "devices"_a, "timeout_ms"_a = std::int64_t{kDefaultNcclTimeoutMs},
      "One process driving several GPUs: rank i on devices[i]. Each rank's Layer must then be "
      "created, driven and closed from its own thread, and each communicator closed from its own "
      "thread (epmoe.close_all does both). `timeout_ms` as for NcclCommunicator.");
  m.def("cuda_device_count", &cuda_device_count,
        "GPUs visible to this process (0 without a CUDA driver or in a build without CUDA).");

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
          [](const HostGroupHandle& g, int rank) {
            return CommHandle(make_host_communicator(g.group, rank));
          },
          "rank"_a, "This rank's communicator (use it, and the layer, from this rank's thread).");

  nb::class_<LayerHandle>(m, "_Layer", "The C++ layer; use epmoe.Layer.")
      .def("__init__", &layer_init, "comm"_a, "config"_a, "w13"_a.none(), "w2"_a.none(),
           "b13"_a.none() = nb::none(), "b2"_a.none() = nb::none(),
           "w13_quantized"_a.none() = nb::none(), "w2_quantized"_a.none() = nb::none())
      .def("_forward", &layer_forward, "x"_a, "topk_ids"_a, "topk_weights"_a, "y"_a, "stream"_a = 0)
      .def("health", [](const LayerHandle& h) { return h.get("health").health(); })
      .def(
          "reset",
          [](LayerHandle& h) {
            Layer& layer = h.get("reset");
            const Running running(h);
            nb::gil_scoped_release release;
            layer.reset();
          },
          "Collective: every rank calls it (from its own thread); rounds then restart.")
      .def("close", &LayerHandle::close,
           "Destroys the layer now. Collective on the CUDA executor (NCCL window "
           "deregistration): every rank closes its layer, each from its own thread or process. "
           "Releases the GIL; closing twice does nothing; afterwards every call raises.")
      .def_prop_ro("closed", [](const LayerHandle& h) { return !h.layer; })
      .def_prop_ro(
          "config", [](const LayerHandle& h) { return h.get("config").config(); },
          nb::rv_policy::copy)
      .def_prop_ro(
          "resident_weight_bytes",
          [](const LayerHandle& h) {
            return h.get("resident_weight_bytes").resident_weight_bytes();
          },
          "Bytes this rank holds for its prepared expert weights, scales included (decoded today: "
          "fp32 values, or bf16 codes with tensor_core math on the CUDA executor).")
      .def_prop_ro("next_round", [](LayerHandle& h) {
        Layer& layer = h.get("next_round");
        const Running running(h);
        nb::gil_scoped_release release;  // a device read: waits for this GPU's queued work
        return layer.next_round();
      });

  // The codecs write into given outputs (epmoe.quantize_mxfp8 & co. allocate them like the
  // input); on CUDA tensors they are queued on `stream` and return at once.
  m.def("quantize_mxfp8", &quantize_mxfp8_py, "x"_a, "elements"_a, "scales"_a, "rounding"_a,
        "stream"_a);
  m.def("dequantize_mxfp8", &dequantize_mxfp8_py, "elements"_a, "scales"_a, "out"_a, "stream"_a);
  m.def("quantize_nvfp4", &quantize_nvfp4_py, "x"_a, "packed"_a, "scales"_a, "tensor_scales"_a,
        "group"_a, "tensor_scale"_a.none(), "stream"_a);
  m.def("dequantize_nvfp4", &dequantize_nvfp4_py, "packed"_a, "scales"_a, "tensor_scales"_a,
        "out"_a, "group"_a.none(), "stream"_a);
  m.def("quantize_fp8_block128", &quantize_fp8_block128_py, "x"_a, "elements"_a, "scales"_a,
        "blocks"_a, "stream"_a);
  m.def("dequantize_fp8_block128", &dequantize_fp8_block128_py, "elements"_a, "scales"_a, "out"_a,
        "blocks"_a.none(), "stream"_a);
  m.def("quantize_mxfp4", &quantize_mxfp4_py, "x"_a, "packed"_a, "scales"_a, "rounding"_a,
        "stream"_a);
  m.def("dequantize_mxfp4", &dequantize_mxfp4_py, "packed"_a, "scales"_a, "out"_a, "stream"_a);

  m.def(
      "_run_command",
      [](const std::string& model, int ranks, std::int64_t tokens, std::int64_t experts,
         const std::string& precision, const std::string& combine, const std::string& executor,
         int rounds, std::uint64_t seed, std::int64_t timeout_ms, const std::string& math,
         std::int64_t check_tokens) {
        tools::RunOptions o;
        o.model = model;
        o.ranks = ranks;
        o.tokens = tokens;
        o.experts = experts;
        o.precision = precision;
        o.combine = combine;
        o.math = math;
        o.executor = executor;
        o.rounds = rounds;
        o.check_tokens = check_tokens;
        o.seed = seed;
        o.timeout_ms = timeout_arg(timeout_ms);
        nb::gil_scoped_release release;
        const int rc = tools::run_command(o);
        std::fflush(stdout);
        std::fflush(stderr);
        return rc;
      },
      "model"_a, "ranks"_a, "tokens"_a, "experts"_a, "precision"_a, "combine"_a, "executor"_a,
      "rounds"_a, "seed"_a, "timeout_ms"_a, "math"_a = "exact", "check_tokens"_a = -1,
      "`epmoe run` (tools/run.cpp): prints its report, returns the exit status.");

#if defined(EPMOE_FAULT_INJECTION)
  nb::module_ t = m.def_submodule("_testing", "Fault switches (test builds only).");
  t.def("inject_fault", &inject_fault_py, "layer"_a, "fault"_a, "stall_ms"_a = 0, "times"_a = 1,
        "Arms a fault on this rank's layer: none, skip_launch_when_idle, stall, round_jump.");
#endif
}

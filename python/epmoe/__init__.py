"""epmoe: an expert-parallel Mixture-of-Experts layer.

Every rank creates a :class:`Layer` (collectively) and calls :meth:`Layer.forward` once per step,
whatever its token count (T may be 0), with no barrier between steps. Tensors are taken without a
copy: torch tensors are read directly (data pointer, shape, strides, dtype, device: no DLPack
export, so nothing is synchronised and CUDA graph capture works), other tensors through DLPack or
the buffer protocol (numpy, cupy, jax, ...); a CUDA array is exported with
``__dlpack__(stream=S)``, S the stream the call runs on, so its producer orders S after the
array's pending work without synchronising the device. A wrong dtype, shape, device or stride is
rejected by the C++ library, before anything runs, with an :class:`Error` that names the argument.

bf16 tensors: torch.bfloat16 (DLPack kDLBfloat), numpy arrays of ``ml_dtypes.bfloat16``, or numpy
``uint16`` arrays holding bf16 bits (numpy has no bfloat16 of its own) are all read as bf16.

Backends:

* CPU executor (:class:`HostGroup`): every rank is a thread of this process.
* CUDA executor (:class:`NcclCommunicator`): one rank per GPU over NCCL. One process per GPU
  (torchrun): :func:`init_from_torch_distributed`, or rank 0's :func:`get_unique_id` broadcast by
  the engine and ``NcclCommunicator(unique_id, rank, world, device)`` on every rank. One process
  driving several GPUs: :func:`nccl_communicators`, each rank's layer created, driven and closed
  from its own thread.

Teardown is collective on the CUDA executor: every rank closes (or drops) its layers, in the same
order, then its communicator. :meth:`Layer.close` and :meth:`Communicator.close` release the GIL,
and so does the garbage collector's destruction of either; :func:`close_all` closes the ranks of a
one-process group concurrently.
"""

from __future__ import annotations

import enum
import sys
import threading
from typing import Any, Iterable, NamedTuple, Optional, Tuple, Union

from . import _epmoe as _ext
from ._epmoe import (
    Communicator,
    Error,
    Health,
    HostGroup,
    LayerConfig,
    LayerShape,
    ModelShape,
    NcclCommunicator,
    cuda_device_count,
    find_model,
    get_unique_id,
    known_models,
    nccl_communicators,
)

__version__ = "0.1.0"

__all__ = [
    "Activation",
    "Combine",
    "Communicator",
    "Error",
    "ExpertMath",
    "Fp8Blocks",
    "Health",
    "HostGroup",
    "Layer",
    "LayerConfig",
    "LayerShape",
    "ModelShape",
    "NcclCommunicator",
    "Nvfp4Group",
    "Precision",
    "QuantizedWeights",
    "ScaleRounding",
    "close_all",
    "cuda_device_count",
    "dequantize_fp8_block128",
    "dequantize_mxfp4",
    "dequantize_mxfp8",
    "dequantize_nvfp4",
    "find_model",
    "get_unique_id",
    "init_from_torch_distributed",
    "known_models",
    "make_config",
    "models",
    "nccl_communicators",
    "quantize_fp8_block128",
    "quantize_mxfp4",
    "quantize_mxfp8",
    "quantize_nvfp4",
]

#: True when the module was built with the fault switches (test builds); then ``epmoe._testing``
#: holds ``inject_fault(layer, fault, stall_ms=0, times=1)``.
fault_injection_available: bool = _ext.fault_injection_available
#: True when the module was built with the CUDA executor (nvcc and NCCL found at build time).
cuda_available: bool = _ext.cuda_available
#: The libnccl.so the module was linked against ("" without CUDA). torch and epmoe must load the
#: same one: build against torch's nvidia-nccl wheel (see README, "Using it from Python").
nccl_library: str = _ext.nccl_library

if hasattr(_ext, "_testing"):
    _testing = _ext._testing
    sys.modules[__name__ + "._testing"] = _testing


class _Named(str, enum.Enum):
    def __str__(self) -> str:
        return str(self.value)


class Precision(_Named):
    """Weights, wire and GEMM inputs. Anywhere a Precision is taken, its name works too.

    ``fp8_block128`` (DeepSeek-V3/R1): E4M3 with fp32 scales, weights in 128 x 128 tiles, activations
    in 1 x 128 runs. ``mxfp4`` (gpt-oss): MXFP4 weights, MXFP8 activations (docs/formats.md)."""

    bf16 = "bf16"
    mxfp8 = "mxfp8"
    nvfp4 = "nvfp4"
    fp8_block128 = "fp8_block128"
    mxfp4 = "mxfp4"


class Combine(_Named):
    """How expert outputs come home: ``staged`` (deterministic fp32 sum in slot order on the home
    rank) or ``in_kernel_reduce`` (weighted adds into the home rank's accumulator)."""

    staged = "staged"
    in_kernel_reduce = "in_kernel_reduce"


class ExpertMath(_Named):
    """How the expert GEMMs sum: ``wgmma`` (the default: Hopper's TMA + WGMMA grouped GEMMs, bf16
    operands with fp32 accumulation or E4M3 GEMMs with the block scales, agreeing with the
    emulating reference to accumulation-order noise, docs/tuning.md gives the rule), ``tensor_core``
    (bf16 ``mma.sync`` tensor cores with fp32 accumulation; no fp8_block128) or ``exact`` (float64
    sums of exact products: bit-exact against the emulating reference with staged combine, and runs
    every layer). The CPU executor always computes exactly."""

    exact = "exact"
    tensor_core = "tensor_core"
    wgmma = "wgmma"


class Activation(_Named):
    """The expert activation between FC1 (+ b13) and FC2: ``swiglu`` is ``silu(gate) * up``
    (``swiglu_limit`` > 0 clamps gate <= limit and |up| <= limit first; default no clamp);
    ``swiglu_oai`` is gpt-oss's ``(clamp(up, -l, l) + 1) * g * sigmoid(1.702 g)`` with
    ``g = min(gate, l)``, ``l = swiglu_limit`` (default 7, must be > 0)."""

    swiglu = "swiglu"
    swiglu_oai = "swiglu_oai"


class ScaleRounding(_Named):
    """MXFP8 / MXFP4 E8M0 scale rule: ``rceil`` (no element saturates) or ``ocp_floor`` (OCP MX
    v1.0)."""

    rceil = "rceil"
    ocp_floor = "ocp_floor"


class Nvfp4Group(_Named):
    """The group one NVFP4 fp32 scale covers: the whole array, or each row."""

    per_tensor = "per_tensor"
    per_row = "per_row"


class Fp8Blocks(_Named):
    """What one fp8_block128 scale covers: a 128 x 128 tile of a weight matrix, or 128 values of
    an activation row."""

    tile_128x128 = "tile_128x128"
    row_1x128 = "row_1x128"


NameOr = Union[str, enum.Enum]


def _name(value: NameOr) -> str:
    return str(value.value) if isinstance(value, enum.Enum) else value


def make_config(
    shape: LayerShape,
    precision: NameOr = "bf16",
    rank: int = 0,
    world: int = 1,
    *,
    combine: NameOr = "staged",
    deterministic: bool = False,
    timeout_ms: int = 10_000,
    swiglu_limit: Optional[float] = None,
    mxfp8_scale_rounding: NameOr = "rceil",
    expert_math: NameOr = "wgmma",
    activation: NameOr = "swiglu",
) -> LayerConfig:
    """A validated :class:`LayerConfig`; raises :class:`Error` naming the field, value and rule.

    ``timeout_ms`` bounds every cross-rank wait (0 = wait forever); ``activation`` is an
    :class:`Activation` (``"swiglu_oai"`` for gpt-oss); ``swiglu_limit`` is its clamp, None for the
    activation's default (``swiglu``: 0 = no clamp; ``swiglu_oai``: 7, and it must be > 0);
    ``deterministic`` requires ``combine="staged"``; ``expert_math`` is an :class:`ExpertMath`
    (the default ``"wgmma"`` is the fastest on the CUDA executor; ``"exact"`` is bit-exact against
    the emulating reference and runs every layer).
    """
    return _ext.make_config(
        shape,
        _name(precision),
        rank,
        world,
        combine=_name(combine),
        deterministic=deterministic,
        timeout_ms=timeout_ms,
        swiglu_limit=swiglu_limit,
        mxfp8_scale_rounding=_name(mxfp8_scale_rounding),
        expert_math=_name(expert_math),
        activation=_name(activation),
    )


# ---- tensors ----


def _is_numpy(a: Any) -> bool:
    return type(a).__module__ == "numpy" and type(a).__name__ == "ndarray"


def _tensor(a: Any) -> Any:
    """The object to hand to C++: numpy arrays of ml_dtypes.bfloat16 cannot leave through DLPack,
    so they go as a uint16 view of the same memory (read as bf16 bits); all else as is."""
    if _is_numpy(a) and a.dtype.name == "bfloat16":
        return a.view("uint16")
    return a


class QuantizedWeights(NamedTuple):
    """One FC's experts already in the layer's precision, as a checkpoint ships them: pass it (or a
    plain tuple ``(codes, scales)`` / ``(codes, scales, global_scale)``) as ``w13`` or ``w2`` of
    :class:`Layer` and the layer decodes it as it is, with no re-quantization (docs/formats.md,
    "Pre-quantized expert weights"). [E, N, K] is [E_local, 2I, H] for w13 (gate rows, then up
    rows) and [E_local, H, I] for w2:

    ==============  ================================  =====================================
    precision       codes (uint8)                     scales
    ==============  ================================  =====================================
    mxfp8           E4M3 [E, N, K]                    E8M0 uint8 [E, N, K/32]
    nvfp4           E2M1 pairs [E, N, K/2]            E4M3 uint8 [E, N, K/16]
    fp8_block128    E4M3 [E, N, K]                    float32 [E, ceil(N/128), ceil(K/128)]
    mxfp4           E2M1 pairs [E, N, K/2] or         E8M0 uint8 [E, N, K/32]
                    [E, N, K/32, 16] (gpt-oss)
    ==============  ================================  =====================================

    E2M1 pairs hold element 2j in the low nibble. torch ``float8_e4m3fn`` / ``float8_e8m0fnu``
    tensors (and ml_dtypes arrays of them) are taken as their uint8 codes. NVFP4 also takes one
    float32 scale per matrix [E], exactly one of ``global_scale`` (ModelOpt's ``weight_scale_2``:
    value = e2m1 * scale * global_scale) and ``s_enc`` (epmoe's encode scale, as
    :func:`quantize_nvfp4` returns it: value = e2m1 * scale / s_enc).
    """

    codes: Any
    scales: Any
    global_scale: Any = None
    s_enc: Any = None


_FLOAT8_CODES = ("float8_e4m3fn", "float8_e8m0fnu")


def _codes_tensor(a: Any) -> Any:
    """Float8 codes (torch or ml_dtypes) as a uint8 view of the same memory; all else as is."""
    if a is None:
        return None
    name = str(getattr(a, "dtype", "")).replace("torch.", "")
    if name in _FLOAT8_CODES:
        if type(a).__module__.split(".")[0] == "torch":
            import torch

            return a.view(torch.uint8)
        return a.view("uint8")
    return _tensor(a)


def _weights_arg(w: Any) -> Tuple[Any, Any]:
    """``w13`` / ``w2`` of Layer as (values, quantized): a tensor of values, or a
    QuantizedWeights (a plain 2- or 3-tuple is one) as the 4-tuple the extension takes."""
    if isinstance(w, tuple):
        q = w if isinstance(w, QuantizedWeights) else QuantizedWeights(*w)
        return None, tuple(_codes_tensor(t) for t in q)
    return _tensor(w), None


def _new_output(x: Any, hidden: int) -> Any:
    """An uninitialised [T, H] output of x's kind: same framework, device and (bf16) dtype."""
    rows = x.shape[0] if len(getattr(x, "shape", ())) > 0 else 0
    module = type(x).__module__.split(".")[0]
    if module == "torch":
        import torch

        return torch.empty((rows, hidden), dtype=torch.bfloat16, device=x.device)
    if module == "numpy":
        import numpy as np

        dtype = x.dtype if x.dtype.name in ("bfloat16", "uint16") else np.uint16
        return np.empty((rows, hidden), dtype=dtype)
    if hasattr(x, "__array_namespace__"):
        xp = x.__array_namespace__()
        return xp.empty((rows, hidden), dtype=x.dtype, device=x.device)
    # Not a tensor we know: the library rejects x (naming it) before looking at this.
    import numpy as np

    return np.empty((0, hidden), dtype=np.uint16)


def _default_stream(x: Any) -> int:
    """The stream a forward on x runs on when none is given: torch's current stream of x's device
    for a torch CUDA tensor, cupy's current stream for a cupy array, else 0 (the legacy default
    stream; ignored by the CPU executor)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else 0
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        return int(cupy.cuda.get_current_stream().ptr)
    return 0


def _stream_handle(stream: Any, x: Any, fn: str = "forward") -> int:
    """cudaStream_t as an integer: None (x's framework's current stream), an int, a torch/cupy
    stream, or any object with the CUDA stream protocol (``__cuda_stream__``)."""
    if stream is None:
        return _default_stream(x)
    if isinstance(stream, int):
        return stream
    if hasattr(stream, "__cuda_stream__"):
        return int(stream.__cuda_stream__()[1])
    for attr in ("cuda_stream", "ptr", "handle"):  # torch.cuda.Stream, cupy Stream, others
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    raise TypeError(f"{fn}: stream must be None, an int or a CUDA stream, not {type(stream)}")


# ---- communicators ----


def init_from_torch_distributed(device: Any = None, group: Any = None,
                                timeout_ms: int = 60_000) -> NcclCommunicator:
    """This process's rank of the CUDA executor, bootstrapped through torch.distributed.

    Collective over ``group`` (default: the world group), which must be initialised
    (``torch.distributed.init_process_group``, any backend). Rank 0 of the group makes the NCCL
    unique id, ``broadcast_object_list`` hands it to every rank, and every rank joins as its rank
    and world size in the group. ``device``: this rank's GPU (an index, ``"cuda:N"`` or a
    ``torch.device``); default ``torch.cuda.current_device()`` (so call
    ``torch.cuda.set_device(local_rank)`` first, as torchrun scripts do). ``timeout_ms`` bounds
    every NCCL call of the communicator, its creation included (0 = wait forever; see
    :class:`NcclCommunicator`).
    """
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("init_from_torch_distributed: torch.distributed is not initialised; "
                           "call torch.distributed.init_process_group() first")
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    if device is None:
        index = torch.cuda.current_device()
    elif isinstance(device, int):
        index = device
    else:
        d = torch.device(device)
        if d.type != "cuda":
            raise ValueError(f"init_from_torch_distributed: device={device!r} is not a CUDA device")
        index = d.index if d.index is not None else torch.cuda.current_device()
    box = [get_unique_id() if rank == 0 else None]
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(box, src=src, group=group)
    return NcclCommunicator(box[0], rank, world, index, timeout_ms=timeout_ms)


def close_all(objects: Iterable[Any]) -> None:
    """Closes the layers (or the communicators) of a one-process group, one thread each, all at
    once: their teardown is collective, so closing them one after the other from one thread would
    wait on ranks not yet closed. Raises the first error once all are done."""
    objects = list(objects)
    errors: list = [None] * len(objects)

    def close(i: int) -> None:
        try:
            objects[i].close()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors[i] = e

    threads = [threading.Thread(target=close, args=(i,)) for i in range(len(objects))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e


# ---- the layer ----


class Layer(_ext._Layer):
    """One rank's expert-parallel MoE layer.

    ``Layer(comm, shape, precision, w13, w2, b13=None, b2=None, *, combine=..., deterministic=...,
    timeout_ms=..., swiglu_limit=..., mxfp8_scale_rounding=..., expert_math=..., activation=...)``
    is collective: every rank of ``comm`` creates its
    layer with the same shape and options (a mismatch is reported on every rank), each from its
    own thread on the CPU executor. ``w13`` [E_local, 2I, H] (gate rows, then up rows) and ``w2``
    [E_local, H, I] are this rank's experts (expert e lives on rank e // E_local), bf16 or f32, on
    the host or on the communicator's device; either may instead be a :class:`QuantizedWeights`
    (or a tuple ``(codes, scales[, global_scale])``): codes and scales already in ``precision``,
    as a checkpoint ships them, decoded as they are. The optional biases ``b13`` [E_local, 2I] (gate
    biases, then up biases) and ``b2`` [E_local, H] (gpt-oss), bf16 or f32, are added in fp32 to
    FC1's output before the activation and to FC2's output, never quantized; they count in
    :attr:`resident_weight_bytes`. The layer quantizes the weights to ``precision`` and keeps
    its own copy, whose size in bytes is :attr:`resident_weight_bytes`: the CUDA executor holds
    the precision's own codes and scales under every ``expert_math`` (MXFP8 1 + 1/32 bytes per
    weight, NVFP4 0.5 + 1/16, MXFP4 0.5 + 1/32, bf16 2, fp8_block128 1 plus an fp32 per
    128 x 128 tile); the CPU executor fp32 values and one scale per matrix.

    Teardown: :meth:`close` (or ``with epmoe.Layer(...) as layer:``, or dropping the last
    reference) destroys the layer. On the CUDA executor that is collective (NCCL window
    deregistration): every rank closes its layers, in the same order, before closing its
    communicator; the GIL is released meanwhile. After close every call raises :class:`Error`.
    """

    def __init__(
        self,
        comm: Communicator,
        shape: LayerShape,
        precision: NameOr,
        w13: Any,
        w2: Any,
        b13: Any = None,
        b2: Any = None,
        *,
        combine: NameOr = "staged",
        deterministic: bool = False,
        timeout_ms: int = 10_000,
        swiglu_limit: Optional[float] = None,
        mxfp8_scale_rounding: NameOr = "rceil",
        expert_math: NameOr = "wgmma",
        activation: NameOr = "swiglu",
    ) -> None:
        config = make_config(
            shape,
            precision,
            comm.rank,
            comm.world,
            combine=combine,
            deterministic=deterministic,
            timeout_ms=timeout_ms,
            swiglu_limit=swiglu_limit,
            mxfp8_scale_rounding=mxfp8_scale_rounding,
            expert_math=expert_math,
            activation=activation,
        )
        self._init(comm, config, w13, w2, b13, b2)

    @classmethod
    def from_config(
        cls, comm: Communicator, config: LayerConfig, w13: Any, w2: Any, b13: Any = None, b2: Any = None
    ) -> "Layer":
        """A layer from a config made with :func:`make_config` (collective, as the constructor)."""
        self = cls.__new__(cls)
        self._init(comm, config, w13, w2, b13, b2)
        return self

    def _init(
        self, comm: Communicator, config: LayerConfig, w13: Any, w2: Any, b13: Any, b2: Any
    ) -> None:
        w13_values, w13_quantized = _weights_arg(w13)
        w2_values, w2_quantized = _weights_arg(w2)
        _ext._Layer.__init__(
            self,
            comm,
            config,
            w13_values,
            w2_values,
            None if b13 is None else _tensor(b13),
            None if b2 is None else _tensor(b2),
            w13_quantized,
            w2_quantized,
        )
        self._hidden = config.shape.hidden

    def forward(
        self,
        x: Any,
        topk_ids: Any,
        topk_weights: Any,
        out: Any = None,
        stream: Any = None,
    ) -> Any:
        """One round: x [T, H] bf16, topk_ids [T, K] int32|int64 (-1 = no expert), topk_weights
        [T, K] float32; writes and returns ``out`` [T, H] bf16 (allocated like x when None; the C++
        library calls it ``y`` in its messages). Every rank calls it every step, T == 0 included.

        ``stream`` (CUDA executor): a CUDA stream handle (int), a torch/cupy stream, or None for
        the current stream of x's framework (``torch.cuda.current_stream(x.device)`` for torch
        tensors, so it is graph-capturable under ``torch.cuda.graph``); the work is queued on it
        and forward returns without waiting. Tensors must stay alive until that work is done
        (torch's caching allocator does this when they belong to the same stream). Ignored by the
        CPU executor, whose forward returns when the round is done.

        Bad arguments raise :class:`Error` (code ``invalid_argument``) before anything runs; a
        cross-rank failure raises ``timeout``, ``peer_aborted`` or ``protocol_violation`` (on the
        CUDA executor: seen by :meth:`health` once the stream has run, and raised by the next
        forward) and the layer refuses work (``layer_unhealthy``) until every rank calls
        :meth:`reset`.
        """
        if out is None:
            out = _new_output(x, self._hidden)
        self._forward(
            _tensor(x),
            _tensor(topk_ids),
            _tensor(topk_weights),
            _tensor(out),
            _stream_handle(stream, x),
        )
        return out

    def __enter__(self) -> "Layer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    __call__ = forward


# ---- formats: host arrays, or torch / cupy tensors on their own device ----
#
# Each codec takes its input where it lives and returns its outputs there: numpy (and any other
# host array) in, numpy out; a torch tensor in, torch tensors out on the same device; a cupy array
# in, cupy arrays out. On a GPU the work is queued on ``stream`` (default: the current stream of the
# input's framework) and the call returns at once; the bytes are those of the host codec. ``out=``
# takes preallocated outputs instead (any writable DLPack arrays on the input's device).


def _reject(message: str) -> Error:
    error = Error(message)
    error.code = "invalid_argument"
    return error


def _kind(a: Any) -> str:
    """'torch', 'cupy', 'cuda' (another CUDA array: DLPack device kDLCUDA) or 'host'."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(a, torch.Tensor):
        return "torch"
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(a, cupy.ndarray):
        return "cupy"
    if hasattr(a, "__dlpack_device__") and not _is_numpy(a):
        try:
            if int(a.__dlpack_device__()[0]) == 2:  # kDLCUDA
                return "cuda"
        except Exception:  # noqa: BLE001 - not a device we know: the library names it
            pass
    return "host"


def _codec_input(x: Any, kind: str) -> Any:
    """x as contiguous float32 of its own framework (a no-op when it already is)."""
    if kind == "torch":
        import torch

        return x.to(torch.float32).contiguous()
    if kind == "cupy":
        import cupy

        return cupy.ascontiguousarray(x, dtype=cupy.float32)
    if kind == "host":
        return _host_f32(x)
    return x  # another CUDA array: it must already be contiguous float32 (the library checks)


def _shape(a: Any) -> Tuple[int, ...]:
    return tuple(int(d) for d in getattr(a, "shape", ()))


def _with_last(shape: Tuple[int, ...], last: int) -> Tuple[int, ...]:
    return shape[:-1] + (last,) if shape else shape


def _rows(shape: Tuple[int, ...]) -> int:
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows


def _empty(fn: str, like: Any, kind: str, shape: Tuple[int, ...], dtype: str) -> Any:
    """An uninitialised output of like's framework and device (dtype: "uint8" or "float32")."""
    if kind == "torch":
        import torch

        return torch.empty(shape, dtype=getattr(torch, dtype), device=like.device)
    if kind == "cupy":
        import cupy

        with like.device:
            return cupy.empty(shape, dtype=dtype)
    if kind == "cuda":
        raise _reject(f"{fn}: the input is a {type(like).__module__}.{type(like).__name__} on "
                      "CUDA; the codecs allocate their outputs with torch or cupy: pass a "
                      "torch.Tensor or cupy.ndarray (e.g. torch.from_dlpack(x)), or out=")
    import numpy as np

    return np.empty(shape, dtype=dtype)


def _outputs(fn: str, out: Any, names: Tuple[str, ...]) -> Tuple[Any, ...]:
    outputs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    if len(outputs) != len(names):
        raise _reject(f"{fn}: out must be ({', '.join(names)}), got {len(outputs)} array(s)")
    return outputs


def _host_f32(x: Any) -> Any:
    if isinstance(x, (list, tuple, float, int)):
        import numpy as np

        return np.ascontiguousarray(x, dtype=np.float32)
    if _is_numpy(x):
        import numpy as np

        if x.dtype == np.uint16:  # bf16 bits
            x = (np.ascontiguousarray(x).astype(np.uint32) << 16).view(np.float32)
        return np.ascontiguousarray(x, dtype=np.float32)
    return x


def quantize_mxfp8(
    x: Any, rounding: NameOr = "rceil", *, out: Any = None, stream: Any = None
) -> Tuple[Any, Any]:
    """MXFP8 of x [..., cols] along its last dimension (cols a multiple of 32):
    ``(elements uint8 [..., cols] E4M3 codes, scales uint8 [..., cols/32] E8M0 codes)``.

    x is converted to contiguous float32 of its framework first (bf16 bits in a numpy uint16 array
    too). Outputs live where x does (see "formats" above); ``out=(elements, scales)`` writes into
    given arrays. ``stream``: for CUDA inputs, as in :meth:`Layer.forward`."""
    fn = "quantize_mxfp8"
    kind = _kind(x)
    x = _codec_input(x, kind)
    shape = _shape(x)
    if out is None:
        cols = shape[-1] if shape else 0
        out = (_empty(fn, x, kind, shape, "uint8"),
               _empty(fn, x, kind, _with_last(shape, cols // 32), "uint8"))
    elements, scales = _outputs(fn, out, ("elements", "scales"))
    _ext.quantize_mxfp8(x, elements, scales, _name(rounding), _stream_handle(stream, x, fn))
    return elements, scales


def dequantize_mxfp8(elements: Any, scales: Any, *, out: Any = None, stream: Any = None) -> Any:
    """float32 [..., cols]: e4m3(elements) * 2^(scale - 127) (NaN for the 0xFF scale), where
    elements lives; ``out=`` writes into a given array."""
    fn = "dequantize_mxfp8"
    if out is None:
        out = _empty(fn, elements, _kind(elements), _shape(elements), "float32")
    (out,) = _outputs(fn, out, ("out",))
    _ext.dequantize_mxfp8(elements, scales, out, _stream_handle(stream, elements, fn))
    return out


def quantize_nvfp4(
    x: Any,
    group: NameOr = "per_tensor",
    tensor_scale: Optional[float] = None,
    *,
    out: Any = None,
    stream: Any = None,
) -> Tuple[Any, Any, Any]:
    """NVFP4 of x [..., cols] along its last dimension (cols a multiple of 16):
    ``(packed uint8 [..., cols/2], scales uint8 [..., cols/16] E4M3 codes, tensor_scales float32)``.

    ``group="per_tensor"``: one encode scale s_enc = 448*6/amax for the whole array (weights: pass
    one expert's matrix); ``"per_row"``: one per row (activations), tensor_scales has one per row.
    ``tensor_scale``: a static s_enc (per_tensor only). A value decodes as
    e2m1 * block_scale / s_enc. Element c of a row is in byte c//2, low nibble when c is even.
    Codes are CUDA's conversion (``__nv_cvt_float2_to_fp4x2``) bit for bit, signed zero included:
    a negative value that rounds to zero is code 0x8 (-0). Outputs live where x does; ``out=(packed, scales, tensor_scales)`` writes into given arrays.
    """
    fn = "quantize_nvfp4"
    kind = _kind(x)
    x = _codec_input(x, kind)
    shape = _shape(x)
    if out is None:
        cols = shape[-1] if shape else 0
        n_scales = _rows(shape) if _name(group) == "per_row" else 1
        out = (_empty(fn, x, kind, _with_last(shape, cols // 2), "uint8"),
               _empty(fn, x, kind, _with_last(shape, cols // 16), "uint8"),
               _empty(fn, x, kind, (n_scales,), "float32"))
    packed, scales, tensor_scales = _outputs(fn, out, ("packed", "scales", "tensor_scales"))
    _ext.quantize_nvfp4(x, packed, scales, tensor_scales, _name(group), tensor_scale,
                        _stream_handle(stream, x, fn))
    return packed, scales, tensor_scales


def dequantize_nvfp4(
    packed: Any,
    scales: Any,
    tensor_scales: Any,
    group: Optional[NameOr] = None,
    *,
    out: Any = None,
    stream: Any = None,
) -> Any:
    """float32 [..., cols], where packed lives. ``group`` defaults to what tensor_scales' size
    says (1 value: per_tensor, one per row: per_row); ``out=`` writes into a given array."""
    fn = "dequantize_nvfp4"
    if out is None:
        shape = _shape(packed)
        out = _empty(fn, packed, _kind(packed), _with_last(shape, 2 * shape[-1] if shape else 0),
                     "float32")
    (out,) = _outputs(fn, out, ("out",))
    _ext.dequantize_nvfp4(packed, scales, tensor_scales, out,
                          None if group is None else _name(group),
                          _stream_handle(stream, packed, fn))
    return out


def _ceil128(n: int) -> int:
    return (n + 127) // 128


def quantize_fp8_block128(
    x: Any, blocks: NameOr = "tile_128x128", *, out: Any = None, stream: Any = None
) -> Tuple[Any, Any]:
    """FP8 with 128-blocks (DeepSeek-V3/R1 checkpoints): ``(elements uint8 E4M3 codes, same shape
    as x; scales float32)``, value = e4m3(element) * scale.

    ``blocks="tile_128x128"`` (weights): x is [..., rows, cols], each matrix tiled on its own;
    scales [..., ceil(rows/128), ceil(cols/128)] (a checkpoint's ``weight_scale_inv``).
    ``"row_1x128"`` (activations): x is [..., cols]; scales [..., ceil(cols/128)]. scale =
    amax(block) / 448, element = e4m3(x / scale); blocks at the edges cover what is there (any
    rows and cols). A block holding NaN or ±Inf gets a NaN scale; an all-zero block scale 0.
    Outputs live where x does; ``out=(elements, scales)`` writes into given arrays."""
    fn = "quantize_fp8_block128"
    kind = _kind(x)
    x = _codec_input(x, kind)
    shape = _shape(x)
    if out is None:
        scale_shape = _with_last(shape, _ceil128(shape[-1]) if shape else 0)
        if _name(blocks) == "tile_128x128" and len(shape) >= 2:
            scale_shape = scale_shape[:-2] + (_ceil128(shape[-2]),) + scale_shape[-1:]
        out = (_empty(fn, x, kind, shape, "uint8"), _empty(fn, x, kind, scale_shape, "float32"))
    elements, scales = _outputs(fn, out, ("elements", "scales"))
    _ext.quantize_fp8_block128(x, elements, scales, _name(blocks), _stream_handle(stream, x, fn))
    return elements, scales


def dequantize_fp8_block128(
    elements: Any,
    scales: Any,
    blocks: Optional[NameOr] = None,
    *,
    out: Any = None,
    stream: Any = None,
) -> Any:
    """float32, elements' shape: e4m3(elements) * scales[block] (NaN where either is NaN), where
    elements lives. ``blocks`` defaults to what scales' shape says (see
    :func:`quantize_fp8_block128`); ``out=`` writes into a given array."""
    fn = "dequantize_fp8_block128"
    if out is None:
        out = _empty(fn, elements, _kind(elements), _shape(elements), "float32")
    (out,) = _outputs(fn, out, ("out",))
    _ext.dequantize_fp8_block128(elements, scales, out,
                                 None if blocks is None else _name(blocks),
                                 _stream_handle(stream, elements, fn))
    return out


def quantize_mxfp4(
    x: Any, rounding: NameOr = "rceil", *, out: Any = None, stream: Any = None
) -> Tuple[Any, Any]:
    """MXFP4 (OCP MX; gpt-oss checkpoints) of x [..., cols] along its last dimension (cols a
    multiple of 32): ``(packed uint8 [..., cols/2] E2M1 pairs, scales uint8 [..., cols/32] E8M0
    codes)``. Element c of a row is in byte c//2, low nibble when c is even: gpt-oss's
    ``*_blocks`` [..., cols/32, 16] viewed as [..., cols/2], and its ``*_scales``.

    ``rounding="rceil"``: scale 2^ceil(log2(amax / 6)), no element saturates; ``"ocp_floor"``:
    2^(floor(log2 amax) - 2), the OCP rule, elements saturate at ±6. Outputs live where x does;
    ``out=(packed, scales)`` writes into given arrays."""
    fn = "quantize_mxfp4"
    kind = _kind(x)
    x = _codec_input(x, kind)
    shape = _shape(x)
    if out is None:
        cols = shape[-1] if shape else 0
        out = (_empty(fn, x, kind, _with_last(shape, cols // 2), "uint8"),
               _empty(fn, x, kind, _with_last(shape, cols // 32), "uint8"))
    packed, scales = _outputs(fn, out, ("packed", "scales"))
    _ext.quantize_mxfp4(x, packed, scales, _name(rounding), _stream_handle(stream, x, fn))
    return packed, scales


def dequantize_mxfp4(packed: Any, scales: Any, *, out: Any = None, stream: Any = None) -> Any:
    """float32 [..., cols]: e2m1(packed) * 2^(scale - 127) (NaN for the 0xFF scale), where packed
    lives; ``out=`` writes into a given array."""
    fn = "dequantize_mxfp4"
    if out is None:
        shape = _shape(packed)
        out = _empty(fn, packed, _kind(packed), _with_last(shape, 2 * shape[-1] if shape else 0),
                     "float32")
    (out,) = _outputs(fn, out, ("out",))
    _ext.dequantize_mxfp4(packed, scales, out, _stream_handle(stream, packed, fn))
    return out


# Hugging Face MoE blocks (Qwen3-MoE, Mixtral, DeepSeek-V3) on epmoe; imports torch only when used.
from . import models  # noqa: E402

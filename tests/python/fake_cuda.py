"""A stand-in for a CUDA array on machines without a GPU: a DLPack producer (as cupy and jax are)
whose ``__dlpack_device__`` says kDLCUDA and whose ``__dlpack__`` records the ``stream`` its
consumer asked for. Its data pointer is made up: it is for tests of what epmoe checks and asks
before anything touches memory (argument checks, the consumer stream, "no GPU" errors), never to
be run on a real GPU.
"""

from __future__ import annotations

import ctypes
from typing import List, Optional, Sequence

KDL_CUDA = 2
_DTYPES = {"float32": (2, 32), "uint8": (1, 8), "int32": (0, 32), "uint16": (1, 16)}


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", _DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),  # none: this object owns the memory of the description
    ]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class FakeCudaArray:
    """shape, dtype name, device index; strides in elements (None: contiguous)."""

    def __init__(self, shape: Sequence[int], dtype: str = "float32", device: int = 0,
                 strides: Optional[Sequence[int]] = None, data: int = 0x7F0000000000) -> None:
        self.shape = tuple(shape)
        self.dtype = dtype
        self.device = device
        if strides is None:
            strides, step = [], 1
            for d in reversed(self.shape):
                strides.insert(0, step)
                step *= d
        self.strides = tuple(strides)
        self.data = data
        self.streams: List[object] = []  # the stream= of every __dlpack__ call
        self._keep: list = []

    def __dlpack_device__(self):
        return (KDL_CUDA, self.device)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.streams.append(stream)
        ndim = len(self.shape)
        shape = (ctypes.c_int64 * max(ndim, 1))(*self.shape)
        strides = (ctypes.c_int64 * max(ndim, 1))(*self.strides)
        code, bits = _DTYPES[self.dtype]
        mt = _DLManagedTensor()
        mt.dl_tensor = _DLTensor(self.data, _DLDevice(KDL_CUDA, self.device), ndim,
                                 _DLDataType(code, bits, 1), shape, strides, 0)
        self._keep += [shape, strides, mt]
        return _capsule_new(ctypes.addressof(mt), b"dltensor", None)

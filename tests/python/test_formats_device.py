"""The codecs' device path without a GPU: where the outputs go, what is checked before anything
touches device memory, the consumer stream handed to a CUDA array's __dlpack__, and the error of a
process (or a build) that cannot run CUDA. tests/python/gpu/test_gpu_codecs.py runs the kernels.
"""

from __future__ import annotations

import numpy as np
import pytest

import epmoe
from epmoe_ref import make_layers, make_problem
from fake_cuda import FakeCudaArray as Cuda

no_gpu = pytest.mark.skipif(
    epmoe.cuda_device_count() > 0,
    reason="its fake CUDA arrays would reach a real GPU (the GPU suite covers this machine)")


def mxfp8_out(rows=4, cols=64, device=0):
    return Cuda((rows, cols), "uint8", device), Cuda((rows, cols // 32), "uint8", device)


def nvfp4_out(rows=4, cols=64, n_scales=1):
    return (Cuda((rows, cols // 2), "uint8"), Cuda((rows, cols // 16), "uint8"),
            Cuda((n_scales,), "float32"))


def raises(code, message, call):
    with pytest.raises(epmoe.Error) as info:
        call()
    assert info.value.code == code, str(info.value)
    assert message in str(info.value)
    return info.value


# ---- bad arguments are named before any CUDA call (safe on any machine) ----


@pytest.mark.parametrize("call,message", [
    (lambda: epmoe.quantize_mxfp8(Cuda((4, 64), "uint8"), out=mxfp8_out()),
     "quantize_mxfp8: x has dtype u8, expected f32"),
    (lambda: epmoe.quantize_mxfp8(Cuda((4, 40)), out=mxfp8_out(4, 40)),
     "quantize_mxfp8: cols=40 must be a multiple of 32"),
    (lambda: epmoe.quantize_mxfp8(Cuda((4, 64), strides=(128, 1)), out=mxfp8_out()),
     "quantize_mxfp8: x is not contiguous (strides [128, 1])"),
    (lambda: epmoe.quantize_mxfp8(Cuda(()), out=mxfp8_out()),
     "quantize_mxfp8: x is 0-d; expected shape [..., cols]"),
    (lambda: epmoe.quantize_mxfp8(Cuda((4, 64)), out=(Cuda((4, 32), "uint8"), mxfp8_out()[1])),
     "quantize_mxfp8: elements has shape [4, 32], expected [4, 64]"),
    (lambda: epmoe.quantize_mxfp8(Cuda((4, 64)), out=(mxfp8_out()[0], Cuda((4, 2), "float32"))),
     "quantize_mxfp8: scales has dtype f32, expected u8"),
    (lambda: epmoe.quantize_mxfp8(Cuda((4, 64)), out=(mxfp8_out()[0], np.zeros((4, 2), np.uint8))),
     "quantize_mxfp8: scales is on cpu, expected cuda:0 (where x is)"),
    (lambda: epmoe.quantize_mxfp8(Cuda((4, 64)), out=mxfp8_out(device=1)),
     "quantize_mxfp8: elements is on cuda:1, expected cuda:0 (where x is)"),
    (lambda: epmoe.quantize_mxfp8(Cuda((4, 64)), out=mxfp8_out()[:1]),
     "quantize_mxfp8: out must be (elements, scales), got 1 array(s)"),
    (lambda: epmoe.quantize_mxfp8(Cuda((4, 64))),
     "quantize_mxfp8: the input is a fake_cuda.FakeCudaArray on CUDA; the codecs allocate their "
     "outputs with torch or cupy"),
    (lambda: epmoe.dequantize_mxfp8(Cuda((4, 64), "uint8"), Cuda((4, 3), "uint8"),
                                    out=Cuda((4, 64))),
     "dequantize_mxfp8: scales has shape [4, 3], expected [4, 2]"),
    (lambda: epmoe.dequantize_mxfp8(*mxfp8_out(), out=Cuda((4, 64), "uint8")),
     "dequantize_mxfp8: out has dtype u8, expected f32"),
    (lambda: epmoe.quantize_nvfp4(Cuda((4, 64)), "per_row", out=nvfp4_out(n_scales=1)),
     "quantize_nvfp4: tensor_scales has 1 elements, expected 4 for group=per_row"),
    (lambda: epmoe.quantize_nvfp4(Cuda((4, 64)), tensor_scale=float("inf"), out=nvfp4_out()),
     "quantize_nvfp4_static: tensor_scale=inf must be finite and > 0"),
    (lambda: epmoe.quantize_nvfp4(Cuda((4, 64)), out=nvfp4_out()[:2] + (np.ones(1, np.float32),)),
     "quantize_nvfp4: tensor_scales is on cpu, expected cuda:0 (where x is)"),
    (lambda: epmoe.dequantize_nvfp4(*nvfp4_out(n_scales=3), out=Cuda((4, 64))),
     "dequantize_nvfp4: tensor_scales has 3 elements, expected 1 (per_tensor) or rows=4 "
     "(per_row)"),
    (lambda: epmoe.dequantize_nvfp4(*nvfp4_out(), out=Cuda((4, 32))),
     "dequantize_nvfp4: out has shape [4, 32], expected [4, 64]"),
    (lambda: epmoe.quantize_fp8_block128(Cuda((4, 200)), out=(Cuda((4, 200), "uint8"),
                                                              Cuda((4, 2), "uint8"))),
     "quantize_fp8_block128: scales has dtype u8, expected f32"),
    (lambda: epmoe.quantize_fp8_block128(Cuda((2, 300, 200)), out=(Cuda((2, 300, 200), "uint8"),
                                                                   Cuda((2, 300, 2)))),
     "quantize_fp8_block128: scales has shape [2, 300, 2], expected [2, 3, 2]"),
    (lambda: epmoe.dequantize_fp8_block128(Cuda((4, 200), "uint8"), np.zeros((4, 2), np.float32),
                                           out=Cuda((4, 200))),
     "dequantize_fp8_block128: scales is on cpu, expected cuda:0 (where elements is)"),
    (lambda: epmoe.quantize_mxfp4(Cuda((4, 64)), out=(Cuda((4, 64), "uint8"),
                                                      Cuda((4, 2), "uint8"))),
     "quantize_mxfp4: packed has shape [4, 64], expected [4, 32]"),
    (lambda: epmoe.dequantize_mxfp4(Cuda((4, 32), "uint8"), Cuda((4, 2), "uint8"),
                                    out=Cuda((4, 64), device=1)),
     "dequantize_mxfp4: out is on cuda:1, expected cuda:0 (where packed is)"),
])
def test_device_arguments_are_checked_and_named(call, message):
    raises("invalid_argument", message, call)


# ---- the consumer stream (README: "CUDA arrays other than torch") ----


@no_gpu
def test_cuda_arrays_are_exported_for_the_stream_the_work_runs_on():
    x = Cuda((4, 64))
    elements, scales = mxfp8_out()
    for stream, expected in ((None, 1), (0, 1), (1234, 1234)):  # 0 / None: legacy default = 1
        with pytest.raises(epmoe.Error):  # no GPU: fails after the imports
            epmoe.quantize_mxfp8(x, out=(elements, scales), stream=stream)
        assert x.streams[-1] == expected and elements.streams[-1] == expected
        assert scales.streams[-1] == expected


def test_forward_exports_cuda_arrays_for_its_stream():
    shape = epmoe.LayerShape(hidden=64, intermediate=64, num_experts=4, top_k=2,
                             max_tokens_per_rank=8)
    layer = make_layers(make_problem(shape, 1, seed=3))[0]
    x = Cuda((3, 64), "uint16")
    ids, weights = np.zeros((3, 2), np.int32), np.full((3, 2), 0.5, np.float32)
    out = np.zeros((3, 64), np.uint16)
    with pytest.raises(epmoe.Error, match="forward: x is on cuda:0, expected cpu"):
        layer.forward(x, ids, weights, out=out, stream=4321)
    assert x.streams == [4321]
    layer.close()


# ---- a process without a GPU, a build without CUDA ----


@no_gpu
@pytest.mark.parametrize("call", [
    lambda: epmoe.quantize_mxfp8(Cuda((4, 64)), out=mxfp8_out()),
    lambda: epmoe.dequantize_mxfp8(*mxfp8_out(), out=Cuda((4, 64))),
    lambda: epmoe.quantize_nvfp4(Cuda((4, 64)), "per_row", out=nvfp4_out(n_scales=4)),
    lambda: epmoe.quantize_nvfp4(Cuda((4, 64)), tensor_scale=2.0, out=nvfp4_out()),
    lambda: epmoe.dequantize_nvfp4(*nvfp4_out(), out=Cuda((4, 64))),
    lambda: epmoe.quantize_fp8_block128(Cuda((4, 64)), out=(Cuda((4, 64), "uint8"),
                                                            Cuda((1, 1)))),
    lambda: epmoe.dequantize_fp8_block128(Cuda((4, 64), "uint8"), Cuda((4, 1)), "row_1x128",
                                          out=Cuda((4, 64))),
    lambda: epmoe.quantize_mxfp4(Cuda((4, 64)), out=(Cuda((4, 32), "uint8"),
                                                     Cuda((4, 2), "uint8"))),
    lambda: epmoe.dequantize_mxfp4(Cuda((4, 32), "uint8"), Cuda((4, 2), "uint8"),
                                   out=Cuda((4, 64))),
])
def test_no_gpu_is_reported_not_crashed(call):
    if epmoe.cuda_available:
        message = "is on cuda:0, but this process has no usable CUDA device"
    else:
        message = "is on cuda:0, but epmoe was built without CUDA"
    raises("unsupported", message, call)


@no_gpu
def test_a_device_this_process_does_not_have_is_named():
    if not epmoe.cuda_available:
        pytest.skip("a build without CUDA says so first")
    # Without a driver every device is missing; the message names the argument and the device.
    raises("unsupported", "quantize_mxfp8: x is on cuda:3",
           lambda: epmoe.quantize_mxfp8(Cuda((4, 64), device=3), out=mxfp8_out(device=3)))


# ---- host arrays: unchanged, now also into given outputs ----


def test_host_out_arrays_are_written_and_returned():
    x = np.random.default_rng(5).standard_normal((3, 64)).astype(np.float32)
    ref = epmoe.quantize_mxfp8(x)
    out = (np.zeros((3, 64), np.uint8), np.zeros((3, 2), np.uint8))
    got = epmoe.quantize_mxfp8(x, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(a, b)
    y = np.zeros((3, 64), np.float32)
    assert epmoe.dequantize_mxfp8(*ref, out=y) is y
    np.testing.assert_array_equal(y, epmoe.dequantize_mxfp8(*ref))
    p, s, t = epmoe.quantize_nvfp4(x, "per_row")
    out = (np.zeros_like(p), np.zeros_like(s), np.zeros_like(t))
    for a, b in zip(epmoe.quantize_nvfp4(x, "per_row", out=out), (p, s, t)):
        np.testing.assert_array_equal(a, b)
    z = np.zeros((3, 64), np.float32)
    np.testing.assert_array_equal(epmoe.dequantize_nvfp4(p, s, t, out=z),
                                  epmoe.dequantize_nvfp4(p, s, t))
    raises("invalid_argument", "quantize_mxfp8: elements has dtype f32, expected u8",
           lambda: epmoe.quantize_mxfp8(x, out=(np.zeros((3, 64), np.float32), out[1])))
    raises("invalid_argument", "quantize_mxfp8: elements is on cuda:0, expected cpu (where x is)",
           lambda: epmoe.quantize_mxfp8(x, out=mxfp8_out(3, 64)))


def test_host_stream_is_ignored():
    x = np.ones((1, 32), np.float32)
    for a, b in zip(epmoe.quantize_mxfp8(x, stream=1234), epmoe.quantize_mxfp8(x)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(TypeError, match="quantize_mxfp8: stream must be None, an int or a CUDA"):
        epmoe.quantize_mxfp8(x, stream="s")


def test_torch_cpu_tensors_give_torch_tensors():
    torch = pytest.importorskip("torch")
    x = torch.randn(4, 64)
    elements, scales = epmoe.quantize_mxfp8(x)
    assert isinstance(elements, torch.Tensor) and elements.dtype == torch.uint8
    ref = epmoe.quantize_mxfp8(x.numpy())
    np.testing.assert_array_equal(elements.numpy(), ref[0])
    np.testing.assert_array_equal(scales.numpy(), ref[1])
    np.testing.assert_array_equal(epmoe.dequantize_mxfp8(elements, scales).numpy(),
                                  epmoe.dequantize_mxfp8(*ref))

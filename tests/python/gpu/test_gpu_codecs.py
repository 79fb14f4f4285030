"""The format codecs on the GPU (epmoe.quantize_mxfp8, _nvfp4, _fp8_block128, _mxfp4 and their
decoders, given CUDA tensors) against the host codec, bit for bit:

    pytest tests/python/gpu/test_gpu_codecs.py      (run_torchrun.sh runs it in its first pass)

Random values and edge values (NaN, ±Inf, ±0, fp32 subnormals, FLT_MAX, all-equal blocks, random
bit patterns), every rounding and scale group, on torch's current stream, on a stream of its own,
inside a torch.cuda.graph capture (replayed on new inputs), on a device other than the current
one, and with cupy arrays when cupy is installed. No collective: it runs once, in the
one-process pass (torchrun's ranks skip it).
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import epmoe  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not epmoe.cuda_available, reason="epmoe built without CUDA"),
    pytest.mark.skipif("WORLD_SIZE" in os.environ,
                       reason="no collective: run once, by the one-process pass (plain pytest)"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]

FLT_MAX = np.finfo(np.float32).max


@contextlib.contextmanager
def no_host_sync():
    """A torch operation in the codecs' Python path that synchronises with the GPU raises."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def dev(index=0):
    return torch.device("cuda", index)


def edge_matrix(cols=128, seed=0):
    """Rows of special blocks, then random rows of every magnitude, then random bit patterns."""
    rng = np.random.default_rng(seed)
    rows = []

    def row(values):
        r = np.resize(np.asarray(values, np.float32), cols)
        rows.append(r)

    row([0.0])
    row([-0.0])
    row([1.0])  # all-equal blocks
    row([-3.0e38])
    row([FLT_MAX, -FLT_MAX, 1.0, -1.0])
    row([1e-45, -1e-45, 1e-40, 2.0**-126, 2.0**-127, 0.0])  # fp32 subnormals
    row([448.0, 449.0, 464.0, 480.0, 2.0**-9, 2.0**-10, 3 * 2.0**-11, 6.0, 5.0, 0.25, 0.75])
    row([1e30, -1e-10, 1e-10, -0.0, 0.0, -3e-12, -0.1])  # NVFP4 zero block scales, signed zeros
    r = rng.standard_normal(cols).astype(np.float32)
    r[5] = np.nan
    rows.append(r)
    r = rng.standard_normal(cols).astype(np.float32)
    r[3], r[cols - 2] = np.inf, -np.inf
    rows.append(r)
    r = np.full(cols, np.nan, np.float32)
    rows.append(r)
    for _ in range(24):
        exps = rng.integers(-150, 128, cols)
        magnitudes = np.exp2(exps.astype(np.float64))
        with np.errstate(over="ignore"):  # the largest become ±Inf: edge values too
            rows.append((rng.standard_normal(cols) * magnitudes).astype(np.float32))
    rows.append(rng.integers(0, 2**32, cols, dtype=np.uint64).astype(np.uint32).view(np.float32))
    for _ in range(8):
        r = rng.standard_normal(cols).astype(np.float32) * np.float32(rng.uniform(1e-3, 1e3))
        rows.append(r)
    return np.stack(rows)


def same_bits(got, want, what):
    got = got.cpu().numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
    want = np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if want.dtype == np.float32:
        got, want = got.view(np.uint32), want.view(np.uint32)
    bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
    assert bad.size == 0, (f"{what}: {bad.size} of {want.size} differ, first at flat index "
                           f"{bad[0]}: device {got.reshape(-1)[bad[0]]:#x}, host "
                           f"{want.reshape(-1)[bad[0]]:#x}")


def host(x):
    return x.detach().float().cpu().numpy()


def all_codecs(x):
    """Every codec on x (a torch CUDA float32 tensor): a dict of name -> device outputs."""
    out = {}
    with no_host_sync():
        for rounding in ("rceil", "ocp_floor"):
            e, s = epmoe.quantize_mxfp8(x, rounding)
            out[f"mxfp8_{rounding}"] = (e, s, epmoe.dequantize_mxfp8(e, s))
        for group in ("per_tensor", "per_row"):
            p, s, t = epmoe.quantize_nvfp4(x, group)
            out[f"nvfp4_{group}"] = (p, s, t, epmoe.dequantize_nvfp4(p, s, t))
        p, s, t = epmoe.quantize_nvfp4(x, tensor_scale=1234.5)
        out["nvfp4_static"] = (p, s, t, epmoe.dequantize_nvfp4(p, s, t))
        for blocks in ("tile_128x128", "row_1x128"):
            e, s = epmoe.quantize_fp8_block128(x, blocks)
            out[f"fp8_block128_{blocks}"] = (e, s, epmoe.dequantize_fp8_block128(e, s, blocks))
        for rounding in ("rceil", "ocp_floor"):
            p, s = epmoe.quantize_mxfp4(x, rounding)
            out[f"mxfp4_{rounding}"] = (p, s, epmoe.dequantize_mxfp4(p, s))
    return out


def check_all(outputs, x_host, what=""):
    for rounding in ("rceil", "ocp_floor"):
        e, s = epmoe.quantize_mxfp8(x_host, rounding)
        want = (e, s, epmoe.dequantize_mxfp8(e, s))
        for i, (g, w) in enumerate(zip(outputs[f"mxfp8_{rounding}"], want)):
            same_bits(g, w, f"{what} mxfp8 {rounding} output {i}")
    static = {"tensor_scale": 1234.5}
    for group, kwargs in (("per_tensor", {}), ("per_row", {}), ("static", static)):
        name = f"nvfp4_{group}"
        p, s, t = epmoe.quantize_nvfp4(x_host, "per_row" if group == "per_row" else "per_tensor",
                                       **kwargs)
        want = (p, s, t, epmoe.dequantize_nvfp4(p, s, t))
        for i, (g, w) in enumerate(zip(outputs[name], want)):
            same_bits(g, w, f"{what} {name} output {i}")
    for blocks in ("tile_128x128", "row_1x128"):
        e, s = epmoe.quantize_fp8_block128(x_host, blocks)
        want = (e, s, epmoe.dequantize_fp8_block128(e, s, blocks))
        for i, (g, w) in enumerate(zip(outputs[f"fp8_block128_{blocks}"], want)):
            same_bits(g, w, f"{what} fp8_block128 {blocks} output {i}")
    for rounding in ("rceil", "ocp_floor"):
        p, s = epmoe.quantize_mxfp4(x_host, rounding)
        want = (p, s, epmoe.dequantize_mxfp4(p, s))
        for i, (g, w) in enumerate(zip(outputs[f"mxfp4_{rounding}"], want)):
            same_bits(g, w, f"{what} mxfp4 {rounding} output {i}")


# ---- bit-exact against the host codec ----


@pytest.mark.parametrize("shape", [(40, 128), (2, 3, 64), (0, 64), (5000, 32), (3, 8192)])
def test_random_values_bit_exact(shape):
    x_host = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32) * 7
    x = torch.from_numpy(x_host).to(dev())
    outputs = all_codecs(x)
    for values in outputs.values():
        assert all(isinstance(v, torch.Tensor) and v.device == x.device for v in values)
    torch.cuda.synchronize()
    check_all(outputs, x_host, str(shape))


def test_edge_values_bit_exact():
    x_host = edge_matrix()
    outputs = all_codecs(torch.from_numpy(x_host).to(dev()))
    torch.cuda.synchronize()
    check_all(outputs, x_host, "edge values")


def nvfp4_codes(packed):
    """[..., cols/2] packed bytes -> [..., cols] E2M1 codes (element 2i in the low nibble)."""
    return np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def test_nvfp4_zero_block_scales_keep_each_elements_sign():
    """A block whose scale rounds to zero encodes each element as the zero of its sign (-0 is
    0x8), as CUDA's conversion of the element scaled by 0 gives (docs/formats.md); it decodes to
    that signed zero. Checked on the device's own bytes, not only against the host's."""
    x_host = np.zeros((2, 32), np.float32)
    x_host[0, 1:16:2] = -0.0  # row 0: an all-zero block with -0.0s, then a block of ones
    x_host[0, 16:] = 1.0
    x_host[1, 16] = 1e30  # row 1: block 0 underflows next to a huge value
    x_host[1, :16] = np.linspace(-1e-10, 1e-10, 16, dtype=np.float32)
    want = np.where(np.signbit(x_host[:, :16]), 0x8, 0x0)
    x = torch.from_numpy(x_host).to(dev())  # the upload syncs; the codec calls below must not
    for group in ("per_tensor", "per_row"):
        with no_host_sync():
            p, s, t = epmoe.quantize_nvfp4(x, group)
            y = epmoe.dequantize_nvfp4(p, s, t)
        torch.cuda.synchronize()
        assert (host(s)[:, 0] == 0).all(), group
        np.testing.assert_array_equal(nvfp4_codes(p.cpu().numpy())[:, :16], want)
        y = host(y)[:, :16]
        assert (y == 0).all(), group
        np.testing.assert_array_equal(np.signbit(y), np.signbit(x_host[:, :16]))


def test_fp8_block128_partial_tiles_and_stacked_experts_bit_exact():
    """gpt-oss-like shapes (2880 is not a multiple of 128; 200 rows leave a 72-row last tile),
    3 experts stacked, each tiled on its own; more tiles than one launch's CTAs."""
    for shape in ((3, 200, 2880), (1, 9000, 640)):
        x_host = np.random.default_rng(shape[1]).standard_normal(shape).astype(np.float32)
        x_host[1 % shape[0]] *= 1e4
        x = torch.from_numpy(x_host).to(dev())
        with no_host_sync():
            got = {b: epmoe.quantize_fp8_block128(x, b) for b in ("tile_128x128", "row_1x128")}
            dec = {b: epmoe.dequantize_fp8_block128(*got[b]) for b in got}
        torch.cuda.synchronize()
        for b, (e, s) in got.items():
            want = epmoe.quantize_fp8_block128(x_host, b)
            same_bits(e, want[0], f"{shape} {b} elements")
            same_bits(s, want[1], f"{shape} {b} scales")
            same_bits(dec[b], epmoe.dequantize_fp8_block128(*want), f"{shape} {b} decode")


def test_fp8_block128_and_mxfp4_decoders_on_every_code():
    """Checkpoint bytes as they come: every E4M3 code with scales of any sign and magnitude (NaN,
    Inf, 0 and subnormals included), every E2M1 pair with every E8M0 code."""
    rng = np.random.default_rng(5)
    codes = rng.integers(0, 256, (300, 256), dtype=np.uint8)
    codes[0] = np.arange(256, dtype=np.uint8)
    scales = rng.standard_normal((3, 2)).astype(np.float32)
    scales[0] = [np.nan, np.inf]
    scales[1] = [0.0, 1e-42]
    got = epmoe.dequantize_fp8_block128(torch.from_numpy(codes).to(dev()),
                                        torch.from_numpy(scales).to(dev()), "tile_128x128")
    packed = rng.integers(0, 256, (256, 128), dtype=np.uint8)
    packed[:, 0] = np.arange(256, dtype=np.uint8)
    e8m0 = np.resize(np.arange(256, dtype=np.uint8), (256, 8))
    got4 = epmoe.dequantize_mxfp4(torch.from_numpy(packed).to(dev()),
                                  torch.from_numpy(e8m0).to(dev()))
    torch.cuda.synchronize()
    same_bits(got, epmoe.dequantize_fp8_block128(codes, scales, "tile_128x128"),
              "fp8_block128 decode")
    same_bits(got4, epmoe.dequantize_mxfp4(packed, e8m0), "mxfp4 decode")


def test_grid_stride_loops_bit_exact():
    """More format blocks than one launch's threads (the grid is capped)."""
    x_host = np.random.default_rng(9).standard_normal((4200, 8192)).astype(np.float32)
    x = torch.from_numpy(x_host).to(dev())
    e, s = epmoe.quantize_mxfp8(x)
    p, ps, t = epmoe.quantize_nvfp4(x, "per_row")
    torch.cuda.synchronize()
    for g, w in zip((e, s), epmoe.quantize_mxfp8(x_host)):
        same_bits(g, w, "mxfp8 large")
    for g, w in zip((p, ps, t), epmoe.quantize_nvfp4(x_host, "per_row")):
        same_bits(g, w, "nvfp4 per_row large")


def test_decoders_on_every_code():
    rng = np.random.default_rng(4)
    elements = rng.integers(0, 256, (64, 256), dtype=np.uint8)
    elements[0, :] = np.arange(256, dtype=np.uint8)
    scales = rng.integers(0, 256, (64, 8), dtype=np.uint8)
    scales[1, :] = [0, 1, 126, 127, 128, 254, 255, 0]
    got = epmoe.dequantize_mxfp8(torch.from_numpy(elements).to(dev()),
                                 torch.from_numpy(scales).to(dev()))
    packed = np.ascontiguousarray(elements[:, :128])
    nv_scales = rng.integers(0, 256, (64, 16), dtype=np.uint8)  # includes E4M3 NaN codes
    for n in (1, 64):
        tensor_scales = rng.uniform(1e-3, 1e4, n).astype(np.float32)
        nv = epmoe.dequantize_nvfp4(torch.from_numpy(packed).to(dev()),
                                    torch.from_numpy(nv_scales).to(dev()),
                                    torch.from_numpy(tensor_scales).to(dev()))
        torch.cuda.synchronize()
        same_bits(nv, epmoe.dequantize_nvfp4(packed, nv_scales, tensor_scales),
                  f"nvfp4 decode, {n} tensor scale(s)")
    same_bits(got, epmoe.dequantize_mxfp8(elements, scales), "mxfp8 decode")


def test_bf16_and_strided_torch_inputs_are_converted():
    x = torch.randn(16, 256, device=dev()) * 5
    for variant in (x.to(torch.bfloat16), x.t().contiguous().t(), x.double()):
        e, s = epmoe.quantize_mxfp8(variant)
        torch.cuda.synchronize()
        for g, w in zip((e, s), epmoe.quantize_mxfp8(host(variant))):
            same_bits(g, w, f"mxfp8 of {variant.dtype}")


# ---- streams, graphs, devices ----


def test_work_goes_on_the_current_or_given_stream():
    """A stream busy with a sleep, then a copy into x: the codec sees the new x only if it is
    queued behind them on that same stream."""
    d = dev()
    old = torch.zeros(64, 256, device=d)
    new_host = np.random.default_rng(1).standard_normal((64, 256)).astype(np.float32)
    new = torch.from_numpy(new_host).to(d)
    want = epmoe.quantize_mxfp8(new_host)
    for how in ("current", "torch stream", "int handle"):
        x = old.clone()
        s = torch.cuda.Stream(d)
        s.wait_stream(torch.cuda.current_stream(d))
        with torch.cuda.stream(s):
            torch.cuda._sleep(20_000_000)
            x.copy_(new)
            if how == "current":
                with no_host_sync():
                    e, sc = epmoe.quantize_mxfp8(x)
        with no_host_sync():
            if how == "torch stream":
                e, sc = epmoe.quantize_mxfp8(x, stream=s)
            elif how == "int handle":
                e, sc = epmoe.quantize_mxfp8(x, stream=s.cuda_stream)
        s.synchronize()
        torch.cuda.synchronize(d)
        for g, w in zip((e, sc), want):
            same_bits(g, w, f"mxfp8 on the {how}")


def test_capture_and_replay_in_a_cuda_graph():
    d = dev()
    rows = edge_matrix(256).shape[0]
    x = torch.zeros(rows, 256, device=d)
    side = torch.cuda.Stream(d)
    side.wait_stream(torch.cuda.current_stream(d))
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch recommends
        all_codecs(x)
    torch.cuda.current_stream(d).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = all_codecs(x)
    for seed in range(3):
        x_host = edge_matrix(256, seed) if seed == 0 else (
            np.random.default_rng(seed).standard_normal((rows, 256)).astype(np.float32) * seed)
        x.copy_(torch.from_numpy(x_host).to(d))
        graph.replay()
        torch.cuda.synchronize(d)
        check_all(outputs, x_host, f"graph replay {seed}")


def test_a_device_other_than_the_current_one():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    torch.cuda.set_device(0)
    x_host = np.random.default_rng(2).standard_normal((8, 64)).astype(np.float32)
    x = torch.from_numpy(x_host).to(dev(1))
    outputs = all_codecs(x)  # on torch's current stream of cuda:1; cuda:0 stays current
    assert torch.cuda.current_device() == 0
    torch.cuda.synchronize(1)
    check_all(outputs, x_host, "cuda:1")


def test_wrong_device_outputs_are_named():
    x = torch.zeros(4, 64, device=dev())
    with pytest.raises(epmoe.Error, match=r"quantize_mxfp8: scales is on cpu, expected cuda:0"):
        epmoe.quantize_mxfp8(x, out=(torch.empty(4, 64, dtype=torch.uint8, device=dev()),
                                     torch.empty(4, 2, dtype=torch.uint8)))


# ---- cupy ----


def test_cupy_arrays_give_cupy_arrays_on_cupys_stream():
    cupy = pytest.importorskip("cupy")
    x_host = edge_matrix(64, 3)
    with cupy.cuda.Device(0):
        x = cupy.asarray(x_host)
        cupy.cuda.Stream.null.synchronize()
        with cupy.cuda.Stream(non_blocking=True) as s:
            e, sc = epmoe.quantize_mxfp8(x)
            p, ps, t = epmoe.quantize_nvfp4(x, "per_row")
            y = epmoe.dequantize_nvfp4(p, ps, t)
        s.synchronize()
    assert all(isinstance(a, cupy.ndarray) for a in (e, sc, p, ps, t, y))
    for g, w in zip((e, sc), epmoe.quantize_mxfp8(x_host)):
        same_bits(cupy.asnumpy(g), w, "cupy mxfp8")
    want = epmoe.quantize_nvfp4(x_host, "per_row")
    for g, w in zip((p, ps, t), want):
        same_bits(cupy.asnumpy(g), w, "cupy nvfp4")
    same_bits(cupy.asnumpy(y), epmoe.dequantize_nvfp4(*want), "cupy nvfp4 decode")

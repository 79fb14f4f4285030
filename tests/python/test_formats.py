"""epmoe.quantize_* / dequantize_* on host arrays (docs/formats.md): MXFP8, NVFP4, fp8_block128,
MXFP4."""

from __future__ import annotations

import numpy as np
import pytest

import epmoe
from epmoe_ref import f32_to_bf16_bits

E4M3_MAX = 448.0


def random(shape, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# ---- MXFP8 ----


def test_mxfp8_worked_example_of_the_docs():
    block = np.ones((1, 32), np.float32)
    block[0, 0] = 500.0
    e, s = epmoe.quantize_mxfp8(block, "ocp_floor")
    assert (s[0, 0], e[0, 0], e[0, 1]) == (127, 0x7E, 0x38)
    assert epmoe.dequantize_mxfp8(e, s)[0, 0] == 448.0
    e, s = epmoe.quantize_mxfp8(block)  # rceil by default
    assert (s[0, 0], e[0, 0], e[0, 1]) == (128, 0x78, 0x30)
    out = epmoe.dequantize_mxfp8(e, s)
    assert out[0, 0] == 512.0 and (out[0, 1:] == 1.0).all()


@pytest.mark.parametrize("rounding", ["rceil", epmoe.ScaleRounding.ocp_floor])
def test_mxfp8_round_trip_error_and_idempotence(rounding):
    x = random((3, 5, 256), seed=1, scale=3.0)
    elements, scales = epmoe.quantize_mxfp8(x, rounding)
    assert elements.shape == (3, 5, 256) and elements.dtype == np.uint8
    assert scales.shape == (3, 5, 8) and scales.dtype == np.uint8
    y = epmoe.dequantize_mxfp8(elements, scales)
    assert y.shape == x.shape and y.dtype == np.float32
    # E4M3 keeps 3 mantissa bits: error <= 2^-4 of each block's largest value; ocp_floor also
    # saturates (amax up to 512 * scale is clipped to 448 * scale): <= 2^-3.
    amax = np.abs(x).reshape(3, 5, 8, 32).max(axis=-1, keepdims=True)
    err = np.abs(y - x).reshape(3, 5, 8, 32)
    bound = 2.0**-4 if rounding == "rceil" else 2.0**-3
    assert (err <= amax * bound).all()
    assert (err > 0).any()
    # Decoded values are representable: they survive another round trip unchanged.
    np.testing.assert_array_equal(epmoe.dequantize_mxfp8(*epmoe.quantize_mxfp8(y, rounding)), y)


def test_mxfp8_special_blocks():
    x = np.zeros((2, 64), np.float32)
    x[1, 40] = np.nan
    x[1, 0:32] = 1.0
    e, s = epmoe.quantize_mxfp8(x)
    assert s[0, 0] == 0 and (e[0] == 0).all()  # all-zero block: scale 2^-127, elements 0
    assert s[1, 1] == 0xFF  # NaN in a block: NaN scale
    y = epmoe.dequantize_mxfp8(e, s)
    assert np.isnan(y[1, 32:]).all() and (y[1, :32] == 1.0).all() and (y[0] == 0).all()


def test_mxfp8_inputs_are_converted_from_numpy_kinds():
    x = random((4, 64), seed=2)
    ref = epmoe.quantize_mxfp8(x)
    for variant in (x.astype(np.float64), np.asfortranarray(x), x.tolist(),
                    x.astype(np.float32)[:, :]):
        for a, b in zip(epmoe.quantize_mxfp8(variant), ref):
            np.testing.assert_array_equal(a, b)
    bits = f32_to_bf16_bits(x)  # uint16 = bf16 bits
    ml_dtypes = pytest.importorskip("ml_dtypes")
    via_bits = epmoe.quantize_mxfp8(bits)
    via_ml = epmoe.quantize_mxfp8((bits.astype(np.uint32) << 16).view(np.float32)
                                  .astype(ml_dtypes.bfloat16))
    for a, b in zip(via_bits, via_ml):
        np.testing.assert_array_equal(a, b)


# ---- NVFP4 ----


def test_nvfp4_worked_example_of_the_docs():
    block = np.array([3, -3, 1, 0.75, 0.1, 0.3, 2, -1.7, 0, 0.5, 2.9, -0.2, 1.2, 1.3, 0.6, 0.4],
                     np.float32)
    x = np.concatenate([block, np.zeros(16, np.float32)])
    x[16] = 6.0  # group amax 6 -> s_enc = 448
    packed, scales, s_enc = epmoe.quantize_nvfp4(x[None, :])
    assert s_enc.shape == (1,) and s_enc[0] == 448.0
    assert scales[0, 0] == 0x76
    assert list(packed[0, :4]) == [0xF7, 0x34, 0x10, 0xD6]
    decoded = epmoe.dequantize_nvfp4(packed, scales, s_enc)[0, :16]
    np.testing.assert_array_equal(
        decoded, np.array([3, -3, 1, 0.75, 0, 0.25, 2, -1.5, 0, 0.5, 3, -0.25, 1, 1.5, 0.5, 0.5],
                          np.float32))


@pytest.mark.parametrize("group", ["per_tensor", "per_row"])
def test_nvfp4_round_trip_error(group):
    x = random((6, 128), seed=3, scale=2.0)
    x[2] *= 100  # rows of very different magnitude
    packed, scales, s_enc = epmoe.quantize_nvfp4(x, group)
    assert packed.shape == (6, 64) and scales.shape == (6, 8)
    assert s_enc.shape == ((1,) if group == "per_tensor" else (6,)) and s_enc.dtype == np.float32
    y = epmoe.dequantize_nvfp4(packed, scales, s_enc)  # group inferred from s_enc's size
    np.testing.assert_array_equal(y, epmoe.dequantize_nvfp4(packed, scales, s_enc, group))
    # docs/formats.md: |error| <= max(0.25, |q|/4) * block_scale / s_enc; bounded here by the
    # block amax / 6 * (1 + 2^-3) slack of the E4M3 block scale.
    blocks = np.abs(x).reshape(6, 8, 16).max(axis=-1, keepdims=True)
    err = np.abs(y - x).reshape(6, 8, 16)
    if group == "per_row":
        assert (err <= blocks / 6 * 1.125 * 2 + 1e-6).all()
    rel = np.linalg.norm(y - x) / np.linalg.norm(x)
    assert rel < 0.15


def nvfp4_codes(packed):
    """[..., cols/2] packed bytes -> [..., cols] E2M1 codes (element 2i in the low nibble)."""
    return np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def test_nvfp4_zero_block_scale_keeps_each_elements_sign():
    """A block whose scale rounds to zero (all zeros, or tiny next to the group's amax) encodes
    each element as the zero of its sign, -0.0 included (code 0x8), as CUDA's conversion does;
    decoding gives back that signed zero."""
    x = np.zeros((2, 32), np.float32)
    x[0, 16:] = 1.0  # row 0: one all-zero block (with -0.0s) next to a block of ones
    x[0, 1:16:2] = -0.0
    x[1, 16] = 1e30  # row 1 under one per-tensor scale: block 0 underflows
    x[1, :16] = np.linspace(-1e-10, 1e-10, 16, dtype=np.float32)
    for group in ("per_tensor", "per_row"):
        packed, scales, s_enc = epmoe.quantize_nvfp4(x, group)
        assert scales[0, 0] == 0 and scales[1, 0] == 0, group
        codes = nvfp4_codes(packed)[:, :16]
        np.testing.assert_array_equal(codes, np.where(np.signbit(x[:, :16]), 0x8, 0x0))
        y = epmoe.dequantize_nvfp4(packed, scales, s_enc)[:, :16]
        assert (y == 0).all()
        np.testing.assert_array_equal(np.signbit(y), np.signbit(x[:, :16]))


def test_nvfp4_static_tensor_scale_and_row_scales():
    x = random((4, 32), seed=4)
    packed, scales, s_enc = epmoe.quantize_nvfp4(x, "per_tensor", tensor_scale=100.0)
    assert s_enc.tolist() == [100.0]
    rows = epmoe.quantize_nvfp4(x, epmoe.Nvfp4Group.per_row)[2]
    amax = np.abs(x).max(axis=1)
    np.testing.assert_allclose(rows, 448 * 6 / amax, rtol=1e-6)
    with pytest.raises(epmoe.Error, match="tensor_scale=-1.000000 must be finite and > 0"):
        epmoe.quantize_nvfp4(x, tensor_scale=-1.0)
    with pytest.raises(epmoe.Error, match="needs group=per_tensor"):
        epmoe.quantize_nvfp4(x, "per_row", tensor_scale=2.0)


# ---- fp8_block128 (DeepSeek-V3/R1) ----


def test_fp8_block128_worked_example_of_the_docs():
    x = np.zeros((1, 128), np.float32)
    x[0, :8] = [10.0, 1.0, -2.5, 0.05, 0.001, -0.0001, -0.0, 7.0]
    elements, scales = epmoe.quantize_fp8_block128(x, "row_1x128")
    assert scales.shape == (1, 1) and scales.dtype == np.float32
    assert scales.view(np.uint32)[0, 0] == 0x3CB6DB6E  # 10 / 448
    assert list(elements[0, :8]) == [0x7E, 0x63, 0xEE, 0x41, 0x13, 0x82, 0x80, 0x7A]
    y = epmoe.dequantize_fp8_block128(elements, scales)
    np.testing.assert_array_equal(y[0, :8], (np.array([448, 44, -112, 2.25, 0.04296875,
                                                       -0.00390625, 0, 320], np.float32)
                                             * scales[0, 0]))
    assert np.signbit(y[0, 6])


@pytest.mark.parametrize("blocks", ["tile_128x128", epmoe.Fp8Blocks.row_1x128])
def test_fp8_block128_round_trip_partial_blocks_and_shapes(blocks):
    x = random((2, 200, 2880), seed=7, scale=3.0)  # 2 experts; neither dim a multiple of 128
    x[1] *= 1000
    elements, scales = epmoe.quantize_fp8_block128(x, blocks)
    assert elements.shape == x.shape and elements.dtype == np.uint8
    tile = str(blocks) == "tile_128x128"
    assert scales.shape == ((2, 2, 23) if tile else (2, 200, 23))
    # Each matrix is tiled on its own: expert 1's scales are 1000x expert 0's, roughly.
    if tile:
        amax = np.abs(x[:, :128, :128]).max(axis=(1, 2))
        np.testing.assert_array_equal(scales[:, 0, 0], amax / np.float32(448))
        np.testing.assert_array_equal(scales[:, 1, 22],
                                      np.abs(x[:, 128:, 2816:]).max(axis=(1, 2)) / np.float32(448))
    else:
        np.testing.assert_array_equal(scales[:, :, 22],
                                      np.abs(x[:, :, 2816:]).max(axis=2) / np.float32(448))
    y = epmoe.dequantize_fp8_block128(elements, scales)  # blocks inferred from scales' shape
    np.testing.assert_array_equal(y, epmoe.dequantize_fp8_block128(elements, scales, blocks))
    # Half an E4M3 step (2^-4 relative) plus the subnormal step of its block's scale.
    full = scales.repeat(128 if tile else 1, axis=-2)[..., :200, :].repeat(128, axis=-1)[..., :2880]
    assert (np.abs(y - x) <= np.abs(x) * 2.0**-4 * (1 + 1e-6) + full * 2.0**-10).all()
    np.testing.assert_array_equal(
        epmoe.dequantize_fp8_block128(*epmoe.quantize_fp8_block128(y, blocks)), y)


def test_fp8_block128_special_blocks():
    x = np.zeros((2, 256), np.float32)
    x[0, 1:128:2] = -0.0  # an all-zero block with -0s: scale 0, elements the zero of each sign
    x[0, 128:] = 2.0
    x[1, 5] = np.inf  # a NaN scale for its block only
    x[1, 128:] = -1.0
    elements, scales = epmoe.quantize_fp8_block128(x, "row_1x128")
    assert scales[0, 0] == 0 and not np.signbit(scales[0, 0])
    np.testing.assert_array_equal(elements[0, :128], np.where(np.signbit(x[0, :128]), 0x80, 0))
    assert np.isnan(scales[1, 0]) and (elements[1, :128] == 0x7F).all()
    y = epmoe.dequantize_fp8_block128(elements, scales)
    np.testing.assert_array_equal(np.signbit(y[0, :128]), np.signbit(x[0, :128]))
    assert (y[0, :128] == 0).all() and np.isnan(y[1, :128]).all()
    np.testing.assert_allclose(y[:, 128:], x[:, 128:], rtol=1e-6)


def test_fp8_block128_checkpoint_scales_are_taken_as_given():
    """A DeepSeek checkpoint's weight (E4M3 codes) and weight_scale_inv decode as e4m3 * scale,
    the scale of row r being that of tile row r // 128."""
    codes = np.resize(np.arange(256, dtype=np.uint8), (130, 128))
    scales = np.array([[0.5], [3.0]], np.float32)
    y = epmoe.dequantize_fp8_block128(codes, scales)  # [2, 1] for [130, 128]: tiles
    e4m3 = epmoe.dequantize_mxfp8(codes, np.full((130, 4), 127, np.uint8))  # the E4M3 values
    np.testing.assert_array_equal(y[:128], e4m3[:128] * np.float32(0.5))
    np.testing.assert_array_equal(y[128:], e4m3[128:] * np.float32(3.0))


# ---- mxfp4 (gpt-oss) ----


def test_mxfp4_worked_example_of_the_docs():
    x = np.zeros((1, 32), np.float32)
    x[0, :8] = [5.0, -0.3, 1.2, 0.1, -2.6, 0.9, 3.1, -0.0]
    packed, scales = epmoe.quantize_mxfp4(x)
    assert packed.shape == (1, 16) and scales.shape == (1, 1) and scales[0, 0] == 127
    assert list(packed[0, :4]) == [0x96, 0x02, 0x2D, 0x85]
    np.testing.assert_array_equal(epmoe.dequantize_mxfp4(packed, scales)[0, :8],
                                  np.array([4, -0.5, 1, 0, -3, 1, 3, -0.0], np.float32))
    block = np.ones((1, 32), np.float32)
    block[0, 0] = 7.0
    p, s = epmoe.quantize_mxfp4(block, "ocp_floor")
    assert (s[0, 0], p[0, 0]) == (127, 0x27) and epmoe.dequantize_mxfp4(p, s)[0, 0] == 6.0
    p, s = epmoe.quantize_mxfp4(block, epmoe.ScaleRounding.rceil)
    assert (s[0, 0], p[0, 0]) == (128, 0x16) and epmoe.dequantize_mxfp4(p, s)[0, 0] == 8.0


@pytest.mark.parametrize("rounding", ["rceil", "ocp_floor"])
def test_mxfp4_round_trip_and_gpt_oss_layout(rounding):
    x = random((3, 4, 2880), seed=8, scale=0.02)  # gpt-oss: H = I = 2880 = 90 blocks of 32
    packed, scales = epmoe.quantize_mxfp4(x, rounding)
    assert packed.shape == (3, 4, 1440) and scales.shape == (3, 4, 90)
    y = epmoe.dequantize_mxfp4(packed, scales)
    # As gpt-oss's loaders decode *_blocks [..., 90, 16] and *_scales: a table lookup, element 2i
    # from the low nibble, times 2^(scale - 127).
    lut = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    blocks = packed.reshape(3, 4, 90, 16)
    pairs = np.stack([lut[blocks & 0xF], lut[blocks >> 4]], axis=-1).reshape(3, 4, 90, 32)
    ref = np.ldexp(pairs, scales.astype(np.int32)[..., None] - 127).reshape(3, 4, 2880)
    np.testing.assert_array_equal(y, ref)
    unit = np.ldexp(np.float32(1), scales.astype(np.int32) - 127).repeat(32, axis=-1)
    q = np.abs(x) / unit
    if rounding == "rceil":
        assert (q <= 6).all()
    bound = np.maximum(0.25, np.minimum(q, 6) / 4) * unit + np.maximum(q - 6, 0) * unit
    assert (np.abs(y - x) <= bound).all()
    np.testing.assert_array_equal(epmoe.dequantize_mxfp4(*epmoe.quantize_mxfp4(y, rounding)), y)


@pytest.mark.parametrize("rounding", ["rceil", "ocp_floor"])
def test_mxfp4_of_a_checkpoints_decoded_blocks_gives_back_its_values(rounding):
    """gpt-oss dequantized to bf16 (MXFP4 values are exact in bf16) and quantized again by the
    layer's mxfp4 precision: every value of the checkpoint comes back (the codes may differ where
    a block's largest magnitude is below 4 x its scale: the same values at a smaller scale)."""
    rng = np.random.default_rng(9)
    packed = rng.integers(0, 256, size=(64, 1440), dtype=np.uint8)  # any codes, any blocks
    scales = rng.integers(100, 150, size=(64, 90), dtype=np.uint8)
    x = epmoe.dequantize_mxfp4(packed, scales)
    assert not (x.view(np.uint32) & 0xFFFF).any()  # bf16 holds them exactly
    np.testing.assert_array_equal(epmoe.dequantize_mxfp4(*epmoe.quantize_mxfp4(x, rounding)), x)


def test_mxfp4_special_blocks():
    x = np.zeros((2, 64), np.float32)
    x[0, 3] = -0.0
    x[1, 40] = np.nan
    x[1, :32] = 1.0
    packed, scales = epmoe.quantize_mxfp4(x)
    assert scales[0, 0] == 0 and packed[0, 1] == 0x80 and (np.delete(packed[0], 1) == 0).all()
    assert scales[1, 1] == 0xFF and (packed[1, 16:] == 0).all()
    y = epmoe.dequantize_mxfp4(packed, scales)
    assert np.isnan(y[1, 32:]).all() and (y[1, :32] == 1.0).all() and (y[0] == 0).all()
    assert np.signbit(y[0, 3])


# ---- rejections ----


@pytest.mark.parametrize("call,message", [
    (lambda: epmoe.quantize_mxfp8(np.zeros((2, 40), np.float32)),
     "quantize_mxfp8: cols=40 must be a multiple of 32"),
    (lambda: epmoe.quantize_mxfp8(np.zeros((2, 32), np.float32), "nearest"),
     "quantize_mxfp8: rounding=nearest: must be rceil or ocp_floor"),
    (lambda: epmoe.quantize_mxfp8(np.float32(1.0)),
     "quantize_mxfp8: x is 0-d; expected shape [..., cols]"),
    (lambda: epmoe.dequantize_mxfp8(np.zeros((2, 64), np.uint8), np.zeros((2, 3), np.uint8)),
     "dequantize_mxfp8: scales has shape [2, 3], expected [2, 2]"),
    (lambda: epmoe.dequantize_mxfp8(np.zeros((2, 64), np.int8), np.zeros((2, 2), np.uint8)),
     "dequantize_mxfp8: elements has dtype int8, which epmoe does not take"),
    (lambda: epmoe.dequantize_mxfp8(np.zeros((2, 64), np.float32), np.zeros((2, 2), np.uint8)),
     "dequantize_mxfp8: elements has dtype f32, expected u8"),
    (lambda: epmoe.dequantize_mxfp8(np.zeros((2, 128), np.uint8)[:, ::2], np.zeros((2, 2), np.uint8)),
     "dequantize_mxfp8: elements is not contiguous"),
    (lambda: epmoe.dequantize_mxfp8("abc", np.zeros((2, 2), np.uint8)),
     "dequantize_mxfp8: elements is a str, not a tensor"),
    (lambda: epmoe.quantize_nvfp4(np.zeros((2, 24), np.float32)),
     "quantize_nvfp4: cols=24 must be a multiple of 16"),
    (lambda: epmoe.quantize_nvfp4(np.zeros((2, 32), np.float32), "per_block"),
     "quantize_nvfp4: group=per_block: must be per_tensor or per_row"),
    (lambda: epmoe.dequantize_nvfp4(np.zeros((2, 16), np.uint8), np.zeros((2, 1), np.uint8),
                                    np.ones(1, np.float32)),
     "dequantize_nvfp4: scales has shape [2, 1], expected [2, 2]"),
    (lambda: epmoe.dequantize_nvfp4(np.zeros((3, 16), np.uint8), np.zeros((3, 2), np.uint8),
                                    np.ones(2, np.float32)),
     "dequantize_nvfp4: tensor_scales has 2 elements, expected 1 (per_tensor) or rows=3 (per_row)"),
    (lambda: epmoe.dequantize_nvfp4(np.zeros((3, 16), np.uint8), np.zeros((3, 2), np.uint8),
                                    np.ones(1, np.float32), "per_row"),
     "dequantize_nvfp4: tensor_scales has 1 elements, expected 3 for group=per_row"),
    (lambda: epmoe.quantize_fp8_block128(np.zeros(64, np.float32)),
     "quantize_fp8_block128: x has shape [64]; blocks=tile_128x128 needs matrices [..., rows, cols]"),
    (lambda: epmoe.quantize_fp8_block128(np.zeros((2, 64), np.float32), "1x128"),
     "quantize_fp8_block128: blocks=1x128: must be tile_128x128 or row_1x128"),
    (lambda: epmoe.dequantize_fp8_block128(np.zeros((2, 64), np.uint8), np.zeros((2, 1), np.uint8)),
     "dequantize_fp8_block128: scales has dtype u8, expected f32"),
    (lambda: epmoe.dequantize_fp8_block128(np.zeros((300, 64), np.uint8),
                                           np.zeros((3, 1), np.float32), "row_1x128"),
     "dequantize_fp8_block128: scales has shape [3, 1], expected [300, 1]"),
    (lambda: epmoe.dequantize_fp8_block128(np.zeros((300, 64), np.uint8),
                                           np.zeros((2, 2), np.float32)),
     "dequantize_fp8_block128: scales has shape [2, 2], expected [300, 1]"),
    (lambda: epmoe.quantize_fp8_block128(np.zeros((4, 64), np.float32),
                                         out=(np.zeros((4, 64), np.uint8),
                                              np.zeros((4, 1), np.float32))),
     "quantize_fp8_block128: scales has shape [4, 1], expected [1, 1]"),
    (lambda: epmoe.quantize_mxfp4(np.zeros((2, 48), np.float32)),
     "quantize_mxfp4: cols=48 must be a multiple of 32"),
    (lambda: epmoe.quantize_mxfp4(np.zeros((2, 32), np.float32), "floor"),
     "quantize_mxfp4: rounding=floor: must be rceil or ocp_floor"),
    (lambda: epmoe.dequantize_mxfp4(np.zeros((2, 16, 16), np.uint8), np.zeros((2, 16), np.uint8)),
     "dequantize_mxfp4: scales has shape [2, 16], expected [2, 16, 1]"),
    (lambda: epmoe.dequantize_mxfp4(np.zeros((2, 16), np.uint8), np.zeros((2, 1), np.uint8),
                                    out=np.zeros((2, 32), np.float64)),
     "dequantize_mxfp4: out has dtype f64, expected f32"),
])
def test_codec_rejections_name_function_and_argument(call, message):
    with pytest.raises(epmoe.Error) as info:
        call()
    assert info.value.code == "invalid_argument"
    assert message in str(info.value)


def test_empty_arrays():
    e, s = epmoe.quantize_mxfp8(np.zeros((0, 64), np.float32))
    assert e.shape == (0, 64) and s.shape == (0, 2)
    assert epmoe.dequantize_mxfp8(e, s).shape == (0, 64)
    p, s, t = epmoe.quantize_nvfp4(np.zeros((0, 32), np.float32), "per_row")
    assert p.shape == (0, 16) and s.shape == (0, 2) and t.shape == (0,)
    e, s = epmoe.quantize_fp8_block128(np.zeros((3, 0, 200), np.float32))
    assert e.shape == (3, 0, 200) and s.shape == (3, 0, 2)
    assert epmoe.dequantize_fp8_block128(e, s).shape == (3, 0, 200)
    p, s = epmoe.quantize_mxfp4(np.zeros((0, 64), np.float32))
    assert p.shape == (0, 32) and s.shape == (0, 2)
    assert epmoe.dequantize_mxfp4(p, s).shape == (0, 64)

"""epmoe.Layer from weights already in its precision (epmoe.QuantizedWeights, or tuples of codes
and scales), on the CPU executor: quantized with epmoe's own codec, they give the same output bits
as the layer built from the bf16 weights, for every precision and both combines; NVFP4's ModelOpt
convention (global_scale = weight_scale_2); torch float8 codes; bad tensors named."""

from __future__ import annotations

import numpy as np
import pytest

import epmoe
from epmoe_ref import bf16_bits_to_f32, make_batch, make_problem, raise_first, run_ranks

# w13 [256, 192] is 2 x 2 fp8_block128 tiles (the second 64 wide), w2 [192, 128] 2 x 1.
SHAPE = epmoe.LayerShape(hidden=192, intermediate=128, num_experts=4, top_k=2,
                         max_tokens_per_rank=12)


def quantize(w_bits: np.ndarray, precision: str, rounding: str = "rceil") -> epmoe.QuantizedWeights:
    """One FC's experts [E, N, K] as a checkpoint in `precision` holds them, by epmoe's codec."""
    w = bf16_bits_to_f32(w_bits)
    if precision == "mxfp8":
        return epmoe.QuantizedWeights(*epmoe.quantize_mxfp8(w, rounding))
    if precision == "mxfp4":
        return epmoe.QuantizedWeights(*epmoe.quantize_mxfp4(w, rounding))
    if precision == "fp8_block128":
        return epmoe.QuantizedWeights(*epmoe.quantize_fp8_block128(w, "tile_128x128"))
    assert precision == "nvfp4"  # one s_enc per expert matrix
    parts = [epmoe.quantize_nvfp4(m, "per_tensor") for m in w]
    packed, scales, s_enc = (np.stack([p[i] for p in parts]) for i in range(3))
    return epmoe.QuantizedWeights(packed, scales, s_enc=s_enc.reshape(-1))


def outputs(problem, precision, weights_of, combine="staged", rounds=3, **options):
    """Every rank's y over a few rounds (one with T = 0) of layers made from weights_of(rank)."""
    world = problem.world
    group = epmoe.HostGroup(world)

    def create(rank):
        w13, w2 = weights_of(rank)
        return epmoe.Layer(group.communicator(rank), problem.shape, precision, w13, w2,
                           combine=combine, timeout_ms=20_000, **options)

    layers = raise_first(run_ranks(world, create))
    ys = []
    for r in range(rounds):
        batches = [make_batch(problem.shape, 0 if r == 1 else 12 - rank, seed=50 * r + rank)
                   for rank in range(world)]
        ys += raise_first(run_ranks(world, lambda rank: layers[rank].forward(
            batches[rank].x, batches[rank].ids, batches[rank].weights)))
    for layer in layers:
        layer.close()
    return ys


def local(problem, q: epmoe.QuantizedWeights, rank: int) -> epmoe.QuantizedWeights:
    e = problem.shape.num_experts // problem.world
    return epmoe.QuantizedWeights(*(None if t is None else t[rank * e:(rank + 1) * e] for t in q))


def assert_same_bits(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype == np.uint16 and np.array_equal(x, y)


@pytest.mark.parametrize("precision", ["mxfp8", "nvfp4", "fp8_block128", "mxfp4"])
@pytest.mark.parametrize("combine,world", [("staged", 2), ("in_kernel_reduce", 1)])
def test_codes_give_the_bits_of_the_bf16_layer(precision, combine, world):
    problem = make_problem(SHAPE, world, seed=3)
    q13, q2 = quantize(problem.w13_bits, precision), quantize(problem.w2_bits, precision)
    want = outputs(problem, precision, problem.local, combine)
    got = outputs(problem, precision,
                  lambda r: (local(problem, q13, r), local(problem, q2, r)), combine)
    assert_same_bits(got, want)
    # The check can fail: another problem's codes give other bits.
    other = make_problem(SHAPE, world, seed=4)
    o13, o2 = quantize(other.w13_bits, precision), quantize(other.w2_bits, precision)
    changed = outputs(problem, precision,
                      lambda r: (local(problem, o13, r), local(problem, o2, r)), combine)
    assert any(not np.array_equal(x, y) for x, y in zip(changed, want) if x.size)


def test_plain_tuples_ocp_floor_and_gpt_oss_blocks():
    problem = make_problem(SHAPE, 1, seed=5)
    q13 = quantize(problem.w13_bits, "mxfp4", "ocp_floor")
    q2 = quantize(problem.w2_bits, "mxfp4", "ocp_floor")
    want = outputs(problem, "mxfp4", problem.local, mxfp8_scale_rounding="ocp_floor")
    # gpt-oss's *_blocks [E, N, K/32, 16] and *_scales, as plain tuples.
    blocks13 = q13.codes.reshape(*q13.scales.shape, 16)
    got = outputs(problem, "mxfp4", lambda r: ((blocks13, q13.scales), (q2.codes, q2.scales)),
                  mxfp8_scale_rounding="ocp_floor")
    assert_same_bits(got, want)


def test_nvfp4_global_scale_is_modelopt_weight_scale_2():
    """value = e2m1 * block_scale * global_scale: with a power-of-two s_enc the reciprocal is
    exact, so ModelOpt's convention gives the bits of epmoe's; a tuple's third part is it."""
    problem = make_problem(SHAPE, 2, seed=6)

    def static(w_bits):
        parts = [epmoe.quantize_nvfp4(m, "per_tensor", 512.0) for m in bf16_bits_to_f32(w_bits)]
        packed, scales = (np.stack([p[i] for p in parts]) for i in range(2))
        return packed, scales, np.full(len(parts), 512.0, np.float32)

    p13, s13, e13 = static(problem.w13_bits)
    p2, s2, e2 = static(problem.w2_bits)
    e = SHAPE.num_experts // 2

    def part(t, r):
        return t[r * e:(r + 1) * e]

    by_s_enc = outputs(problem, "nvfp4", lambda r: (
        epmoe.QuantizedWeights(part(p13, r), part(s13, r), s_enc=part(e13, r)),
        epmoe.QuantizedWeights(part(p2, r), part(s2, r), s_enc=part(e2, r))))
    by_global = outputs(problem, "nvfp4", lambda r: (
        (part(p13, r), part(s13, r), 1.0 / part(e13, r)),
        epmoe.QuantizedWeights(part(p2, r), part(s2, r), global_scale=1.0 / part(e2, r))))
    assert_same_bits(by_global, by_s_enc)


def test_torch_float8_codes_and_scales():
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8_e4m3fn")
    problem = make_problem(SHAPE, 1, seed=7)
    want = outputs(problem, "fp8_block128", problem.local)

    def as_torch(q):  # DeepSeek-V3: weight float8_e4m3fn, weight_scale_inv float32
        codes = torch.from_numpy(q.codes).view(torch.float8_e4m3fn)
        return codes, torch.from_numpy(q.scales)

    q13 = as_torch(quantize(problem.w13_bits, "fp8_block128"))
    q2 = as_torch(quantize(problem.w2_bits, "fp8_block128"))
    assert q13[0].dtype == torch.float8_e4m3fn
    assert_same_bits(outputs(problem, "fp8_block128", lambda r: (q13, q2)), want)
    # NVFP4 as ModelOpt ships it: block scales float8_e4m3fn.
    want = outputs(problem, "nvfp4", problem.local)
    n13, n2 = quantize(problem.w13_bits, "nvfp4"), quantize(problem.w2_bits, "nvfp4")

    def modelopt(q):
        return epmoe.QuantizedWeights(torch.from_numpy(q.codes),
                                      torch.from_numpy(q.scales).view(torch.float8_e4m3fn),
                                      s_enc=torch.from_numpy(q.s_enc))

    assert_same_bits(outputs(problem, "nvfp4", lambda r: (modelopt(n13), modelopt(n2))), want)


def test_ml_dtypes_float8_codes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    problem = make_problem(SHAPE, 1, seed=9)
    q13, q2 = quantize(problem.w13_bits, "mxfp8"), quantize(problem.w2_bits, "mxfp8")
    want = outputs(problem, "mxfp8", problem.local)
    e4m3 = [q.codes.view(ml_dtypes.float8_e4m3fn) for q in (q13, q2)]
    assert_same_bits(outputs(problem, "mxfp8", lambda r: ((e4m3[0], q13.scales),
                                                          (e4m3[1], q2.scales))), want)


def creation_error(precision, edit):
    problem = make_problem(SHAPE, 1, seed=8)
    q13 = quantize(problem.w13_bits, precision)
    q2 = quantize(problem.w2_bits, precision)
    w13, w2 = edit(problem, q13, q2)
    with pytest.raises(epmoe.Error) as info:
        epmoe.Layer(epmoe.HostGroup(1).communicator(0), SHAPE, precision, w13, w2)
    assert info.value.code == "invalid_argument"
    return str(info.value)


def test_bad_tensors_are_named():
    assert creation_error("mxfp8", lambda p, a, b: ((a.codes, a.scales[:, :, :2]), b)) == (
        "Layer: weights.w13_quantized.scales has shape [4, 256, 2], expected [4, 256, 6] "
        "(mxfp8: E8M0 scales, one per 32 along K)")
    assert creation_error("mxfp8", lambda p, a, b: (a, (b.codes.astype(np.float32), b.scales))) == (
        "Layer: weights.w2_quantized.codes has dtype f32, expected u8 (mxfp8: E4M3 codes)")
    assert creation_error("fp8_block128", lambda p, a, b: (
        a, (b.codes, b.scales.astype(np.float64)))) == (
        "Layer: weights.w2_quantized.scales has dtype f64, expected f32 (fp8_block128: "
        "weight_scale_inv, one per 128 x 128 tile)")
    assert "Layer: weights.w13_quantized needs exactly one of global_scale" in creation_error(
        "nvfp4", lambda p, a, b: ((a.codes, a.scales), b))
    assert creation_error("nvfp4", lambda p, a, b: (a, b._replace(s_enc=b.s_enc[:2]))) == (
        "Layer: weights.w2_quantized.s_enc has shape [2], expected [4] (nvfp4: one encode scale "
        "per matrix)")
    assert creation_error("mxfp4", lambda p, a, b: (a, (b.codes, b.scales, b.scales))) == (
        "Layer: weights.w2_quantized.global_scale is given, but precision=mxfp4 has no "
        "per-matrix scale (only nvfp4 does)")
    assert creation_error("mxfp4", lambda p, a, b: ((a.codes[:, :, :8], a.scales), b)) == (
        "Layer: weights.w13_quantized.codes has shape [4, 256, 8], expected [4, 256, 96] "
        "(mxfp4: E2M1 pairs, element 2j in the low nibble: [E, N, K/2] or [E, N, K/32, 16])")
    with pytest.raises(epmoe.Error, match=r"precision=bf16 has no codes"):
        q = quantize(make_problem(SHAPE, 1).w13_bits, "mxfp8")
        epmoe.Layer(epmoe.HostGroup(1).communicator(0), SHAPE, "bf16", q,
                    make_problem(SHAPE, 1).w2_bits)

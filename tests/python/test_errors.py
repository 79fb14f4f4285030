"""Wrong arguments raise epmoe.Error naming the argument, before anything runs."""

from __future__ import annotations

import numpy as np
import pytest

import epmoe
from epmoe_ref import NumpyLayer, assert_within_bf16_ulps, make_batch, make_layers, make_problem
from epmoe_ref import raise_first, run_ranks

H, K = 64, 2
SHAPE = dict(hidden=H, intermediate=64, num_experts=4, top_k=K, max_tokens_per_rank=8)


@pytest.fixture(scope="module")
def problem():
    return make_problem(epmoe.LayerShape(**SHAPE), 2, seed=21)


@pytest.fixture(scope="module")
def layers(problem):
    return make_layers(problem, timeout_ms=30_000)


def good(t=3):
    return (np.zeros((t, H), np.uint16), np.zeros((t, K), np.int32), np.full((t, K), 0.5, np.float32))


def readonly(a):
    a = a.copy()
    a.flags.writeable = False
    return a


def f16(t):
    return np.zeros((t, H), np.float16)


# (argument, call tweak, text the message must contain)
BAD_FORWARD = [
    ("x", lambda x, i, w: (x[:, :32], i, w, None), "forward: x has shape [3, 32], expected [3, 64]"),
    ("x", lambda x, i, w: (x.astype(np.float32), i, w, None), "forward: x has dtype f32, expected bf16"),
    ("x", lambda x, i, w: (f16(3), i, w, None), "forward: x has dtype float16, which epmoe does not take"),
    ("x", lambda x, i, w: (x.reshape(-1), i, w, None), "forward: x has shape [192], expected [T, 64]"),
    ("x", lambda x, i, w: ([[0] * H] * 3, i, w, None), "forward: x is a list, not a tensor"),
    ("x", lambda x, i, w: (np.zeros((9, H), np.uint16), np.zeros((9, K), np.int32),
                           np.zeros((9, K), np.float32), None), "forward: x has T=9 tokens: must be <= max_tokens_per_rank=8"),
    ("topk_ids", lambda x, i, w: (x, i.astype(np.float32), w, None), "forward: topk_ids has dtype f32, expected i32 or i64"),
    ("topk_ids", lambda x, i, w: (x, i[:2], w, None), "forward: topk_ids has shape [2, 2], expected [3, 2]"),
    ("topk_ids", lambda x, i, w: (x, np.full((3, K), 4, np.int32), w, None), "forward: topk_ids[0, 0]=4: must be -1 (no expert) or in [0, num_experts=4)"),
    ("topk_ids", lambda x, i, w: (x, np.full((3, K), -2, np.int64), w, None), "forward: topk_ids[0, 0]=-2"),
    ("topk_weights", lambda x, i, w: (x, i, w.astype(np.float64), None), "forward: topk_weights has dtype f64, expected f32"),
    ("topk_weights", lambda x, i, w: (x, i, np.zeros((3, 2 * K), np.float32)[:, ::2], None), "forward: topk_weights is not contiguous"),
    ("y", lambda x, i, w: (x, i, w, np.zeros((3, 2 * H), np.uint16)), "forward: y has shape [3, 128], expected [3, 64]"),
    ("y", lambda x, i, w: (x, i, w, np.zeros((3, H), np.float32)), "forward: y has dtype f32, expected bf16"),
    ("y", lambda x, i, w: (x, i, w, readonly(np.zeros((3, H), np.uint16))), "forward: y is read-only"),
    ("y", lambda x, i, w: (x, i, w, np.zeros((3, 2 * H), np.uint16)[:, ::2]), "forward: y is not contiguous"),
]


@pytest.mark.parametrize("arg,tweak,message", BAD_FORWARD,
                         ids=[f"{a}-{n}" for n, (a, _, _) in enumerate(BAD_FORWARD)])
def test_bad_forward_argument_is_named_and_nothing_runs(layers, arg, tweak, message):
    before = layers[0].next_round
    x, i, w, out = tweak(*good())
    with pytest.raises(epmoe.Error) as info:
        layers[0].forward(x, i, w, out=out)
    assert info.value.code == "invalid_argument"
    assert message in str(info.value)
    assert isinstance(info.value, RuntimeError)
    # Rejected before the round: no round was started, the layer is healthy.
    assert layers[0].next_round == before
    assert layers[0].health().ok


def test_layer_still_serves_rounds_after_rejections(problem, layers):
    """Every rank runs a real round after rank 0's rejected calls: no rank is out of step."""
    for _ in range(3):
        with pytest.raises(epmoe.Error):
            layers[0].forward(*good()[:2], np.zeros((3, K), np.float64))
    batches = [make_batch(problem.shape, t, seed=t) for t in (4, 0)]
    ys = raise_first(run_ranks(2, lambda r: layers[r].forward(
        batches[r].x, batches[r].ids, batches[r].weights)))
    assert_within_bf16_ulps(ys[0], NumpyLayer(problem).forward(batches[0]))
    assert ys[1].shape == (0, H)


def test_bad_config_names_field_value_and_rule():
    with pytest.raises(epmoe.Error, match=r"hidden=2050: must be a multiple of 64") as info:
        epmoe.make_config(epmoe.LayerShape(hidden=2050, intermediate=64, num_experts=4, top_k=2,
                                           max_tokens_per_rank=8))
    assert info.value.code == "invalid_argument"
    shape = epmoe.LayerShape(**SHAPE)
    with pytest.raises(epmoe.Error, match=r"precision=fp8: must be one of bf16, mxfp8, nvfp4"):
        epmoe.make_config(shape, "fp8")
    with pytest.raises(epmoe.Error, match=r"combine=fast"):
        epmoe.make_config(shape, combine="fast")
    with pytest.raises(epmoe.Error, match=r"mxfp8_scale_rounding=up: must be rceil or ocp_floor"):
        epmoe.make_config(shape, mxfp8_scale_rounding="up")
    with pytest.raises(epmoe.Error, match=r"expert_math=tf32: must be one of exact, tensor_core"):
        epmoe.make_config(shape, expert_math="tf32")
    with pytest.raises(epmoe.Error, match=r"timeout_ms=-1"):
        epmoe.make_config(shape, timeout_ms=-1)
    with pytest.raises(epmoe.Error, match=r"world"):
        epmoe.make_config(shape, world=3)  # 4 experts do not split over 3 ranks


def test_bad_weights_and_communicators(problem):
    group = epmoe.HostGroup(1)
    shape = epmoe.LayerShape(**SHAPE)
    w13, w2 = problem.w13_bits, problem.w2_bits  # all 4 experts: right for world 1
    with pytest.raises(epmoe.Error, match=r"Layer: weights.w13 has shape \[4, 128, 32\], expected \[4, 128, 64\]"):
        epmoe.Layer(group.communicator(0), shape, "bf16", w13[:, :, :32], w2)
    with pytest.raises(epmoe.Error, match=r"Layer: weights.w2 has dtype i32, expected bf16 or f32"):
        epmoe.Layer(group.communicator(0), shape, "bf16", w13, w2.astype(np.int32))
    with pytest.raises(epmoe.Error, match=r"Layer: weights.w2 has dtype float16"):
        epmoe.Layer(group.communicator(0), shape, "bf16", w13, w2.astype(np.float16))
    with pytest.raises(epmoe.Error, match=r"rank=1: must be in \[0, 1\)"):
        group.communicator(1)
    with pytest.raises(epmoe.Error, match=r"world=0: must be >= 1"):
        epmoe.HostGroup(0)


def test_torch_tensor_on_the_wrong_device_is_named():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device to make a cuda tensor")
    problem = make_problem(epmoe.LayerShape(**SHAPE), 1, seed=2)
    layer = make_layers(problem)[0]
    x, i, w = good()
    with pytest.raises(epmoe.Error, match=r"forward: x is on cuda:0, expected cpu"):
        layer.forward(torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).cuda(), i, w)

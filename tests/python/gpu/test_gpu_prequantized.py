"""Pre-quantized weights on the CUDA executor from Python: torch tensors on the GPU as checkpoints
hold them (float8_e4m3fn codes, DeepSeek-V3's float32 weight_scale_inv, ModelOpt's float8 block
scales, gpt-oss's blocks), quantized by epmoe's own codec on the GPU, give the output bits of the
layer built from the bf16 weights (exact math, staged combine, one GPU).

    pytest tests/python/gpu
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

import epmoe  # noqa: E402
from gpu_ref import layer_shape, make_batch, make_weights  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not epmoe.cuda_available, reason="epmoe built without the CUDA executor"),
    pytest.mark.skipif("WORLD_SIZE" in os.environ, reason="one process: run with plain pytest"),
    pytest.mark.skipif(epmoe.cuda_device_count() < 1, reason="needs a GPU"),
]


def quantize(w: torch.Tensor, precision: str) -> epmoe.QuantizedWeights:
    """[E, N, K] bf16 on the GPU as a checkpoint in `precision` holds it (epmoe's GPU codec)."""
    x = w.float()
    if precision == "fp8_block128":
        codes, scale_inv = epmoe.quantize_fp8_block128(x, "tile_128x128")
        return epmoe.QuantizedWeights(codes.view(torch.float8_e4m3fn), scale_inv)
    if precision == "mxfp4":
        packed, scales = epmoe.quantize_mxfp4(x)
        return epmoe.QuantizedWeights(packed.view(*scales.shape, 16), scales)  # gpt-oss blocks
    if precision == "mxfp8":
        return epmoe.QuantizedWeights(*epmoe.quantize_mxfp8(x))
    assert precision == "nvfp4"  # one s_enc per expert matrix; block scales as float8_e4m3fn
    parts = [epmoe.quantize_nvfp4(m, "per_tensor") for m in x]
    packed, scales, s_enc = (torch.stack([p[i] for p in parts]) for i in range(3))
    return epmoe.QuantizedWeights(packed, scales.view(torch.float8_e4m3fn),
                                  s_enc=s_enc.reshape(-1))


@pytest.mark.parametrize("precision", ["mxfp8", "nvfp4", "fp8_block128", "mxfp4"])
def test_gpu_codes_give_the_bits_of_the_bf16_layer(precision):
    shape = layer_shape(hidden=192, intermediate=128)
    weights = make_weights(shape, seed=3)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    w13, w2 = weights.w13.to(device), weights.w2.to(device)
    q13, q2 = quantize(w13, precision), quantize(w2, precision)
    torch.cuda.synchronize(device)
    (comm,) = epmoe.nccl_communicators([0])
    outputs = []
    for a, b in ((w13, w2), (q13, q2)):
        layer = epmoe.Layer(comm, shape, precision, a, b, expert_math="exact")
        ys = []
        for tokens, seed in ((64, 1), (0, 2), (9, 3)):
            batch = make_batch(shape, tokens, seed=seed).to(device)
            ys.append(layer.forward(batch.x, batch.ids, batch.weights))
        torch.cuda.synchronize(device)
        outputs.append([y.cpu() for y in ys])
        layer.close()
    comm.close()
    for want, got in zip(*outputs):
        assert torch.equal(want.view(torch.int16), got.view(torch.int16))

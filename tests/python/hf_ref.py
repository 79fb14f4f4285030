"""Tiny transformers MoE blocks and their float64 reference, for the parity tests
(tests/python/test_hf_models.py on the CPU executor, tests/python/gpu/test_gpu_hf_models.py).

Every block is built in code from a small config (no downloads), with random weights in bf16 as
checkpoints ship them. The reference is the same block in float64 (a deep copy), run with the
bf16 block's own routing (ids and weights), so that routing ties broken differently in float64
do not count as error: the comparison isolates the experts (and the shared experts).

:func:`shipped_checkpoint` also writes a block as its quantized checkpoints ship it (FP8 with
``weight_scale_inv``, gpt-oss's MXFP4 ``*_blocks`` / ``*_scales``) and gives the block holding the
values those codes decode to, dequantized by transformers' own loaders.
"""

from __future__ import annotations

import copy
from typing import Tuple

import torch

MODELS = ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss")
PRECISIONS = ("bf16", "mxfp8", "nvfp4")
# gpt-oss ships MXFP4 weights: its third precision is that format (quantized by epmoe from bf16).
MODEL_PRECISIONS = {m: PRECISIONS for m in MODELS} | {"gpt_oss": ("bf16", "mxfp8", "mxfp4")}
# (model, precision) pairs the parity tests run.
CASES = [(m, p) for m in MODELS for p in MODEL_PRECISIONS[m]]
# rel-L2 against an unquantized float64 forward that each precision stays under: the bounds of
# `epmoe run` (docs/design.md §6, docs/tuning.md "Expert math"; reference::check_output).
BOUND = {"bf16": 0.02, "mxfp8": 0.10, "nvfp4": 0.35, "mxfp4": 0.35, "fp8_block128": 0.10}
# Quantized checkpoints the adapters read as shipped: (model, its format = the layer's precision).
# FP8 as DeepSeek-V3 ships it; Qwen3-MoE and Mixtral FP8 checkpoints use the same names.
SHIPPED = [("deepseek_v3", "fp8_block128"), ("qwen3_moe", "fp8_block128"),
           ("mixtral", "fp8_block128"), ("gpt_oss", "mxfp4")]

H, I = 256, 128  # hidden, moe intermediate: multiples of 64 as epmoe requires
# gpt-oss's intermediate: 2I != H, so that a transposed [E, H, 2I] read as [E, 2I, H] (or
# [E, I, H] as [E, H, I]) fails on its shape, not only on its values.
I_GPT_OSS = 192


def make_config(model: str):
    common = dict(hidden_size=H, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, hidden_act="silu")
    if model == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        config = Qwen3MoeConfig(moe_intermediate_size=I, intermediate_size=2 * I, num_experts=8,
                                num_experts_per_tok=2, norm_topk_prob=True, **common)
    elif model == "mixtral":
        from transformers import MixtralConfig

        config = MixtralConfig(intermediate_size=I, num_local_experts=8, num_experts_per_tok=2,
                               **common)
    elif model == "deepseek_v3":
        from transformers import DeepseekV3Config

        config = DeepseekV3Config(moe_intermediate_size=I, intermediate_size=2 * I,
                                  n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                  topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
                                  norm_topk_prob=True, first_k_dense_replace=0,
                                  q_lora_rank=None, kv_lora_rank=64, qk_rope_head_dim=16,
                                  qk_nope_head_dim=32, v_head_dim=32, **common)
    elif model == "gpt_oss":
        from transformers import GptOssConfig

        config = GptOssConfig(intermediate_size=I_GPT_OSS, num_local_experts=8,
                              num_experts_per_tok=4, head_dim=64, **common)
    else:
        raise ValueError(model)
    config._experts_implementation = "eager"  # transformers' reference loop, on any device
    return config


def make_block(model: str, seed: int = 0, device="cpu") -> Tuple[torch.nn.Module, object]:
    """The model's MoE block, random bf16 weights (the same on every rank for a seed): U(-1, 1)
    / sqrt(fan_in), the router's 4x as large (clear preferences). gpt-oss's gate_up_proj is 8x
    as large, so that some gate and up values pass its clamp at 7 (as the real model's do); its
    biases are U(-1, 1) on FC1 and U(-0.5, 0.5) on FC2."""
    config = make_config(model)
    if model == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as B
    elif model == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as B
    elif model == "gpt_oss":
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP as B
    else:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as B
    block = B(config)
    transposed = getattr(block.experts, "is_transposed", False)  # gpt-oss: [E, in, out]
    scales = {"gate.": 4.0, "router.": 4.0, "experts.gate_up_proj": 8.0 if model == "gpt_oss"
              else 1.0}
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.endswith("_bias"):  # gpt-oss's expert biases: [E, out]
                p.copy_((torch.rand(p.shape, generator=g) * 2 - 1) *
                        (1.0 if "gate_up" in name else 0.5))
                continue
            fan_in = p.shape[-2] if transposed and name.startswith("experts.") else p.shape[-1]
            scale = next((v for k, v in scales.items() if name.startswith(k)), 1.0)
            p.copy_((torch.rand(p.shape, generator=g) * 2 - 1) * scale / fan_in ** 0.5)
        if hasattr(getattr(block, "gate", None), "e_score_correction_bias"):
            block.gate.e_score_correction_bias.copy_(torch.rand(config.n_routed_experts,
                                                                generator=g) * 0.1)
    block.eval()
    return block.to(device=device, dtype=torch.bfloat16), config


def make_tokens(tokens: int, seed: int, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, H, generator=g).to(device=device, dtype=torch.bfloat16)


def block_forward(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The block's own forward on x [T, H] -> [T, H] (gpt-oss's returns (y, router_scores))."""
    y = block(x[None])
    return (y[0] if isinstance(y, tuple) else y)[0]


def float64_copy(block: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(block).to(torch.float64)


@torch.no_grad()
def reference64(block64: torch.nn.Module, x: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
    """The block's forward in float64 with the given routing: routed experts (and their biases)
    + shared experts."""
    x64 = x.to(block64.experts.gate_up_proj.device, torch.float64)
    y = block64.experts(x64, ids.to(x64.device, torch.int64), weights.to(x64.device, torch.float64))
    if getattr(block64, "shared_experts", None) is not None:
        y = y + block64.shared_experts(x64)
    return y


def rel_l2(y: torch.Tensor, ref: torch.Tensor) -> float:
    y = y.detach().to("cpu", torch.float64)
    ref = ref.detach().to("cpu", torch.float64)
    return float((y - ref).norm() / ref.norm().clamp_min(1e-300))


def checkpoint_state_dict(block: torch.nn.Module, model: str, prefix: str) -> dict:
    """The block as a checkpoint on disk names it: one matrix per expert (Mixtral: w1/w3/w2
    under block_sparse_moe), router and shared experts as in transformers; gpt-oss's bf16
    checkpoints keep transformers' names and layout."""
    if model == "gpt_oss":
        return {prefix + k: v.clone() for k, v in block.state_dict().items()}
    sd = {}
    i = block.experts.down_proj.shape[2]
    on_disk = prefix.replace(".mlp.", ".block_sparse_moe.") if model == "mixtral" else prefix
    names = ("w1", "w3", "w2") if model == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for e in range(block.experts.gate_up_proj.shape[0]):
        gu = block.experts.gate_up_proj[e].detach()
        for n, w in zip(names, (gu[:i], gu[i:], block.experts.down_proj[e].detach())):
            sd[f"{on_disk}experts.{e}.{n}.weight"] = w.clone()
    for k, v in block.state_dict().items():
        if not k.startswith("experts."):
            sd[on_disk + k] = v.clone()
    return sd


def shipped_checkpoint(block: torch.nn.Module, model: str, prefix: str):
    """(state dict, dequantized block): the block's bf16 experts quantized as the model's
    checkpoints ship them, by epmoe's codecs, and a float32 copy of the block whose experts hold
    the values those codes decode to (dequantized by transformers' loaders, the external oracle
    of the layouts). Router, shared experts and biases stay as they are.

    * FP8 (not gpt-oss): per expert ``...experts.{e}.{gate_proj,up_proj,down_proj}.weight``
      float8_e4m3fn [out, in] with ``.weight_scale_inv`` float32 [ceil(out/128), ceil(in/128)],
      amax / 448 per 128 x 128 tile (Mixtral: w1, w3, w2 under block_sparse_moe), of the
      block's weights times a factor per tile.
    * gpt-oss MXFP4: ``experts.{gate_up,down}_proj_blocks`` [E, N, K/32, 16] uint8 and
      ``_scales`` [E, N, K/32] uint8, N x K = 2I x H (rows 0::2 gate, 1::2 up, as
      gate_up_proj's columns) and H x I.
    """
    import epmoe
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    dequantized = copy.deepcopy(block).float()
    experts = dequantized.experts
    if model == "gpt_oss":
        sd = {prefix + k: v.clone() for k, v in block.state_dict().items()
              if k not in ("experts.gate_up_proj", "experts.down_proj")}
        for name in ("gate_up_proj", "down_proj"):
            rows = getattr(block.experts, name).detach().transpose(1, 2).float()  # [E, N, K]
            packed, scales = epmoe.quantize_mxfp4(rows.contiguous())
            blocks = packed.reshape(*scales.shape, 16)
            sd[f"{prefix}experts.{name}_blocks"] = blocks
            sd[f"{prefix}experts.{name}_scales"] = scales
            with torch.no_grad():  # transformers' loader: [E, N, K/32, 16] -> [E, K, N]
                getattr(experts, name).copy_(
                    convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
        return sd, dequantized
    sd = checkpoint_state_dict(block, model, prefix)
    fp8 = Fp8Dequantize(None)
    i = block.experts.down_proj.shape[2]
    g = torch.Generator().manual_seed(0)
    for key in [k for k in sd if ".experts." in k and k.endswith(".weight")]:
        # Each 128 x 128 tile scaled by its own 2^U(-2, 1): the tiles' scales differ (with the
        # block's uniform weights they would all be equal, and a mix-up of them would not show).
        rows, cols = sd[key].shape
        tiles = torch.rand(-(-rows // 128), -(-cols // 128), generator=g) * 3 - 2
        factor = tiles.exp2().repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
        codes, scale_inv = epmoe.quantize_fp8_block128(sd[key].float() * factor, "tile_128x128")
        sd[key] = codes.view(torch.float8_e4m3fn)
        sd[key + "_scale_inv"] = scale_inv
        e, name = int(key.split(".experts.")[1].split(".")[0]), key.split(".")[-2]
        values = fp8._dequantize_one(sd[key], scale_inv, torch.float32)
        with torch.no_grad():
            if name in ("down_proj", "w2"):
                experts.down_proj[e].copy_(values)
            else:
                rows = slice(0, i) if name in ("gate_proj", "w1") else slice(i, 2 * i)
                experts.gate_up_proj[e, rows].copy_(values)
    return sd, dequantized


def values_state_dict(block: torch.nn.Module, dequantized: torch.nn.Module, model: str,
                      prefix: str) -> dict:
    """The checkpoint of :func:`shipped_checkpoint`'s dequantized experts (float32 values) with
    the block's own bf16 router, shared experts and biases: the shipped layer, given as values."""
    sd = checkpoint_state_dict(dequantized, model, prefix)
    sd.update({k: v for k, v in checkpoint_state_dict(block, model, prefix).items()
               if ".experts." not in k or k.endswith("_bias")})
    return sd

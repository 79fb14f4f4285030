"""Tiny transformers MoE blocks and their float64 reference, for the parity tests
(tests/python/test_hf_models.py on the CPU executor, tests/python/gpu/test_gpu_hf_models.py).

Every block is built in code from a small config (no downloads), with random weights in bf16 as
checkpoints ship them. The reference is the same block in float64 (a deep copy), run with the
bf16 block's own routing (ids and weights), so that routing ties broken differently in float64
do not count as error: the comparison isolates the experts (and the shared experts).
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
BOUND = {"bf16": 0.02, "mxfp8": 0.10, "nvfp4": 0.35, "mxfp4": 0.35}

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

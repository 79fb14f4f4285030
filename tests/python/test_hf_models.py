"""Hugging Face MoE blocks on epmoe's CPU executor against transformers' own blocks.

For Qwen3-MoE, Mixtral, DeepSeek-V3 and gpt-oss (tiny random configs built in code, bf16 weights
as shipped): the block's own forward vs its router's top-k -> epmoe ``Layer.forward`` (+ the
shared experts), for every precision the model's checkpoints allow (gpt-oss: bf16, mxfp8, mxfp4
quantized by epmoe), both measured against the block in float64 with the same routing (the rel-L2
bounds of docs/design.md §6). A changed layout mapping (gate/up order or interleave, transposes,
biases, a rank's expert range) or activation fails these tests. Skipped, with the reason,
without torch or transformers (CI has neither).
"""

from __future__ import annotations

import pytest

try:
    import torch
    import transformers  # noqa: F401
except ImportError as e:  # CI: no torch, no transformers
    pytest.skip(f"Hugging Face parity tests need torch and transformers ({e})",
                allow_module_level=True)

import epmoe  # noqa: E402
from epmoe import models  # noqa: E402
from epmoe_ref import raise_first, run_ranks  # noqa: E402
from hf_ref import (  # noqa: E402
    BOUND,
    CASES,
    H,
    MODELS,
    block_forward,
    float64_copy,
    make_block,
    make_config,
    make_tokens,
    reference64,
    rel_l2,
)

MAX_TOKENS = 32
# Tokens per rank per round (rank 1 idle in the second round).
TOKENS = {1: [[32], [7]], 2: [[32, 9], [5, 0]]}
# Largest error seen per (model, precision, world): printed with -s, for the report.
SEEN = {}


def run_layers(block, precision, world, xs, from_state_dict=None, **options):
    """EPMoE per rank (one thread each) on xs[round][rank]; outputs[round][rank]."""
    group = epmoe.HostGroup(world)

    def rank_main(rank):
        with torch.no_grad():
            comm = group.communicator(rank)
            if from_state_dict is None:
                moe = models.EPMoE.from_block(comm, block, precision,
                                              max_tokens_per_rank=MAX_TOKENS, timeout_ms=30_000,
                                              **options)
            else:
                moe = from_state_dict(comm)
            with moe:
                return [moe(xs[r][rank]) for r in range(len(xs))]

    per_rank = raise_first(run_ranks(world, rank_main, timeout=120))
    return [[per_rank[rank][r] for rank in range(world)] for r in range(len(xs))]


def parity(model, precision, world, **options):
    """(worst rel-L2 of epmoe, worst of transformers' bf16 block), both vs float64."""
    block, _ = make_block(model, seed=1)
    block64 = float64_copy(block)
    xs = [[make_tokens(t, seed=100 * r + rank) for rank, t in enumerate(tokens)]
          for r, tokens in enumerate(TOKENS[world])]
    ys = run_layers(block, precision, world, xs, **options)
    worst_ep = worst_hf = 0.0
    for r, tokens in enumerate(TOKENS[world]):
        for rank, t in enumerate(tokens):
            x, y = xs[r][rank], ys[r][rank]
            assert y.shape == x.shape and y.dtype == torch.bfloat16
            if t == 0:
                continue
            with torch.no_grad():
                ids, weights = models.route(block, x)
                hf = block_forward(block, x)
                ref = reference64(block64, x, ids, weights)
            worst_ep = max(worst_ep, rel_l2(y, ref))
            worst_hf = max(worst_hf, rel_l2(hf, ref))
    return worst_ep, worst_hf


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("model,precision", CASES)
def test_block_parity_with_transformers(model, precision, world):
    ep, hf = parity(model, precision, world)
    SEEN[(model, precision, world)] = (ep, hf)
    print(f"\n{model} {precision} world={world}: rel_l2 vs float64: epmoe {ep:.2e}, "
          f"transformers bf16 {hf:.2e} (bound {BOUND[precision]})")
    assert hf < BOUND["bf16"], f"transformers' own bf16 block: rel_l2 {hf} (noise floor)"
    assert ep < BOUND[precision], f"epmoe {precision}: rel_l2 {ep}, bound {BOUND[precision]}"


@pytest.mark.parametrize("model", MODELS)
def test_activation_is_the_models(model):
    """epmoe's activation is the block's: clamping SwiGLU (swiglu_limit, gpt-oss style) must
    show; for gpt-oss, so must SwiGLU instead of its own, and another clamp than its 7."""
    changes = [dict(activation="swiglu"), dict(swiglu_limit=3.0)] if model == "gpt_oss" else \
        [dict(swiglu_limit=0.05)]
    for options in changes:
        ep, _ = parity(model, "bf16", 1, **options)
        assert ep > BOUND["bf16"], (options, ep)


def checkpoint_state_dict(block, model, prefix):
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


PREFIX = "model.layers.0.mlp."


@pytest.mark.parametrize("naming", ["transformers", "checkpoint"])
@pytest.mark.parametrize("model", MODELS)
def test_state_dict_gives_the_blocks_weights_and_router(model, naming):
    block, config = make_block(model, seed=2)
    if naming == "transformers":
        sd = {PREFIX + k: v for k, v in block.state_dict().items()}
    else:
        sd = checkpoint_state_dict(block, model, PREFIX)
    world = 2
    for rank in range(world):
        w13, w2 = models.expert_weights(block, rank, world)
        s13, s2 = models.expert_weights_from_state_dict(sd, config, PREFIX, rank, world)
        spec = models.model_spec(config)
        e = spec.num_experts // world
        assert w13.shape == (e, 2 * spec.intermediate, spec.hidden)
        assert w2.shape == (e, spec.hidden, spec.intermediate)
        assert w13.dtype == s13.dtype == torch.bfloat16 and w2.dtype == torch.bfloat16
        assert torch.equal(w13, s13) and torch.equal(w2, s2)
        mine = slice(rank * e, (rank + 1) * e)  # expert e = rank * E_local + j
        if model == "gpt_oss":
            # gate_up_proj [E, H, 2I]: columns 0::2 gate, 1::2 up; down_proj [E, I, H]
            i = spec.intermediate
            gate_up = block.experts.gate_up_proj.detach()[mine].transpose(1, 2)
            assert torch.equal(w13[:, :i], gate_up[:, 0::2])
            assert torch.equal(w13[:, i:], gate_up[:, 1::2])
            assert torch.equal(w2, block.experts.down_proj.detach()[mine].transpose(1, 2))
            b13, b2 = models.expert_biases(block, rank, world)
            sb13, sb2 = models.expert_biases_from_state_dict(sd, config, PREFIX, rank, world)
            assert torch.equal(b13, sb13) and torch.equal(b2, sb2)
            bias = block.experts.gate_up_proj_bias.detach()[mine]
            assert torch.equal(b13[:, :i], bias[:, 0::2]) and torch.equal(b13[:, i:], bias[:, 1::2])
            assert torch.equal(b2, block.experts.down_proj_bias.detach()[mine])
        else:
            # gate rows then up rows of transformers' gate_up_proj; no biases
            assert torch.equal(w13, block.experts.gate_up_proj.detach()[mine])
            assert models.expert_biases(block, rank, world) is None
            assert models.expert_biases_from_state_dict(sd, config, PREFIX, rank, world) is None
    x = make_tokens(40, seed=5)
    router = models.Router.from_state_dict(sd, config, PREFIX)
    with torch.no_grad():
        ids, weights = router(x)
        bids, bweights = models.route(block, x)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids, bids) and torch.equal(weights, bweights)


@pytest.mark.parametrize("model", MODELS)
def test_layer_from_state_dict_equals_layer_from_block(model):
    block, config = make_block(model, seed=3)
    sd = checkpoint_state_dict(block, model, PREFIX)
    world = 2
    xs = [[make_tokens(t, seed=50 + rank) for rank, t in enumerate([17, 4])]]
    from_block = run_layers(block, "mxfp8", world, xs)

    def build(comm):
        return models.EPMoE.from_state_dict(comm, sd, config, PREFIX, "mxfp8",
                                            max_tokens_per_rank=MAX_TOKENS,
                                            shared_experts=getattr(block, "shared_experts", None))

    from_sd = run_layers(block, "mxfp8", world, xs, from_state_dict=build)
    for a, b in zip(from_block[0], from_sd[0]):
        assert torch.equal(a, b)


def test_layer_shape_and_spec_from_configs():
    s = models.layer_shape(make_config("deepseek_v3"), 64)
    assert (s.hidden, s.intermediate, s.num_experts, s.top_k, s.max_tokens_per_rank) == \
        (256, 128, 16, 4, 64)
    spec = models.model_spec(make_config("deepseek_v3"))
    assert (spec.n_group, spec.topk_group, spec.routed_scaling_factor,
            spec.has_shared_experts) == (4, 2, 2.5, True)
    # a config.json as a dict works too
    spec = models.model_spec({"model_type": "mixtral", "hidden_size": 4096,
                              "intermediate_size": 14336, "num_local_experts": 8,
                              "num_experts_per_tok": 2, "hidden_act": "silu"})
    assert spec.layer_shape(16) == epmoe.find_model("mixtral-8x7b").layer_shape(16)
    assert list(models.local_experts(16, 1, 4)) == [4, 5, 6, 7]
    # gpt-oss-120b's config.json (its MXFP4 weights dequantized by transformers on load)
    gpt_oss_120b = {"model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880,
                    "num_local_experts": 128, "num_experts_per_tok": 4, "swiglu_limit": 7.0,
                    "quantization_config": {"quant_method": "mxfp4", "dequantize": True}}
    spec = models.model_spec(gpt_oss_120b)
    assert spec.layer_shape(16) == epmoe.find_model("gpt-oss-120b").layer_shape(16)
    assert spec.layer_options() == {"activation": "swiglu_oai", "swiglu_limit": 7.0}
    assert spec.has_biases and models.model_spec(make_config("qwen3_moe")).layer_options() == {}


def test_gpt_oss_mxfp4_as_shipped_is_refused_naming_what_is_missing():
    block, config = make_block("gpt_oss", seed=6)
    shipped = dict(make_config("gpt_oss").to_dict(), quantization_config={"quant_method": "mxfp4"})
    with pytest.raises(models.UnsupportedModel, match="MXFP4 .*Mxfp4Config\\(dequantize=True\\)"):
        models.model_spec(shipped)
    # the checkpoint's tensors: blocks [E, 2I, H/32, 16] and scales [E, 2I, H/32], uint8
    e, i = config.num_local_experts, config.intermediate_size
    sd = {PREFIX + k: v for k, v in block.state_dict().items()
          if k not in ("experts.gate_up_proj", "experts.down_proj")}
    sd[PREFIX + "experts.gate_up_proj_blocks"] = torch.zeros(e, 2 * i, H // 32, 16,
                                                             dtype=torch.uint8)
    sd[PREFIX + "experts.gate_up_proj_scales"] = torch.zeros(e, 2 * i, H // 32, dtype=torch.uint8)
    for call in (models.expert_weights_from_state_dict, models.expert_biases_from_state_dict):
        with pytest.raises(models.UnsupportedModel, match="gate_up_proj_blocks: .*pre-quantized"):
            call(sd, config, PREFIX, 0, 2)
    # transformers' MXFP4 experts module: uint8 blocks in gate_up_proj
    with torch.no_grad():
        block.experts.gate_up_proj = torch.nn.Parameter(
            torch.zeros(e, 2 * i, H // 32, 16, dtype=torch.uint8), requires_grad=False)
    with pytest.raises(models.UnsupportedModel, match="torch.uint8: gpt-oss's MXFP4"):
        models.expert_weights(block, 0, 2)


def test_gpt_oss_alpha_other_than_1702_is_refused():
    block, _ = make_block("gpt_oss", seed=7)
    block.experts.alpha = 1.5
    with pytest.raises(models.UnsupportedModel, match="alpha=1.5: .*1.702"):
        models.expert_weights(block, 0, 1)


def test_fp8_checkpoints_are_refused_naming_what_is_missing():
    block, config = make_block("deepseek_v3", seed=4)
    sd = checkpoint_state_dict(block, "deepseek_v3", PREFIX)
    fp8 = {k: (v.to(torch.float8_e4m3fn) if ".experts." in k else v) for k, v in sd.items()}
    with pytest.raises(models.UnsupportedModel, match="FP8 checkpoints .* not supported yet"):
        models.expert_weights_from_state_dict(fp8, config, PREFIX, 0, 2)
    scaled = dict(sd)
    scaled[PREFIX + "experts.0.gate_proj.weight_scale_inv"] = torch.ones(1, 2)
    with pytest.raises(models.UnsupportedModel, match="weight_scale_inv"):
        models.expert_weights_from_state_dict(scaled, config, PREFIX, 0, 2)
    config_fp8 = make_config("deepseek_v3")
    config_fp8.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(models.UnsupportedModel, match="fp8_block128"):
        models.model_spec(config_fp8)


def test_other_activations_and_models_are_refused():
    config = make_config("qwen3_moe")
    config.hidden_act = "gelu"
    with pytest.raises(models.UnsupportedModel, match="silu"):
        models.model_spec(config)
    with pytest.raises(models.UnsupportedModel, match="model_type='llama'"):
        models.model_spec({"model_type": "llama"})


def test_qwen3_example_serves_one_layer_end_to_end_on_the_cpu_executor():
    import os
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "qwen3_moe_layer.py"
    env = dict(os.environ)
    package_parent = str(Path(epmoe.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
    p = subprocess.run([sys.executable, str(example), "--cpu", "--ranks", "2", "--precision",
                        "mxfp8"], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "T=  0 (idle)" in p.stdout and "rank 1 step 5" in p.stdout
    assert "logits rel_l2 vs transformers" in p.stdout

"""Hugging Face MoE blocks on epmoe's CPU executor against transformers' own blocks.

For Qwen3-MoE, Mixtral, DeepSeek-V3 and gpt-oss (tiny random configs built in code, bf16 weights
as shipped): the block's own forward vs its router's top-k -> epmoe ``Layer.forward`` (+ the
shared experts), for every precision the model's checkpoints allow (gpt-oss: bf16, mxfp8, mxfp4
quantized by epmoe), both measured against the block in float64 with the same routing (the rel-L2
bounds of docs/design.md §6). A changed layout mapping (gate/up order or interleave, transposes,
biases, a rank's expert range) or activation fails these tests. scripts/test.sh (CI) runs them in a
venv with pinned CPU torch and transformers; skipped, with the reason, without either.
"""

from __future__ import annotations

import copy

import pytest

try:
    import torch
    import transformers  # noqa: F401
except ImportError as e:  # EPMOE_TEST_TORCH=0, or no PyPI to install them from
    pytest.skip(f"Hugging Face parity tests need torch and transformers ({e})",
                allow_module_level=True)

import epmoe  # noqa: E402
from epmoe import models  # noqa: E402
from epmoe_ref import raise_first, run_ranks  # noqa: E402
from hf_ref import (  # noqa: E402
    BOUND,
    CASES,
    MODELS,
    SHIPPED,
    block_forward,
    checkpoint_state_dict,
    float64_copy,
    make_block,
    make_config,
    make_tokens,
    reference64,
    rel_l2,
    shipped_checkpoint,
    values_state_dict,
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


def test_gpt_oss_alpha_other_than_1702_is_refused():
    block, _ = make_block("gpt_oss", seed=7)
    block.experts.alpha = 1.5
    with pytest.raises(models.UnsupportedModel, match="alpha=1.5: .*1.702"):
        models.expert_weights(block, 0, 1)


# --------------------------------------------------------------- quantized checkpoints as shipped


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("model,precision", SHIPPED)
def test_shipped_checkpoint_gives_the_layer_of_its_values_and_transformers_parity(
        model, precision, world):
    """FP8 / MXFP4 codes and scales as the checkpoint ships them -> epmoe at the checkpoint's
    precision (the default) gives, bit for bit, the layer built from the values they decode to
    (decode -> re-encode is exact for both formats with these scale rules); and matches
    transformers' block run on those values in float64 within the format's bound."""
    block, config = make_block(model, seed=11)
    sd, dequantized = shipped_checkpoint(block, model, PREFIX)
    values = values_state_dict(block, dequantized, model, PREFIX)
    shared = getattr(block, "shared_experts", None)
    xs = [[make_tokens(t, seed=100 * r + rank) for rank, t in enumerate(tokens)]
          for r, tokens in enumerate(TOKENS[world])]

    def build(state_dict, layer_precision):
        return lambda comm: models.EPMoE.from_state_dict(
            comm, state_dict, config, PREFIX, layer_precision, max_tokens_per_rank=MAX_TOKENS,
            shared_experts=shared, timeout_ms=30_000)

    shipped = run_layers(block, None, world, xs, from_state_dict=build(sd, None))
    from_values = run_layers(block, None, world, xs, from_state_dict=build(values, precision))
    deq64, deq_bf16 = float64_copy(dequantized), copy.deepcopy(dequantized).to(torch.bfloat16)
    worst_ep = worst_hf = 0.0
    for r, tokens in enumerate(TOKENS[world]):
        for rank, t in enumerate(tokens):
            x, y = xs[r][rank], shipped[r][rank]
            assert y.shape == x.shape and y.dtype == torch.bfloat16
            assert torch.equal(y, from_values[r][rank]), (r, rank)
            if t == 0:
                continue
            with torch.no_grad():
                ids, weights = models.route(block, x)
                ref = reference64(deq64, x, ids, weights)
                worst_ep = max(worst_ep, rel_l2(y, ref))
                worst_hf = max(worst_hf, rel_l2(block_forward(deq_bf16, x), ref))
    print(f"\n{model} {precision} as shipped, world={world}: rel_l2 vs float64 of the dequantized "
          f"block: epmoe {worst_ep:.2e}, transformers bf16 {worst_hf:.2e} "
          f"(bound {BOUND[precision]})")
    assert worst_hf < BOUND["bf16"], f"transformers' bf16 block: rel_l2 {worst_hf}"
    assert worst_ep < BOUND[precision], f"epmoe {precision}: rel_l2 {worst_ep}"


def decode(q, precision):
    if precision == "fp8_block128":
        return epmoe.dequantize_fp8_block128(q.codes, q.scales)
    return epmoe.dequantize_mxfp4(q.codes.reshape(*q.scales.shape[:-1], -1), q.scales)


@pytest.mark.parametrize("model,precision", SHIPPED)
def test_shipped_state_dict_gives_the_checkpoints_codes_in_epmoes_layout(model, precision):
    """The codes are the checkpoint's own bytes (no re-quantization), reordered to w13 [E_local,
    2I, H] gate rows then up rows and w2 [E_local, H, I]: decoded, they are the values
    transformers' loaders give, in the layout the bf16 adapter gives them."""
    block, config = make_block(model, seed=12)
    sd, dequantized = shipped_checkpoint(block, model, PREFIX)
    world, i = 2, models.model_spec(config).intermediate
    for rank in range(world):
        q13, q2 = models.expert_weights_from_state_dict(sd, config, PREFIX, rank, world)
        assert isinstance(q13, epmoe.QuantizedWeights) and isinstance(q2, epmoe.QuantizedWeights)
        assert q13.codes.dtype == q2.codes.dtype == torch.uint8
        v13, v2 = models.expert_weights(dequantized, rank, world)
        assert torch.equal(decode(q13, precision), v13) and torch.equal(decode(q2, precision), v2)
        first = rank * len(q13.codes)
        if precision == "fp8_block128":
            gate, up, down = (("w1", "w3", "w2") if model == "mixtral" else
                              ("gate_proj", "up_proj", "down_proj"))
            on_disk = PREFIX.replace(".mlp.", ".block_sparse_moe.") if model == "mixtral" \
                else PREFIX
            w = f"{on_disk}experts.{first}.{{}}.weight"
            assert torch.equal(q13.codes[0, :i], sd[w.format(gate)].view(torch.uint8))
            assert torch.equal(q13.codes[0, i:], sd[w.format(up)].view(torch.uint8))
            assert torch.equal(q13.scales[0], torch.cat([sd[w.format(gate) + "_scale_inv"],
                                                         sd[w.format(up) + "_scale_inv"]]))
            assert torch.equal(q2.scales[0], sd[w.format(down) + "_scale_inv"])
        else:
            blocks = sd[PREFIX + "experts.gate_up_proj_blocks"][first]
            assert torch.equal(q13.codes[0, :i], blocks[0::2])  # gpt-oss: even rows gate
            assert torch.equal(q13.codes[0, i:], blocks[1::2])
            assert torch.equal(q2.codes[0], sd[PREFIX + "experts.down_proj_blocks"][first])
            b13, b2 = models.expert_biases_from_state_dict(sd, config, PREFIX, rank, world)
            assert torch.equal(b13, models.expert_biases(block, rank, world)[0])


def fp8_block(seed):
    """A DeepSeek-V3 block whose experts are transformers' FP8Experts holding its FP8
    checkpoint (as transformers loads it: gate_up_proj float8 [E, 2I, H], gate_up_proj_scale_inv
    [E, 2I/128, H/128], down_proj, down_proj_scale_inv), and that checkpoint."""
    from transformers.integrations.finegrained_fp8 import FP8Experts

    block, config = make_block("deepseek_v3", seed=seed)
    sd, _ = shipped_checkpoint(block, "deepseek_v3", PREFIX)
    experts = FP8Experts(config, block_size=(128, 128))
    with torch.no_grad():
        for e in range(config.n_routed_experts):
            w = f"{PREFIX}experts.{e}.{{}}.weight"
            for fused, parts in (("gate_up_proj", ("gate_proj", "up_proj")),
                                 ("down_proj", ("down_proj",))):
                codes = torch.cat([sd[w.format(p)].view(torch.uint8) for p in parts])
                getattr(experts, fused).view(torch.uint8)[e].copy_(codes)
                getattr(experts, fused + "_scale_inv")[e].copy_(
                    torch.cat([sd[w.format(p) + "_scale_inv"] for p in parts]))
    block.experts = experts
    return block, config, sd


def test_fp8_block_and_its_state_dict_give_the_checkpoints_layer():
    """transformers' FP8 block (EPMoE.from_block) and its state dict's fused names
    (gate_up_proj + gate_up_proj_scale_inv) give the layer of the per-expert checkpoint."""
    block, config, sd = fp8_block(seed=13)
    fused_sd = {PREFIX + k: v for k, v in block.state_dict().items()}
    assert fused_sd[PREFIX + "experts.gate_up_proj"].dtype == torch.float8_e4m3fn
    world = 2
    for rank in range(world):
        want = models.expert_weights_from_state_dict(sd, config, PREFIX, rank, world)
        for got in (models.expert_weights(block, rank, world),
                    models.expert_weights_from_state_dict(fused_sd, config, PREFIX, rank, world)):
            for a, b in zip(got, want):
                assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
    xs = [[make_tokens(t, seed=60 + rank) for rank, t in enumerate([17, 4])]]
    from_block = run_layers(block, None, world, xs)

    def build(comm):
        return models.EPMoE.from_state_dict(comm, sd, config, PREFIX,
                                            max_tokens_per_rank=MAX_TOKENS,
                                            shared_experts=block.shared_experts)

    for a, b in zip(from_block[0], run_layers(block, None, world, xs, from_state_dict=build)[0]):
        assert torch.equal(a, b)


def test_shipped_checkpoints_refusals_name_the_tensor():
    block, config = make_block("deepseek_v3", seed=14)
    sd, _ = shipped_checkpoint(block, "deepseek_v3", PREFIX)
    w = PREFIX + "experts.{}.{}.weight"
    comm = epmoe.HostGroup(1).communicator(0)
    # another precision than the checkpoint's: no dequantize / re-quantize
    with pytest.raises(models.UnsupportedModel, match="ships fp8_block128 .*not 'mxfp8'"):
        models.EPMoE.from_state_dict(comm, sd, config, PREFIX, "mxfp8", max_tokens_per_rank=8)
    missing = {k: v for k, v in sd.items() if k != w.format(1, "up_proj") + "_scale_inv"}
    with pytest.raises(models.UnsupportedModel,
                       match=r"experts\.1\.up_proj\.weight_scale_inv is missing"):
        models.expert_weights_from_state_dict(missing, config, PREFIX, 0, 2)
    unscaled = {k: v for k, v in sd.items() if not k.endswith("_scale_inv")}
    with pytest.raises(models.UnsupportedModel, match="is float8_e4m3fn without its "
                       "'weight_scale_inv'"):
        models.expert_weights_from_state_dict(unscaled, config, PREFIX, 0, 2)
    bad = dict(sd)
    bad[w.format(2, "down_proj") + "_scale_inv"] = torch.ones(2, 2)
    with pytest.raises(models.UnsupportedModel, match=r"experts\.2\.down_proj\.weight_scale_inv "
                       r"has shape \(2, 2\) .*expected \(2, 1\)"):
        models.expert_weights_from_state_dict(bad, config, PREFIX, 0, 2)
    # I = 192: a 128-row tile of w13 would hold gate and up rows
    odd = make_config("qwen3_moe")
    odd.moe_intermediate_size = 192
    odd_sd = {}
    for e in range(odd.num_experts):
        for name, shape in (("gate_proj", (192, 256)), ("up_proj", (192, 256)),
                            ("down_proj", (256, 192))):
            odd_sd[w.format(e, name)] = torch.zeros(shape).to(torch.float8_e4m3fn)
            odd_sd[w.format(e, name) + "_scale_inv"] = torch.ones(-(-shape[0] // 128), 2)
    with pytest.raises(models.UnsupportedModel, match=r"experts\.0\.gate_proj\.weight_scale_inv: "
                       "I=192 is not a multiple of 128"):
        models.expert_weights_from_state_dict(odd_sd, odd, PREFIX, 0, 1)
    # gpt-oss: MXFP4 tensors of another dtype or shape
    gpt, gpt_config = make_block("gpt_oss", seed=15)
    mx, _ = shipped_checkpoint(gpt, "gpt_oss", PREFIX)
    wrong = dict(mx, **{PREFIX + "experts.down_proj_scales":
                        mx[PREFIX + "experts.down_proj_scales"].to(torch.int32)})
    with pytest.raises(models.UnsupportedModel, match="down_proj_scales is torch.int32|"
                       "down_proj_scales is int32, expected uint8"):
        models.expert_weights_from_state_dict(wrong, gpt_config, PREFIX, 0, 2)
    short = dict(mx, **{PREFIX + "experts.gate_up_proj_blocks":
                        mx[PREFIX + "experts.gate_up_proj_blocks"][:, :-2]})
    with pytest.raises(models.UnsupportedModel, match=r"gate_up_proj_blocks has shape "
                       r"\(4, 382, 8, 16\) .*expected \(4, 384, 8, 16\)"):
        models.expert_weights_from_state_dict(short, gpt_config, PREFIX, 0, 2)
    # transformers' MXFP4 experts module (uint8 blocks, scales swizzled for triton's kernels)
    e, i, h = gpt_config.num_local_experts, gpt_config.intermediate_size, gpt_config.hidden_size
    with torch.no_grad():
        gpt.experts.gate_up_proj = torch.nn.Parameter(
            torch.zeros(e, 2 * i, h // 32, 16, dtype=torch.uint8), requires_grad=False)
    with pytest.raises(models.UnsupportedModel, match="torch.uint8|uint8: .*Mxfp4GptOssExperts.*"
                       "from_state_dict"):
        models.expert_weights(gpt, 0, 2)


def test_quantization_configs():
    """The config's quantization_config: FP8 in 128 x 128 tiles with dynamic activation scales
    and MXFP4 are read (as shipped, or dequantized by transformers); others are refused."""
    def with_quantization(model, **q):
        return dict(make_config(model).to_dict(), quantization_config=q)

    for q in ({"quant_method": "fp8", "weight_block_size": [128, 128],
               "activation_scheme": "dynamic", "fmt": "e4m3"}, {"quant_method": "fp8"}):
        assert models.model_spec(with_quantization("deepseek_v3", **q)).intermediate == 128
    assert models.model_spec(with_quantization("gpt_oss", quant_method="mxfp4")).has_biases
    with pytest.raises(models.UnsupportedModel, match=r"weight_block_size=\[1, 128\]"):
        models.model_spec(with_quantization("deepseek_v3", quant_method="fp8",
                                            weight_block_size=[1, 128]))
    with pytest.raises(models.UnsupportedModel, match="activation_scheme='static'"):
        models.model_spec(with_quantization("qwen3_moe", quant_method="fp8",
                                            activation_scheme="static"))
    with pytest.raises(models.UnsupportedModel, match="quant_method='gptq'"):
        models.model_spec(with_quantization("mixtral", quant_method="gptq"))


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

"""Hugging Face MoE blocks on epmoe: Qwen3-MoE, Mixtral, DeepSeek-V3 (routed experts) and gpt-oss.

The router and the shared experts stay in the model (in torch); epmoe runs the routed experts.
docs/models.md has each model's layout and router; in short, transformers 5.x keeps a block's
routed experts fused, as epmoe wants them::

    block.experts.gate_up_proj [E, 2I, H] (rows :I gate, I: up) -> w13 [E_local, 2I, H]
    block.experts.down_proj    [E, H, I]                        -> w2  [E_local, H, I]

and checkpoints on disk keep one matrix per expert (``experts.{e}.gate_proj.weight`` [I, H], or
Mixtral's ``w1`` = gate, ``w3`` = up, ``w2`` = down), which are stacked the same way. gpt-oss
keeps its experts transposed with gate and up interleaved, and has biases::

    experts.gate_up_proj      [E, H, 2I] (columns 0::2 gate, 1::2 up) -> w13 [E_local, 2I, H]
    experts.gate_up_proj_bias [E, 2I]    (0::2 gate, 1::2 up)         -> b13 [E_local, 2I]
    experts.down_proj         [E, I, H]                               -> w2  [E_local, H, I]
    experts.down_proj_bias    [E, H]                                  -> b2  [E_local, H]

with ``activation="swiglu_oai"`` and its ``swiglu_limit``. Expert e lives on rank e // E_local;
only this rank's experts are read. bf16 tensors keep their dtype (the layer quantizes them to its
precision itself). Quantized checkpoints are taken as shipped, their codes and scales handed to
the layer as :class:`epmoe.QuantizedWeights` in the checkpoint's own format, with no dequantizing
and re-quantizing::

    FP8 (DeepSeek-V3/R1; Qwen3-MoE and Mixtral FP8 checkpoints alike), precision fp8_block128:
    experts.{e}.gate_proj.weight float8_e4m3fn [I, H] + .weight_scale_inv f32 [I/128, ceil(H/128)]
    experts.{e}.up_proj ... , experts.{e}.down_proj ... [H, I] + [ceil(H/128), ceil(I/128)]
        -> w13 codes [E_local, 2I, H] (gate rows, then up rows), scales [E_local, 2I/128, ...]
    (I must be a multiple of 128, so that no 128-row tile straddles gate and up rows)

    MXFP4 (gpt-oss), precision mxfp4:
    experts.gate_up_proj_blocks u8 [E, 2I, H/32, 16], _scales u8 [E, 2I, H/32] (rows 0::2 gate,
    1::2 up) -> w13 blocks and scales, gate rows then up rows
    experts.down_proj_blocks u8 [E, H, I/32, 16], _scales u8 [E, H, I/32] -> w2 as they are

A layer built from such weights runs at the checkpoint's precision (the default when none is
given); asking for another is refused.

From a block (the module object)::

    moe = epmoe.models.EPMoE.from_block(comm, block, "mxfp8", max_tokens_per_rank=256)
    y = moe(hidden)          # = block(hidden): block's router, epmoe experts, + shared experts

From a checkpoint's state dict (or a lazy mapping, e.g. safetensors' ``safe_open``) and config::

    moe = epmoe.models.EPMoE.from_state_dict(comm, state_dict, config, "model.layers.3.mlp",
                                              "bf16", max_tokens_per_rank=256, device="cuda")

Lower level: :func:`expert_weights` / :func:`expert_weights_from_state_dict` (this rank's
``w13, w2``), :func:`expert_biases` / :func:`expert_biases_from_state_dict` (gpt-oss's ``b13,
b2``), :func:`layer_shape`, :func:`route` (the block's own router) and :class:`Router` (the same
router from a state dict).

Refused with :class:`UnsupportedModel`: other models and activations, FP8 with tiles other than
128 x 128 or static activation scales, other quantization methods, and transformers' MXFP4
experts module (its codes and scales are swizzled for triton's kernels; build from the
checkpoint's state dict instead).

torch is imported when a function here is called, not when ``epmoe`` is imported.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any, Mapping, NamedTuple, Optional

from ._epmoe import Communicator, LayerShape

__all__ = [
    "EPMoE",
    "MoeSpec",
    "Router",
    "SUPPORTED_MODELS",
    "UnsupportedModel",
    "expert_biases",
    "expert_biases_from_state_dict",
    "expert_weights",
    "expert_weights_from_state_dict",
    "layer_shape",
    "local_experts",
    "model_spec",
    "route",
]

#: model_type values (``config.model_type``) the adapters take.
SUPPORTED_MODELS = ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss")

# The precision a layer takes each checkpoint format at, as shipped.
_FP8 = "fp8_block128"  # float8_e4m3fn weights + float32 weight_scale_inv per 128 x 128 tile
_MXFP4 = "mxfp4"  # uint8 *_blocks (E2M1 pairs) + uint8 *_scales (UE8M0 per 32)
_FP8_TILE = 128
_MXFP4_BLOCK = 32
_MXFP4_BLOCKS_FROM_STATE_DICT = (
    "gpt-oss's MXFP4 experts as transformers holds them (Mxfp4GptOssExperts) are not read: its "
    "codes and scales are swizzled for triton's kernels. Build the layer from the checkpoint's "
    "state dict (EPMoE.from_state_dict: experts.gate_up_proj_blocks / _scales, "
    "down_proj_blocks / _scales, taken as shipped at precision mxfp4), or load the model "
    "dequantized (Mxfp4Config(dequantize=True))")
# transformers' GptOssExperts.alpha; epmoe's swiglu_oai fixes it (kSwigluOaiAlpha, config.hpp).
_SWIGLU_OAI_ALPHA = 1.702
_SWIGLU_OAI_DEFAULT_LIMIT = 7.0  # GptOssExperts.limit; Mxfp4GptOssExperts: config.swiglu_limit


class UnsupportedModel(ValueError):
    """A model, checkpoint format or layout the adapters cannot map to epmoe (yet)."""


@dataclass(frozen=True)
class MoeSpec:
    """What epmoe needs from a model's config (one MoE layer)."""

    model_type: str  # "qwen3_moe" | "mixtral" | "deepseek_v3" | "gpt_oss"
    hidden: int
    intermediate: int  # the routed experts' intermediate size
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    routed_scaling_factor: float = 1.0  # DeepSeek-V3
    n_group: int = 1  # DeepSeek-V3
    topk_group: int = 1  # DeepSeek-V3
    has_shared_experts: bool = False
    # gpt-oss: biases on both projections (b13, b2), a bias on the router, its activation.
    has_biases: bool = False
    activation: str = "swiglu"
    swiglu_limit: Optional[float] = None  # None: the activation's default (Layer's rule)

    def layer_shape(self, max_tokens_per_rank: int) -> LayerShape:
        return LayerShape(hidden=self.hidden, intermediate=self.intermediate,
                          num_experts=self.num_experts, top_k=self.top_k,
                          max_tokens_per_rank=max_tokens_per_rank)

    def layer_options(self) -> dict:
        """The :class:`epmoe.Layer` keyword arguments the model's experts need."""
        if self.activation == "swiglu":
            return {}
        return {"activation": self.activation, "swiglu_limit": self.swiglu_limit}


def _cfg(config: Any) -> Any:
    return SimpleNamespace(**config) if isinstance(config, Mapping) else config


def _get(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def _check_quantization(config: Any) -> None:
    """The checkpoint formats the adapters read as shipped: FP8 in 128 x 128 tiles with dynamic
    activation scales (DeepSeek-V3's ``quant_method="fp8"``) and MXFP4 (gpt-oss's). Whether a
    layer's weights are quantized is read from the tensors themselves."""
    q = _get(config, "quantization_config")
    if q is None:
        return

    def field(name: str) -> Any:
        return q.get(name) if isinstance(q, Mapping) else getattr(q, name, None)

    method = field("quant_method")
    method = str(getattr(method, "value", method)).lower()
    if method == "mxfp4":
        return
    if method == "fp8":
        block = field("weight_block_size")
        if block is not None and [int(b) for b in block] != [_FP8_TILE, _FP8_TILE]:
            raise UnsupportedModel(f"quantization_config.weight_block_size={list(block)}: epmoe's "
                                   f"{_FP8} takes weights in {_FP8_TILE} x {_FP8_TILE} tiles "
                                   "(DeepSeek-V3's) only")
        scheme = field("activation_scheme")
        if scheme not in (None, "dynamic"):
            raise UnsupportedModel(f"quantization_config.activation_scheme={scheme!r}: epmoe "
                                   f"scales {_FP8} activations per 1 x 128 run as it sends them "
                                   "(dynamic); a checkpoint's static activation scales are not "
                                   "taken")
        return
    raise UnsupportedModel(f"quantization_config.quant_method={method!r}: the adapters read bf16 "
                           "or f32 weights, FP8 (quant_method 'fp8', 128 x 128 tiles) and MXFP4 "
                           "(gpt-oss) checkpoints; load an unquantized checkpoint")


def model_spec(config: Any) -> MoeSpec:
    """The :class:`MoeSpec` of a transformers config (or a config.json dict). Raises
    :class:`UnsupportedModel` for other models, quantization methods other than FP8 in 128 x 128
    tiles and MXFP4, and, but for gpt-oss, activations other than SiLU (epmoe computes
    silu(gate) * up)."""
    config = _cfg(config)
    model_type = str(_get(config, "model_type", default=""))
    if model_type not in SUPPORTED_MODELS:
        raise UnsupportedModel(f"model_type={model_type!r}: the adapters take "
                               f"{', '.join(SUPPORTED_MODELS)}")
    _check_quantization(config)
    hidden = int(config.hidden_size)
    if model_type == "gpt_oss":  # hidden_act is unused: its experts hard-code their activation
        # The router's softmax over the top-k logits is normalised by construction.
        return MoeSpec(model_type, hidden, int(config.intermediate_size),
                       int(_get(config, "num_local_experts")), int(config.num_experts_per_tok),
                       norm_topk_prob=True, has_biases=True, activation="swiglu_oai",
                       swiglu_limit=float(_get(config, "swiglu_limit",
                                               default=_SWIGLU_OAI_DEFAULT_LIMIT)))
    act = str(_get(config, "hidden_act", default="silu"))
    if act not in ("silu", "swish"):
        raise UnsupportedModel(f"{model_type}: hidden_act={act!r}: epmoe's experts compute "
                               "silu(gate) * up only")
    if model_type == "mixtral":
        return MoeSpec(model_type, hidden, int(config.intermediate_size),
                       int(_get(config, "num_local_experts")),
                       int(config.num_experts_per_tok), norm_topk_prob=True)
    if model_type == "qwen3_moe":
        return MoeSpec(model_type, hidden, int(config.moe_intermediate_size),
                       int(_get(config, "num_experts")), int(config.num_experts_per_tok),
                       norm_topk_prob=bool(_get(config, "norm_topk_prob", default=False)))
    # deepseek_v3
    return MoeSpec(model_type, hidden, int(config.moe_intermediate_size),
                   int(_get(config, "n_routed_experts", "num_local_experts")),
                   int(config.num_experts_per_tok),
                   norm_topk_prob=bool(_get(config, "norm_topk_prob", default=True)),
                   routed_scaling_factor=float(_get(config, "routed_scaling_factor", default=1.0)),
                   n_group=int(_get(config, "n_group", default=1)),
                   topk_group=int(_get(config, "topk_group", default=1)),
                   has_shared_experts=int(_get(config, "n_shared_experts", default=0)) > 0)


def layer_shape(config: Any, max_tokens_per_rank: int) -> LayerShape:
    """epmoe's :class:`LayerShape` of one MoE layer of ``config``."""
    return model_spec(config).layer_shape(max_tokens_per_rank)


def local_experts(num_experts: int, rank: int, world: int) -> range:
    """The experts rank ``rank`` owns: e // E_local == rank."""
    if world < 1 or not 0 <= rank < world or num_experts % world:
        raise ValueError(f"num_experts={num_experts}, rank={rank}, world={world}: num_experts must "
                         "be a multiple of world and 0 <= rank < world")
    e_local = num_experts // world
    return range(rank * e_local, (rank + 1) * e_local)


# --------------------------------------------------------------------------- weights


class _Experts(NamedTuple):
    """This rank's experts for the layer: w13, w2 as values (``precision`` None), or as
    :class:`epmoe.QuantizedWeights` in the checkpoint's own format (``precision``), read from the
    tensors ``where`` names."""

    w13: Any
    w2: Any
    precision: Optional[str] = None
    where: str = ""


def _dtype_name(t: Any) -> str:
    return str(getattr(t, "dtype", "")).replace("torch.", "")


def _refuse_dtype(spec: MoeSpec, name: str, t: Any) -> None:
    """Values must be floats: quantized codes reach here only without their scales."""
    dtype = _dtype_name(t)
    if dtype.startswith("float8"):
        raise UnsupportedModel(f"{name} is {dtype} without its 'weight_scale_inv' (FP8 weights "
                               f"are read with their {_FP8_TILE} x {_FP8_TILE} block scales, as "
                               "DeepSeek-V3 ships them)")
    if dtype in ("uint8", "int8"):
        if spec.model_type == "gpt_oss":
            raise UnsupportedModel(f"{name} is {dtype}: {_MXFP4_BLOCKS_FROM_STATE_DICT}")
        raise UnsupportedModel(f"{name} is {dtype} (packed quantized weights): epmoe reads bf16 "
                               "or f32 values, FP8 with 'weight_scale_inv' and gpt-oss's MXFP4")


def _router_module(block: Any) -> Any:
    """The block's router: ``.gate`` (Qwen3-MoE, Mixtral, DeepSeek-V3) or ``.router``
    (gpt-oss)."""
    gate = getattr(block, "gate", None)
    return gate if gate is not None else getattr(block, "router", None)


def _block_config(block: Any) -> Any:
    for owner in (block, getattr(block, "experts", None), _router_module(block)):
        config = getattr(owner, "config", None)
        if config is not None:
            return config
    return None


def _block_spec(block: Any) -> MoeSpec:
    """The spec of a transformers MoE block, from its config and the block's own attributes."""
    name = type(block).__name__
    experts = getattr(block, "experts", None)
    config = _block_config(block)
    if config is None:
        raise UnsupportedModel(f"{name}: no config on the block or its experts; use "
                               "from_state_dict(state_dict, config, ...) instead")
    spec = model_spec(config)
    if experts is None or _router_module(block) is None:
        raise UnsupportedModel(f"{name}: expected a MoE block with .gate or .router (the router) "
                               "and .experts (transformers' {Qwen3MoeSparseMoeBlock, "
                               "MixtralSparseMoeBlock, DeepseekV3MoE, GptOssMLP}); got neither "
                               "or one")
    if spec.model_type == "gpt_oss":
        # The module's constants are what its forward computes (GptOssExperts hard-codes its
        # limit; transformers' MXFP4 experts read config.swiglu_limit).
        alpha = float(getattr(experts, "alpha", _SWIGLU_OAI_ALPHA))
        if alpha != _SWIGLU_OAI_ALPHA:
            raise UnsupportedModel(f"{name}.experts.alpha={alpha}: epmoe's swiglu_oai fixes the "
                                   f"sigmoid scale at {_SWIGLU_OAI_ALPHA} (gpt-oss's)")
        spec = replace(spec, swiglu_limit=float(getattr(experts, "limit", spec.swiglu_limit)))
    return spec


def _model_layout(spec: MoeSpec) -> tuple:
    """(transposed, concatenated) of the model's fused gate_up_proj in memory and on disk."""
    return (True, False) if spec.model_type == "gpt_oss" else (False, True)


def _deinterleave(t: Any) -> Any:
    """[E, 2I, ...] with gate and up interleaved along dim 1 (gate0, up0, gate1, ...) -> gate
    rows, then up rows."""
    import torch

    return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)


def _check_shapes(spec: MoeSpec, w13: Any, w2: Any, n: int, names: str) -> None:
    h, i = spec.hidden, spec.intermediate
    if tuple(w13.shape) != (n, 2 * i, h) or tuple(w2.shape) != (n, h, i):
        raise UnsupportedModel(f"{names}: this rank's w13 / w2 have shapes {tuple(w13.shape)} / "
                               f"{tuple(w2.shape)}, expected ({n}, {2 * i}, {h}) / "
                               f"({n}, {h}, {i}) from the config")


def _from_fused(spec: MoeSpec, gate_up: Any, down: Any, chosen: range, where: str,
                transposed: bool, concatenated: bool, scale_inv: tuple = (None, None)) -> _Experts:
    """transformers 5's fused experts: gate_up_proj [E, 2I, H] (gate rows, then up rows) and
    down_proj [E, H, I] (``transposed``: [E, H, 2I] and [E, I, H]; not ``concatenated``: gate
    and up interleaved, gate0, up0, gate1, ...) -> this rank's w13 [E_local, 2I, H], w2. FP8
    (float8_e4m3fn, or ``scale_inv`` given: gate_up_proj_scale_inv, down_proj_scale_inv) ->
    :func:`_fp8_from_fused`."""
    fp8 = _dtype_name(gate_up).startswith("float8") or any(t is not None for t in scale_inv)
    if fp8 and (transposed, concatenated) == (False, True):  # transformers' FP8Experts
        return _fp8_from_fused(spec, gate_up, scale_inv[0], down, scale_inv[1], chosen, where)
    _refuse_dtype(spec, f"{where}.gate_up_proj", gate_up)
    _refuse_dtype(spec, f"{where}.down_proj", down)
    sel = slice(chosen.start, chosen.stop)
    w13, w2 = gate_up.detach()[sel], down.detach()[sel]
    if transposed:
        w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
    if not concatenated:
        w13 = _deinterleave(w13)
    _check_shapes(spec, w13, w2, len(chosen), f"{where}.gate_up_proj / down_proj")
    return _Experts(w13.contiguous(), w2.contiguous())


def _biases_from_fused(spec: MoeSpec, gate_up_bias: Any, down_bias: Any, chosen: range,
                       where: str, concatenated: bool):
    """gate_up_proj_bias [E, 2I] (interleaved unless ``concatenated``) and down_proj_bias [E, H]
    -> this rank's b13 [E_local, 2I] (gate biases, then up biases), b2 [E_local, H]."""
    sel = slice(chosen.start, chosen.stop)
    b13, b2 = gate_up_bias.detach()[sel], down_bias.detach()[sel]
    if not concatenated:
        b13 = _deinterleave(b13)
    n, h, i = len(chosen), spec.hidden, spec.intermediate
    if tuple(b13.shape) != (n, 2 * i) or tuple(b2.shape) != (n, h):
        raise UnsupportedModel(f"{where}.gate_up_proj_bias / down_proj_bias: this rank's b13 / b2 "
                               f"have shapes {tuple(b13.shape)} / {tuple(b2.shape)}, expected "
                               f"({n}, {2 * i}) / ({n}, {h}) from the config")
    return b13.contiguous(), b2.contiguous()


def _stack_gate_up(mats: list) -> tuple:
    """One (gate [I, ...], up [I, ...], down) per local expert -> ([E_local, 2I, ...] gate rows,
    then up rows; the downs stacked): weights, and FP8's row-block scales alike."""
    import torch

    return (torch.stack([torch.cat([g.detach(), u.detach()]) for g, u, _ in mats]),
            torch.stack([d.detach() for _, _, d in mats]))


def _from_per_expert(spec: MoeSpec, mats: list, where: str) -> _Experts:
    """One (gate [I, H], up [I, H], down [H, I]) per local expert -> w13, w2."""
    for n, (g, u, d) in enumerate(mats):
        for what, t in (("gate", g), ("up", u), ("down", d)):
            _refuse_dtype(spec, f"{where} (local expert {n}, {what})", t)
    w13, w2 = _stack_gate_up(mats)
    _check_shapes(spec, w13, w2, len(mats), where)
    return _Experts(w13.contiguous(), w2.contiguous())


def _expect(t: Any, shape: tuple, name: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise UnsupportedModel(f"{name} has shape {tuple(t.shape)} (this rank's part), expected "
                               f"{tuple(shape)} from the config")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _fp8_codes(t: Any, name: str) -> Any:
    """float8_e4m3fn weights as their uint8 view: the codes the layer takes."""
    import torch

    if _dtype_name(t) != "float8_e4m3fn":
        raise UnsupportedModel(f"{name} is {_dtype_name(t)}, expected float8_e4m3fn: it comes "
                               "with a 'weight_scale_inv' (FP8 block scales)")
    return t.detach().view(torch.uint8)


def _fp8_scales(t: Any, name: str) -> Any:
    """weight_scale_inv as float32: as shipped, or from transformers' E8M0 (scale_fmt "ue8m0"),
    whose powers of two float32 holds exactly."""
    import torch

    if t is None:
        raise UnsupportedModel(f"{name} is missing: FP8 weights are read with their "
                               f"{_FP8_TILE} x {_FP8_TILE} block scales")
    dtype = _dtype_name(t)
    if dtype == "float8_e8m0fnu":
        return t.detach().to(torch.float32)
    if dtype != "float32":
        raise UnsupportedModel(f"{name} is {dtype}, expected float32 (or float8_e8m0fnu) scales, "
                               f"one per {_FP8_TILE} x {_FP8_TILE} tile")
    return t.detach()


def _fp8_tiles(spec: MoeSpec, name: str) -> None:
    """w13 stacks gate's I rows on up's: its 128-row tiles are gate's and up's own tiles (and
    the scales concatenate exactly) only when 128 divides I."""
    if spec.intermediate % _FP8_TILE:
        raise UnsupportedModel(f"{name}: I={spec.intermediate} is not a multiple of {_FP8_TILE}: "
                               f"one of w13's {_FP8_TILE}-row tiles ({_FP8}) would hold rows of "
                               "gate and of up, which the checkpoint scales separately")


def _fp8_shapes(spec: MoeSpec) -> dict:
    """Per expert: codes and weight_scale_inv of gate / up [I, H] and down [H, I]."""
    h, i = spec.hidden, spec.intermediate
    th, ti = _ceil_div(h, _FP8_TILE), _ceil_div(i, _FP8_TILE)
    return {"gate_up": ((i, h), (ti, th)), "down": ((h, i), (th, ti))}


def _fp8_experts(w13: Any, s13: Any, w2: Any, s2: Any, where: str) -> _Experts:
    from . import QuantizedWeights

    return _Experts(QuantizedWeights(w13.contiguous(), s13.contiguous()),
                    QuantizedWeights(w2.contiguous(), s2.contiguous()), _FP8, where)


def _fp8_from_per_expert(spec: MoeSpec, mats: list, scales: list, keys: list,
                         where: str) -> _Experts:
    """FP8 checkpoints' (DeepSeek-V3's) matrices: per local expert (gate, up, down) float8_e4m3fn
    [out, in] with their weight_scale_inv float32 [ceil(out/128), ceil(in/128)], ``keys`` their
    names -> w13 codes [E_local, 2I, H] and scales [E_local, 2I/128, ceil(H/128)] (gate's, then
    up's), w2 codes and scales stacked."""
    _fp8_tiles(spec, keys[0][0] + "_scale_inv")
    shapes = _fp8_shapes(spec)
    codes, inv = [], []
    for weights, scale_invs, names in zip(mats, scales, keys):
        codes.append(tuple(_fp8_codes(t, name) for t, name in zip(weights, names)))
        inv.append(tuple(_fp8_scales(s, name + "_scale_inv")
                         for s, name in zip(scale_invs, names)))
        for t, s, name, kind in zip(codes[-1], inv[-1], names, ("gate_up", "gate_up", "down")):
            _expect(t, shapes[kind][0], name)
            _expect(s, shapes[kind][1], name + "_scale_inv")
    (w13, w2), (s13, s2) = _stack_gate_up(codes), _stack_gate_up(inv)
    return _fp8_experts(w13, s13, w2, s2, where)


def _fp8_from_fused(spec: MoeSpec, gate_up: Any, gate_up_scale_inv: Any, down: Any,
                    down_scale_inv: Any, chosen: range, where: str) -> _Experts:
    """transformers' FP8 experts (``FP8Experts``, and its state dict): gate_up_proj [E, 2I, H]
    float8_e4m3fn (gate rows, then up rows) with gate_up_proj_scale_inv [E, 2I/128, ceil(H/128)],
    down_proj [E, H, I] with down_proj_scale_inv -> this rank's codes and scales."""
    names = [f"{where}.{n}" for n in ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj",
                                      "down_proj_scale_inv")]
    _fp8_tiles(spec, names[1])
    sel = slice(chosen.start, chosen.stop)
    w13, w2 = _fp8_codes(gate_up, names[0])[sel], _fp8_codes(down, names[2])[sel]
    s13 = _fp8_scales(gate_up_scale_inv, names[1])[sel]
    s2 = _fp8_scales(down_scale_inv, names[3])[sel]
    (gate, gate_tiles), (down_shape, down_tiles) = _fp8_shapes(spec).values()
    n = len(chosen)
    for t, shape, name in zip((w13, s13, w2, s2),
                              ((2 * gate[0], gate[1]), (2 * gate_tiles[0], gate_tiles[1]),
                               down_shape, down_tiles), names):
        _expect(t, (n, *shape), name)
    return _fp8_experts(w13, s13, w2, s2, f"{names[0]} / {names[2]}")


def _mxfp4_from_blocks(spec: MoeSpec, tensor: Any, chosen: range, where: str) -> _Experts:
    """gpt-oss's MXFP4 checkpoint, ``tensor(name)`` its tensors under ``where``: *_blocks
    [E, N, K/32, 16] uint8 (E2M1 pairs, element 2j in the low nibble) and *_scales [E, N, K/32]
    uint8 (UE8M0), N x K = 2I x H for gate_up_proj, whose rows interleave gate (0::2) and up
    (1::2), and H x I for down_proj -> this rank's codes and scales, gate rows first."""
    from . import QuantizedWeights

    sel = slice(chosen.start, chosen.stop)
    n, h, i = len(chosen), spec.hidden, spec.intermediate
    shapes = {"gate_up_proj": (2 * i, h // _MXFP4_BLOCK), "down_proj": (h, i // _MXFP4_BLOCK)}
    parts = {}
    for proj, (rows, blocks) in shapes.items():
        for kind, shape in (("blocks", (n, rows, blocks, 16)), ("scales", (n, rows, blocks))):
            name = f"{where}.{proj}_{kind}"
            t = tensor(f"{proj}_{kind}").detach()[sel]
            if _dtype_name(t) != "uint8":
                raise UnsupportedModel(f"{name} is {_dtype_name(t)}, expected uint8 (MXFP4 "
                                       "E2M1 pairs and UE8M0 scales)")
            _expect(t, shape, name)
            parts[f"{proj}_{kind}"] = t
    w13 = QuantizedWeights(_deinterleave(parts["gate_up_proj_blocks"]).contiguous(),
                           _deinterleave(parts["gate_up_proj_scales"]).contiguous())
    w2 = QuantizedWeights(parts["down_proj_blocks"].contiguous(),
                          parts["down_proj_scales"].contiguous())
    return _Experts(w13, w2, _MXFP4, f"{where}.gate_up_proj_blocks / down_proj_blocks")


def _fused_layout(spec: MoeSpec, experts: Any, where: str) -> tuple:
    """(transposed, concatenated) of a fused experts module: transformers 5 states both
    (use_experts_implementation); they must be the model's, whose math the adapter knows."""
    transposed, concatenated = _model_layout(spec)
    have = (bool(getattr(experts, "is_transposed", transposed)),
            bool(getattr(experts, "is_concatenated", concatenated)))
    if spec.model_type == "gpt_oss" and have != (transposed, concatenated):
        raise UnsupportedModel(f"{where}: is_transposed={have[0]}, is_concatenated={have[1]}; "
                               "gpt-oss's experts are transposed with gate and up interleaved")
    return have


def _stack_experts(spec: MoeSpec, experts: Any, chosen: range, where: str) -> _Experts:
    """w13 [E_local, 2I, H] (gate rows, then up rows) and w2 [E_local, H, I] of a transformers
    experts module: fused 3D parameters (transformers 5; FP8 ones with their ``*_scale_inv``) or
    a ModuleList of per-expert MLPs."""
    import torch

    has_bias = bool(getattr(experts, "has_bias", False)) or \
        getattr(experts, "gate_up_proj_bias", None) is not None
    if has_bias != spec.has_biases:
        theirs = "have them" if spec.has_biases else "have none"
        raise UnsupportedModel(f"{where}: the experts have {'' if has_bias else 'no '}biases; "
                               f"{spec.model_type}'s {theirs}")
    if getattr(experts, "has_gate", True) is False:
        raise UnsupportedModel(f"{where}: the experts have no gate projection (has_gate=False); "
                               "epmoe computes silu(gate) * up")
    if getattr(experts, "gate_up_proj_precision_config", None) is not None:
        raise UnsupportedModel(f"{where}: {_MXFP4_BLOCKS_FROM_STATE_DICT}")
    if hasattr(experts, "gate_up_proj"):  # transformers 5: one 3D parameter each
        transposed, concatenated = _fused_layout(spec, experts, where)
        scale_inv = (getattr(experts, "gate_up_proj_scale_inv", None),
                     getattr(experts, "down_proj_scale_inv", None))
        return _from_fused(spec, experts.gate_up_proj, experts.down_proj, chosen, where,
                           transposed, concatenated, scale_inv)
    if isinstance(experts, torch.nn.ModuleList):  # per-expert MLPs (transformers 4, custom)
        def mats(m):
            if hasattr(m, "gate_proj"):
                return m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight
            return m.w1.weight, m.w3.weight, m.w2.weight  # Mixtral: w1 gate, w3 up, w2 down
        return _from_per_expert(spec, [mats(experts[e]) for e in chosen], where)
    raise UnsupportedModel(f"{where}: {type(experts).__name__} has neither gate_up_proj / "
                           "down_proj nor a ModuleList of per-expert MLPs")


def _block_experts(block: Any, rank: int, world: int) -> _Experts:
    spec = _block_spec(block)
    return _stack_experts(spec, block.experts, local_experts(spec.num_experts, rank, world),
                          type(block).__name__ + ".experts")


def expert_weights(block: Any, rank: int = 0, world: int = 1):
    """This rank's ``(w13 [E_local, 2I, H], w2 [E_local, H, I])`` of a transformers MoE block,
    in the parameters' dtype and device (views of them where already contiguous). An FP8 block
    (transformers' ``FP8Experts``: float8_e4m3fn ``gate_up_proj`` / ``down_proj`` with their
    ``*_scale_inv``) gives two :class:`epmoe.QuantizedWeights` in ``fp8_block128``."""
    return tuple(_block_experts(block, rank, world)[:2])


def expert_biases(block: Any, rank: int = 0, world: int = 1):
    """This rank's ``(b13 [E_local, 2I], b2 [E_local, H])`` of a transformers MoE block whose
    experts have biases (gpt-oss: ``gate_up_proj_bias`` de-interleaved, ``down_proj_bias``), in
    the parameters' dtype and device; None for the models without."""
    spec = _block_spec(block)
    if not spec.has_biases:
        return None
    experts, where = block.experts, type(block).__name__ + ".experts"
    _, concatenated = _fused_layout(spec, experts, where)
    return _biases_from_fused(spec, experts.gate_up_proj_bias, experts.down_proj_bias,
                              local_experts(spec.num_experts, rank, world), where, concatenated)


def _key(state_dict: Mapping, *candidates: str) -> Optional[str]:
    for k in candidates:
        if k in state_dict:
            return k
    return None


def _prefixes(prefix: str) -> list:
    """prefix with its trailing dot (none when empty), and its other spelling (Mixtral
    checkpoints: ``block_sparse_moe``; transformers 5 renames it ``mlp`` on load)."""
    prefix = prefix.rstrip(".")
    out = [prefix + "." if prefix else ""]
    for a, b in ((".mlp", ".block_sparse_moe"), (".block_sparse_moe", ".mlp")):
        if prefix.endswith(a):
            out.append(prefix[: -len(a)] + b + ".")
    return out


def _optional(state_dict: Mapping, key: str) -> Any:
    return state_dict[key] if key in state_dict else None


def _experts_from_state_dict(state_dict: Mapping, spec: MoeSpec, prefix: str,
                             chosen: range) -> _Experts:
    prefixes = _prefixes(prefix)
    for p in prefixes:
        if _key(state_dict, f"{p}experts.gate_up_proj_blocks") is not None:  # gpt-oss MXFP4
            return _mxfp4_from_blocks(spec, lambda name: state_dict[f"{p}experts.{name}"], chosen,
                                      f"{p}experts")
        fused = _key(state_dict, f"{p}experts.gate_up_proj")
        if fused is not None:
            scale_inv = tuple(_optional(state_dict, f"{p}experts.{n}_scale_inv")
                              for n in ("gate_up_proj", "down_proj"))
            return _from_fused(spec, state_dict[fused], state_dict[f"{p}experts.down_proj"],
                               chosen, f"{p}experts", *_model_layout(spec), scale_inv)
        for names in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")):
            # Qwen3-MoE / DeepSeek-V3 checkpoints; Mixtral's: w1 gate, w3 up, w2 down
            if _key(state_dict, f"{p}experts.{chosen.start}.{names[0]}.weight") is None:
                continue
            keys = [tuple(f"{p}experts.{e}.{n}.weight" for n in names) for e in chosen]
            mats = [tuple(state_dict[k] for k in ks) for ks in keys]
            where = f"{p}experts.N.{{{','.join(names)}}}.weight"
            if _key(state_dict, keys[0][0] + "_scale_inv") is not None:  # FP8 as shipped
                scales = [tuple(_optional(state_dict, k + "_scale_inv") for k in ks)
                          for ks in keys]
                return _fp8_from_per_expert(spec, mats, scales, keys, where)
            return _from_per_expert(spec, mats, where)
    raise KeyError(f"no routed experts under {' or '.join(repr(p) for p in prefixes)}: expected "
                   f"'{prefixes[0]}experts.gate_up_proj' or '{prefixes[0]}experts.{chosen.start}."
                   "gate_proj.weight' (Mixtral: '.w1.weight'; gpt-oss MXFP4: "
                   f"'{prefixes[0]}experts.gate_up_proj_blocks')")


def expert_weights_from_state_dict(state_dict: Mapping, config: Any, prefix: str, rank: int = 0,
                                   world: int = 1):
    """This rank's ``(w13, w2)`` of the MoE layer at ``prefix`` (e.g. ``"model.layers.3.mlp"``;
    Mixtral checkpoints use ``"model.layers.3.block_sparse_moe"``; either spelling is tried).

    Takes transformers' fused names (``{prefix}.experts.gate_up_proj`` [E, 2I, H],
    ``{prefix}.experts.down_proj`` [E, H, I], as ``model.state_dict()`` has them; gpt-oss's
    [E, H, 2I] interleaved and [E, I, H], as its bf16 checkpoints have them too) or the
    checkpoint's per-expert names (``{prefix}.experts.{e}.gate_proj.weight`` [I, H], ``up_proj``,
    ``down_proj`` [H, I]; Mixtral ``w1`` gate, ``w3`` up, ``w2`` down). Only this rank's experts
    are read, so a lazy mapping loads no more than it needs.

    Quantized checkpoints give two :class:`epmoe.QuantizedWeights` as shipped: FP8 (float8_e4m3fn
    weights with their ``weight_scale_inv``, per expert or fused as ``gate_up_proj_scale_inv``)
    in ``fp8_block128``; gpt-oss's ``experts.{gate_up,down}_proj_{blocks,scales}`` in
    ``mxfp4``."""
    spec = model_spec(config)
    return tuple(_experts_from_state_dict(state_dict, spec, prefix,
                                          local_experts(spec.num_experts, rank, world))[:2])


def expert_biases_from_state_dict(state_dict: Mapping, config: Any, prefix: str, rank: int = 0,
                                  world: int = 1):
    """This rank's ``(b13, b2)`` of the MoE layer at ``prefix`` when the model's experts have
    biases (gpt-oss: ``{prefix}.experts.gate_up_proj_bias`` [E, 2I] interleaved,
    ``{prefix}.experts.down_proj_bias`` [E, H]); None for the models without."""
    spec = model_spec(config)
    if not spec.has_biases:
        return None
    chosen = local_experts(spec.num_experts, rank, world)
    prefixes = _prefixes(prefix)
    for p in prefixes:
        key = _key(state_dict, f"{p}experts.gate_up_proj_bias")
        if key is not None:
            return _biases_from_fused(spec, state_dict[key],
                                      state_dict[f"{p}experts.down_proj_bias"], chosen,
                                      f"{p}experts", _model_layout(spec)[1])
    raise KeyError(f"no expert biases under {' or '.join(repr(p) for p in prefixes)}: expected "
                   f"'{prefixes[0]}experts.gate_up_proj_bias' and '.down_proj_bias'")


# --------------------------------------------------------------------------- routers


def route(block: Any, hidden: Any):
    """The block's own router on ``hidden`` [..., H]: ``(topk_ids [T, K] int32, topk_weights
    [T, K] float32)`` for :meth:`epmoe.Layer.forward`, T = hidden.numel() // H. The weights are
    the router's own values (Qwen3-MoE and gpt-oss round them to the model dtype, as their blocks
    do)."""
    import torch

    x = hidden.reshape(-1, hidden.shape[-1])
    if x.shape[0] == 0:  # an idle rank (some routers cannot reshape zero tokens)
        return _no_routes(x, _block_spec(block).top_k)
    _, weights, ids = _router_module(block)(x)  # (logits, top-k weights, top-k ids)
    return ids.to(torch.int32).contiguous(), weights.to(torch.float32).contiguous()


def _no_routes(x: Any, top_k: int):
    import torch

    return (torch.empty(0, top_k, dtype=torch.int32, device=x.device),
            torch.empty(0, top_k, dtype=torch.float32, device=x.device))


# The router's bias, by model: its name under the router module (gate / router).
_ROUTER_BIAS = {"deepseek_v3": "e_score_correction_bias", "gpt_oss": "bias"}


class Router:
    """The router of one MoE layer from its state dict, computed as transformers 5 does:

    * Qwen3-MoE: logits = x @ W.T in x's dtype; softmax in fp32; top-k; divided by their sum when
      ``norm_topk_prob``; rounded to x's dtype.
    * Mixtral: logits in x's dtype; softmax in fp32; top-k; divided by their sum (always).
    * DeepSeek-V3: logits in fp32; s = sigmoid(logits); choice = s + e_score_correction_bias;
      the ``topk_group`` of ``n_group`` groups with the largest sum of their two best choices; the
      top-k choices in those groups; weights = s of those experts, divided by their sum
      (+1e-20) when ``norm_topk_prob``, times ``routed_scaling_factor``.
    * gpt-oss: logits = x @ W.T + b in x's dtype; top-k of the logits; softmax over those k in
      x's dtype.

    ``bias``: DeepSeek-V3's ``e_score_correction_bias`` or gpt-oss's router bias.
    """

    def __init__(self, spec: MoeSpec, weight: Any, bias: Any = None):
        self.spec = spec
        self.weight = weight
        self.bias = bias
        if spec.model_type in _ROUTER_BIAS and self.bias is None:
            raise KeyError(f"{spec.model_type} router: {_ROUTER_BIAS[spec.model_type]} is missing")

    @classmethod
    def from_state_dict(cls, state_dict: Mapping, config: Any, prefix: str,
                        device: Any = None) -> "Router":
        spec = model_spec(config)
        name = "router" if spec.model_type == "gpt_oss" else "gate"
        found = [p for p in _prefixes(prefix) if _key(state_dict, f"{p}{name}.weight")]
        if not found:
            raise KeyError(f"no router under {prefix!r}: expected "
                           f"'{_prefixes(prefix)[0]}{name}.weight'")
        p = found[0]
        weight = state_dict[f"{p}{name}.weight"]
        bias_name = _ROUTER_BIAS.get(spec.model_type)
        bias = state_dict[f"{p}{name}.{bias_name}"] if bias_name else None
        if device is not None:
            weight = weight.to(device)
            bias = bias.to(device) if bias is not None else None
        return cls(spec, weight, bias)

    @classmethod
    def from_block(cls, block: Any) -> "Router":
        spec = _block_spec(block)
        router = _router_module(block)
        bias_name = _ROUTER_BIAS.get(spec.model_type)
        bias = getattr(router, bias_name) if bias_name else None
        return cls(spec, router.weight.detach(), None if bias is None else bias.detach())

    def __call__(self, hidden: Any):
        """``(topk_ids [T, K] int32, topk_weights [T, K] float32)`` of hidden [..., H]."""
        import torch
        import torch.nn.functional as F

        s = self.spec
        x = hidden.reshape(-1, s.hidden)
        if x.shape[0] == 0:
            return _no_routes(x, s.top_k)
        if s.model_type == "deepseek_v3":
            logits = F.linear(x.float(), self.weight.float())
            scores = logits.sigmoid()
            choice = scores + self.bias
            groups = choice.view(-1, s.n_group, s.num_experts // s.n_group)
            group_scores = groups.topk(2, dim=-1)[0].sum(dim=-1)
            group_idx = torch.topk(group_scores, k=s.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
            score_mask = group_mask.unsqueeze(-1).expand_as(groups).reshape(-1, s.num_experts)
            choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
            ids = torch.topk(choice, k=s.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
            if s.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            weights = weights * s.routed_scaling_factor
        elif s.model_type == "gpt_oss":
            logits = F.linear(x, self.weight.to(x.dtype), self.bias.to(x.dtype))
            top, ids = torch.topk(logits, s.top_k, dim=-1)
            weights = torch.softmax(top, dim=1, dtype=top.dtype)
        else:
            logits = F.linear(x, self.weight.to(x.dtype))
            probs = torch.softmax(logits.float(), dim=-1)
            weights, ids = torch.topk(probs, s.top_k, dim=-1)
            if s.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            if s.model_type == "qwen3_moe":
                weights = weights.to(logits.dtype)
        return ids.to(torch.int32).contiguous(), weights.to(torch.float32).contiguous()


# --------------------------------------------------------------------------- the layer


def _layer_precision(experts: _Experts, precision: Any) -> Any:
    """The layer's precision: a quantized checkpoint's own (it is read as shipped, never
    dequantized and re-quantized), else the caller's, bf16 by default."""
    if experts.precision is None:
        return "bf16" if precision is None else precision
    if precision is not None and str(precision) != experts.precision:
        raise UnsupportedModel(f"{experts.where}: the checkpoint ships {experts.precision} codes "
                               f"and scales, which a layer takes as shipped at precision "
                               f"{experts.precision} only, not {str(precision)!r} (epmoe does "
                               "not dequantize and re-quantize them)")
    return experts.precision


def _make_layer(comm: Communicator, spec: MoeSpec, precision: Any, max_tokens_per_rank: int,
                device: Any, experts: _Experts, biases: Optional[tuple], options: dict) -> Any:
    """The :class:`epmoe.Layer` of this rank's experts and (b13, b2) or None, moved to
    ``device`` when given; the caller's ``options`` override the model's layer options."""
    from . import Layer, QuantizedWeights

    def moved(t: Any) -> Any:
        if t is None or device is None:
            return t
        if isinstance(t, QuantizedWeights):
            return QuantizedWeights(*(moved(part) for part in t))
        return t.to(device)

    tensors = [moved(t) for t in (experts.w13, experts.w2, *(biases or (None, None)))]
    return Layer(comm, spec.layer_shape(max_tokens_per_rank), _layer_precision(experts, precision),
                 *tensors, **{**spec.layer_options(), **options})


class EPMoE:
    """One MoE layer of a model served by epmoe: the router and the shared experts in torch,
    the routed experts in an :class:`epmoe.Layer` (collective to build and to call: every rank,
    every step, T == 0 included). ``moe(hidden)`` equals the transformers block's forward on
    ``hidden`` [..., H] (within the precision's error) and returns the block's dtype; T =
    hidden.numel() // H must be at most ``max_tokens_per_rank``."""

    def __init__(self, layer: Any, spec: MoeSpec, router: Any, shared_experts: Any = None):
        self.layer = layer
        self.spec = spec
        self.router = router  # hidden [T, H] -> (ids int32, weights float32)
        self.shared_experts = shared_experts

    @classmethod
    def from_block(cls, comm: Communicator, block: Any, precision: Any = None, *,
                   max_tokens_per_rank: int, device: Any = None, **options: Any) -> "EPMoE":
        """From a transformers MoE block: this rank's experts and their biases (``device``:
        where the layer gets them, default where they are), the block's own router and shared
        experts. ``precision``: by default bf16, or an FP8 block's own ``fp8_block128`` (the
        only one it takes). ``options`` go to :class:`epmoe.Layer`; the model's activation
        (gpt-oss: ``swiglu_oai`` with the block's limit) is the default."""
        spec = _block_spec(block)
        layer = _make_layer(comm, spec, precision, max_tokens_per_rank, device,
                            _block_experts(block, comm.rank, comm.world),
                            expert_biases(block, comm.rank, comm.world), options)
        return cls(layer, spec, lambda h: route(block, h), getattr(block, "shared_experts", None))

    @classmethod
    def from_state_dict(cls, comm: Communicator, state_dict: Mapping, config: Any, prefix: str,
                        precision: Any = None, *, max_tokens_per_rank: int, device: Any = None,
                        shared_experts: Any = None, **options: Any) -> "EPMoE":
        """From a state dict and the model's config: this rank's experts and a :class:`Router`.
        ``precision``: by default bf16, or the checkpoint's own format when it ships quantized
        experts (``fp8_block128`` for FP8, ``mxfp4`` for gpt-oss's MXFP4; the only one it
        takes). ``shared_experts``: the model's shared-expert module (DeepSeek-V3), added to the
        output; epmoe does not run it. ``options`` as for :meth:`from_block`."""
        spec = model_spec(config)
        rank, world = comm.rank, comm.world
        layer = _make_layer(
            comm, spec, precision, max_tokens_per_rank, device,
            _experts_from_state_dict(state_dict, spec, prefix,
                                     local_experts(spec.num_experts, rank, world)),
            expert_biases_from_state_dict(state_dict, config, prefix, rank, world), options)
        return cls(layer, spec, Router.from_state_dict(state_dict, config, prefix, device),
                   shared_experts)

    def experts(self, hidden: Any, topk_ids: Any, topk_weights: Any, out: Any = None,
                stream: Any = None) -> Any:
        """The routed experts only: ``Layer.forward`` on hidden [T, H] bf16."""
        return self.layer.forward(hidden, topk_ids, topk_weights, out=out, stream=stream)

    def __call__(self, hidden: Any, stream: Any = None) -> Any:
        import torch

        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        ids, weights = self.router(x)
        xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
        y = self.layer.forward(xb.contiguous(), ids, weights, stream=stream)
        if y.dtype != hidden.dtype:
            y = y.to(hidden.dtype)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.reshape(shape)

    forward = __call__

    def close(self) -> None:
        self.layer.close()

    def __enter__(self) -> "EPMoE":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

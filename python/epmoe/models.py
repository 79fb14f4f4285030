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
only this rank's experts are read. Tensors keep their dtype (bf16 as shipped; the layer quantizes
them to its precision itself).

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

Not supported yet, refused with :class:`UnsupportedModel`: checkpoints in a quantized format as
shipped, i.e. gpt-oss's MXFP4 ``*_blocks`` / ``*_scales`` and DeepSeek-V3/R1's float8_e4m3 weights
with 128x128 ``weight_scale_inv`` blocks: the pre-quantized weight input is not done yet
(docs/design.md §6, "Planned"). Dequantize them to bf16 first; epmoe's ``mxfp4`` and
``fp8_block128`` precisions quantize them again in the same formats.

torch is imported when a function here is called, not when ``epmoe`` is imported.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any, Mapping, Optional

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

_FP8_WHAT = ("FP8 checkpoints (float8_e4m3 weights with 128x128 block scales, "
             "'weight_scale_inv') are not supported yet: the adapters do not read a checkpoint's "
             "own scales (docs/design.md §6, planned). Load the bf16 weights (dequantize the "
             "checkpoint to bf16 first) and let epmoe quantize them (precision bf16, mxfp8, nvfp4, "
             "or fp8_block128, DeepSeek's own 128x128 / 1x128 blocks)")
_MXFP4_WHAT = ("gpt-oss's MXFP4 checkpoint tensors as shipped (uint8 '*_blocks' of E2M1 pairs and "
               "'*_scales' of UE8M0 per 32) are not supported yet: the adapters do not take "
               "pre-quantized weights (docs/design.md §6, planned). Load the bf16 weights "
               "(transformers: quantization_config=Mxfp4Config(dequantize=True)) and let epmoe "
               "quantize them (precision bf16, mxfp8, or mxfp4, gpt-oss's own format)")
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


def _refuse_quantized(config: Any) -> None:
    q = _get(config, "quantization_config")
    if q is None:
        return
    method = q.get("quant_method") if isinstance(q, Mapping) else getattr(q, "quant_method", q)
    method = str(getattr(method, "value", method)).lower()
    if "fp8" in method:
        raise UnsupportedModel(f"quantization_config.quant_method={method!r}: {_FP8_WHAT}")
    if "mxfp4" in method:
        dequantize = q.get("dequantize") if isinstance(q, Mapping) else getattr(q, "dequantize",
                                                                                  False)
        if dequantize:  # transformers dequantized the checkpoint to bf16 on load
            return
        raise UnsupportedModel(f"quantization_config.quant_method={method!r}: {_MXFP4_WHAT}")
    raise UnsupportedModel(f"quantization_config.quant_method={method!r}: epmoe takes bf16 or f32 "
                           "expert weights and quantizes them itself; load an unquantized "
                           "checkpoint")


def model_spec(config: Any) -> MoeSpec:
    """The :class:`MoeSpec` of a transformers config (or a config.json dict). Raises
    :class:`UnsupportedModel` for quantized checkpoints as shipped (FP8, MXFP4 not dequantized),
    other models and, but for gpt-oss, activations other than SiLU (epmoe computes
    silu(gate) * up)."""
    config = _cfg(config)
    model_type = str(_get(config, "model_type", default=""))
    if model_type not in SUPPORTED_MODELS:
        raise UnsupportedModel(f"model_type={model_type!r}: the adapters take "
                               f"{', '.join(SUPPORTED_MODELS)}")
    _refuse_quantized(config)
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


def _refuse_dtype(spec: MoeSpec, name: str, t: Any) -> None:
    dtype = str(getattr(t, "dtype", ""))
    if "float8" in dtype:
        raise UnsupportedModel(f"{name} is {dtype}: {_FP8_WHAT}")
    if dtype in ("torch.uint8", "uint8", "torch.int8", "int8"):
        if spec.model_type == "gpt_oss":
            raise UnsupportedModel(f"{name} is {dtype}: {_MXFP4_WHAT}")
        raise UnsupportedModel(f"{name} is {dtype} (packed quantized weights): epmoe takes bf16 "
                               "or f32 expert weights and quantizes them itself")


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
                transposed: bool, concatenated: bool):
    """transformers 5's fused experts: gate_up_proj [E, 2I, H] (gate rows, then up rows) and
    down_proj [E, H, I] (``transposed``: [E, H, 2I] and [E, I, H]; not ``concatenated``: gate
    and up interleaved, gate0, up0, gate1, ...) -> this rank's w13 [E_local, 2I, H], w2."""
    _refuse_dtype(spec, f"{where}.gate_up_proj", gate_up)
    _refuse_dtype(spec, f"{where}.down_proj", down)
    sel = slice(chosen.start, chosen.stop)
    w13, w2 = gate_up.detach()[sel], down.detach()[sel]
    if transposed:
        w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
    if not concatenated:
        w13 = _deinterleave(w13)
    _check_shapes(spec, w13, w2, len(chosen), f"{where}.gate_up_proj / down_proj")
    return w13.contiguous(), w2.contiguous()


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


def _from_per_expert(spec: MoeSpec, mats: list, where: str):
    """One (gate [I, H], up [I, H], down [H, I]) per local expert -> w13, w2."""
    import torch

    for n, (g, u, d) in enumerate(mats):
        for what, t in (("gate", g), ("up", u), ("down", d)):
            _refuse_dtype(spec, f"{where} (local expert {n}, {what})", t)
    w13 = torch.stack([torch.cat([g.detach(), u.detach()]) for g, u, _ in mats])
    w2 = torch.stack([d.detach() for _, _, d in mats])
    _check_shapes(spec, w13, w2, len(mats), where)
    return w13.contiguous(), w2.contiguous()


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


def _stack_experts(spec: MoeSpec, experts: Any, chosen: range, where: str):
    """w13 [E_local, 2I, H] (gate rows, then up rows) and w2 [E_local, H, I] of a transformers
    experts module: fused 3D parameters (transformers 5) or a ModuleList of per-expert MLPs."""
    import torch

    has_bias = bool(getattr(experts, "has_bias", False)) or hasattr(experts, "gate_up_proj_bias")
    if has_bias != spec.has_biases:
        theirs = "have them" if spec.has_biases else "have none"
        raise UnsupportedModel(f"{where}: the experts have {'' if has_bias else 'no '}biases; "
                               f"{spec.model_type}'s {theirs}")
    if getattr(experts, "has_gate", True) is False:
        raise UnsupportedModel(f"{where}: the experts have no gate projection (has_gate=False); "
                               "epmoe computes silu(gate) * up")
    if hasattr(experts, "gate_up_proj"):  # transformers 5: one 3D parameter each
        transposed, concatenated = _fused_layout(spec, experts, where)
        return _from_fused(spec, experts.gate_up_proj, experts.down_proj, chosen, where,
                           transposed, concatenated)
    if isinstance(experts, torch.nn.ModuleList):  # per-expert MLPs (transformers 4, custom)
        def mats(m):
            if hasattr(m, "gate_proj"):
                return m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight
            return m.w1.weight, m.w3.weight, m.w2.weight  # Mixtral: w1 gate, w3 up, w2 down
        return _from_per_expert(spec, [mats(experts[e]) for e in chosen], where)
    raise UnsupportedModel(f"{where}: {type(experts).__name__} has neither gate_up_proj / "
                           "down_proj nor a ModuleList of per-expert MLPs")


def expert_weights(block: Any, rank: int = 0, world: int = 1):
    """This rank's ``(w13 [E_local, 2I, H], w2 [E_local, H, I])`` of a transformers MoE block,
    in the parameters' dtype and device (views of them where already contiguous)."""
    spec = _block_spec(block)
    return _stack_experts(spec, block.experts, local_experts(spec.num_experts, rank, world),
                          type(block).__name__ + ".experts")


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


def _refuse_quantized_tensors(state_dict: Mapping, p: str) -> None:
    """A checkpoint's quantized tensors as shipped: FP8 scales, MXFP4 blocks and scales."""
    keys = list(state_dict.keys()) if hasattr(state_dict, "keys") else []
    if any(k.startswith(p) and k.endswith("weight_scale_inv") for k in keys):
        raise UnsupportedModel(f"{p or 'state dict'}: the state dict has "
                               f"'weight_scale_inv' tensors: {_FP8_WHAT}")
    blocks = _key(state_dict, f"{p}experts.gate_up_proj_blocks", f"{p}experts.down_proj_blocks")
    if blocks is not None:
        raise UnsupportedModel(f"{blocks}: {_MXFP4_WHAT}")


def expert_weights_from_state_dict(state_dict: Mapping, config: Any, prefix: str, rank: int = 0,
                                   world: int = 1):
    """This rank's ``(w13, w2)`` of the MoE layer at ``prefix`` (e.g. ``"model.layers.3.mlp"``;
    Mixtral checkpoints use ``"model.layers.3.block_sparse_moe"``; either spelling is tried).

    Takes transformers' fused names (``{prefix}.experts.gate_up_proj`` [E, 2I, H],
    ``{prefix}.experts.down_proj`` [E, H, I], as ``model.state_dict()`` has them; gpt-oss's
    [E, H, 2I] interleaved and [E, I, H], as its bf16 checkpoints have them too) or the
    checkpoint's per-expert names (``{prefix}.experts.{e}.gate_proj.weight`` [I, H], ``up_proj``,
    ``down_proj`` [H, I]; Mixtral ``w1`` gate, ``w3`` up, ``w2`` down). Only this rank's experts
    are read, so a lazy mapping loads no more than it needs."""
    spec = model_spec(config)
    chosen = local_experts(spec.num_experts, rank, world)
    prefixes = _prefixes(prefix)
    for p in prefixes:
        _refuse_quantized_tensors(state_dict, p)
        fused = _key(state_dict, f"{p}experts.gate_up_proj")
        if fused is not None:
            return _from_fused(spec, state_dict[fused], state_dict[f"{p}experts.down_proj"],
                               chosen, f"{p}experts", *_model_layout(spec))
        for names in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")):
            # Qwen3-MoE / DeepSeek-V3 checkpoints; Mixtral's: w1 gate, w3 up, w2 down
            if _key(state_dict, f"{p}experts.{chosen.start}.{names[0]}.weight") is None:
                continue
            mats = [tuple(state_dict[f"{p}experts.{e}.{n}.weight"] for n in names)
                    for e in chosen]
            return _from_per_expert(spec, mats, f"{p}experts.N.{{{','.join(names)}}}.weight")
    raise KeyError(f"no routed experts under {' or '.join(repr(p) for p in prefixes)}: expected "
                   f"'{prefixes[0]}experts.gate_up_proj' or '{prefixes[0]}experts.{chosen.start}."
                   "gate_proj.weight' (Mixtral: '.w1.weight')")


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
        _refuse_quantized_tensors(state_dict, p)
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


def _make_layer(comm: Communicator, spec: MoeSpec, precision: Any, max_tokens_per_rank: int,
                device: Any, weights: tuple, biases: Optional[tuple], options: dict) -> Any:
    """The :class:`epmoe.Layer` of this rank's (w13, w2) and (b13, b2) or None, moved to
    ``device`` when given; the caller's ``options`` override the model's layer options."""
    from . import Layer

    tensors = list(weights) + list(biases or (None, None))
    if device is not None:
        tensors = [None if t is None else t.to(device) for t in tensors]
    return Layer(comm, spec.layer_shape(max_tokens_per_rank), precision, *tensors,
                 **{**spec.layer_options(), **options})


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
    def from_block(cls, comm: Communicator, block: Any, precision: Any = "bf16", *,
                   max_tokens_per_rank: int, device: Any = None, **options: Any) -> "EPMoE":
        """From a transformers MoE block: this rank's experts and their biases (``device``:
        where the layer gets them, default where they are), the block's own router and shared
        experts. ``options`` go to :class:`epmoe.Layer`; the model's activation (gpt-oss:
        ``swiglu_oai`` with the block's limit) is the default."""
        spec = _block_spec(block)
        layer = _make_layer(comm, spec, precision, max_tokens_per_rank, device,
                            expert_weights(block, comm.rank, comm.world),
                            expert_biases(block, comm.rank, comm.world), options)
        return cls(layer, spec, lambda h: route(block, h), getattr(block, "shared_experts", None))

    @classmethod
    def from_state_dict(cls, comm: Communicator, state_dict: Mapping, config: Any, prefix: str,
                        precision: Any = "bf16", *, max_tokens_per_rank: int, device: Any = None,
                        shared_experts: Any = None, **options: Any) -> "EPMoE":
        """From a state dict and the model's config: this rank's experts and a :class:`Router`.
        ``shared_experts``: the model's shared-expert module (DeepSeek-V3), added to the
        output; epmoe does not run it. ``options`` as for :meth:`from_block`."""
        spec = model_spec(config)
        rank, world = comm.rank, comm.world
        layer = _make_layer(
            comm, spec, precision, max_tokens_per_rank, device,
            expert_weights_from_state_dict(state_dict, config, prefix, rank, world),
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

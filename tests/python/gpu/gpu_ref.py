"""Torch helpers of the GPU tests: random problems and a torch model of the bf16 forward.

The model follows every rounding point of the library's bf16 forward (docs/design.md §6): x and the
weights in bf16, float64 dot products rounded to fp32 (the GEMM outputs), SwiGLU in float64 from
those fp32 values, rounded to fp32 and then to the bf16 intermediate, FC2 in float64 rounded to
fp32, each FC2 row rounded to bf16 for the staged combine, and the top-k weighted sum in fp32 in
slot order 0..K-1, rounded to bf16. Only summation orders differ from the GPU, so outputs agree
within one bf16 ulp. It runs on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List

import numpy as np
import torch

import epmoe
from epmoe_ref import raise_first, run_ranks  # tests/python, on sys.path via conftest

SHAPE = dict(hidden=256, intermediate=128, num_experts=8, top_k=4, max_tokens_per_rank=64)


def layer_shape(**overrides: int) -> epmoe.LayerShape:
    return epmoe.LayerShape(**{**SHAPE, **overrides})


@dataclass
class Weights:
    w13: torch.Tensor  # [E, 2I, H] bf16, every expert (CPU)
    w2: torch.Tensor  # [E, H, I] bf16

    def local(self, rank: int, world: int):
        e = self.w13.shape[0] // world
        return self.w13[rank * e:(rank + 1) * e], self.w2[rank * e:(rank + 1) * e]


def make_weights(shape: epmoe.LayerShape, seed: int) -> Weights:
    """The same on every rank (every rank loads the same checkpoint)."""
    g = torch.Generator().manual_seed(seed)
    e, h, i = shape.num_experts, shape.hidden, shape.intermediate
    w13 = (torch.rand(e, 2 * i, h, generator=g) * 2 - 1) / h ** 0.5
    w2 = (torch.rand(e, h, i, generator=g) * 2 - 1) / i ** 0.5
    return Weights(w13.to(torch.bfloat16), w2.to(torch.bfloat16))


@dataclass
class Batch:
    x: torch.Tensor  # [T, H] bf16
    ids: torch.Tensor  # [T, K] int32, -1 = no expert
    weights: torch.Tensor  # [T, K] float32

    def to(self, device: Any) -> "Batch":
        return Batch(self.x.to(device), self.ids.to(device), self.weights.to(device))


def make_batch(shape: epmoe.LayerShape, tokens: int, seed: int, drop: float = 0.15) -> Batch:
    g = torch.Generator().manual_seed(seed)
    k, e = shape.top_k, shape.num_experts
    x = (torch.rand(tokens, shape.hidden, generator=g) * 2 - 1).to(torch.bfloat16)
    ids = torch.rand(tokens, e, generator=g).argsort(dim=1)[:, :k].to(torch.int32)
    ids[torch.rand(tokens, k, generator=g) < drop] = -1
    w = torch.rand(tokens, k, generator=g) * 0.9 + 0.1
    w[ids < 0] = 0
    w = w / w.sum(dim=1, keepdim=True).clamp_min(1e-6)
    return Batch(x, ids.contiguous(), w.to(torch.float32).contiguous())


def reference_forward(batch: Batch, weights: Weights, combine: str = "staged") -> torch.Tensor:
    """y [T, H] bf16 (CPU) of the bf16 layer with every expert, for this rank's tokens."""
    x = batch.x.cpu().to(torch.float64)
    ids = batch.ids.cpu().to(torch.int64)
    topk_w = batch.weights.cpu().to(torch.float32)
    w13 = weights.w13.to(torch.float64)
    w2 = weights.w2.to(torch.float64)
    t, k = ids.shape
    h, inter = w2.shape[1], w2.shape[2]
    rows = torch.zeros(t, k, h, dtype=torch.float32)
    for e in ids[ids >= 0].unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        fc1 = (x[tok] @ w13[e].T).to(torch.float32)  # the FC1 GEMM output: fp32
        gate = fc1[:, :inter].to(torch.float64)
        up = fc1[:, inter:].to(torch.float64)
        act = (gate / (1.0 + torch.exp(-gate)) * up).to(torch.float32).to(torch.bfloat16)
        rows[tok, slot] = (act.to(torch.float64) @ w2[e].T).to(torch.float32)  # FC2: fp32
    if combine == "staged":  # FC2 rows travel home in bf16
        rows = rows.to(torch.bfloat16).to(torch.float32)
    acc = torch.zeros(t, h, dtype=torch.float32)
    for s in range(k):  # fp32, slot order
        valid = (ids[:, s] >= 0)[:, None]
        acc = torch.where(valid, acc + topk_w[:, s:s + 1] * rows[:, s], acc)
    return acc.to(torch.bfloat16)


def bf16_ulp(mag: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp at magnitude `mag` (float64): 2^(floor(log2 mag) - 7); 0 where mag is 0."""
    _, exponent = torch.frexp(mag)  # mag = m * 2^exponent, m in [0.5, 1)
    ulp = torch.pow(2.0, (exponent - 8).to(torch.float64))
    return torch.where(mag > 0, ulp, torch.zeros_like(mag))


def mismatch(y: torch.Tensor, ref: torch.Tensor, ulps: int = 1, abs_floor: float = 1e-6) -> str:
    """'' when y == ref within `ulps` bf16 ulps of the larger magnitude (+ abs_floor, as the C++
    compare_bf16_tolerant), else what differs and where first."""
    a = y.detach().cpu().to(torch.float64)
    b = ref.detach().cpu().to(torch.float64)
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} vs reference {tuple(b.shape)}"
    bad = ~((a - b).abs() <= ulps * bf16_ulp(torch.maximum(a.abs(), b.abs())) + abs_floor)
    if not bool(bad.any()):
        return ""
    first = tuple(int(v) for v in bad.nonzero()[0])
    return (f"{int(bad.sum())} of {a.numel()} elements differ by more than {ulps} bf16 ulp; "
            f"first at {first}: {a[first].item()!r} vs reference {b[first].item()!r}")


def bits(t: torch.Tensor) -> np.ndarray:
    """bf16 tensor -> numpy uint16 bits (for epmoe_ref's numpy model)."""
    return t.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)


def run_threads(world: int, fn: Callable[[int], Any], timeout: float = 50.0) -> List[Any]:
    """fn(rank) on one thread per rank; each rank's result, or re-raises the first exception."""
    return raise_first(run_ranks(world, fn, timeout))

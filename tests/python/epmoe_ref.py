"""Test helpers: rank threads, random problems, and a numpy model of the layer.

The numpy forward emulates every rounding point of the library's forward (docs/design.md §6): inputs and
weights quantized to the layer's precision (bf16 rounding, or the MXFP8/NVFP4 codecs through
epmoe's own quantize/dequantize), float64 dot products rounded to fp32 (the GEMM outputs), SwiGLU
in float64 rounded to fp32, the intermediate quantized again, FC2 rows rounded to bf16 for the
staged combine, and the top-k weighted sum in fp32 in slot order 0..K-1. Only the float64
summation order differs from the C++ reference, so outputs agree within one bf16 ulp.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import numpy as np

import epmoe

# ---- bf16 as uint16 bits ----


def f32_to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """Round to nearest even, as formats::float_to_bf16 (inputs here are finite)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def round_bf16(a: np.ndarray) -> np.ndarray:
    return bf16_bits_to_f32(f32_to_bf16_bits(a))


def bf16_ulp(mag: np.ndarray) -> np.ndarray:
    """One bf16 ulp at magnitude `mag` (2^(floor(log2 mag) - 7)); 0 where mag is 0."""
    mag = np.asarray(mag, dtype=np.float64)
    out = np.zeros_like(mag)
    nz = mag > 0
    out[nz] = np.ldexp(1.0, np.frexp(mag[nz])[1] - 1 - 7)
    return out


def assert_within_bf16_ulps(y_bits: np.ndarray, ref_bits: np.ndarray, ulps: int = 1,
                            abs_floor: float = 1e-6) -> int:
    """y == ref within `ulps` bf16 ulps of the larger magnitude (+ abs_floor, as the C++
    compare_bf16_tolerant); returns how many elements differ at all."""
    a = bf16_bits_to_f32(y_bits).astype(np.float64)
    b = bf16_bits_to_f32(ref_bits).astype(np.float64)
    assert a.shape == b.shape
    diff = np.abs(a - b)
    bad = ~(diff <= ulps * bf16_ulp(np.maximum(np.abs(a), np.abs(b))) + abs_floor)
    if bad.any():
        i = np.argwhere(bad)[0]
        raise AssertionError(
            f"{int(bad.sum())} of {a.size} elements differ by more than {ulps} bf16 ulp; first at "
            f"{tuple(int(v) for v in i)}: {a[tuple(i)]!r} vs reference {b[tuple(i)]!r}")
    return int((y_bits != ref_bits).sum())


# ---- rank threads ----


def run_ranks(world: int, fn: Callable[[int], Any], timeout: float = 60.0) -> List[Any]:
    """fn(rank) on one thread per rank; returns each rank's result or the exception it raised."""
    results: List[Any] = [None] * world

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            results[rank] = e

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), f"a rank thread is still running after {timeout} s (hang)"
    return results


def raise_first(results: List[Any]) -> List[Any]:
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


# ---- problems ----


@dataclass
class Problem:
    shape: epmoe.LayerShape
    world: int
    w13_bits: np.ndarray  # [E, 2I, H] bf16 bits
    w2_bits: np.ndarray  # [E, H, I] bf16 bits

    def local(self, rank: int):
        e = self.shape.num_experts // self.world
        return self.w13_bits[rank * e:(rank + 1) * e], self.w2_bits[rank * e:(rank + 1) * e]


def make_problem(shape: epmoe.LayerShape, world: int, seed: int = 1) -> Problem:
    rng = np.random.default_rng(seed)
    e, h, i = shape.num_experts, shape.hidden, shape.intermediate
    w13 = rng.uniform(-1, 1, (e, 2 * i, h)).astype(np.float32) / np.sqrt(h)
    w2 = rng.uniform(-1, 1, (e, h, i)).astype(np.float32) / np.sqrt(i)
    return Problem(shape, world, f32_to_bf16_bits(w13), f32_to_bf16_bits(w2))


@dataclass
class Batch:
    x: np.ndarray  # [T, H] bf16 bits
    ids: np.ndarray  # [T, K] int32, -1 = no expert
    weights: np.ndarray  # [T, K] float32


def make_batch(shape: epmoe.LayerShape, tokens: int, seed: int, drop: float = 0.15) -> Batch:
    rng = np.random.default_rng(seed)
    k, e = shape.top_k, shape.num_experts
    x = f32_to_bf16_bits(rng.uniform(-1, 1, (tokens, shape.hidden)).astype(np.float32))
    ids = np.array([rng.permutation(e)[:k] for _ in range(tokens)], dtype=np.int32).reshape(
        tokens, k)
    ids[rng.uniform(size=(tokens, k)) < drop] = -1
    w = rng.uniform(0.1, 1.0, (tokens, k)).astype(np.float32)
    w[ids < 0] = 0
    w /= np.maximum(w.sum(axis=1, keepdims=True), 1e-6)
    return Batch(x, ids, w.astype(np.float32))


# ---- the numpy model ----


def emulate_activation(rows: np.ndarray, precision: str, rounding: str = "rceil") -> np.ndarray:
    """Each row as it is after its wire quantization (the FC1 input and the FC2 input)."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    if rows.size == 0:
        return rows
    if precision == "bf16":
        return round_bf16(rows)
    if precision in ("mxfp8", "mxfp4"):  # an mxfp4 layer's activations are MXFP8
        return epmoe.dequantize_mxfp8(*epmoe.quantize_mxfp8(rows, rounding))
    if precision == "nvfp4":
        return epmoe.dequantize_nvfp4(*epmoe.quantize_nvfp4(rows, "per_row"))
    if precision == "fp8_block128":  # one fp32 scale per 1 x 128 run of a row
        return epmoe.dequantize_fp8_block128(*epmoe.quantize_fp8_block128(rows, "row_1x128"),
                                             "row_1x128")
    raise ValueError(precision)


def emulate_weights(w: np.ndarray, precision: str, rounding: str = "rceil") -> np.ndarray:
    """[E, rows, cols] weights as the layer holds them: quantized per expert along cols."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if precision == "bf16":
        return round_bf16(w)
    if precision == "mxfp8":
        return epmoe.dequantize_mxfp8(*epmoe.quantize_mxfp8(w, rounding))
    if precision == "nvfp4":  # one fp32 scale per expert matrix
        return np.stack([epmoe.dequantize_nvfp4(*epmoe.quantize_nvfp4(m, "per_tensor")) for m in w])
    if precision == "fp8_block128":  # one fp32 scale per 128 x 128 tile of each expert matrix
        return np.stack([epmoe.dequantize_fp8_block128(
            *epmoe.quantize_fp8_block128(m, "tile_128x128"), "tile_128x128") for m in w])
    if precision == "mxfp4":
        return epmoe.dequantize_mxfp4(*epmoe.quantize_mxfp4(w, rounding))
    raise ValueError(precision)


def swiglu(gate: np.ndarray, up: np.ndarray, limit: float) -> np.ndarray:
    gate = gate.astype(np.float64)
    up = up.astype(np.float64)
    if limit > 0:
        gate = np.minimum(gate, limit)
        up = np.clip(up, -limit, limit)
    return gate / (1.0 + np.exp(-gate)) * up


def swiglu_oai(gate: np.ndarray, up: np.ndarray, limit: float) -> np.ndarray:
    """gpt-oss (transformers GptOssExperts._apply_gate): (clamp(up, -l, l) + 1) * g * sigmoid(1.702 g),
    g = min(gate, l)."""
    gate = np.minimum(gate.astype(np.float64), limit)
    up = np.clip(up.astype(np.float64), -limit, limit)
    return (up + 1.0) * (gate * (1.0 / (1.0 + np.exp(-(gate * 1.702)))))


def activation(name: str, gate: np.ndarray, up: np.ndarray, limit: float) -> np.ndarray:
    return swiglu_oai(gate, up, limit) if name == "swiglu_oai" else swiglu(gate, up, limit)


class NumpyLayer:
    """The whole layer (every expert) for one rank's tokens. ``b13`` [E, 2I] and ``b2`` [E, H]
    (float32, optional) are added to each GEMM's float64 sum before it is rounded to float32."""

    def __init__(self, problem: Problem, precision: str = "bf16", combine: str = "staged",
                 swiglu_limit: float = 0.0, activation: str = "swiglu",
                 b13: Optional[np.ndarray] = None, b2: Optional[np.ndarray] = None):
        self.shape = problem.shape
        self.precision = precision
        self.combine = combine
        self.limit = swiglu_limit
        self.activation = activation
        e = problem.shape.num_experts
        self.b13 = (np.zeros((e, 2 * problem.shape.intermediate)) if b13 is None
                    else b13.astype(np.float64))
        self.b2 = np.zeros((e, problem.shape.hidden)) if b2 is None else b2.astype(np.float64)
        w13 = bf16_bits_to_f32(problem.w13_bits)
        w2 = bf16_bits_to_f32(problem.w2_bits)
        self.w13_exact = w13.astype(np.float64)
        self.w2_exact = w2.astype(np.float64)
        self.w13 = emulate_weights(w13, precision).astype(np.float64)
        self.w2 = emulate_weights(w2, precision).astype(np.float64)

    def _expert_rows(self, x: np.ndarray, e: int) -> np.ndarray:
        """x [n, H] (already wire-quantized) through expert e: fp32 FC2 rows [n, H]."""
        inter = self.shape.intermediate
        fc1 = (x.astype(np.float64) @ self.w13[e].T + self.b13[e]).astype(np.float32)
        act = activation(self.activation, fc1[:, :inter], fc1[:, inter:], self.limit)
        act = emulate_activation(act.astype(np.float32), self.precision)
        return (act.astype(np.float64) @ self.w2[e].T + self.b2[e]).astype(np.float32)

    def forward(self, batch: Batch) -> np.ndarray:
        """y [T, H] as bf16 bits."""
        t, h = batch.x.shape[0], self.shape.hidden
        x = emulate_activation(bf16_bits_to_f32(batch.x), self.precision)
        acc = np.zeros((t, h), dtype=np.float32)
        for s in range(self.shape.top_k):
            ids = batch.ids[:, s]
            rows = np.zeros((t, h), dtype=np.float32)
            for e in np.unique(ids[ids >= 0]):
                sel = ids == e
                rows[sel] = self._expert_rows(x[sel], int(e))
            if self.combine == "staged":
                rows = round_bf16(rows)
            valid = ids >= 0
            acc[valid] += batch.weights[valid, s][:, None] * rows[valid]
        return f32_to_bf16_bits(acc)

    def forward_exact(self, batch: Batch) -> np.ndarray:
        """y [T, H] float64 with no quantization anywhere."""
        t, h, inter = batch.x.shape[0], self.shape.hidden, self.shape.intermediate
        x = bf16_bits_to_f32(batch.x).astype(np.float64)
        y = np.zeros((t, h))
        for s in range(self.shape.top_k):
            for tok in range(t):
                e = int(batch.ids[tok, s])
                if e < 0:
                    continue
                fc1 = self.w13_exact[e] @ x[tok] + self.b13[e]
                act = activation(self.activation, fc1[:inter], fc1[inter:], self.limit)
                y[tok] += float(batch.weights[tok, s]) * (self.w2_exact[e] @ act + self.b2[e])
        return y


def rel_l2(y_bits: np.ndarray, ref: np.ndarray) -> float:
    y = bf16_bits_to_f32(y_bits).astype(np.float64)
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(y - ref) / den) if den > 0 else float(np.linalg.norm(y - ref))


def make_layers(problem: Problem, precision: str = "bf16", group: Optional[epmoe.HostGroup] = None,
                **options: Any) -> List[epmoe.Layer]:
    """Every rank's layer, each created on its own thread (creation is collective)."""
    group = group or epmoe.HostGroup(problem.world)

    def create(rank: int) -> epmoe.Layer:
        w13, w2 = problem.local(rank)
        local = dict(options)
        e = problem.shape.num_experts // problem.world
        for name in ("b13", "b2"):  # whole-layer biases: this rank's experts
            if local.get(name) is not None:
                local[name] = local[name][rank * e:(rank + 1) * e]
        return epmoe.Layer(group.communicator(rank), problem.shape, precision, w13, w2, **local)

    return raise_first(run_ranks(problem.world, create))

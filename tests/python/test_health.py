"""health() and reset() after a rank goes missing (fault switches: test builds only)."""

from __future__ import annotations

import time

import numpy as np
import pytest

import epmoe
from epmoe_ref import NumpyLayer, assert_within_bf16_ulps, make_batch, make_layers, make_problem
from epmoe_ref import raise_first, run_ranks

pytestmark = pytest.mark.skipif(
    not epmoe.fault_injection_available,
    reason="module built without EPMOE_FAULT_INJECTION (no epmoe._testing)")

WORLD, TIMEOUT_MS = 3, 500
SHAPE = dict(hidden=64, intermediate=64, num_experts=6, top_k=2, max_tokens_per_rank=8)


def test_testing_module_is_importable():
    from epmoe._testing import inject_fault  # noqa: F401

    assert epmoe._testing.inject_fault is inject_fault


def test_skipped_idle_launch_is_named_then_reset_recovers():
    problem = make_problem(epmoe.LayerShape(**SHAPE), WORLD, seed=31)
    layers = make_layers(problem, timeout_ms=TIMEOUT_MS)
    model = NumpyLayer(problem)

    def round_(tokens, seed):
        batches = [make_batch(problem.shape, tokens(r), seed=seed + r) for r in range(WORLD)]

        def step(rank):
            start = time.monotonic()
            try:
                b = batches[rank]
                return layers[rank].forward(b.x, b.ids, b.weights), time.monotonic() - start
            except epmoe.Error as e:
                return e, time.monotonic() - start

        return batches, run_ranks(WORLD, step)

    round_(lambda r: 3, 100)
    assert all(layer.health().ok for layer in layers)

    # Rank 1 is idle and skips its launch: the bug the protocol exists to catch.
    epmoe._testing.inject_fault(layers[1], "skip_launch_when_idle")
    _, outcomes = round_(lambda r: 0 if r == 1 else 4, 200)
    for rank in (0, 2):
        error, seconds = outcomes[rank]
        assert isinstance(error, epmoe.Error), f"rank {rank} did not notice rank 1 skipped"
        assert error.code in ("timeout", "peer_aborted")
        assert "rank 1" in str(error) and "round 2" in str(error)
        assert seconds < TIMEOUT_MS / 1000 + 1.0
        h = layers[rank].health()
        assert not h.ok and h.code in ("timeout", "peer_aborted")
        assert (h.peer, h.phase, h.round) == (1, "dispatch_counts", 2), h
        d = h.as_dict()
        assert set(d) == {"ok", "code", "rank", "peer", "phase", "round", "observed", "expected",
                          "what"}
        assert d["what"] == h.what and d["ok"] is False
    assert not isinstance(outcomes[1][0], Exception)  # the skipping rank "succeeded"

    # Every rank refuses work until reset(), at once.
    _, refused = round_(lambda r: 1, 300)
    for rank in range(WORLD):
        error, seconds = refused[rank]
        assert isinstance(error, epmoe.Error), f"rank {rank} accepted work after the failure"
        assert seconds < 0.5

    raise_first(run_ranks(WORLD, lambda r: layers[r].reset()))
    assert all(layer.health().ok for layer in layers)
    assert repr(layers[0].health()) == "Health(ok=True)"
    assert layers[0].health().code is None
    batches, outcomes = round_(lambda r: 2 * r, 400)
    for rank in range(WORLD):
        y, _ = outcomes[rank]
        assert not isinstance(y, Exception), y
        assert_within_bf16_ulps(y, model.forward(batches[rank]))


def test_unknown_fault_is_rejected():
    problem = make_problem(epmoe.LayerShape(**SHAPE), 1, seed=32)
    SHAPE1 = epmoe.LayerShape(**SHAPE)
    layer = epmoe.Layer(epmoe.HostGroup(1).communicator(0), SHAPE1, "bf16", *problem.local(0))
    with pytest.raises(epmoe.Error, match=r"inject_fault: fault=crash: must be none or "
                                          r"skip_launch_when_idle or stall or round_jump"):
        epmoe._testing.inject_fault(layer, "crash")
    epmoe._testing.inject_fault(layer, "none")
    y = layer.forward(np.zeros((0, 64), np.uint16), np.zeros((0, 2), np.int32),
                      np.zeros((0, 2), np.float32))
    assert y.shape == (0, 64) and layer.health().ok

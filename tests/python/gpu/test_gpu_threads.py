"""The CUDA executor from Python, one process driving two GPUs with one thread per rank:

    pytest tests/python/gpu      (run_torchrun.sh does, before the torchrun run)

What this checks beyond the torchrun tests: every blocking collective call releases the GIL
(NcclCommunicator creation, Layer creation, close, and the destructor that garbage collection
runs), else the two rank threads of one interpreter wait on each other forever.
"""

from __future__ import annotations

import gc
import os

import pytest

torch = pytest.importorskip("torch")

import epmoe  # noqa: E402
from gpu_ref import layer_shape, make_batch, make_weights, mismatch, reference_forward  # noqa

pytestmark = [
    pytest.mark.skipif(not epmoe.cuda_available, reason="epmoe built without the CUDA executor"),
    pytest.mark.skipif("WORLD_SIZE" in os.environ,
                       reason="one process drives both GPUs: run with plain pytest, not torchrun"),
    pytest.mark.skipif(epmoe.cuda_device_count() < 2, reason="needs 2 GPUs"),
]

from gpu_ref import run_threads  # noqa: E402

WORLD = 2


def rounds(layer, rank, shape, weights, token_counts, seed):
    """Runs the rounds on this rank's GPU; the mismatches against the torch reference."""
    device = torch.device("cuda", rank)
    outputs = []
    for r, tokens in enumerate(token_counts):
        b = make_batch(shape, tokens[rank], seed=seed + 10 * r + rank).to(device)
        outputs.append((r, b, layer.forward(b.x, b.ids, b.weights)))
    torch.cuda.synchronize(device)
    return [f"rank {rank} round {r}: {why}" for r, b, y in outputs
            if (why := mismatch(y, reference_forward(b, weights)))]


def test_nccl_communicators_from_unique_id_on_two_threads_run_and_close_a_layer():
    shape = layer_shape()
    weights = make_weights(shape, seed=7)
    uid = epmoe.get_unique_id()

    def rank_main(rank):
        torch.cuda.set_device(rank)
        # blocks until both threads have joined: the GIL must be released meanwhile
        comm = epmoe.NcclCommunicator(uid, rank, WORLD, rank)
        assert (comm.rank, comm.world, comm.device) == (rank, WORLD, f"cuda:{rank}")
        w13, w2 = weights.local(rank, WORLD)
        layer = epmoe.Layer(comm, shape, "bf16", w13.cuda(rank), w2.cuda(rank),
                            expert_math="exact")
        failures = rounds(layer, rank, shape, weights, [(4, 0), (0, 0), (17, 64)], seed=1)
        layer.close()  # collective
        comm.close()  # collective
        return failures, layer.closed, comm.closed

    results = run_threads(WORLD, rank_main)
    for failures, layer_closed, comm_closed in results:
        assert not failures, failures
        assert layer_closed and comm_closed


def test_layers_dropped_by_their_threads_are_destroyed_without_deadlock():
    shape = layer_shape()
    weights = make_weights(shape, seed=8)
    comms = epmoe.nccl_communicators([0, 1])
    assert [c.rank for c in comms] == [0, 1] and all(c.world == 2 for c in comms)
    assert all(isinstance(c, epmoe.NcclCommunicator) for c in comms)

    def rank_main(rank):
        torch.cuda.set_device(rank)
        w13, w2 = weights.local(rank, WORLD)
        layer = epmoe.Layer(comms[rank], shape, "bf16", w13, w2, expert_math="exact")  # host
        failures = rounds(layer, rank, shape, weights, [(0, 3), (64, 0)], seed=2)
        try:
            comms[rank].close()
            failures.append("closed a communicator with an open layer")
        except epmoe.Error as e:
            if "still open" not in str(e):
                failures.append(str(e))
        del layer  # the last reference: the collective destructor runs here, GIL released
        gc.collect()
        return failures

    for failures in run_threads(WORLD, rank_main):
        assert not failures, failures
    epmoe.close_all(comms)  # one thread each: closing is collective
    assert all(c.closed for c in comms)


def test_close_all_closes_the_layers_of_a_one_process_group():
    shape = layer_shape()
    weights = make_weights(shape, seed=9)
    comms = epmoe.nccl_communicators([0, 1])

    def create(rank):
        torch.cuda.set_device(rank)
        w13, w2 = weights.local(rank, WORLD)
        layer = epmoe.Layer(comms[rank], shape, "nvfp4", w13.cuda(rank), w2.cuda(rank))
        b = make_batch(shape, 5, seed=rank).to(torch.device("cuda", rank))
        layer.forward(b.x, b.ids, b.weights)
        torch.cuda.synchronize(rank)
        return layer

    layers = run_threads(WORLD, create)
    assert all(layer.health().ok for layer in layers)
    epmoe.close_all(layers)
    assert all(layer.closed for layer in layers)
    with pytest.raises(epmoe.Error, match="the layer is closed"):
        layers[0].health()
    epmoe.close_all(comms)

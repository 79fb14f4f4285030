"""Closing layers and communicators, and the CUDA bindings' checks that need no GPU."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import epmoe
from epmoe_ref import make_batch, make_layers, make_problem, raise_first, run_ranks

SHAPE = dict(hidden=64, intermediate=64, num_experts=4, top_k=2, max_tokens_per_rank=8)


def test_closed_layer_refuses_every_call_and_its_communicator_closes_after_it():
    problem = make_problem(epmoe.LayerShape(**SHAPE), 1, seed=1)
    comm = epmoe.HostGroup(1).communicator(0)
    assert comm.device == "cpu" and not comm.closed
    b = make_batch(problem.shape, 3, seed=2)
    with epmoe.Layer(comm, problem.shape, "bf16", *problem.local(0)) as layer:
        layer.forward(b.x, b.ids, b.weights)
        assert not layer.closed
        with pytest.raises(epmoe.Error, match=r"Communicator.close\(\): 1 layer\(s\) created on "
                                              r"it are still open; close them first"):
            comm.close()
    assert layer.closed
    for call, name in [(lambda: layer.forward(b.x, b.ids, b.weights), "forward"),
                       (layer.health, "health"), (layer.reset, "reset"),
                       (lambda: layer.config, "config"), (lambda: layer.next_round, "next_round")]:
        with pytest.raises(epmoe.Error, match=rf"^{name}: the layer is closed") as e:
            call()
        assert e.value.code == "invalid_argument"
    layer.close()  # twice: nothing
    with comm:
        assert repr(comm) == "Communicator(rank=0, world=1, backend=cpu_threads, device=cpu)"
    assert comm.closed and repr(comm) == "Communicator(closed)"
    with pytest.raises(epmoe.Error, match="Communicator.rank: the communicator is closed"):
        comm.rank
    with pytest.raises(epmoe.Error, match="the communicator is closed"):
        epmoe.Layer(comm, problem.shape, "bf16", *problem.local(0))
    config = epmoe.make_config(problem.shape)
    with pytest.raises(epmoe.Error, match="^Layer: the communicator is closed"):
        epmoe.Layer.from_config(comm, config, *problem.local(0))
    comm.close()


def test_layers_dropped_or_closed_from_their_threads_release_the_communicator():
    problem = make_problem(epmoe.LayerShape(**SHAPE), 2, seed=3)
    group = epmoe.HostGroup(2)
    comms = [group.communicator(r) for r in range(2)]

    def create_run_drop(rank):
        layer = epmoe.Layer(comms[rank], problem.shape, "bf16", *problem.local(rank))
        b = make_batch(problem.shape, rank, seed=rank)
        layer.forward(b.x, b.ids, b.weights)
        del layer  # the last reference: destroyed here, with the GIL released
        gc.collect()

    raise_first(run_ranks(2, create_run_drop))
    layers = make_layers(problem, group=group)
    epmoe.close_all(layers)
    assert all(layer.closed for layer in layers)
    epmoe.close_all(comms)
    assert all(c.closed for c in comms)


def test_a_layer_needs_an_epmoe_communicator():
    problem = make_problem(epmoe.LayerShape(**SHAPE), 1, seed=4)
    with pytest.raises(epmoe.Error, match=r"Layer: comm is a str, not an epmoe.Communicator"):
        epmoe._epmoe._Layer.__init__(epmoe.Layer.__new__(epmoe.Layer), "comm",
                                     epmoe.make_config(problem.shape), *problem.local(0))


def test_nccl_entry_points_without_a_gpu_fail_with_named_errors():
    assert epmoe.cuda_device_count() >= 0
    assert isinstance(epmoe.nccl_library, str) and epmoe.nccl_library.endswith(
        ("libnccl.so", "libnccl.so.2")) == epmoe.cuda_available
    with pytest.raises(epmoe.Error, match=r"NcclCommunicator: unique_id has 3 bytes, expected "
                                          r"128 \(the bytes of epmoe.get_unique_id\(\)"):
        epmoe.NcclCommunicator(b"abc", 0, 1, 0)
    with pytest.raises(epmoe.Error, match=r"timeout_ms=-1: must be in \[0, 3600000\]"):
        epmoe.NcclCommunicator(bytes(128), 0, 1, 0, timeout_ms=-1)
    with pytest.raises(epmoe.Error, match=r"timeout_ms=-5: must be in \[0, 3600000\]"):
        epmoe.nccl_communicators([0], timeout_ms=-5)
    if not epmoe.cuda_available:
        with pytest.raises(epmoe.Error, match="get_unique_id: this build of epmoe has no CUDA"):
            epmoe.get_unique_id()
        return
    uid = epmoe.get_unique_id()  # no GPU needed
    assert isinstance(uid, bytes) and len(uid) == 128
    with pytest.raises(epmoe.Error, match=r"make_nccl_communicator: rank=2 world=2"):
        epmoe.NcclCommunicator(uid, 2, 2, 0)
    if epmoe.cuda_device_count() == 0:
        with pytest.raises(epmoe.Error, match=r"device=0: this process sees 0 GPU\(s\)"):
            epmoe.NcclCommunicator(uid, 0, 1, 0)
        with pytest.raises(epmoe.Error, match=r"device 0 does not exist"):
            epmoe.nccl_communicators([0])


def test_init_from_torch_distributed_needs_an_initialised_group():
    torch = pytest.importorskip("torch")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        pytest.skip("torch.distributed is initialised in this process")
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        epmoe.init_from_torch_distributed()


def test_default_stream_is_zero_for_host_arrays():
    from epmoe import _stream_handle

    x = np.zeros((1, 64), np.uint16)
    assert _stream_handle(None, x) == 0 and _stream_handle(7, x) == 7

    class Cupyish:
        ptr = 1234

    assert _stream_handle(Cupyish(), x) == 1234
    with pytest.raises(TypeError, match="forward: stream must be None, an int or a CUDA stream"):
        _stream_handle("stream", x)


def test_abort_is_local_and_idempotent_and_closed_communicators_refuse_it():
    # The CPU executor's teardown is always local, so abort() changes nothing there: the layer
    # keeps working and closing stays orderly. (On the GPU it is ncclCommAbort:
    # tests/gpu/run.sh kills a rank process and rebuilds.)
    problem = make_problem(epmoe.LayerShape(**SHAPE), 1, seed=4)
    comm = epmoe.HostGroup(1).communicator(0)
    b = make_batch(problem.shape, 2, seed=5)
    with epmoe.Layer(comm, problem.shape, "bf16", *problem.local(0)) as layer:
        comm.abort()
        comm.abort()
        y = layer.forward(b.x, b.ids, b.weights)
        assert y.shape == (2, problem.shape.hidden)
    comm.close()
    with pytest.raises(epmoe.Error, match="^Communicator.abort: the communicator is closed"):
        comm.abort()

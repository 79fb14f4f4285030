"""The CUDA executor from Python, one process per GPU, as a serving engine runs it:

    torchrun --nproc-per-node=2 -m pytest tests/python/gpu      (run_torchrun.sh does)

Every test is collective: both ranks run it in the same order and every rank calls forward in
every round (T == 0 included). Checks are gathered and asserted after the rounds (and the layer's
close), so a failure on one rank does not leave the other waiting in a collective.
"""

from __future__ import annotations

import gc
import os
import re
import time

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import epmoe  # noqa: E402
from gpu_ref import (  # noqa: E402
    bits,
    layer_shape,
    make_batch,
    make_weights,
    mismatch,
    reference_forward,
)

WORLD = int(os.environ.get("WORLD_SIZE", "0"))
pytestmark = [
    pytest.mark.skipif(not epmoe.cuda_available, reason="epmoe built without the CUDA executor"),
    pytest.mark.skipif(WORLD != 2 or "LOCAL_RANK" not in os.environ,
                       reason="one process per GPU: run under torchrun --nproc-per-node=2 "
                              "(tests/python/gpu/run_torchrun.sh)"),
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


class Ep:
    """This process's rank: its communicator and GPU."""

    def __init__(self, comm: epmoe.NcclCommunicator, device: int):
        self.comm = comm
        self.rank = comm.rank
        self.world = comm.world
        self.index = device
        self.device = torch.device("cuda", device)

    def layer(self, shape, precision, weights, on_host=False, **options):
        w13, w2 = weights.local(self.rank, self.world)
        if not on_host:
            # w13 as a parameter that requires grad: read directly (DLPack would refuse it)
            w13 = torch.nn.Parameter(w13.to(self.device).float(), requires_grad=True)
            w2 = w2.to(self.device)
        options.setdefault("expert_math", "exact")  # compared within bf16 ulps
        return epmoe.Layer(self.comm, shape, precision, w13, w2, **options)


@pytest.fixture(scope="module")
def ep():
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("gloo")  # any backend: it only carries the unique id here
    comm = epmoe.init_from_torch_distributed()
    yield Ep(comm, local)
    dist.barrier()
    comm.close()
    dist.destroy_process_group()


def test_init_from_torch_distributed_gives_this_ranks_nccl_communicator(ep):
    c = ep.comm
    assert isinstance(c, epmoe.NcclCommunicator) and isinstance(c, epmoe.Communicator)
    assert (c.rank, c.world) == (dist.get_rank(), dist.get_world_size())
    assert c.backend == "cuda_nccl"
    assert c.device == f"cuda:{torch.cuda.current_device()}"
    assert torch.device(c.device) == ep.device
    assert repr(c).startswith(f"NcclCommunicator(rank={c.rank}, world=2")
    uid = epmoe.get_unique_id()
    assert isinstance(uid, bytes) and len(uid) == 128 and uid != epmoe.get_unique_id()
    assert epmoe.cuda_device_count() == torch.cuda.device_count()


# Tokens per rank per round: rounds with one idle rank, both idle, and both full.
TOKENS = [(5, 0), (0, 7), (0, 0), (64, 1), (3, 33), (64, 64)]


@pytest.mark.parametrize("combine", ["staged", "in_kernel_reduce"])
def test_bf16_forward_of_torch_tensors_matches_torch_reference_with_idle_ranks(ep, combine):
    shape = layer_shape()
    weights = make_weights(shape, seed=1)
    side = torch.cuda.Stream()
    outputs, failures = [], []
    with ep.layer(shape, "bf16", weights, combine=combine, timeout_ms=20_000) as layer:
        for r, tokens in enumerate(TOKENS):
            b = make_batch(shape, tokens[ep.rank], seed=100 * r + ep.rank).to(ep.device)
            if r == 1:  # int64 ids, caller's output
                out = torch.empty_like(b.x)
                y = layer.forward(b.x, b.ids.long(), b.weights, out=out)
                if y is not out:
                    failures.append("forward did not return out")
            elif r == 3:  # on another torch stream, taken as the current one
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    y = layer.forward(b.x, b.ids, b.weights)
                torch.cuda.current_stream().wait_stream(side)
            elif r == 4:  # an explicit stream object
                side.wait_stream(torch.cuda.current_stream())
                y = layer.forward(b.x, b.ids, b.weights, stream=side)
                torch.cuda.current_stream().wait_stream(side)
            else:  # stream=None: torch's current stream, out allocated like x
                y = layer(b.x, b.ids, b.weights)
            outputs.append((r, b, y))
        torch.cuda.synchronize()
        health, next_round = layer.health(), layer.next_round
    for r, b, y in outputs:
        if y.dtype != torch.bfloat16 or y.device != ep.device or y.shape != b.x.shape:
            failures.append(f"round {r}: y is {y.dtype} {tuple(y.shape)} on {y.device}")
        elif (why := mismatch(y, reference_forward(b, weights, combine))):
            failures.append(f"rank {ep.rank} round {r} T={b.x.shape[0]}: {why}")
    assert health.ok, health
    assert next_round == len(TOKENS) + 1
    assert not failures, failures


@pytest.mark.parametrize("precision", ["mxfp8", "nvfp4"])
def test_quantized_forward_matches_the_emulated_codecs(ep, precision):
    np = pytest.importorskip("numpy")
    from epmoe_ref import Batch as NpBatch
    from epmoe_ref import NumpyLayer, Problem, assert_within_bf16_ulps

    shape = layer_shape()
    weights = make_weights(shape, seed=2)
    outputs = []
    with ep.layer(shape, precision, weights, on_host=True, timeout_ms=20_000) as layer:
        for r, tokens in enumerate([(5, 0), (64, 64), (0, 9)]):
            b = make_batch(shape, tokens[ep.rank], seed=200 * r + ep.rank).to(ep.device)
            outputs.append((r, b, layer.forward(b.x, b.ids, b.weights)))
        torch.cuda.synchronize()
        health = layer.health()
    model = NumpyLayer(Problem(shape, ep.world, bits(weights.w13), bits(weights.w2)), precision)
    failures = []
    for r, b, y in outputs:
        ref = model.forward(NpBatch(bits(b.x), b.ids.cpu().numpy().astype(np.int32),
                                    b.weights.cpu().numpy()))
        try:
            assert_within_bf16_ulps(bits(y), ref)
        except AssertionError as e:
            failures.append(f"rank {ep.rank} round {r}: {e}")
    assert health.ok, health
    assert not failures, failures


def test_forward_captured_in_a_torch_cuda_graph_replays_with_fresh_routing(ep):
    shape, t, replays = layer_shape(), 64, 24
    weights = make_weights(shape, seed=3)
    x = torch.zeros(t, shape.hidden, dtype=torch.bfloat16, device=ep.device)
    ids = torch.full((t, shape.top_k), -1, dtype=torch.int32, device=ep.device)
    w = torch.zeros(t, shape.top_k, dtype=torch.float32, device=ep.device)
    y = torch.empty_like(x)

    def load(b):
        x.copy_(b.x)
        ids.copy_(b.ids)
        w.copy_(b.weights)

    failures = []
    with ep.layer(shape, "bf16", weights, timeout_ms=20_000) as layer:
        b = make_batch(shape, t, seed=ep.rank)
        load(b)
        layer.forward(x, ids, w, out=y)  # an eager round first, as engines warm up
        torch.cuda.synchronize()
        if (why := mismatch(y, reference_forward(b, weights))):
            failures.append(f"eager: {why}")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # stream=None: the capture stream
            layer.forward(x, ids, w, out=y)
        captured_round = layer.next_round
        for i in range(replays):
            # fresh routing every replay; every 8th replay all slots dropped (-1)
            b = make_batch(shape, t, seed=1000 * (i + 1) + ep.rank,
                           drop=1.0 if i % 8 == 7 else 0.15)
            load(b)
            graph.replay()
            torch.cuda.current_stream().synchronize()
            if (why := mismatch(y, reference_forward(b, weights))):
                failures.append(f"rank {ep.rank} replay {i}: {why}")
        health, next_round = layer.health(), layer.next_round
        del graph
    assert captured_round == 2, "capturing ran a round"
    assert health.ok, health
    assert next_round == 2 + replays, "each replay advances the round on the GPU"
    assert not failures, failures


def test_torch_tensors_that_epmoe_cannot_take_are_rejected_naming_the_argument(ep):
    shape = layer_shape()
    weights = make_weights(shape, seed=4)
    other = torch.device("cuda", 1 - ep.index)
    h, k = shape.hidden, shape.top_k
    # Weights on the other GPU: rejected on both ranks before anything collective.
    w13, w2 = weights.local(ep.rank, ep.world)
    with pytest.raises(epmoe.Error, match=rf"Layer: weights are on cuda:{other.index}, "
                                          rf"expected cpu or cuda:{ep.index}"):
        epmoe.Layer(ep.comm, shape, "bf16", w13.to(other), w2.to(other))

    b = make_batch(shape, 4, seed=ep.rank).to(ep.device)
    cases = [
        ((b.x.cpu(), b.ids, b.weights), rf"forward: x is on cpu, expected cuda:{ep.index}"),
        ((b.x.to(other), b.ids, b.weights),
         rf"forward: x is on cuda:{other.index}, expected cuda:{ep.index}"),
        ((b.x.half(), b.ids, b.weights), r"forward: x has dtype torch.float16, which epmoe"),
        ((b.x, b.ids.short(), b.weights), r"forward: topk_ids has dtype torch.int16"),
        ((b.x, b.ids, b.weights.double()), r"forward: topk_weights has dtype f64, expected f32"),
        ((torch.empty(h, 4, dtype=torch.bfloat16, device=ep.device).t(), b.ids, b.weights),
         r"forward: x is not contiguous"),
        ((torch.empty(4, h, dtype=torch.bfloat16, device="meta"), b.ids, b.weights),
         r"forward: x is on meta, which epmoe does not take"),
        ((torch.zeros(4, h).to_sparse(), b.ids, b.weights),
         r"forward: x has layout torch.sparse_coo; pass a dense"),
        ((b.x, b.ids[:, :k - 1], b.weights), r"forward: topk_ids has shape \[4, 3\], expected"),
    ]
    failures = []
    with ep.layer(shape, "bf16", weights, timeout_ms=20_000) as layer:
        for args, pattern in cases:  # rejected before anything runs: no round is used
            try:
                layer.forward(*args)
                failures.append(f"accepted: {pattern}")
            except epmoe.Error as e:
                if e.code != "invalid_argument" or not re.search(pattern, str(e)):
                    failures.append(f"{pattern!r}: got {e.code}: {e}")
        try:
            layer.forward(b.x, b.ids, b.weights, out=torch.empty(4, h, device=ep.device))
            failures.append("accepted a float32 out")
        except epmoe.Error as e:
            if "forward: y has dtype f32, expected bf16" not in str(e):
                failures.append(f"out: {e}")
        y = layer.forward(b.x, b.ids, b.weights)  # the rounds are still in step
        torch.cuda.synchronize()
        if (why := mismatch(y, reference_forward(b, weights))):
            failures.append(why)
        next_round = layer.next_round
        with pytest.raises(epmoe.Error, match="layer\\(s\\) created on it are still open"):
            ep.comm.close()
    assert next_round == 2
    assert not failures, failures


def test_layers_are_closed_by_close_by_with_and_by_garbage_collection(ep):
    shape = layer_shape()
    weights = make_weights(shape, seed=5)
    b = make_batch(shape, 3 + ep.rank, seed=ep.rank).to(ep.device)

    dropped = ep.layer(shape, "bf16", weights)
    y1 = dropped.forward(b.x, b.ids, b.weights)
    torch.cuda.synchronize()
    del dropped  # the destructor is collective (NCCL window deregistration), GIL released
    gc.collect()

    with ep.layer(shape, "bf16", weights) as layer:
        y2 = layer.forward(b.x, b.ids, b.weights)
        torch.cuda.synchronize()
    assert layer.closed
    with pytest.raises(epmoe.Error, match="forward: the layer is closed"):
        layer.forward(b.x, b.ids, b.weights)
    layer.close()  # twice: nothing

    third = ep.layer(shape, "mxfp8", weights)
    third.forward(b.x, b.ids, b.weights)
    third.close()
    assert third.closed and not ep.comm.closed
    ref = reference_forward(b, weights)
    assert not mismatch(y1, ref) and not mismatch(y2, ref)


def test_health_names_the_rank_that_skipped_its_launch_then_reset_recovers(ep):
    if not epmoe.fault_injection_available:
        pytest.skip("module built without EPMOE_FAULT_INJECTION (no epmoe._testing)")
    shape = layer_shape(max_tokens_per_rank=16)
    weights = make_weights(shape, seed=6)
    failures, outputs = [], []
    with ep.layer(shape, "bf16", weights, timeout_ms=500) as layer:
        if ep.rank == 1:
            epmoe._testing.inject_fault(layer, "skip_launch_when_idle")
        b = make_batch(shape, 0 if ep.rank == 1 else 8, seed=3).to(ep.device)
        start = time.monotonic()
        layer.forward(b.x, b.ids, b.weights)  # returns at once; rank 0's kernel gives up
        torch.cuda.synchronize()
        seconds = time.monotonic() - start
        h = layer.health()
        if ep.rank == 0:
            if h.ok or (h.peer, h.phase, h.round) != (1, "dispatch_counts", 1):
                failures.append(f"rank 0 health: {h!r}")
            elif "rank 1" not in h.what or h.code not in ("timeout", "peer_aborted"):
                failures.append(f"rank 0 health: {h!r}")
            if seconds > 0.5 + 2.0:
                failures.append(f"rank 0 waited {seconds:.1f} s with timeout_ms=500")
            try:
                layer.forward(b.x, b.ids, b.weights)
                failures.append("rank 0 accepted work before reset()")
            except epmoe.Error as e:
                if "refused until a collective reset()" not in str(e):
                    failures.append(f"rank 0 refusal: {e}")
        dist.barrier()  # both ranks enter reset() together (its waits are bounded by 500 ms)
        layer.reset()
        if not layer.health().ok:
            failures.append(f"after reset: {layer.health()!r}")
        for r in range(3):
            bb = make_batch(shape, 5 + r + ep.rank, seed=10 * r + ep.rank).to(ep.device)
            outputs.append((r, bb, layer.forward(bb.x, bb.ids, bb.weights)))
        torch.cuda.synchronize()
        health = layer.health()
    for r, bb, y in outputs:
        if (why := mismatch(y, reference_forward(bb, weights))):
            failures.append(f"rank {ep.rank} round {r} after reset: {why}")
    assert health.ok, health
    assert not failures, failures

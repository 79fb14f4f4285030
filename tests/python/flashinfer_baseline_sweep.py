"""Run by test_flashinfer_baseline.py under torchrun on the CPU (gloo): the whole sweep of
tools/baselines/flashinfer_ep.py (worlds, shapes, T, eager and CUDA-graph timing, budget and error
paths, checks, JSON) with a stand-in for flashinfer.moe_ep and for torch.cuda's events and graphs.
The stand-in layer is torch_ep.py's bf16 forward behind FlashInfer's API (int32 ids, bf16 x,
MoEEpTensors); with FAKE_FAIL=build:EXPERTS:RANK, capture:EXPERTS:RANK or hang:EXPERTS:RANK one
rank fails (or hangs, at T > 1) on the shape with that many experts.

  python3 -m torch.distributed.run --standalone --nproc-per-node=2 \
      tests/python/flashinfer_baseline_sweep.py tools/baselines OUT.json [script arguments]
"""

import contextlib
import os
import sys
import time
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist

sys.path.insert(0, sys.argv[1])  # tools/baselines
import flashinfer_ep as fe  # noqa: E402
import torch_ep as te  # noqa: E402

te.MODELS["small"] = (256, 128, 8, 4)  # hidden, intermediate, experts, top_k
FAIL = os.environ.get("FAKE_FAIL", "")


class Event:
    def __init__(self, enable_timing=False):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


class Graph:
    capturing = None

    def __init__(self):
        self.replays = []

    def replay(self):
        for fn in self.replays:
            fn()


@contextlib.contextmanager
def graph(g):
    Graph.capturing = g
    try:
        yield
    finally:
        Graph.capturing = None


torch.cuda.Event, torch.cuda.CUDAGraph, torch.cuda.graph = Event, Graph, graph
torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.empty_cache = lambda: None


@dataclass(frozen=True)
class BootstrapConfig:
    world_size: int
    rank: int
    device: int = None
    process_group: object = None


@dataclass(frozen=True)
class FleetParams:
    num_experts: int
    max_tokens_per_rank: int
    token_hidden_size: int


@dataclass
class Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig:
    intermediate_size: int
    top_k: int


@dataclass
class MegaConfig:
    megakernel: object


@dataclass
class MoEWeightPack:
    w13: torch.Tensor
    w2: torch.Tensor


@dataclass
class MoEEpTensors:
    hidden_states: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor


def failing(kind, fleet, boot):
    what, _, rest = FAIL.partition(":")
    experts, _, rank = rest.partition(":")
    return what == kind and int(experts) == fleet.num_experts and int(rank) == boot.rank


class Layer:
    def __init__(self, boot, fleet, pack, backend):
        assert dist.get_world_size(boot.process_group) == boot.world_size
        assert pack.w13.shape == (fleet.num_experts // boot.world_size,
                                  2 * backend.megakernel.intermediate_size,
                                  fleet.token_hidden_size)
        if failing("build", fleet, boot):
            raise RuntimeError("stand-in build failure")
        self.boot, self.fleet = boot, fleet
        self.w13t, self.w2t = pack.w13.transpose(1, 2), pack.w2.transpose(1, 2)
        self.t = te.TorchEP.__new__(te.TorchEP)
        self.t.torch, self.t.dist, self.t.F = torch, dist, torch.nn.functional
        self.t.grouped = te.TorchEP.loop_mm
        self.destroyed = False

    def compute(self, t):
        assert t.topk_ids.dtype == torch.int32, "the validator wants int32 ids"
        assert t.hidden_states.shape[0] <= self.fleet.max_tokens_per_rank
        return self.t.forward(t.hidden_states, t.topk_ids.long(), t.topk_weights, self.w13t,
                              self.w2t, self.w13t.shape[0], self.boot.world_size,
                              self.boot.process_group)

    def forward(self, t):
        assert not self.destroyed
        if failing("hang", self.fleet, self.boot) and t.hidden_states.shape[0] > 1:
            time.sleep(3600)  # a peer that never arrives: the watchdog must end the run
        g = Graph.capturing
        if g is None:
            return self.compute(t)
        if failing("capture", self.fleet, self.boot):
            raise RuntimeError("stand-in capture failure")
        y = torch.empty(t.hidden_states.shape, dtype=torch.bfloat16)
        g.replays.append(lambda: y.copy_(self.compute(t)))
        return y

    def destroy(self):
        self.destroyed = True


fi = types.SimpleNamespace(
    MoEEpLayer=Layer, BootstrapConfig=BootstrapConfig, FleetParams=FleetParams,
    MoEWeightPack=MoEWeightPack, MegaConfig=MegaConfig, MoEEpTensors=MoEEpTensors,
    Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig=Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig)


def main():
    args = fe.parse_args(["--json", sys.argv[2]] + sys.argv[3:])
    dist.init_process_group("gloo")
    f = fe.FlashInferEP.__new__(fe.FlashInferEP)
    f.args, f.t_start = args, time.monotonic()
    f.torch, f.dist, f.F = torch, dist, torch.nn.functional
    f.rank, f.nproc = dist.get_rank(), dist.get_world_size()
    f.local, f.device = f.rank, torch.device("cpu")
    f.fi, f.fi_version = fi, "stand-in"
    f.points, f.prepare, f.current, f.models, f.tokens = [], [], [], [], []
    f.ceilings = dict(hbm_gbps=None, peer_gbps=None, matmul_tflops=None)
    f.gpus = ["cpu"]
    f.watchdog = fe.ShapeTimeout(f, args.hard_limit_s)
    sys.exit(f.run())


if __name__ == "__main__":
    main()

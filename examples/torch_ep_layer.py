"""How a serving engine wires epmoe's expert-parallel MoE layer into a torch model.

    torchrun --nproc-per-node 8 examples/torch_ep_layer.py --model qwen3-30b-a3b   # CUDA executor
    torchrun --nproc-per-node 2 examples/torch_ep_layer.py --experts 16 --graph    # + CUDA graph
    python examples/torch_ep_layer.py --cpu --ranks 4                              # CPU executor

What an engine does, and what this file shows:

* One ``epmoe.Layer`` per MoE layer of the model, created collectively by every rank from the
  checkpoint's state dict: this rank's experts only (expert e lives on rank e // E_local), as
  ``w13 [E_local, 2I, H]`` (gate_proj rows, then up_proj rows) and ``w2 [E_local, H, I]``
  (down_proj). The layer quantizes them to its precision and keeps its own copy.
* The router stays in the model (replicated, in torch); epmoe takes the top-k ids and weights.
* Every rank calls every MoE layer at every step, also when it has no tokens (T == 0: with
  DP attention some ranks are idle in most decode steps). A rank that skips a call makes the
  others fail within ``timeout_ms`` with an error that names it (that is the contract, not a hang).
* On an ``epmoe.Error`` from a cross-rank failure every rank logs ``health()`` and calls
  ``reset()`` on every layer (collective), then serving can go on.
* Teardown is collective on the CUDA executor: every rank closes its layers, in the same order,
  then its communicator (``close()`` releases the GIL; so does garbage collection).

The block, the weight loading, the step loop and the error handling are the same code for both
executors: torchrun runs one process per GPU (CUDA executor: torch CUDA tensors, the current torch
stream, bootstrapped with ``epmoe.init_from_torch_distributed()``), ``--cpu`` runs the ranks as
threads of one process (torch CPU tensors). ``--graph`` (CUDA) also captures one decode step of
every layer in a ``torch.cuda.CUDAGraph`` and replays it with fresh inputs.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from typing import Dict, List, Optional

import torch

import epmoe

# --------------------------------------------------------------------------- communicators


def nccl_communicator() -> epmoe.Communicator:
    """One process per GPU (torchrun): rank 0 makes the NCCL unique id, torch.distributed
    broadcasts it, every rank joins on its GPU."""
    if not epmoe.cuda_available:
        sys.exit("this epmoe module was built without the CUDA executor; run with --cpu")
    import torch.distributed as dist

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    # = get_unique_id() on rank 0, broadcast_object_list, NcclCommunicator(id, rank, world, dev)
    return epmoe.init_from_torch_distributed()


# --------------------------------------------------------------------------- weights


def local_expert_weights(state_dict: Dict[str, torch.Tensor], prefix: str, first: int,
                         count: int):
    """This rank's experts from a Hugging Face style state dict (Qwen3-MoE / Mixtral naming:
    ``{prefix}.experts.{e}.{gate,up,down}_proj.weight``)."""
    experts = range(first, first + count)
    w13 = torch.stack([
        torch.cat([state_dict[f"{prefix}.experts.{e}.gate_proj.weight"],   # [I, H]
                   state_dict[f"{prefix}.experts.{e}.up_proj.weight"]])    # [I, H]
        for e in experts])                                                 # [E_local, 2I, H]
    w2 = torch.stack([state_dict[f"{prefix}.experts.{e}.down_proj.weight"]  # [H, I]
                      for e in experts])                                  # [E_local, H, I]
    return w13.contiguous(), w2.contiguous()


class EPMoEBlock(torch.nn.Module):
    """One MoE layer of the model: the router in torch, the experts in epmoe."""

    def __init__(self, comm: epmoe.Communicator, shape: epmoe.LayerShape,
                 state_dict: Dict[str, torch.Tensor], prefix: str, precision: str,
                 device: torch.device, **options):
        super().__init__()
        e_local = shape.num_experts // comm.world
        w13, w2 = local_expert_weights(state_dict, prefix, comm.rank * e_local, e_local)
        self.router = state_dict[f"{prefix}.gate.weight"].to(device, torch.float32)  # [E, H]
        self.top_k = shape.top_k
        # Collective: every rank creates its layer with the same shape and options, at the same
        # point of model loading. The layer keeps its own (quantized) copy of w13 and w2.
        self.layer = epmoe.Layer(comm, shape, precision, w13.to(device), w2.to(device), **options)

    def forward(self, hidden: torch.Tensor, stream=None) -> torch.Tensor:
        """hidden [T, H] bf16, T may be 0 (and differ per rank): call it anyway."""
        probs = torch.softmax(hidden.float() @ self.router.T, dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)  # norm_topk_prob (Qwen3-MoE)
        out = torch.empty_like(hidden)
        # No copies: torch tensors are read directly (no DLPack export, nothing synchronised).
        # On the CUDA executor the work goes on `stream`, by default torch's current stream, so
        # the call can be captured in a CUDA graph.
        self.layer.forward(hidden, ids.to(torch.int32), weights.contiguous(), out=out,
                           stream=stream)
        return out


# --------------------------------------------------------------------------- the engine's loop


def serve(comm: epmoe.Communicator, state_dict, shape: epmoe.LayerShape, num_layers: int,
          steps: List[int], precision: str, device: torch.device, timeout_ms: int,
          log=print, graph: bool = False) -> None:
    blocks = [EPMoEBlock(comm, shape, state_dict, f"model.layers.{i}.mlp", precision, device,
                         timeout_ms=timeout_ms)
              for i in range(num_layers)]
    gen = torch.Generator().manual_seed(1000 + comm.rank)
    for step, tokens in enumerate(steps):
        # Stand-in for this rank's attention output; T == 0 when this rank has no requests.
        h = (torch.rand(tokens, shape.hidden, generator=gen) - 0.5).to(device, torch.bfloat16)
        try:
            for block in blocks:  # every MoE layer, every step, whatever T is
                h = h + block(h)  # stream: torch's current stream (CUDA), ignored on the CPU
        except epmoe.Error as e:
            # A peer went missing (timeout / peer_aborted / protocol_violation): every rank gets
            # an error within timeout_ms (on the GPU from the next forward; health() has it as
            # soon as the stream has run). Log who, where and when; then every rank resets every
            # layer (collective), and the step is retried or its requests failed.
            log(f"rank {comm.rank} step {step}: {e.code}: {e}")
            for block in blocks:
                log(f"  {block.layer.health()}")
            for block in blocks:
                block.layer.reset()
            continue
        log(f"rank {comm.rank} step {step}: T={tokens:3d}  |y|={h.float().norm().item():.4f}")
    if graph and device.type == "cuda":
        decode_with_cuda_graph(blocks, shape, comm, device, log)
    for block in blocks:  # collective on the CUDA executor: every rank, same order
        block.layer.close()


def decode_with_cuda_graph(blocks, shape: epmoe.LayerShape, comm, device: torch.device, log,
                           tokens: int = 8, replays: int = 5) -> None:
    """One decode step of every layer captured once, replayed with fresh inputs: the round
    counter lives on the GPU, so a replay needs no host involvement. Every rank captures and
    replays the same number of times (an idle rank captures with T == 0)."""
    t = tokens if comm.rank % 2 == 0 else 0  # odd ranks idle in every replayed step
    static_in = torch.zeros(t, shape.hidden, dtype=torch.bfloat16, device=device)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up torch's own kernels (softmax, topk) off the graph
        h = static_in
        for block in blocks:
            h = h + block(h)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        h = static_in
        for block in blocks:
            h = h + block(h)
    static_out = h
    gen = torch.Generator().manual_seed(2000 + comm.rank)
    for i in range(replays):
        static_in.copy_((torch.rand(t, shape.hidden, generator=gen) - 0.5).to(torch.bfloat16))
        graph.replay()
        log(f"rank {comm.rank} graph step {i}: T={t:3d}  "
            f"|y|={static_out.float().norm().item():.4f}")


# --------------------------------------------------------------------------- a checkpoint


def random_state_dict(shape: epmoe.LayerShape, num_layers: int, seed: int = 0):
    """What a checkpoint loader would return, with random bf16 weights (HF naming)."""
    g = torch.Generator().manual_seed(seed)
    h, i = shape.hidden, shape.intermediate

    def w(rows, cols):
        return ((torch.rand(rows, cols, generator=g) * 2 - 1) / cols ** 0.5).to(torch.bfloat16)

    sd = {}
    for layer in range(num_layers):
        p = f"model.layers.{layer}.mlp"
        sd[f"{p}.gate.weight"] = w(shape.num_experts, h)
        for e in range(shape.num_experts):
            sd[f"{p}.experts.{e}.gate_proj.weight"] = w(i, h)
            sd[f"{p}.experts.{e}.up_proj.weight"] = w(i, h)
            sd[f"{p}.experts.{e}.down_proj.weight"] = w(h, i)
    return sd


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--experts", type=int, default=0, help="fewer experts than the model's")
    ap.add_argument("--layers", type=int, default=2, help="MoE layers to build")
    ap.add_argument("--precision", default="bf16", help="bf16 | mxfp8 | nvfp4")
    ap.add_argument("--max-tokens", type=int, default=16, help="max_tokens_per_rank")
    ap.add_argument("--timeout-ms", type=int, default=10_000)
    ap.add_argument("--cpu", action="store_true", help="CPU executor: ranks are threads")
    ap.add_argument("--ranks", type=int, default=2, help="ranks of the CPU executor")
    ap.add_argument("--graph", action="store_true",
                    help="CUDA: also replay a captured decode step (torch.cuda.graph)")
    args = ap.parse_args(argv)

    model = epmoe.find_model(args.model)
    shape = model.layer_shape(args.max_tokens)
    if args.cpu and not args.experts:  # the CPU executor holds every expert in host memory
        args.experts = args.ranks * -(-max(8, shape.top_k) // args.ranks)
    if args.experts:
        shape.num_experts = args.experts
    state_dict = random_state_dict(shape, args.layers)  # every rank loads the same checkpoint

    if not args.cpu:
        comm = nccl_communicator()
        steps = [args.max_tokens if (s + comm.rank) % 3 else 0 for s in range(6)]
        serve(comm, state_dict, shape, args.layers, steps, args.precision,
              torch.device("cuda", torch.cuda.current_device()), args.timeout_ms,
              graph=args.graph)
        comm.close()  # collective, after every layer on it is closed
        torch.distributed.destroy_process_group()
        return

    # CPU executor: every rank is a thread of this process; each rank's layers are created and
    # driven from its own thread, exactly as each process would on GPUs.
    group = epmoe.HostGroup(args.ranks)
    lock = threading.Lock()

    def log(line):
        with lock:
            print(line, flush=True)

    def rank_main(rank):
        # Rank r is idle (T == 0) in some steps, as DP-attention ranks are.
        steps = [0 if (s + rank) % 3 == 0 else 1 + (5 * s + rank) % args.max_tokens
                 for s in range(6)]
        serve(group.communicator(rank), state_dict, shape, args.layers, steps, args.precision,
              torch.device("cpu"), args.timeout_ms, log)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(args.ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()

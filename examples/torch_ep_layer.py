"""How a serving engine wires epmoe's expert-parallel MoE layer into a torch model.

    torchrun --nproc-per-node 8 examples/torch_ep_layer.py --model qwen3-30b-a3b   # CUDA executor
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

NOT BUILT YET — the CUDA half of the Python bindings: ``epmoe.get_unique_id()`` and
``epmoe.nccl_communicator(unique_id, rank, world, device)`` (the C++ library's
``epmoe::get_unique_id`` / ``make_nccl_communicator``) are not in the module yet, so the torchrun
path (``nccl_communicator`` below) is written against the API as it will be. Everything else — the
block, the weight loading, the step loop, error handling — is the same code for both executors
and runs today with ``--cpu`` (torch CPU tensors, ranks as threads of one process).
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
    broadcasts it, every rank joins. NEEDS THE CUDA HALF OF THE BINDINGS (not built yet)."""
    if not hasattr(epmoe, "get_unique_id"):
        sys.exit("this epmoe module has no CUDA executor bindings yet (get_unique_id, "
                 "nccl_communicator); run this example with --cpu")
    import torch.distributed as dist

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(device)
    box = [epmoe.get_unique_id() if rank == 0 else None]  # 128 opaque bytes
    dist.broadcast_object_list(box, src=0)
    return epmoe.nccl_communicator(box[0], rank, world, device)


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
        # DLPack in and out, no copies; on the CUDA executor `stream` is the engine's stream
        # (torch.cuda.current_stream()), and the call is graph-capturable.
        self.layer.forward(hidden, ids.to(torch.int32), weights.contiguous(), out=out,
                           stream=stream)
        return out


# --------------------------------------------------------------------------- the engine's loop


def serve(comm: epmoe.Communicator, state_dict, shape: epmoe.LayerShape, num_layers: int,
          steps: List[int], precision: str, device: torch.device, timeout_ms: int,
          log=print) -> None:
    blocks = [EPMoEBlock(comm, shape, state_dict, f"model.layers.{i}.mlp", precision, device,
                         timeout_ms=timeout_ms)
              for i in range(num_layers)]
    stream = torch.cuda.current_stream() if device.type == "cuda" else None
    gen = torch.Generator().manual_seed(1000 + comm.rank)
    for step, tokens in enumerate(steps):
        # Stand-in for this rank's attention output; T == 0 when this rank has no requests.
        h = (torch.rand(tokens, shape.hidden, generator=gen) - 0.5).to(device, torch.bfloat16)
        try:
            for block in blocks:  # every MoE layer, every step, whatever T is
                h = h + block(h, stream)
        except epmoe.Error as e:
            # A peer went missing (timeout / peer_aborted / protocol_violation): every rank gets
            # an error within timeout_ms. Log who, where and when; then every rank resets every
            # layer (collective), and the step is retried or its requests failed.
            log(f"rank {comm.rank} step {step}: {e.code}: {e}")
            for block in blocks:
                log(f"  {block.layer.health()}")
            for block in blocks:
                block.layer.reset()
            continue
        log(f"rank {comm.rank} step {step}: T={tokens:3d}  |y|={h.float().norm().item():.4f}")


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
              torch.device("cuda", torch.cuda.current_device()), args.timeout_ms)
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

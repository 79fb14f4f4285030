"""One MoE layer of a tiny Qwen3-MoE model served by epmoe, end to end:

    torchrun --nproc-per-node 2 examples/qwen3_moe_layer.py --graph    # CUDA executor (1+ GPUs)
    python examples/qwen3_moe_layer.py --cpu --ranks 2                 # CPU executor (threads)

Every rank builds the same tiny random ``Qwen3MoeForCausalLM`` (transformers 5; a stand-in for
loading a checkpoint), then replaces layer 0's MoE block (``model.model.layers[0].mlp``) by an
epmoe one built from the model's state dict: this rank's experts (``experts.gate_up_proj``
[E, 2I, H] rows of its experts -> w13, ``experts.down_proj`` -> w2), the router in torch
(softmax, top-k, ``norm_topk_prob``, as Qwen3-MoE does). Then each rank serves its own requests
(data-parallel attention): a prefill of the whole model per step, T tokens, T == 0 on idle
ranks, which still call the MoE layer (every rank, every step). Each step's logits are checked
against the untouched transformers model. ``--graph`` (CUDA) then captures one decode step of
the layer (router + epmoe) in a ``torch.cuda.CUDAGraph`` and replays it with fresh tokens.
docs/models.md describes the layouts and routers.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import threading
from typing import List, Optional

import torch

import epmoe
from epmoe import models


def tiny_qwen3_moe(experts: int, seed: int = 0):
    """A 1-layer Qwen3-MoE with random bf16 weights (the same on every rank for a seed)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                            moe_intermediate_size=128, num_experts=experts, num_experts_per_tok=4,
                            norm_topk_prob=True, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64)
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16).eval()
    with torch.no_grad():  # a router with clear preferences (init's 0.02 std is near-uniform)
        model.model.layers[0].mlp.gate.weight.normal_(0.0, 0.2)
    return model, config


class EPMoEMlp(torch.nn.Module):
    """Drop-in for the model's MoE block: router in torch, experts in epmoe (collective)."""

    def __init__(self, moe: models.EPMoE):
        super().__init__()
        self.moe = moe

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.moe(hidden)


def serve(comm, model, config, steps: List[int], precision: str, device: torch.device,
          max_tokens: int, graph: bool, log=print) -> bool:
    reference = copy.deepcopy(model).to(device)  # transformers, untouched
    served = copy.deepcopy(model).to(device)
    # Collective: every rank builds its layer from the same checkpoint, this rank's experts only.
    moe = models.EPMoE.from_state_dict(comm, model.state_dict(), config, "model.layers.0.mlp",
                                       precision, max_tokens_per_rank=max_tokens, device=device,
                                       timeout_ms=20_000)
    served.model.layers[0].mlp = EPMoEMlp(moe)
    bound = {"bf16": 0.02, "mxfp8": 0.10, "nvfp4": 0.35}[precision]
    ok = True
    gen = torch.Generator().manual_seed(1000 + comm.rank)
    with torch.no_grad():
        for step, tokens in enumerate(steps):
            if tokens == 0:  # idle: no request on this rank, but the layer is still called
                moe(torch.empty(0, config.hidden_size, dtype=torch.bfloat16, device=device))
                log(f"rank {comm.rank} step {step}: T=  0 (idle)")
                continue
            ids = torch.randint(0, config.vocab_size, (1, tokens), generator=gen).to(device)
            logits = served(ids).logits.float()
            ref = reference(ids).logits.float()
            err = ((logits - ref).norm() / ref.norm()).item()
            ok &= err < bound
            log(f"rank {comm.rank} step {step}: T={tokens:3d}  logits rel_l2 vs transformers "
                f"{err:.2e} (bound {bound})")
        if graph and device.type == "cuda":
            ok &= decode_with_cuda_graph(moe, config, comm, device, log)
    health = moe.layer.health()
    moe.close()  # collective on the CUDA executor
    if not health.ok:
        log(f"rank {comm.rank}: {health}")
    return ok and health.ok


def decode_with_cuda_graph(moe, config, comm, device, log, tokens: int = 8, replays: int = 4):
    """One decode step of the layer (router + epmoe) captured once, replayed with fresh hidden
    states; each replay equals an eager call on the same input. Odd ranks are idle (T == 0)."""
    t = tokens if comm.rank % 2 == 0 else 0
    static_in = torch.zeros(t, config.hidden_size, dtype=torch.bfloat16, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up torch's kernels (router) off the graph
        moe(static_in)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = moe(static_in)
    gen = torch.Generator().manual_seed(2000 + comm.rank)
    ok = True
    for i in range(replays):
        static_in.copy_(torch.randn(t, config.hidden_size, generator=gen).to(torch.bfloat16))
        g.replay()
        replayed = static_out.clone()
        same = torch.equal(replayed, moe(static_in))  # an eager round of its own
        ok &= same
        log(f"rank {comm.rank} graph step {i}: T={t:3d}  |y|={replayed.float().norm().item():.4f}"
            f"  {'== eager' if same else 'DIFFERS from eager'}")
    return ok


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--precision", default="bf16", help="bf16 | mxfp8 | nvfp4")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32, help="max_tokens_per_rank")
    ap.add_argument("--cpu", action="store_true", help="CPU executor: ranks are threads")
    ap.add_argument("--ranks", type=int, default=2, help="ranks of the CPU executor")
    ap.add_argument("--graph", action="store_true", help="CUDA: replay a captured decode step")
    args = ap.parse_args(argv)
    model, config = tiny_qwen3_moe(args.experts)

    def steps_of(rank):  # rank r is idle in some steps, as data-parallel-attention ranks are
        return [0 if (s + rank) % 3 == 0 else 1 + (7 * s + 3 * rank) % args.max_tokens
                for s in range(6)]

    if not args.cpu:
        if not epmoe.cuda_available:
            sys.exit("this epmoe module was built without the CUDA executor; run with --cpu")
        import torch.distributed as dist

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group("gloo")  # only carries NCCL's unique id
            comm = epmoe.init_from_torch_distributed()
        else:  # plain `python examples/qwen3_moe_layer.py`: world 1
            comm = epmoe.NcclCommunicator(epmoe.get_unique_id(), 0, 1, torch.cuda.current_device())
        ok = serve(comm, model, config, steps_of(comm.rank), args.precision,
                   torch.device("cuda", torch.cuda.current_device()), args.max_tokens, args.graph)
        comm.close()  # collective, after the layer
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(0 if ok else 1)

    group = epmoe.HostGroup(args.ranks)
    lock = threading.Lock()
    results = [False] * args.ranks

    def log(line):
        with lock:
            print(line, flush=True)

    def rank_main(rank):
        results[rank] = serve(group.communicator(rank), model, config, steps_of(rank),
                              args.precision, torch.device("cpu"), args.max_tokens, False, log)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(args.ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()

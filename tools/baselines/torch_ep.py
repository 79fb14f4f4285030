#!/usr/bin/env python3
"""The obvious PyTorch expert-parallel MoE layer, timed the way `epmoe bench` times epmoe.

A baseline, not a reference: what a serving engine gets by writing the EP layer with stock PyTorch.
One process per GPU (torchrun). One forward on each rank, for its T tokens:

  1. every valid (token, top-k slot) becomes one row: the token's x row, copied once per slot
     (the common naive dispatch: one copy per (token, expert), NOT one per destination rank),
     sorted by expert id, which also groups the rows by owner rank (expert e lives on rank
     e // E_local);
  2. torch.distributed.all_to_all_single of the per-rank row counts, then .tolist() (a host sync),
     then all_to_all_single of the rows (bf16) and of their local expert ids (int32);
  3. the received rows sorted by local expert; FC1 = torch._grouped_mm(rows, w13^T, offs) with
     offs = cumulative rows per expert (bf16 in and out, fp32 accumulate); SwiGLU
     (silu(gate) * up, in bf16); FC2 = torch._grouped_mm(h, w2^T, offs); back to arrival order;
  4. all_to_all_single of the result rows back to their home ranks;
  5. y = sum over slots of weight * row (index_add_ in fp32), cast to bf16.

With world 1 steps 2 and 4 are skipped (no communication is needed). If torch._grouped_mm is
missing or fails a probe, FC1/FC2 fall back to a loop of matmuls per expert (JSON: "gemm").

Weights and routing: the same distributions as `epmoe bench`, not the same numbers (same seed is
not needed for timing): weights U(-1, 1)/sqrt(fan_in) in bf16, x U(-1, 1) in bf16, routing uniform
top-k with distinct experts per token, 5 % of slots dropped (-1), weights 0.1 + U(0, 1) normalised.

Timing: per point, --warmup rounds then --rounds timed rounds; before each round every rank meets
in an all-reduce (a barrier that also carries rank 0's decisions); CUDA events around the whole
forward on each rank; a round's latency is the slowest rank's; median and p90 over rounds. Output
JSON has the schema of `epmoe bench --json` (impl "torch_ep", precision "bf16", combine
"a2a_per_slot"), so bench/plot.py draws both.

  python3 -m torch.distributed.run --nproc-per-node=2 tools/baselines/torch_ep.py --json t.json
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (stdlib only at import)
from common import MODELS, TRAFFIC_KEYS, parse_models, plan_rounds  # noqa: E402,F401


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Naive PyTorch EP MoE layer (NCCL all-to-all + torch._grouped_mm), timed like "
        "`epmoe bench`. Run one process per GPU: python3 -m torch.distributed.run "
        "--nproc-per-node=N tools/baselines/torch_ep.py ...",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    common.add_model_args(p, "qwen3-30b-a3b,deepseek-v3")
    common.add_tokens_worlds_args(p)
    common.add_timing_args(p)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-check", action="store_true",
                   help="skip the per-world check of the layer against a dense fp32 forward "
                   "(small shape, all weights on every rank)")
    common.add_ceilings_arg(p)
    p.add_argument("--json", default="", help="write the points here (rank 0)")
    return p.parse_args(argv)


class TorchEP:
    """Everything that needs torch, imported once the arguments parsed (--help needs no torch)."""

    def __init__(self, args):
        import datetime

        import torch
        import torch.distributed as dist
        import torch.nn.functional as F

        self.torch, self.dist, self.F = torch, dist, F
        self.args = args
        if not torch.cuda.is_available():
            sys.exit("torch_ep.py needs CUDA GPUs (one process per GPU under torchrun)")
        self.rank, self.nproc, local = common.init_rank_env(29533)
        self.device = torch.device("cuda", local)
        torch.cuda.set_device(self.device)
        dist.init_process_group("nccl", device_id=self.device,
                                timeout=datetime.timedelta(minutes=60))
        self.t_start = time.monotonic()
        self.grouped, self.gemm_name = self.pick_grouped_mm()

    def log(self, text):
        if self.rank == 0:
            print(text, flush=True)

    # ---- grouped GEMM: torch._grouped_mm when it exists and passes a probe, else a loop ----
    loop_mm = staticmethod(common.loop_mm)

    def pick_grouped_mm(self):
        return common.pick_grouped_mm(self.torch, self.device, self.log)

    # ---- the layer ----
    def forward(self, x, ids, wts, w13t, w2t, e_local, world, group):
        """x [T, H] bf16, ids [T, K] int64 (-1 = none), wts [T, K] f32 -> y [T, H] bf16.
        w13t [E_local, H, 2I] and w2t [E_local, I, H] (transposed views of the checkpoint's)."""
        torch, dist = self.torch, self.dist
        t, h = x.shape
        k = ids.shape[1]
        inter = w2t.shape[1]
        flat = ids.reshape(-1)
        slots = (flat >= 0).nonzero().squeeze(1)
        experts = flat[slots]
        order = torch.argsort(experts, stable=True)  # by expert, hence by owner rank
        slots, experts = slots[order], experts[order]
        tok = slots // k
        send_x = x[tok]  # one copy per (token, expert) slot
        local_e = (experts % e_local).to(torch.int32)
        if world > 1:
            send_counts = torch.bincount(experts // e_local, minlength=world)
            recv_counts = torch.empty_like(send_counts)
            dist.all_to_all_single(recv_counts, send_counts, group=group)
            sc, rc = send_counts.tolist(), recv_counts.tolist()  # host sync
            recv_x = x.new_empty(sum(rc), h)
            dist.all_to_all_single(recv_x, send_x, rc, sc, group=group)
            recv_e = local_e.new_empty(sum(rc))
            dist.all_to_all_single(recv_e, local_e, rc, sc, group=group)
        else:
            recv_x, recv_e = send_x, local_e
        if recv_x.shape[0] > 0:
            perm = torch.argsort(recv_e, stable=True)
            offs = torch.cumsum(torch.bincount(recv_e, minlength=e_local), 0).to(torch.int32)
            h1 = self.grouped(recv_x[perm], w13t, offs)  # [M, 2I]: gate | up
            act = self.F.silu(h1[:, :inter]) * h1[:, inter:]
            out_sorted = self.grouped(act, w2t, offs)  # [M, H]
            out = torch.empty_like(out_sorted)
            out[perm] = out_sorted
        else:
            out = recv_x.new_empty(0, h)
        if world > 1:
            back = x.new_empty(send_x.shape[0], h)
            dist.all_to_all_single(back, out, sc, rc, group=group)
        else:
            back = out
        y = torch.zeros(t, h, device=x.device, dtype=torch.float32)
        y.index_add_(0, tok, back.float() * wts.reshape(-1)[slots].unsqueeze(1))
        return y.to(torch.bfloat16)

    def make_weights(self, hidden, inter, e_local, seed):
        return common.make_weights(self.torch, self.device, hidden, inter, e_local, seed)

    def make_routing(self, t, experts, k, seed):
        return common.make_routing(self.torch, self.device, t, experts, k, seed)

    def agree(self, flag, group):
        """Rank 0's flag on every rank of the group; also a barrier (all-reduce, then a sync)."""
        return common.any_rank(self.torch, self.dist, self.device, flag and self.rank == 0,
                               group)

    # ---- check: a small shape against a dense fp32 forward (all weights gathered) ----
    def check(self, world, group):
        torch, dist = self.torch, self.dist
        hidden, inter, e_local, k, t = 256, 128, 4, 4, 16
        w13, w2 = self.make_weights(hidden, inter, e_local, 1000 + self.rank)
        x = (torch.rand(t, hidden, device=self.device) * 2 - 1).to(torch.bfloat16)
        ids, wts = self.make_routing(t, e_local * world, k, 2000 + self.rank)
        y = self.forward(x, ids, wts, w13.transpose(1, 2), w2.transpose(1, 2), e_local, world,
                         group)
        if world > 1:
            all13 = [torch.empty_like(w13) for _ in range(world)]
            all2 = [torch.empty_like(w2) for _ in range(world)]
            dist.all_gather(all13, w13, group=group)
            dist.all_gather(all2, w2, group=group)
            w13, w2 = torch.cat(all13), torch.cat(all2)
        ref = torch.zeros(t, hidden, device=self.device)
        for ti in range(t):
            for j in range(k):
                e = int(ids[ti, j])
                if e < 0:
                    continue
                hh = w13[e].float() @ x[ti].float()
                a = self.F.silu(hh[:inter]) * hh[inter:]
                ref[ti] += float(wts[ti, j]) * (w2[e].float() @ a)
        err = ((y.float() - ref).norm() / ref.norm()).reshape(1)
        dist.all_reduce(err, op=dist.ReduceOp.MAX, group=group)
        e = err.item()
        return ("pass" if e < 2e-2 else "fail") + f" (rel_l2 {e:.2g} vs dense fp32)"

    # ---- what one round moves (all ranks' routing), as epmoe bench counts it ----
    def round_traffic(self, ids, m, world, e_local, group):
        torch, dist = self.torch, self.dist
        h, inter, experts = m["hidden"], m["intermediate"], m["experts"]
        flat = ids.reshape(-1)
        counts = torch.bincount(flat[flat >= 0], minlength=experts)  # this rank's slots/expert
        per_owner = counts.view(world, e_local).sum(1)  # [world]
        if world > 1:
            rows = [torch.empty_like(per_owner) for _ in range(world)]
            dist.all_gather(rows, per_owner, group=group)
            slots_to = torch.stack(rows).double().cpu()  # [src, dst]
            dist.all_reduce(counts, group=group)
        else:
            slots_to = per_owner.double().cpu().reshape(1, 1)
        counts = counts.double().cpu()
        expert_bytes = 3.0 * inter * h * 2.0  # bf16
        touched = (counts > 0).double().view(world, e_local).sum(1)
        pairs = slots_to.sum(0)  # computed on each owner
        row_out = 2.0 * h + 4.0  # a bf16 row and its int32 expert id
        row_back = 2.0 * h
        remote = slots_to.clone()
        remote.fill_diagonal_(0.0)
        out = remote.sum(1) * row_out + remote.sum(0) * row_back
        inn = remote.sum(0) * row_out + remote.sum(1) * row_back
        tr = dict(
            weight_bytes=float(touched.sum()) * expert_bytes,
            pairs=float(pairs.sum()),
            flops=float(pairs.sum()) * 6.0 * inter * h,
            nvlink_bytes=float(remote.sum()) * (row_out + row_back),
            dispatched_rows=float(remote.sum()),
            returned_rows=float(remote.sum()),
        )
        return common.traffic_floors(tr, self.ceilings, float(touched.max()) * expert_bytes,
                                     float(pairs.max()) * 6.0 * inter * h,
                                     max(float(out.max()), float(inn.max())), world)

    # ---- one model at one world size ----
    def sweep_model(self, m, mi, world, group, check_result):
        torch, args = self.torch, self.args
        label = common.model_label(m)
        base = dict(impl="torch_ep", model=m["name"], hidden=m["hidden"],
                    intermediate=m["intermediate"], experts=m["experts"],
                    model_experts=m["model_experts"], top_k=m["top_k"], precision="bf16",
                    combine="a2a_per_slot", world=world, check=check_result, warmup=0,
                    rounds=0, latency_ms=[], latency_ms_p50=None, latency_ms_p90=None,
                    latency_ms_min=None, bound="", floor_ms=None, eff_tbps=None, eff_tflops=None)
        base.update({key: None for key in TRAFFIC_KEYS})
        points = [dict(base, tokens_per_rank=t, status="pending", note="") for t in self.tokens]
        if m["experts"] % world != 0:
            for p in points:
                p.update(status="skipped", note=f"{m['experts']} experts do not split over {world}")
            return points
        e_local = m["experts"] // world
        h, inter, k = m["hidden"], m["intermediate"], m["top_k"]
        w13, w2 = self.make_weights(h, inter, e_local, args.seed * 1000 + mi * 100 + self.rank)
        w13t, w2t = w13.transpose(1, 2), w2.transpose(1, 2)
        g = torch.Generator(device=self.device).manual_seed(args.seed * 7919 + self.rank)
        x_all = ((torch.rand(max(self.tokens[-1], 1), h, device=self.device, generator=g) * 2 - 1)
                 .to(torch.bfloat16))
        start_ev = torch.cuda.Event(enable_timing=True)
        stop_ev = torch.cuda.Event(enable_timing=True)
        last_ms, last_t = None, 0
        for pi, p in enumerate(points):
            t = p["tokens_per_rank"]
            over = args.budget_s > 0 and time.monotonic() - self.t_start > args.budget_s
            if self.agree(over, group):
                for q in points[pi:]:
                    q.update(status="skipped", note="over --budget-s")
                break
            warmup, rounds, skip = plan_rounds(args, last_ms,
                                               t / last_t if last_t > 0 else float(t))
            if skip:
                for q in points[pi:]:
                    q.update(status="skipped", note=skip)
                break
            x = x_all[:t]
            mine, traffic = [], []
            t0 = time.monotonic()
            for i in range(warmup + rounds):
                ids, wts = self.make_routing(t, m["experts"], k,
                                             args.seed * 1000003 + t * 7777 + i * world + self.rank)
                stop = i > warmup + 2 and time.monotonic() - t0 > args.max_point_s
                if self.agree(stop, group):  # also the barrier before the round
                    break
                start_ev.record()
                self.forward(x, ids, wts, w13t, w2t, e_local, world, group)
                stop_ev.record()
                stop_ev.synchronize()
                if i >= warmup:
                    mine.append(start_ev.elapsed_time(stop_ev))
                    traffic.append(self.round_traffic(ids, m, world, e_local, group))
            lat = common.slowest_rank(torch, self.dist, self.device, mine, world, group)
            p["warmup"] = warmup
            common.finish_point(p, lat, traffic, world, rounds)
            last_ms, last_t = p["latency_ms_p50"], t
            self.log(f"[torch_ep] {label} W={world} T={t}: {p['latency_ms_p50']:.3f} ms")
        del w13, w2, w13t, w2t, x_all
        torch.cuda.empty_cache()
        return points

    def run(self):
        args = self.args
        self.models = parse_models(args.models, args.experts)
        self.tokens = sorted({int(t) for t in args.tokens.split(",") if t})
        worlds = common.worlds_of(args, self.nproc)
        self.ceilings = common.read_ceilings(args.ceilings_from)

        points = []
        for world in worlds:
            group = self.dist.new_group(ranks=list(range(world)))  # every process calls it
            if self.rank < world:
                check = "skipped" if args.no_check else self.check(world, group)
                self.log(f"[torch_ep] world {world}: check {check}; gemm {self.gemm_name}")
                for mi, m in enumerate(self.models):
                    points += self.sweep_model(m, mi, world, group, check)
            self.dist.barrier()

        if self.rank == 0:
            common.print_ep_table(points)
            if args.json:
                torch = self.torch
                doc = {
                    "schema": "epmoe-bench/1",
                    "tool": "torch_ep",
                    "executor": f"torch {torch.__version__}, NCCL, one process per GPU",
                    "gpus": [torch.cuda.get_device_name(d)
                             for d in range(torch.cuda.device_count())],
                    "ceilings": self.ceilings,
                    "settings": dict(warmup=args.warmup, rounds=args.rounds, seed=args.seed,
                                     routing="uniform top-k, 5% slots dropped",
                                     gemm=self.gemm_name,
                                     dispatch="one bf16 row per (token, expert) slot",
                                     max_point_s=args.max_point_s),
                    "total_s": time.monotonic() - self.t_start,
                    "points": points,
                }
                common.write_json(args.json, doc)
                print(f"wrote {args.json}")
        self.dist.destroy_process_group()
        failed = any(p.get("check", "").startswith("fail") for p in points)
        return 1 if failed else 0


def main(argv=None):
    args = parse_args(argv)
    return TorchEP(args).run()


if __name__ == "__main__":
    sys.exit(main())

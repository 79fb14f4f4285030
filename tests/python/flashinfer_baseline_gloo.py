"""Run by test_flashinfer_baseline.py under torchrun on the CPU (gloo): tools/baselines/
flashinfer_ep.py's per-point check (its dense fp32 reference, each rank adding its own experts'
share) and its traffic count, without flashinfer or a GPU. torch_ep.py's bf16 forward plays the
layer: same seeds give both scripts the same weights and routing, so its output must sit within
bf16 noise of the reference, and a wrong output must not."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, sys.argv[1])  # tools/baselines
import flashinfer_ep as fe  # noqa: E402
import torch_ep as te  # noqa: E402


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    group = dist.new_group(list(range(world)))
    cpu = torch.device("cpu")
    ceilings = dict(hbm_gbps=4000.0, peer_gbps=400.0, matmul_tflops=800.0)
    f = fe.FlashInferEP.__new__(fe.FlashInferEP)
    f.torch, f.dist, f.F, f.device, f.rank, f.ceilings = (torch, dist, torch.nn.functional, cpu,
                                                           rank, ceilings)
    t = te.TorchEP.__new__(te.TorchEP)
    t.torch, t.dist, t.F, t.device, t.rank, t.ceilings = (torch, dist, torch.nn.functional, cpu,
                                                           rank, ceilings)
    t.grouped = te.TorchEP.loop_mm
    e_local, k, n = 4, 4, 24
    m = dict(name="x", hidden=256, intermediate=128, experts=e_local * world,
             model_experts=e_local * world, top_k=k)
    w13, w2 = f.make_weights(256, 128, e_local, 7 + rank)
    w13t, w2t = t.make_weights(256, 128, e_local, 7 + rank)
    assert torch.equal(w13, w13t) and torch.equal(w2, w2t), "weights differ from torch_ep's"
    ids, wts = f.make_routing(n, m["experts"], k, 99 + rank)
    ids64, wts64 = t.make_routing(n, m["experts"], k, 99 + rank)
    assert ids.dtype == torch.int32 and ids.is_contiguous(), ids.dtype
    assert torch.equal(ids.long(), ids64) and torch.equal(wts, wts64), "routing differs"
    assert (ids < 0).any() or n * k < 40, "no dropped slot drawn"
    x = (torch.rand(n, 256, generator=torch.Generator().manual_seed(3 + rank)) * 2 - 1).to(
        torch.bfloat16)
    y = t.forward(x, ids64, wts64, w13.transpose(1, 2), w2.transpose(1, 2), e_local, world, group)
    rel = f.reference_rel_l2(y, x, ids, wts, w13, w2, e_local, world, group, 10)
    wrong = f.reference_rel_l2(y.roll(1, 0), x, ids, wts, w13, w2, e_local, world, group, 10)
    assert rel < 2e-2, f"rel_l2 {rel} of torch_ep's forward against the reference"
    assert wrong > 0.5, f"rel_l2 {wrong} of a shuffled output"
    assert f.check_text(rel).startswith("pass") and f.check_text(wrong).startswith("fail")
    tf, tt = f.round_traffic(ids, m, world, e_local, group), t.round_traffic(ids64, m, world,
                                                                             e_local, group)
    assert tf["pairs"] == tt["pairs"] and tf["flops"] == tt["flops"], (tf, tt)
    assert abs(tf["weight_bytes"] / tt["weight_bytes"] - fe.WEIGHT_BYTES_PER_PARAM / 2) < 1e-9
    if world > 1:  # one row per (token, remote rank), not per (token, remote slot)
        assert 0 < tf["dispatched_rows"] <= tt["dispatched_rows"], (tf, tt)
        assert tf["nvlink_floor_ms"] > 0
    else:
        assert tf["nvlink_bytes"] == 0 and tf["nvlink_floor_ms"] == 0.0
    assert f.agree(rank == world - 1, group) and not f.agree(False, group)
    dist.destroy_process_group()
    print(f"rank {rank}: rel_l2 {rel:.3g}, shuffled {wrong:.3g}: OK", flush=True)


if __name__ == "__main__":
    main()

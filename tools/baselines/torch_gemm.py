#!/usr/bin/env python3
"""The expert GEMMs alone with stock PyTorch, on the sizes `epmoe bench gemm` times.

One GPU, one process. For each model shape (its H, I; E experts, --experts caps them as `epmoe
bench gemm` does) and R rows per expert, the rows arrive already sorted by expert (offs = R, 2R,
..., E R) and one timed step is FC1, the activation and FC2 over all E experts:

  bf16          torch._grouped_mm(x [E R, H], w13^T [E, H, 2I], offs) -> silu(gate) * up (bf16)
                -> torch._grouped_mm(h, w2^T [E, I, H], offs); a per-expert matmul loop where
                torch._grouped_mm is missing or fails its probe.
  fp8_rowwise   torch._scaled_grouped_mm: E4M3 x E4M3 with one fp32 scale per row of x and per
                output column of each expert's weights (torch's grouped FP8 recipe on Hopper);
                the activation's rows are quantized to E4M3 inside the step (FC2's input).
  fp8_block128  torch._scaled_mm once per expert: E4M3 with 1 x 128 scales on the rows and
                128 x 128 on the weights (DeepSeek's recipe, epmoe's fp8_block128); FC2's input
                quantized 1 x 128 inside the step. Needs H and I in whole 128-blocks.

x is U(-1, 1) and quantized outside the step (epmoe's rows arrive quantized from dispatch);
weights U(-1, 1)/sqrt(fan_in), quantized once. Each precision is first checked on a small shape
against an fp32 forward of the same (dequantized) operands (rel_l2 <= 2e-2 bf16, <= 0.1 fp8); a
recipe this torch lacks or rejects is skipped with its reason. Timing: --warmup steps, then
--rounds, each between two CUDA events; p50 / p90 in us. JSON: schema epmoe-bench-gemm/1 (as
`epmoe bench gemm --json`), impl "torch"; --ceilings-from takes the HBM / matmul ceilings that
`epmoe bench gemm` measured. --dry-run needs no torch: the plan, every point skipped.

  python3 tools/baselines/torch_gemm.py --ceilings-from gemm_epmoe.json --json gemm_torch.json
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (models, round plan, statistics, weights, grouped GEMM, JSON)
from common import model_label as label, percentile  # noqa: E402

PRECISIONS = ("bf16", "fp8_rowwise", "fp8_block128")
E4M3_MAX = 448.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="The expert GEMMs alone (FC1 + SwiGLU + FC2 over E experts, R rows each) "
        "with torch._grouped_mm and torch's scaled FP8 GEMMs, timed like `epmoe bench gemm`.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    common.add_model_args(p, "qwen3-30b-a3b,deepseek-v3,gpt-oss-120b,mixtral-8x7b", 32)
    p.add_argument("--rows", default="1,4,16,64,256,1024,4096",
                   help="comma list of R, rows per expert")
    p.add_argument("--precisions", default=",".join(PRECISIONS),
                   help="comma list of " + ", ".join(PRECISIONS))
    common.add_timing_args(p, "steps")
    p.add_argument("--seed", type=int, default=1)
    common.add_ceilings_arg(p, "an `epmoe bench gemm --json` (or `epmoe bench --json`) file",
                            "HBM and matmul ceilings")
    p.add_argument("--json", default="", help="write the points here")
    p.add_argument("--device", default="cuda",
                   help="cuda, or cpu for tests (wall-clock timing; torch's FP8 GEMMs are mostly "
                   "CUDA-only, so those points skip with torch's reason)")
    p.add_argument("--dry-run", action="store_true",
                   help="no torch, no GPU: print and write the plan, every point skipped")
    a = p.parse_args(argv)
    try:
        a.row_list = sorted({int(r) for r in a.rows.split(",") if r})
    except ValueError:
        p.error(f"--rows={a.rows}: a comma list of integers")
    if not a.row_list or a.row_list[0] < 1:
        p.error(f"--rows={a.rows}: every R must be >= 1")
    a.precision_list = [x for x in a.precisions.split(",") if x]
    bad = [x for x in a.precision_list if x not in PRECISIONS]
    if bad or not a.precision_list:
        p.error(f"--precisions={a.precisions}: each must be one of {', '.join(PRECISIONS)}")
    if a.warmup < 0 or a.rounds < 1:
        p.error(f"--warmup={a.warmup} --rounds={a.rounds}: need warmup >= 0 and rounds >= 1")
    a.model_list = common.parse_models(a.models, a.experts)
    return a


def refusal(m, precision):
    """Why `precision` cannot run on model m (None: it can)."""
    if precision == "fp8_block128" and (m["hidden"] % 128 or m["intermediate"] % 128):
        return (f"fp8_block128 needs H and I in whole 128-blocks (H={m['hidden']}, "
                f"I={m['intermediate']})")
    return None


def make_points(args):
    """Every point of the sweep in the order it runs (precision, model, R), status pending."""
    points = []
    for prec in args.precision_list:
        for m in args.model_list:
            e, k = m["experts"], m["top_k"]
            for r in args.row_list:
                points.append(dict(
                    impl="torch", model=m["name"], hidden=m["hidden"],
                    intermediate=m["intermediate"], experts=e, model_experts=m["model_experts"],
                    top_k=k, precision=prec, gemm="", world=1, rows_per_expert=r,
                    tokens_per_rank=e * r // k if (e * r) % k == 0 else None, pairs=e * r,
                    status="pending", note=refusal(m, prec) or "", check="skipped",
                    timed="cuda events" if args.device == "cuda" else "wall clock", warmup=0,
                    rounds=0, gemm_us_p50=None, gemm_us_p90=None, gemm_us_min=None,
                    latency_ms_p50=None, latency_ms_p90=None,
                    flops=6.0 * e * r * m["intermediate"] * m["hidden"],
                    weight_bytes=None, eff_tflops=None, eff_tbps=None, hbm_floor_us=None,
                    compute_floor_us=None, floor_us=None, bound="", gemm_us=[]))
    return points


def finish(p, us, ceilings):
    """Fills a point's statistics and floors from its per-round times (us)."""
    p50 = percentile(us, 0.5)
    p.update(status="ok", rounds=len(us), gemm_us=us, gemm_us_p50=p50,
             gemm_us_p90=percentile(us, 0.9), gemm_us_min=min(us),
             latency_ms_p50=p50 * 1e-3, latency_ms_p90=percentile(us, 0.9) * 1e-3)
    p["eff_tflops"] = p["flops"] / (p50 * 1e-6) / 1e12
    p["eff_tbps"] = p["weight_bytes"] / (p50 * 1e-6) / 1e12
    if ceilings.get("hbm_gbps"):
        p["hbm_floor_us"] = p["weight_bytes"] / (ceilings["hbm_gbps"] * 1e9) * 1e6
    if ceilings.get("matmul_tflops"):
        p["compute_floor_us"] = p["flops"] / (ceilings["matmul_tflops"] * 1e12) * 1e6
    floors = {n: v for n, v in (("hbm", p["hbm_floor_us"]), ("mma", p["compute_floor_us"])) if v}
    if floors:
        p["bound"] = max(floors, key=floors.get)
        p["floor_us"] = floors[p["bound"]]


def read_ceilings(path):
    return common.read_ceilings(path, ("hbm_gbps", "matmul_tflops"), "source")


class TorchGemm:
    """The three recipes; everything that needs torch (imported here: --help and --dry-run
    need none)."""

    def __init__(self, args):
        import torch
        import torch.nn.functional as F

        self.torch, self.F, self.args = torch, F, args
        if args.device == "cpu":
            self.device = torch.device("cpu")
        elif torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            sys.exit("torch_gemm.py needs a CUDA GPU (use --dry-run to see the plan without one)")
        self.fp8 = getattr(torch, "float8_e4m3fn", None)
        # torch_ep's weights and its probed grouped GEMM, on this device.
        self.grouped, self.grouped_name = common.pick_grouped_mm(torch, self.device, print)

    def make_weights(self, hidden, inter, e, seed):
        return common.make_weights(self.torch, self.device, hidden, inter, e, seed)

    # ---- quantization (E4M3 with fp32 scales: value = code * scale) ----
    def quant_rows(self, a):
        """[M, K] -> E4M3 codes [M, K], one scale per row [M]."""
        torch = self.torch
        s = a.float().abs().amax(1).clamp_min(1e-12) / E4M3_MAX
        return (a.float() / s[:, None]).to(self.fp8), s

    def quant_1x128(self, a):
        """[M, K] -> codes [M, K], scales [M, K / 128] (one per 128 of a row)."""
        m, k = a.shape
        blocks = a.float().view(m, k // 128, 128)
        s = blocks.abs().amax(2).clamp_min(1e-12) / E4M3_MAX
        return (blocks / s[:, :, None]).view(m, k).to(self.fp8), s

    def quant_128x128(self, w):
        """[E, N, K] -> codes [E, N, K], scales [E, N / 128, K / 128]."""
        e, n, k = w.shape
        tiles = w.float().view(e, n // 128, 128, k // 128, 128)
        s = tiles.abs().amax((2, 4)).clamp_min(1e-12) / E4M3_MAX
        codes = (tiles / s[:, :, None, :, None]).view(e, n, k).to(self.fp8)
        return codes, s

    # ---- torch._scaled_mm's 1 x 128 / 128 x 128 layout, found by a probe ----
    def block_mm(self):
        """f(a_codes [M, K], a_scales [M, K/128], b_codes [N, K], b_scales [N/128, K/128]) ->
        bf16 [M, N] with torch._scaled_mm, in the first scale layout this torch accepts and
        computes right (its docs leave it to the shapes and strides); raises if none does."""
        torch = self.torch
        if not hasattr(torch, "_scaled_mm") or self.fp8 is None:
            raise RuntimeError("torch._scaled_mm or torch.float8_e4m3fn does not exist here")
        variants = {
            "scale_a outer-dim-major, scale_b [K/128, N/128]":
                lambda sa, sb: (sa.t().contiguous().t(), sb.t()),
            "scale_a outer-dim-major, scale_b [N/128, K/128]":
                lambda sa, sb: (sa.t().contiguous().t(), sb),
            "scale_a row-major, scale_b [K/128, N/128]": lambda sa, sb: (sa.contiguous(), sb.t()),
        }
        g = torch.Generator(device=self.device).manual_seed(11)
        a = torch.randn(64, 256, device=self.device, generator=g)
        b = torch.randn(1, 256, 256, device=self.device, generator=g)
        ac, asc = self.quant_1x128(a)
        bc, bsc = self.quant_128x128(b)
        want = (ac.float().view(64, 2, 128) * asc[:, :, None]).view(64, 256) @ \
            (bc.float().view(2, 128, 2, 128) * bsc[0][:, None, :, None]).view(256, 256).t()
        errors = []
        for name, layout in variants.items():
            try:
                sa, sb = layout(asc, bsc[0])
                got = torch._scaled_mm(ac, bc[0].t(), scale_a=sa, scale_b=sb,
                                       out_dtype=torch.bfloat16).float()
                err = ((got - want).norm() / want.norm()).item()
                if err < 2e-2:
                    return (lambda a_, sa_, b_, sb_, lay=layout: torch._scaled_mm(
                        a_, b_.t(), *lay(sa_, sb_), out_dtype=torch.bfloat16)), name
                errors.append(f"{name}: rel_l2 {err:.3g}")
            except Exception as e:  # noqa: BLE001 - the next layout
                errors.append(f"{name}: {str(e).splitlines()[0][:160]}")
        raise RuntimeError("torch._scaled_mm takes no 1x128 / 128x128 layout: " +
                           "; ".join(errors))

    # ---- one precision's step over E experts of R rows each ----
    def build(self, prec, m, e, r, seed):
        """Returns (step, weight_bytes, gemm_name, reference) for M = E R rows sorted by expert:
        step() runs FC1 + activation + FC2; reference() is the fp32 forward of the same
        (dequantized) operands, for the check."""
        torch, F = self.torch, self.F
        h, inter = m["hidden"], m["intermediate"]
        w13, w2 = self.make_weights(h, inter, e, seed)  # [E, 2I, H], [E, H, I]
        g = torch.Generator(device=self.device).manual_seed(seed + 1)
        x = (torch.rand(e * r, h, device=self.device, generator=g) * 2 - 1).to(torch.bfloat16)
        offs = torch.arange(1, e + 1, device=self.device, dtype=torch.int32) * r
        swiglu = (lambda y: F.silu(y[:, :inter]) * y[:, inter:])

        if prec == "bf16":
            w13t, w2t = w13.transpose(1, 2), w2.transpose(1, 2)

            def step():
                return self.grouped(swiglu(self.grouped(x, w13t, offs)), w2t, offs)

            def reference():
                y = torch.cat([x[i * r:(i + 1) * r].float() @ w13[i].float().t()
                               for i in range(e)])
                a = swiglu(y)
                return torch.cat([a[i * r:(i + 1) * r] @ w2[i].float().t() for i in range(e)])
            nbytes = w13.nbytes + w2.nbytes
            return step, nbytes, self.grouped_name, reference

        if prec == "fp8_rowwise":
            if not hasattr(torch, "_scaled_grouped_mm") or self.fp8 is None:
                raise RuntimeError("torch._scaled_grouped_mm does not exist in this torch")
            xq, xs = self.quant_rows(x)
            q13 = [self.quant_rows(w13[i]) for i in range(e)]  # per output column of FC1
            q2 = [self.quant_rows(w2[i]) for i in range(e)]
            w13q = torch.stack([c for c, _ in q13])  # [E, 2I, H]
            w13s = torch.stack([s for _, s in q13])  # [E, 2I]
            w2q = torch.stack([c for c, _ in q2])  # [E, H, I]
            w2s = torch.stack([s for _, s in q2])  # [E, H]
            del w13, w2

            def gmm(a, sa, b, sb):  # b [E, N, K] row-major -> [E, K, N] column-major view
                return torch._scaled_grouped_mm(a, b.transpose(1, 2), sa, sb, offs=offs,
                                                out_dtype=torch.bfloat16)

            def step():
                hq, hs = self.quant_rows(swiglu(gmm(xq, xs, w13q, w13s)))
                return gmm(hq, hs, w2q, w2s)

            def reference():
                xf = xq.float() * xs[:, None]
                y = torch.cat([xf[i * r:(i + 1) * r] @ (w13q[i].float() * w13s[i][:, None]).t()
                               for i in range(e)])
                hq, hs = self.quant_rows(swiglu(y).to(torch.bfloat16))
                a = hq.float() * hs[:, None]
                return torch.cat([a[i * r:(i + 1) * r] @ (w2q[i].float() * w2s[i][:, None]).t()
                                  for i in range(e)])
            nbytes = w13q.nbytes + w13s.nbytes + w2q.nbytes + w2s.nbytes
            return step, nbytes, "torch._scaled_grouped_mm (rowwise fp32 scales)", reference

        # fp8_block128: torch._scaled_mm per expert
        mm, layout = self.block_mm()
        xq, xs = self.quant_1x128(x)
        w13q, w13s = self.quant_128x128(w13)
        w2q, w2s = self.quant_128x128(w2)
        del w13, w2

        def per_expert(a, sa, b, sb):
            return torch.cat([mm(a[i * r:(i + 1) * r], sa[i * r:(i + 1) * r], b[i], sb[i])
                              for i in range(e)])

        def step():
            hq, hs = self.quant_1x128(swiglu(per_expert(xq, xs, w13q, w13s)))
            return per_expert(hq, hs, w2q, w2s)

        def dequant_w(q, s):
            n, k = q.shape[1:]
            return (q.float().view(e, n // 128, 128, k // 128, 128)
                    * s[:, :, None, :, None]).view(e, n, k)

        def reference():
            xf = (xq.float().view(e * r, h // 128, 128) * xs[:, :, None]).view(e * r, h)
            w13f, w2f = dequant_w(w13q, w13s), dequant_w(w2q, w2s)
            y = torch.cat([xf[i * r:(i + 1) * r] @ w13f[i].t() for i in range(e)])
            hq, hs = self.quant_1x128(swiglu(y).to(torch.bfloat16))
            a = (hq.float().view(e * r, inter // 128, 128) * hs[:, :, None]).view(e * r, inter)
            return torch.cat([a[i * r:(i + 1) * r] @ w2f[i].t() for i in range(e)])
        nbytes = w13q.nbytes + w13s.nbytes + w2q.nbytes + w2s.nbytes
        return step, nbytes, f"torch._scaled_mm per expert (1x128 x 128x128; {layout})", \
            reference

    def check(self, prec):
        """One small problem against the fp32 forward of its own operands."""
        m = dict(hidden=256, intermediate=256)
        step, _, name, reference = self.build(prec, m, 3, 16, 4242)
        got, want = step().float(), reference()
        err = ((got - want).norm() / want.norm()).item()
        bound = 2e-2 if prec == "bf16" else 0.1
        return ("pass" if err <= bound else "fail") + f" (rel_l2 {err:.2g} <= {bound:g})", name

    def time_point(self, step, warmup, rounds, cap_s):
        """Per timed round, us: CUDA events around step() (wall clock on the CPU)."""
        torch = self.torch
        cuda = self.device.type == "cuda"
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            stop = torch.cuda.Event(enable_timing=True)
        us, t0 = [], time.monotonic()
        for i in range(warmup + rounds):
            if i > warmup + 2 and time.monotonic() - t0 > cap_s:
                break
            if cuda:
                start.record()
                step()
                stop.record()
                stop.synchronize()
                elapsed = start.elapsed_time(stop) * 1e3
            else:
                begin = time.perf_counter()
                step()
                elapsed = (time.perf_counter() - begin) * 1e6
            if i >= warmup:
                us.append(elapsed)
        return us

    def run(self, points, ceilings, t_start):
        torch, args = self.torch, self.args
        checks = {}
        for prec in args.precision_list:
            try:
                checks[prec] = self.check(prec)
            except Exception as e:  # noqa: BLE001 - this torch lacks or rejects the recipe
                why = str(e).splitlines()[0].split(". ")[0][:300]
                checks[prec] = (None, f"unavailable: {why}")
            print(f"[torch_gemm] {prec}: {checks[prec][1]}; check {checks[prec][0] or 'skipped'}",
                  flush=True)
        last = {}  # (precision, model) -> (p50 us, R) of the last timed point
        for p in points:
            prec = p["precision"]
            check, name = checks[prec]
            p.update(gemm=name, check=check or "skipped")
            if p["note"]:  # a shape rule (refusal)
                p["status"] = "skipped"
                continue
            if check is None:
                p.update(status="skipped", note=name)
                continue
            if args.budget_s > 0 and time.monotonic() - t_start > args.budget_s:
                p.update(status="skipped", note="over --budget-s")
                continue
            key = (prec, p["model"], p["experts"])
            last_us, last_r = last.get(key, (None, 1))
            warmup, rounds, skip = common.plan_rounds(
                args, last_us and last_us * 1e-3, p["rows_per_expert"] / last_r, what="step")
            if skip:
                p.update(status="skipped", note=skip)
                continue
            m = next(x for x in args.model_list
                     if x["name"] == p["model"] and x["experts"] == p["experts"])
            try:
                step, nbytes, _, _ = self.build(prec, m, p["experts"], p["rows_per_expert"],
                                                args.seed)
                p.update(weight_bytes=float(nbytes), warmup=warmup)
                us = self.time_point(step, warmup, rounds, args.max_point_s)
                finish(p, us, ceilings)
                if len(us) < rounds:
                    p["note"] = f"stopped after {len(us)} rounds (--max-point-s)"
                last[key] = (p["gemm_us_p50"], p["rows_per_expert"])
                print(f"[torch_gemm] {label(m)} {prec} R={p['rows_per_expert']}: "
                      f"{p['gemm_us_p50']:.1f} us, {p['eff_tflops']:.0f} TFLOPS, "
                      f"{p['eff_tbps']:.2f} TB/s", flush=True)
            except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
                p.update(status="error", note=str(e).splitlines()[0][:300])
                print(f"[torch_gemm] {label(m)} {prec} R={p['rows_per_expert']}: error "
                      f"{p['note']}", flush=True)
            finally:
                step = None
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
        return checks


def fmt(v, spec=".1f"):
    return common.fmt(v, spec)


def print_table(points):
    print(f"\n{'model':22} {'prec':12} {'R':>5} {'gemm us':>10} {'p90 us':>10} {'TFLOPS':>7} "
          f"{'TB/s':>6} {'floor us':>9} bound  check")
    for p in points:
        head = f"{label(p):22} {p['precision']:12} {p['rows_per_expert']:>5} "
        if p["status"] != "ok":
            print(head + f"{p['status']}: {p['note']}")
            continue
        print(head + f"{fmt(p['gemm_us_p50']):>10} {fmt(p['gemm_us_p90']):>10} "
              f"{fmt(p['eff_tflops']):>7} {fmt(p['eff_tbps'], '.2f'):>6} "
              f"{fmt(p['floor_us']):>9} {p['bound'] or '-':5}  {p['check']}")


def main(argv=None):
    args = parse_args(argv)
    t_start = time.monotonic()
    ceilings = read_ceilings(args.ceilings_from)
    points = make_points(args)
    settings = dict(warmup=args.warmup, rounds=args.rounds, seed=args.seed,
                    routing="balanced: every expert exactly R rows, sorted by expert",
                    timed="FC1 + activation (+ FC2's input quantization) + FC2, " + (
                        "CUDA events" if args.device == "cuda" else "wall clock"),
                    max_point_s=args.max_point_s)
    if args.dry_run:
        for p in points:
            p.update(status="skipped", note=p["note"] or "dry run")
        executor, gpus = "dry run (no torch)", []
    else:
        tg = TorchGemm(args)
        checks = tg.run(points, ceilings, t_start)
        settings["gemm"] = {k: v[1] for k, v in checks.items()}
        torch = tg.torch
        on_gpu = tg.device.type == "cuda"
        executor = f"torch {torch.__version__}, " + ("CUDA, one GPU" if on_gpu else "CPU (a test)")
        gpus = [torch.cuda.get_device_name(tg.device)] if on_gpu else []
    print_table(points)
    if args.json:
        doc = {"schema": "epmoe-bench-gemm/1", "tool": "torch_gemm", "executor": executor,
               "gpus": gpus, "ceilings": ceilings, "settings": settings,
               "total_s": time.monotonic() - t_start, "points": points}
        common.write_json(args.json, doc)
        print(f"wrote {args.json}")
    bad = [p for p in points if p["status"] == "error" or p["check"].startswith("fail")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

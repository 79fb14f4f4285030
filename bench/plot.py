#!/usr/bin/env python3
"""Plots and one combined table from `epmoe bench --json` and the baselines' JSON
(`tools/baselines/torch_ep.py --json`, `tools/baselines/flashinfer_ep.py --json`).

  python3 bench/plot.py bench/out/epmoe.json bench/out/torch_ep.json bench/out/flashinfer_ep.json \
      --out bench/out --table

One PNG per model shape (latency_<model>.png): median latency (p50, line; p90, shaded) against T
(tokens per rank), one panel per world size, a line per implementation / precision / combine /
expert math (circles: exact; triangles and dash-dots: tensor_core; diamonds and dashes: wgmma), FlashInfer's SM90 layer in brown (solid:
eager, dashed: CUDA graph), the torch baseline in black, and the floor of each precision dashed (the largest of the HBM, bf16-matmul and NVLink floors that `epmoe bench` derives
from its measured ceilings). For points of `epmoe bench --phases`, one more PNG per model shape
(phases_<model>.png): a stacked bar per T of the p50 of each chain phase (dispatch, route, fc1, fc2,
combine), one panel per world size and epmoe config, the point's p50 latency marked. --table prints (and writes table.md) the p50 latencies of every
implementation side by side (a column per precision / combine / expert math; a baseline's CUDA-graph
points get a column of their own), with the bf16 floor, the best epmoe config (any column) over the
torch baseline, and, where FlashInfer points exist, the best epmoe fp8_block128 config over
FlashInfer's best (eager or graph). Needs matplotlib for the plots
only.
"""

import argparse
import json
import math
import os
import sys


SCHEMAS = ("epmoe-bench/1", "epmoe-bench-gemm/1")


def load(paths):
    """Points of the layer files (epmoe-bench/1) and of the GEMM files (epmoe-bench-gemm/1:
    `epmoe bench gemm`, tools/baselines/torch_gemm.py), kept apart, and each file's header."""
    points, gemm, meta = [], [], []
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        if doc.get("schema") not in SCHEMAS:
            sys.exit(f"{path}: not an {' or '.join(SCHEMAS)} file (schema {doc.get('schema')!r})")
        meta.append((path, doc))
        if doc["schema"] == "epmoe-bench-gemm/1":
            gemm.extend(doc["points"])
            continue
        # Points whose ranks ran different T (`epmoe bench --tokens 0/64`: tokens_by_rank, no
        # tokens_per_rank) have no place on a T axis: left out of the plots and tables, said so.
        per_rank = [p for p in doc["points"] if p.get("tokens_per_rank") is None]
        if per_rank:
            print(f"{path}: {len(per_rank)} point(s) with a T per rank left out", file=sys.stderr)
        points.extend(p for p in doc["points"] if p.get("tokens_per_rank") is not None)
    return points, gemm, meta


def model_label(p):
    if p["experts"] == p["model_experts"]:
        return p["model"]
    return f'{p["model"]} E{p["experts"]}/{p["model_experts"]}'


def math_of(p):
    """Expert math of a point: epmoe points before the field existed were exact; other
    implementations have none. A point that ran the persistent round (`megakernel`) is its math
    plus " persistent"."""
    if p["impl"] != "epmoe":
        return ""
    return p.get("math", "exact") + (" persistent" if p.get("megakernel") else "")


def graph_of(p):
    """Whether the point timed a CUDA graph replay (FlashInfer's baseline times both; epmoe's
    with `epmoe bench --graph`)."""
    return bool(p.get("graph", False))


def series_name(p):
    if p["impl"] == "epmoe":
        math = "" if math_of(p) == "exact" else f" {math_of(p)}"
        return f'epmoe {p["precision"]} {p["combine"]}{math}' + (" graph" if graph_of(p) else "")
    return f'{p["impl"]} {p["precision"]}' + (" graph" if graph_of(p) else "")


def file_safe(model):
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in model.replace(" ", "_"))


def ok(p):
    return p.get("status") == "ok" and p.get("latency_ms_p50") is not None


COMBINE_SHORT = {"staged": "st", "in_kernel_reduce": "ikr"}
MATH_SHORT = {"exact": "", "tensor_core": " tc", "tensor_core persistent": " tc pr", "wgmma": " wg"}
PRECISIONS = ["bf16", "mxfp8", "nvfp4", "fp8_block128", "mxfp4"]
PRECISION_COLOR = {"bf16": "tab:blue", "mxfp8": "tab:orange", "nvfp4": "tab:green",
                   "fp8_block128": "tab:red", "mxfp4": "tab:purple"}
# Line style and marker per expert math: (staged, in_kernel_reduce) styles, marker.
MATH_STYLE = {"exact": ("-", ":", "o"),
              "tensor_core": ("-.", (0, (3, 1, 1, 1, 1, 1)), "^"),
              "wgmma": ("--", (0, (5, 1, 1, 1)), "D")}


def plot(points, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    written = []
    models = sorted({model_label(p) for p in points})
    for model in models:
        mine = [p for p in points if model_label(p) == model]
        worlds = sorted({p["world"] for p in mine}, reverse=True)
        tokens = sorted({p["tokens_per_rank"] for p in mine})
        xpos = {t: i for i, t in enumerate(tokens)}
        fig, axes = plt.subplots(1, len(worlds), figsize=(6.5 * len(worlds), 4.8), squeeze=False)
        for ax, world in zip(axes[0], worlds):
            pts = [p for p in mine if p["world"] == world and ok(p)]
            for name in sorted({series_name(p) for p in pts}):
                s = sorted((p for p in pts if series_name(p) == name),
                           key=lambda p: p["tokens_per_rank"])
                xs = [xpos[p["tokens_per_rank"]] for p in s]
                p50 = [p["latency_ms_p50"] for p in s]
                p90 = [p["latency_ms_p90"] or p["latency_ms_p50"] for p in s]
                if s[0]["impl"] == "epmoe":
                    color = PRECISION_COLOR.get(s[0]["precision"])
                    staged_style, reduce_style, marker = MATH_STYLE.get(math_of(s[0]),
                                                                        MATH_STYLE["exact"])
                    style = staged_style if s[0]["combine"] == "staged" else reduce_style
                elif s[0]["impl"] == "flashinfer_sm90":
                    color, marker = "tab:brown", "v"
                    style = "--" if graph_of(s[0]) else "-"
                else:
                    color, style, marker = "black", "-", "s"
                ax.plot(xs, p50, linestyle=style, marker=marker, color=color, label=name,
                        linewidth=1.6)
                ax.fill_between(xs, p50, p90, color=color, alpha=0.12)
            # Floors: one dashed line per precision (from epmoe's staged points; the floor does not
            # depend on the expert math, so one point per T).
            for prec in ("bf16", "mxfp8", "nvfp4"):
                at = {}
                for p in pts:
                    if (p["impl"] == "epmoe" and p["precision"] == prec
                            and p["combine"] == "staged" and p.get("floor_ms")):
                        at.setdefault(p["tokens_per_rank"], p)
                s = [at[t] for t in sorted(at)]
                if s:
                    ax.plot([xpos[p["tokens_per_rank"]] for p in s], [p["floor_ms"] for p in s],
                            "--", color=PRECISION_COLOR[prec], alpha=0.7, linewidth=1.2,
                            label=f"floor {prec}")
            ax.set_yscale("log")
            ax.set_xticks(range(len(tokens)))
            ax.set_xticklabels([str(t) for t in tokens])
            ax.set_xlabel("T (tokens per rank)")
            ax.set_ylabel("latency per forward, ms (p50; shaded to p90)")
            ax.set_title(f"{model}, {world} GPU{'s' if world > 1 else ''}")
            ax.grid(True, which="both", alpha=0.3)
            if pts:
                ax.legend(fontsize=7, loc="upper left")
            else:
                ax.text(0.5, 0.5, "no timed points (all skipped or failed: see the table)",
                        transform=ax.transAxes, ha="center", va="center", fontsize=9)
        fig.tight_layout()
        path = os.path.join(out_dir, f"latency_{file_safe(model)}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


# The chain phases of `epmoe bench --phases` (its phases_us_p50), stacked in order; wait_counts and
# wait_done lie inside route and combine, so they are not stacked.
CHAIN_PHASES = ["dispatch", "route", "fc1", "fc2", "combine"]
PHASE_COLOR = {"dispatch": "tab:blue", "route": "tab:orange", "fc1": "tab:green",
               "fc2": "tab:red", "combine": "tab:purple"}


def plot_phases(points, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [p for p in points if ok(p) and p.get("phases_us_p50")]
    written = []
    for model in sorted({model_label(p) for p in timed}):
        mine = [p for p in timed if model_label(p) == model]
        panels = sorted({(p["world"], series_name(p)) for p in mine}, key=lambda k: (-k[0], k[1]))
        cols = min(3, len(panels))
        rows = (len(panels) + cols - 1) // cols
        fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4.2 * rows), squeeze=False)
        for ax in axes.flat[len(panels):]:
            ax.set_visible(False)
        for ax, (world, name) in zip(axes.flat, panels):
            s = sorted((p for p in mine if p["world"] == world and series_name(p) == name),
                       key=lambda p: p["tokens_per_rank"])
            xs = range(len(s))
            bottom = [0.0] * len(s)
            for phase in CHAIN_PHASES:
                us = [p["phases_us_p50"].get(phase) or 0.0 for p in s]
                ax.bar(xs, us, bottom=bottom, color=PHASE_COLOR[phase], label=phase)
                bottom = [b + u for b, u in zip(bottom, us)]
            ax.plot(xs, [p["latency_ms_p50"] * 1e3 for p in s], "k_", markersize=18,
                    label="forward p50")
            ax.set_xticks(list(xs))
            ax.set_xticklabels([str(p["tokens_per_rank"]) for p in s])
            ax.set_xlabel("T (tokens per rank)")
            ax.set_ylabel("µs (p50 per phase, slowest rank)")
            ax.set_title(f"{model}, {world} GPU{'s' if world > 1 else ''}\n{name}", fontsize=9)
            ax.grid(True, axis="y", alpha=0.3)
            ax.legend(fontsize=7, loc="upper left")
        fig.tight_layout()
        path = os.path.join(out_dir, f"phases_{file_safe(model)}.png")
        os.makedirs(out_dir, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def fmt(v):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.3f}" if v < 100 else f"{v:.1f}"


def table(points, meta):
    lines = []
    for path, doc in meta:
        c = doc.get("ceilings") or {}
        if doc.get("schema") != "epmoe-bench/1":
            continue
        if doc.get("tool") == "epmoe bench":
            lines.append(
                f"ceilings ({os.path.basename(path)}): HBM {c.get('hbm_gbps') or '-'} GB/s, "
                f"peer {c.get('peer_gbps') or '-'} GB/s, bf16 matmul "
                f"{c.get('matmul_tflops') or '-'} TFLOP/s; GPUs: {', '.join(doc.get('gpus', []))}")
        else:
            lines.append(f"{doc.get('tool')} ({os.path.basename(path)}): {doc.get('executor')}; "
                         f"gemm {doc.get('settings', {}).get('gemm')}")
    # A column per (impl, precision, combine, math) the files hold: tensor_core gets columns of its
    # own ("bf16 st tc") for both combines rather than only staged, since in_kernel_reduce with
    # tensor cores is usually the fastest epmoe config and "best epmoe / torch" must be able to
    # point at it; the short names keep the default sweep (12 epmoe columns) about 150 characters
    # wide. Within a precision: st, st tc, ikr, ikr tc.
    # Baselines first (torch, then FlashInfer eager, then its CUDA graph), then epmoe.
    def key_of(p):
        return (p["impl"], p["precision"], p["combine"], math_of(p), graph_of(p))

    cols = []
    for p in points:
        key = key_of(p)
        if key not in cols:
            cols.append(key)
    maths = list(MATH_SHORT)
    impls = ["torch_ep", "flashinfer_sm90"]
    cols.sort(key=lambda k: (impls.index(k[0]) if k[0] in impls else
                             (len(impls) + 1 if k[0] == "epmoe" else len(impls)), k[4],
                             PRECISIONS.index(k[1]) if k[1] in PRECISIONS else 9,
                             k[2] != "staged", maths.index(k[3]) if k[3] in maths else 9))
    has_fi = any(k[0] == "flashinfer_sm90" for k in cols)

    def col_name(k):
        if k[0] == "epmoe":
            return (f"{k[1]} {COMBINE_SHORT.get(k[2], k[2])}{MATH_SHORT.get(k[3], ' ' + k[3])}"
                    + (" graph" if k[4] else ""))
        if k[0] == "flashinfer_sm90":
            return "flashinfer graph" if k[4] else "flashinfer"
        return k[0] + (" graph" if k[4] else "")

    head = ["model", "W", "T", "floor bf16"] + [col_name(k) for k in cols] + ["best epmoe / torch"]
    if has_fi:
        head.append("fp8_block128 epmoe / flashinfer")
    lines.append("")
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join(" --- " for _ in head) + "|")
    by = {}
    for p in points:
        by[(model_label(p), p["world"], p["tokens_per_rank"]) + key_of(p)] = p
    rows = sorted({(model_label(p), p["world"], p["tokens_per_rank"]) for p in points},
                  key=lambda r: (r[0], -r[1], r[2]))
    for model, world, t in rows:
        cells = [model, str(world), str(t)]
        floor = (by.get((model, world, t, "epmoe", "bf16", "staged", "exact", False))
                 or by.get((model, world, t, "epmoe", "bf16", "staged", "tensor_core", False)))
        cells.append(fmt(floor.get("floor_ms")) if floor and ok(floor) else "-")
        best, best_fp8, torch_ms, fi_ms = None, None, None, None
        for k in cols:
            p = by.get((model, world, t) + k)
            if p is None:
                cells.append("")
            elif ok(p):
                v = p["latency_ms_p50"]
                cells.append(fmt(v))
                if k[0] == "epmoe":
                    best = v if best is None else min(best, v)
                    if k[1] == "fp8_block128":
                        best_fp8 = v if best_fp8 is None else min(best_fp8, v)
                elif k[0] == "flashinfer_sm90":
                    fi_ms = v if fi_ms is None else min(fi_ms, v)
                elif k[0] == "torch_ep" and not k[4]:
                    torch_ms = v
            else:
                cells.append(p.get("status", "?"))
        cells.append(f"{best / torch_ms:.2f}x" if best and torch_ms else "-")
        if has_fi:
            cells.append(f"{best_fp8 / fi_ms:.2f}x" if best_fp8 and fi_ms else "-")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("p50 latency per forward in ms (the slowest rank, median over rounds); W = GPUs; "
                 "T = tokens per rank; st = staged, ikr = in_kernel_reduce combine; tc = "
                 "tensor_core expert math (bf16 mma.sync, fp32 accumulation), wg = wgmma (Hopper "
                 "TMA + WGMMA grouped GEMMs), else exact; "
                 "floor bf16 = "
                 "the largest of the HBM / matmul / NVLink floors of the bf16 layer; best epmoe / "
                 "torch < 1 means epmoe is faster." + (
                     " flashinfer = FlashInfer's SM90 EP layer (sm90_fp8_fp8_bf16_push_cuda, "
                     "fp8_block128 weights, FP8 dispatch and combine), eager and as a CUDA graph "
                     "replay; fp8_block128 epmoe / flashinfer = the best epmoe fp8_block128 "
                     "config over FlashInfer's better mode (< 1: epmoe is faster)."
                     if has_fi else ""))
    return "\n".join(lines)

# ---- `epmoe bench gemm` and tools/baselines/torch_gemm.py (schema epmoe-bench-gemm/1) ----

def gemm_series(p):
    if p["impl"] == "epmoe":
        return f'epmoe {p["precision"]} {p.get("math", "")}'.strip()
    return f'{p["impl"]} {p["precision"]}'


def gemm_ok(p):
    return p.get("status") == "ok" and p.get("gemm_us_p50") is not None


def plot_gemm(points, meta, out_dir):
    """gemm_<model>.png: TFLOPS and weight TB/s against R (rows per expert), a line per
    implementation / precision / expert math, the measured bf16 matmul and HBM ceilings dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ceil = {}
    for _, doc in meta:
        if doc.get("schema") == "epmoe-bench-gemm/1":
            for k, v in (doc.get("ceilings") or {}).items():
                if isinstance(v, (int, float)) and v > 0:
                    ceil.setdefault(k, v)
    written = []
    timed = [p for p in points if gemm_ok(p)]
    for model in sorted({model_label(p) for p in timed}):
        mine = [p for p in timed if model_label(p) == model]
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
        for ax, key, ylabel, line in (
                (axes[0], "eff_tflops", "TFLOPS (FC1 + FC2 FLOPs / GEMM time)",
                 ("matmul_tflops", 1.0, "bf16 matmul")),
                (axes[1], "eff_tbps", "weight TB/s (precision's bytes / GEMM time)",
                 ("hbm_gbps", 1e-3, "HBM copy"))):
            for name in sorted({gemm_series(p) for p in mine}):
                s = sorted((p for p in mine if gemm_series(p) == name),
                           key=lambda p: p["rows_per_expert"])
                color = PRECISION_COLOR.get(s[0]["precision"], "black")
                style = "-" if s[0]["impl"] == "epmoe" else ":"
                marker = MATH_STYLE.get(s[0].get("math", ""), ("", "", "s"))[2]
                ax.plot([p["rows_per_expert"] for p in s], [p[key] for p in s], linestyle=style,
                        marker=marker, color=color, label=name)
            if line[0] in ceil:
                ax.axhline(ceil[line[0]] * line[1], color="gray", linestyle="--",
                           label=f"{line[2]} (measured)")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("R (rows per expert)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{model}: expert GEMMs alone")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, f"gemm_{file_safe(model)}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


# Issue 12's GEMM targets: deepseek-v3's expert shape, R >= 512, TFLOPS per precision; and at
# decode-like R (<= 64) the weights streamed at >= 3.3 TB/s.
GEMM_TFLOPS_TARGETS = {"bf16": 650, "fp8_block128": 1100, "mxfp8": 650, "nvfp4": 600,
                       "mxfp4": 600}
GEMM_DECODE_TBPS = 3.3


def gemm_targets(points):
    lines = []
    ds = [p for p in points if gemm_ok(p) and p["impl"] == "epmoe" and p["model"] == "deepseek-v3"]
    for prec, goal in GEMM_TFLOPS_TARGETS.items():
        big = [p["eff_tflops"] for p in ds if p["precision"] == prec and p["rows_per_expert"] >= 512]
        small = [p["eff_tbps"] for p in ds if p["precision"] == prec and p["rows_per_expert"] <= 64]
        if not big and not small:
            continue
        best = max(big) if big else None
        worst_tbps = min(small) if small else None
        lines.append(
            f"- deepseek-v3 {prec}: R >= 512 worst {fmt(min(big)) if big else '-'} / best "
            f"{fmt(best)} TFLOPS (target >= {goal}: {'MET' if big and min(big) >= goal else 'open'}"
            f"); R <= 64 weights at {fmt(worst_tbps)} TB/s at worst (target >= {GEMM_DECODE_TBPS}"
            f": {'MET' if small and worst_tbps >= GEMM_DECODE_TBPS else 'open'})")
    return lines


def gemm_table(points, meta):
    """A row per (model, R): the GEMM p50 in us of every implementation, then epmoe's best
    TFLOPS and TB/s, and epmoe over torch for bf16 and for FP8 (below 1: epmoe is faster)."""
    lines = []
    for path, doc in meta:
        if doc.get("schema") != "epmoe-bench-gemm/1":
            continue
        c = doc.get("ceilings") or {}
        lines.append(f"{doc.get('tool')} ({os.path.basename(path)}): {doc.get('executor')}; "
                     f"HBM {c.get('hbm_gbps') or '-'} GB/s, bf16 matmul "
                     f"{c.get('matmul_tflops') or '-'} TFLOP/s; "
                     f"timed: {(doc.get('settings') or {}).get('timed')}")
    cols = []
    for p in points:
        name = gemm_series(p)
        if name not in cols:
            cols.append(name)
    cols.sort(key=lambda n: (not n.startswith("torch"), n))
    head = ["model", "R"] + [f"{c} us" for c in cols] + [
        "epmoe TFLOPS", "epmoe TB/s", "bf16 epmoe / torch", "fp8 epmoe / torch"]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    rows = sorted({(model_label(p), p["rows_per_expert"]) for p in points})
    for model, r in rows:
        here = [p for p in points if model_label(p) == model and p["rows_per_expert"] == r]
        by = {gemm_series(p): p for p in here}
        cells = [model, str(r)]
        for c in cols:
            p = by.get(c)
            cells.append("" if p is None else fmt(p["gemm_us_p50"]) if gemm_ok(p)
                         else p.get("status", "?"))
        mine = [p for p in here if p["impl"] == "epmoe" and gemm_ok(p)]
        cells.append(fmt(max(p["eff_tflops"] for p in mine)) if mine else "-")
        cells.append(fmt(max(p["eff_tbps"] for p in mine)) if mine else "-")

        def best(impl, precs):
            v = [p["gemm_us_p50"] for p in here
                 if gemm_ok(p) and (p["impl"] == "epmoe") == (impl == "epmoe")
                 and p["precision"] in precs]
            return min(v) if v else None
        for ours, theirs in ((("bf16",), ("bf16",)),
                             (("fp8_block128",), ("fp8_block128", "fp8_rowwise"))):
            a, b = best("epmoe", ours), best("torch", theirs)
            cells.append(f"{a / b:.2f}x" if a and b else "-")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "GEMM p50 in us: FC1 + activation + FC2 over the E experts, R rows each (epmoe: "
              "phase fc1's begin to phase fc2's end on the GPU clock; torch: CUDA events around "
              "its step); epmoe TFLOPS / TB/s: its best config at that R; fp8 epmoe / torch = "
              "epmoe's fp8_block128 over torch's faster FP8 recipe (< 1: epmoe is faster)."]
    targets = gemm_targets(points)
    if targets:
        lines += ["", "issue 12 GEMM targets (epmoe, every R in range must meet them):"] + targets
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="+",
                    help="epmoe-bench/1 (layer) and epmoe-bench-gemm/1 (GEMM) JSON files")
    ap.add_argument("--out", default="bench/out", help="folder for the PNGs (and table.md)")
    ap.add_argument("--table", action="store_true", help="print the combined table (last)")
    ap.add_argument("--no-plots", action="store_true", help="only the table")
    args = ap.parse_args(argv)
    points, gemm, meta = load([p for p in args.json if os.path.exists(p)] or args.json)
    if not args.no_plots:
        for path in (plot(points, args.out) + plot_phases(points, args.out)
                     + plot_gemm(gemm, meta, args.out)):
            print(f"wrote {path}")
    if args.table:
        text = "\n\n".join(([table(points, meta)] if points else [])
                            + ([gemm_table(gemm, meta)] if gemm else []))
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "table.md"), "w") as f:
            f.write(text + "\n")
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`epmoe bench gemm` and tools/baselines/torch_gemm.py without a GPU: the arguments and their
errors, the points of the sweep, the statistics and floors, the epmoe-bench-gemm/1 JSON of both
sides, and bench/plot.py's GEMM table from it. The C++ side runs on the CPU executor where the
`epmoe` binary is found (EPMOE_CLI, as ctest sets it, or build/cpu/tools/epmoe); the torch side
runs its bf16 recipe on the CPU where torch is importable."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from script_loader import ROOT, load

SCRIPT = ROOT / "tools" / "baselines" / "torch_gemm.py"


tg = load(SCRIPT, "torch_gemm")
plot = load(ROOT / "bench" / "plot.py", "bench_plot")

POINT_KEYS = {"impl", "model", "hidden", "intermediate", "experts", "model_experts", "top_k",
              "precision", "world", "rows_per_expert", "tokens_per_rank", "pairs", "status",
              "note", "check", "timed", "warmup", "rounds", "gemm_us_p50", "gemm_us_p90",
              "gemm_us_min", "latency_ms_p50", "latency_ms_p90", "flops", "weight_bytes",
              "eff_tflops", "eff_tbps", "hbm_floor_us", "compute_floor_us", "floor_us", "bound",
              "gemm_us"}


def problems(doc):
    """What is wrong with an epmoe-bench-gemm/1 document: [] when nothing."""
    out = []
    if doc.get("schema") != "epmoe-bench-gemm/1":
        out.append(f"schema {doc.get('schema')!r}")
    for key in ("tool", "executor", "gpus", "ceilings", "settings", "points"):
        if key not in doc:
            out.append(f"no {key}")
    for i, p in enumerate(doc.get("points", [])):
        missing = POINT_KEYS - set(p)
        if missing:
            out.append(f"point {i}: no {sorted(missing)}")
            continue
        e, r, k = p["experts"], p["rows_per_expert"], p["top_k"]
        if p["pairs"] != e * r:
            out.append(f"point {i}: pairs {p['pairs']} != E x R = {e * r}")
        if p["tokens_per_rank"] is not None and p["tokens_per_rank"] * k != e * r:
            out.append(f"point {i}: T x K = {p['tokens_per_rank'] * k} != E x R = {e * r}")
        if p["flops"] != pytest.approx(6.0 * e * r * p["intermediate"] * p["hidden"], rel=1e-5):
            out.append(f"point {i}: flops {p['flops']} != 2 R E (2 I H + H I)")
        if p["status"] == "ok":
            us = p["gemm_us_p50"]
            if not us or us <= 0 or len(p["gemm_us"]) != p["rounds"]:
                out.append(f"point {i}: ok without its rounds")
                continue
            if p["eff_tflops"] != pytest.approx(p["flops"] / (us * 1e-6) / 1e12, rel=1e-4):
                out.append(f"point {i}: eff_tflops is not flops / gemm_us_p50")
            if p["eff_tbps"] != pytest.approx(p["weight_bytes"] / (us * 1e-6) / 1e12, rel=1e-4):
                out.append(f"point {i}: eff_tbps is not weight_bytes / gemm_us_p50")
            if p["latency_ms_p50"] != pytest.approx(us * 1e-3, rel=1e-4):
                out.append(f"point {i}: latency_ms_p50 is not gemm_us_p50 in ms")
    return out


# ---- torch_gemm.py ----

def test_defaults_are_the_sizes_of_epmoe_bench_gemm_and_need_no_torch():
    p = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    a = tg.parse_args([])
    assert a.row_list == [1, 4, 16, 64, 256, 1024, 4096]
    assert a.precision_list == ["bf16", "fp8_rowwise", "fp8_block128"]
    assert [m["name"] for m in a.model_list] == ["qwen3-30b-a3b", "deepseek-v3", "gpt-oss-120b",
                                                 "mixtral-8x7b"]
    assert [m["experts"] for m in a.model_list] == [32, 32, 32, 8]  # --experts 32 caps them


@pytest.mark.parametrize("argv, says", [
    (["--rows", "0"], "--rows=0: every R must be >= 1"),
    (["--rows", "1,x"], "--rows=1,x: a comma list of integers"),
    (["--precisions", "bf16,fp4"], "--precisions=bf16,fp4: each must be one of"),
    (["--rounds", "0"], "--rounds=0"),
])
def test_bad_arguments_exit_2_naming_the_argument(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        tg.parse_args(argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_points_cover_precision_x_model_x_r_and_refuse_fp8_block128_off_128_blocks():
    a = tg.parse_args(["--models", "deepseek-v3,gpt-oss-120b", "--rows", "1,4096"])
    points = tg.make_points(a)
    assert len(points) == 3 * 2 * 2
    ds = [p for p in points if p["model"] == "deepseek-v3" and p["precision"] == "bf16"]
    assert [(p["rows_per_expert"], p["tokens_per_rank"], p["pairs"]) for p in ds] == \
        [(1, 4, 32), (4096, 16384, 32 * 4096)]
    assert ds[1]["flops"] == 6.0 * 32 * 4096 * 2048 * 7168
    refused = [p for p in points if p["model"] == "gpt-oss-120b" and p["precision"] ==
               "fp8_block128"]
    assert refused and all("whole 128-blocks (H=2880, I=2880)" in p["note"] for p in refused)
    assert problems({"schema": "epmoe-bench-gemm/1", "tool": "t", "executor": "e", "gpus": [],
                     "ceilings": {}, "settings": {}, "points": points}) == []


def test_finish_gives_tflops_tbps_and_the_larger_floor():
    p = tg.make_points(tg.parse_args(["--models", "deepseek-v3", "--rows", "1024",
                                      "--precisions", "bf16"]))[0]
    p["weight_bytes"] = 32 * 3 * 2048 * 7168 * 2.0
    tg.finish(p, [1000.0, 2000.0, 3000.0], {"hbm_gbps": 4000.0, "matmul_tflops": 800.0})
    assert p["gemm_us_p50"] == 2000.0 and p["gemm_us_min"] == 1000.0
    assert p["eff_tflops"] == pytest.approx(p["flops"] / 2e-3 / 1e12)
    assert p["eff_tbps"] == pytest.approx(p["weight_bytes"] / 2e-3 / 1e12)
    assert p["compute_floor_us"] == pytest.approx(p["flops"] / 800e12 * 1e6)
    assert p["bound"] == "mma" and p["floor_us"] == p["compute_floor_us"]


def test_dry_run_json_is_read_by_plot_and_every_point_is_skipped(tmp_path):
    out = tmp_path / "plan.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--models", "qwen3-30b-a3b",
                        "--rows", "1,256", "--json", str(out)], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    assert problems(doc) == []
    assert {q["status"] for q in doc["points"]} == {"skipped"}
    points, gemm, meta = plot.load([str(out)])
    assert points == [] and len(gemm) == 6
    assert "| qwen3-30b-a3b E32/128 | 256 | skipped | skipped | skipped |" in \
        plot.gemm_table(gemm, meta)


def test_the_checker_catches_a_wrong_pair_count_and_a_wrong_tflops():
    doc = {"schema": "epmoe-bench-gemm/1", "tool": "t", "executor": "e", "gpus": [],
           "ceilings": {}, "settings": {},
           "points": tg.make_points(tg.parse_args(["--models", "tiny", "--rows", "4",
                                                   "--precisions", "bf16"]))}
    doc["points"][0]["weight_bytes"] = 1000.0
    tg.finish(doc["points"][0], [10.0], {})
    assert problems(doc) == []
    bad = copy.deepcopy(doc)
    bad["points"][0]["pairs"] += 1
    assert any("pairs" in x for x in problems(bad))
    bad = copy.deepcopy(doc)
    bad["points"][0]["eff_tflops"] *= 2
    assert any("eff_tflops" in x for x in problems(bad))


def test_bf16_recipe_runs_on_the_cpu_and_passes_its_check(tmp_path):
    try:
        import torch  # noqa: F401
    except ImportError as e:
        pytest.skip(f"torch is not importable ({e})")
    out = tmp_path / "torch.json"
    assert tg.main(["--device", "cpu", "--models", "tiny", "--rows", "1,4", "--warmup", "0",
                    "--rounds", "2", "--precisions", "bf16,fp8_block128",
                    "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert problems(doc) == []
    bf16 = [p for p in doc["points"] if p["precision"] == "bf16"]
    assert [p["status"] for p in bf16] == ["ok", "ok"]
    assert all(p["check"].startswith("pass") for p in bf16)
    assert doc["settings"]["gemm"]["bf16"] in ("torch._grouped_mm", "per-expert matmul loop")
    fp8 = [p for p in doc["points"] if p["precision"] == "fp8_block128"]
    assert all(p["status"] == "skipped" and "128-blocks" in p["note"] for p in fp8)


# ---- `epmoe bench gemm` (C++) on the CPU executor ----

def epmoe_cli():
    for c in (os.environ.get("EPMOE_CLI"), ROOT / "build" / "cpu" / "tools" / "epmoe"):
        if c and Path(c).is_file():
            return str(c)
    pytest.skip("no epmoe binary (set EPMOE_CLI, or build build/cpu)")


def test_epmoe_bench_gemm_cpu_json_has_every_r_and_the_table_compares_with_torch(tmp_path):
    out = tmp_path / "gemm.json"
    p = subprocess.run([epmoe_cli(), "bench", "gemm", "--executor", "cpu", "--models", "tiny",
                        "--rows", "1,4,16", "--precisions", "bf16,nvfp4", "--math",
                        "exact,tensor_core", "--warmup", "1", "--rounds", "3", "--hbm-gbps",
                        "4000", "--matmul-tflops", "800", "--json", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "timing the whole forward" in p.stdout
    doc = json.loads(out.read_text())
    assert problems(doc) == []
    assert doc["tool"] == "epmoe bench gemm" and doc["settings"]["timed"].startswith("forward")
    assert doc["ceilings"]["hbm_gbps"] == 4000 and doc["ceilings"]["matmul_tflops"] == 800
    pts = doc["points"]
    assert len(pts) == 2 * 2 * 3
    assert {(q["precision"], q["math"]) for q in pts} == {
        ("bf16", "exact"), ("bf16", "tensor_core"), ("nvfp4", "exact"), ("nvfp4", "tensor_core")}
    assert all(q["status"] == "ok" and q["check"] == "pass" and q["timed"] == "forward"
               for q in pts)
    # tiny: E 16, K 4, H = I = 64; bf16 weights 2 B per parameter
    r16 = [q for q in pts if q["rows_per_expert"] == 16 and q["precision"] == "bf16"]
    assert all((q["tokens_per_rank"], q["pairs"]) == (64, 256) for q in r16)
    assert all(q["weight_bytes"] == 16 * 3 * 64 * 64 * 2 for q in r16)
    torch_doc = {"schema": "epmoe-bench-gemm/1", "tool": "torch_gemm", "executor": "x",
                 "gpus": [], "ceilings": {}, "settings": {},
                 "points": tg.make_points(tg.parse_args(["--models", "tiny", "--rows", "4",
                                                         "--precisions", "bf16"]))}
    torch_doc["points"][0]["weight_bytes"] = 1.0
    # The table compares epmoe's best bf16 config at R = 4 (either math) with torch's.
    best_bf16 = min(q["gemm_us_p50"] for q in pts
                    if q["rows_per_expert"] == 4 and q["precision"] == "bf16")
    tg.finish(torch_doc["points"][0], [2 * best_bf16], {})
    (tmp_path / "torch.json").write_text(json.dumps(torch_doc))
    points, gemm, meta = plot.load([str(out), str(tmp_path / "torch.json")])
    table = plot.gemm_table(gemm, meta)
    row = next(line for line in table.splitlines() if line.startswith("| tiny | 4 |"))
    assert row.split(" | ")[1:2] == ["4"] and row.endswith(" | 0.50x | - |")


def test_epmoe_bench_gemm_rejects_bad_arguments_naming_them():
    cli = epmoe_cli()
    for argv, says in ((["--rows", "0"], "--rows: 0 must be >= 1"),
                       (["--models", "tiny:6", "--rows", "1"], "K must divide E x R"),
                       (["--models", "deepseek-v3:4", "--rows", "1"], "at least K experts"),
                       (["--math", "fast"], "--math"),
                       (["--executor", "gpu"], "--executor=gpu")):
        p = subprocess.run([cli, "bench", "gemm", "--executor", "cpu", *argv]
                           if "--executor" not in argv else [cli, "bench", "gemm", *argv],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 2, (argv, p.stdout, p.stderr)
        assert says in p.stderr, (argv, p.stderr)


def test_round_plan_keeps_fits_shrinks_and_skips_as_epmoe_bench_does():
    a = tg.parse_args(["--max-point-s", "1"])  # warmup 2, rounds 10
    plan = tg.common.plan_rounds
    assert plan(a, None, 4.0) == (2, 10, None)
    assert plan(a, 10.0, 4.0) == (2, 10, None)  # 40 ms x 12 fits in 1 s
    assert plan(a, 50.0, 4.0) == (1, 4, None)  # 200 ms: 1 warm-up + 4 timed
    warmup, rounds, skip = plan(a, 200.0, 4.0, what="step")  # 800 ms x 4 > 1.5 s
    assert (warmup, rounds) == (1, 3) and skip.startswith("estimated 0.80 s per step exceeds")

"""tools/baselines/flashinfer_ep.py (FlashInfer's SM90 EP layer as a bench baseline) without a GPU:
its arguments, its shape rules, the JSON of --dry-run and how bench/plot.py tabulates it; under
torch (CPU, gloo) its numerics check and traffic count. The run itself needs Hopper GPUs and the
flashinfer wheels: EPMOE_TEST_FLASHINFER=1 runs a small one here when they are present."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from script_loader import ROOT, load

SCRIPT = ROOT / "tools" / "baselines" / "flashinfer_ep.py"
PLOT = ROOT / "bench" / "plot.py"


fe = load(SCRIPT, "flashinfer_ep")
te = load(ROOT / "tools" / "baselines" / "torch_ep.py", "torch_ep")
plot = load(PLOT, "bench_plot")


def need_gloo():
    """torch with torch.distributed's gloo backend, or a visible skip."""
    try:
        import torch
    except ImportError as e:  # missing, or a broken install
        pytest.skip(f"torch is not importable ({e})")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")


def run(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_help_and_defaults_need_no_torch():
    p = run("--help")
    assert p.returncode == 0, p.stderr
    assert "--prepare-only" in p.stdout and "--jit-cache" in p.stdout
    a = fe.parse_args([])
    assert a.models == "qwen3-30b-a3b,deepseek-v3"
    assert a.token_list == [0, 1, 16, 64, 128, 512, 2048, 8192]
    assert (a.warmup, a.rounds, a.seed, a.check_tokens) == (2, 10, 1, 16)
    assert a.jit_cache.endswith(os.path.join("build", "flashinfer-jit"))
    assert a.wheels.endswith(os.path.join(".gpu_deps", "wheels"))
    assert fe.parse_args(["--tokens", "64,0,64,8"]).token_list == [0, 8, 64]
    for bad in (["--tokens", "1,x"], ["--tokens", "-1"], ["--check-tokens", "-1"],
                ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            fe.parse_args(bad)


def test_shapes_are_torch_eps_and_the_backend_rules_hold():
    assert fe.MODELS is te.MODELS or fe.MODELS == te.MODELS
    models = {m["name"]: m for m in fe.parse_models(",".join(fe.MODELS), 0)}
    for name in ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b"):
        for world in (1, 2, 4, 8):
            assert fe.unsupported(models[name], world) == "", (name, world)
    assert "2880 is not a multiple of 128" in fe.unsupported(models["gpt-oss-120b"], 2)
    assert "64 is not a multiple of 128" in fe.unsupported(models["tiny"], 1)
    m = dict(models["qwen3-30b-a3b"], top_k=3)
    assert "top_k 3" in fe.unsupported(m, 1)
    m = dict(models["qwen3-30b-a3b"], intermediate=16384 + 128)
    assert "16384" in fe.unsupported(m, 1)
    m = dict(models["deepseek-v3"], experts=16)
    assert "do not split" in fe.unsupported(m, 3)
    assert "at most 32" in fe.unsupported(dict(models["deepseek-v3"], experts=256), 64)


def test_dry_run_writes_the_bench_schema_and_plot_reads_it(tmp_path):
    out = tmp_path / "plan.json"
    env = dict(os.environ, WORLD_SIZE="2")
    p = run("--dry-run", "--models", "qwen3-30b-a3b,gpt-oss-120b", "--tokens", "0,64",
            "--json", str(out), env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(out.read_text())
    assert doc["schema"] == "epmoe-bench/1" and doc["tool"] == "flashinfer_ep"
    assert doc["settings"]["kernel"] == "sm90_fp8_fp8_bf16_push_cuda"
    pts = doc["points"]
    # worlds 2 and 1 x 2 models x 2 T x eager and graph
    assert len(pts) == 16
    for q in pts:
        assert q["impl"] == "flashinfer_sm90" and q["baseline"] == "flashinfer_sm90"
        assert q["precision"] == "fp8_block128" and q["combine"] == "push_fp8"
        assert q["status"] == "skipped" and q["mode"] in ("eager", "cuda_graph")
        for key in ("latency_ms_p50", "latency_ms_p90", "tokens_per_rank", "world", "experts",
                    "model_experts", "eff_tflops", "check"):
            assert key in q
    assert {q["world"] for q in pts} == {1, 2}
    gpt = [q for q in pts if q["model"] == "gpt-oss-120b"]
    assert all("not a multiple of 128" in q["note"] for q in gpt)
    t = subprocess.run([sys.executable, str(PLOT), str(out), "--out", str(tmp_path), "--table",
                        "--no-plots"], capture_output=True, text=True, timeout=60)
    assert t.returncode == 0, t.stdout + t.stderr
    assert "| flashinfer | flashinfer graph |" in t.stdout


def point(impl, precision, combine, t, ms, world=2, graph=False, math=None):
    p = dict(impl=impl, model="qwen3-30b-a3b", experts=128, model_experts=128, world=world,
             tokens_per_rank=t, precision=precision, combine=combine, status="ok",
             latency_ms_p50=ms, latency_ms_p90=ms, graph=graph)
    if math:
        p["math"] = math
    return p


def test_plot_table_compares_epmoe_fp8_with_flashinfers_best_mode():
    pts = [point("torch_ep", "bf16", "a2a_per_slot", 8192, 4.0),
           point("flashinfer_sm90", "fp8_block128", "push_fp8", 8192, 1.97),
           point("flashinfer_sm90", "fp8_block128", "push_fp8", 8192, 1.87, graph=True),
           point("epmoe", "fp8_block128", "staged", 8192, 1.4, math="wgmma"),
           point("epmoe", "bf16", "staged", 8192, 2.0, math="wgmma")]
    meta = [("e.json", {"tool": "epmoe bench", "ceilings": {}, "gpus": []}),
            ("f.json", {"tool": "flashinfer_ep", "executor": "x", "settings": {"gemm": "y"}})]
    text = plot.table(pts, meta)
    head = next(line for line in text.splitlines() if line.startswith("| model"))
    assert head.startswith("| model | W | T | floor bf16 | torch_ep | flashinfer | "
                           "flashinfer graph | bf16 st wg | fp8_block128 st wg |"), head
    assert head.endswith("| best epmoe / torch | fp8_block128 epmoe / flashinfer |"), head
    row = next(line for line in text.splitlines() if "| 8192 |" in line)
    # best epmoe 1.4 / torch 4.0 (not FlashInfer's); epmoe fp8 1.4 / FlashInfer's graph 1.87
    assert row.endswith("| 0.35x | 0.75x |"), row
    # Without FlashInfer points the table has no FlashInfer column (the existing layout).
    text = plot.table([pts[0], pts[3]], meta[:1])
    assert "flashinfer" not in text
    assert plot.series_name(pts[2]) == "flashinfer_sm90 fp8_block128 graph"


def test_install_explains_a_missing_wheel_folder(tmp_path):
    p = run("--install", "--wheels", str(tmp_path / "none"), "--site", str(tmp_path / "site"))
    assert p.returncode == 2
    assert "pip download --no-deps flashinfer-python==0.6.18 apache-tvm-ffi==0.1.15.post2" in \
        p.stderr


def test_check_and_traffic_on_the_cpu_with_two_gloo_ranks():
    need_gloo()
    harness = Path(__file__).resolve().parent / "flashinfer_baseline_gloo.py"
    for world in (1, 2):
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc-per-node={world}", str(harness), str(SCRIPT.parent)],
                           capture_output=True, text=True, timeout=180)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        assert p.stdout.count(": OK") == world, p.stdout


def sweep(tmp_path, *args, fail="", timeout=240):
    """flashinfer_ep.py's whole sweep on two gloo ranks with a stand-in layer."""
    need_gloo()
    out = tmp_path / "sweep.json"
    harness = Path(__file__).resolve().parent / "flashinfer_baseline_sweep.py"
    env = dict(os.environ, FAKE_FAIL=fail)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node=2", str(harness), str(SCRIPT.parent), str(out), *args],
                       capture_output=True, text=True, timeout=timeout, env=env)
    return p, json.loads(out.read_text())


def test_the_sweep_times_eager_and_graph_and_checks_every_point(tmp_path):
    p, doc = sweep(tmp_path, "--models", "small,gpt-oss-120b", "--tokens", "0,1,16", "--rounds",
                   "3", "--warmup", "1")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert doc["complete"] is True and len(doc["prepare"]) == 2  # small at W = 2 and 1
    pts = doc["points"]
    assert len(pts) == 2 * 2 * 3 * 2  # worlds x models x T x (eager, graph)
    small = [q for q in pts if q["model"] == "small"]
    assert all(q["status"] == "ok" and len(q["latency_ms"]) == 3 for q in small), small
    for q in small:
        if q["tokens_per_rank"] > 0:
            assert q["check"].startswith("pass") and q["rel_l2"] < 2e-2, q
        assert q["pairs"] is not None and q["weight_bytes"] is not None
    assert {q["mode"] for q in small} == {"eager", "cuda_graph"}
    assert all(q["status"] == "skipped" for q in pts if q["model"] == "gpt-oss-120b")


def test_a_rank_that_fails_to_build_fails_the_shape_on_every_rank(tmp_path):
    # rank 1 cannot build the 8-expert layer at W = 2; the 4-expert one runs after it
    p, doc = sweep(tmp_path, "--models", "small,small:4", "--tokens", "0,1", "--rounds", "3",
                   "--warmup", "1", "--worlds", "2", "--no-graph", fail="build:8:1")
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    assert "stand-in build failure" in p.stderr
    e8 = [q for q in doc["points"] if q["experts"] == 8]
    e4 = [q for q in doc["points"] if q["experts"] == 4]
    assert e8 and all(q["status"] == "error" and q["note"].startswith("layer:") for q in e8)
    assert e4 and all(q["status"] == "ok" for q in e4)


def test_a_hung_peer_ends_the_run_with_its_json_written(tmp_path):
    p, doc = sweep(tmp_path, "--models", "small,small:4", "--tokens", "0,16", "--rounds", "3",
                   "--warmup", "1", "--worlds", "2", "--shape-timeout-s", "8", fail="hang:4:1")
    assert p.returncode != 0
    assert "--shape-timeout-s passed in small E4/8 W=2" in p.stderr
    assert doc["complete"] is False
    assert all(q["status"] == "ok" for q in doc["points"] if q["experts"] == 8)
    e4 = [q for q in doc["points"] if q["experts"] == 4]
    assert e4 and all(q["status"] == "error" and "timeout" in q["note"] for q in e4)


def hopper_and_flashinfer():
    if os.environ.get("EPMOE_TEST_FLASHINFER") != "1":
        return "EPMOE_TEST_FLASHINFER=1 not set (a GPU run that may JIT-compile for minutes)"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(0) != (9, 0):
        return "needs an SM90 (Hopper) GPU"
    return ""


@pytest.mark.skipif(bool(hopper_and_flashinfer()), reason=hopper_and_flashinfer() or "-")
def test_a_small_run_on_a_hopper_gpu(tmp_path):
    assert run("--install").returncode == 0
    out = tmp_path / "fi.json"
    p = run("--models", "qwen3-30b-a3b:8", "--tokens", "0,1,64", "--worlds", "1", "--warmup",
            "1", "--rounds", "3", "--json", str(out), timeout=1500)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    pts = json.loads(out.read_text())["points"]
    assert len(pts) == 6 and all(q["status"] == "ok" for q in pts), pts
    assert all(q["check"].startswith("pass") for q in pts if q["tokens_per_rank"] > 0), pts

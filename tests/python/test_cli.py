"""`python -m epmoe run` runs the same code as `epmoe run` (tools/run.cpp) and reports the same."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import epmoe


def run(*args: str, timeout: float = 300):
    env = dict(os.environ)
    package_parent = str(Path(epmoe.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "epmoe", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_run_passes_on_a_real_model_shape_with_an_idle_round():
    p = run("run", "--model", "qwen3-30b-a3b", "--experts", "8", "--ranks", "2", "--tokens", "3",
            "--rounds", "2", "--precision", "mxfp8")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "epmoe run: qwen3-30b-a3b  H=2048 I=768 E=8 K=8  precision=mxfp8" in p.stdout
    assert "PASS: qwen3-30b-a3b" in p.stdout


def test_run_checks_the_first_check_tokens_of_each_round():
    p = run("run", "--model", "qwen3-30b-a3b", "--experts", "8", "--ranks", "2", "--tokens", "5",
            "--rounds", "2", "--check-tokens", "2")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "check: the first 2 of 5 tokens per rank per round" in p.stdout
    assert "PASS: qwen3-30b-a3b" in p.stdout
    p = run("run", "--check-tokens", "-2")
    assert p.returncode == 2 and "--check-tokens=-2: must be >= 0, or -1 (auto)" in p.stderr


def test_run_with_zero_tokens_on_every_rank():
    p = run("run", "--model", "qwen3-30b-a3b", "--experts", "8", "--ranks", "4", "--tokens", "0",
            "--rounds", "3")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "PASS" in p.stdout


def test_run_on_the_cpu_checks_every_math_bit_for_bit():
    # The CPU executor computes exactly whatever the option, so its outputs are held to exact's
    # rule (bit-exact with staged combine), not to the looser one of the math they name.
    for math in ("tensor_core", "wgmma"):
        p = run("run", "--model", "qwen3-30b-a3b", "--experts", "8", "--ranks", "2", "--tokens",
                "2", "--rounds", "1", "--math", math)
        assert p.returncode == 0, p.stdout + p.stderr
        assert f"math={math}" in p.stdout
        assert "PASS: qwen3-30b-a3b" in p.stdout and "rule: staged: bit-exact" in p.stdout
    p = run("run", "--math", "fast")
    assert p.returncode == 2
    assert "--math=fast: must be one of exact, tensor_core" in p.stderr


def test_run_errors_exit_2_with_the_library_message():
    p = run("run", "--precision", "fp8")
    assert p.returncode == 2
    assert "epmoe: error (invalid_argument): precision=fp8: must be one of bf16, mxfp8, nvfp4, fp8_block128, mxfp4" in p.stderr
    p = run("run", "--model", "llama")
    assert p.returncode == 2 and "qwen3-30b-a3b" in p.stderr


def test_help_lists_the_options_of_the_tool():
    p = run("run", "--help")
    assert p.returncode == 0
    for option in ("--model", "--ranks", "--tokens", "--experts", "--precision", "--combine",
                   "--math", "--executor", "--rounds", "--check-tokens", "--seed", "--timeout-ms"):
        assert option in p.stdout


def test_type_stubs_ship_with_the_module():
    stub = Path(epmoe._epmoe.__file__).parent / "_epmoe.pyi"
    assert stub.is_file(), "python/CMakeLists.txt generates _epmoe.pyi next to the module"
    text = stub.read_text()
    for name in ("class LayerShape", "class _Layer", "def quantize_mxfp8", "class Health"):
        assert name in text
    assert (Path(epmoe.__file__).parent / "py.typed").is_file()

"""examples/torch_ep_layer.py runs on the CPU executor (where torch is installed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import epmoe

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torch_ep_layer.py"


def test_example_compiles():
    compile(EXAMPLE.read_text(), str(EXAMPLE), "exec")


def test_torch_example_serves_steps_with_idle_ranks():
    pytest.importorskip("torch")
    env = dict(os.environ)
    package_parent = str(Path(epmoe.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
    p = subprocess.run([sys.executable, str(EXAMPLE), "--cpu", "--ranks", "2", "--layers", "2",
                        "--precision", "mxfp8"], capture_output=True, text=True, timeout=600,
                       env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "T=  0" in p.stdout and "rank 1 step 5" in p.stdout
    assert "Error" not in p.stdout + p.stderr

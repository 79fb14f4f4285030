"""epmoe and torch share one libnccl.so.2 and one libcudart, whichever is imported first.

A module linked against another NCCL than torch's (the CUDA toolkit's instead of the
nvidia-nccl wheel's) made `import torch` after `import epmoe` fail with "undefined symbol:
ncclCommResume": one process loads one libnccl.so.2. With the toolkit's libcudart loaded first,
torch loaded a second copy of its own and aborted ("free(): invalid pointer"). The build links
the wheels' libraries with an rpath (python/CMakeLists.txt).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

import epmoe  # noqa: E402

pytestmark = pytest.mark.skipif(not epmoe.cuda_available,
                                reason="epmoe built without the CUDA executor (no NCCL)")

PROBE = """
import json, {first}, {second}, torch
torch.cuda.nccl.version()
import epmoe
def mapped(name):
    return sorted({{line.split()[-1] for line in open("/proc/self/maps") if name in line}})
print(json.dumps({{"maps": mapped("libnccl"), "cudart": mapped("libcudart"),
                  "linked": epmoe.nccl_library}}))
"""


@pytest.mark.parametrize("first,second", [("epmoe", "torch"), ("torch", "epmoe")])
def test_epmoe_and_torch_load_one_libnccl_in_either_import_order(first, second):
    env = dict(os.environ)
    package_parent = str(Path(epmoe.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
    p = subprocess.run([sys.executable, "-c", PROBE.format(first=first, second=second)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    info = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(info["maps"]) == 1, f"more than one libnccl in the process: {info['maps']}"
    assert len(info["cudart"]) <= 1, f"more than one libcudart in the process: {info['cudart']}"
    assert os.path.realpath(info["maps"][0]) == os.path.realpath(info["linked"]), (
        f"torch and epmoe use {info['maps'][0]}, but epmoe was built against "
        f"{info['linked']}: build with NCCL_ROOT at torch's nvidia-nccl wheel")

"""GPU tests of the Python package; tests/python/gpu/run_torchrun.sh runs them on a GPU machine.

Two ways to run them, and each test module says which one it needs:

* one process per GPU: ``torchrun --nproc-per-node=2 -m pytest tests/python/gpu``
  (test_gpu_torchrun.py: torch.distributed bootstrap, torch tensors, CUDA graphs, faults);
* one process driving both GPUs: ``pytest tests/python/gpu``
  (test_gpu_threads.py: nccl_communicators and NcclCommunicator with one thread per rank).

Without torch, a CUDA build of epmoe or two GPUs, the tests are skipped with the reason (CI).
A hung test (a collective that a failed peer never joins) is ended by a watchdog after
WATCHDOG_S seconds: its stack goes to $EPMOE_GPU_TEST_LOGS/watchdog_rank<R>.txt and the process
exits, which makes torchrun stop the other rank too.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # epmoe_ref (tests/python)
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on these machines

WATCHDOG_S = 60


@pytest.fixture(autouse=True)
def watchdog():
    logs = Path(os.environ.get("EPMOE_GPU_TEST_LOGS", tempfile.gettempdir()))
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / f"watchdog_rank{os.environ.get('RANK', 'single')}.txt", "w") as f:
        faulthandler.dump_traceback_later(WATCHDOG_S, exit=True, file=f)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()


def pytest_collection_modifyitems(config, items):
    """No GPU visible (CI): every test of this folder is skipped, visibly, before it imports or
    loads anything GPU-side. Checked through epmoe itself, since torch may be installed without a
    GPU, and a CPU machine's epmoe links the toolkit's NCCL, not torch's wheel."""
    here = Path(__file__).resolve().parent
    mine = [item for item in items if here in Path(str(item.fspath)).resolve().parents]
    if not mine:
        return
    import epmoe

    if epmoe.cuda_device_count() > 0:
        return
    skip = pytest.mark.skip(reason="no GPU visible: tests/python/gpu runs on a GPU machine "
                                   "(tests/python/gpu/run_torchrun.sh)")
    for item in mine:
        item.add_marker(skip)

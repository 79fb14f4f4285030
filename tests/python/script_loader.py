"""Loads a repository script that is not a package (tools/baselines/*.py, bench/plot.py) as a
module, with its own folder on sys.path while it imports (the baselines import their neighbours,
common.py among them), for the tests that call its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load(path, name):
    """The module of the script at `path`, imported under `name`."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(path.parent))
    return mod

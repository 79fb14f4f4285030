"""bench/ab_table.py without a GPU: the sides of an A/B run in base, alt1, ..., new order, each
turn's p50 per point, a point a side lacks or did not run, and the phases' means over turns."""

from __future__ import annotations

import json
import sys

import pytest
from script_loader import ROOT, load

ab = load(ROOT / "bench" / "ab_table.py", "ab_table")


def point(precision, tokens, p50, phases=None, status="ok"):
    p = {"model": "qwen3-30b-a3b", "world": 1, "precision": precision, "combine": "staged",
         "math": "wgmma", "tokens_per_rank": tokens, "latency_ms_p50": p50, "status": status,
         "floor_ms": 0.012 if tokens else None}
    if phases is not None:
        p["phases_us_p50"] = phases
    return p


def write(tmp_path, name, points):
    (tmp_path / name).write_text(json.dumps({"schema": "epmoe-bench/1", "points": points}))


def test_sides_in_order_with_each_turn_and_the_floor(tmp_path):
    write(tmp_path, "new_1.json", [point("mxfp8", 1, 0.0631)])
    write(tmp_path, "base_1.json", [point("mxfp8", 1, 0.0712)])
    write(tmp_path, "base_2.json", [point("mxfp8", 1, 0.0674)])
    write(tmp_path, "alt1_1.json", [point("mxfp8", 1, 0.064), point("mxfp8", 0, 0.036)])
    write(tmp_path, "notes.json", [])  # not a side's turn: ignored
    lines = ab.table(ab.load(tmp_path)).splitlines()
    assert lines[0].endswith("| base | alt1 | new | floor |")
    row = next(line for line in lines if "| mxfp8 | staged | wgmma | 1 |" in line)
    assert row.endswith("| 0.071 / 0.067 | 0.064 | 0.063 | 0.012 |")
    idle = next(line for line in lines if "| mxfp8 | staged | wgmma | 0 |" in line)
    assert idle.endswith("| – | 0.036 | – | – |")  # only alt1 ran it; an idle round has no floor
    assert not any("Per-phase" in line for line in lines)  # no --phases


def test_phases_are_the_mean_over_turns_and_a_failed_point_shows_its_status(tmp_path):
    phases = dict.fromkeys(ab.PHASES, 1.0)
    write(tmp_path, "base_1.json", [point("nvfp4", 8192, 3.0, dict(phases, fc2=740.0))])
    write(tmp_path, "base_2.json", [point("nvfp4", 8192, 3.1, dict(phases, fc2=760.0))])
    write(tmp_path, "new_1.json", [point("nvfp4", 8192, 0.0, phases, status="error")])
    text = ab.table(ab.load(tmp_path))
    assert "| 3.000 / 3.100 | error |" in text
    assert "| nvfp4 | 8192 | base | 1.0 | 1.0 | 1.0 | 1.0 | 750.0 | 1.0 | 1.0 |" in text


def test_a_directory_without_turns_is_named(tmp_path):
    sys.argv = ["ab_table.py", str(tmp_path)]
    with pytest.raises(SystemExit, match="no <side>_<turn>.json"):
        ab.main()

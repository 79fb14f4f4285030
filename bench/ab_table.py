#!/usr/bin/env python3
"""The sides of a bench/ab.sh run side by side: p50 per point and side, each turn's, then the
per-phase p50s (the mean over turns) where the run had --phases. Markdown, to read the call's
output at once and to paste into bench/RESULTS.md.

    bench/ab_table.py DIR     # DIR holds <side>_<turn>.json (base, alt1, ..., new)

Standard library only (it runs on the GPU machines too, at the end of bench/ab.sh).
"""
import glob
import json
import os
import re
import sys

PHASES = ["dispatch", "route", "wait_counts", "fc1", "fc2", "combine", "wait_done"]


def side_order(side):
    """base, alt1, alt2, ..., new."""
    if side == "base":
        return (0, 0)
    if side == "new":
        return (2, 0)
    match = re.fullmatch(r"alt(\d+)", side)
    return (1, int(match.group(1)) if match else 0)


def load(directory):
    """{side: {turn: [points]}} from DIR/<side>_<turn>.json."""
    runs = {}
    for path in glob.glob(os.path.join(directory, "*_*.json")):
        match = re.fullmatch(r"(base|alt\d+|new)_(\d+)\.json", os.path.basename(path))
        if not match:
            continue
        with open(path) as f:
            runs.setdefault(match.group(1), {})[int(match.group(2))] = json.load(f)["points"]
    return runs


def key(point):
    return (point["model"], point["world"], point["precision"], point["combine"],
            point["math"], point["tokens_per_rank"])


def table(runs):
    sides = sorted(runs, key=side_order)
    points = {}  # key -> side -> [points, by turn]
    for side in sides:
        for turn in sorted(runs[side]):
            for point in runs[side][turn]:
                points.setdefault(key(point), {}).setdefault(side, []).append(point)
    lines = ["| model | W | precision | combine | math | T | " + " | ".join(sides) +
             " | floor |", "|" + " --- |" * (7 + len(sides))]
    for k in sorted(points, key=lambda k: (k[0], k[1], k[2], k[3], k[4], k[5])):
        cells = []
        floor = None
        for side in sides:
            turns = points[k].get(side, [])
            cells.append(" / ".join(
                f"{p['latency_ms_p50']:.3f}" if p.get("status") == "ok" else p.get("status", "?")
                for p in turns) or "–")
            for p in turns:
                floor = floor or p.get("floor_ms")
        floor_text = f"{floor:.3f}" if floor else "–"
        lines.append("| " + " | ".join(str(x) for x in k) + " | " + " | ".join(cells) +
                     f" | {floor_text} |")
    phased = [(k, side, turns) for k in sorted(points) for side in sides
              for turns in [points[k].get(side, [])]
              if turns and all(p.get("phases_us_p50") for p in turns)]
    if phased:
        lines += ["", "Per-phase p50 µs, the mean over turns:", "",
                  "| precision | T | side | " + " | ".join(PHASES) + " |",
                  "|" + " --- |" * (3 + len(PHASES))]
        for k, side, turns in phased:
            means = [sum(p["phases_us_p50"].get(ph, 0.0) for p in turns) / len(turns)
                     for ph in PHASES]
            lines.append(f"| {k[2]} | {k[5]} | {side} | " +
                         " | ".join(f"{m:.1f}" for m in means) + " |")
    return "\n".join(lines)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    runs = load(sys.argv[1])
    if not runs:
        sys.exit(f"no <side>_<turn>.json in {sys.argv[1]}")
    print(table(runs))


if __name__ == "__main__":
    main()

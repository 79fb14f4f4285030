#!/usr/bin/env python3
"""Per-kernel GPU time from an Nsight Compute CSV (bench/kernel_times.sh writes one): each kernel a
round launches, in the order it first ran, with its launches, mean gpu__time_duration.sum and
µs per round, their sum, then the kernels that ran less often (layer creation). Rounds are
counted by a kernel that runs once a round (--per-round, the chain's dispatch_kernel). Names lose
their scopes and parameters (`void epmoe::cuda::(anonymous namespace)::route_kernel(...)` ->
route_kernel) and keep their template arguments.

  bench/kernel_times.py out/kernel_times.csv [--per-round dispatch_kernel]

ncu serializes kernels and replays each one, so the sum is the kernels' own time without launch
gaps or overlap (programmatic dependent launch included): the bench's p50 minus it is the gaps.
"""
import argparse
import csv
import re
import statistics
import sys

UNIT_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
           "second": 1e6, "s": 1e6}


def short_name(name):
    """A kernel's name without scopes or parameters; template arguments kept (they tell the packed
    GEMM's instantiations apart)."""
    # an anonymous namespace: "(anonymous namespace)::" or ncu's "<unnamed>::", whose "<" is
    # lost where ncu drops the scopes before it ("unnamed>::dispatch_kernel(RoundParams)")
    name = re.sub(r"\(anonymous namespace\)::|<?unnamed>::", "", name)
    if name.startswith("void "):
        name = name[len("void "):]
    depth = 0
    for i, ch in enumerate(name):  # the parameters: the first '(' outside template brackets
        depth += {"<": 1, ">": -1}.get(ch, 0)
        if ch == "(" and depth == 0:
            name = name[:i]
            break
    base, bracket, arguments = name.partition("<")
    return base.split("::")[-1] + bracket + re.sub(r"\w+::", "", arguments)


def read_times(path):
    """(kernel name, µs) per launch, in launch order."""
    times = []
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # ncu prints log lines first
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = row.get("Metric Unit", "").strip()
        if unit not in UNIT_US:
            sys.exit(f"kernel_times.py: unknown unit {unit!r} in {path}")
        value = float(row["Metric Value"].replace(",", ""))
        times.append((short_name(row["Kernel Name"]), value * UNIT_US[unit]))
    return times


def table(times, per_round):
    """The round's kernels (launched at least as often as `per_round`, which runs once a round),
    per round, then the others (layer creation, checks) by their launch counts."""
    by_kernel = {}
    for name, us in times:
        by_kernel.setdefault(name, []).append(us)
    matches = [name for name in by_kernel if name.split("<")[0] == per_round]
    if not matches:
        sys.exit(f"kernel_times.py: no kernel named {per_round} (--per-round)")
    rounds = len(by_kernel[matches[0]])
    lines = [f"{rounds} rounds (launches of {per_round}); per round:",
             f"  {'kernel':56} {'launches':>8} {'us each':>9} {'us':>9}"]
    total, others = 0.0, []
    for name, values in by_kernel.items():
        if len(values) < rounds:
            others.append((name, values))
            continue
        total += sum(values) / rounds
        lines.append(f"  {name[:56]:56} {len(values) / rounds:8.1f} "
                     f"{statistics.mean(values):9.1f} {sum(values) / rounds:9.1f}")
    lines.append(f"  {'every kernel of the round':56} {'':>8} {'':>9} {total:9.1f}")
    if others:
        lines.append("other kernels (launches, us each):")
        lines += [f"  {name[:56]:56} {len(values):8d} {statistics.mean(values):9.1f}"
                  for name, values in others]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", help="ncu --csv --metrics gpu__time_duration.sum output")
    parser.add_argument("--per-round", default="dispatch_kernel",
                        help="a kernel every round launches once (the chain's dispatch)")
    args = parser.parse_args()
    times = read_times(args.csv)
    if not times:
        sys.exit(f"kernel_times.py: no gpu__time_duration.sum rows in {args.csv}")
    print(table(times, args.per_round))


if __name__ == "__main__":
    main()

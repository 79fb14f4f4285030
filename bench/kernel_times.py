#!/usr/bin/env python3
"""Per-kernel GPU time from an Nsight Compute CSV (bench/kernel_times.sh writes one): each kernel a
round launches, in the order it first ran, with its launches, mean gpu__time_duration.sum and
µs per round, and, where the CSV has them, its DRAM traffic as GB/s over its own time
(dram__bytes_read.sum + dram__bytes_write.sum: a weight-streaming GEMM against HBM's bandwidth)
and its SM throughput (sm__throughput.avg.pct_of_peak_sustained_elapsed, % of peak); their sum,
then the kernels that ran less often (layer creation). Rounds are counted by a kernel that runs
once a round (--per-round, the chain's dispatch_kernel). Names lose their scopes and parameters
(`void epmoe::cuda::(anonymous namespace)::route_kernel(...)` -> route_kernel) and keep their
template arguments.

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
UNIT_BYTES = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6,
              "GB": 1e9}
TIME = "gpu__time_duration.sum"
DRAM = ("dram__bytes_read.sum", "dram__bytes_write.sum")
SM = "sm__throughput.avg.pct_of_peak_sustained_elapsed"


class Launch:
    """One kernel launch: its short name, µs, DRAM bytes and SM % of peak (None where the CSV has
    no such metric)."""

    def __init__(self, name):
        self.name, self.us, self.dram_bytes, self.sm_pct = name, None, None, None

    def __repr__(self):
        return f"Launch({self.name!r}, {self.us}, {self.dram_bytes}, {self.sm_pct})"


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


def _value(row, units, path):
    unit = row.get("Metric Unit", "").strip()
    if unit not in units:
        sys.exit(f"kernel_times.py: unknown unit {unit!r} of {row['Metric Name']} in {path}")
    return float(row["Metric Value"].replace(",", "")) * units[unit]


def read_launches(path):
    """Every launch with a gpu__time_duration.sum, in launch order (rows grouped by ncu's ID)."""
    launches = {}
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # ncu prints log lines first
    for row in csv.DictReader(lines):
        metric = row.get("Metric Name")
        if metric not in (TIME, SM) + DRAM:
            continue
        launch = launches.setdefault(row["ID"], Launch(short_name(row["Kernel Name"])))
        if metric == TIME:
            launch.us = _value(row, UNIT_US, path)
        elif metric == SM:
            launch.sm_pct = _value(row, {"%": 1.0}, path)
        else:
            launch.dram_bytes = (launch.dram_bytes or 0.0) + _value(row, UNIT_BYTES, path)
    return [launch for launch in launches.values() if launch.us is not None]


def read_times(path):
    """(kernel name, µs) per launch, in launch order."""
    return [(launch.name, launch.us) for launch in read_launches(path)]


def table(launches, per_round):
    """The round's kernels (launched at least as often as `per_round`, which runs once a round),
    per round, then the others (layer creation, checks) by their launch counts. `launches`:
    Launch objects, or (name, µs) pairs."""
    launches = [item if isinstance(item, Launch) else _pair(*item) for item in launches]
    by_kernel = {}
    for launch in launches:
        by_kernel.setdefault(launch.name, []).append(launch)
    matches = [name for name in by_kernel if name.split("<")[0] == per_round]
    if not matches:
        sys.exit(f"kernel_times.py: no kernel named {per_round} (--per-round)")
    rounds = len(by_kernel[matches[0]])
    lines = [f"{rounds} rounds (launches of {per_round}); per round:",
             f"  {'kernel':56} {'launches':>8} {'us each':>9} {'us':>9} {'DRAM GB/s':>10} "
             f"{'SM %':>6}"]
    total, others = 0.0, []
    for name, runs in by_kernel.items():
        if len(runs) < rounds:
            others.append((name, runs))
            continue
        us = [run.us for run in runs]
        total += sum(us) / rounds
        lines.append(f"  {name[:56]:56} {len(runs) / rounds:8.1f} {statistics.mean(us):9.1f} "
                     f"{sum(us) / rounds:9.1f} {_dram_gbps(runs):>10} {_sm(runs):>6}")
    lines.append(f"  {'every kernel of the round':56} {'':>8} {'':>9} {total:9.1f}")
    if others:
        lines.append("other kernels (launches, us each):")
        lines += [f"  {name[:56]:56} {len(runs):8d} {statistics.mean(r.us for r in runs):9.1f}"
                  for name, runs in others]
    return "\n".join(lines)


def _pair(name, us):
    launch = Launch(name)
    launch.us = us
    return launch


def _dram_gbps(runs):
    """DRAM bytes over the kernel's own time, GB/s ('-' without the metric)."""
    if any(run.dram_bytes is None for run in runs):
        return "-"
    return f"{sum(run.dram_bytes for run in runs) / sum(run.us for run in runs) / 1e3:.0f}"


def _sm(runs):
    if any(run.sm_pct is None for run in runs):
        return "-"
    return f"{statistics.mean(run.sm_pct for run in runs):.0f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", help="ncu --csv --metrics gpu__time_duration.sum[,...] output")
    parser.add_argument("--per-round", default="dispatch_kernel",
                        help="a kernel every round launches once (the chain's dispatch)")
    args = parser.parse_args()
    launches = read_launches(args.csv)
    if not launches:
        sys.exit(f"kernel_times.py: no gpu__time_duration.sum rows in {args.csv}")
    print(table(launches, args.per_round))


if __name__ == "__main__":
    main()

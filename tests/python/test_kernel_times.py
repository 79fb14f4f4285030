"""bench/kernel_times.py without a GPU: names shortened as ncu prints them (anonymous namespaces,
parameters; template arguments kept), units to µs, the round's kernels counted by the per-round
kernel and the others set apart, and the errors it names."""

from __future__ import annotations

import pytest
from script_loader import ROOT, load

kt = load(ROOT / "bench" / "kernel_times.py", "kernel_times")

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
          '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
          '"Metric Value"\n')
DISPATCH = "epmoe::cuda::(anonymous namespace)::dispatch_kernel(epmoe::cuda::RoundParams)"
GEMM = ("void epmoe::cuda::experts::wgmma::(anonymous namespace)::packed_gemm_kernel"
        "<(epmoe::Precision)1, 64, true>(epmoe::cuda::experts::wgmma::(anonymous namespace)::Args)")
PREPARE = "void epmoe::cuda::experts::prepare_kernel<float>(int)"


def csv_file(tmp_path, rows):
    """One gpu__time_duration.sum row per launch: (name, unit, value)."""
    return metrics_file(tmp_path, [(i, name, "gpu__time_duration.sum", unit, value)
                                   for i, (name, unit, value) in enumerate(rows)])


def metrics_file(tmp_path, rows):
    """Rows (launch ID, kernel name, metric, unit, value), as ncu --csv prints several metrics:
    one row per metric, the launch's ID on each."""
    lines = ["==PROF== Connected to process 1\n", HEADER]
    for launch, name, metric, unit, value in rows:
        lines.append(f'"{launch}","1","epmoe","h","{name}","1","7","(256, 1, 1)","(8, 1, 1)",'
                     f'"0","9.0","Command line profiler metrics","{metric}","{unit}","{value}"\n')
    path = tmp_path / "k.csv"
    path.write_text("".join(lines))
    return path


def test_names_lose_scopes_and_parameters_and_keep_template_arguments():
    assert kt.short_name(DISPATCH) == "dispatch_kernel"
    assert kt.short_name(GEMM) == "packed_gemm_kernel<(Precision)1, 64, true>"
    assert kt.short_name(PREPARE) == "prepare_kernel<float>"
    # as ncu 2025.3 printed them on an H200 (session 23): "<unnamed>" with its "<" cut off
    assert kt.short_name("unnamed>::dispatch_kernel(RoundParams)") == "dispatch_kernel"
    gemm = "void wgmma::<unnamed>::packed_gemm_kernel<1, 64, 0>(wgmma::<unnamed>::Args)"
    assert kt.short_name(gemm) == "packed_gemm_kernel<1, 64, 0>"


def test_units_become_microseconds(tmp_path):
    path = csv_file(tmp_path, [(DISPATCH, "nsecond", "5,120"), (GEMM, "msecond", "0.03"),
                               (PREPARE, "usecond", "7")])
    assert kt.read_times(path) == [("dispatch_kernel", pytest.approx(5.12)),
                                   ("packed_gemm_kernel<(Precision)1, 64, true>",
                                    pytest.approx(30.0)),
                                   ("prepare_kernel<float>", pytest.approx(7.0))]


def test_a_round_is_counted_by_its_per_round_kernel(tmp_path):
    rows = [(PREPARE, "usecond", "100")]
    for gemm_us in ("30", "34"):  # two rounds: dispatch once, the GEMM twice a round
        rows += [(DISPATCH, "usecond", "5"), (GEMM, "usecond", gemm_us),
                 (GEMM, "usecond", "10")]
    text = kt.table(kt.read_times(csv_file(tmp_path, rows)), "dispatch_kernel")
    lines = text.splitlines()
    assert lines[0].startswith("2 rounds")
    gemm = next(line for line in lines if "packed_gemm_kernel" in line).split()
    # launches per round, µs each, µs per round; no DRAM or SM metric in this CSV
    assert gemm[-5:] == ["2.0", "21.0", "42.0", "-", "-"]
    assert "every kernel of the round" in lines[-3] and lines[-3].split()[-1] == "47.0"
    assert lines[-2] == "other kernels (launches, us each):"
    assert lines[-1].split()[-2:] == ["1", "100.0"]


def test_dram_traffic_becomes_gbps_over_the_kernels_own_time_and_sm_percent_is_averaged(tmp_path):
    rows = []
    for r, (gemm_us, read_mb, sm) in enumerate([("10", "30", "40"), ("20", "60", "60")]):
        rows += [(3 * r, DISPATCH, "gpu__time_duration.sum", "usecond", "5"),
                 (3 * r, DISPATCH, "dram__bytes_read.sum", "Kbyte", "1"),
                 (3 * r, DISPATCH, "dram__bytes_write.sum", "byte", "0"),
                 (3 * r, DISPATCH, "sm__throughput.avg.pct_of_peak_sustained_elapsed", "%", "2"),
                 (3 * r + 1, GEMM, "gpu__time_duration.sum", "usecond", gemm_us),
                 (3 * r + 1, GEMM, "dram__bytes_read.sum", "Mbyte", read_mb),
                 (3 * r + 1, GEMM, "dram__bytes_write.sum", "Kbyte", "500"),
                 (3 * r + 1, GEMM, "sm__throughput.avg.pct_of_peak_sustained_elapsed", "%", sm),
                 # a metric the table does not read, and a launch of creation with time only
                 (3 * r + 1, GEMM, "sm__inst_executed.sum", "inst", "7"),
                 (3 * r + 2, PREPARE, "gpu__time_duration.sum", "usecond", "1")]
    launches = kt.read_launches(metrics_file(tmp_path, rows))
    assert [launch.name for launch in launches][:3] == [
        "dispatch_kernel", "packed_gemm_kernel<(Precision)1, 64, true>", "prepare_kernel<float>"]
    assert launches[1].dram_bytes == pytest.approx(30.5e6)
    lines = kt.table(launches, "dispatch_kernel").splitlines()
    assert lines[1].split()[-4:] == ["DRAM", "GB/s", "SM", "%"]
    gemm = next(line for line in lines if "packed_gemm_kernel" in line).split()
    # (30.5 + 60.5) MB over (10 + 20) µs = 3033 GB/s; SM % the mean of 40 and 60
    assert gemm[-5:] == ["1.0", "15.0", "15.0", "3033", "50"]
    dispatch = next(line for line in lines if line.strip().startswith("dispatch_kernel")).split()
    assert dispatch[-2:] == ["0", "2"]  # 1 KB in 5 µs: 0.2 GB/s


def test_errors_name_what_is_wrong(tmp_path):
    with pytest.raises(SystemExit, match="unknown unit 'furlong'"):
        kt.read_times(csv_file(tmp_path, [(DISPATCH, "furlong", "1")]))
    with pytest.raises(SystemExit, match="unknown unit 'bit' of dram__bytes_read.sum"):
        kt.read_launches(metrics_file(tmp_path, [(0, GEMM, "dram__bytes_read.sum", "bit", "8")]))
    times = kt.read_times(csv_file(tmp_path, [(GEMM, "usecond", "1")]))
    with pytest.raises(SystemExit, match="no kernel named dispatch_kernel"):
        kt.table(times, "dispatch_kernel")
